"""``eager_only``: what ``torch.compiler.disable`` does to a function, applied at its first call.

``torch.compiler.disable`` imports ``torch._dynamo`` (over a second of a process's start, most of ``import
moonep``), and moonep marks its host-side functions with it at import time.  A process that never compiles
(a CPU rank under ``mpiexec``, an eager training loop) would pay it for nothing.  Made at the first call, the
disabled function is the same; when that first call is traced, dynamo traces the wrapper (the ``disable`` call
adds nothing to the graph) and breaks the graph at the disabled function, as it would have: one graph break
either way (checked on torch 2.11 and 2.13).  This module imports nothing of moonep.
"""
from __future__ import annotations

import functools

import torch


def eager_only(fn):
    """``fn``, run eagerly under ``torch.compile`` (one graph break where compiled code calls it), like
    ``torch.compiler.disable(fn)``; the disabled function is made at the first call."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call
