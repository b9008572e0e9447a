"""FP8 dispatch (ExpertParallel(dispatch_dtype=torch.float8_e4m3fn)) on every rank, against the dense float64
reference (CPU here; tests/gpu/test_mp_fp8_gpu.py runs the same cases on CUDA ranks, NVLink backend).

Tolerances, derived from e4m3's precision (moonep/quant.py):
* Quantisation: e4m3 keeps 3 mantissa bits, so each element moves by at most half an ulp in its normal
  range and by 2**-10 * scale below it: |x_hat - x| <= 2**-4 * |x| + 2**-10 * scale (+ fp32 rounding,
  2**-22 * |x|).  Checked element by element on the received rows.
* Forward against the reference at x: tanh is 1-Lipschitz, so for y = sum_k w_k tanh(x W1_e) W2_e
  |y_hat - y| <= sum_k |w_k| (|dx| @ |W1_e|) @ |W2_e|, with |dx| the bound above: a per-element bound,
  computed in float64, plus the fp32 slack of the data path.
* The data path itself is exact on the quantised values: forward and every gradient (straight through:
  the gradients are those of the dense function at x_hat) equal the float64 reference evaluated at x_hat
  up to fp32 rounding (2e-5 relative to the reference's magnitude; the bf16 dx of bf16 tokens: K row
  gradients, K partials and the sum each rounded to bf16, 2**-9 * (2K + 2)).
"""
import os

import torch

import moonep
from ep_reference import expect_error, make_problem, my_slice
from moonep.fp8 import dequantize_rows
from moonep.quant import dequantize_fp8, quantize_fp8

FP8 = torch.float8_e4m3fn
KINDS = ["uniform", "hot", "zipf"]


def transports(rt):
    if os.environ.get("MOONEP_TEST_TRANSPORT"):
        return os.environ["MOONEP_TEST_TRANSPORT"].split(",")
    return ["mpi", "torch"] if rt.device.type == "cpu" else ["nvlink", "torch"]


def _sizes(R, S):
    sizes = [S - (r % 3) for r in range(R)]
    if R > 1:
        sizes[R // 2] = 0  # a rank without tokens
    return sizes


def _expert(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


def _dense(x, idx, w, w1, w2):
    y = torch.zeros_like(x)
    for k in range(idx.shape[1]):
        for e in range(w1.shape[0]):
            sel = idx[:, k] == e
            if sel.any():
                y[sel] = y[sel] + w[sel, k, None] * _expert(x[sel], w1[e], w2[e])
    return y


def _forward_bound(x, xq_scales, idx, w, w1, w2):
    """The per-element bound on |y(x_hat) - y(x)| of the module docstring (float64)."""
    s, H = x.shape
    sc = xq_scales.double().repeat_interleave(128, dim=1)
    dx = 2.0 ** -4 * x.abs() + 2.0 ** -10 * sc + 2.0 ** -22 * x.abs()
    b = torch.zeros_like(x)
    for k in range(idx.shape[1]):
        for e in range(w1.shape[0]):
            sel = idx[:, k] == e
            if sel.any():
                b[sel] += w[sel, k, None].abs() * ((dx[sel] @ w1[e].abs()) @ w2[e].abs())
    return b


def _close(name, got, ref, rel, ctx):
    ref = ref.double()
    err = (got.double().cpu() - ref).abs().max().item() if ref.numel() else 0.0
    scale = max(ref.abs().max().item() if ref.numel() else 0.0, 1e-30)
    assert err <= rel * scale, f"{name} {ctx}: max error {err:.3g} > {rel:g} x {scale:.3g}"


def _check_nvlink_rows(ep, h, q, sc, sizes, S):
    """NVLink: every row holding a token is, byte for byte, that token's wire row (codes and scale bits of
    quantize_fp8, quantised by the sender while it sends, or sent pre-packed), padding zero; other rows zero."""
    from moonep import fp8

    st = ep._step_of(h).routing
    wire = fp8.wire_rows(h.tokens).cpu()
    rf = st.row_first.long().cpu()
    used = rf >= 0
    src = st.src.long().cpu()[rf[used]]  # src_rank * S + source token
    first = torch.tensor([sum(sizes[:r]) for r in range(len(sizes))], dtype=torch.long)
    g = first[src // S] + src % S
    want = fp8.pack_pair(q[g], sc[g])
    assert torch.equal(wire[used], want), "fp8 rows differ from the wire rows of their tokens"
    assert not bool(wire[~used].any()), "rows without a token are not zero"


def _run(rt, E, K, H, kind, transport, dtype, mask=0.0, seed=0, pre=False, pow2=False, S=12, F=6):
    R, dev = rt.world_size, rt.device
    sizes = _sizes(R, S)
    x, idx, w, w1, w2, gy = make_problem(seed, R, E, K, H, F, sizes, kind, mask, torch.float64)
    x = x.to(dtype).double()  # representable in the token dtype
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype, transport=transport,
                               dispatch_dtype=FP8, pow2_scales=pow2)
    sl, home = my_slice(rt, sizes), slice(rt.rank * E // R, (rt.rank + 1) * E // R)
    xl = x[sl].to(dtype).to(dev).requires_grad_(not pre)
    wl = w[sl].float().to(dev).requires_grad_()
    w1l, w2l = w1[home].float().to(dev).requires_grad_(), w2[home].float().to(dev).requires_grad_()
    xin = quantize_fp8(xl.detach(), pow2_scales=pow2, check_finite=False) if pre else xl
    h = ep.dispatch(xin, idx[sl].to(dev), wl)
    assert h.tokens.dtype == FP8 and tuple(h.tokens.shape) == (ep.capacity, H)
    assert h.scales.dtype == torch.float32 and tuple(h.scales.shape) == (ep.capacity, H // 128)
    rows = dequantize_rows(h, dtype=torch.float32)
    w1s, w2s = ep.prefetch(h, w1l), ep.prefetch(h, w2l)
    cu = h.cu_seqlens.tolist()
    out = torch.cat([_expert(rows[cu[j]:cu[j + 1]], w1s[j], w2s[j]) for j in range(len(cu) - 1)]
                    + [rows.new_zeros(rows.shape[0] - cu[-1], H)])
    y = ep.combine(out, h)
    (y * gy[sl].float().to(dev)).sum().backward()
    ctx = f"rank {rt.rank} E={E} K={K} kind={kind} transport={transport} dtype={dtype} pre={pre} pow2={pow2}"

    # the quantised global input, as every rank quantised its own tokens
    q, sc = quantize_fp8(x.to(dtype), pow2_scales=pow2)
    xh = dequantize_fp8(q, sc, dtype=torch.float32).double()
    if pow2:
        assert bool((torch.frexp(sc).mantissa == 0.5).all()), ctx
    if transport == "nvlink":
        _check_nvlink_rows(ep, h, q, sc, sizes, S)
    # element bound of quantisation on the received rows (unused rows: zero codes and scales)
    n = int(cu[-1])
    assert torch.equal(h.scales[n:].cpu(), torch.zeros_like(h.scales[n:].cpu())), ctx
    assert bool((((xh - x).abs()) <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * sc.double().repeat_interleave(128, 1)
                 + 2.0 ** -22 * x.abs()).all()), ctx

    # exact path: reference at x_hat (forward, gradients straight through)
    rx, rw = xh.clone().requires_grad_(), w.clone().requires_grad_()
    r1, r2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ry = _dense(rx, idx, rw, r1, r2)
    (ry * gy).sum().backward()
    _close("y", y, ry[sl].detach(), 2e-5, ctx)
    _close("dtopk_weights", wl.grad, rw.grad[sl], 2e-5, ctx)
    _close("dW1", w1l.grad, r1.grad[home], 2e-5, ctx)
    _close("dW2", w2l.grad, r2.grad[home], 2e-5, ctx)
    if not pre:
        assert xl.grad.dtype == dtype, ctx
        # bf16: each of the K row gradients is rounded to bf16 (the token dtype, 2**-9 relative), then each
        # rank's partial sum and the final sum again: (K + K + 1) roundings of terms bounded by the scale
        _close("dx", xl.grad, rx.grad[sl], 2e-5 if dtype == torch.float32 else 2.0 ** -9 * (2 * K + 2), ctx)
    # against the reference at x: the derived bound
    y0 = _dense(x, idx, w, w1, w2)
    bound = _forward_bound(x, sc, idx, w, w1, w2)[sl] + 2e-5 * max(y0.abs().max().item(), 1e-30)
    y0 = y0[sl]
    assert bool(((y.detach().double().cpu() - y0).abs() <= bound).all()), f"y vs reference at x {ctx}"
    if kind == "hot" and R > 1:  # skewed routing: replicas are exercised
        assert bool((h.plan.replica_experts >= 0).any()), ctx
    ep.close()
    return h


def case_fp8_forward_backward(rt):
    R = rt.world_size
    for (epn, K), kind in [((1, 1), "uniform"), ((2, 2), "hot"), ((4, 3), "zipf"), ((2, 2), "uniform")]:
        E = epn * R
        if K > E:
            continue
        for transport in transports(rt):
            _run(rt, E, K, 256, kind, transport, torch.float32, seed=epn * 10 + K)


def case_fp8_bf16_tokens_masked_choices(rt):
    _run(rt, 4 * rt.world_size, 3, 128, "zipf", transports(rt)[0], torch.bfloat16, mask=0.3, seed=5)


def case_fp8_prequantised_pair(rt):
    for pow2 in (False, True):
        _run(rt, 2 * rt.world_size, 2, 256, "hot", transports(rt)[0], torch.bfloat16, seed=7, pre=True, pow2=pow2)


def case_fp8_pow2_scales(rt):
    _run(rt, 2 * rt.world_size, 2, 128, "uniform", transports(rt)[0], torch.float32, seed=8, pow2=True)


def case_fp8_slot_matmul_accepts_h(rt):
    R, dev, E, K, H, S = rt.world_size, rt.device, 2 * rt.world_size, 2, 128, 8
    sizes = _sizes(R, S)
    x, idx, w, w1, _, _ = make_problem(9, R, E, K, H, 4, sizes, "zipf", 0.0, torch.float64)
    sl = my_slice(rt, sizes)
    with moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.float32,
                               transport=transports(rt)[0], dispatch_dtype=FP8) as ep:
        xl = x[sl].float().to(dev).requires_grad_()
        h = ep.dispatch(xl, idx[sl].to(dev), w[sl].float().to(dev))
        ws = torch.randn(2 * ep.epn, H, 4, generator=torch.Generator().manual_seed(1)).to(dev)
        a = moonep.slot_matmul(h, h.cu_seqlens, ws)
        b = moonep.slot_matmul((h.tokens, h.scales), h.cu_seqlens, ws)
        c = moonep.slot_matmul(dequantize_rows(h).detach(), h.cu_seqlens, ws)
        assert torch.equal(a.detach(), c) and torch.equal(b, c)
        a.sum().backward()  # straight through: the gradient reaches x
        assert xl.grad is not None and xl.grad.shape == xl.shape


def _finish(ep):
    """Errors the NVLink kernels record on device surface at the next call: wait for them here."""
    ep.synchronize()


def case_fp8_bad_inputs_refused_on_every_rank(rt):
    R, dev, E, K, S = rt.world_size, rt.device, 2 * rt.world_size, 2, 8
    tr = transports(rt)[0]
    # hidden not a multiple of 128
    expect_error(lambda: moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=96, max_tokens=S,
                                               dtype=torch.bfloat16, transport=tr, dispatch_dtype=FP8), "hidden")
    # dispatch_dtype differs across ranks (rank 0 asks for fp8)
    if R > 1:
        dd = FP8 if rt.rank == 0 else None
        expect_error(lambda: moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=128, max_tokens=S,
                                                   dtype=torch.bfloat16, transport=tr, dispatch_dtype=dd),
                     "dispatch_dtype")
    H = 256
    g = torch.Generator().manual_seed(3)
    x = torch.randn(S, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).to(dev)
    w = torch.rand(S, K, generator=g).to(dev)
    q, sc = quantize_fp8(x)
    bad = {"x[1] (scales)": (q, sc[:, :1]), "x[0] (x_fp8)": (q.view(torch.uint8), sc),
           "x": (q, sc, sc)}
    with moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.bfloat16,
                               transport=tr, dispatch_dtype=FP8) as ep:
        want = ep.dispatch(x, idx, w)
        want = (want.tokens.view(torch.uint8).cpu().clone(), want.scales.cpu().clone())
        for name, arg in bad.items():  # a bad pair on the last rank only: every rank refuses
            mine = arg if rt.rank == R - 1 else (q, sc)
            msg = expect_error(lambda: ep.dispatch(mine, idx, w), name.split(" ")[0])
            assert rt.rank == R - 1 or R == 1 or "on rank" in msg, msg
        if R > 1:  # a pair on one rank, a tensor on the others: the signatures disagree
            mine = (q, sc) if rt.rank == 0 else x
            expect_error(lambda: ep.dispatch(mine, idx, w), "x")
        # non-finite tokens on the last rank: refused on every rank (NVLink: at the next call or synchronize)
        xb = x.clone()
        if rt.rank == R - 1:
            xb[1, 5] = float("inf")
        expect_error(lambda: (ep.dispatch(xb, idx, w), _finish(ep)), "x")
        got = ep.dispatch(x, idx, w)  # the next valid call works, with the same bits
        _finish(ep)
        assert torch.equal(got.tokens.view(torch.uint8).cpu(), want[0]) and torch.equal(got.scales.cpu(), want[1])
        y = ep.combine(dequantize_rows(got), got)
        assert y.dtype == torch.bfloat16 and tuple(y.shape) == (S, H)
