"""What moonep's custom ops (:mod:`moonep.ops`) look up at run time: instances by integer id, steps by token.

A ``torch.library`` op takes tensors and a few Python scalars, so the two pieces of host state of the data
path travel as:

* **the instance**: an int (``ExpertParallel.op_id``, given at construction).  A compiled graph holds it as a
  constant; the instance lives as long as its owner keeps it (a weak reference here).
* **the step** (the plan and the backend's :class:`moonep.handles.StepState` of one dispatch): a *step
  token*, an int64 ``[1]`` tensor that ``moonep::dispatch`` returns and every later op of the step takes as an
  input.  The entry is keyed by the token's data address, which is unique while the token's storage lives;
  the entry holds the token, so the address cannot be reused under it.  An entry is dropped once the token
  is referenced from nowhere else (the compiled graph and autograd let go of it after the step's backward),
  checked whenever a new step is stored.

This module imports nothing of moonep, so ``moonep.ep`` can use it without an import cycle.
"""
from __future__ import annotations

import itertools
import weakref

import torch

_INSTANCES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_STEPS: dict = {}  # token data_ptr -> (token, instance id, Dispatched without rows)


def register_instance(ep) -> int:
    """A process-unique id for ``ep`` (an :class:`moonep.ExpertParallel`), resolvable by :func:`instance`."""
    i = next(_IDS)
    _INSTANCES[i] = ep
    return i


def instance(op_id: int):
    """The ExpertParallel of ``op_id`` (raises ``ValueError`` when it was garbage collected)."""
    ep = _INSTANCES.get(int(op_id))
    if ep is None:
        raise ValueError(f"ep: expected a live ExpertParallel for op id {op_id}, got none (it was deleted)")
    return ep


def _storage_uses(t: torch.Tensor) -> int:
    # one of the counted references is the storage object made for this query
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def put_step(token: torch.Tensor, op_id: int, handle) -> None:
    """Remember ``handle`` (a :class:`moonep.Dispatched`) under ``token`` (int64 ``[1]``) and drop entries
    whose tokens nobody else holds any more."""
    for key in [k for k, (t, _, _) in _STEPS.items() if _storage_uses(t) <= 1]:
        del _STEPS[key]
    _STEPS[token.data_ptr()] = (token, int(op_id), handle)


def step(token: torch.Tensor, op_id: int):
    """The ``Dispatched`` stored under ``token`` for instance ``op_id`` (raises ``ValueError`` otherwise)."""
    ent = _STEPS.get(token.data_ptr())
    if ent is None or ent[1] != int(op_id):
        raise ValueError("step: expected the step token that moonep::dispatch returned for this ExpertParallel, "
                         f"got {'an unknown token' if ent is None else f'a token of op id {ent[1]}'}")
    return ent[2]


def live_steps() -> int:
    """Entries held now (tests check that steps are released)."""
    return len(_STEPS)
