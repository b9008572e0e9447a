"""Faults and resource hygiene on CUDA ranks (NVLink transport and the NCCL host path).

Run by tests/gpu/test_mp_faults_gpu.py with MOONEP_TEST_DEVICE=cuda; every case skips on CPU ranks.  The
NVLink path never syncs with the host, so a mismatched call order cannot be detected before the data
moves: the kernels' peer waits time out instead (``timeout``) and every rank raises MoonepError.
"""
import gc
import os
import time

import torch

import moonep
from tests.harness.mp import SkipCase
from moonep.transport import ipc

TIMEOUT = 5.0


def _need_cuda(rt):
    if rt.device.type != "cuda":
        raise SkipCase("needs CUDA ranks (MOONEP_TEST_DEVICE=cuda)")


def _problem(rt, E, K=2, H=64, S=64, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + rt.rank)
    x = torch.randn(S, H, generator=g).to(rt.device)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).to(rt.device)
    w = torch.rand(S, K, generator=g).to(rt.device)
    home = torch.randn(E // rt.world_size, H, generator=g).to(rt.device)
    return x, idx, w, home


def _nv(rt, **kw):
    ep = moonep.ExpertParallel(rt, num_experts=2 * rt.world_size, topk=2, hidden=64, max_tokens=64,
                               transport="nvlink", timeout=TIMEOUT, **kw)
    assert ep.transport_name == "nvlink"
    return ep


def _expect_error_soon(calls, within):
    """Run calls then synchronize until MoonepError; it must come within ``within`` seconds."""
    t0 = time.monotonic()
    try:
        for c in calls:
            c()
        for _ in range(200):
            torch.cuda.synchronize()
            if time.monotonic() - t0 > within:
                break
            calls[-1]()  # keep making calls: the error surfaces at the next call
    except moonep.MoonepError as exc:
        dt = time.monotonic() - t0
        assert dt <= within, f"raised after {dt:.1f}s: {exc}"
        # a peer's kernels did not signal, or (host order board) a peer did not start the call
        assert "within the timeout" in str(exc) and f"{TIMEOUT:g}s" in str(exc), exc
        return str(exc)
    raise AssertionError(f"no MoonepError within {within}s")


def _warm_nv(rt):
    """An NVLink ExpertParallel after one matched dispatch + combine: (ep, x, idx, w, h)."""
    _need_cuda(rt)
    ep = _nv(rt)
    x, idx, w, _ = _problem(rt, ep.num_experts)
    with torch.no_grad():
        h = ep.dispatch(x, idx, w)
        ep.combine(h.tokens, h)
        ep.synchronize()
    return ep, x, idx, w, h


def case_nvlink_order_mismatch_raises_on_every_rank(rt):
    """The last rank calls combine #3 while the others call dispatch #3: the host order board reports it on
    every rank before any kernel runs (the kernels alone would satisfy each other's waits), and the
    instance stays usable: the next matched calls give the right values."""
    R = rt.world_size
    ep, x, idx, w, h = _warm_nv(rt)
    with torch.no_grad():
        call = (lambda: ep.combine(h.tokens, h)) if rt.rank == R - 1 else (lambda: ep.dispatch(x, idx, w))
        t0 = time.monotonic()
        try:
            call()
        except moonep.MoonepError as exc:
            assert f"rank {R - 1} called combine #3 while rank 0 called dispatch #3" in str(exc), exc
            assert time.monotonic() - t0 < TIMEOUT, "detected only by a timeout"
        else:
            raise AssertionError(f"rank {rt.rank}: mismatched call order not detected")
        h = ep.dispatch(x, idx, w)
        y = ep.combine(h.tokens, h)
        ep.synchronize()
        want = (w * (idx >= 0)).sum(1, keepdim=True) * x
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    ep.close()
    rt.barrier()


def case_nvlink_stall_past_timeout(rt):
    R = rt.world_size
    ep, x, idx, w, h = _warm_nv(rt)
    with torch.no_grad():
        if rt.rank == R - 1:
            time.sleep(TIMEOUT + 3)  # the others time out meanwhile; then this rank's waits time out too
        _expect_error_soon([lambda: ep.dispatch(x, idx, w), ep.synchronize], TIMEOUT * 3 + 30)
    ep.close(check=False)
    rt.barrier()


def case_nccl_path_order_mismatch_detected(rt):
    """The host-driven path on GPUs (torch transport, NCCL data, gloo header): detected before data moves."""
    _need_cuda(rt)
    R = rt.world_size
    ep = moonep.ExpertParallel(rt, num_experts=2 * R, topk=2, hidden=64, max_tokens=64, transport="torch")
    x, idx, w, _ = _problem(rt, ep.num_experts)
    h = ep.dispatch(x, idx, w)
    call = (lambda: ep.combine(h.tokens, h)) if rt.rank == R - 1 else (lambda: ep.dispatch(x, idx, w))
    try:
        call()
    except moonep.MoonepError as exc:
        msg = str(exc)  # "... rank R-1 called combine #2 of ExpertParallel #N while rank 0 called dispatch #2 of ..."
        assert f"rank {R - 1} called combine #2 " in msg and "while rank 0 called dispatch #2 " in msg, msg
    else:
        raise AssertionError("mismatch not detected")
    ep.close()


def _fds():
    return len(os.listdir("/proc/self/fd"))


def case_nvlink_create_close_100_times_no_leak(rt):
    _need_cuda(rt)
    import cupy

    def cycle(i):
        with _nv(rt) as ep:
            if i % 10 == 0:
                x, idx, w, home = _problem(rt, ep.num_experts, seed=i)
                h = ep.dispatch(x, idx, w)
                ep.prefetch(h, home)
                ep.combine(h.tokens, h)
                ep.synchronize()

    for i in range(3):
        cycle(i)
    gc.collect()
    torch.cuda.synchronize()
    fd0, alloc0 = _fds(), torch.cuda.memory_allocated()
    with cupy.cuda.Device(rt.device.index):  # this rank's GPU, not CuPy's default device
        free0 = cupy.cuda.runtime.memGetInfo()[0]
    live0 = ipc.live_counts()
    for i in range(100):
        cycle(i)
    gc.collect()
    torch.cuda.synchronize()
    fd1, alloc1 = _fds(), torch.cuda.memory_allocated()
    with cupy.cuda.Device(rt.device.index):
        free1 = cupy.cuda.runtime.memGetInfo()[0]
    live1 = ipc.live_counts()
    assert live1 == live0 == {"ipc_handles": 0, "buffers": 0}, (live0, live1)
    assert fd1 <= fd0, f"file descriptors {fd0} -> {fd1}"
    assert alloc1 <= alloc0, f"torch.cuda.memory_allocated {alloc0} -> {alloc1}"
    # Other ranks sharing the GPU allocate concurrently: allow their transient use, not a per-cycle leak.
    assert free0 - free1 < 256 * 2**20, f"free device memory dropped {(free0 - free1) / 2**20:.0f} MiB"
    rt.barrier()
