"""Launch detection and process groups: mpirun/mpiexec, torchrun, or a plain single process.

``moonep.init()`` is the one call a program makes. It works out who launched it, builds a
``torch.distributed`` process group (gloo on CPU, NCCL on CUDA), picks the GPU by local rank and returns
a :class:`Runtime`. Nothing here uses a fixed port: under MPI, rank 0 opens a TCPStore on a free port
and broadcasts it over MPI, so two jobs on one machine never collide.
"""
from __future__ import annotations

import datetime
import math
import numbers
import os
import pickle
import socket
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .config import env_float
from .errors import MoonepError, expect, fail
from .guard import BARRIER
from .transport.host_group import HostGroup, register as register_host_group
from .transport.mpi import _abandon, _nap, set_polling

_DEFAULT_TIMEOUT_S = 60.0


def default_timeout_s() -> float:
    """``MOONEP_TIMEOUT`` (a finite number of seconds > 0), else 60; read at each call, so a bad value
    fails ``moonep.init()`` with a ``ValueError`` naming the variable, never ``import moonep``."""
    return env_float("MOONEP_TIMEOUT", _DEFAULT_TIMEOUT_S)


def __getattr__(name):  # the former module constant, now read when asked for
    if name == "DEFAULT_TIMEOUT_S":
        return default_timeout_s()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _timeout_delta(timeout) -> datetime.timedelta:
    """``timeout`` (seconds, or ``None`` for ``MOONEP_TIMEOUT`` / 60) as a checked ``timedelta``."""
    if timeout is None:
        return datetime.timedelta(seconds=default_timeout_s())
    ok = (isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and math.isfinite(timeout)
          and timeout > 0)
    expect(ok, "timeout", "None or a finite number of seconds > 0", repr(timeout))
    return datetime.timedelta(seconds=float(timeout))


def _poll(req, seconds: float, keep=()) -> bool:
    """Test ``req`` until it completes (True) or ``seconds`` pass (False: ``req`` and ``keep`` stay alive, in
    the MPI transport's list of abandoned requests).

    Never ``Wait``/``Free``: a request a peer never matches is kept (with its buffers), not waited on; an
    MPI error raised by ``Test`` leaves them kept too, so MPI never writes into freed memory."""
    t0 = time.monotonic()
    deadline = t0 + seconds
    spins = 0
    try:
        while not req.Test():
            spins += 1
            _nap(spins, time.monotonic() - t0)  # the MPI transport's backoff: ranks may share cores
            if time.monotonic() > deadline:
                _abandon([req], keep)  # rendezvous, shutdown barrier: kept alive with its buffers
                return False
    except BaseException:
        _abandon([req], keep)
        raise
    return True


@dataclass
class Runtime:
    """Who we are in the job. ``group`` spans all ranks; ``cpu_group`` is a gloo group for host metadata."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    group: object
    cpu_group: object
    backend: str
    launcher: str  # "mpi", "torchrun", "single", "external" or "local" (no process group)
    timeout: datetime.timedelta
    comm: object = None  # the mpi4py communicator when launched by mpirun, else None
    _owns_pg: bool = field(default=False, repr=False)
    failed: bool = field(default=False, repr=False)  # a collective raised MoonepError (peer dead/stalled)
    _instances: int = field(default=0, repr=False)  # ExpertParallel objects built here (order-check ids)
    mesh: object = field(default=None, repr=False)  # the experts' 1-D "ep" DeviceMesh (moonep.training.expert_mesh)
    dp_mesh: object = field(default=None, repr=False)  # its data-parallel sibling, when moonep built the mesh
    _host: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.comm is not None:  # the MPI transport's waits: no spinning on oversubscribed cores
            set_polling(self.local_world_size)
        if self.group is not None and self.cpu_group is not None and self.cpu_group is not self.group:
            register_host_group(self.group, self.cpu_group)  # headers of collectives on a NCCL group

    @property
    def host(self) -> HostGroup:
        """moonep's header-first collectives on ``cpu_group`` (:mod:`moonep.transport.host_group`)."""
        if self._host is None:
            self._host = HostGroup(self.cpu_group, self.timeout.total_seconds())
        return self._host

    def _give_up(self) -> None:
        """A shutdown barrier failed or expired: remember it, and under mpirun make sure the process ends
        (``MPI_Finalize`` would wait for the missing peer; see :func:`moonep.guard.mark_failed`)."""
        from .guard import mark_failed

        mark_failed(self, self.timeout.total_seconds())

    def __deepcopy__(self, memo) -> "Runtime":
        """The runtime itself: it is the job's communicators (a ProcessGroup cannot be copied), so a deep
        copy of a model that holds it (``copy.deepcopy`` of a patched model) shares it."""
        return self

    def next_instance(self) -> int:
        """Index of the next ExpertParallel on this runtime (construction is collective: same everywhere)."""
        self._instances += 1
        return self._instances - 1

    @property
    def collective_device(self) -> torch.device:
        """Where tensors for ``group`` collectives must live: the GPU under NCCL, else the host."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        """Wait for every rank (a header exchange on ``cpu_group``: a rank in another moonep collective makes
        every rank raise MoonepError instead of pairing with it)."""
        if self.cpu_group is not None and self.world_size > 1:
            self.host.agree(BARRIER, what="Runtime.barrier")

    def shutdown(self) -> None:
        """Destroy the default process group if ``init`` created it.

        Under MPI, rank 0 hosts the TCPStore: a final MPI barrier keeps it alive until every rank has torn
        its process group down (a rank whose store vanished mid-teardown aborts in C++).  After a failed
        collective (``failed``) no barrier is attempted: a dead peer would never arrive.  Every barrier
        here waits at most the runtime's timeout; one that expires is given up quietly (this is shutdown)
        and marks the runtime failed.
        """
        if self.failed and self._owns_pg and dist.is_initialized():
            self._owns_pg = False
            self.group = self.cpu_group = None
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (best effort: the job is already broken)
                pass
            return
        if self._owns_pg and dist.is_initialized():
            try:  # torchrun's env:// rendezvous also hosts the store in rank 0: keep a handle past destroy
                store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 (private API; the MPI barrier below covers mpirun anyway)
                store = None
            try:
                self.barrier()  # gloo: bounded by the group's timeout
            except Exception:  # noqa: BLE001 (a peer is dead, stalled or elsewhere: give the barriers up)
                self._give_up()
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                self._give_up()
            self._owns_pg = False
            # Drop our handles now: groups torn down later, at interpreter exit, can abort in C++.
            self.group = self.cpu_group = None
            if self.failed:
                return
            if self.comm is not None:
                try:
                    ok = _poll(self.comm.Ibarrier(), self.timeout.total_seconds())
                except Exception:  # noqa: BLE001 (mpi4py.MPI.Exception: a failed peer)
                    ok = False
                if not ok:
                    self._give_up()
            elif store is not None and self.world_size > 1:
                key = "moonep/shutdown"
                if self.rank != 0:
                    store.add(key, 1)
                else:  # the store's host leaves last
                    deadline = time.monotonic() + self.timeout.total_seconds()
                    while store.add(key, 0) < self.world_size - 1 and time.monotonic() < deadline:
                        time.sleep(0.005)
            del store


def local_runtime(device=None, timeout: float | None = None) -> Runtime:
    """A runtime for one process without a process group (``launcher="local"``, ``group=None``): what
    ``ExpertParallel(group=None)`` uses in a plain process.  No ``torch.distributed`` state is created."""
    from .errors import expect_device

    dev = expect_device(device) if device is not None else _pick_device(0, None)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    td = _timeout_delta(timeout)
    return Runtime(0, 1, 0, 1, dev, None, None, "none", "local", td)


def detect_launcher(env=os.environ) -> str:
    """Return "torchrun", "mpi" or "single" from the environment the launcher left us."""
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env):
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env or "PMIX_RANK" in env or "PMI_RANK" in env:
        return "mpi"
    return "single"


_HOST_BYTES = 256  # a host name's slot in the rendezvous gather (Linux names are at most 64 bytes)
_INFO_BYTES = 4096  # rank 0's pickled (address, port, error) in the rendezvous broadcast


def _rendezvous_wait(req, seconds: float, rank: int, what: str, keep) -> None:
    try:
        ok = _poll(req, seconds, keep)
    except Exception as exc:  # noqa: BLE001 (mpi4py.MPI.Exception)
        raise MoonepError(f"moonep.init: rank {rank}: {what} failed: {exc}") from exc
    if not ok:
        from .guard import mark_failed

        mark_failed(None, seconds)  # under mpirun: the process still ends (MPI_Finalize would wait)
        raise MoonepError(f"moonep.init: rank {rank}: {what} did not complete within the timeout of "
                          f"{seconds:g}s (a rank is dead, stalled or not calling moonep.init)")


def _mpi_rendezvous(timeout):
    """Local ranks from the ranks' host names, and rank 0's TCPStore address, over MPI: non-blocking
    collectives polled against ``timeout``, so a rank that never arrives (or a rank 0 that died before its
    broadcast) raises :class:`moonep.MoonepError` instead of blocking."""
    from mpi4py import MPI  # imported only under mpirun: importing it initialises MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    seconds = timeout.total_seconds()
    mine = np.zeros(_HOST_BYTES, dtype=np.uint8)
    name = socket.gethostname().encode()[:_HOST_BYTES - 1]
    mine[:len(name)] = np.frombuffer(name, dtype=np.uint8)
    table = np.zeros((size, _HOST_BYTES), dtype=np.uint8)
    _rendezvous_wait(comm.Iallgather(mine, table), seconds, rank, "the host-name gather", (mine, table))
    hosts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table]
    # Ranks on one host (what MPI_COMM_TYPE_SHARED groups), numbered in rank order.
    local_rank, local_size = hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank])
    store = None
    buf = np.zeros(_INFO_BYTES, dtype=np.uint8)
    if rank == 0:
        # One node: loopback. Several: rank 0's address (override with MOONEP_MASTER_ADDR).
        addr = os.environ.get("MOONEP_MASTER_ADDR") or (
            "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname()))
        try:
            store = dist.TCPStore(addr, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
            info = (addr, store.port, None)
        except Exception as exc:  # broadcast the failure instead of leaving peers waiting for the address
            info = (None, None, repr(exc)[:2000])
        data = pickle.dumps(info)
        buf[:8] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
        buf[8:8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    _rendezvous_wait(comm.Ibcast(buf, root=0), seconds, rank, "the broadcast of rank 0's store address", buf)
    n = int(np.frombuffer(buf[:8].tobytes(), dtype=np.int64)[0])
    addr, port, err = pickle.loads(buf[8:8 + n].tobytes())
    if err is not None:
        raise RuntimeError(f"moonep.init: rank 0 could not open its TCPStore: {err}")
    if rank != 0:
        store = dist.TCPStore(addr, port, size, is_master=False, timeout=timeout)
    return comm, store, rank, size, local_rank, local_size


def _pick_device(local_rank: int, want_cuda: bool | None) -> torch.device:
    use_cuda = torch.cuda.is_available() if want_cuda is None else want_cuda
    if not use_cuda:
        return torch.device("cpu")
    expect(torch.cuda.is_available(), "device", "CUDA to be available", "no CUDA device")
    # More ranks than GPUs is allowed (oversubscription): CUDA IPC works between processes on one GPU.
    dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def gloo_twin(pg, timeout: datetime.timedelta):
    """A gloo group of ``pg``'s ranks, for the host exchanges of an NCCL group.  Every rank of the job calls
    it together (``new_group`` is collective over the whole job): when ``pg`` is one group of a mesh dimension
    (an ``ep`` group beside others), the ranks gather every group's members and all build every twin, in one
    order, each keeping its own."""
    world = dist.new_group(list(range(dist.get_world_size())), backend="gloo", timeout=timeout)
    ranks = tuple(dist.get_process_group_ranks(pg))
    if len(ranks) == dist.get_world_size():
        return world
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ranks, group=world)
    mine = None
    for members in sorted(set(every)):
        g = dist.new_group(list(members), backend="gloo", timeout=timeout)
        if members == ranks:
            mine = g
    return mine


def init(group=None, *, backend: str | None = None, device: str | torch.device | None = None,
         timeout: float | None = None) -> Runtime:
    """Initialise moonep's runtime from whatever launched this process.

    Args:
        group: an existing ``torch.distributed`` ProcessGroup to use instead of creating one, or a 1-D
            DeviceMesh (the ``"ep"`` dimension of a ``("dp", "ep")`` mesh): its group, and expert parameters
            become DTensors over that mesh (FSDP2 shards them over its ``"dp"`` sibling).
        backend: "gloo" or "nccl"; default NCCL when the device is CUDA, else gloo.
        device: "cpu" or "cuda"; default: a DeviceMesh's device type, else CUDA when available.
        timeout: seconds before a collective that waits on a dead or stalled peer raises (default 60,
            or ``MOONEP_TIMEOUT``); also bounds the MPI rendezvous here and the barriers of
            :meth:`Runtime.shutdown`.

    Returns:
        A :class:`Runtime`. Calling ``init`` twice returns a runtime over the existing default group.
    """
    td = _timeout_delta(timeout)  # first: a bad MOONEP_TIMEOUT or timeout fails before anything is built
    want_cuda = None if device is None else torch.device(device).type == "cuda"
    if backend is not None:
        expect(backend in ("gloo", "nccl"), "backend", '"gloo" or "nccl"', repr(backend))
        if backend == "nccl":
            want_cuda = True
    env = os.environ
    mesh = None
    if isinstance(group, DeviceMesh):
        expect(group.ndim == 1, "group", "a ProcessGroup or a 1-D DeviceMesh (e.g. mesh['ep'])",
               f"a {group.ndim}-D DeviceMesh")
        mesh, group = group, group.get_group()
        # a mesh names its device type: a "cpu" mesh on a GPU machine stays on the host
        if want_cuda is not None and want_cuda != (mesh.device_type == "cuda"):
            name, got = ("device", device) if device is not None else ("backend", backend)
            fail(name, f"one that runs on the mesh's device type, {mesh.device_type} (or None)", got)
        want_cuda = mesh.device_type == "cuda"
    if group is not None or dist.is_initialized():
        pg = group if group is not None else dist.group.WORLD
        rank, size = dist.get_rank(pg), dist.get_world_size(pg)
        local_rank = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK",
                                                         env.get("MPI_LOCALRANKID", rank))))
        local_size = int(env.get("LOCAL_WORLD_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)))
        dev = _pick_device(local_rank, want_cuda)
        be = dist.get_backend(pg)
        cpu_group = pg if be == "gloo" else gloo_twin(pg, td)
        rt = Runtime(rank, size, local_rank, local_size, dev, pg, cpu_group, be, "external", td)
        rt.mesh = mesh
        return rt

    launcher = detect_launcher()
    comm = None
    if launcher == "mpi":
        comm, store, rank, size, local_rank, local_size = _mpi_rendezvous(td)
    elif launcher == "torchrun":
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_size = int(env.get("LOCAL_WORLD_SIZE", 1))
        store = None  # env:// rendezvous through MASTER_ADDR/MASTER_PORT that torchrun chose
    else:
        rank, size, local_rank, local_size = 0, 1, 0, 1
        store = dist.HashStore()
    dev = _pick_device(local_rank, want_cuda)
    # NCCL refuses two ranks on one GPU; oversubscribed GPU jobs (CUDA IPC tests) run gloo for the group.
    shared_gpu = dev.type == "cuda" and local_size > torch.cuda.device_count()
    be = backend or ("nccl" if dev.type == "cuda" and not shared_gpu else "gloo")
    expect(not (be == "nccl" and shared_gpu), "backend",
           f"gloo when {local_size} local ranks share {torch.cuda.device_count()} GPUs (NCCL refuses that)", be)
    kwargs = dict(backend=be, rank=rank, world_size=size, timeout=td)
    if store is not None:
        kwargs["store"] = store
    if be == "nccl":
        kwargs["device_id"] = dev
    dist.init_process_group(**kwargs)
    pg = dist.group.WORLD
    cpu_group = pg if be == "gloo" else dist.new_group(list(range(size)), backend="gloo", timeout=td)
    return Runtime(rank, size, local_rank, local_size, dev, pg, cpu_group, be, launcher, td, comm, True)
