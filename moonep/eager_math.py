"""Elementwise math that ``torch.compile`` runs exactly as eager does: one opaque custom op per call site.

Inductor regenerates a layer's elementwise code (sigmoid, tanh, norms, small reductions) in its own kernels,
whose rounding differs from eager's by an ulp here and there (docs/design.md, "Why inductor is close, not
bitwise"); GEMMs stay library calls either way.  Wrapping such a function with :func:`keep_eager` makes it
one node, ``moonep::eager_math``, whose body calls the function eagerly, and whose backward,
``moonep::eager_math_backward``, recomputes it and takes ``torch.autograd.grad`` of it: the same ATen kernels
forward and backward, so the compiled layer matches eager bit for bit.  Outside compilation the wrapper is
the plain function (no recomputation).

The price under compile: these ops are not fused with their neighbours, and the backward recomputes the
forward of the wrapped function (elementwise work, small next to the expert GEMMs and the collectives).

A wrapped function's tensor inputs must have no other consumer whose gradient meets theirs (the sum of a
tensor's gradient contributions would then be ordered differently eagerly and compiled); the call sites in
moonep (router scores, top-k weights, SiTU-GLU, RMSNorm) take freshly computed tensors.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .errors import expect

__all__ = ["keep_eager"]

_FNS: dict[int, Callable] = {}   # key -> the wrapped function, f(*tensors, *consts) -> Tensor
_KEYS: dict[str, int] = {}


def _out(t: Tensor, like: Tensor, *inputs: Tensor) -> Tensor:
    """``t`` as a custom op may return it: laid out as ``torch.empty_like(like)`` (what the fake kernel
    promises) and not aliasing an input; copied only when it is not already."""
    want = torch.empty_like(like, device="meta").stride()
    if t.stride() == want and not any(t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr()
                                      for i in inputs):
        return t
    return torch.empty_like(like).copy_(t)


@torch.library.custom_op("moonep::eager_math", mutates_args=())
def _eager_math(inputs: list[Tensor], key: int, consts: list[float]) -> Tensor:
    out = _FNS[key](*inputs, *consts)
    return _out(out, out, *inputs)


@_eager_math.register_fake
def _(inputs, key, consts):
    return torch.empty_like(_FNS[key](*inputs, *consts))


def _autograd_on():
    """Autograd inside a custom op's body, which runs below the autograd dispatch keys: the thread's
    dispatch key sets with the autograd functionality taken out of the excluded ones."""
    excluded = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


@torch.library.custom_op("moonep::eager_math_backward", mutates_args=())
def _eager_math_backward(inputs: list[Tensor], grad: Tensor, key: int, consts: list[float]) -> list[Tensor]:
    with _autograd_on(), torch.enable_grad():
        xs = [x.detach().requires_grad_(True) for x in inputs]
        out = _FNS[key](*xs, *consts)
        gs = torch.autograd.grad(out, xs, grad, allow_unused=True)
    return [torch.zeros_like(x) if g is None else _out(g, x, grad, *inputs) for x, g in zip(inputs, gs)]


@_eager_math_backward.register_fake
def _(inputs, grad, key, consts):
    return [torch.empty_like(x) for x in inputs]


def _setup(ctx, inputs, output):
    tensors, ctx.key, ctx.consts = inputs
    ctx.save_for_backward(*tensors)


def _backward(ctx, grad):
    grads = list(_eager_math_backward(list(ctx.saved_tensors), grad, ctx.key, ctx.consts))
    # the gradient of `consts` mirrors its structure as torch flattens it: [] is an empty list of tensors,
    # a list of floats one non-tensor leaf
    return grads, None, ([] if not ctx.consts else None)


_eager_math.register_autograd(_backward, setup_context=_setup)


def keep_eager(fn: Callable, name: str) -> Callable:
    """``fn(*tensors, *consts) -> Tensor``, run as eager runs it when compiled (``moonep::eager_math``).

    Args:
        fn: floating tensors (positional), then float constants -> one tensor; only torch ops, no host syncs.
        name: a unique name of the call site (the key of ``fn`` in this process).
    Returns:
        ``wrapper(*tensors, *consts)``: ``fn`` itself eagerly; under ``torch.compile`` one opaque op whose
        forward and backward run ``fn``'s ATen kernels.
    """
    expect(name not in _KEYS, "name", "a name not yet used by keep_eager", name)
    key = len(_FNS)
    _FNS[key], _KEYS[name] = fn, key

    def wrapper(*args):
        if not torch.compiler.is_compiling():
            return fn(*args)
        tensors = [a for a in args if isinstance(a, Tensor)]
        consts = [float(a) for a in args if not isinstance(a, Tensor)]
        return _eager_math(tensors, key, consts)

    wrapper.__name__ = wrapper.__qualname__ = f"keep_eager({name})"
    wrapper.__doc__ = fn.__doc__
    return wrapper
