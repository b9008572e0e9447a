"""A layer's own math under ``torch.compile``: fused by inductor by default, or bit for bit as eager runs it.

By default, code traced by ``torch.compile`` calls a function wrapped with :func:`keep_eager` as plain code:
inductor fuses it with its neighbours and rounds its own way (within the dtype's tolerance of eager, and
faster: docs/performance.md, "torch.compile").  Inside :func:`bitwise` (an opt-in, for tests that compare
compiled with eager bit for bit) each call is one opaque op instead, ``moonep::eager_math``, whose body calls
the function eagerly, and whose backward, ``moonep::eager_math_backward``, recomputes it and takes
``torch.autograd.grad`` of it: the same ATen kernels forward and backward, so the compiled layer matches
eager bit for bit (docs/design.md, "Bitwise under inductor").  Inductor would otherwise regenerate the
elementwise code, add bf16 terms in float32 before one rounding, and on CPU lower small GEMMs to its own
loops.  Outside compilation the wrapper is the plain function (no recomputation).

The price of :func:`bitwise`: the kept ops are not fused with their neighbours, and the backward recomputes
the wrapped function and runs autograd from Python.

Under autocast the wrapped functions are traced as plain code also inside :func:`bitwise` (an op's body runs
without autocast, which would change their dtypes): compiled and eager then agree in dtype but not bit for
bit.

A wrapped function's tensor inputs must have no other consumer whose gradient meets theirs (the sum of a
tensor's gradient contributions would then be ordered differently eagerly and compiled); the call sites in
moonep (``LatentMoE``: router scores, top-k weights, SiTU-GLU, RMSNorm, projections, shared experts; the
sum of ``x``'s gradients) take freshly computed tensors or parameters.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .errors import expect
from .op_state import fresh_output

__all__ = ["keep_eager", "register", "call", "bitwise", "is_bitwise"]

_FNS: dict[int, Callable] = {}   # key -> f(*tensors, *consts) -> list of tensors
_KEYS: dict[str, int] = {}
_BITWISE = [False]  # bitwise(): the wrapped functions as moonep::eager_math ops when compiled


@contextlib.contextmanager
def bitwise():
    """Inside, code traced by ``torch.compile`` runs each wrapped function as one opaque op with eager's
    kernels, so that the compiled layer's outputs and gradients are eager's bit for bit (for tests: slower,
    since nothing of it fuses).  Dynamo guards on this switch: run the compiled calls inside it (outside,
    they are compiled again, fused)."""
    prev = _BITWISE[0]
    _BITWISE[0] = True
    try:
        yield
    finally:
        _BITWISE[0] = prev


def as_ops() -> bool:
    """Whether :func:`keep_eager` functions run as ``moonep::eager_math`` ops here: compiled inside
    :func:`bitwise` (elsewhere they are plain code, eager or fused)."""
    return _BITWISE[0] and torch.compiler.is_compiling()


def is_bitwise() -> bool:
    """Whether code compiled now keeps the wrapped functions at eager's bits (inside :func:`bitwise`)."""
    return _BITWISE[0]


def _outs(r) -> list:
    return list(r) if isinstance(r, (tuple, list)) else [r]


def _out(t: Tensor, like: Tensor, *inputs: Tensor) -> Tensor:
    """``t`` as a custom op may return it: laid out as ``torch.empty_like(like)`` (what the fake kernel
    promises) and not aliasing an input; copied only when it is not already."""
    if t.stride() != torch.empty_like(like, device="meta").stride():
        return torch.empty_like(like).copy_(t)
    return fresh_output(t, *inputs)


@torch.library.custom_op("moonep::eager_math", mutates_args=())
def _eager_math(inputs: list[Tensor], key: int, consts: list[float]) -> list[Tensor]:
    return [_out(o, o, *inputs) for o in _outs(_FNS[key](*inputs, *consts))]


@_eager_math.register_fake
def _(inputs, key, consts):
    return [torch.empty_like(o) for o in _outs(_FNS[key](*inputs, *consts))]


def _autograd_on():
    """Autograd inside a custom op's body, which runs below the autograd dispatch keys: the thread's
    dispatch key sets with the autograd functionality taken out of the excluded ones."""
    excluded = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


@torch.library.custom_op("moonep::eager_math_backward", mutates_args=())
def _eager_math_backward(inputs: list[Tensor], grads: list[Optional[Tensor]], key: int,
                         consts: list[float]) -> list[Tensor]:
    """Gradients of every floating input (zeros where none flows; integer inputs get zeros too)."""
    with _autograd_on(), torch.enable_grad():
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        outs = _outs(_FNS[key](*xs, *consts))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        want = [x for x in xs if x.requires_grad]
        gs = iter(torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs], allow_unused=True)
                  if pairs and want else [None] * len(want))
    op_args = inputs + [g for g in grads if g is not None]  # what a result may not alias
    res = []
    for x in inputs:
        g = next(gs) if x.is_floating_point() else None
        res.append(torch.zeros_like(x) if g is None else _out(g, x, *op_args))
    return res


@_eager_math_backward.register_fake
def _(inputs, grads, key, consts):
    return [torch.empty_like(x) for x in inputs]


def _setup(ctx, inputs, output):
    tensors, ctx.key, ctx.consts = inputs
    ctx.save_for_backward(*tensors)


def _backward(ctx, grads):
    xs = list(ctx.saved_tensors)
    gx = _eager_math_backward(xs, list(grads), ctx.key, ctx.consts)
    # the gradient of `consts` mirrors its structure as torch flattens it: [] is an empty list of tensors,
    # a list of floats one non-tensor leaf
    return [g if x.is_floating_point() else None for x, g in zip(xs, gx)], None, ([] if not ctx.consts else None)


_eager_math.register_autograd(_backward, setup_context=_setup)


def register(fn: Callable, name: str) -> int:
    """The key of ``fn`` (see :func:`keep_eager`) in this process; ``name`` is used once."""
    expect(name not in _KEYS, "name", "a name not yet used by keep_eager", name)
    key = len(_FNS)
    _FNS[key], _KEYS[name] = fn, key
    return key


# Device types whose autocast state moonep reads: a fixed set (torch's autocast device types), since
# torch.amp.is_autocast_available is not traceable by Dynamo on every supported torch (2.11 breaks the graph).
_AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", torch._C._get_privateuse1_backend_name())


def autocast_on(device_type: str) -> bool:
    """Whether autocast is enabled for ``device_type`` (False for a device type without autocast, e.g. meta)."""
    return device_type in _AUTOCAST_TYPES and torch.is_autocast_enabled(device_type)


def call(key: int, *args):
    """``fn(*args)`` of the function registered under ``key`` (a list of its outputs); inside :func:`bitwise`,
    as one ``moonep::eager_math`` op (tensors first, then float constants).  Under autocast ``fn`` is called
    directly: an op's body runs without autocast, so it would compute in other dtypes than eager does."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    if not _BITWISE[0] or (tensors and autocast_on(tensors[0].device.type)):
        return _outs(_FNS[key](*args))
    consts = [float(a) for a in args if not isinstance(a, Tensor)]
    return _eager_math(tensors, key, consts)


def _traced(t) -> bool:
    """``t`` is being traced (a tensor subclass or a dispatch mode): AOTAutograd traces a backward this way,
    where ``torch.compiler.is_compiling()`` is False on some torch versions (2.11)."""
    return type(t) is not Tensor or _get_current_dispatch_mode() is not None


def keep_eager(fn: Callable, name: str) -> Callable:
    """``fn(*tensors, *consts) -> Tensor``, run as eager runs it when compiled inside :func:`bitwise`.

    Args:
        fn: tensors (positional), then float constants -> one tensor; only torch ops, no host syncs, and
            deterministic (no random ops such as dropout: the backward recomputes it).
        name: a unique name of the call site (the key of ``fn`` in this process).
    Returns:
        ``wrapper(*tensors, *consts)``: ``fn`` itself eagerly and (fused) under ``torch.compile``; compiled
        inside :func:`bitwise`, one opaque op whose forward and backward run ``fn``'s ATen kernels.
    """
    key = register(fn, name)

    def wrapper(*args):
        if not (torch.compiler.is_compiling() or _traced(args[0])):
            return fn(*args)
        return call(key, *args)[0]

    wrapper.__name__ = wrapper.__qualname__ = f"keep_eager({name})"
    wrapper.__doc__ = fn.__doc__
    return wrapper
