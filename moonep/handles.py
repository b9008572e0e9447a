"""The handle types of the data path: what ``dispatch`` returns and the per-step state the backends keep.

``Dispatched`` is what a user holds between ``dispatch`` and ``combine``.  Its ``routing`` field is the
backend's state for the step (one of the ``*Step`` classes below), which combine, prefetch, reduce_grad and
both backward passes reuse, so nothing is planned or exchanged twice.

This module imports nothing else of moonep, so every other module can use these types.
Notation: ``R`` ranks, ``E`` experts, ``epn = E // R``, ``K`` top-k, ``s`` tokens on this rank,
``S`` the ``max_tokens`` the buffers were sized for, ``H`` hidden width, ``cap`` receive rows per rank
(``moonep.layout.capacity``: ``S*K`` with exact balance and ``align == 1``).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union

import torch
from torch import Tensor


class StepState:
    """Base of the per-step states; a backend only accepts the kind it made (see ``Backend.step_type``).

    ``step`` is the sequence number of the dispatch that made it and ``instance`` the index of its
    ExpertParallel (both set by ``ExpertParallel.dispatch``): every rank must pass the same step.
    ``issued``: what dispatch handed out in the ``Dispatched`` of this step (:func:`issue`).
    """

    step: int = -1
    instance: int = -1
    issued: Any = None


@dataclass
class Dispatched:
    """What :meth:`moonep.ExpertParallel.dispatch` returns; pass it to ``combine``, ``prefetch``, ``reduce_grad``.

    Attributes:
        tokens: ``[cap, H]`` in the token dtype: the received rows in slot order (slot ``j < epn`` is home
            expert ``rank*epn + j``, slot ``epn + j`` a replica).  Rows past ``cu_seqlens[-1]`` (and
            alignment padding) are zero.  With ``apply_weights="dispatch"`` every row is already multiplied
            by its routing weight.  On the nvlink backend in zero-copy mode, a view of the receive buffer
            that stays valid until the next ``dispatch`` of the same instance.
        weights: ``[cap]`` in the dtype of ``topk_weights``: the routing weight of each row, zero in unused
            rows.
        cu_seqlens: int32 ``[2*epn + 1]``: slot ``j`` owns rows ``cu_seqlens[j]:cu_seqlens[j+1]``.
        slot_experts: int64 ``[2*epn]``: the global expert of each slot, home experts first, ``-1`` for an
            empty replica slot.
        num_rows: the rows used, ``cu_seqlens[-1]`` (the same on every rank with exact balance): a Python
            int, or a 0-d int64 device tensor on the nvlink backend (reading it is a host sync the backend
            avoids).
        plan: the :class:`moonep.planner.Plan` of this step (identical on every rank).
        routing: the backend's :class:`StepState` for this step (opaque: combine and the backward passes
            read it).
        scales: with ``dispatch_dtype=torch.float8_e4m3fn``: float32 ``[cap, H/128]``, the scales of the rows
            of ``tokens`` (then float8_e4m3fn ``[cap, H]``; both views of the received wire rows, see
            :mod:`moonep.fp8`), zero in unused rows; ``None`` otherwise.
        grad_rows: fp8 dispatch under autograd only: a stride-0 zero ``[cap, H]`` in the token dtype through
            which the gradient of the dequantised rows reaches the backward of dispatch (straight through;
            :func:`moonep.fp8.dequantize_rows` uses it); ``None`` otherwise.
    """

    tokens: torch.Tensor
    weights: torch.Tensor
    cu_seqlens: torch.Tensor
    slot_experts: torch.Tensor
    num_rows: Union[int, torch.Tensor]
    plan: Any  # moonep.planner.Plan (not imported: this module depends on nothing of moonep)
    routing: StepState
    scales: Optional[torch.Tensor] = None
    grad_rows: Optional[torch.Tensor] = field(default=None, repr=False)


@dataclass
class HostStep(StepState):
    """Who sends what to whom in one step of the host backends (MPI, torch.distributed, local).

    Attributes:
        num_tokens: ``s``, tokens on this rank.
        pair_token: int64 ``[n_send]``: the token of each sent (token, destination rank) pair, grouped by
            destination rank in rank order, ascending token inside a group.
        send_rows: int64 ``[n_send, K]``: for each pair, the rows on the destination of choices
            ``k = 0..K-1`` (``-1`` where choice ``k`` goes to another rank or is masked).
        send_splits: ``R`` ints, pairs sent to each rank.
        recv_rows: int64 ``[n_recv, K]``: the same lists as received, rows of this rank's buffer (``None``
            until the dispatch exchange when the packed CPU dispatch carries them).
        recv_splits: ``R`` ints, pairs received from each rank (``None`` until that exchange, likewise).
        capacity: ``cap``, rows of the receive buffer.
        cache: derived index arrays (e.g. the token order of the combine's final sum).
    """

    num_tokens: int
    pair_token: torch.Tensor
    send_rows: torch.Tensor
    send_splits: list
    recv_rows: Optional[torch.Tensor]
    recv_splits: Optional[list]
    capacity: int
    cache: dict = field(default_factory=dict, repr=False)


@dataclass
class NVLinkStep(StepState):
    """One step of the nvlink backend (all device tensors; nothing here was copied to the host).

    Attributes:
        num_tokens: ``s``, tokens on this rank.
        dst_rank: int64 ``[s, K]``: destination rank of each choice, ``-1`` masked.
        dst_row: int64 ``[s, K]``: its row on that rank, ``-1`` masked.
        generation: the dispatch that filled the receive buffer for this step (zero-copy views of an older
            step are refused by combine).
        zero_copy: whether ``tokens``/``weights`` are views of the receive buffer.
        row_first: int32 ``[cap]``: the first row here of each row's token, ``-1`` for unwritten rows.
        rec: int32 ``[cap, K]``: at first rows, the token's K-aligned rows here (``-1`` elsewhere).
        src: int32 ``[cap]``: at first rows, ``src_rank * S + src_token``.
        tokfirst: int32 ``[R, S]``: the first row here of each source token, ``-1`` none (fused dispatch
            only; ``None`` after the two-kernel dispatch).
        w32: fp32 ``[s, K]``: the routing weights as the kernels read them.
        cu: int32 ``[2*epn + 1]``: this rank's ``cu_seqlens`` (a view of the planner launch's output).
    """

    num_tokens: int
    dst_rank: torch.Tensor
    dst_row: torch.Tensor
    generation: int = 0
    zero_copy: bool = True
    row_first: Optional[torch.Tensor] = None
    rec: Optional[torch.Tensor] = None
    src: Optional[torch.Tensor] = None
    tokfirst: Optional[torch.Tensor] = None
    w32: Optional[torch.Tensor] = None
    cu: Optional[torch.Tensor] = None


# -- the compiled form (moonep.ops) --------------------------------------------------------------------------
class Routed(NamedTuple):
    """What ``moonep.ops.dispatch`` returns, and ``ExpertParallel.dispatch`` in compiled code: the compiled form of
    :class:`moonep.Dispatched`, with the same fields (``tokens``, ``weights``, ``cu_seqlens``, ``slot_experts``,
    ``num_rows``, ``plan``, ``scales``, ``grad_rows``); in place of its opaque ``routing`` it carries the step
    token (``step``) and the instance's ``op_id``.

    Attributes:
        tokens: ``[cap, H]`` in the token dtype, rows in slot order (padding rows zero).
        weights: ``[cap]`` in ``topk_weights``' dtype, each row's routing weight.
        cu_seqlens: int32 ``[2*epn + 1]``; slot ``j`` owns rows ``cu_seqlens[j]:cu_seqlens[j+1]``.
        slot_experts: int64 ``[2*epn]``, the global expert of each slot (``-1``: empty replica slot).
        assignment: int64 ``[E, R]`` of the plan; replica_experts: int64 ``[R, epn]``; recv_counts: int64 ``[R]``.
        step: int64, the step token the other ops take: ``[1]`` (its value means nothing) on the host
            backends; on NVLink the step's device state, ``[token_state_words + 2*s*K]`` (see
            ``Backend.pack_step``).
        op_id: the ExpertParallel's ``op_id``.
        num_tokens: ``s``, this rank's tokens (an int, symbolic under ``torch.compile``).
        scaled: ``apply_weights="dispatch"``: every row of ``tokens`` is already multiplied by its weight, and
            :func:`moonep.ops.combine` sums them plainly.
        scales, grad_rows: fp8 dispatch (``tokens`` float8_e4m3fn): float32 ``[cap, H/128]`` and the stride-0
            ``[cap, H]`` through which :func:`moonep.fp8.dequantize_rows` sends the rows' gradient back, as in
            :class:`moonep.Dispatched`; ``None`` otherwise.
    """

    tokens: Tensor
    weights: Tensor
    cu_seqlens: Tensor
    slot_experts: Tensor
    assignment: Tensor
    replica_experts: Tensor
    recv_counts: Tensor
    step: Tensor
    op_id: int
    num_tokens: int
    scaled: bool = False
    scales: Optional[Tensor] = None
    grad_rows: Optional[Tensor] = None

    @property
    def plan(self) -> "Routed":
        """The plan's tensors (``assignment``, ``replica_experts``, ``recv_counts``), as ``Dispatched.plan``
        gives them: the handle itself."""
        return self

    @property
    def num_rows(self) -> Tensor:
        """The rows used, ``cu_seqlens[-1]``: a 0-d int32 tensor (reading it is a host sync), as
        ``Dispatched.num_rows`` on the NVLink backend."""
        return self.cu_seqlens[-1]


class Fetched(NamedTuple):
    """What :meth:`moonep.ReplicaPool.fetch` returns for a :class:`Routed` (compiled code), per projection:
    the step ``h``, the ``home [epn, *D]`` weights and their fresh ``replicas [epn, *D]``
    (``moonep.ops.prefetch_replicas``), which :func:`moonep.expert_matmul` passes to ``moonep::expert_matmul``."""

    h: Routed
    home: Tensor
    replicas: Tensor


# -- what dispatch handed out ------------------------------------------------------------------------------
def _key(t):
    """What identifies a tensor's memory and layout: a replaced or sliced tensor differs in one of them."""
    if not isinstance(t, torch.Tensor):
        return None
    return tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr()


def _show(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)} strides {tuple(t.stride())} on {t.device} at 0x{t.data_ptr():x}"


def issue(h: Dispatched) -> Dispatched:
    """Record in ``h.routing`` the fields of ``h`` that later calls read (``weights``, ``plan``), as dispatch
    hands them out: :func:`check_issued` then refuses a handle whose fields were replaced."""
    h.routing.issued = (_key(h.weights), _show(h.weights), h.plan)
    return h


def reissue(h: Dispatched, **changes) -> Dispatched:
    """``dataclasses.replace(h, **changes)`` with its own copy of the step state, issued anew (what
    :mod:`moonep.ops` does with the tensors a compiled graph passes, checked by the op)."""
    st = copy.copy(changes.pop("routing", h.routing))
    return issue(dataclasses.replace(h, routing=st, **changes))


def check_issued(h: Dispatched) -> None:
    """Raise ``ValueError`` naming the field when ``h.weights`` or ``h.plan`` is not what dispatch handed out
    (replaced, sliced, another step's): combine would read it out of bounds or give wrong values."""
    if h.routing.issued is None:
        return
    key, shown, plan = h.routing.issued
    if h.plan is not plan:
        raise ValueError(f"h.plan: expected the plan dispatch returned in this Dispatched, got "
                         f"{type(h.plan).__name__} object at 0x{id(h.plan):x} (replaced)")
    if _key(h.weights) != key:
        raise ValueError(f"h.weights: expected the tensor dispatch returned ({shown}), got {_show(h.weights)} "
                         "(replaced or sliced; modify it in place instead)")
