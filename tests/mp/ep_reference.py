"""Shared pieces of the multi-rank ExpertParallel tests: routings, tiny MLP experts, the dense reference."""
import torch

import moonep


def routing(kind: str, s: int, E: int, K: int, gen: torch.Generator, R: int = 1) -> torch.Tensor:
    """int64 [s, K] distinct experts per token, from a named family (adversarial ones included)."""
    if kind == "uniform":
        logits = torch.zeros(s, E)
    elif kind == "zipf":
        logits = (-1.5 * torch.log(torch.arange(1, E + 1, dtype=torch.float64))).float().expand(s, E).clone()
    elif kind == "hot":  # one expert in every token, the rest tiny
        logits = torch.full((s, E), -20.0)
        logits[:, 0] = 20.0
    elif kind == "cold_rank":  # rank 0's home experts receive nothing
        epn = E // R
        logits = torch.zeros(s, E)
        logits[:, :epn] = -float("inf") if E - epn >= K else 0.0
    else:
        raise ValueError(kind)
    g = -torch.log(-torch.log(torch.rand(s, E, generator=gen).clamp(1e-9, 1 - 1e-9)))  # Gumbel top-k
    return (logits + g).topk(K, dim=1).indices.to(torch.int64)


def make_problem(seed, R, E, K, H, F, sizes, kind, mask_frac=0.0, dtype=torch.float64):
    """Global problem identical on every rank: tokens, routing, weights and expert MLP weights."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(sizes)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dtype)
    idx = routing(kind, T, E, K, gen, R)
    if mask_frac:
        idx[torch.rand(T, K, generator=gen) < mask_frac] = -1
    w = torch.rand(T, K, generator=gen, dtype=torch.float64).to(dtype)
    w1 = (torch.randn(E, H, F, generator=gen, dtype=torch.float64) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, F, H, generator=gen, dtype=torch.float64) / F ** 0.5).to(dtype)
    gy = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dtype)
    return x, idx, w, w1, w2, gy


def expert(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


def dense_reference(x, idx, w, w1, w2):
    """The obvious loop: y_i = sum_k w_ik * f_{e_ik}(x_i), masked choices skipped."""
    y = torch.zeros_like(x)
    for k in range(idx.shape[1]):
        for e in range(w1.shape[0]):
            sel = idx[:, k] == e
            if sel.any():
                y[sel] = y[sel] + w[sel, k, None] * expert(x[sel], w1[e], w2[e])
    return y


def run_slots(tokens, cu, w1s, w2s):
    """Grouped expert compute over the 2*epn slots of one rank; unused rows give zero."""
    outs = [expert(tokens[cu[j]:cu[j + 1]], w1s[j], w2s[j]) for j in range(len(cu) - 1)]
    outs.append(tokens.new_zeros(tokens.shape[0] - int(cu[-1]), tokens.shape[1]))
    return torch.cat(outs)


def moe_step(ep, x, idx, w, w1_local, w2_local):
    """One expert-parallel MoE forward: dispatch, prefetch replicas, experts per slot, combine."""
    h = ep.dispatch(x, idx, w)
    w1s, w2s = ep.prefetch(h, w1_local), ep.prefetch(h, w2_local)
    out = run_slots(h.tokens, h.cu_seqlens.tolist(), w1s, w2s)
    return ep.combine(out, h), h


def my_slice(rt, sizes):
    start = sum(sizes[:rt.rank])
    return slice(start, start + sizes[rt.rank])


def expect_error(fn, match, exc=ValueError):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"message {str(e)!r} lacks {match!r}"
        return str(e)
    raise AssertionError(f"expected {exc.__name__} containing {match!r}")


__all__ = ["moonep"]
