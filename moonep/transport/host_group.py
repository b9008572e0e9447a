"""moonep's collectives on a gloo group: each call starts with one fixed-size header, so a disagreement
fails cleanly instead of letting gloo abort a process.

gloo pairs the collectives of a group by call order, whatever they are, and ends the process (a C++
``terminate``: "Received data size doesn't match expected size") when two paired calls move different
sizes.  Ranks end up in different calls when one builds an instance while another dispatches, after an
exception on one rank, after Ctrl-C.  So every collective moonep makes on a gloo group (the runtime's
``cpu_group``: the ``"torch"`` transport's headers, its object gathers, ``EPProvider``'s sizing, the
``QuantileBalancer``'s step, the adapters' agreement, ``Runtime.barrier``) starts with the same all-gather
of :data:`moonep.guard.HEADER_WORDS` int64 words naming the call (:func:`moonep.guard.describe`): ranks
in different calls see it by content and raise :class:`moonep.guard.OrderMismatch` together.  What
follows a header is sized by what every rank has just agreed on.

A rank that leaves a call part way, after its header (an interrupt, an error on that rank only), leaves
its peers in a collective it will never make: its next header would pair with their data.  It marks the
group *abandoned* (:meth:`HostGroup.abandon`) and every later moonep collective on that group is refused
at once on that rank; the peers' wait ends at the group's timeout, after which gloo closes the group's
connections on every rank anyway.  A new group (``moonep.init(group=dist.new_group(...))``) works.
"""
from __future__ import annotations

import contextlib
import pickle
import time
import weakref

import torch
import torch.distributed as dist

from ..errors import MoonepError, RefusedEverywhere
from ..guard import HEADER_WORDS, MAGIC, OrderMismatch, check_same_call
from ..work import join_host

# Renamed in torch 2.13; keep working on older releases (the GPU image has 2.11).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_ABANDONED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # gloo group -> why it was left
_HOST_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a runtime's group -> its gloo group


def register(group, cpu_group) -> None:
    """``cpu_group`` is the gloo group of ``group``'s ranks (``moonep.init``): where the headers of
    collectives on ``group`` (e.g. a ``QuantileBalancer`` over a NCCL group) go."""
    _HOST_OF[group] = cpu_group


@contextlib.contextmanager
def released(group, *tensors, timeout_s: float = 1.0):
    """Around one collective on ``group`` over ``tensors``: when ``group`` is gloo, on leaving, wait (the GIL
    released) until gloo's worker thread has dropped its references to them.

    Why: gloo marks a collective complete before its worker thread destroys the work, and destroying it
    drops the tensors, which takes the GIL.  When the interpreter is already finalizing by then (the
    collective was the last one before exit), Python ends that thread inside a ``noexcept`` destructor and
    the process aborts ("terminate called without an active exception").  Each tensor's use count is
    back to what it was before the call once the worker let go: usually at once, else within
    microseconds.  Bounded by ``timeout_s``; skipped when the collective raised, and on other backends.
    """
    on = hasattr(torch.Tensor, "_use_count") and dist.get_backend(group) == "gloo"
    counts = [t._use_count() for t in tensors] if on else None
    yield
    if counts is None:
        return
    deadline = time.monotonic() + timeout_s
    for t, before in zip(tensors, counts):
        while t._use_count() > before and time.monotonic() < deadline:
            time.sleep(0)


def group_timeout_s(group, default: float = 60.0) -> float:
    """The timeout a gloo group's collectives wait (set when it was made), else ``default``."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # private: no public API
    except Exception:  # noqa: BLE001 (another backend or torch release)
        return default


def host_of(group):
    """The gloo group for the headers of collectives on ``group``: itself when it is gloo, else the one
    registered by ``moonep.init``, else ``None`` (a NCCL group moonep did not create)."""
    if dist.get_backend(group) == "gloo":
        return group
    return _HOST_OF.get(group)


class HostGroup:
    """The header-first collectives of one gloo group.

    Args:
        group: a gloo ProcessGroup.
        timeout_s: the group's timeout (named in errors; gloo applies it); ``None``: read from the group.
    """

    def __init__(self, group, timeout_s: float | None = None):
        self.group = group
        self.timeout_s = group_timeout_s(group) if timeout_s is None else float(timeout_s)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    # -- an abandoned group ----------------------------------------------------------------------------
    def usable(self, what: str) -> None:
        """Raise :class:`moonep.MoonepError` (naming ``what``) if a call on this group was left part way."""
        why = _ABANDONED.get(self.group)
        if why is not None:
            raise MoonepError(f"rank {self.rank}: {what}: refused: an earlier collective on this process group was "
                              f"left part way on this rank ({why[:300]}); its peers may still be waiting in it, so "
                              "the group cannot be used any more: build a new one "
                              "(moonep.init(group=dist.new_group(...)))")

    def abandon(self, why: str) -> None:
        """A call on this group ended part way on this rank: refuse every later one (see the module doc)."""
        _ABANDONED.setdefault(self.group, why)

    @contextlib.contextmanager
    def span(self, what: str):
        """Around the collectives of one call after its header: leaving it by an exception (an interrupt
        included) abandons the group, unless every rank raises it at the same point (a refusal, a
        mismatch of headers)."""
        try:
            yield
        except (RefusedEverywhere, OrderMismatch):
            raise
        except BaseException as exc:
            self.abandon(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
            raise

    # -- the collectives -------------------------------------------------------------------------------
    def _failed(self, what: str, exc: Exception) -> MoonepError:
        self.abandon(f"{what} failed")
        return MoonepError(f"rank {self.rank}: {what} failed (the process group's timeout {self.timeout_s:g}s; a "
                           f"peer is dead, stalled or called a different collective): {str(exc).strip()[:500]}")

    def exchange(self, header, what: str) -> list[list[int]]:
        """All-gather ``header`` (``HEADER_WORDS`` ints, padded with zeros) -> every rank's, rank order."""
        join_host()  # after the queued async_op=True calls, never beside one on the group
        self.usable(what)
        words = [int(v) for v in header] + [0] * (HEADER_WORDS - len(header))
        assert len(words) == HEADER_WORDS, words
        mine = torch.tensor(words, dtype=torch.int64)
        out = torch.empty(self.world_size * HEADER_WORDS, dtype=torch.int64)
        try:
            with released(self.group, out, mine):
                all_gather_single(out, mine, group=self.group)
        except RuntimeError as exc:  # gloo: "Timed out waiting ...", "Connection closed by peer ..."
            raise self._failed(what, exc) from exc
        return out.view(self.world_size, HEADER_WORDS).tolist()

    def agree(self, code: int, value: int = 0, *, instance: int = -1, seq: int = 0, what: str) -> list[int]:
        """One header exchange for call ``code`` (``moonep.guard``'s codes) carrying ``value``: every rank's
        ``value`` in rank order.  Ranks in a different call raise :class:`moonep.guard.OrderMismatch`."""
        rows = self.exchange([MAGIC, instance, code, seq, 0, int(value)], what)
        check_same_call(rows, self.rank)
        return [row[5] for row in rows]

    def all_gather_object(self, obj, *, code: int, instance: int = -1, seq: int = 0, what: str) -> list:
        """Gather a picklable object from every rank: a header carrying its size (call ``code``), then the
        bytes, padded to the largest."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = self.agree(code, len(data), instance=instance, seq=seq, what=what)
        n = max(sizes)
        mine = torch.zeros(n, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(self.world_size * n, dtype=torch.uint8)
        with self.span(what):
            try:
                with released(self.group, out, mine):
                    all_gather_single(out, mine, group=self.group)
            except RuntimeError as exc:
                raise self._failed(what, exc) from exc
        return [obj if r == self.rank else pickle.loads(out[r * n:r * n + sizes[r]].numpy().tobytes())
                for r in range(self.world_size)]
