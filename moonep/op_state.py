"""What moonep's custom ops (:mod:`moonep.ops`) look up at run time: instances by integer id, steps by token.

A ``torch.library`` op takes tensors and a few Python scalars, so the pieces of host state of the data path
travel as:

* **the instance**: an int (``ExpertParallel.op_id``, given at construction).  A compiled graph holds it as a
  constant; the instance lives as long as its owner keeps it (a weak reference here).
* **the step** (the :class:`moonep.handles.Step` of one dispatch: its plan and the backend's state): a
  *step token*, an int64 tensor that ``moonep::dispatch`` returns and every later op of the step takes as
  an input (``[1]``; compiled on NVLink, the step's device state itself, see ``moonep.ops``).  The entry is
  keyed by the token's data address and holds only a *weak* reference to the token's storage.  A compiled
  NVLink step's entry holds no tensor at all, so a CUDA graph's memory pool holds no allocation that is
  not an output of the graph; an eager step's entry holds the step (its device tables on NVLink) until it
  is dropped.  An entry is dropped at the next stored step once the token's storage died (the handle,
  the compiled graph and autograd let go of it after the step's backward), and an instance's entries when
  it is closed; until then a lookup at its address still finds it (a graph replay makes a new tensor at
  the recorded address and runs no Python, so a backward recorded after a replayed forward finds the step
  that way).
* **an eager pool's replicas** (:class:`moonep.Replicas`): an int too (:func:`replicas_id`), by which
  ``moonep::expert_matmul``'s autograd finds them again in the backward (a weak reference here).

Also here, for every custom op of moonep (``moonep.ops``, ``moonep.eager_math``): :func:`fresh_output`, as an
op may return a tensor (never one sharing memory with its inputs); and :func:`call`, how moonep's own code calls
its ops.

This module imports nothing of moonep, so ``moonep.ep`` can use it without an import cycle.
"""
from __future__ import annotations

import itertools
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class _Registry:
    """Objects by a process-unique int, held weakly (their owners keep them alive)."""

    def __init__(self, arg: str, what: str, label: str):
        self._objs: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        self._ids, self._arg, self._what, self._label = itertools.count(1), arg, what, label

    def add(self, obj) -> int:
        i = next(self._ids)
        self._objs[i] = obj
        return i

    def get(self, i: int):
        """The object of ``i`` (raises ``ValueError`` when it was garbage collected)."""
        obj = self._objs.get(int(i))
        if obj is None:
            raise ValueError(f"{self._arg}: expected a live {self._what} for {self._label} {i}, got none (it was "
                             "deleted)")
        return obj


_INSTANCES = _Registry("ep", "ExpertParallel", "op id")
_REPLICAS = _Registry("replicas", "Replicas", "id")
_STEPS: dict = {}  # token data_ptr -> (weak ref of the token's storage, instance id, host state)
_STEPS_LOCK = threading.Lock()  # async_op calls of two instances store steps from two worker threads


def fresh_output(out: torch.Tensor, *inputs) -> torch.Tensor:
    """``out``, copied when it shares memory with an input (a custom op's outputs must not alias them;
    ``None`` inputs and empty tensors are skipped)."""
    if not out.numel():
        return out
    ptr = out.untyped_storage().data_ptr()
    for t in inputs:
        if t is not None and t.numel() and t.untyped_storage().data_ptr() == ptr:
            return out.clone()
    return out


_KERNELS: dict = {}  # id(OpOverload) -> (the function an eager call runs, tensor argument positions, list ones)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def tensor_positions(op) -> tuple:
    """The positions of ``op``'s ``Tensor`` and ``Tensor?`` arguments (a collective's trailing ``after`` left out)."""
    return tuple(i for i, a in enumerate(op._schema.arguments)
                 if a.name != "after" and str(a.type) in ("Tensor", "Optional[Tensor]"))


def register_kernel(op, fn) -> None:
    """``fn(*args)`` is what an eager call of ``op`` on plain tensors runs (its Autograd kernel, or its body for
    an op without autograd): :func:`call` runs it directly.  A collective's trailing ``after`` is not passed."""
    lists = tuple(i for i, a in enumerate(op._schema.arguments) if str(a.type) == "List[Tensor]")
    _KERNELS[id(op)] = (fn, tensor_positions(op), lists)


def call(op, *args):
    """``op(*args)``.  Eagerly, on plain tensors and with no dispatch mode, the op's kernel is called here
    directly: the same function the dispatcher would run, without converting a dozen arguments to C++ and back
    (tens of µs per call, which a host-bound step pays a dozen times).  Traced code, tensor subclasses,
    dispatch modes (fake tensors, FlopCounterMode, ...) and functorch transforms go through the dispatcher.
    Under torch.profiler the call is still a range named after the op."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or torch._C._are_functorch_transforms_active():
        return op(*args)
    entry = _KERNELS.get(id(op))
    if entry is None:
        return op(*args)
    fn, tensors, lists = entry
    for i in tensors:  # (the op's tensor arguments only: a few type checks)
        t = args[i]
        if t is not None and type(t) not in _PLAIN:
            return op(*args)
    for i in lists:
        ts = args[i]
        if ts and type(ts[0]) not in _PLAIN:
            return op(*args)
    if torch.autograd._profiler_enabled():
        with torch.autograd.profiler.record_function(op.name()):
            return fn(*args)
    return fn(*args)


def register_instance(ep) -> int:
    """A process-unique id for ``ep`` (an :class:`moonep.ExpertParallel`), resolvable by :func:`instance`."""
    return _INSTANCES.add(ep)


def instance(op_id: int):
    """The ExpertParallel of ``op_id`` (raises ``ValueError`` when it was garbage collected)."""
    return _INSTANCES.get(op_id)


def replicas_id(rep) -> int:
    """A process-unique id for ``rep`` (a :class:`moonep.Replicas` of an eager pool fetch), by which
    ``moonep::expert_matmul``'s autograd finds it again (its backward refetches reused slots)."""
    if getattr(rep, "_op_id", None) is None:
        rep._op_id = _REPLICAS.add(rep)
    return rep._op_id


def replicas(rid: int):
    """The :class:`moonep.Replicas` of ``rid`` (raises ``ValueError`` when it was garbage collected)."""
    return _REPLICAS.get(rid)


def put_step(token: torch.Tensor, op_id: int, handle) -> None:
    """Remember ``handle`` (the step's host state, see ``moonep.ops``) under ``token`` (int64) and drop
    entries whose tokens died."""
    with _STEPS_LOCK:
        for key in [k for k, (r, _, _) in _STEPS.items() if r.expired()]:
            del _STEPS[key]
        _STEPS[token.data_ptr()] = (StorageWeakRef(token.untyped_storage()), int(op_id), handle)


def move_step(src: torch.Tensor, dst: torch.Tensor) -> None:
    """When ``src`` is a live step token: its step is found by ``dst`` too (a copy of it, see
    ``moonep.work.CompiledWork``); otherwise nothing."""
    if src.dtype != torch.int64 or not src.numel():
        return
    ent = _STEPS.get(src.data_ptr())
    if ent is not None and not ent[0].expired() and ent[0].cdata == src.untyped_storage()._cdata:
        put_step(dst, ent[1], ent[2])


def step(token: torch.Tensor, op_id: int):
    """The host state stored under ``token`` for instance ``op_id`` (raises ``ValueError`` otherwise)."""
    ent = _STEPS.get(token.data_ptr())
    if ent is None or ent[1] != int(op_id):
        raise ValueError("h.step: expected the step token that moonep::dispatch returned for this ExpertParallel, "
                         f"got {'an unknown token' if ent is None else f'a token of op id {ent[1]}'}")
    return ent[2]


def drop_steps(op_id: int) -> None:
    """Forget every step of instance ``op_id`` (it was closed)."""
    with _STEPS_LOCK:
        for key in [k for k, (_, i, _) in _STEPS.items() if i == int(op_id)]:
            del _STEPS[key]


def live_steps() -> int:
    """Entries held now (tests check that steps are released)."""
    return len(_STEPS)
