"""ExpertParallel on the NVLink transport (CUDA IPC kernels) against the host path, on every rank.

Run by tests/gpu/test_mp_ep_gpu.py with MOONEP_TEST_DEVICE=cuda; every case skips on CPU ranks.
The host reference is the same ExpertParallel API on CPU tensors over MPI: the plan and layout are
identical, copies are exact and the combine sums are done in the same order with separately rounded
fp32 multiplies and adds, so fp32 results must be bitwise equal.

The host-side helpers (``ep_reference``, ``cases_ep``) live in tests/mp/, shared with the CPU cases.
"""
import sys
from pathlib import Path

import torch

from moonep import MoonepError

import moonep
from moonep.config import parse_fused
from tests.harness.cuda_graph import capture
from moonep.ep import ExpertParallel
from tests.harness.mp import SkipCase

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mp"))  # tests/mp: ep_reference, cases_ep
from ep_reference import make_problem, my_slice  # noqa: E402

H_CASES = [(64, 3), (6, 2)]  # (hidden, topk): 16-byte rows and odd 24-byte rows (4-byte path, scalar combine)


def _need_cuda(rt):
    if rt.device.type != "cuda":
        raise SkipCase("needs CUDA ranks (MOONEP_TEST_DEVICE=cuda)")


def _sizes(R, S, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [int(v) for v in torch.randint(0, S + 1, (R,), generator=g)]
    if R > 1:
        sizes[R // 2] = 0  # a rank with no tokens
    sizes[-1] = S
    return sizes


def _problem(rt, E, K, H, S, kind="zipf", seed=0, mask=0.0, dtype=torch.float32):
    R = rt.world_size
    sizes = _sizes(R, S, seed)
    x, idx, w, w1, w2, gy = make_problem(seed, R, E, K, H, 4, sizes, kind, mask, torch.float64)
    sl = my_slice(rt, sizes)
    return x[sl].to(dtype), idx[sl], w[sl].float(), gy[sl].to(dtype), sizes


def _pair(rt, **kw):
    """The same configuration on the host path (CPU, MPI) and on the NVLink transport (this GPU)."""
    host = ExpertParallel(rt, device="cpu", transport="mpi", **kw)
    nv = ExpertParallel(rt, transport="nvlink", **kw)
    assert nv.transport_name == "nvlink"
    return host, nv


def _eq(a, b, what):
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs()
        raise AssertionError(f"{what}: not bitwise equal (max |diff| {float(diff.max())}, "
                             f"{int((a != b).sum())} of {a.numel()} differ)")


def _expert_out(tokens, seed):
    """Some fixed non-linear function of the rows, computed on CPU (so both paths see the same values)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(tokens.shape[1], tokens.shape[1], generator=g)
    return torch.tanh(tokens.detach().cpu().float() @ W)


def _run_both(rt, host, nv, x, idx, w, gy, seed, zero_copy_inplace=False):
    """Forward and backward on both paths; returns dicts of results (CPU tensors)."""
    dev = rt.device
    res = {}
    for name, ep, d in (("host", host, torch.device("cpu")), ("nv", nv, dev)):
        out = {}
        # dispatch forward + backward (its backward is a combine without weights)
        xl = x.clone().to(d).requires_grad_()
        wl = w.clone().to(d).requires_grad_()
        h = ep.dispatch(xl, idx.to(d), wl)
        out["tokens"], out["weights"] = h.tokens.detach().cpu(), h.weights.detach().cpu()
        out["cu"], out["slots"] = h.cu_seqlens.cpu(), h.slot_experts.cpu()
        out["rows"] = int(h.num_rows)
        g = torch.Generator().manual_seed(seed + 1)
        G1 = torch.randn(h.tokens.shape, generator=g).to(h.tokens.dtype).to(d)
        G2 = torch.randn(h.weights.shape, generator=g).to(h.weights.dtype).to(d)
        ((h.tokens * G1).sum() + (h.weights * G2).sum()).backward()
        out["dx"], out["dw"] = xl.grad.cpu(), wl.grad.cpu()
        # combine forward + backward (its backward is a dispatch of dy)
        wl2 = w.clone().to(d).requires_grad_()
        h2 = ep.dispatch(x.to(d), idx.to(d), wl2)
        eo = _expert_out(h2.tokens, seed).to(h2.tokens.dtype).to(d).requires_grad_()
        y = ep.combine(eo, h2)
        (y * gy.to(d)).sum().backward()
        out["y"], out["d_out"], out["dw2"] = y.detach().cpu(), eo.grad.cpu(), wl2.grad.cpu()
        # inference (no autograd; zero-copy views on the NVLink path)
        with torch.no_grad():
            h3 = ep.dispatch(x.to(d), idx.to(d), w.to(d))
            eo3 = _expert_out(h3.tokens, seed).to(h3.tokens.dtype).to(d)
            if zero_copy_inplace and name == "nv":
                h3.tokens.copy_(eo3)  # expert output written in place into the receive buffer
                eo3 = h3.tokens
            out["y_infer"] = ep.combine(eo3, h3).cpu()
        res[name] = out
    return res


# The weight gradient of combine is a length-H dot product per row; the CPU's vectorised sum and the
# GPU's warp reduction add in different orders, so it is compared to fp32 rounding, not bitwise.
DOT_PRODUCTS = {"dw2"}


def _compare(res, ctx):
    for key in res["host"]:
        a, b = res["host"][key], res["nv"][key]
        if isinstance(a, int):
            assert a == b, (ctx, key, a, b)
        elif key in DOT_PRODUCTS:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m: f"{ctx} {key}: {m}")
        else:
            _eq(b, a, f"{ctx} {key}")


def case_fp32_bitwise_equal_to_host_path(rt):
    _need_cuda(rt)
    R = rt.world_size
    for (H, K), kind, align, mask in [(H_CASES[0], "zipf", 1, 0.0), (H_CASES[1], "hot", 1, 0.0),
                                      (H_CASES[0], "cold_rank", 4, 0.25), (H_CASES[1], "uniform", 2, 0.1)]:
        E, S = 4 * R, 40
        K = min(K, E)
        x, idx, w, gy, _ = _problem(rt, E, K, H, S, kind, seed=H + K, mask=mask)
        host, nv = _pair(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32, align=align)
        with nv:
            res = _run_both(rt, host, nv, x, idx, w, gy, seed=7, zero_copy_inplace=True)
            nv.synchronize()
        _compare(res, f"rank {rt.rank} H={H} K={K} kind={kind} align={align} mask={mask}")


def case_many_tokens_several_blocks(rt):
    """Enough tokens that every kernel runs many warps and blocks (grid-stride loops, done counters)."""
    _need_cuda(rt)
    R = rt.world_size
    E, K, H, S = 8 * R, 4, 256, 700
    x, idx, w, gy, _ = _problem(rt, E, K, H, S, "zipf", seed=3)
    host, nv = _pair(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32,
                      tuning=moonep.Tuning(num_sms=3))
    with nv:
        res = _run_both(rt, host, nv, x, idx, w, gy, seed=9)
    _compare(res, f"rank {rt.rank} many tokens")


def case_repeat_determinism_and_zero_copy_vs_copy(rt):
    _need_cuda(rt)
    R = rt.world_size
    E, K, H, S = 4 * R, 4, 64, 50
    x, idx, w, _, _ = _problem(rt, E, K, H, S, "zipf", seed=5)
    d = rt.device
    kw = dict(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32, transport="nvlink")
    outs = []
    with ExpertParallel(rt, zero_copy=True, **kw) as zc, ExpertParallel(rt, zero_copy=False, **kw) as cp:
        for rep in range(3):
            for ep in (zc, cp):
                with torch.no_grad():
                    h = ep.dispatch(x.to(d), idx.to(d), w.to(d))
                    tokens, weights = h.tokens.clone(), h.weights.clone()
                    eo = torch.tanh(h.tokens * 1.5)
                    if ep is zc:
                        h.tokens.copy_(eo)  # in place: combine reads the receive buffer itself
                        eo = h.tokens
                    y = ep.combine(eo, h)
                outs.append((tokens.cpu(), weights.cpu(), y.cpu()))
                # the zero-copy views really are the receive buffer; the copying mode's are not
                assert (ep._backend.recv.data_ptr() == h.tokens.data_ptr()) == (ep is zc)
        zc.synchronize()
        cp.synchronize()
    for i, o in enumerate(outs[1:], 1):
        for a, b, what in zip(outs[0], o, ("tokens", "weights", "y")):
            _eq(b, a, f"rank {rt.rank} run {i} {what}")


def case_no_host_sync(rt):
    """plan + dispatch + prefetch + experts + combine (+ backward) under sync-debug 'error'."""
    _need_cuda(rt)
    R, d = rt.world_size, rt.device
    E, K, H, S, F = 4 * R, 4, 32, 64, 16
    x, idx, w, gy, _ = _problem(rt, E, K, H, S, "hot", seed=11)
    g = torch.Generator().manual_seed(1)
    W1 = (torch.randn(E // R, H, F, generator=g) / H ** 0.5).to(d).requires_grad_()
    W2 = (torch.randn(E // R, F, H, generator=g) / F ** 0.5).to(d).requires_grad_()
    x, idx, w, gy = x.to(d), idx.to(d), w.to(d), gy.to(d)
    with ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32,
                               transport="nvlink") as ep:
        def step(train):
            xl = x.clone().requires_grad_(train)
            h = ep.dispatch(xl, idx, w)
            w1s, w2s = ep.prefetch(h, W1), ep.prefetch(h, W2)
            y = ep.combine(slot_experts_no_sync(h.tokens, h.cu_seqlens, w1s, w2s), h)
            if train:
                (y * gy).sum().backward()
            return y

        step(True)  # warm-up: compiles, allocates the lazy gradient and pool buffers
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for train in (False, True, True):
                step(train)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ep.synchronize()


def slot_experts_no_sync(tokens, cu, w1s, w2s):
    """Per-slot MLP without reading cu_seqlens on the host: each row gathers its slot's weights."""
    cap = tokens.shape[0]
    rows = torch.arange(cap, device=tokens.device, dtype=cu.dtype)
    slot = torch.searchsorted(cu[1:].contiguous(), rows, right=True)  # == the slot count past the last slot
    W1 = torch.cat([w1s, w1s.new_zeros(1, *w1s.shape[1:])])[slot]
    W2 = torch.cat([w2s, w2s.new_zeros(1, *w2s.shape[1:])])[slot]
    return torch.bmm(torch.tanh(torch.bmm(tokens[:, None, :], W1)), W2)[:, 0, :]


def case_cuda_graph_replay_with_new_routing(rt):
    _need_cuda(rt)
    R, d = rt.world_size, rt.device
    E, K, H, S, F = 4 * R, 4, 32, 48, 8
    g = torch.Generator().manual_seed(2)
    W1 = (torch.randn(E // R, H, F, generator=g) / H ** 0.5).to(d)
    W2 = (torch.randn(E // R, F, H, generator=g) / F ** 0.5).to(d)
    problems = [_problem(rt, E, K, H, S, kind, seed=20 + i) for i, kind in enumerate(["zipf", "hot", "uniform", "cold_rank"])]
    s = S  # static token count for the graph: pad every problem to S rows (masked choices)

    def padded(p):
        x, idx, w = p[0], p[1], p[2]
        n = x.shape[0]
        xp = torch.zeros(s, H)
        xp[:n] = x
        ip = torch.full((s, K), -1, dtype=torch.int64)
        ip[:n] = idx
        wp = torch.zeros(s, K)
        wp[:n] = w
        return xp.to(d), ip.to(d), wp.to(d)

    with ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32,
                               transport="nvlink", zero_copy=True) as ep:
        sx, sidx, sw = padded(problems[0])

        def step():
            h = ep.dispatch(sx, sidx, sw)
            out = slot_experts_no_sync(h.tokens, h.cu_seqlens, ep.prefetch(h, W1), ep.prefetch(h, W2))
            return ep.combine(out, h)

        with torch.no_grad():
            graph, y_static = capture(step)
            for p in problems + problems[::-1]:
                xp, ip, wp = padded(p)
                sx.copy_(xp)
                sidx.copy_(ip)
                sw.copy_(wp)
                graph.replay()
                got = y_static.clone()
                want = step()  # eager, same inputs
                _eq(got, want, f"rank {rt.rank} graph replay")
        ep.synchronize()


def case_bf16_tokens_close_to_reference(rt):
    _need_cuda(rt)
    R, d = rt.world_size, rt.device
    E, K, H, S = 4 * R, 4, 128, 64
    x, idx, w, _, _ = _problem(rt, E, K, H, S, "zipf", seed=13, dtype=torch.float64)
    with ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.bfloat16,
                               transport="nvlink") as ep, torch.no_grad():
        xb = x.to(torch.bfloat16)
        h = ep.dispatch(xb.to(d), idx.to(d), w.to(d))
        assert h.tokens.dtype == torch.bfloat16
        y = ep.combine(h.tokens, h)  # identity experts: y = sum_k w_k x
        ref = w.double().sum(1, keepdim=True) * xb.double()
        torch.testing.assert_close(y.double().cpu(), ref, atol=3e-2, rtol=2e-2)
        assert y.dtype == torch.bfloat16
        # bf16 against the host path: the fp32 accumulation order is the same, so still bitwise
        host = ExpertParallel(rt, device="cpu", transport="mpi", num_experts=E, topk=K, hidden=H,
                                     max_tokens=S, dtype=torch.bfloat16)
        hh = host.dispatch(xb, idx, w)
        _eq(h.tokens, hh.tokens, f"rank {rt.rank} bf16 tokens")
        _eq(y, host.combine(hh.tokens, hh), f"rank {rt.rank} bf16 y")
        ep.synchronize()


def case_prefetch_and_reduce_grad_equal_host(rt):
    _need_cuda(rt)
    R, d = rt.world_size, rt.device
    E, K, H, S = 4 * R, 4, 16, 40
    x, idx, w, _, _ = _problem(rt, E, K, H, S, "hot", seed=17)
    host, nv = _pair(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32)
    g = torch.Generator().manual_seed(rt.rank)
    with nv, torch.no_grad():
        hh, hn = host.dispatch(x, idx, w), nv.dispatch(x.to(d), idx.to(d), w.to(d))
        _eq(hn.plan.replica_experts, hh.plan.replica_experts, "plan")
        # rows of 15 elements go element by element, rows of 32 (a multiple of 16 bytes) in 16-byte words
        for shape in ((3, 5), (4, 8)):
            Wl = torch.randn(E // R, *shape, generator=g)
            G = torch.randn(2 * (E // R), *shape, generator=g)
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                ctx = f"rank {rt.rank} {dt} {shape}"
                _eq(nv.prefetch(hn, Wl.to(dt).to(d)), host.prefetch(hh, Wl.to(dt)), f"{ctx} prefetch")
                _eq(nv.reduce_grad(hn, G.to(dt).to(d)), host.reduce_grad(hh, G.to(dt)), f"{ctx} reduce_grad")
        nv.synchronize()


def case_bad_values_reported_later_on_every_rank(rt):
    """Bad ids are caught on device: every rank raises, at the first call that sees the flag.

    The bad rank raises ValueError naming itself. A rank whose peer stopped early (it raised at dispatch
    and skipped combine) gets MoonepError once the short timeout expires: an error, never a hang.
    """
    _need_cuda(rt)
    R, d = rt.world_size, rt.device
    E, K, H, S = 2 * R, 2, 8, 6
    bad_rank = R - 1
    x = torch.randn(S, H, device=d)
    idx = torch.stack([torch.arange(K)] * S).to(d)
    w = torch.rand(S, K, device=d)
    with ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32,
                        transport="nvlink", timeout=5) as ep:
        bad_idx = idx.clone().fill_(E) if rt.rank == bad_rank else idx
        errors = []
        with torch.no_grad():
            try:
                h = ep.dispatch(x, bad_idx, w)
            except ValueError as exc:
                errors.append(exc)
            else:
                try:
                    ep.combine(h.tokens, h)
                except ValueError as exc:
                    errors.append(exc)
            try:
                ep.synchronize()
            except (ValueError, MoonepError) as exc:
                errors.append(exc)
        assert errors, f"rank {rt.rank}: bad topk_idx on rank {bad_rank} was not reported"
        for exc in errors:
            assert isinstance(exc, MoonepError) or (f"on rank {bad_rank}" in str(exc) and "topk_idx" in str(exc)), \
                repr(exc)


def case_repeated_expert_in_a_token_caught_for_any_topk(rt):
    """A token naming one expert twice is caught on device on every rank, whatever K: K dividing 32 takes
    the warp-match check (a token's choices in adjacent lanes), other K reload the token's earlier choices.
    The same routing without the repeat passes."""
    _need_cuda(rt)
    R, d = rt.world_size, rt.device
    H, S = 8, 40
    for K in (3, 6, 8):
        E = 2 * K * R
        g = torch.Generator().manual_seed(K)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)])
        bad = idx.clone()
        if rt.rank == R - 1:
            bad[11, K - 1] = bad[11, 0]  # token 11: choices 33..35 at K=3 (across a warp), 88..95 at K=8
        x, w = torch.randn(S, H, device=d), torch.rand(S, K, device=d)
        with ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32,
                            transport="nvlink", timeout=5) as ep, torch.no_grad():
            h = ep.dispatch(x, idx.to(d), w)
            ep.combine(h.tokens, h)
            ep.synchronize()  # the clean routing: no error
            errors = []
            try:
                ep.dispatch(x, bad.to(d), w)
            except ValueError as exc:
                errors.append(exc)
            try:
                ep.synchronize()  # local: every rank's dispatch kernels ran, the flag is visible
            except ValueError as exc:
                errors.append(exc)
            assert len(errors) == 1, f"rank {rt.rank} K={K}: {errors!r}"
            msg = str(errors[0])
            assert "distinct experts per token" in msg and f"on rank {R - 1}" in msg, msg


def case_fused_kernels_equal_unfused(rt):
    """The fused kernels (validation+gather, chunk-pipelined dispatch, fused combine) against the earlier
    two-kernel path (Tuning(fused=())): every output and gradient bitwise equal, in fp32 and bf16,
    zero-copy and copying, for several chunk counts and NVLink block budgets, odd rows included."""
    _need_cuda(rt)
    R, d = rt.world_size, rt.device
    for (H, K), dtype, nch, sms, spec in [((256, 4), torch.float32, 4, 3, "1"), ((64, 3), torch.bfloat16, 8, 1, "1"),
                                          ((6, 2), torch.float32, 3, 2, "1"), ((2048, 4), torch.bfloat16, 1, 5, "1"),
                                          ((256, 4), torch.float32, 4, 3, "route,dispatch"),
                                          ((2048, 4), torch.bfloat16, 2, 5, "route,dispatch"),
                                          ((6, 2), torch.bfloat16, 3, 2, "route,dispatch")]:
        E, S = 8 * R, 300
        x, idx, w, gy, _ = _problem(rt, E, K, H, S, "zipf", seed=H + K, mask=0.1, dtype=dtype)
        kw = dict(num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype, transport="nvlink")
        res = {}
        # "route,dispatch": the two-kernel combine walks the fused dispatch's tokfirst list
        fused = moonep.Tuning(num_sms=sms, chunks=nch, fused=parse_fused(spec))
        with ExpertParallel(rt, tuning=fused, **kw) as fz, \
                ExpertParallel(rt, tuning=moonep.Tuning(num_sms=sms, fused=()), **kw) as uf:
            for name, ep in (("fused", fz), ("unfused", uf)):
                out = {}
                xl = x.clone().to(d).requires_grad_()
                wl = w.clone().to(d).requires_grad_()
                h = ep.dispatch(xl, idx.to(d), wl)
                out["tokens"], out["weights"] = h.tokens.detach().clone(), h.weights.detach().clone()
                eo = torch.tanh(h.tokens.float() * 1.5).to(dtype)
                y = ep.combine(eo, h)
                (y.float() * gy.to(d).float()).sum().backward()
                out["y"], out["dx"], out["dw"] = y.detach(), xl.grad, wl.grad
                with torch.no_grad():
                    h2 = ep.dispatch(x.to(d), idx.to(d), w.to(d))
                    out["tokens_zc"] = h2.tokens.clone()
                    eo2 = torch.tanh(h2.tokens.float()).to(dtype)
                    h2.tokens.copy_(eo2)
                    out["y_zc"] = ep.combine(h2.tokens, h2)
                    out["rows"] = torch.tensor(int(h2.num_rows))
                res[name] = {k: v.cpu() for k, v in out.items()}
            fz.synchronize()
            uf.synchronize()
        for key in res["fused"]:
            _eq(res["fused"][key], res["unfused"][key], f"rank {rt.rank} H={H} {dtype} nch={nch} sms={sms} {spec} {key}")
