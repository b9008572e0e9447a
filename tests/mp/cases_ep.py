"""ExpertParallel end to end on every rank, against a single-process dense float64 reference."""
import itertools
import os

import torch

import moonep
from ep_reference import (dense_reference, expect_error, make_problem, moe_step, my_slice)

KINDS = ["uniform", "zipf", "hot", "cold_rank"]


def transports(rt):
    """The host-driven transports that apply on this device (MPI moves CPU tensors only).

    MOONEP_TEST_TRANSPORT overrides the list (the GPU run uses "torch": the NCCL path)."""
    if os.environ.get("MOONEP_TEST_TRANSPORT"):
        return os.environ["MOONEP_TEST_TRANSPORT"].split(",")
    return ["mpi", "torch"] if rt.device.type == "cpu" else ["torch"]


def _sizes(R, base, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [int(v) for v in torch.randint(0, base + 1, (R,), generator=g)]
    sizes[R // 2] = 0 if R > 1 else sizes[0]  # some rank passes no token at all (MoonEP cannot)
    sizes[-1] = base  # someone is at capacity
    return sizes


def _check_forward_backward(rt, E, K, H, kind, transport, dtype=torch.float64, mask=0.0, seed=0,
                            apply_weights="combine", align=1):
    R, F, S = rt.world_size, 5, 12
    sizes = _sizes(R, S, seed)
    x, idx, w, w1, w2, gy = make_problem(seed, R, E, K, H, F, sizes, kind, mask, dtype)
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype,
                               transport=transport, apply_weights=apply_weights, align=align)
    sl, home = my_slice(rt, sizes), slice(rt.rank * E // R, (rt.rank + 1) * E // R)
    dev = rt.device
    xl = x[sl].to(dev).requires_grad_()
    wl = w[sl].to(dev).requires_grad_()
    w1l, w2l = w1[home].to(dev).requires_grad_(), w2[home].to(dev).requires_grad_()
    y, h = moe_step(ep, xl, idx[sl].to(dev), wl, w1l, w2l)
    (y * gy[sl].to(dev)).sum().backward()

    # Reference: the whole global batch in one process, float64.
    rx, rw = x.double().clone().requires_grad_(), w.double().clone().requires_grad_()
    r1, r2 = w1.double().clone().requires_grad_(), w2.double().clone().requires_grad_()
    ry = dense_reference(rx, idx, rw, r1, r2)
    (ry * gy.double()).sum().backward()

    tol = dict(atol=1e-12, rtol=0) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    ctx = f"rank {rt.rank} E={E} K={K} kind={kind} transport={transport} dtype={dtype}"
    def close(got, want, what):
        torch.testing.assert_close(got.double().cpu(), want.detach(), **tol, msg=lambda m: f"{what} {ctx}: {m}")

    close(y, ry[sl], "y")
    close(xl.grad, rx.grad[sl], "dx")
    close(wl.grad, rw.grad[sl], "dtopk_weights")
    close(w1l.grad, r1.grad[home], "dW1")
    close(w2l.grad, r2.grad[home], "dW2")
    if kind == "hot" and R > 1:  # a hot expert must be replicated, so prefetch/reduce_grad are exercised
        assert bool((h.plan.replica_experts >= 0).any()), ctx

    # Balance: the planner's guarantee, on every rank, with static shapes.
    T = int((idx >= 0).sum())
    assert h.num_rows == T // R + (1 if rt.rank < T % R else 0), (ctx, h.num_rows, T)
    assert h.tokens.shape == (ep.capacity, H)
    assert int(h.cu_seqlens[-1]) >= h.num_rows
    return y.detach().cpu(), xl.grad.cpu(), wl.grad.cpu(), w1l.grad.cpu()


def case_forward_backward_float64(rt):
    R = rt.world_size
    for (epn, K), kind, transport in itertools.product([(1, 1), (2, 2), (4, 3)], KINDS, transports(rt)):
        E = epn * R
        if K > E:
            continue
        _check_forward_backward(rt, E, K, 6, kind, transport, seed=epn * 10 + K)


def case_forward_backward_float32(rt):
    for kind in KINDS:
        _check_forward_backward(rt, 2 * rt.world_size, min(2, 2 * rt.world_size), 8, kind, transports(rt)[0],
                                dtype=torch.float32, seed=3)


def case_masked_choices_and_alignment(rt):
    E = 4 * rt.world_size
    _check_forward_backward(rt, E, 3, 6, "zipf", transports(rt)[0], mask=0.3, seed=5, align=4)


def case_apply_weights_before_experts(rt):
    # With weights applied at dispatch, y = sum_k f(w_k x): check against that reference directly.
    R, E, K, H, S = rt.world_size, 2 * rt.world_size, 2, 5, 10
    sizes = _sizes(R, S, 4)
    x, idx, w, w1, w2, _ = make_problem(4, R, E, K, H, 4, sizes, "zipf")
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float64,
                               apply_weights="dispatch", transport=transports(rt)[0])
    sl, home = my_slice(rt, sizes), slice(rt.rank * E // R, (rt.rank + 1) * E // R)
    dev = rt.device
    y, _ = moe_step(ep, x[sl].to(dev), idx[sl].to(dev), w[sl].to(dev), w1[home].to(dev), w2[home].to(dev))
    y = y.cpu()
    ref = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for k in range(K):
            e = int(idx[i, k])
            ref[i] += torch.tanh((w[i, k] * x[i]) @ w1[e]) @ w2[e]
    torch.testing.assert_close(y, ref[sl], atol=1e-12, rtol=0)


def case_transports_bitwise_equal_and_deterministic(rt):
    outs = {}
    for transport in transports(rt):
        for rep in range(2):
            outs[transport, rep] = _check_forward_backward(rt, 4 * rt.world_size, 4, 6, "zipf", transport,
                                                           dtype=torch.float32, seed=11)
    base = outs[transports(rt)[0], 0]
    for key, got in outs.items():
        for a, b in zip(base, got):
            assert torch.equal(a, b), f"rank {rt.rank}: {key} differs bitwise from the first run"


def case_bfloat16_tokens(rt):
    R, E, K, H, S = rt.world_size, 2 * rt.world_size, 2, 16, 8
    sizes = [S] * R
    x, idx, w, w1, w2, _ = make_problem(2, R, E, K, H, 8, sizes, "zipf", dtype=torch.float64)
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.bfloat16,
                               transport=transports(rt)[0])
    sl, dev = my_slice(rt, sizes), rt.device
    h = ep.dispatch(x[sl].bfloat16().to(dev), idx[sl].to(dev), w[sl].float().to(dev))
    y = ep.combine(h.tokens, h)  # identity experts: y = sum_k w_k x, accumulated in fp32
    ref = (w[sl].sum(1, keepdim=True) * x[sl].bfloat16().double())
    torch.testing.assert_close(y.double().cpu(), ref, atol=2e-2, rtol=2e-2)
    assert y.dtype == torch.bfloat16


# -- bad input: every rank raises, nobody hangs ---------------------------------------------------------
def _ep(rt, **kw):
    args = dict(num_experts=2 * rt.world_size, topk=2, hidden=4, max_tokens=6, dtype=torch.float32,
                transport=transports(rt)[0])
    args.update(kw)
    return moonep.ExpertParallel(rt, **args)


def case_bad_inputs_fail_on_every_rank(rt):
    ep = _ep(rt)
    E, bad_rank = ep.num_experts, rt.world_size - 1
    dev = rt.device
    good = (torch.randn(6, 4, device=dev), torch.stack([torch.arange(2, device=dev)] * 6),
            torch.rand(6, 2, device=dev))

    def call(mutate, match):
        x, i, w = (t.clone() for t in good)
        if rt.rank == bad_rank:
            x, i, w = mutate(x, i, w)
        msg = expect_error(lambda: ep.dispatch(x, i, w), match)
        if rt.rank != bad_rank:
            assert f"(on rank {bad_rank})" in msg, msg

    call(lambda x, i, w: (x, i.fill_(E), w), "topk_idx: expected expert ids in [-1")
    call(lambda x, i, w: (x, i.fill_(-2), w), "topk_idx: expected expert ids in [-1")
    call(lambda x, i, w: (x, i.fill_(0), w), "topk_idx: expected distinct experts")
    call(lambda x, i, w: (x, i, w.fill_(float("nan"))), "topk_weights: expected finite")
    call(lambda x, i, w: (x, i, w.fill_(float("inf"))), "topk_weights: expected finite")
    call(lambda x, i, w: (torch.randn(7, 4, device=dev), torch.zeros(7, 2, dtype=torch.int64, device=dev),
                          torch.rand(7, 2, device=dev)), "x: expected at most max_tokens=6 rows")
    call(lambda x, i, w: (x.double(), i, w), "x: expected dtype")
    call(lambda x, i, w: (x, i.float(), w), "topk_idx: expected dtype")
    call(lambda x, i, w: (x, i[:, :1], w), "topk_idx: expected shape")
    call(lambda x, i, w: (x[:, :3], i, w), "x: expected shape [s, 4]")
    call(lambda x, i, w: (x, i, w.int()), "topk_weights: expected dtype")
    call(lambda x, i, w: ("not a tensor", i, w), "x: expected a torch.Tensor")
    call(lambda x, i, w: (x.to("meta"), i, w), "x: expected device")
    # After all those refusals the same object still works.
    h = ep.dispatch(*good)
    assert h.tokens.shape == (ep.capacity, 4)


def case_config_mismatch_fails_on_every_rank(rt):
    if rt.world_size == 1:
        return
    expect_error(lambda: _ep(rt, hidden=4 + (rt.rank == 1)), "hidden: expected the same value on every rank")
    expect_error(lambda: _ep(rt, num_experts=2 * rt.world_size + 1), "num_experts: expected a multiple")
    expect_error(lambda: _ep(rt, topk=0 if rt.rank == 0 else 2), "topk: expected a positive int")


def case_global_token_count_contract(rt):
    ep = _ep(rt)
    x, i, w = (t.to(rt.device) for t in (torch.randn(3, 4), torch.stack([torch.arange(2)] * 3), torch.rand(3, 2)))
    ep.dispatch(x, i, w, num_global_tokens=3 * rt.world_size)
    expect_error(lambda: ep.dispatch(x, i, w, num_global_tokens=3 * rt.world_size + 1), "num_global_tokens")


# -- prefetch into a persistent pool (out=) -------------------------------------------------------------
class _WriteLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the byte range of every tensor an aten op writes (mutable and out= arguments)."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema.arguments
        values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
        for a, v in zip(schema, values):
            if isinstance(v, torch.Tensor) and a.alias_info is not None and a.alias_info.is_write and v.numel():
                span = 1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride()))
                self.writes.append((str(func), v.data_ptr(), v.data_ptr() + span * v.element_size()))
        return func(*args, **kwargs)


def _hot_steps(rt, E, K, H, S, steps, seed):
    """Per step a routing whose hot expert moves (a new expert permutation), so the replicas change."""
    R, out = rt.world_size, []
    for t in range(steps):
        sizes = [S] * R
        x, idx, w, _, _, _ = make_problem(seed + t, R, E, K, H, 2, sizes, "hot", dtype=torch.float32)
        perm = torch.randperm(E, generator=torch.Generator().manual_seed(seed + 100 + t))
        sl = my_slice(rt, sizes)
        out.append((x[sl], perm[idx[sl]], w[sl]))
    return out


def case_prefetch_out_was_removed(rt):
    """prefetch(out=) is gone: refused on every rank, naming out and the way that replaced it; the instance
    still works after it."""
    R, dev = rt.world_size, rt.device
    E, K, H, S = 2 * R, 2, 4, 6
    ep = _ep(rt, num_experts=E, topk=K, hidden=H, max_tokens=S)
    h = ep.dispatch(torch.randn(S, H, device=dev), torch.stack([torch.arange(K)] * S).to(dev), torch.rand(S, K, device=dev))
    wl = torch.randn(ep.epn, 3, device=dev)
    pool = torch.zeros(2 * ep.epn, 3, device=dev)
    expect_error(lambda: ep.prefetch(h, wl, out=pool), "out: expected None (prefetch(out=...) was removed")
    expect_error(lambda: ep.prefetch(h, wl, out="pool"), "ReplicaPool")
    assert torch.equal(ep.prefetch(h, wl)[:ep.epn], wl)
