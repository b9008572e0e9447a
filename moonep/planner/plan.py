"""The :class:`Plan` type and the checks and bounds shared by the CPU and GPU planners."""
from __future__ import annotations

import math
from typing import Optional

import torch

class _Field:
    """A Plan tensor. CPU plans store it as a plain attribute; CUDA plans create it on first access as a
    view of the planner's device workspace (no launch, no sync; graph replays update it in place)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        if obj._ws is None:
            raise AttributeError(self.name)
        v = obj._geo.view(obj._ws, self.name)
        obj.__dict__[self.name] = v
        return v


class Plan:
    """Result of :func:`plan_balanced` (all tensors on the input's device).

    assignment       int64 [E, R]   token copies of expert e computed on rank r
    replica_experts  int64 [R, epn] global expert ids in rank r's replica slots, ascending, -1 padded
    replica_source   int64 [R]      home rank of all of r's replicas, -1 if none
    recv_counts      int64 [R]      copies each rank computes (= assignment.sum(0))
    expert_counts    int64 [E]      copies routed to each expert (= counts.sum(0))
    counts           int64 [R, E]   the input, as int64 (layout needs each source's prefix)
    error            int32 []       0, or device-side validation flags (CUDA only, see check())
    """

    assignment = _Field()
    replica_experts = _Field()
    replica_source = _Field()
    recv_counts = _Field()
    expert_counts = _Field()
    counts = _Field()
    error = _Field()
    _ws = None    # CUDA: int64 workspace holding every tensor above and the layout's tables
    _geo = None   # CUDA: its layout (moonep.planner.cuda._Geo)
    _pre = None   # CUDA, from plan_and_destinations' one launch: (rank, align, word offset of that rank's
    #               slot experts and cu_seqlens in _ws)

    def __init__(self, assignment: torch.Tensor, replica_experts: torch.Tensor, replica_source: torch.Tensor,
                 recv_counts: torch.Tensor, expert_counts: torch.Tensor, counts: torch.Tensor,
                 slack: float = 0.0, error: Optional[torch.Tensor] = None):
        self.__dict__.update(assignment=assignment, replica_experts=replica_experts, replica_source=replica_source,
                             recv_counts=recv_counts, expert_counts=expert_counts, counts=counts, slack=slack,
                             error=error)

    @classmethod
    def _cuda(cls, ws, geo, counts, slack: float) -> "Plan":
        p = cls.__new__(cls)
        d = p.__dict__
        d["_ws"], d["_geo"], d["slack"] = ws, geo, slack
        if counts is not None:
            d["counts"] = counts
        return p

    def __repr__(self):
        return (f"Plan(R={self.num_ranks}, E={self.num_experts}, slack={self.slack}, "
                f"device={self.replica_source.device})")

    @property
    def num_ranks(self) -> int:
        return self._geo.R if self._ws is not None else self.assignment.shape[1]

    @property
    def num_experts(self) -> int:
        return self._geo.E if self._ws is not None else self.assignment.shape[0]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def on_device(self) -> bool:
        """Made by the GPU planner: its tensors are views of one device workspace, which the layout kernels
        read directly."""
        return self._ws is not None

    def launch_slots(self, rank: int, align: int):
        """``(slot_experts int64 [2*epn], cu_seqlens int32 [2*epn + 1])`` of ``rank`` as the fused plan+layout
        launch wrote them for ``align`` (views of the workspace, no launch), or ``None`` when this plan was
        made otherwise or for another rank or alignment."""
        pre = self._pre
        if pre is None or rank != pre[0]:
            return None
        epn = self._geo.epn
        experts = self._ws.as_strided((2 * epn,), (1,), pre[2])
        if align != pre[1]:
            return experts, None
        return experts, self._ws.view(torch.int32).as_strided((2 * epn + 1,), (1,), 2 * (pre[2] + 2 * epn))

    def num_replicas(self) -> torch.Tensor:
        """int64 [R]: occupied replica slots per rank."""
        return (self.replica_experts >= 0).sum(1)

    def check(self) -> "Plan":
        """Raise ValueError for problems the GPU planner found on device (syncs); returns self."""
        if self.error is not None:
            err = int(self.error.item())
            if err & ERR_NEGATIVE:
                raise ValueError("counts: expected non-negative values, got a negative count")
            if err & ERR_ROWSUM:
                raise ValueError("counts: row sums disagree with the declared tokens_per_rank * topk")
        return self


ERR_NEGATIVE = 1
ERR_ROWSUM = 2


def cap_for(total: int, num_ranks: int, slack: float) -> int:
    """Per-rank cap ``ceil((1 + slack) * T / R)`` (float64, as the kernel computes it), never below
    ``ceil(T / R)`` so that a plan always exists."""
    c = (1.0 + slack) * total / num_ranks
    if not math.isfinite(c):  # slack so large the float overflows: no cap binds, as with c = total
        c = total
    return max(-(-int(total) // num_ranks), math.ceil(c))


def _validate(counts, slack, tokens_per_rank, topk):
    if (type(counts) is torch.Tensor and tokens_per_rank is None and topk is None and type(slack) is float
            and slack == 0.0 and (counts.dtype is torch.int64 or counts.dtype is torch.int32)):
        shp = counts.shape  # the common call, checked in a few hundred ns
        if len(shp) == 2 and shp[0] >= 1 and shp[1] >= 1 and shp[1] % shp[0] == 0:
            return
    if not isinstance(counts, torch.Tensor):
        raise ValueError(f"counts: expected a torch.Tensor, got {type(counts).__name__}")
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise ValueError(f"counts: expected an integer dtype (int64 or int32), got {counts.dtype}")
    if counts.dim() != 2:
        raise ValueError(f"counts: expected shape [R, E] (2-D), got {tuple(counts.shape)}")
    R, E = counts.shape
    if R < 1 or E < 1:
        raise ValueError(f"counts: expected R >= 1 and E >= 1, got shape {tuple(counts.shape)}")
    if E % R != 0:
        raise ValueError(f"counts: expected E % R == 0, got E={E}, R={R} (E % R = {E % R})")
    if isinstance(slack, bool) or not (isinstance(slack, (int, float)) and math.isfinite(slack) and slack >= 0):
        raise ValueError(f"slack: expected a finite float >= 0, got {slack!r}")
    if (tokens_per_rank is None) != (topk is None):
        raise ValueError("tokens_per_rank and topk: expected both or neither, got "
                         f"tokens_per_rank={tokens_per_rank!r}, topk={topk!r}")
    if topk is not None and (not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk < MAX_TOTAL):
        raise ValueError(f"topk: expected an int in [1, 2**62), got {topk!r}")


# Totals at or above this would overflow the int64 sums of the planner and the layout.
MAX_TOTAL = 2**62


def _declared(tokens_per_rank, R, device):
    """int64 [R] declared tokens per rank from an int, a sequence or a tensor."""
    if isinstance(tokens_per_rank, int) and not isinstance(tokens_per_rank, bool):
        if not 0 <= tokens_per_rank < MAX_TOTAL:
            raise ValueError(f"tokens_per_rank: expected values in [0, 2**62), got {tokens_per_rank!r}")
        t = torch.full((R,), tokens_per_rank, dtype=torch.int64, device=device)
    else:
        try:
            t = torch.as_tensor(tokens_per_rank)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            t = None
        if t is None or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"tokens_per_rank: expected an int or integers of shape [{R}], got "
                             f"{tokens_per_rank!r}")
        t = t.to(device=device, dtype=torch.int64)
    if t.shape != (R,):
        raise ValueError(f"tokens_per_rank: expected an int or shape [{R}], got {tuple(t.shape)}")
    if bool((t < 0).any()):
        raise ValueError(f"tokens_per_rank: expected values >= 0, got {t.tolist()}")
    return t


