"""Per-slot helpers for layers, re-exported from :mod:`moonep.experts` (the experts stage): :func:`slot_matmul`
(one ``[G, D, N]`` weight) and :func:`slot_apply` (any expert module, one slot at a time)."""
from ..experts import slot_apply, slot_matmul  # noqa: F401
