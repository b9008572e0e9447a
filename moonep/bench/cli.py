"""The command line of ``moonep-bench`` (``python -m moonep.bench``): flags, presets, where results go,
which optional packages a run needs, and which rank this process is before any process group exists."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
import time
from pathlib import Path

DESCRIPTION = """\
Measure moonep's expert-parallel dispatch and combine against a Megatron-style all-to-all, PyTorch's
NVSHMEM all-to-all (GPU) and the hardware ceiling, over a sweep of routing imbalance.

examples:
  mpiexec -n 4 moonep-bench                          CPU ranks, small defaults (under a minute)
  mpiexec -n 4 moonep-bench --tokens 512 --hidden 2048 --ek 256x8 --maxvio 0 1 4
  mpirun -n 2 moonep-bench --device cuda --preset h200 --plot --out results/
  moonep-bench --report results/moonep_bench_cuda_np2_20260101-120000.json

Every flag that takes a list sweeps it: --tokens, --hidden, --ek, --maxvio, --slack, --placement.
Per point, on one routing: moonep's dispatch (planning included), combine, replica prefetch of three
[hidden, ffn] projections, and dispatch + prefetch; the Megatron-style path (permute, all-to-all with
host-known splits, regroup); torch.ops.symm_mem.all_to_all_vdev_2d (GPU only); the ceiling (a kernel
storing moonep's wire bytes into the peers' memory on GPU, the raw transport on CPU); and one MoE layer
step on both paths.

Rank 0 shows progress, prints the tables (a legend under each) and writes a JSON file after every
point, so an interrupted run keeps what it measured. The JSON records the command, the git commit and
the machine, and defines every figure in its "definitions" field. --plot needs matplotlib; the
progress bar needs tqdm (both: pip install 'moonep[bench]'); a CUDA run needs CuPy (the cuda12 or
cuda13 extra).
"""

PRESETS = {
    # The headline: 2xH200, 4096 tokens/rank, hidden 7168, bf16, top-8 of 256, maxvio sweep.
    "h200": dict(device="cuda", tokens=[4096], hidden=[7168], ek=[(256, 8)], maxvio=[0, 0.25, 0.5, 1, 2, 4],
                 slack=[0.0, 0.02, 0.05], placement=["random", "clustered"], ffn=2048, iters=20, warmup=5),
    # Every shape, imbalance, slack and placement together (long: hours on CPU; minutes on GPU).
    "full": dict(tokens=[128, 512, 1024, 4096, 8192], hidden=[2048, 4096, 7168],
                 ek=[(256, 8), (384, 8), (896, 16)], maxvio=[0, 0.25, 0.5, 1, 2, 4], slack=[0.0, 0.02, 0.05],
                 placement=["random", "clustered"]),
    # Seconds on CPU ranks (what tests/mp/test_bench.py runs).
    "tiny": dict(tokens=[32], hidden=[64], ek=[(16, 4)], maxvio=[0, 2], slack=[0.0, 0.05], ffn=32, iters=2,
                 warmup=1),
}
PRESET_HELP = ("a named sweep; flags given explicitly override it. tiny: seconds on CPU ranks; h200: two "
               "GPUs at DeepSeek-V3's shape (4096 tokens, hidden 7168, top-8 of 256, 6 imbalances, 3 slacks, "
               "2 placements); full: every shape together (hours on CPU)")
BENCH_EXTRA = "pip install 'moonep[bench]'"
RESULT_PREFIX = "moonep_bench"


def program(argv0: str | None = None) -> list[str]:
    """How this process was started: ``["moonep-bench"]`` for the console script, else
    ``[<python>, "-m", "moonep.bench"]`` (``sys.argv[0]`` is ``.../moonep/bench/__main__.py`` then)."""
    name = Path(sys.argv[0] if argv0 is None else argv0).name
    if name.startswith("moonep-bench"):  # the console script (moonep-bench.exe on Windows)
        return ["moonep-bench"]
    return [Path(sys.executable).name, "-m", "moonep.bench"]


def _ek(text: str):
    try:
        e, k = text.lower().split("x")
        return int(e), int(k)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ExK such as 256x8, got {text!r}") from None


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``moonep-bench``."""
    ap = argparse.ArgumentParser(prog=prog or " ".join(program()), description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help=PRESET_HELP)
    sweep = ap.add_argument_group("the sweep (every list is swept)")
    sweep.add_argument("--tokens", type=int, nargs="+", default=[128], metavar="N", help="tokens per rank")
    sweep.add_argument("--hidden", type=int, nargs="+", default=[1024], metavar="H", help="hidden width")
    sweep.add_argument("--ek", type=_ek, nargs="+", default=[(256, 8)], metavar="ExK",
                       help="experts x top-k, e.g. 256x8 384x8 896x16")
    sweep.add_argument("--maxvio", type=float, nargs="+", default=[0, 1, 4], metavar="V",
                       help="target routing imbalance: max over experts of load / mean load, minus 1")
    sweep.add_argument("--slack", type=float, nargs="+", default=[0.0, 0.05], metavar="S",
                       help="moonep's allowed receive imbalance (0: equal on every rank); the first one is "
                            "used for the layer step and the ceiling")
    sweep.add_argument("--placement", nargs="+", choices=["random", "clustered"], default=["random"],
                       help="where the popular experts live: on random ranks, or all on rank 0")
    run = ap.add_argument_group("what runs and how")
    run.add_argument("--ffn", type=int, default=128, help="expert FFN width of the three projections used "
                     "for prefetch and the layer step (DeepSeek-V3: 2048); 0 skips both")
    run.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                     help="element type of the tokens and the expert weights")
    run.add_argument("--dispatch-dtype", choices=["same", "fp8"], default="same",
                     help="what dispatch moves: the token dtype, or fp8 e4m3 rows with per-128-channel scales "
                          "(hidden must be a multiple of 128; the layer step is skipped)")
    run.add_argument("--iters", type=int, default=5, help="timed calls per figure (the median is shown)")
    run.add_argument("--warmup", type=int, default=1, help="untimed calls before them")
    run.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                     help="auto: CUDA when available")
    run.add_argument("--transport", default="auto", help="moonep transport: auto, mpi, torch, nvlink")
    run.add_argument("--num-sms", type=int, default=24, help="SM budget of moonep's NVLink kernels")
    run.add_argument("--ceiling-blocks", type=int, default=32,
                     help="thread blocks per peer of the GPU ceiling's copy kernel")
    run.add_argument("--no-symm", dest="symm", action="store_false", help="skip the symm_mem baseline")
    run.add_argument("--no-layer", dest="layer", action="store_false", help="skip the layer step")
    out = ap.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", default=None,
                     help=f"directory for the results (created if missing; default: the current directory): "
                          f"{RESULT_PREFIX}_<device>_np<ranks>_<date-time>.json and, with --plot, a .png "
                          f"beside it. A path ending in .json names the file itself")
    out.add_argument("--plot", action="store_true", help="also draw the charts into a PNG (needs matplotlib)")
    out.add_argument("--report", metavar="JSON", default=None,
                     help="print the tables of an earlier run's JSON (with --plot: redraw its PNG) and exit")
    return ap


def parse(argv, prog: str | None = None):
    """Parse ``argv``; a ``--preset`` sets the defaults the other flags override."""
    ap = parser(prog)
    first, _ = ap.parse_known_args(argv)
    if first.preset:
        ap.set_defaults(**PRESETS[first.preset])
    return ap.parse_args(argv)


def launch_rank(env=os.environ) -> int:
    """This process's rank as its launcher set it (0 when launched alone): known before any process group,
    so that only rank 0 prints ``--help``, usage errors and missing-package errors."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK"):
        val = env.get(key, "")
        if val.isdigit():
            return int(val)
    return 0


def parse_on_rank(argv, rank: int):
    """:func:`parse`, with argparse's output (help, usage errors) shown by rank 0 only; every rank still
    exits where argparse exits, with its status."""
    if rank == 0:
        return parse(argv)
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        return parse(argv)


def launcher_prefix(env=os.environ) -> tuple[str, int]:
    """The launcher part of the command line (``mpiexec -n 2``, ``""`` alone) and the number of ranks."""
    if "OMPI_COMM_WORLD_SIZE" in env:
        root = " --allow-run-as-root" if hasattr(os, "geteuid") and os.geteuid() == 0 else ""
        return f"mpirun{root} -n {env['OMPI_COMM_WORLD_SIZE']}", int(env["OMPI_COMM_WORLD_SIZE"])
    if "PMI_SIZE" in env:
        return f"mpiexec -n {env['PMI_SIZE']}", int(env["PMI_SIZE"])
    if "WORLD_SIZE" in env and "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun --nproc-per-node {env['WORLD_SIZE']}", int(env["WORLD_SIZE"])
    return "", 1


def result_path(out: str | None, device: str, ranks: int, now: float | None = None) -> Path:
    """Where the JSON goes: ``out`` itself when it ends in ``.json``, else a new time-stamped file in the
    directory ``out`` (default: the current directory, never a path inside it that the user did not ask
    for). The time stamp keeps a second run from overwriting the first."""
    if out and out.endswith(".json"):
        return Path(out)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path(out or ".") / f"{RESULT_PREFIX}_{device}_np{ranks}_{stamp}.json"


def missing_packages(plot: bool, device: str, progress: bool = True) -> list[str]:
    """One line per optional package this run needs and cannot import: the package, what needs it, how
    to install it. Checked before anything is measured, so a sweep never dies at its end for want of one.
    ``progress=False``: no progress bar (``--report``), so no tqdm."""
    need = [("tqdm", "the progress bar", BENCH_EXTRA)] if progress else []
    if plot:
        need.append(("matplotlib", "--plot", BENCH_EXTRA))
    if device == "cuda":
        from moonep.cuda_runtime import cupy_install_hint

        need.append(("cupy", "moonep's CUDA kernels", cupy_install_hint()))
    lines = []
    for module, what, how in need:
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install that fails while importing
            lines.append(f"  {module} (for {what}) cannot be imported: {type(exc).__name__}: {exc}\n"
                         f"    install it: {how}")
    return lines
