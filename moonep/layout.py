"""Token layout: where every token copy lands, given a :class:`moonep.planner.Plan`.

Destination rank ``r`` groups its rows by slot: slot ``j < epn`` is home expert ``r*epn + j``, slot
``epn + j`` is ``plan.replica_experts[r, j]``. The copies of expert ``e`` in global order
``(src, token i, choice k)`` are cut into contiguous chunks by destination rank in rank order, chunk
``r`` holding ``assignment[e, r]`` copies, so a source rank places its own copies knowing only the plan:

    row = cu_seqlens[r][slot(e, r)] + (global_index - chunk_start[e, r])

With ``align > 1`` every slot's row count is rounded up to a multiple of ``align`` (padding rows are
zero). On CPU everything here is torch ops; plans made on CUDA use one fused kernel each for
``token_destinations`` and ``cu_seqlens`` (``csrc/layout.cu``, bit-identical to the torch ops, which
remain the reference and the fallback). ``plan_and_destinations`` on CUDA is one launch that also writes
the rank's ``slot_experts`` and ``cu_seqlens``; for that plan and rank those two return views of it.
Neither path synchronises with the host, and both can be captured in a CUDA graph.
"""
from __future__ import annotations

import operator

import torch

from . import cpu_kernels as ck
from .errors import expect, expect_int, expect_slack, expect_tensor, fail
from .planner import Plan, _validate, cap_for, plan_balanced
from .planner.cuda import cu_seqlens_cuda, layout_cuda, layout_fast, plan_layout_cuda, plan_layout_fast

__all__ = ["slot_experts", "slot_sizes", "cu_seqlens", "capacity", "token_destinations", "plan_and_destinations"]


def _check_align(align):
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"align: expected an int >= 1, got {align!r}")


def _check_plan(plan) -> None:
    expect(isinstance(plan, Plan), "plan", "a moonep.planner.Plan (from plan_balanced)", type(plan).__name__)


def _check_routing(plan: Plan, rank: int, topk_idx) -> None:
    """``topk_idx`` must be the integer [s, K] routing that ``plan.counts[rank]`` counts, on the plan's device.

    Values are checked on CPU plans only (on CUDA they would cost a host sync; ``ExpertParallel`` checks
    them before planning). A routing the plan did not count would place copies in rows of other slots."""
    expect_tensor(topk_idx, "topk_idx", dim=2)
    expect(not topk_idx.dtype.is_floating_point and not topk_idx.dtype.is_complex and topk_idx.dtype != torch.bool,
           "topk_idx", "an integer dtype (int32 or int64)", topk_idx.dtype)
    dev = plan.replica_source.device
    if topk_idx.device.type != dev.type:  # (the message only on failure)
        fail("topk_idx", f"device {dev} (that of the plan)", topk_idx.device)
    if dev.type != "cpu" or topk_idx.numel() == 0:
        return
    E = plan.num_experts
    flat = topk_idx.reshape(-1).to(torch.int64)
    lo, hi = int(flat.min()), int(flat.max())
    if lo < -1 or hi >= E:
        fail("topk_idx", f"expert ids in [-1, {E})", f"values in [{lo}, {hi}]")
    cnt = torch.bincount(flat[flat >= 0], minlength=E)
    if not torch.equal(cnt, plan.counts[rank]):
        e = int((cnt != plan.counts[rank]).nonzero()[0, 0])
        raise ValueError(f"topk_idx: expected the routing plan.counts[{rank}] counts ({int(plan.counts[rank, e])} "
                         f"copies of expert {e}), got {int(cnt[e])}")


def slot_experts(plan: Plan, rank: int) -> torch.Tensor:
    """int64 [2*epn]: global expert id in each slot of ``rank`` (home experts, then replicas; -1 empty)."""
    _check_plan(plan)
    rank = _check_rank(rank, plan.num_ranks)
    pre = plan.launch_slots(rank, 1) if plan.on_device else None
    if pre is not None:  # written by plan_and_destinations' launch (no torch ops)
        return pre[0]
    epn = plan.experts_per_rank
    home = torch.arange(rank * epn, (rank + 1) * epn, device=plan.assignment.device)
    return torch.cat([home, plan.replica_experts[rank]])


def slot_sizes(plan: Plan, align: int = 1) -> torch.Tensor:
    """int64 [R, 2*epn]: rows in each slot of every rank, rounded up to a multiple of ``align``."""
    _check_plan(plan)
    _check_align(align)
    A = plan.assignment
    E, R = A.shape
    epn = E // R
    r = torch.arange(R, device=A.device)
    home = A.view(R, epn, R)[r, :, r]                                    # [R, epn]
    rep = plan.replica_experts
    rsz = A[rep.clamp(min=0), r[:, None].expand(R, epn)] * (rep >= 0)   # [R, epn]
    sz = torch.cat([home, rsz], 1)
    return (sz + (align - 1)) // align * align


def _check_rank(rank, R) -> int:
    try:
        r = operator.index(rank)
    except TypeError:
        r = -1
    if isinstance(rank, bool) or not 0 <= r < R:
        raise ValueError(f"rank: expected an int in [0, {R}), got {rank!r}")
    return r


def cu_seqlens(plan: Plan, rank: int | None = None, align: int = 1) -> torch.Tensor:
    """int32 [2*epn + 1] slot offsets of ``rank`` (or int32 [R, 2*epn + 1] for every rank if None)."""
    _check_plan(plan)
    _check_align(align)
    if rank is not None:
        rank = _check_rank(rank, plan.num_ranks)
    if plan.on_device:  # CUDA plan: written by plan_and_destinations' launch, else one small kernel
        pre = plan.launch_slots(rank, align) if rank is not None else None
        return pre[1] if pre is not None and pre[1] is not None else cu_seqlens_cuda(plan, rank, align)
    if plan.assignment.device.type == "cpu":
        cu = _offsets_cpu(*_plan_arrays_cpu(plan), align).to(torch.int32)
        return cu if rank is None else cu[rank]
    sz = slot_sizes(plan, align)
    cu = torch.nn.functional.pad(sz.cumsum(1), (1, 0)).to(torch.int32)
    return cu if rank is None else cu[rank]


def capacity(max_tokens: int, topk: int, num_ranks: int, num_experts: int, align: int = 1,
             slack: float = 0.0) -> int:
    """Receive-buffer rows per rank: ``ceil((1 + slack) * S * K) + 2 * epn * (align - 1)``.

    The plan gives a rank at most ``cap_for(R*S*K, R, slack)`` copies (``S*K`` when ``slack == 0``)
    and each of its ``2*epn`` slots adds fewer than ``align`` padding rows."""
    _check_align(align)
    expect_int(max_tokens, "max_tokens", 0)
    expect_int(topk, "topk", 1)
    expect_int(num_ranks, "num_ranks", 1)
    expect_int(num_experts, "num_experts", 1)
    slack = expect_slack(slack)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: expected a multiple of num_ranks={num_ranks}, got {num_experts}")
    epn = num_experts // num_ranks
    return cap_for(num_ranks * max_tokens * topk, num_ranks, slack) + 2 * epn * (align - 1)


def plan_and_destinations(counts: torch.Tensor, rank: int, topk_idx: torch.Tensor, *, slack: float = 0.0,
                          align: int = 1):
    """``plan_balanced(counts, slack=slack)`` and ``token_destinations(plan, rank, topk_idx, align)`` in one
    call: what a source rank needs each step. On CUDA it is one kernel launch (``moonep_plan_layout``: the
    layout's counting overlaps the plan's sequential loop) when the shapes allow, else the two calls.

    counts    int32/int64 [R, E], E % R == 0: the step's routing counts (identical on every rank)
    rank      this source rank; topk_idx int32/int64 [s, K] its expert ids (-1: masked), counted in counts[rank]
    returns   (plan, dst_rank int64 [s, K], dst_row int64 [s, K]); -1 where topk_idx == -1. On the one-launch
              CUDA path the three share one allocation (disjoint regions: the plan's workspace, then
              dst_rank, then dst_row), so holding dst_rank keeps that buffer alive.
    """
    # A call of the same kind as an earlier validated one (shapes, dtypes, slack, rank, align) skips the
    # Python checks: the host time of the launch is what bounds small plans.
    if (type(counts) is torch.Tensor and type(topk_idx) is torch.Tensor and type(rank) is int
            and type(align) is int and type(slack) is float and counts.is_cuda):
        res = plan_layout_fast(counts, slack, rank, topk_idx, align)
        if res is not None:
            return res
    _validate(counts, slack, None, None)
    _check_align(align)
    rank = _check_rank(rank, counts.shape[0])
    if (counts.is_cuda and type(topk_idx) is torch.Tensor and topk_idx.is_cuda and topk_idx.dim() == 2
            and topk_idx.dtype in (torch.int32, torch.int64)):
        res = plan_layout_cuda(counts, float(slack), rank, topk_idx, align)
        if res is not None:
            return res
    plan = plan_balanced(counts, slack=slack)
    dst_rank, dst_row = token_destinations(plan, rank, topk_idx, align=align)
    return plan, dst_rank, dst_row


def token_destinations(plan: Plan, rank: int, topk_idx: torch.Tensor, align: int = 1):
    """Destination of every local copy of ``rank``.

    topk_idx  int32/int64 [s, K] expert ids (-1: masked copy), the routing ``plan.counts[rank]`` counts
    returns   (dst_rank int64 [s, K], dst_row int64 [s, K]), -1 where topk_idx == -1
    """
    # CUDA plans: a call identical in kind (shape, dtype, rank, align) to an earlier validated one skips
    # the Python checks (host time bounds small layouts; values are checked on the device).
    if (type(plan) is Plan and plan.on_device and type(rank) is int and type(align) is int
            and type(topk_idx) is torch.Tensor and topk_idx.is_cuda):
        res = layout_fast(plan, rank, topk_idx, align)
        if res is not None:
            return res
    _check_plan(plan)
    _check_align(align)
    expect_tensor(topk_idx, "topk_idx")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected shape [s, K], got {tuple(topk_idx.shape)}")
    rank = _check_rank(rank, plan.num_ranks)
    _check_routing(plan, rank, topk_idx)
    if plan.on_device and topk_idx.is_cuda:  # CUDA plan: one fused kernel (csrc/layout.cu)
        res = layout_cuda(plan, rank, topk_idx, align)
        if res is not None:
            return res
    if plan.assignment.device.type == "cpu":
        return destinations_cpu(plan, rank, topk_idx, align)
    return destinations_torch(plan, rank, topk_idx, align)


def _plan_arrays_cpu(plan: Plan):
    """``(assignment [E, R], replica_experts [R, epn])`` of a CPU plan as contiguous int64 numpy arrays."""
    return (plan.assignment.to(torch.int64).contiguous().numpy(),
            plan.replica_experts.to(torch.int64).contiguous().numpy())


def _offsets_cpu(A, rep, align: int) -> torch.Tensor:
    """int64 ``[R, 2*epn + 1]``: every rank's slot offsets of a CPU plan (one numba pass) from its
    :func:`_plan_arrays_cpu`."""
    cu = torch.empty((rep.shape[0], 2 * rep.shape[1] + 1), dtype=torch.int64)
    ck.slot_offsets(A, rep, align, cu.numpy())
    return cu


def destinations_cpu(plan: Plan, rank: int, topk_idx: torch.Tensor, align: int = 1):
    """:func:`token_destinations` of a CPU plan in one pass of a numba kernel (not some twenty small torch ops),
    its arguments already checked: ``HostBackend.plan_step`` calls it with the routing it has just checked and
    counted into the plan."""
    flat = topk_idx.reshape(-1).to(torch.int64).contiguous()
    dst, row = torch.empty_like(flat), torch.empty_like(flat)
    A, rep = _plan_arrays_cpu(plan)
    ck.copy_destinations(flat.numpy(), plan.counts[:rank].sum(0).to(torch.int64).numpy(), A, rep,
                         _offsets_cpu(A, rep, align).numpy(), plan.experts_per_rank, dst.numpy(), row.numpy())
    return dst.view(topk_idx.shape), row.view(topk_idx.shape)


def destinations_torch(plan: Plan, rank: int, topk_idx: torch.Tensor, align: int = 1):
    """:func:`token_destinations` in torch ops, on any device (a CUDA plan the fused kernel does not take;
    checked against the CPU kernel in the tests).  Arguments already checked."""
    A = plan.assignment
    E, R = A.shape
    epn = E // R
    dev = A.device
    flat = topk_idx.reshape(-1).to(torch.int64)
    n = flat.numel()
    valid = flat >= 0
    ec = torch.where(valid, flat, E)                                     # masked -> bucket E
    # index of each copy among this rank's copies of its expert, in (i, k) order
    _, perm = torch.sort(ec, stable=True)
    cnt = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, ec, torch.ones_like(ec))
    start = cnt.cumsum(0) - cnt
    within = torch.arange(n, device=dev) - start[ec[perm]]
    local = torch.empty_like(within).scatter_(0, perm, within)
    e = ec.clamp(max=E - 1)
    # global index of the copy among all copies of e: sources < rank come first
    g = plan.counts[:rank].sum(0)[e] + local
    # destination rank: chunk holding g. Flatten (e, r) into one sorted sequence so one searchsorted
    # call answers every copy: key(e, r) = off[e] + cumA[e, r], query off[e] + g.
    cumA = A.cumsum(1)
    L = plan.expert_counts
    off = L.cumsum(0) - L
    keys = (off[:, None] + cumA).reshape(-1)
    pos = off[e] + g
    dst = torch.searchsorted(keys, pos, right=True) - e * R
    dst = dst.clamp(0, R - 1)                                            # masked copies only
    chunk_start = cumA[e, dst] - A[e, dst]
    # slot of e on dst: home slot, or epn + its place among dst's (ascending) replicas
    rep = torch.where(plan.replica_experts >= 0, plan.replica_experts, E)
    rkeys = (torch.arange(R, device=dev)[:, None] * (E + 1) + rep).reshape(-1)
    j = torch.searchsorted(rkeys, dst * (E + 1) + e) - dst * epn
    slot = torch.where(e // epn == dst, e % epn, epn + j)
    cu = cu_seqlens(plan, None, align).to(torch.int64)
    row = cu[dst, slot] + (g - chunk_start)
    neg = torch.full_like(row, -1)
    return (torch.where(valid, dst, neg).view(topk_idx.shape),
            torch.where(valid, row, neg).view(topk_idx.shape))
