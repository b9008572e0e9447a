"""Optimizers over a model whose expert shards are DTensors and whose other parameters are plain tensors.

torch's foreach optimizer kernels (the default of AdamW, Adam, SGD... on CUDA) take one list per device and
dtype, and DTensor refuses a list that mixes DTensors and plain tensors.  Under DDP, or without a
wrapper, a model with moonep layers is exactly such a mix (under FSDP2 every parameter is a DTensor).  The
plain parameters there are replicated, the same on every rank, which is what DTensor's implicit replication
assumes of a plain tensor in a DTensor op: so an optimizer holding both steps under
``torch.distributed.tensor.experimental.implicit_replication`` (bitwise what the per-tensor loop computes).

Nothing is asked of the user: :func:`install` (called when the first expert DTensor is made) registers a
global optimizer-step hook that, the first time an optimizer holding both kinds steps, makes that
optimizer's ``step`` run inside the context from then on (exception-safe); that first step itself is
bracketed by the pre- and post-step hooks.
"""
from __future__ import annotations

import types

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

_INSTALLED: list = []


def install() -> None:
    """Register the step hooks once per process."""
    if not _INSTALLED:
        _INSTALLED.append((register_optimizer_step_pre_hook(_before_step),
                           register_optimizer_step_post_hook(_after_step)))


def mixes_dtensors(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` holds both DTensor and plain parameters (cached per count of parameter groups)."""
    n = len(opt.param_groups)
    seen = opt.__dict__.get("_moonep_mix")
    if seen is None or seen[0] != n:
        kinds = {isinstance(p, DTensor) for g in opt.param_groups for p in g["params"]}
        seen = opt.__dict__["_moonep_mix"] = (n, kinds == {True, False})
    return seen[1]


def _implicit_step(self, *args, **kwargs):
    """``step`` of an optimizer holding DTensor and plain parameters: the wrapped step under implicit
    replication."""
    stale = self.__dict__.pop("_moonep_first", None)  # the first step raised before its post-step hook
    if stale is not None:
        stale.__exit__(None, None, None)
    with implicit_replication():
        return self.__dict__["_moonep_inner_step"](*args, **kwargs)


def _before_step(opt, args, kwargs) -> None:
    if opt.__dict__.get("_moonep_wrapped") or not mixes_dtensors(opt):
        return
    # from the next step on: this optimizer's step (or the wrapper an LR scheduler put there) inside the context
    opt.__dict__["_moonep_inner_step"] = opt.__dict__.get("step") or opt.step
    opt.step = types.MethodType(_implicit_step, opt)
    opt.__dict__["_moonep_wrapped"] = True
    ctx = implicit_replication()  # this step already runs outside the wrapper: until its post-step hook
    ctx.__enter__()
    opt.__dict__["_moonep_first"] = ctx


def _after_step(opt, args, kwargs) -> None:
    ctx = opt.__dict__.pop("_moonep_first", None)
    if ctx is not None:
        ctx.__exit__(None, None, None)
