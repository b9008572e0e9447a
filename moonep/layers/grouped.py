"""Per-slot helpers for layers: :func:`slot_matmul` (one ``[G, D, N]`` weight, from :mod:`moonep.experts`)
and :func:`slot_apply` (any expert module, one slot at a time).  Expert weights with replicas go through
:func:`moonep.expert_matmul` and a :class:`moonep.ReplicaPool` instead."""
from __future__ import annotations

import torch

from ..experts import slot_matmul  # noqa: F401  (re-exported: the grouped GEMM lives with the experts stage)


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
