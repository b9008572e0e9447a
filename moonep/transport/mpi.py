"""mpi4py transport: ``Ialltoallv`` on zero-copy numpy views of CPU tensors, polled with a timeout.

Non-blocking calls polled against a deadline mean a stalled peer raises :class:`moonep.MoonepError`
instead of blocking forever (blocking MPI collectives have no timeout).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import MoonepError, expect
from .base import Transport

# numpy has no bf16: half-width floats travel as int16 bit patterns (the bytes are what matter).
_WIRE_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.view(_WIRE_VIEW.get(t.dtype, t.dtype)).numpy()


class MPITransport(Transport):
    name = "mpi"

    def __init__(self, comm, timeout: float = 60.0):
        self.comm = comm
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)

    def _wait(self, req, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not req.Test():
            spins += 1
            if spins > 1000:  # spin briefly for latency, then yield the core (ranks may share cores)
                time.sleep(1e-4)
            if time.monotonic() > deadline:
                raise MoonepError(f"rank {self.rank}: {what} did not complete within {self.timeout:.0f}s; "
                                  "a peer is dead, stalled or called a different collective")

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
        return self.comm.allgather(obj)
