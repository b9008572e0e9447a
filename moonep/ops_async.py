"""The asynchronous forms of moonep's collective ops, for ``async_op=True`` under ``torch.compile``.

    work = ep.dispatch(x_b, idx_b, w_b, async_op=True)   # moonep::dispatch_async: B's rows start moving
    out_a = experts(h_a)                                  # A's experts: graph code between the two ops
    h_b = work.wait()                                     # moonep::wait_work

As torch's functional collectives split a collective from its ``wait_tensor``, every collective op
``moonep::<op>`` of :mod:`moonep.ops` that takes ``async_op`` has a twin ``moonep::<op>_async``: the same
arguments, the same outputs (none for an op that writes in place) plus a *work tensor* (int64 ``[1]`` on the
instance's device).  It returns at once (:meth:`moonep.work.Overlap.start_compiled`: CUDA, kernels queued on
the communication stream; host, the worker thread).  ``moonep::wait_work(outs, work, op_id, keep)`` takes
every output (and every tensor written in place) as written in place: whatever reads them is ordered after
the wait by the graph's data flow, whatever the compiler's scheduling; inductor does the write in place.  A
compiler that copies an output before the wait gets the call's values in the copy at the wait
(``moonep.work._copy_into``), never an unfinished read.  The wait also reads (``keep``) the call's inputs,
whose memory a compiler then does not reuse while the call may read them, and, from
:mod:`moonep.compile_order`, what the program computes between the call and the wait, before which no
scheduler then moves the wait (the overlap stays).

Autograd: ``dispatch_async`` and ``combine_async`` have the synchronous ops' backward (a synchronous
collective in the compiled backward graph).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import op_state
from .ops import (_LIB, _autograd, _below_autograd, _combine, _combine_bwd, _combine_fake, _combine_setup,
                  _define, _dispatch_bwd, _dispatch_fake, _dispatch_impl, _dispatch_setup, _fetch_replicas,
                  _reduce_grad, _reduce_grad_fake, _reduce_replicas, combine_op, dispatch_op, fetch_replicas_op,
                  reduce_grad_op, reduce_replicas_op)

__all__ = ["dispatch_async_op", "combine_async_op", "reduce_grad_async_op", "reduce_replicas_async_op",
           "fetch_replicas_async_op", "wait_work_op"]


def _device_of(args) -> torch.device:
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, Tensor):
                return t.device
    raise AssertionError("a collective op without tensors")


def _define_async(op, body, fake, *, op_id_at: int, mutated: tuple = (), guarded: bool = True):
    """Define ``moonep::<op>_async`` (see the module): ``body``, ``fake`` the synchronous op's kernel and fake
    implementation; ``op_id_at``: the position of the ``int op_id`` argument; ``mutated``: those of the
    arguments written in place; ``guarded``: a work tensor that dies unwaited refuses the next call (the order
    guard; not for a replica fetch, whose slots are read only after a wait)."""
    schema = op._schema
    name = schema.name.split("::")[1]
    args = str(schema).split("(", 1)[1].rsplit(") -> ", 1)[0]
    n = len(schema.returns)
    returns = "Tensor" if n == 0 else "(" + ", ".join(["Tensor"] * (n + 1)) + ")"

    def pack(outs, work):
        return work if n == 0 else ((outs,) if n == 1 else tuple(outs)) + (work,)

    def run(*a):
        ep = op_state.instance(a[op_id_at])
        outs, work = ep._start_async(name, lambda: body(*a), lambda: fake(*a), a, [a[i] for i in mutated],
                                     guarded)
        return pack(outs, work)

    def fake_async(*a):
        return pack(fake(*a), torch.empty(1, dtype=torch.int64, device=_device_of(a)))

    return _define(f"{name}_async({args}) -> {returns}", run, fake_async), run


def _drop_last(backward):
    """The synchronous op's backward for the async one (whose work tensor gets no gradient)."""
    return lambda ctx, *grads: backward(ctx, *grads[:-1])


dispatch_async_op, _run = _define_async(dispatch_op, _dispatch_impl, _dispatch_fake, op_id_at=5)
_autograd(dispatch_async_op, _run, _dispatch_setup, _drop_last(_dispatch_bwd), inputs=(0, 2), tracked=13)
combine_async_op, _run = _define_async(combine_op, _combine, _combine_fake, op_id_at=3)
_autograd(combine_async_op, _run, _combine_setup, _drop_last(_combine_bwd), inputs=(0, 1), tracked=6)
reduce_grad_async_op, _ = _define_async(reduce_grad_op, _reduce_grad, _reduce_grad_fake, op_id_at=2)
reduce_replicas_async_op, _ = _define_async(reduce_replicas_op, _reduce_replicas, lambda *a: None, op_id_at=3,
                                            mutated=(0,))
fetch_replicas_async_op, _ = _define_async(fetch_replicas_op, _fetch_replicas, lambda *a: None, op_id_at=3,
                                           mutated=(1,), guarded=False)


def _wait_work(outs, work, op_id, keep):
    op_state.instance(op_id)._overlap.wait_compiled(outs, work)


# not a collective (no call of the peers, not chained by moonep.compile_order), but never dead code
wait_work_op = _define("wait_work(Tensor(a!)[] outs, Tensor work, int op_id, Tensor[] keep) -> ()", _wait_work,
                       lambda *a: None, collective=False)
torch.fx.node.has_side_effect(wait_work_op)
wait_work_op.__doc__ = """``moonep::wait_work``: wait for the async call of ``work`` (a ``moonep::<op>_async``'s work
tensor) of instance ``op_id``; ``outs``: its outputs and the tensors it writes in place (see the module).
``keep``: tensors the wait only reads, so that they live until it: the call's inputs (a compiler must not reuse
their memory while the call may still read them) and, added by :mod:`moonep.compile_order`, what the program
computes between the call and its wait (so that no compiler moves the wait before that work)."""
# below autograd: the outputs keep the call's autograd history (the wait changes no value a gradient sees)
_LIB.impl("wait_work", lambda outs, work, op_id, keep: _below_autograd(wait_work_op, (outs, work, op_id, keep)),
          "Autograd")
