"""FP8 dispatch on one CUDA rank, NVLink backend: the rows the dispatch kernels quantise while sending (and the
host backends' wire quantiser) against the torch path (bitwise), no host sync (sync-debug "error"), CUDA-graph
capture and replay, and a non-finite x reported lazily (also in a token without any destination).  Skipped
without CUDA.

The send kernels' fanout variant is compiled into the "ep" program once per process: the compile-time switch
``MOONEP_FP8_WORDS`` (csrc/common.cuh, ``cuda_runtime.profile_build``) selects it.  A plain run checks the
default here and the narrow one (``0``) in a child process (``test_narrow_fanout_in_a_child``);
``MOONEP_TEST_BUILD=MOONEP_FP8_WORDS=N pytest tests/gpu/test_fp8_gpu.py`` runs everything on variant ``N``."""
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import moonep  # noqa: E402
from moonep import cuda_runtime, fp8  # noqa: E402
from tests.harness.cuda_graph import capture  # noqa: E402
from tests.harness.mprun import apply_test_build  # noqa: E402
from moonep.quant import _quantize_torch  # noqa: E402

WORDS = apply_test_build().get("MOONEP_FP8_WORDS")  # MOONEP_TEST_BUILD: a chosen fanout (before any kernel)

pytestmark = [pytest.mark.gpu]
FP8 = torch.float8_e4m3fn
E, K, H, S = 16, 4, 256, 64


@pytest.fixture(scope="module")
def rt():
    r = moonep.init(device="cuda")
    yield r
    r.shutdown()


def _problem(seed, s=S):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, H, generator=g).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]).cuda()
    w = torch.rand(s, K, generator=g).cuda()
    return x, idx, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_wire_kernel_bitwise_torch_path(dtype, pow2):
    x = torch.randn(37, 384, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[3] = 0
    x[5, :128] *= 1e4
    wire = fp8.quantize_wire(x.cuda(), pow2_scales=pow2, check_finite=False)
    q, sc, _ = _quantize_torch(x, 128, pow2)
    gq, gs = fp8.split_wire(wire.cpu(), 384)
    assert torch.equal(gq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(gs, sc)
    bad = x.clone().cuda()
    bad[7, 200] = float("nan")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    fp8.quantize_wire(bad, check_finite=False, flag=flag, code=16)
    assert int(flag) == 16


@pytest.mark.parametrize("fused", ["route,dispatch", "route", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [384, 512, 640])
def test_dispatch_rows_bitwise_torch_path(rt, fused, dtype, hidden):
    """Every received row is the wire row of its token (quantised by the dispatch kernels), in both kernel
    paths, zero-copy or not, plain or power-of-two scales; rows without a token are zero."""
    g = torch.Generator().manual_seed(hidden)
    s = S - 3
    x = torch.randn(s, hidden, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-12, 10, (s, hidden // 128), generator=g).double()).repeat_interleave(128, 1)
    x = x.to(dtype)
    x[4] = 0
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)])
    idx[torch.rand(s, K, generator=g) < 0.2] = -1
    idx[7] = -1  # a token without any destination
    w = torch.rand(s, K, generator=g)
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    for pow2 in (False, True):
        q, sc, _ = _quantize_torch(x.cpu(), 128, pow2)
        want = fp8.pack_pair(q, sc)
        for zero_copy in (True, False):
            with moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=hidden, max_tokens=S, dtype=dtype,
                                       transport="nvlink", zero_copy=zero_copy, dispatch_dtype=FP8,
                                       pow2_scales=pow2) as ep, torch.no_grad():
                ep._backend.set_fused(fused)
                for _ in range(2):  # a second call over the same buffers
                    h = ep.dispatch(x, idx, w)
                    ep.synchronize()
                    rows = fp8.wire_rows(h.tokens).cpu()
                    rf = ep._step_of(h).routing.row_first.long().cpu()
                    used = rf >= 0
                    tok = ep._step_of(h).routing.src.long().cpu()[rf[used]]
                    ctx = f"fused={fused} dtype={dtype} H={hidden} pow2={pow2} zero_copy={zero_copy}"
                    assert int(used.sum()) == int((idx >= 0).sum()), ctx
                    assert torch.equal(rows[used], want[tok]), ctx
                    assert not bool(rows[~used].any()), ctx


def test_fanout_variant_compiled():
    """The fanout switch reaches the "ep" program's compile options exactly when it is set."""
    got = [o for o in cuda_runtime.compile_options("ep") if o.startswith("-DMOONEP_FP8_WORDS=")]
    assert got == ([] if WORDS is None else [f"-DMOONEP_FP8_WORDS={int(WORDS)}"]), got


@pytest.mark.skipif(WORDS is not None, reason="this process runs a chosen fanout")
def test_narrow_fanout_in_a_child():
    """The bitwise and non-finite checks again, in a process that compiles the narrow fanout."""
    env = dict(os.environ, MOONEP_TEST_BUILD="MOONEP_FP8_WORDS=0")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "dispatch_rows_bitwise or nonfinite or variant_compiled"],
                       env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


@pytest.mark.parametrize("fused", ["route,dispatch", "0"])
def test_nonfinite_x_in_a_token_without_destination(rt, fused):
    x, idx, w = _problem(5)
    with moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.bfloat16,
                               transport="nvlink", dispatch_dtype=FP8) as ep:
        ep._backend.set_fused(fused)
        xb, ib = x.clone(), idx.clone()
        xb[3, 100] = float("nan")
        ib[3] = -1
        with pytest.raises(ValueError, match="x: expected finite values"):
            ep.dispatch(xb, ib, w)
            ep.synchronize()
        h = ep.dispatch(x, idx, w)
        ep.synchronize()  # reported once: the next call is clean
        assert bool(torch.isfinite(h.scales).all())


def _mlp(rows, cu, W):
    """Per-slot linear map without reading cu on the host (graph-safe): row -> its slot's weight."""
    r = torch.arange(rows.shape[0], device=rows.device, dtype=cu.dtype)
    slot = torch.searchsorted(cu[1:].contiguous(), r, right=True)
    Wx = torch.cat([W, W.new_zeros(1, *W.shape[1:])])[slot]
    return torch.bmm(rows[:, None, :], Wx)[:, 0, :]


def test_no_host_sync_fp8(rt):
    x, idx, w = _problem(2)
    W = (torch.randn(2 * E, H, H, generator=torch.Generator().manual_seed(3)) / H ** 0.5).to(torch.bfloat16).cuda()
    with moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.bfloat16,
                               transport="nvlink", dispatch_dtype=FP8) as ep:
        def step(train):
            xl = x.clone().requires_grad_(train)
            h = ep.dispatch(xl, idx, w)
            y = ep.combine(_mlp(fp8.dequantize_rows(h), h.cu_seqlens, W[:2 * ep.epn]), h)
            if train:
                y.float().sum().backward()
            pre = ep.dispatch(moonep.quant.quantize_fp8(x), idx, w)  # the pre-quantised path as well
            return y, pre

        step(True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for train in (False, True, False):
                step(train)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ep.synchronize()


def test_cuda_graph_capture_replay_fp8(rt):
    problems = [_problem(10 + i) for i in range(3)]
    sx, sidx, sw = (t.clone() for t in problems[0])
    with moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.bfloat16,
                               transport="nvlink", zero_copy=True, dispatch_dtype=FP8) as ep, torch.no_grad():
        def step():
            h = ep.dispatch(sx, sidx, sw)
            return ep.combine(fp8.dequantize_rows(h), h), h.scales

        graph, (y_static, sc_static) = capture(step)
        for x, idx, w in problems + problems[::-1]:
            sx.copy_(x)
            sidx.copy_(idx)
            sw.copy_(w)
            graph.replay()
            got, got_sc = y_static.clone(), sc_static.clone()
            want, want_sc = step()
            assert torch.equal(got, want) and torch.equal(got_sc, want_sc)
        ep.synchronize()


def test_nonfinite_x_lazy_error_then_recovers(rt):
    x, idx, w = _problem(4)
    with moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=torch.bfloat16,
                               transport="nvlink", dispatch_dtype=FP8) as ep:
        xb = x.clone()
        xb[2, 9] = float("inf")
        with pytest.raises(ValueError, match="x: expected finite values"):
            ep.dispatch(xb, idx, w)
            ep.synchronize()
        h = ep.dispatch(x, idx, w)
        ep.synchronize()
        assert h.tokens.dtype == FP8 and bool(torch.isfinite(h.scales).all())
