"""Ranks with no tokens, and inputs of any memory layout, in every op and every backward, on both host
transports: a hypothesis property over each rank's token count (0 included) and the layouts of ``x``,
``topk_idx``, ``topk_weights``, the home expert weights and the output gradient (contiguous, expanded with
stride 0, transposed, sliced; ``y.sum().backward()`` gives a stride-0 gradient, ``[0, H]`` with strides
``(0, 0)`` on an empty rank).  Values and every gradient against the dense float64 computation of one
process.  Run by tests/mp/test_mp_ep.py at 2 and 3 ranks (one launch with the other core cases); on CUDA
ranks by tests/gpu/test_mp_reliability_gpu.py (the torch transport with CUDA tensors, the nvlink backend).

Every rank draws the same examples (derandomized, no shrinking: the ranks must make the same calls).
"""
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import moonep
from tests.harness.mp import SkipCase
from ep_reference import dense_reference, expert, routing, run_slots

LAYOUTS = ("contiguous", "expanded", "transposed", "sliced")
WEIGHT_LAYOUTS = ("contiguous", "transposed", "sliced")  # expert weights have no rows to repeat
E_PER_RANK, K, H, F, S = 2, 2, 8, 4, 5


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of ``t`` (``[n, m, ...]``; rows all equal for ``"expanded"``) in another layout."""
    if layout == "expanded":
        return t[:1].expand(t.shape) if t.shape[0] else torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
    if layout == "transposed":
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "sliced":  # every other row and column of a larger tensor
        big = torch.zeros((2 * t.shape[0] + 1, 2 * t.shape[1] + 1, *t.shape[2:]), dtype=t.dtype, device=t.device)
        big[1::2, 1::2] = t
        return big[1::2, 1::2]
    return t.contiguous()


def _reference(X, I, W, w1, w2, apply_weights):
    """The dense computation of one process: ``sum_k w_k f_k(x)``, or ``sum_k f_k(w_k x)`` when the rows
    are weighted at dispatch."""
    if apply_weights == "combine":
        return dense_reference(X, I, W, w1, w2)
    y = torch.zeros_like(X)
    for k in range(I.shape[1]):
        for e in range(w1.shape[0]):
            sel = I[:, k] == e
            if sel.any():
                y[sel] = y[sel] + expert(W[sel, k, None] * X[sel], w1[e], w2[e])
    return y


def _rank_inputs(seed, r, s, E, repeat_rows):
    """Rank ``r``'s tokens, routing, weights and output gradient (rows repeated where a layout expands)."""
    g = torch.Generator().manual_seed(1000 * seed + r)
    n = 1 if repeat_rows else s
    x = torch.randn(n, H, generator=g, dtype=torch.float64).expand(s, H).contiguous()
    idx = routing("uniform", n, E, K, g).expand(s, K).contiguous()
    w = torch.rand(n, K, generator=g, dtype=torch.float64).expand(s, K).contiguous()
    gy = torch.randn(n, H, generator=g, dtype=torch.float64).expand(s, H).contiguous()
    return x, idx, w, gy


@st.composite
def _examples(draw, R):
    return dict(sizes=draw(st.lists(st.sampled_from([0, 0, 1, 3, S]), min_size=R, max_size=R)),
                layouts={k: draw(st.sampled_from(LAYOUTS)) for k in ("x", "idx", "w")}
                | {k: draw(st.sampled_from(WEIGHT_LAYOUTS)) for k in ("w1", "w2")},
                grad=draw(st.sampled_from(LAYOUTS + ("sum",))),
                apply_weights=draw(st.sampled_from(("combine", "dispatch"))), seed=draw(st.integers(0, 10**6)))


def _check(rt, ep, ex):
    R, r, E, lay = rt.world_size, rt.rank, ep.num_experts, ex["layouts"]
    on = dict(device=rt.device, dtype=ep.dtype)
    repeat = "expanded" in (lay["x"], lay["idx"], lay["w"], ex["grad"])
    parts = [_rank_inputs(ex["seed"], q, ex["sizes"][q], E, repeat) for q in range(R)]
    g = torch.Generator().manual_seed(ex["seed"])
    w1 = torch.randn(E, H, F, generator=g, dtype=torch.float64) / H ** 0.5
    w2 = torch.randn(E, F, H, generator=g, dtype=torch.float64) / F ** 0.5
    x, idx, w, gy = parts[r]
    home = slice(r * E // R, (r + 1) * E // R)
    xs = _laid_out(x.to(**on), lay["x"]).requires_grad_()
    ws = _laid_out(w.to(**on), lay["w"]).requires_grad_()
    w1s = _laid_out(w1[home].to(**on), lay["w1"]).requires_grad_()
    w2s = _laid_out(w2[home].to(**on), lay["w2"]).requires_grad_()
    h = ep.dispatch(xs, _laid_out(idx.to(rt.device), lay["idx"]), ws)
    out = run_slots(h.tokens, h.cu_seqlens.tolist(), ep.prefetch(h, w1s), ep.prefetch(h, w2s))
    y = ep.combine(out, h)
    if ex["grad"] == "sum":
        y.sum().backward()  # a stride-0 gradient
    else:
        y.backward(_laid_out(gy.to(**on), ex["grad"]))
    # the dense float64 computation of one process holding every rank's tokens
    X, I, W, GY = (torch.cat([p[i] for p in parts]) for i in range(4))
    leaves = [t.requires_grad_() for t in (X, W, w1, w2)]
    ref = _reference(X, I, W, w1, w2, ex["apply_weights"])
    grads = (torch.autograd.grad(ref, leaves, torch.ones_like(GY) if ex["grad"] == "sum" else GY, allow_unused=True)
             if ref.requires_grad else [None] * 4)  # no tokens anywhere: no graph
    gX, gW, g1, g2 = (torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))
    sl = slice(sum(ex["sizes"][:r]), sum(ex["sizes"][:r + 1]))
    tol = dict(atol=1e-12, rtol=0) if ep.dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    for name, got, want in (("y", y.detach(), ref.detach()[sl]), ("x.grad", xs.grad, gX[sl]),
                            ("topk_weights.grad", ws.grad, gW[sl]), ("w1.grad", w1s.grad, g1[home]),
                            ("w2.grad", w2s.grad, g2[home])):
        torch.testing.assert_close(got.double().cpu(), want, **tol, msg=lambda m: f"rank {r} {name} {ex}: {m}")


def _property(rt, transport):
    """The property on ``transport``: both host transports on CPU ranks (float64, exact); on CUDA ranks the
    torch transport (float64) and the nvlink backend (float32: its kernels move no float64)."""
    if transport not in (("mpi", "torch") if rt.device.type == "cpu" else ("torch", "nvlink")):
        raise SkipCase(f"the {transport} transport does not move {rt.device.type} tensors")
    if rt.world_size == 1:
        return
    dtype = torch.float32 if transport == "nvlink" else torch.float64
    eps = {a: moonep.ExpertParallel(rt, num_experts=E_PER_RANK * rt.world_size, topk=K, hidden=H, max_tokens=S,
                                    dtype=dtype, transport=transport, apply_weights=a)
           for a in ("combine", "dispatch")}

    @settings(max_examples=60, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_examples(rt.world_size))
    def run(ex):
        _check(rt, eps[ex["apply_weights"]], ex)

    run()
    for ep in eps.values():
        ep.close()


def case_empty_ranks_any_layout_mpi(rt):
    _property(rt, "mpi")


def case_empty_ranks_any_layout_torch(rt):
    _property(rt, "torch")


def case_empty_ranks_any_layout_nvlink(rt):
    _property(rt, "nvlink")
