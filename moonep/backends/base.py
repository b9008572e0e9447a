"""What a backend provides to :class:`moonep.ExpertParallel`: one screen, every stage of the data path.

``ExpertParallel`` (the bodies of the ops in ``moonep/ops.py``) checks arguments, checks the call order across
ranks and calls these methods; a backend moves the rows.  The backward passes reuse the forward ones: the backward of
dispatch is a combine of the rows' gradients (:meth:`dispatch_backward`), the backward of combine is a
dispatch of ``dy`` over the same step (:meth:`combine_backward`), the backward of prefetch is
:meth:`reduce_grad`.  Every method that moves data is collective: all ranks call it in the same order.

Shapes: ``s`` tokens here, ``K`` top-k, ``H`` hidden, ``cap`` receive rows, ``epn`` experts per rank,
``D`` any trailing weight shape.  The step state (``st``) is the backend's :class:`moonep.handles.StepState`.
"""
from __future__ import annotations

import contextlib

import torch

from ..errors import expect
from ..handles import StepState


class Backend:
    """The interface; see :mod:`moonep.backends.host`, :mod:`.nvlink` and :mod:`.local`."""

    name = "base"
    step_type = StepState
    # topk_weights dtypes the backend moves
    weight_dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    # whether the backward passes also check the call order with the peers (the nvlink backend's kernels
    # cannot tell ops apart, and its backward passes run inside CUDA graphs: they check nothing on the host)
    checks_backward_order = True
    # header all-gather for the call-order check, or None for the transport's own
    order_exchange = None
    # bad token values (fp8 dispatch: a non-finite x) are flagged on device and raised by a later call, as the
    # nvlink backend does for routing values; False: wire_rows raises before the call's header
    lazy_input_errors = False

    def plan_step(self, x, topk_idx, topk_weights, num_global_tokens=None):
        """Validate values, all-gather the routing counts, plan and lay out. Collective.

        Shapes, dtypes and devices were checked by ``ExpertParallel`` (and agreed on by every rank); value
        errors are the backend's to surface on every rank.  Returns ``(plan, st)``.
        """
        raise NotImplementedError

    def wire_rows(self, x, pow2_scales: bool):
        """fp8 dispatch: ``x`` (bf16/fp16/fp32 ``[s, H]``, or a checked pair ``(x_fp8 [s, H], scales float32
        [s, H/128])``) -> uint8 wire rows ``[s, H + 4*H/128]`` (:mod:`moonep.fp8`), moved by :meth:`dispatch`
        as rows of bytes.  Raises ``ValueError`` naming ``x`` for inf/nan (in the scales of a pair)."""
        from .. import fp8

        if isinstance(x, (tuple, list)):
            bad = ~torch.isfinite(x[1])
            expect(not bool(bad.any()), "x[1] (scales)", "finite scales", f"{int(bad.sum())} non-finite scale(s)")
            return fp8.pack_pair(x[0], x[1])
        return fp8.quantize_wire(x, pow2_scales=pow2_scales, check_finite=True)

    def slots(self, plan, st):
        """``(cu_seqlens int32 [2*epn+1], slot_experts int64 [2*epn])`` of this rank."""
        raise NotImplementedError

    def dispatch(self, x, topk_weights, st, tracked: bool):
        """``x [s, H]``, ``topk_weights [s, K]`` -> ``(tokens [cap, H], weights [cap])`` in the step's rows.

        ``tracked``: autograd records this dispatch (the nvlink backend then returns copies, not views).
        fp8 dispatch passes the uint8 wire rows of :meth:`wire_rows` as ``x`` (moved as bytes, ``tokens`` uint8)."""
        raise NotImplementedError

    def combine(self, rows, weights, st, out_dtype):
        """``rows [cap, H]``, ``weights [cap]`` or ``None`` (plain sum) -> ``y [s, H]`` in ``out_dtype``."""
        raise NotImplementedError

    def check_rows(self, rows, st) -> None:
        """Raise ``ValueError`` if ``rows`` cannot be combined for step ``st`` (checked before the call's
        header, so every rank refuses together)."""

    def in_recv(self, rows) -> bool:
        """Whether ``rows`` (dispatch's rows or weights) is a view of a receive buffer that the next dispatch
        reuses (zero-copy backends)."""
        return False

    def check_live(self, rows, st, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` if ``rows`` is a view of the receive buffer (:meth:`in_recv`) that
        holds step ``st``'s received rows no longer: a later dispatch has overwritten them."""

    def dispatch_backward(self, g_tokens, g_weights, st, want_x: bool, want_w: bool, x_dtype, w_dtype):
        """Backward of dispatch: ``(gx [s, H] or None, gw [s, K] or None)`` from the rows' gradients."""
        raise NotImplementedError

    def combine_backward(self, gy, st, own: bool = False):
        """Backward of combine: ``gy [s, H]`` sent over the step's routing -> ``[cap, H]`` (dy of each row);
        ``own``: a tensor of its own (else it may be a view of a buffer that the next collective reuses)."""
        raise NotImplementedError

    def prefetch(self, plan, local_weight):
        """``[epn, *D]`` home weights -> ``[2*epn, *D]`` (home experts, then replicas; empty slots zero)."""
        raise NotImplementedError

    def prefetch_replicas(self, plan, local_weights, replicas, fresh: bool = False):
        """Only the replica slots, of several projections in one call: each ``local_weights[i] [epn, *D_i]``
        is read in place, this rank's replicas are written into ``replicas[i] [epn, *D_i]`` (empty slots
        zero).  ``fresh``: the buffers are new and never passed again (every empty slot is zeroed, nothing
        of them is kept); else persistent pool buffers.  Returns ``replicas``."""
        raise NotImplementedError

    def reduce_grad(self, plan, grad):
        """``[2*epn, *D]`` slot gradients -> ``[epn, *D]``: replica parts added at home, in rank order."""
        raise NotImplementedError

    def reduce_replicas(self, plan, home_grad, replica_grad, scratch: bool = False):
        """:meth:`reduce_grad` with the two halves apart: ``home_grad [epn, *D]`` plus the replica slots'
        gradients of every rank (``replica_grad [epn, *D]`` here) -> ``[epn, *D]``.  ``scratch``: the caller
        no longer needs ``home_grad`` (a backward's own): the sum may be made in it."""
        raise NotImplementedError

    # -- the step as a custom op's token (moonep.ops): its layout is the backend's own ------------------
    # int64 words of a compiled step's token besides its 2*s*K destination words; 0: the token is int64 [1]
    # and the registry keeps the whole step (it holds no device tensor that a compiled graph must see)
    token_state_words = 0

    def pack_step(self, h, device, graph: bool):
        """``(token, kept)`` for step ``h`` (a :class:`moonep.handles.Step`): ``token`` an int64 tensor (``[1]``,
        or under ``torch.compile`` (``graph``) ``[token_state_words + 2*s*K]`` on ``device`` when the step's
        device state travels in it), ``kept`` what ``moonep.op_state`` keeps for :meth:`unpack_step`."""
        if graph:  # on the graph's device, as the fake implementation says
            return torch.zeros(1, dtype=torch.int64, device=device), h
        return torch.empty(1, dtype=torch.int64), h

    def unpack_step(self, kept, token):
        """The :class:`moonep.handles.Step` of a step, from what :meth:`pack_step` returned."""
        return kept

    def copied_rows(self):
        """A context in which :meth:`dispatch` returns rows of its own, never views of a buffer that the next
        dispatch reuses (a compiled graph keeps the rows past it)."""
        return contextlib.nullcontext()

    def abandon_call(self, why: str) -> None:
        """A call ended part way on this rank (see :meth:`moonep.transport.Transport.abandon_call`): what
        carries its headers and data refuses every later call, naming ``why``."""

    def label(self, op: str) -> None:
        """The collective call now running (named in errors the backend raises later)."""

    def after_call(self) -> None:
        """Raise errors recorded during the call (the nvlink kernels record them on device)."""

    def synchronize(self) -> None:
        """Wait for this rank's queued work and raise any recorded error."""

    def close(self, peers_ok: bool = True, check: bool = True) -> None:
        """Release buffers (collective unless a peer failed: ``peers_ok=False``)."""
