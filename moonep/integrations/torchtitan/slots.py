"""An experts module's own forward on moonep's ``2*epn`` slots: home rows with its own weights, replica rows
with the replica pool's, grouped (no host sync), differentiable.

torchtitan's inner experts (``GroupedExperts``, ``GptOssGroupedExperts``) take ``(rows [R, D], counts [e])``
and multiply every group of rows by its expert's slice of their ``[e, ...]`` parameters.  Calling that forward
twice reproduces their maths exactly on moonep's slots, without copying a weight:

    out[:cu[epn]]          = forward(rows,            counts[:epn])  with the module's own parameters
    out[cu[epn]:cu[2epn]]  = forward(rows from cu[epn], counts[epn:])  with the pool's replicas

A grouped GEMM starts its first group at row 0, so the replica rows are moved to the front of a scratch copy
(an index op on activations, as :mod:`moonep.experts` does).  The pool slots are shared by every layer, so
the graph of the two calls is kept here and differentiated in the backward, after the replicas were fetched
again into the same memory (``Replicas.weights_for_backward``); the replica gradients then go home through
``Replicas.reduce`` (collective: every rank runs it, rows or not).
"""
from __future__ import annotations

import torch

from ...experts import _shift


def _masked(rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``rows`` with the rows outside ``keep`` set to zero (``where``: a grouped GEMM leaves the rows past its
    last group unwritten, in its output and in its input's gradient, so both are masked, never multiplied)."""
    return torch.where(keep[:, None], rows, rows.new_zeros(()))


def slot_forward(fn, rows: torch.Tensor, cu: torch.Tensor, home: dict, replicas: dict) -> torch.Tensor:
    """``fn(params, rows, counts)`` on the home slots, then on the replica slots; the two merged by row.

    Args:
        fn: ``(params {name: [e, ...]}, rows [cap, D], counts int32 [e]) -> [cap, N]``; rows past
            ``counts.sum()`` may come back as anything (they are masked here).
        rows: ``[cap, D]`` grouped by slot; ``cu``: int32 ``[2*epn + 1]`` on the rows' device.
        home, replicas: ``{name: [epn, ...]}`` tensors (the module's own, the pool's).
    Returns:
        ``[cap, N]``; rows past ``cu[-1]`` are zero.
    """
    epn = (cu.shape[0] - 1) // 2
    counts = cu[1:] - cu[:-1]
    idx = torch.arange(rows.shape[0], device=rows.device)
    is_home = idx < cu[epn]
    out_home = fn(home, _masked(rows, is_home), counts[:epn])
    n_rep = cu[2 * epn] - cu[epn]
    out_rep = fn(replicas, _masked(_shift(rows, cu[epn]), idx < n_rep), counts[epn:])
    back = out_rep.index_select(0, (idx - cu[epn]).clamp_(min=0))
    out = torch.where(is_home[:, None], out_home, back)
    return _masked(out, idx < cu[2 * epn])


class _SlotForward(torch.autograd.Function):
    """:func:`slot_forward` with the replicas' gradients sent home; its graph is built in the forward (nested)
    and differentiated in the backward once the pool holds this layer's replicas again."""

    @staticmethod
    def forward(ctx, rows, meta, *homes):
        fn, names, reps, cu = meta
        with torch.enable_grad():
            rows_l = rows.detach().requires_grad_(rows.requires_grad)
            home_l = [p.detach().requires_grad_(p.requires_grad) for p in homes]
            # .data: a view of the pool slots with its own version counter, so that the backward's refetch
            # into the same memory is read by this graph instead of raising as an in-place change
            rep_l = [r.weights().data.requires_grad_(p.requires_grad) for r, p in zip(reps, homes)]
            out = slot_forward(fn, rows_l, cu, dict(zip(names, home_l)), dict(zip(names, rep_l)))
        ctx.graph, ctx.reps = (out, rows_l, home_l, rep_l), reps
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        if ctx.graph is None:
            raise RuntimeError("moonep's experts: a second backward through the same forward (retain_graph=True) "
                               "is not supported; run the forward again")
        out, rows_l, home_l, rep_l = ctx.graph
        for r in ctx.reps:
            r.weights_for_backward()  # collective when the slots were reused by a later layer
        leaves = [rows_l, *home_l, *rep_l]
        grads = (torch.autograd.grad(out, leaves, g, allow_unused=True) if out.requires_grad
                 else [None] * len(leaves))
        fill = lambda gr, like: torch.zeros_like(like) if gr is None else gr  # noqa: E731
        n = len(home_l)
        # every rank reduces every projection, rows or not: the reduce is a collective
        param_grads = [r.reduce(fill(grads[1 + i], home_l[i]), fill(grads[1 + n + i], rep_l[i]))
                       for i, r in enumerate(ctx.reps)]
        ctx.graph = ctx.reps = None
        return (None if grads[0] is None else grads[0], None, *param_grads)


class _SlotForwardRecomputed(torch.autograd.Function):
    """:class:`_SlotForward` for a forward under activation checkpointing (saved-tensor hooks active): a graph
    kept privately would be packed by the checkpoint's hooks and then refused or recomputed under it, so the
    forward keeps no graph and the backward builds it, from the saved rows and home weights, once the pool
    holds this layer's replicas again (the experts' forward runs once more, in the backward)."""

    @staticmethod
    def forward(ctx, rows, meta, *homes):
        fn, names, reps, cu = meta
        ctx.save_for_backward(rows, *homes)
        ctx.meta = meta
        with torch.no_grad():
            return slot_forward(fn, rows, cu, dict(zip(names, homes)), {n: r.weights() for n, r in zip(names, reps)})

    @staticmethod
    def backward(ctx, g):
        fn, names, reps, cu = ctx.meta
        rows, *homes = ctx.saved_tensors
        weights = [r.weights_for_backward() for r in reps]
        with torch.enable_grad():
            rows_l = rows.detach().requires_grad_(ctx.needs_input_grad[0])
            home_l = [p.detach().requires_grad_(p.requires_grad) for p in homes]
            rep_l = [w.data.requires_grad_(p.requires_grad) for w, p in zip(weights, homes)]
            out = slot_forward(fn, rows_l, cu, dict(zip(names, home_l)), dict(zip(names, rep_l)))
            ctx.graph, ctx.reps = (out, rows_l, home_l, rep_l), reps
        return _SlotForward.backward(ctx, g)


def _checkpointing() -> bool:
    """Saved-tensor hooks are active: this forward runs under activation checkpointing (or offloading)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def module_on_slots(fn, rows: torch.Tensor, cu: torch.Tensor, names: list, homes: list, replicas: list):
    """:func:`slot_forward` under autograd: differentiable with respect to ``rows`` and ``homes`` (each
    ``[epn, ...]``, read in place); ``replicas`` the :class:`moonep.Replicas` of each home tensor.  The
    replica rows' parameter gradients are added to their home experts' on the home ranks (collective in the
    backward).  Under activation checkpointing the experts' forward is run again in the backward."""
    if not (torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in homes))):
        return slot_forward(fn, rows, cu, dict(zip(names, homes)), {n: r.weights() for n, r in zip(names, replicas)})
    fwd = _SlotForwardRecomputed if _checkpointing() else _SlotForward
    return fwd.apply(rows, (fn, names, replicas, cu), *homes)
