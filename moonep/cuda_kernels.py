"""Run-time CUDA kernels from ``csrc/*.cu`` (CuPy RawModule, NVRTC), launched on torch's current stream.

CuPy is imported lazily, only when a CUDA tensor needs a kernel, so CPU installs need neither CuPy nor a
build step. Kernels take raw device pointers of torch tensors and run on torch's current stream
(``cupy.cuda.ExternalStream``): no DLPack handshake, no host sync, capturable in a CUDA graph.
"""
from __future__ import annotations

import os

import numpy as np
import torch

_MODULES: dict = {}
_SMEM_SET: dict = {}
_AVAILABLE = None
_STREAMS: dict = {}


def available() -> bool:
    """CuPy importable (checked once); ``MOONEP_NO_CUPY=1`` forces the pure-torch fallbacks."""
    global _AVAILABLE
    if _AVAILABLE is None:
        if os.environ.get("MOONEP_NO_CUPY", "") not in ("", "0"):
            _AVAILABLE = False
        else:
            try:
                import cupy  # noqa: F401
                _AVAILABLE = True
            except Exception:  # ImportError, or a CuPy that cannot find its CUDA libraries
                _AVAILABLE = False
    return _AVAILABLE


def source_path(name: str) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for p in (os.path.join(here, "..", "csrc", name), os.path.join(here, "csrc", name)):
        if os.path.exists(p):
            return os.path.normpath(p)
    raise FileNotFoundError(f"csrc/{name} not found next to the moonep package")


def module(name: str):
    """The compiled ``csrc/<name>`` (cached per process; NVRTC compiles for the current device)."""
    mod = _MODULES.get(name)
    if mod is None:
        import cupy
        with open(source_path(name)) as f:
            src = f.read()
        mod = _MODULES[name] = cupy.RawModule(code=src, options=("-std=c++17",))
    return mod


def ptr(t: torch.Tensor):
    """Kernel argument for a tensor's device address."""
    return np.uint64(t.data_ptr())


def stream(device: torch.device):
    """Context manager: CuPy's current device and stream = torch's current stream on ``device``."""
    import contextlib

    import cupy
    handle = torch.cuda.current_stream(device).cuda_stream
    st = _STREAMS.get((device.index, handle))
    if st is None:
        st = _STREAMS[(device.index, handle)] = cupy.cuda.ExternalStream(handle, device.index)
    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(device.index))
    stack.enter_context(st)
    return stack


def allow_smem(fn, key, nbytes: int, device_index: int) -> None:
    """Opt ``fn`` in to more than 48 KiB of dynamic shared memory (once per size and device)."""
    k = (key, device_index)
    if nbytes > 48 * 1024 and _SMEM_SET.get(k, 0) < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes
        _SMEM_SET[k] = nbytes


_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    n = _SMS.get(device.index)
    if n is None:
        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n
