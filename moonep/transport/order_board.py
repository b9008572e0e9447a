"""Collective-order headers between the ranks of one node through host shared memory.

The NVLink path moves data with kernels that only count signals: if one rank calls ``combine`` while its
peers call ``dispatch``, the kernels can satisfy each other's waits and return wrong data without any
error.  :class:`OrderBoard` is the NVLink transport's ``exchange_header`` for
:class:`moonep.guard.CollectiveGuard`: every rank writes its ``[magic, instance, op, seq, ...]``
header into its own slot of a small POSIX shared-memory table and waits (on the host, a few µs when the
ranks are in step) until every peer wrote the header of the same generation.  No device work and no host
sync with the GPU: only the hosts go in step, as the kernels would anyway.

Slots alternate between two halves by generation parity.  A rank writes generation g + 2 into the half
of g only after it read every peer's g + 1, which each peer wrote after it finished reading g.

A slot also holds a check word over its generation and header, and a reader takes a slot only when the
check matches what it read.  Why: the header is written before the generation, but on a weakly ordered
host (Arm, e.g. Grace) a peer may see the new generation before the new header words; it then reads a
slot whose check fails and reads it again, instead of taking last generation's header for this one.
On x86 (stores stay in order) readers skip the check; ``MOONEP_BOARD_CHECK=1`` forces it.
"""
from __future__ import annotations

import platform
import time
import weakref
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from ..errors import MoonepError

_M64 = (1 << 64) - 1
_MUL0 = 0x9E3779B97F4A7C15  # odd 64-bit multipliers of the check word, one per slot word


# Readers verify the check word where stores may become visible out of order. x86 keeps store order
# (TSO), so there the generation written last is enough and the check is skipped (~1 µs per peer).
from ..config import env_flag  # noqa: E402 (kept next to its one use: MOONEP_BOARD_CHECK, validated)
VERIFY = env_flag("MOONEP_BOARD_CHECK", False) or platform.machine().lower() not in (
    "x86_64", "amd64", "i386", "i686")


def _unlink(shm) -> None:
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def _check(w, n: int | None = None) -> int:
    """Check word (signed int64) of the slot words ``w[:n]`` (generation, then the header; all of ``w`` by
    default): a sum with a distinct odd 64-bit multiplier per word, so any stale word (one that differs
    from the fresh one) changes it."""
    n = len(w) if n is None else n
    v = 0
    for i in range(n):
        v += (w[i] & _M64) * ((_MUL0 + 2 * i * 0x632BE59BD9B4E019) | 1)
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


class OrderBoard:
    """Host shared-memory header exchange for the ``R`` ranks of one node (NVLink transport).

    Args:
        rank, world_size: this rank and the number of ranks (all on this node).
        gather_obj: collective ``all_gather_object`` used once, to share the segment's name.
        timeout: seconds to wait for a peer's header before raising :class:`moonep.MoonepError`.
        header_words: ints in a header (:data:`moonep.guard.HEADER_WORDS`).
    """

    def __init__(self, rank: int, world_size: int, gather_obj, timeout: float, header_words: int = 4):
        self.rank, self.R, self.timeout = rank, world_size, float(timeout)
        self.n = int(header_words)
        words = self.n + 2  # generation, the header, the check word
        nbytes = 2 * world_size * words * 8
        self._shm = shared_memory.SharedMemory(create=True, size=nbytes) if rank == 0 else None
        # The creator unlinks the segment when the board is closed, collected, or the process exits
        # without closing it (a script that drops its ExpertParallel): not left to the resource tracker,
        # which would warn of "leaked shared_memory objects" at exit.
        self._fin = weakref.finalize(self, _unlink, self._shm) if rank == 0 else None
        names = gather_obj(self._shm.name if rank == 0 else None)
        if rank != 0:
            self._shm = shared_memory.SharedMemory(name=names[0])
            # Only the creator owns the segment: otherwise this process's resource tracker would unlink
            # it (and warn) at exit while peers may still use it.
            resource_tracker.unregister(self._shm._name, "shared_memory")
        self.table = np.ndarray((2, world_size, words), dtype=np.int64, buffer=self._shm.buf)
        if rank == 0:
            self.table[:] = 0
        gather_obj(None)  # nobody writes before rank 0 zeroed the table
        self.gen = 0
        self.broken = False

    def exchange(self, header, what: str = "a collective") -> list[list[int]]:
        """Publish ``header`` (``header_words`` ints) and return every rank's header of this generation, in
        rank order."""
        if self.broken:
            raise MoonepError(f"rank {self.rank}: {what}: an earlier collective timed out; this ExpertParallel "
                              "cannot be used any more")
        self.gen += 1
        half = self.table[self.gen & 1]
        n = self.n
        header = [int(v) for v in header]
        half[self.rank, 1:n + 1] = header
        half[self.rank, n + 1] = _check([self.gen] + header, n + 1)
        half[self.rank, 0] = self.gen  # last; a reader still checks the whole slot (module docstring)
        t0 = time.monotonic()
        spins = 0
        got = []
        for p in range(self.R):
            while True:
                if int(half[p, 0]) >= self.gen:
                    row = half[p].tolist()
                    if not VERIFY or (row[0] == self.gen and row[n + 1] == _check(row, n + 1)):
                        got.append(row[1:n + 1])
                        break
                spins += 1
                if spins & 63 == 0:
                    dt = time.monotonic() - t0
                    if dt > self.timeout:
                        # No view of the segment may outlive close() (a traceback keeps this frame's locals),
                        # and the generations are out of step from here on.
                        del half
                        self.broken = True
                        raise MoonepError(f"rank {self.rank}: rank {p} did not start {what} within the timeout of "
                                          f"{self.timeout:g}s (a peer died, stalled or called a different "
                                          "collective)")
                    if dt > 0.002:  # spin while peers are µs apart (the usual case), then yield the core
                        time.sleep(0.0001 if dt < 0.1 else 0.002)
        del half
        return got

    def close(self) -> None:
        if self._shm is None:
            return
        self.table = None
        self._shm.close()
        if self._fin is not None:
            self._fin()  # unlink: peers keep their mapping until they close it
        self._shm = None
