"""Transports: how bytes move between ranks, behind the interface of :mod:`.base`.

    mpi.py          mpi4py Alltoallv on zero-copy numpy views (CPU tensors under mpirun)
    torchdist.py    torch.distributed all_to_all_single (gloo, NCCL)
    host_group.py   header-first collectives on a gloo group (host metadata; abandoned groups)
    local.py        one process, no group: the identity
    ipc.py          CUDA IPC symmetric buffers and pinned host words (the nvlink backend's memory)
    order_board.py  host shared memory for the nvlink backend's call-order headers
"""
from __future__ import annotations

from ..errors import expect
from ..guard import BUILD
from .base import Transport
from .local import SelfTransport
from .mpi import MPITransport
from .torchdist import TorchDistTransport

__all__ = ["Transport", "make_transport"]


def make_transport(kind: str, rt, timeout: float | None = None) -> Transport:
    """``kind``: "mpi", "torch" or "auto" (MPI for CPU tensors under mpirun, else torch.distributed).

    ``timeout``: seconds the transport's own polled waits last (default: the runtime's), from its first
    call on: every wait of the MPI transport; the torch transport's collectives keep its process group's
    timeout (``moonep.init(timeout=...)``), which it reports in errors."""
    expect(kind in ("auto", "mpi", "torch"), "transport", '"auto", "mpi" or "torch"', repr(kind))
    group_timeout = rt.timeout.total_seconds()
    timeout = group_timeout if timeout is None else float(timeout)
    if rt.group is None:  # moonep.runtime.local_runtime: one process, no process group
        return SelfTransport(timeout=timeout)
    if kind == "auto":
        kind = "mpi" if rt.comm is not None and rt.device.type == "cpu" else "torch"
    if kind == "mpi":
        expect(rt.comm is not None, "transport", "a job launched by mpirun/mpiexec for the MPI transport",
               f"launcher {rt.launcher!r}")
        t = MPITransport(rt.comm, timeout=timeout)
    else:
        t = TorchDistTransport(rt.group, rt.cpu_group, timeout=timeout, group_timeout=group_timeout)
    t.current_op = "ExpertParallel construction"  # until the first collective call names itself
    t.call = (rt._instances, BUILD, 0)  # the index this instance gets once built
    return t
