"""Command-line switches of the profiling runs (benchmarks/ and tools/): which kernel build and which
:class:`moonep.Tuning` a run measures.  The library reads none of this from the environment: a run says it.

    --lineinfo                    compile with -lineinfo (source lines in ncu)
    --switch NAME=V               a compile-time switch of moonep.cuda_runtime.PROFILE_SWITCHES (repeatable)
    --patch FILE                  compile a copy of csrc/ with FILE applied (e.g. tools/diag_nvlink.patch);
                                  --switch may then name the patch's own defines (MOONEP_DIAG=3)
    --fused SPEC                  Tuning.fused: 0, 1 or a comma list of route, dispatch, combine
    --chunks N, --combine-sms N   Tuning.chunks, Tuning.combine_sms
"""
from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from pathlib import Path

from moonep import cuda_runtime
from moonep.config import parse_fused

ROOT = Path(__file__).resolve().parents[1]


def add_args(ap, tuning: bool = True) -> None:
    """The switches above, on an ``argparse.ArgumentParser``; ``tuning=False`` leaves out the Tuning ones (a
    run that builds its own ``Tuning``)."""
    ap.add_argument("--lineinfo", action="store_true", help="compile the kernels with -lineinfo")
    ap.add_argument("--switch", action="append", default=[], metavar="NAME=V",
                    help="a compile-time switch (moonep.cuda_runtime.PROFILE_SWITCHES); repeatable")
    ap.add_argument("--patch", default=None, help="compile a copy of csrc/ with this patch applied")
    if tuning:
        ap.add_argument("--fused", default=None, help="Tuning.fused: 0, 1 or a comma list of stages")
        ap.add_argument("--chunks", type=int, default=None, help="Tuning.chunks")
        ap.add_argument("--combine-sms", type=int, default=None, help="Tuning.combine_sms")


def apply(args) -> dict:
    """Set the kernel build (before any kernel loads) and return the ``Tuning`` keywords the run asked for."""
    switches = cuda_runtime.parse_switches(",".join(args.switch), "--switch")
    sources = None
    if args.patch:
        tmp = tempfile.mkdtemp(prefix="moonep_csrc_")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        sources = Path(tmp) / "csrc"
        shutil.copytree(ROOT / "csrc", sources)
        subprocess.run(["patch", "-s", "-p1", "--fuzz=0", "-d", tmp, "-i", str(Path(args.patch).resolve())],
                       check=True)
    if args.lineinfo or switches or sources:
        cuda_runtime.profile_build(lineinfo=args.lineinfo, sources=None if sources is None else str(sources),
                                   **switches)
    kw = {}
    if getattr(args, "fused", None) is not None:
        kw["fused"] = parse_fused(args.fused, "--fused")
    if getattr(args, "chunks", None) is not None:
        kw["chunks"] = args.chunks
    if getattr(args, "combine_sms", None) is not None:
        kw["combine_sms"] = args.combine_sms
    return kw


def describe(args) -> dict:
    """What the JSON of a run records about its build and tuning."""
    return dict(lineinfo=args.lineinfo, switches=list(args.switch), patch=args.patch,
                **{k: getattr(args, k) for k in ("fused", "chunks", "combine_sms") if hasattr(args, k)})
