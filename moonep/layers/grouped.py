"""Expert GEMMs over the ``2*epn`` slots of one rank (home experts, then replicas).

The dispatched rows are already grouped by slot (``cu_seqlens``), so one grouped GEMM reads views of the
receive buffer: no permute. On CUDA ``torch._grouped_mm`` does it in one launch with device offsets (no
host sync); elsewhere, or when it refuses the shapes/dtype, a loop over slots does the same maths.
"""
from __future__ import annotations

import torch

_FAILED: set = set()  # (device type, dtype) combinations where _grouped_mm raised once: use the loop


def _grouped_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or a.device.type != "cuda":
        return False
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32) or (a.device.type, a.dtype) in _FAILED:
        return False
    es = a.element_size()
    # _grouped_mm wants 16-byte aligned strides on both operands.
    return all(s * es % 16 == 0 for s in (a.stride(0), *w.stride()[:1], max(w.stride(1), w.stride(2))))


def slot_matmul(a: torch.Tensor, cu_seqlens: torch.Tensor, w: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Rows of slot ``j`` times ``w[j]``.

    Args:
        a: ``[cap, D]`` rows grouped by slot (rows past ``cu_seqlens[-1]`` are padding).
        cu_seqlens: int32 ``[G + 1]``, slot ``j`` owns rows ``cu_seqlens[j]:cu_seqlens[j+1]``.
        w: ``[G, D, N]`` one matrix per slot, same dtype as ``a``.
        impl: ``"auto"`` (grouped on CUDA when possible), ``"grouped"`` (``torch._grouped_mm``) or ``"loop"``.
    Returns:
        ``[cap, N]`` in ``a.dtype``; padding rows are zero. Differentiable wrt ``a`` and ``w``.
    """
    if impl == "grouped" or (impl == "auto" and _grouped_ok(a, w)):
        try:
            out = torch._grouped_mm(a, w, offs=cu_seqlens[1:].to(torch.int32))
            # Rows past the last offset are never written: mask them (where, since garbage may be NaN).
            live = torch.arange(a.shape[0], device=a.device) < cu_seqlens[-1]
            return torch.where(live[:, None], out, out.new_zeros(()))
        except RuntimeError:
            if impl == "grouped":
                raise
            _FAILED.add((a.device.type, a.dtype))
    cu = cu_seqlens.tolist()
    parts = [a[cu[j]:cu[j + 1]] @ w[j] for j in range(len(cu) - 1)]
    parts.append(a.new_zeros(a.shape[0] - cu[-1], w.shape[-1]))
    return torch.cat(parts)


def slot_apply(fn, a: torch.Tensor, cu_seqlens: torch.Tensor, out_width: int) -> torch.Tensor:
    """``fn(j, rows)`` on every slot's rows (arbitrary expert modules); padding rows give zero.

    Args:
        fn: ``(slot j, rows [n_j, D]) -> [n_j, out_width]``.
        a: ``[cap, D]``; cu_seqlens: int32 ``[G + 1]``.
    Returns:
        ``[cap, out_width]`` in ``a.dtype``.
    """
    cu = cu_seqlens.tolist()
    parts = [fn(j, a[cu[j]:cu[j + 1]]) if cu[j + 1] > cu[j] else a.new_zeros(0, out_width)
             for j in range(len(cu) - 1)]
    parts.append(a.new_zeros(a.shape[0] - cu[-1], out_width))
    return torch.cat([p.to(a.dtype) for p in parts])
