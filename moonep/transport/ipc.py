"""Symmetric device buffers over CUDA IPC (through CuPy): one allocation per rank, mapped into every peer.

Why CuPy IPC and not ``torch.distributed._symmetric_memory``:

* CUDA IPC (``cudaIpcGetMemHandle``/``cudaIpcOpenMemHandle``) works between processes that share one
  GPU, which is how we test 4 or 8 ranks on 1-2 GPUs; it needs nothing but the driver and a way to swap
  64-byte handles (``all_gather_object`` on the runtime's gloo group).
* The layout is ours: one ``cudaMalloc`` per rank with identical offsets on every rank, so a kernel
  reaches any peer's buffer as ``base[peer] + offset`` and signal words sit next to the data.  Nothing
  creates multicast objects (which must stay off on our machines).
* torch's symmetric memory API has been moving between releases (the GPU image runs torch 2.11, CI
  2.13), and its CUDA backend rendezvous assumes one rank per device; CuPy's IPC wrappers are thin and
  stable.  The price is a CuPy dependency on the GPU path only (``pip install moonep[cuda13]``).

Memory from :class:`SymmetricBuffer` is a raw ``cudaMalloc`` (IPC needs the allocation base, which
torch's caching allocator does not expose) wrapped as torch tensors without copies.  Views handed out by
:meth:`SymmetricBuffer.view` dangle after :meth:`SymmetricBuffer.close`.
"""
from __future__ import annotations

import ctypes
import os

import torch


# Peer mappings currently open in this process (cudaIpcOpenMemHandle minus cudaIpcCloseMemHandle), and
# symmetric allocations not yet freed: resource-hygiene tests check they return to zero.
_LIVE = {"ipc_handles": 0, "buffers": 0}


def live_counts() -> dict:
    """``{"ipc_handles": n, "buffers": m}``: IPC mappings and symmetric buffers open in this process."""
    return dict(_LIVE)


def _cupy():
    import cupy  # imported lazily: CPU installs never need it

    return cupy


class SymmetricBuffer:
    """``nbytes`` of device memory on every rank, with every rank's pointer mapped here.

    Collective: every rank of ``group`` constructs it with the same ``nbytes``, at the same point.

    Attributes:
        ptr: this rank's device pointer (int).
        peer_ptrs: ``R`` ints, rank ``p``'s allocation as mapped in this process (``peer_ptrs[rank] == ptr``).
    """

    def __init__(self, nbytes: int, device: torch.device, rank: int, world_size: int, all_gather_object):
        cp = _cupy()
        rt = cp.cuda.runtime
        self.nbytes = int(max(nbytes, 256))
        self.device = device
        self.rank, self.world_size = rank, world_size
        self._opened: list[int] = []
        self._closed = False
        with cp.cuda.Device(device.index):
            self.ptr = int(rt.malloc(self.nbytes))
            _LIVE["buffers"] += 1
            rt.memset(self.ptr, 0, self.nbytes)
            rt.deviceSynchronize()  # zeroed before any peer can signal into it
            handle = bytes(rt.ipcGetMemHandle(self.ptr))
        infos = all_gather_object((handle, os.getpid(), device.index, self.nbytes))
        errors = []
        self.peer_ptrs = []
        with cp.cuda.Device(device.index):
            for r, (h, _pid, _dev, nb) in enumerate(infos):
                if nb != self.nbytes:
                    errors.append(f"rank {r} allocated {nb} bytes, this rank {self.nbytes}")
                if r == rank:
                    self.peer_ptrs.append(self.ptr)
                    continue
                try:
                    p = int(rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess))
                except Exception as exc:  # report on every rank instead of leaving peers half-mapped
                    errors.append(f"rank {rank} could not map rank {r}'s buffer: {exc!r}")
                    p = 0
                else:
                    self._opened.append(p)
                    _LIVE["ipc_handles"] += 1
                self.peer_ptrs.append(p)
        all_errors = [e for errs in all_gather_object(errors) for e in errs]
        if all_errors:
            self.close(barrier=None)
            from ..errors import MoonepError

            raise MoonepError("symmetric buffer setup failed: " + "; ".join(all_errors))

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """A torch tensor over ``[offset, offset + numel*itemsize)`` of this rank's allocation (no copy)."""
        cp = _cupy()
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        assert offset % 16 == 0 and offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
        mem = cp.cuda.UnownedMemory(self.ptr + offset, max(nbytes, 1), self, self.device.index)
        arr = cp.ndarray((max(nbytes, 1),), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        t = torch.as_tensor(arr, device=self.device)[:nbytes]
        return t.view(dtype).view(*shape) if nbytes else torch.empty(shape, dtype=dtype, device=self.device)

    def close(self, barrier=None) -> None:
        """Unmap the peers' buffers, wait for every rank (``barrier()``), then free this rank's memory."""
        if self._closed:
            return
        self._closed = True
        cp = _cupy()
        rt = cp.cuda.runtime
        with cp.cuda.Device(self.device.index):
            for p in self._opened:
                try:
                    rt.ipcCloseMemHandle(p)
                except Exception:
                    pass
                _LIVE["ipc_handles"] -= 1
            self._opened = []
            if barrier is not None:
                barrier()  # nobody still maps our memory when we free it
            try:
                rt.free(self.ptr)
            except Exception:
                pass
            _LIVE["buffers"] -= 1


class HostWords:
    """A few int32 words in pinned, device-mapped host memory: kernels write errors, the host reads them
    with a plain load (no CUDA call, so no synchronisation and nothing for sync-debug mode to flag)."""

    def __init__(self, n: int, device: torch.device):
        cp = _cupy()
        rt = cp.cuda.runtime
        self.n = n
        with cp.cuda.Device(device.index):
            self.ptr = int(rt.hostAlloc(4 * n, rt.hostAllocMapped | rt.hostAllocPortable))
            try:
                self.device_ptr = int(rt.pointerGetAttributes(self.ptr).devicePointer) or self.ptr
            except Exception:  # unified addressing: the host pointer is valid on the device
                self.device_ptr = self.ptr
        self._words = (ctypes.c_int32 * n).from_address(self.ptr)
        for i in range(n):
            self._words[i] = 0

    def __getitem__(self, i: int) -> int:
        return int(self._words[i])

    def __setitem__(self, i: int, v: int) -> None:
        self._words[i] = int(v)

    def close(self) -> None:
        if self.ptr:
            self._words = None
            try:
                _cupy().cuda.runtime.freeHost(self.ptr)
            except Exception:
                pass
            self.ptr = 0
