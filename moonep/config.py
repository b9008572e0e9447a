"""Configuration: the tuning knobs of the GPU kernels, and every environment variable moonep reads.

Tuning lives in :class:`Tuning`, passed to ``ExpertParallel(..., tuning=...)``; no variable overrides it.
The package reads six environment variables: the runtime's timeouts, its order check and the rendezvous
address, and two test switches, none of which changes a result.  ``ENV`` lists them beside those that the
tests, tools and benchmarks read (a unit test checks that no code reads another ``MOONEP_*`` variable).
Profiling builds of the kernels are asked for in code (:func:`moonep.cuda_runtime.profile_build`).

Every variable is read through :func:`env_float`, :func:`env_int` or :func:`env_flag` when it is used, not
when ``moonep`` is imported (``MOONEP_BOARD_CHECK`` is the exception: read when the order board's module is
imported).  A bad value raises ``ValueError("NAME: expected <accepted values>, got 'raw'")``; an empty value
counts as unset.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .errors import expect, expect_int

FUSED_STAGES = ("route", "dispatch", "combine")


@dataclass(frozen=True)
class Tuning:
    """Tuning of the nvlink backend's kernels; results are bitwise the same for every valid setting.

    Args:
        num_sms: blocks that drive NVLink (the dispatch send; the combine's push gets ``combine_sms``).  The
            rest of the grid, every other SM, does the local HBM work of the fused kernels.
        chunks: source-token chunks of the fused dispatch, each with its own signal, so the receiver's
            local expansion starts before the whole send has landed (1..8).
        combine_sms: NVLink blocks of the fused combine; ``None`` is ``2 * num_sms`` (they also read about
            ``K/R`` rows for every row they push).
        fused: which stages run as one fused kernel: any of ``"route"`` (validation + counts all-gather),
            ``"dispatch"`` (send overlapped with the local expansion) and ``"combine"``.  The default fuses
            route and dispatch; the fused combine measured slower than the two-kernel one
            (docs/performance.md).
    """

    num_sms: int = 24
    chunks: int = 4
    combine_sms: int | None = None
    fused: tuple = ("route", "dispatch")

    def __post_init__(self):
        expect_int(self.num_sms, "tuning.num_sms", 1)
        expect_int(self.chunks, "tuning.chunks", 1)
        expect(self.chunks <= 8, "tuning.chunks", "at most 8", self.chunks)
        expect(self.combine_sms is None or (isinstance(self.combine_sms, int) and self.combine_sms >= 1),
               "tuning.combine_sms", "None or an int >= 1", repr(self.combine_sms))
        expect(isinstance(self.fused, (tuple, list, frozenset, set)) and set(self.fused) <= set(FUSED_STAGES),
               "tuning.fused", f"a tuple of stages from {FUSED_STAGES}", repr(self.fused))
        object.__setattr__(self, "fused", tuple(s for s in FUSED_STAGES if s in set(self.fused)))


def parse_fused(spec: str, name: str = "fused") -> tuple:
    """``"0"`` (none), ``"1"`` (all) or a comma list of stages -> a tuple of stages."""
    stages = {"0": set(), "1": set(FUSED_STAGES)}.get(spec.strip(), {t.strip() for t in spec.split(",") if t.strip()})
    expect(stages <= set(FUSED_STAGES), name, '"0", "1" or a comma list of route, dispatch, combine', repr(spec))
    return tuple(s for s in FUSED_STAGES if s in stages)


def _env_raw(name: str):
    """The variable's text, or ``None`` when it is unset or empty (whitespace only)."""
    raw = os.environ.get(name)
    return None if raw is None or not raw.strip() else raw


def env_float(name: str, default, *, lo_exclusive: float = 0.0):
    """A finite float ``> lo_exclusive`` from the environment, or ``default`` when unset or empty."""
    raw = _env_raw(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > lo_exclusive):
        raise ValueError(f"{name}: expected a finite number > {lo_exclusive:g}, got {raw!r}")
    return v


def env_int(name: str, default, lo: int | None = None, hi: int | None = None):
    """An int in ``[lo, hi]`` (either bound may be ``None``) from the environment, or ``default`` when unset
    or empty.  Only plain decimal integers are accepted (no ``1.5``, ``1e3`` or ``inf``)."""
    raw = _env_raw(name)
    if raw is None:
        return default
    try:
        v = int(raw.strip(), 10)
    except ValueError:
        v = None
    if v is None or (lo is not None and v < lo) or (hi is not None and v > hi):
        want = ("an int" + (f" in [{lo}, {hi}]" if lo is not None and hi is not None else
                            f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else ""))
        raise ValueError(f"{name}: expected {want}, got {raw!r}")
    return v


_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_flag(name: str, default: bool) -> bool:
    """A boolean from the environment: 1/true/yes/on or 0/false/no/off (any case), ``default`` when unset
    or empty."""
    raw = _env_raw(name)
    if raw is None:
        return default
    v = _FLAGS.get(raw.strip().lower())
    if v is None:
        raise ValueError(f"{name}: expected one of 0, 1, true, false, yes, no, on, off, got {raw!r}")
    return v


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    group: str  # runtime, library tests (both read by the package), tests or tools (read outside it)
    doc: str


# Every MOONEP_* variable read anywhere in the package, its tests, tools and benchmarks (the package reads
# the runtime ones and the two "library tests" switches; profiling builds are asked for in code,
# cuda_runtime.profile_build, and a Tuning is an argument):
# name | default | group | what it does
_TABLE = """
MOONEP_TIMEOUT | 60 | runtime | seconds a collective waits for a peer before MoonepError (moonep.init's default; a finite number > 0)
MOONEP_NVLINK_TIMEOUT | the runtime's timeout | runtime | seconds the nvlink kernels wait for a peer's signal (a finite number > 0)
MOONEP_CHECK_ORDER | 1 | runtime | 0 skips the per-call header exchange that checks all ranks make the same call with agreeing arguments: mismatches then go undetected (0/1/true/false/yes/no)
MOONEP_MASTER_ADDR | loopback, or rank 0's address | runtime | address of rank 0's TCPStore under mpirun
MOONEP_NO_CUPY | 0 | library tests | 1 forces the pure-torch fallbacks of the CUDA kernels (0/1/true/false/yes/no)
MOONEP_BOARD_CHECK | 0 (1 off x86) | library tests | 1 makes the order board's readers verify every header's checksum (0/1/true/false/yes/no)
MOONEP_MPIEXEC | the venv's mpiexec | tests | launcher of the multi-rank tests
MOONEP_LAUNCH_ID | set by the harness | tests | marks the processes of one test launch
MOONEP_TEST_DEVICE | cpu | tests | device of the multi-rank test cases
MOONEP_TEST_DTYPES | float64 | tests | row dtypes of the replica pool cases (tests/mp/cases_pool.py), comma list
MOONEP_TEST_TRANSPORT | mpi,torch | tests | host transports the multi-rank EP cases run over
MOONEP_GPU_NRANKS | 2 4 | tests | world sizes of the GPU multi-rank tests
MOONEP_TEST_BUILD | unset | tests | a profiling build the tests run on: comma-separated NAME=INT switches of cuda_runtime.profile_build (tests/harness/mprun.py, tests/gpu/test_fp8_gpu.py)
MOONEP_FUZZ_N | 10000 | tests | routings of the planner fuzz test
MOONEP_FUZZ_GPU_N | 1000 | tests | routings of the GPU planner fuzz test
MOONEP_TT_FULL | 0 | tests | 1 runs the torchtitan cases for every MoE debug model and EP size, not only DeepSeek-V3 at EP 2
MOONEP_TT_MODELS | every model | tests | torchtitan models of the full run, comma list (tests/mp/cases_torchtitan.py)
MOONEP_TT_EP | 1,N | tests | EP sizes of the full torchtitan run: "N" or "1,N"
MOONEP_TT_DTYPE | per model | tests | parameter dtype of the torchtitan cases
MOONEP_TT_RECORD | unset | tests | JSON path ({N}: ranks) where the torchtitan cases record their figures
MOONEP_EXTRAS | test,bench | tools | extras that scripts/setup.sh installs
MOONEP_TORCHTITAN | 1 | tools | 0 makes scripts/setup.sh skip installing torchtitan (its tests then skip)
MOONEP_BENCH_COMMAND | the command line | tools | command recorded in benchmark results
"""
ENV = {v.name: v for v in (EnvVar(*(f.strip() for f in line.split("|", 3)))
                           for line in _TABLE.strip().splitlines())}
