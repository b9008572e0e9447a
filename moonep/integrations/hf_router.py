"""A patched block's router under ``torch.compile`` inside :func:`moonep.eager_math.bitwise`: the model's own
router code, run as eager runs it.

:func:`patch_hf_moe` leaves the router's maths untouched; compiled, inductor regenerates it (softmax in
float32, top-k, renormalisation: other roundings than eager's), which is the default.  For bit-equality with
eager, :func:`keep_router_eager` gives the router a subclass of its own class whose ``forward`` is the
original one, except when compiled inside ``bitwise()``: then it is one ``moonep::eager_math`` op that calls
the original ``forward`` through ``torch.func.functional_call`` on a meta-device copy of the router (its
non-tensor attributes), with the router's live parameters and buffers as the op's inputs (the meta copy
holds no tensor data).
"""
from __future__ import annotations

import copy
import itertools

import torch
from torch import Tensor, nn

from .. import eager_math

__all__ = ["keep_router_eager"]

_CLASSES: dict = {}
_IDS = itertools.count()


def _router_fn(template: nn.Module, names: list):
    def fn(*xs):
        *ts, n_args = xs  # the call's tensor arguments, then the router's parameters and buffers by name
        n_args = int(n_args)
        return torch.func.functional_call(template, dict(zip(names, ts[n_args:])), tuple(ts[:n_args]))
    return fn


def _router_class(base: type) -> type:
    if base not in _CLASSES:
        def forward(self, *args, **kwargs):
            if kwargs or not eager_math.as_ops() or not all(isinstance(a, Tensor) for a in args):
                return base.forward(self, *args, **kwargs)
            state = dict(self.named_parameters())
            state.update(self.named_buffers())
            outs = eager_math.call(self.moonep_router_key, *args, *[state[n] for n in self.moonep_router_names],
                                   len(args))
            return tuple(outs) if len(outs) > 1 else outs[0]

        _CLASSES[base] = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                                       "__qualname__": base.__qualname__})
    return _CLASSES[base]


def keep_router_eager(block: nn.Module) -> None:
    """Make ``block``'s router (its ``gate`` or ``router`` child module) run its own code eagerly when
    compiled inside ``eager_math.bitwise()`` (see the module docstring); a block without one is left as it
    is.  Idempotent."""
    for attr in ("gate", "router"):
        r = getattr(block, attr, None)
        if not isinstance(r, nn.Module) or r is getattr(block, "experts", None):
            continue
        if type(r) in _CLASSES.values():
            return
        names = [n for n, _ in r.named_parameters()] + [n for n, _ in r.named_buffers()]
        template = copy.deepcopy(r).to("meta")
        r.moonep_router_key = eager_math.register(_router_fn(template, names), f"hf_router.{next(_IDS)}")
        r.moonep_router_names = names
        r.__class__ = _router_class(type(r))
        return
