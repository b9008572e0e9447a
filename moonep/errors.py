"""Argument checks that fail loudly: every message names the argument, what was expected and what came."""
from __future__ import annotations

from typing import NoReturn

import torch


class MoonepError(RuntimeError):
    """A distributed failure: a peer died, stalled or disagreed. Raised on every surviving rank."""


class RefusedEverywhere(ValueError):
    """A ``ValueError`` every rank of a collective call raises at the same point, from what they all
    exchanged: the ranks stay in step, and the next valid call works."""


def fail(name: str, expected: str, actual) -> NoReturn:
    """Raise the ``ValueError`` every check raises: ``"{name}: expected {expected}, got {actual}"``."""
    raise ValueError(f"{name}: expected {expected}, got {actual}")


def expect(cond: bool, name: str, expected: str, actual) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``cond`` holds."""
    if not cond:
        fail(name, expected, actual)


def expect_tensor(t, name: str, *, dim: int | None = None, dtypes=None, device=None, shape=None) -> None:
    """Check a tensor argument's type and layout (dense), rank, dtype, device and (partial) shape.

    ``shape`` entries that are ``None`` are not checked. Messages are built only on failure: this runs on
    every dispatch and combine, where eager f-strings cost more host time than the checks.
    """
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.layout is not torch.strided or t.is_nested:  # sparse, MKL-DNN, nested: every op here reads strides
        fail(name, "a dense (strided) tensor", f"a {'nested' if t.is_nested else t.layout} tensor")
    if dim is not None and t.dim() != dim:
        fail(name, f"{dim} dimensions", f"shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes) if isinstance(dtypes, (tuple, list, set)) else (dtypes,)
        if t.dtype not in dtypes:
            fail(name, f"dtype in {[str(d) for d in dtypes]}", t.dtype)
    if device is not None:
        want = device.type if isinstance(device, torch.device) else torch.device(device).type
        if t.device.type != want:
            fail(name, f"device {device}", t.device)
    if shape is not None:
        got = t.shape
        if len(shape) != len(got) or any(a is not None and a != b for a, b in zip(shape, got)):
            fail(name, "shape [" + ", ".join("*" if a is None else str(a) for a in shape) + "]", list(got))


def expect_same(name: str, values, show=str) -> None:
    """Raise ``ValueError`` naming ``name`` and every rank's value unless ``values`` (one per rank, in rank
    order) are all equal: ``"{name}: expected the same value on every rank, got rank 0: ..; rank 1: .."``."""
    if any(v != values[0] for v in values):
        got = "; ".join(f"rank {r}: {show(v)}" for r, v in enumerate(values))
        raise RefusedEverywhere(f"{name}: expected the same value on every rank, got {got}")


def raise_together(error, gather_object) -> NoReturn:
    """Some rank's check failed (``error`` here, or ``None`` if it failed elsewhere): gather the messages
    (collective: every rank calls this) and raise :class:`RefusedEverywhere` (a ``ValueError``) on every
    rank, with this rank's own message, else the first failing rank's followed by ``(on rank r)``."""
    msgs = gather_object(error)
    if error is not None:
        raise RefusedEverywhere(error)
    r = next(i for i, m in enumerate(msgs) if m)
    raise RefusedEverywhere(f"{msgs[r]} (on rank {r})")


def valid_timeout(t) -> bool:
    """``None`` or a finite number of seconds > 0 (what every ``timeout`` argument accepts)."""
    return t is None or (isinstance(t, (int, float)) and 0 < t < float("inf"))


def expect_int(v, name: str, lo: int | None = None, hi: int | None = None) -> None:
    """Raise ``ValueError`` unless ``v`` is an integer (``int`` or a numpy integer, not a bool) ``>= lo`` (and
    ``< hi``)."""
    import operator

    try:
        ok = (not isinstance(v, bool) and operator.index(v) == v and (lo is None or v >= lo)
              and (hi is None or v < hi))
    except TypeError:
        ok = False
    expect(ok, name, "an int" + ("" if lo is None else f" >= {lo}") + ("" if hi is None else f" below {hi}"),
           repr(v))


def expect_slack(v, name: str = "slack") -> float:
    """``slack`` must be a finite real ``>= 0`` (bools are refused: they are almost always a slip)."""
    import math

    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    expect(ok, name, "a finite float >= 0", repr(v))
    return float(v)


def expect_device(device, name: str = "device") -> torch.device:
    """Parse ``device`` and check it can hold moonep's tensors: the CPU, or a CUDA device that exists.

    Catches the "wrong device" mistakes early (``"meta"``, ``"cuda:7"`` on a 2-GPU box, a typo), where torch
    would fail later with an assertion or a device-mismatch deep inside a kernel."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected a torch.device or a device string, got {device!r} ({exc})") from None
    expect(dev.type in ("cpu", "cuda"), name, "a cpu or cuda device", dev)
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        expect(n > 0 and (dev.index is None or dev.index < n), name,
               f"an existing CUDA device ({n} visible)", dev)
    return dev
