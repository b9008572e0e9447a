"""One runtime for every CUDA kernel of moonep: compile, cache, stream and launch.

The kernels are plain CUDA C in ``csrc/``, grouped in *programs* (:data:`PROGRAMS`): an ordered list of
files concatenated into one translation unit (``#pragma once`` and ``#include`` lines naming a file of the
same program are dropped, so NVRTC needs no include path; each file still compiles alone with nvcc).

* **Compile**: ``cupy.RawModule(code=..., backend="nvrtc")``, once per (program, device) in a process. The
  shipped build has no switches; profiling tools ask for another one with :func:`profile_build` before a
  program is first used (``-lineinfo``, phase clocks of the planner, another fp8 send fanout...), and the
  library itself never does.  CuPy's on-disk cache keys on the full source text, the options and the
  architecture, so a later process only loads the binary, and editing any file of a program recompiles it.
* **Why CuPy/NVRTC**: no build step, and CPU installs need neither CuPy nor a compiler: CuPy is imported
  lazily, only when a CUDA tensor needs a kernel. ``MOONEP_NO_CUPY=1`` makes :func:`available` false, so
  callers take their pure-torch fallbacks. A CUDA caller that falls back because CuPy cannot be imported
  says so once per process (:func:`available_for`, a :class:`CuPyMissingWarning` naming the extra).
* **Stream**: every launch goes to torch's current stream of the device (``_cuda_getCurrentRawStream``),
  wrapped once per (device, stream) in a CuPy stream object (:func:`stream`, one cache for all programs).
  No DLPack hand-off, no device context switch, no host sync, so launches are CUDA-graph capturable.
* **Launch**: :meth:`Kernels.launch` calls the cached ``cupy.cuda.Function`` with the stream as a positional
  argument: no per-call import, context manager or stream object. Which call form and argument type this
  CuPy accepts is probed once per process with a no-op kernel (:func:`launch_form`); with an old CuPy the
  context-manager form is used instead. Hot paths that record their launch (``moonep.planner.cuda``) keep
  ``Kernels.fn[name]``, ``Kernels.streams`` and pre-built arguments (``Kernels.arg`` / :meth:`Kernels.c`); the
  others pass addresses, int64 and int values through :func:`ptr`, :func:`i64` and :func:`i32`, pre-built as
  well once probed.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import env_flag
from .errors import expect, fail

__all__ = ["PROGRAMS", "Program", "Kernels", "available", "csrc_dir", "program_source", "compile_options",
           "kernels", "loaded", "stream", "num_sms", "dispatch_threads", "ptr", "i64", "i32", "launch_form",
           "STATIC_SMEM", "PROFILE_SWITCHES", "profile_build", "profile_switch", "parse_switches"]


# Profiling builds: the -D switches a tool may set (tools/, benchmarks/): each one's kind ("flag": defined or
# not, read with #ifdef; "int": -DNAME=value), accepted values, and the default the shipped build compiles
# with (None: not defined).
PROFILE_SWITCHES = {
    "MOONEP_PLAN_CLOCKS": ("flag", (0, 1), None),     # cycle counters per planner phase (tools/profile_planner.py)
    "MOONEP_PLAN_STAMPS": ("flag", (0, 1), None),     # phase stamps of the fused planner launch
    "MOONEP_QUANT_SOFT_CVT": ("flag", (0, 1), None),  # the portable e4m3 conversion instead of the sm_89+ one
    "MOONEP_FP8_WORDS": ("int", tuple(range(9)), None),  # fp8 send fanout, 16-byte words in flight (common.cuh)
    "MOONEP_DISPATCH_THREADS": ("int", tuple(range(512, 1025, 32)), 512),  # the fused dispatch's block size
}
_SHIPPED = {"lineinfo": False, "defines": {}, "sources": None, "extra": {}}
BUILD_SIZED: list = []  # callables: whether a module has sized something for the build in force (the planner)
_PROFILE: dict = dict(_SHIPPED)
_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def profile_build(*, lineinfo: bool = False, sources: str | None = None, **switches: int) -> None:
    """Compile every program first used after this call with ``-lineinfo`` (source lines in ncu) and with
    ``switches`` (names and values of :data:`PROFILE_SWITCHES`), replacing an earlier call's; with no argument,
    the shipped build.  For profiling tools; results are those of the shipped build except where a switch's
    comment says otherwise.

    ``sources``: a directory of patched kernel sources to compile instead of ``csrc/`` (e.g. with
    ``tools/diag_nvlink.patch`` applied); ``switches`` may then also name that patch's own integer defines
    (each must appear in those sources), which every program gets.

    Raises ``ValueError`` for an unknown switch or value, and ``RuntimeError`` once a program is loaded or the
    planner has sized a workspace (the build is fixed for the process: call this first); asking again for the
    build already in force is a no-op."""
    src = None if sources is None else Path(sources).resolve()
    expect(src is None or (src / "common.cuh").exists(), "sources",
           "a directory holding the kernel sources (common.cuh...)", sources)
    text = "" if src is None else "\n".join(f.read_text() for f in sorted(src.iterdir()) if f.suffix in (".cu", ".cuh"))
    extra = {}
    for name, v in switches.items():
        expect(type(v) is int, name, "an int", repr(v))  # (a bool or a float would compile as something else)
        if name not in PROFILE_SWITCHES and src is not None:
            expect(_NAME.fullmatch(name) is not None and name in text, "switches",
                   f"names from {sorted(PROFILE_SWITCHES)} or defines the sources in {src} read", name)
            extra[name] = v
            continue
        expect(name in PROFILE_SWITCHES, "switches", f"names from {sorted(PROFILE_SWITCHES)}", name)
        expect(v in PROFILE_SWITCHES[name][1], name, f"one of {PROFILE_SWITCHES[name][1]}", v)
    want = {"lineinfo": bool(lineinfo), "defines": {k: v for k, v in switches.items() if k not in extra},
            "sources": src, "extra": extra}
    if want == _PROFILE:
        return
    if any(_LOADED.values()) or any(sized() for sized in BUILD_SIZED):
        raise RuntimeError("profile_build: a kernel program is already loaded (or a planner workspace sized) in "
                           "this process; call it before the first CUDA call of moonep")
    _PROFILE.clear()
    _PROFILE.update(want)


def parse_switches(spec: str, what: str) -> dict:
    """``"NAME=INT,NAME=INT"`` (a tool's ``--switch`` values, a test's ``MOONEP_TEST_BUILD``) -> the keyword
    arguments of :func:`profile_build`; a malformed item raises ``ValueError`` naming ``what``."""
    switches = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not value.strip().lstrip("-").isdigit():
            fail(what, "comma-separated NAME=INT", repr(spec))
        switches[name.strip()] = int(value)
    return switches


def profile_switch(name: str):
    """The value a program compiles ``name`` with (:func:`profile_build`, else its default; ``None``: not
    defined, as a flag that is off)."""
    kind, _, default = PROFILE_SWITCHES[name]
    v = _PROFILE["defines"].get(name, default)
    return None if v is None or (kind == "flag" and not v) else v


def dispatch_threads() -> int:
    """Threads per block of the fused dispatch, compiled into its launch bounds and used to launch it (512;
    ``MOONEP_DISPATCH_THREADS`` of :func:`profile_build`).  One block per SM: more threads are more warps in
    flight with fewer registers each."""
    return profile_switch("MOONEP_DISPATCH_THREADS")


@dataclass(frozen=True)
class Program:
    """files: csrc/ files in translation-unit order; kernels: the ``extern "C"`` kernels loaded when the
    program is; defines: the program's compile-time switches, read when it is compiled."""

    files: tuple[str, ...]
    kernels: tuple[str, ...]
    switches: tuple[str, ...] = ()  # the PROFILE_SWITCHES its sources read

    def defines(self) -> tuple[str, ...]:
        """``-D`` options of its switches that are set (:func:`profile_build`) or have a default."""
        out = []
        for name in self.switches:
            v = profile_switch(name)
            if v is not None:
                out.append(f"-D{name}={v}")
        return tuple(out)


PROGRAMS: dict[str, Program] = {
    # balanced plan (planner.cu) and token layout (layout.cu), launched by moonep/planner/cuda.py
    "plan": Program(("planner.cu", "layout.cu"),
                    ("moonep_plan", "moonep_colsum", "moonep_assign", "moonep_cu", "moonep_layout",
                     "moonep_plan_layout"),
                    ("MOONEP_PLAN_CLOCKS", "MOONEP_PLAN_STAMPS")),
    # the NVLink backend's data path by stage, launched by moonep/backends/nvlink.py
    "ep": Program(("common.cuh", "route.cu", "dispatch.cu", "combine.cu", "replicas.cu"),
                  ("moonep_gather", "moonep_route_gather", "moonep_dispatch_send", "moonep_dispatch_expand",
                   "moonep_dispatch_fused", "moonep_dispatch_zero", "moonep_combine_reduce", "moonep_combine_sum",
                   "moonep_combine_fused", "moonep_prefetch_push", "moonep_prefetch_finish",
                   "moonep_reduce_stage", "moonep_reduce_finish"),
                  ("MOONEP_FP8_WORDS", "MOONEP_DISPATCH_THREADS", "MOONEP_QUANT_SOFT_CVT")),
    # Quantile Balancing's recording and bias step, launched by moonep/balance.py
    "balance": Program(("balance.cu",),
                       ("qb_record_f32", "qb_record_bf16", "qb_record_f16", "qb_record_f64", "qb_quantiles",
                        "qb_finalize")),
    # FP8 (e4m3) quantiser, launched by moonep/quant.py (common.cuh also holds the send fanout, unused here)
    "quant": Program(("common.cuh", "quant.cu"), ("moonep_quant_f32", "moonep_quant_bf16", "moonep_quant_f16",
                      "moonep_quant_wire_f32", "moonep_quant_wire_bf16", "moonep_quant_wire_f16"),
                     ("MOONEP_QUANT_SOFT_CVT", "MOONEP_FP8_WORDS")),
    # float32 expert GEMMs with the slot offsets read on the device, and the row moves around torch's grouped
    # GEMMs, launched by moonep/experts_cuda.py
    "slot_gemm": Program(("slot_gemm.cu",), ("moonep_slot_gemm_f32", "moonep_slot_wgrad_f32", "moonep_rows_front",
                                             "moonep_rows_back")),
}

# Dynamic shared memory a kernel may use without the opt-in is 48 KiB minus its static shared memory; the
# kernels' static shared memory stays below this margin wherever they also take dynamic memory.
STATIC_SMEM = 1024
_DYN_DEFAULT = 48 * 1024 - STATIC_SMEM

_cur_dev = getattr(torch._C, "_cuda_getDevice", None)                # absent in CPU-only torch builds
_cur_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

_AVAILABLE = None
_IMPORT_ERROR = None  # why ``import cupy`` failed (set by available())
_WARNED = False       # the CuPy-missing warning was given in this process
_CSRC = None
_LOADED: dict = {name: {} for name in PROGRAMS}   # program -> {device index: Kernels}
_STREAMS: dict = {}   # device index -> {raw stream pointer: CuPy stream}
_SMS: dict = {}
_FORM = None          # (argument type, positional stream) this CuPy accepts
# Kernel arguments: numpy scalars until launch_form finds CuPy's pre-built CIntptr (8 bytes: addresses, int64) and
# CInt32 (int), which a launch passes as they are (a numpy scalar is converted on every launch: a step makes hundreds)
_ARG8, _ARG4 = np.int64, np.int32


def available() -> bool:
    """CuPy importable (checked once); ``MOONEP_NO_CUPY=1`` forces the pure-torch fallbacks."""
    global _AVAILABLE, _IMPORT_ERROR
    if _AVAILABLE is None:
        if env_flag("MOONEP_NO_CUPY", False):
            _AVAILABLE = False
        else:
            try:
                import cupy  # noqa: F401
                _AVAILABLE = True
            except Exception as exc:  # ImportError, or a CuPy that cannot find its CUDA libraries
                _AVAILABLE, _IMPORT_ERROR = False, exc
    return _AVAILABLE


class CuPyMissingWarning(UserWarning):
    """A CUDA run takes a pure-torch fallback because CuPy cannot be imported."""


def cupy_install_hint() -> str:
    """The pip command that brings CuPy for this torch's CUDA (both extras when the version is unknown)."""
    major = (torch.version.cuda or "").split(".")[0]
    if major in ("12", "13"):
        return f"pip install 'moonep[cuda{major}]'"
    return "pip install 'moonep[cuda12]' (CUDA 12) or 'moonep[cuda13]' (CUDA 13)"


def warn_cupy_missing(fallback: str) -> None:
    """Warn, once per process, that a CUDA run takes ``fallback`` because CuPy cannot be imported.

    Silent when CuPy imports, and when the import was never tried: ``MOONEP_NO_CUPY=1`` (the fallbacks
    were asked for) or a test that switched the kernels off. Once per process, not per call site: one
    missing package is one thing to fix, whatever falls back."""
    global _WARNED
    if _WARNED or available() or _IMPORT_ERROR is None:
        return
    _WARNED = True
    why = f"{type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}"
    warnings.warn(f"moonep: CuPy cannot be imported ({why}), so this CUDA run uses {fallback}, slower than "
                  f"moonep's CUDA kernels; install CuPy with {cupy_install_hint()} (warned once per process)",
                  CuPyMissingWarning, stacklevel=3)


def available_for(fallback: str) -> bool:
    """:func:`available`, for a CUDA caller that takes ``fallback`` without CuPy: warns once when it must."""
    if _AVAILABLE:  # the hot path: one global read
        return True
    if available():
        return True
    warn_cupy_missing(fallback)
    return False


def csrc_dir() -> Path:
    """The kernel sources: a profiling build's patched copy (:func:`profile_build`), else ``csrc/`` beside the
    package in a checkout, or ``moonep/csrc`` (package data)."""
    global _CSRC
    if _PROFILE["sources"] is not None:
        return _PROFILE["sources"]
    if _CSRC is None:
        here = Path(__file__).resolve().parent
        for cand in (here.parent / "csrc", here / "csrc"):
            if (cand / "common.cuh").exists():
                _CSRC = cand
                break
        else:
            raise FileNotFoundError("moonep: csrc/common.cuh not found next to the package")
    return _CSRC


_INCLUDE = re.compile(r'#include\s+"([^"]+)"')


def program_source(name: str) -> str:
    """The program's files as one translation unit (NVRTC needs no include path)."""
    files = PROGRAMS[name].files
    parts = []
    for f in files:
        lines = []
        for line in (csrc_dir() / f).read_text().splitlines():
            s = line.strip()
            m = _INCLUDE.fullmatch(s)
            if s != "#pragma once" and not (m and m.group(1) in files):
                lines.append(line)
        parts.append(f"// ---- {f} ----\n" + "\n".join(lines))
    return "\n".join(parts)


def compile_options(name: str) -> tuple[str, ...]:
    """NVRTC options of a program: the shipped build's, or the profiling build's (:func:`profile_build`)."""
    extra = tuple(f"-D{k}={v}" for k, v in _PROFILE["extra"].items())  # a patched build's own defines
    return ("-std=c++17",) + (("-lineinfo",) if _PROFILE["lineinfo"] else ()) + PROGRAMS[name].defines() + extra


def ptr(t):
    """Kernel argument for a tensor's device address (``None``: a null pointer)."""
    return _ARG8(0 if t is None else t.data_ptr())


def i64(v: int):
    """Kernel argument for an ``int64`` (``long long``) value."""
    return _ARG8(v)


def i32(v: int):
    """Kernel argument for an ``int`` (32-bit) value.  Like :func:`ptr` and :func:`i64`, a kernel argument object:
    pass it to a launch, never test or compute with it (a CuPy argument object is always true)."""
    return _ARG4(v)


def num_sms(device_index: int) -> int:
    """Multiprocessors of a CUDA device (cached)."""
    n = _SMS.get(device_index)
    if n is None:
        n = _SMS[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return n


class _TorchStream:
    """A raw stream pointer through the CUDA stream protocol (for ``cupy.cuda.Stream.from_external``)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def stream(device_index: int, raw=None):
    """The CuPy stream for torch's current stream on a device (or for the raw stream pointer ``raw``),
    wrapped once per (device, stream)."""
    if raw is None:
        raw = _cur_stream(device_index)
    streams = _STREAMS.setdefault(device_index, {})
    s = streams.get(raw)
    if s is None:
        import cupy
        if hasattr(cupy.cuda.Stream, "from_external"):
            s = cupy.cuda.Stream.from_external(_TorchStream(raw))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                s = cupy.cuda.ExternalStream(raw, device_index)
        streams[raw] = s
    return s


def launch_form(device_index: int):
    """(argument type, positional stream): the cheapest launch this CuPy accepts, probed once per process with
    a no-op kernel on torch's current stream of the device. The argument type is ``CIntptr`` (a pre-built
    kernel argument; with ``CInt32`` for :func:`i32`) where CuPy has them, else ``int`` (converted by CuPy on
    every call)."""
    global _FORM, _ARG8, _ARG4
    if _FORM is None:
        import cupy
        try:
            from cupy.cuda.function import CInt32, CIntptr
            CIntptr(0), CInt32(0)
        except Exception:  # older CuPy: plain ints
            CIntptr = CInt32 = None
        with cupy.cuda.Device(device_index):
            mod = cupy.RawModule(code='extern "C" __global__ void moonep_probe(long long x, int y) {}',
                                 options=("-std=c++17",), backend="nvrtc")
            raw = mod.get_function("moonep_probe")
            fn = raw.kernel
            st = stream(device_index)
            forms = ((CIntptr, CInt32, True),) if CIntptr is not None else ()
            for arg, arg4, positional in forms + ((int, np.int32, True), (int, np.int32, False)):
                try:
                    if positional:
                        fn((1,), (1,), (arg(0), arg4(0)), 0, st)
                    else:
                        with st:
                            raw((1,), (1,), (arg(0), arg4(0)), shared_mem=0)
                except TypeError:
                    continue
                _FORM = (arg, positional)
                if arg is not int:
                    _ARG8, _ARG4 = arg, arg4
                break
            else:
                raise RuntimeError("moonep: cannot launch CUDA kernels with this CuPy version")
    return _FORM


class Kernels:
    """The compiled kernels of one program on one device, and how to launch them.

    Attributes:
        fn: kernel name -> ``cupy.cuda.Function`` (loaded on this device); raw: name -> ``cupy.RawKernel``.
        streams: the shared stream cache's entry of this device (raw stream pointer -> CuPy stream).
        arg: the kernel argument type for integers and pointers (``CIntptr`` or ``int``, see launch_form).
        lean: launches take the positional-stream form (False: an old CuPy, the context-manager form).
        smem_max: dynamic shared memory bytes a kernel may use after the opt-in (:meth:`need_smem`).
    """

    def __init__(self, program: str, device_index: int):
        try:
            import cupy
        except ImportError as exc:  # a bare "No module named 'cupy'" would not say how to get it
            raise ImportError(f"moonep: the CUDA kernels ({program!r}) need CuPy: {cupy_install_hint()}",
                              name="cupy") from exc

        self.program, self.di = program, device_index
        self.device = torch.device("cuda", device_index)
        self.options = compile_options(program)
        self.arg, self.lean = launch_form(device_index)
        names = PROGRAMS[program].kernels
        with cupy.cuda.Device(device_index):
            mod = cupy.RawModule(code=program_source(program), options=self.options, backend="nvrtc")
            self.raw = {k: mod.get_function(k) for k in names}
            self.fn = {k: v.kernel for k, v in self.raw.items()}  # compiles and loads once
        self.smem = dict.fromkeys(names, _DYN_DEFAULT)  # dynamic bytes allowed so far
        props = torch.cuda.get_device_properties(device_index)
        self.smem_max = int(getattr(props, "shared_memory_per_block_optin", 227 * 1024)) - STATIC_SMEM
        self.streams = _STREAMS.setdefault(device_index, {})
        self.consts: dict = {}

    def c(self, v: int):
        """Cached kernel argument for a small constant."""
        a = self.consts.get(v)
        if a is None:
            a = self.consts[v] = self.arg(v)
        return a

    def stream(self, raw=None):
        """The CuPy stream for torch's current stream on this device (or for ``raw``)."""
        return stream(self.di, raw)

    def need_smem(self, name: str, nbytes: int) -> None:
        """Let kernel ``name`` take ``nbytes`` of dynamic shared memory (the opt-in above the default limit,
        once per larger size)."""
        if nbytes > self.smem[name]:
            import cupy
            with cupy.cuda.Device(self.di):
                self.raw[name].max_dynamic_shared_size_bytes = nbytes
            self.smem[name] = nbytes

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple, smem: int = 0, any_device: bool = False):
        """Launch kernel ``name`` on torch's current stream of this device. grid, block: tuples of ints.

        The calling thread's current CUDA device must be this one, unless ``any_device`` (one device query
        more per launch; another current device takes the context-manager form)."""
        st = self.streams.get(_cur_stream(self.di))
        if st is None:
            st = self.stream()
        if self.lean and (not any_device or _cur_dev() == self.di):
            self.fn[name](grid, block, args, smem, st)
        else:
            import cupy
            with cupy.cuda.Device(self.di):
                if self.lean:
                    self.fn[name](grid, block, args, smem, st)
                else:
                    with st:
                        self.raw[name](grid, block, args, shared_mem=smem)


def kernels(program: str, device_index: int) -> Kernels:
    """The program's kernels on a device, compiled and loaded on first use (see the module docstring)."""
    k = _LOADED[program].get(device_index)
    if k is None:
        k = _LOADED[program][device_index] = Kernels(program, device_index)
    return k


def loaded(program: str) -> dict:
    """The program's loaded kernels by device index (the cache :func:`kernels` fills), for callers that look
    them up on every call: one dict lookup."""
    return _LOADED[program]
