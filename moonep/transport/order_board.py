"""Collective-order headers between the ranks of one node through host shared memory.

The NVLink path moves data with kernels that only count signals: if one rank calls ``combine`` while its
peers call ``dispatch``, the kernels can satisfy each other's waits and return wrong data without any
error.  :class:`OrderBoard` is the NVLink transport's ``exchange_header`` for
:class:`moonep.transport.guard.CollectiveGuard`: every rank writes its ``[magic, instance, op, seq]``
header into its own slot of a small POSIX shared-memory table and waits (on the host, a few µs when the
ranks are in step) until every peer wrote the header of the same generation.  No device work and no host
sync with the GPU: only the hosts go in step, as the kernels would anyway.

Slots alternate between two halves by generation parity.  A rank writes generation g + 2 into the half
of g only after it read every peer's g + 1, which each peer wrote after it finished reading g.
"""
from __future__ import annotations

import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from ..errors import MoonepError

WORDS = 5  # generation, then the 4-word header


class OrderBoard:
    """Host shared-memory header exchange for the ``R`` ranks of one node (NVLink transport).

    Args:
        rank, world_size: this rank and the number of ranks (all on this node).
        gather_obj: collective ``all_gather_object`` used once, to share the segment's name.
        timeout: seconds to wait for a peer's header before raising :class:`moonep.MoonepError`.
    """

    def __init__(self, rank: int, world_size: int, gather_obj, timeout: float):
        self.rank, self.R, self.timeout = rank, world_size, float(timeout)
        nbytes = 2 * world_size * WORDS * 8
        self._shm = shared_memory.SharedMemory(create=True, size=nbytes) if rank == 0 else None
        names = gather_obj(self._shm.name if rank == 0 else None)
        if rank != 0:
            self._shm = shared_memory.SharedMemory(name=names[0])
            # Only the creator owns the segment: otherwise this process's resource tracker would unlink
            # it (and warn) at exit while peers may still use it.
            resource_tracker.unregister(self._shm._name, "shared_memory")
        self.table = np.ndarray((2, world_size, WORDS), dtype=np.int64, buffer=self._shm.buf)
        if rank == 0:
            self.table[:] = 0
        gather_obj(None)  # nobody writes before rank 0 zeroed the table
        self.gen = 0
        self.broken = False

    def exchange(self, header, what: str = "a collective") -> list[list[int]]:
        """Publish ``header`` (4 ints) and return every rank's header of this generation, rank order."""
        if self.broken:
            raise MoonepError(f"rank {self.rank}: {what}: an earlier collective timed out; this ExpertParallel "
                              "cannot be used any more")
        self.gen += 1
        half = self.table[self.gen & 1]
        half[self.rank, 1:] = header
        half[self.rank, 0] = self.gen  # after the header: a peer that sees gen sees the header (x86 TSO)
        t0 = time.monotonic()
        spins = 0
        for p in range(self.R):
            while int(half[p, 0]) < self.gen:
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
        got = half[:, 1:].tolist()
        del half
        return got

    def close(self) -> None:
        if self._shm is None:
            return
        self.table = None
        self._shm.close()
        if self.rank == 0:
            try:
                self._shm.unlink()  # peers keep their mapping until they close it
            except FileNotFoundError:
                pass
        self._shm = None
