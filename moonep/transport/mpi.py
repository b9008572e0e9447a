"""mpi4py transport: ``Ialltoallv`` on zero-copy numpy views of CPU tensors, polled with a timeout.

Non-blocking calls polled against a deadline mean a stalled peer raises :class:`moonep.MoonepError`
instead of blocking forever (blocking MPI collectives have no timeout).  The collective-order header
(:mod:`moonep.guard`) travels point to point, so a timeout there names the peers that never sent.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import MoonepError, expect
from .base import Transport

# Requests given up on after a timeout: MPI may still write into their buffers, so they must stay alive.
_ABANDONED: list = []
_HEADER_TAG = 0x6D6F  # point-to-point tag of the order header (MPI keeps it apart from collectives)

# numpy has no bf16: half-width floats travel as int16 bit patterns (the bytes are what matter).
_WIRE_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.view(_WIRE_VIEW.get(t.dtype, t.dtype)).numpy()


class MPITransport(Transport):
    name = "mpi"

    def __init__(self, comm, timeout: float = 60.0):
        from mpi4py import MPI

        self.comm = comm
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)
        # Errors (e.g. a peer's connection lost) become Python exceptions we can name, not an abort.
        comm.Set_errhandler(MPI.ERRORS_RETURN)

    def timeout_s(self) -> float:
        return self.timeout

    def _fail(self, what: str, why: str) -> MoonepError:
        return MoonepError(f"rank {self.rank}: {self.current_op}: {what} {why}")

    def _wait(self, req, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        spins = 0
        try:
            while not req.Test():
                spins += 1
                if spins > 1000:  # spin briefly for latency, then yield the core (ranks may share cores)
                    time.sleep(1e-4)
                if time.monotonic() > deadline:
                    _ABANDONED.append(req)
                    raise self._fail(what, f"did not complete within the timeout of {self.timeout:g}s; a peer "
                                     "is dead, stalled or called a different collective")
        except MoonepError:
            raise
        except Exception as exc:  # mpi4py.MPI.Exception: the library saw a failed peer
            _ABANDONED.append(req)
            raise self._fail(what, f"failed: {exc}") from exc

    def exchange_header(self, header):
        """Point-to-point swap with every peer, so a timeout knows exactly who did not send."""
        R = self.world_size
        mine = np.asarray(header, dtype=np.int64)
        got = np.zeros((R, mine.size), dtype=np.int64)
        got[self.rank] = mine
        peers = [p for p in range(R) if p != self.rank]
        try:
            recvs = [self.comm.Irecv(got[p], source=p, tag=_HEADER_TAG) for p in peers]
            sends = [self.comm.Isend(mine, dest=p, tag=_HEADER_TAG) for p in peers]
        except Exception as exc:
            raise self._fail("header exchange", f"failed: {exc}") from exc
        deadline = time.monotonic() + self.timeout
        done = [False] * len(peers)
        spins = 0
        while not all(done):
            try:
                for i, req in enumerate(recvs):
                    if not done[i]:
                        done[i] = bool(req.Test())
            except Exception as exc:
                _ABANDONED.extend(recvs + sends + [got, mine])
                raise self._fail("header exchange", f"failed: {exc}") from exc
            spins += 1
            if spins > 1000:
                time.sleep(1e-4)
            if time.monotonic() > deadline and not all(done):
                missing = [p for p, d in zip(peers, done) if not d]
                _ABANDONED.extend(recvs + sends + [got, mine])
                who = "rank " + ", ".join(map(str, missing)) if len(missing) < 9 else f"{len(missing)} ranks"
                raise MoonepError(f"rank {self.rank}: {self.current_op}: {who} did not join within the timeout "
                                  f"of {self.timeout:g}s (dead, stalled, or waiting in another collective)")
        for req in sends:  # eager sends of 32 bytes: already done once every peer's header has arrived
            self._wait(req, "header send")
        return got.tolist()

    def all_to_all(self, send, send_splits, recv_splits):
        expect(send.device.type == "cpu", "send", "a CPU tensor for the MPI transport", send.device)
        send = send.contiguous()
        row = int(np.prod(send.shape[1:], dtype=np.int64))
        recv = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype)
        s_counts = np.asarray(send_splits, dtype=np.int64) * row
        r_counts = np.asarray(recv_splits, dtype=np.int64) * row
        s_displ = np.concatenate([[0], np.cumsum(s_counts)[:-1]]).astype(np.int64)
        r_displ = np.concatenate([[0], np.cumsum(r_counts)[:-1]]).astype(np.int64)
        sbuf, rbuf = _np(send).reshape(-1), _np(recv).reshape(-1)
        req = self.comm.Ialltoallv([sbuf, (s_counts, s_displ)], [rbuf, (r_counts, r_displ)])
        self._wait(req, "all_to_all")
        return recv

    def all_gather(self, t):
        t = t.to(torch.int64).contiguous()
        out = torch.empty((self.world_size, t.numel()), dtype=torch.int64)
        req = self.comm.Iallgather(_np(t), _np(out))
        self._wait(req, "all_gather")
        return out

    def all_gather_object(self, obj):
        try:
            return self.comm.allgather(obj)  # setup-time only (blocking, no timeout)
        except Exception as exc:
            raise self._fail("all_gather_object", f"failed: {exc}") from exc
