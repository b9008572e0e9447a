"""Transports: how bytes move between ranks, behind the interface of :mod:`.base`.

    mpi.py          mpi4py Alltoallv on zero-copy numpy views (CPU tensors under mpirun)
    torchdist.py    torch.distributed all_to_all_single (gloo, NCCL)
    local.py        one process, no group: the identity
    ipc.py          CUDA IPC symmetric buffers and pinned host words (the nvlink backend's memory)
    order_board.py  host shared memory for the nvlink backend's call-order headers
"""
from __future__ import annotations

from ..errors import expect
from .base import Transport
from .local import SelfTransport
from .mpi import MPITransport
from .torchdist import TorchDistTransport

__all__ = ["Transport", "make_transport"]


def make_transport(kind: str, rt, timeout: float | None = None) -> Transport:
    """``kind``: "mpi", "torch" or "auto" (MPI for CPU tensors under mpirun, else torch.distributed).

    ``timeout``: seconds the MPI transport waits for peers (default: the runtime's); the torch transport
    uses its process group's timeout (``moonep.init(timeout=...)``)."""
    expect(kind in ("auto", "mpi", "torch"), "transport", '"auto", "mpi" or "torch"', repr(kind))
    if rt.group is None:  # moonep.runtime.local_runtime: one process, no process group
        return SelfTransport(timeout=rt.timeout.total_seconds() if timeout is None else timeout)
    if kind == "auto":
        kind = "mpi" if rt.comm is not None and rt.device.type == "cpu" else "torch"
    if kind == "mpi":
        expect(rt.comm is not None, "transport", "a job launched by mpirun/mpiexec for the MPI transport",
               f"launcher {rt.launcher!r}")
        return MPITransport(rt.comm, timeout=rt.timeout.total_seconds() if timeout is None else timeout)
    return TorchDistTransport(rt.group, rt.cpu_group, timeout=rt.timeout.total_seconds())
