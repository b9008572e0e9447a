"""Float32 slot GEMMs on CUDA (``csrc/slot_gemm.cu``): the slot offsets are read on the device.

torch's grouped GEMM takes bf16/fp16 only on the GPUs moonep targets; for float32 the alternative is one
cuBLAS GEMM per slot, whose row ranges are read on the host (a sync, and nothing a CUDA graph can capture).
These kernels keep float32 expert layers sync-free and capturable (``torch.compile(mode="reduce-overhead")``),
and give the same bits on every call (each output is one float32 sum in increasing ``k``).  They are simple
tiled kernels, slower than cuBLAS: float32 experts are for checks; train in bf16.
"""
from __future__ import annotations

import numpy as np
import torch

from . import cuda_runtime

_TILE = 64


def usable(a: torch.Tensor) -> bool:
    """True for float32 CUDA rows when the kernels can load (CuPy present)."""
    return a.dtype == torch.float32 and a.device.type == "cuda" and cuda_runtime.available()


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def slot_gemm(a: torch.Tensor, cu: torch.Tensor, w_home: torch.Tensor, w_rep: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of slot ``j`` times slot ``j``'s weight.

    Args:
        a: float32 ``[cap, D]`` rows grouped by slot, on CUDA.
        cu: int ``[G + 1]`` slot offsets (on ``a``'s device; read there).
        w_home: float32 ``[n_home, D, N]`` weights of slots ``0 .. n_home-1`` (any strides: ``.mT`` views too).
        w_rep: float32 ``[G - n_home, D, N]`` weights of the other slots, or None (``n_home = G``).
    Returns:
        float32 ``[cap, N]``; rows from ``cu[G]`` on are zero.
    """
    a, cu = _rows(a), cu.to(torch.int32).contiguous()
    G = cu.shape[0] - 1
    cap, D = a.shape
    N = w_home.shape[-1]
    rep = w_home if w_rep is None else w_rep
    out = torch.empty(cap, N, dtype=torch.float32, device=a.device)
    if cap == 0 or N == 0:
        return out
    p, i32, i64 = cuda_runtime.ptr, np.int32, np.int64
    # y: the slot tiles (at most ceil(cap/64) + G of them with the padding tiles), plus one spare
    grid = ((N + _TILE - 1) // _TILE, (cap + _TILE - 1) // _TILE + G + 1, 1)
    cuda_runtime.kernels("slot_gemm", a.device.index).launch(
        "moonep_slot_gemm_f32", grid, (256, 1, 1),
        (p(a), i64(a.stride(0)), p(cu), i32(G), p(w_home), *map(i64, w_home.stride()),
         i32(G if w_rep is None else w_home.shape[0]), p(rep), *map(i64, rep.stride()),
         p(out), i64(out.stride(0)), i32(cap), i32(D), i32(N)), any_device=True)
    return out


def slot_wgrad(a: torch.Tensor, g: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Weight gradient of every slot: float32 ``[G, D, N]`` with ``[j] = a[rows j].T @ g[rows j]`` (zero for an
    empty slot).  a: float32 ``[cap, D]``; g: float32 ``[cap, N]``; cu: int ``[G + 1]``."""
    a, g, cu = _rows(a), _rows(g), cu.to(torch.int32).contiguous()
    G, D, N = cu.shape[0] - 1, a.shape[1], g.shape[1]
    out = torch.empty(G, D, N, dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out
    p, i32, i64 = cuda_runtime.ptr, np.int32, np.int64
    grid = ((N + _TILE - 1) // _TILE, (D + _TILE - 1) // _TILE, G)
    cuda_runtime.kernels("slot_gemm", a.device.index).launch(
        "moonep_slot_wgrad_f32", grid, (256, 1, 1),
        (p(a), i64(a.stride(0)), p(g), i64(g.stride(0)), p(cu), p(out), i32(D), i32(N)), any_device=True)
    return out
