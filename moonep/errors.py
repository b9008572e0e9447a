"""Argument checks that fail loudly: every message names the argument, what was expected and what came."""
from __future__ import annotations

import torch


class MoonepError(RuntimeError):
    """A distributed failure: a peer died, stalled or disagreed. Raised on every surviving rank."""


def expect(cond: bool, name: str, expected: str, actual) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``cond`` holds."""
    if not cond:
        raise ValueError(f"{name}: expected {expected}, got {actual}")


def expect_tensor(t, name: str, *, dim: int | None = None, dtypes=None, device=None, shape=None) -> None:
    """Check a tensor argument's type, rank, dtype, device and (partial) shape.

    ``shape`` entries that are ``None`` are not checked.
    """
    expect(isinstance(t, torch.Tensor), name, "a torch.Tensor", type(t).__name__)
    if dim is not None:
        expect(t.dim() == dim, name, f"{dim} dimensions", f"shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes) if isinstance(dtypes, (tuple, list, set)) else (dtypes,)
        expect(t.dtype in dtypes, name, f"dtype in {[str(d) for d in dtypes]}", t.dtype)
    if device is not None:
        expect(t.device.type == torch.device(device).type, name, f"device {device}", t.device)
    if shape is not None:
        ok = len(shape) == t.dim() and all(a is None or a == b for a, b in zip(shape, t.shape))
        want = "[" + ", ".join("*" if a is None else str(a) for a in shape) + "]"
        expect(ok, name, f"shape {want}", f"{list(t.shape)}")
