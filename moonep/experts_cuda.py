"""Float32 slot GEMMs on CUDA, and the row moves around torch's bf16/fp16 grouped GEMM (``csrc/slot_gemm.cu``):
the slot offsets are read on the device.

torch's grouped GEMM takes bf16/fp16 only on the GPUs moonep targets; for float32 the alternative is one
cuBLAS GEMM per slot, whose row ranges are read on the host (a sync, and nothing a CUDA graph can capture).
These kernels keep float32 expert layers sync-free and capturable (``torch.compile(mode="reduce-overhead")``),
and give the same bits on every call (each output is one float32 sum in increasing ``k``).  They are simple
tiled kernels, slower than cuBLAS: float32 experts are for checks; train in bf16.
"""
from __future__ import annotations

import torch

from . import cuda_runtime
from .errors import expect

_TILE = 64
_MAX_GRID_Y = 65535


def loadable(t: torch.Tensor) -> bool:
    """True for a CUDA tensor when the kernels can load (CuPy present)."""
    return t.device.type == "cuda" and cuda_runtime.available()


def usable(a: torch.Tensor) -> bool:
    """True for float32 CUDA rows when the kernels can load."""
    return a.dtype == torch.float32 and loadable(a)


def _check(name: str, w: torch.Tensor, a: torch.Tensor, D: int) -> None:
    expect(w.dtype == torch.float32 and w.device == a.device, name, f"float32 on {a.device} (like the rows)",
           f"{w.dtype} on {w.device}")
    expect(w.dim() == 3 and w.shape[1] == D, name, f"shape [slots, D={D}, N]", list(w.shape))


def _launch(name: str, grid: tuple, args: tuple, device_index: int, block: tuple = (256, 1, 1)) -> None:
    try:
        cuda_runtime.kernels("slot_gemm", device_index).launch(name, grid, block, args, any_device=True)
    except (ImportError, RuntimeError):
        raise
    except Exception as exc:  # CuPy's compile and driver errors: the caller falls back on RuntimeError
        raise RuntimeError(f"moonep: {name}: {exc}") from exc


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
    a, cu = _rows(a), cu.to(a.device, torch.int32).contiguous()
    G = cu.shape[0] - 1
    cap, D = a.shape
    N = w_home.shape[-1]
    rep = w_home if w_rep is None else w_rep
    _check("w_home", w_home, a, D)
    _check("w_rep", rep, a, D)
    n_home = G if w_rep is None else w_home.shape[0]
    expect(rep.shape[-1] == N and (w_rep is None and w_home.shape[0] == G or
                                   w_rep is not None and n_home + w_rep.shape[0] == G),
           "w_home, w_rep", f"{G} slot weights [*, {D}, {N}] in all (cu has {G + 1} offsets)",
           [list(w_home.shape), None if w_rep is None else list(w_rep.shape)])
    out = torch.empty(cap, N, dtype=torch.float32, device=a.device)
    if cap == 0 or N == 0:
        return out
    p, i32, i64 = cuda_runtime.ptr, cuda_runtime.i32, cuda_runtime.i64
    # y: the slot tiles (at most ceil(cap/64) + G of them with the padding tiles), plus one spare
    grid = ((N + _TILE - 1) // _TILE, (cap + _TILE - 1) // _TILE + G + 1, 1)
    expect(grid[1] <= _MAX_GRID_Y, "a", f"at most {(_MAX_GRID_Y - G - 1) * _TILE} rows for the float32 slot "
           "kernels", f"{cap} rows")
    _launch("moonep_slot_gemm_f32", grid,
            (p(a), i64(a.stride(0)), p(cu), i32(G), p(w_home), *map(i64, w_home.stride()), i32(n_home), p(rep),
             *map(i64, rep.stride()), p(out), i64(out.stride(0)), i32(cap), i32(D), i32(N)), a.device.index)
    return out


def slot_wgrad(a: torch.Tensor, g: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Weight gradient of every slot: float32 ``[G, D, N]`` with ``[j] = a[rows j].T @ g[rows j]`` (zero for an
    empty slot).  a: float32 ``[cap, D]``; g: float32 ``[cap, N]``; cu: int ``[G + 1]``."""
    a, g, cu = _rows(a), _rows(g), cu.to(a.device, torch.int32).contiguous()
    G, D, N = cu.shape[0] - 1, a.shape[1], g.shape[1]
    expect(g.dtype == torch.float32 and g.device == a.device and g.shape[0] == a.shape[0], "g",
           f"float32 [{a.shape[0]}, N] on {a.device}", f"{g.dtype} {list(g.shape)} on {g.device}")
    out = torch.empty(G, D, N, dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out
    p, i32, i64 = cuda_runtime.ptr, cuda_runtime.i32, cuda_runtime.i64
    grid = ((N + _TILE - 1) // _TILE, (D + _TILE - 1) // _TILE, G)
    expect(grid[1] <= _MAX_GRID_Y and G <= _MAX_GRID_Y, "a, cu", f"D <= {_MAX_GRID_Y * _TILE} and at most "
           f"{_MAX_GRID_Y} slots", f"D={D}, {G} slots")
    _launch("moonep_slot_wgrad_f32", grid, (p(a), i64(a.stride(0)), p(g), i64(g.stride(0)), p(cu), p(out), i32(D),
                                            i32(N)), a.device.index)
    return out


def slot_sums(g: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """float32 ``[G, N]``: the sum of each slot's rows of ``g [cap, N]`` (CUDA, bf16/fp16/fp32), in a fixed
    order (the same bits every call, unlike ``index_add_``'s atomics) and in float32 (float64 rows would lose
    precision: :class:`moonep.experts._ExpertBias` sums those with a GEMM)."""
    g = g.float()
    return slot_wgrad(g.new_ones(g.shape[0], 1), g, cu)[:, 0]


# Row moves around torch's grouped GEMM (bf16/fp16 expert layers, moonep/experts.py): only the replica slots'
# rows and the padding move, however many rows the step has (their counts read on the device).
_MOVE_BLOCKS, _MOVE_THREADS = 1024, 128


def _word(row_bytes: int, *strides_and_ptrs: int) -> int:
    """The largest word (16, 8, 4, 2 or 1 bytes) that divides the row size, the strides and the addresses."""
    v = 16
    while v > 1 and any(x % v for x in (row_bytes, *strides_and_ptrs)):
        v //= 2
    return v


def _move_rows(name: str, dst: torch.Tensor, src: torch.Tensor, cu: torch.Tensor, n_home: int, *tail) -> None:
    """Launch row-move kernel ``name`` (``moonep_rows_front``/``_back``): ``dst`` and ``src`` rows by the widest
    word their row size, strides and addresses allow; ``tail``: the kernel's arguments after ``G``."""
    rb, es = dst.shape[1] * dst.element_size(), dst.element_size()
    vec = _word(rb, dst.stride(0) * es, src.stride(0) * es, dst.data_ptr(), src.data_ptr())
    p, i32, i64 = cuda_runtime.ptr, cuda_runtime.i32, cuda_runtime.i64
    _launch(name, (min(dst.shape[0], _MOVE_BLOCKS), 1, 1),
            (p(dst), i64(dst.stride(0) * es), p(src), i64(src.stride(0) * es), p(cu), i32(n_home),
             i32(cu.shape[0] - 1), *tail, i64(rb), i32(vec)), dst.device.index, (_MOVE_THREADS, 1, 1))


def rows_front(x: torch.Tensor, cu: torch.Tensor, n_home: int) -> torch.Tensor:
    """``[cap, D]`` with rows ``cu[n_home] .. cu[G]-1`` of ``x`` moved to rows ``0 ..`` (the other rows unset).

    Args:
        x: ``[cap, D]`` rows grouped by slot, on CUDA, any dtype, unit stride along ``D``.
        cu: int ``[G + 1]`` slot offsets, on ``x``'s device (read there: no host sync).
        n_home: the slots before the moved ones.
    """
    x, cu = _rows(x), cu.to(x.device, torch.int32).contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        _move_rows("moonep_rows_front", out, x, cu, n_home)
    return out


def rows_back(out: torch.Tensor, rep: torch.Tensor, cu: torch.Tensor, n_home: int) -> torch.Tensor:
    """In place: rows ``r >= cu[n_home]`` of ``out`` become ``rep[r - cu[n_home]]`` while ``r < cu[G]``, and zero
    after (``n_home = G``: the padding rows zeroed only).  Returns ``out``.

    Args:
        out: ``[cap, N]`` on CUDA, contiguous rows (a grouped GEMM's output over the home slots).
        rep: ``[cap', N]`` like ``out`` (the replica slots' products, from row 0), unit stride along ``N``.
        cu: int ``[G + 1]`` slot offsets, on the device.
    """
    cu, rep = cu.to(out.device, torch.int32).contiguous(), _rows(rep)
    expect(out.stride(-1) == 1, "out", "rows of unit stride (written in place)", f"strides {tuple(out.stride())}")
    if out.numel():
        _move_rows("moonep_rows_back", out, rep, cu, n_home, cuda_runtime.i64(out.shape[0]))
    return out
