"""What the adapters share: one verdict for every rank, and float tolerances of patch-time probes."""
from __future__ import annotations

import torch

from ..errors import raise_together
from ..guard import AGREEMENT

# relative tolerance of a probe comparing a patched block with the original in the block's own dtype:
# summation order only (a wrong routing or a lost shared expert differs by O(1))
PROBE_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def ep_kwargs_error(ep_kwargs: dict) -> str | None:
    """The error for keyword arguments an adapter would pass on to ExpertParallel but that it does not take
    (or that the adapter sets itself, per call): caught at patch time, not at the first forward."""
    import inspect

    from ..ep import ExpertParallel

    own = {"group", "num_experts", "topk", "hidden", "max_tokens", "dtype", "device"}
    ok = set(inspect.signature(ExpertParallel.__init__).parameters) - own - {"self"}
    bad = sorted(set(ep_kwargs) - ok)
    return None if not bad else (f"{bad[0]}: expected a keyword argument of moonep.ExpertParallel "
                                 f"({', '.join(sorted(ok))}), got {bad[0]}={ep_kwargs[bad[0]]!r}")


def pool_error(pool) -> str | None:
    """The error for a ``replica_pool=`` that is neither ``None`` nor a :class:`moonep.ReplicaPool`."""
    from ..experts import ReplicaPool

    if pool is None or isinstance(pool, ReplicaPool):
        return None
    return f"replica_pool: expected None or a moonep.ReplicaPool, got {type(pool).__name__}"


def agree(rt, error: str | None) -> None:
    """Raise ``ValueError(error)`` on every rank if any rank has an ``error`` (its own message where it has
    one, else the first failing rank's with ``(on rank r)``). Collective over ``rt.cpu_group`` when
    ``rt`` has several ranks, so a refusal on one rank never leaves the others waiting later."""
    if rt is None or rt.world_size == 1:
        if error is not None:
            raise ValueError(error)
        return
    host = rt.host  # header first: a rank in another moonep collective fails cleanly with this one
    if any(host.agree(AGREEMENT, error is not None, what="agreement")):
        with host.span("agreement"):  # the messages: every rank gathers them, then raises
            raise_together(error, lambda obj: host.all_gather_object(obj, code=AGREEMENT, seq=1, what="agreement"))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` (0 for empty tensors, ``inf`` for a shape mismatch)."""
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
