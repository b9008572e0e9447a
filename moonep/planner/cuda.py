"""GPU balanced planner: thin wrapper around ``csrc/planner.cu`` (CuPy RawModule, NVRTC at run time).

Why CuPy RawModule: no build step for CPU installs (cupy is imported lazily, only for CUDA inputs),
and plain CUDA C lets the kernel mirror ``cpu.py`` statement by statement, which is what makes the
results bit-identical. Kernels get raw device pointers of torch-allocated tensors and run on torch's
current stream (``cupy.cuda.ExternalStream``), so there is no DLPack stream handshake, no host sync,
and the sequence can be captured in a CUDA graph. Three launches: column sums (+ negative check),
the single-block plan, and the [E, R] assignment fill.
"""
from __future__ import annotations

import os

import numpy as np
import torch

_MOD = None
_SMEM_SET: dict = {}


def _source_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for p in (os.path.join(here, "..", "..", "csrc", "planner.cu"), os.path.join(here, "..", "csrc", "planner.cu")):
        if os.path.exists(p):
            return os.path.normpath(p)
    raise FileNotFoundError("csrc/planner.cu not found next to the moonep package")


def _module():
    global _MOD
    if _MOD is None:
        import cupy
        with open(_source_path()) as f:
            src = f.read()
        _MOD = cupy.RawModule(code=src, options=("-std=c++17",))
    return _MOD


def _ptr(t: torch.Tensor):
    return np.uint64(t.data_ptr())


def plan_cuda(counts: torch.Tensor, slack: float, declared):
    """counts int32/int64 [R, E] on CUDA -> Plan on the same device, no host synchronisation.
    ``declared`` int64 [R] expected row sums or None."""
    import cupy

    from . import ERR_ROWSUM, Plan

    R, E = counts.shape
    epn = E // R
    dev = counts.device
    mod = _module()
    if counts.dtype not in (torch.int64, torch.int32):
        counts = counts.to(torch.int64)
    counts = counts.contiguous()
    i64 = dict(dtype=torch.int64, device=dev)
    L = torch.empty(E, **i64)
    err = torch.zeros((), dtype=torch.int32, device=dev)
    rem = torch.empty(E, **i64)
    amt = torch.empty(E, **i64)
    rep_exp = torch.empty(R, epn, **i64)
    rep_src = torch.empty(R, **i64)
    recv = torch.empty(R, **i64)
    assignment = torch.empty(E, R, **i64)
    nt = min(1024, max(64, 1 << (max(R, epn) - 1).bit_length()))
    smem = 8 * E + 16 * R + 4 * E + R
    smem = (smem + 15) // 16 * 16
    k_plan = mod.get_function("plan_kernel")
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream, dev.index)
    with cupy.cuda.Device(dev.index), stream:
        if smem > 48 * 1024 and _SMEM_SET.get(dev.index, 0) < smem:  # opt in to >48 KiB (E=8192: 113 KiB)
            k_plan.max_dynamic_shared_size_bytes = smem
            _SMEM_SET[dev.index] = smem
        name = "colsum_i64" if counts.dtype == torch.int64 else "colsum_i32"
        mod.get_function(name)(((E + 255) // 256,), (256,), (_ptr(counts), np.int32(R), np.int32(E), _ptr(L), _ptr(err)))
        k_plan((1,), (nt,), (_ptr(L), np.int32(R), np.int32(epn), np.float64(slack), np.int32(slack > 0),
                             _ptr(rem), _ptr(amt), _ptr(rep_exp), _ptr(rep_src), _ptr(recv)), shared_mem=smem)
        n = E * R
        mod.get_function("assign_kernel")(((n + 255) // 256,), (256,), (_ptr(rem), _ptr(amt), _ptr(rep_src),
                                           np.int32(R), np.int32(epn), _ptr(assignment)))
    if declared is not None:  # device-side contract check, recorded in plan.error
        bad = (counts.sum(1, dtype=torch.int64) != declared).any()
        err = err | (bad.to(torch.int32) * ERR_ROWSUM)
    return Plan(assignment, rep_exp, rep_src, recv, L, counts.to(torch.int64), float(slack), err)
