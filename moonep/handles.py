"""The handle types of the data path: what ``dispatch`` returns and the per-step state the backends keep.

``Dispatched`` is what a user holds between ``dispatch`` and ``combine``: the outputs of the op
``moonep::dispatch``, in eager code and compiled code alike.  Its ``step`` token finds the step's host record
(:class:`Step`, kept by :mod:`moonep.op_state`), whose ``routing`` is the backend's state for the step (one
of the ``*Step`` classes below): combine, the replica fetch and reduce and both backward passes reuse it, so
nothing is planned or exchanged twice.

This module imports nothing else of moonep, so every other module can use these types.
Notation: ``R`` ranks, ``E`` experts, ``epn = E // R``, ``K`` top-k, ``s`` tokens on this rank,
``S`` the ``max_tokens`` the buffers were sized for, ``H`` hidden width, ``cap`` receive rows per rank
(``moonep.layout.capacity``: ``S*K`` with exact balance and ``align == 1``).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor


class StepState:
    """Base of the per-step states; a backend only accepts the kind it made (see ``Backend.step_type``).

    ``step`` is the sequence number of the dispatch that made it and ``instance`` the index of its
    ExpertParallel (both set by ``ExpertParallel.dispatch``): every rank must pass the same step.
    ``issued``: the :func:`weights_key` of the ``h.weights`` that dispatch handed out (:func:`check_issued`).
    """

    step: int = -1
    instance: int = -1
    issued: Any = None


@dataclass
class Step:
    """The host record of one dispatch, kept by :mod:`moonep.op_state` under the step's token: what the later
    calls of the step read (the backends' ``pack_step``/``unpack_step`` make and restore it).

    Attributes:
        cu_seqlens: int32 ``[2*epn + 1]``, slot ``j`` owns rows ``cu_seqlens[j]:cu_seqlens[j+1]``.
        slot_experts: int64 ``[2*epn]``, the global expert of each slot (``-1``: an empty replica slot).
        plan: the :class:`moonep.planner.Plan` of the step (NVLink, restored from a token: its replica tables).
        routing: the backend's :class:`StepState` (opaque: combine and the backward passes read it).
    """

    cu_seqlens: Optional[torch.Tensor]
    slot_experts: Optional[torch.Tensor]
    plan: Any  # moonep.planner.Plan (not imported: this module depends on nothing of moonep)
    routing: StepState


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


# -- the handle ------------------------------------------------------------------------------------------
class Dispatched(NamedTuple):
    """What :meth:`moonep.ExpertParallel.dispatch` returns, eagerly and under ``torch.compile`` alike (the
    outputs of the op ``moonep::dispatch``); pass it to ``combine``, ``ReplicaPool.fetch``, ``expert_matmul``.

    Attributes:
        tokens: ``[cap, H]`` in the token dtype: the received rows in slot order (slot ``j < epn`` is home
            expert ``rank*epn + j``, slot ``epn + j`` a replica).  Rows past ``cu_seqlens[-1]`` (and alignment
            padding) are zero.  With ``apply_weights="dispatch"`` every row is already multiplied by its
            routing weight.  On the NVLink backend in zero-copy mode (eager), a view of the receive buffer
            that stays valid until the next ``dispatch`` of the same instance.  fp8 dispatch: float8_e4m3fn.
        weights: ``[cap]`` in ``topk_weights``' dtype, each row's routing weight (zero in unused rows).
        cu_seqlens: int32 ``[2*epn + 1]``; slot ``j`` owns rows ``cu_seqlens[j]:cu_seqlens[j+1]``.
        slot_experts: int64 ``[2*epn]``, the global expert of each slot (``-1``: empty replica slot).
        assignment: int64 ``[E, R]`` of the step's plan (token copies of expert ``e`` computed on rank ``r``);
            replica_experts: int64 ``[R, epn]``; recv_counts: int64 ``[R]`` (see :class:`moonep.planner.Plan`).
        step: the step token, an int64 tensor that the later calls of the step take: ``[1]`` (its value means
            nothing), or on NVLink under ``torch.compile`` the step's device state (``Backend.pack_step``).
        op_id: the ExpertParallel's ``op_id``.
        num_tokens: ``s``, this rank's tokens (an int, symbolic under ``torch.compile``).
        scaled: ``apply_weights="dispatch"``: the rows are scaled already, and combine sums them plainly.
        scales: fp8 dispatch: float32 ``[cap, H/128]``, the scales of the rows of ``tokens`` (zero in unused
            rows; see :mod:`moonep.fp8`); ``None`` otherwise.
        grad_rows: fp8 dispatch under autograd: a stride-0 zero ``[cap, H]`` in the token dtype through which
            :func:`moonep.fp8.dequantize_rows` sends the rows' gradient back to ``x`` (straight through);
            ``None`` otherwise.
        rank: this rank.
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
    rank: int = 0

    @property
    def plan(self) -> "Dispatched":
        """The plan's tensors (``assignment``, ``replica_experts``, ``recv_counts``): the handle itself."""
        return self

    def num_replicas(self) -> Tensor:
        """int64 ``[R]``: occupied replica slots per rank (as :meth:`moonep.planner.Plan.num_replicas`)."""
        return (self.replica_experts >= 0).sum(1)

    @property
    def num_rows(self) -> Tensor:
        """The token copies received here, ``recv_counts[rank]`` (the same on every rank with exact balance;
        alignment padding not counted): a 0-d int64 tensor (on a GPU, reading it is a host sync)."""
        return self.recv_counts[self.rank]


Routed = Dispatched  # the name of the compiled form before both modes shared one handle


class Fetched(NamedTuple):
    """What :meth:`moonep.ReplicaPool.fetch` returns under ``torch.compile``, per projection:
    the step ``h``, the ``home [epn, *D]`` weights and their fresh ``replicas [epn, *D]``
    (``moonep.ops.prefetch_replicas``), which :func:`moonep.expert_matmul` passes to ``moonep::expert_matmul``
    (after ``work.wait()`` for a fetch with ``async_op=True``)."""

    h: Dispatched
    home: Tensor
    replicas: Tensor
    work: Optional[object] = None  # fetched with async_op=True: a moonep.work.CompiledWork, waited before a read


# -- what dispatch handed out ------------------------------------------------------------------------------
def names_key(names) -> int:
    """A checksum of the replica pool's projection names (``None``: none), which the peers compare (the same
    in every process)."""
    return zlib.crc32("\0".join(names or ()).encode())


def weights_key(t):
    """What identifies a tensor's memory and layout: a replaced or sliced tensor differs in one of them."""
    if not isinstance(t, torch.Tensor):
        return (type(t).__name__,)
    return tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr()


def _show(key) -> str:
    if len(key) == 1:
        return key[0]
    shape, stride, dtype, device, ptr = key
    return f"{dtype} {list(shape)} strides {tuple(stride)} on {device} at 0x{ptr:x}"


def check_issued(st: StepState, weights) -> None:
    """Raise ``ValueError`` naming ``h.weights`` when ``weights`` is not the tensor dispatch returned for step
    ``st`` (replaced, sliced, another step's): combine would read it out of bounds or give wrong values."""
    if st.issued is None:
        return
    got = weights_key(weights)
    if got != st.issued:
        raise ValueError(f"h.weights: expected the tensor dispatch returned ({_show(st.issued)}), got {_show(got)} "
                         "(replaced or sliced; modify it in place instead)")
