"""``python -m moonep.bench``: moonep against the Megatron all-to-all, PyTorch symmetric memory and the
hardware ceiling, swept over routing imbalance.

    mpiexec -n 4 python -m moonep.bench                      # CPU ranks, small defaults (< 1 min)
    mpiexec -n 4 python -m moonep.bench --tokens 512 --hidden 2048 --ek 256x8 --maxvio 0 1 4
    mpirun --allow-run-as-root -n 2 python3 -m moonep.bench --device cuda --preset h200 --plot

Every flag that takes a list sweeps it: --tokens, --hidden, --ek (E x K), --maxvio, --slack,
--placement. Per point it measures, on one routing and in one run: moonep dispatch (planning
included), combine, prefetch of three [H, ffn] projections, and dispatch + prefetch; the Megatron-style
path (permute, all_to_all_single with host-known splits, regroup); torch.ops.symm_mem.all_to_all_vdev_2d
and _2d_offset (GPU, NVSHMEM; "unavailable: <reason>" otherwise); the ceiling (a peer-store kernel
moving moonep's wire bytes on GPU, the raw transport on CPU); and a MoE layer step on both paths.
Rank 0 prints a progress bar, two tables, and writes JSON (command, git commit, machine) after every
point, so an interrupted run keeps what it measured. See moonep/bench/suite.py for the definitions.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PRESETS = {
    # The headline: 2xH200, 4096 tokens/rank, hidden 7168, bf16, top-8 of 256, maxvio sweep.
    "h200": dict(device="cuda", tokens=[4096], hidden=[7168], ek=[(256, 8)], maxvio=[0, 0.25, 0.5, 1, 2, 4],
                 slack=[0.0, 0.02, 0.05], placement=["random", "clustered"], ffn=2048, iters=20, warmup=5),
    # Every shape, imbalance, slack and placement together (long: hours on CPU; minutes on GPU).
    "full": dict(tokens=[128, 512, 1024, 4096, 8192], hidden=[2048, 4096, 7168],
                 ek=[(256, 8), (384, 8), (896, 16)], maxvio=[0, 0.25, 0.5, 1, 2, 4], slack=[0.0, 0.02, 0.05],
                 placement=["random", "clustered"]),
    # What tests/mp/test_bench.py runs.
    "tiny": dict(tokens=[32], hidden=[64], ek=[(16, 4)], maxvio=[0, 2], slack=[0.0, 0.05], ffn=32, iters=2,
                 warmup=1),
}


def _ek(text: str):
    try:
        e, k = text.lower().split("x")
        return int(e), int(k)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ExK such as 256x8, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moonep.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a named sweep; explicit flags override it")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128], help="tokens per rank (sweep)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024], help="hidden width (sweep)")
    ap.add_argument("--ek", type=_ek, nargs="+", default=[(256, 8)], metavar="ExK",
                    help="experts x top-k (sweep), e.g. 256x8 384x8 896x16")
    ap.add_argument("--maxvio", type=float, nargs="+", default=[0, 1, 4], help="target maxvio (sweep)")
    ap.add_argument("--slack", type=float, nargs="+", default=[0.0, 0.05], help="moonep slack (sweep; the "
                    "first one is used for the layer step and the ceiling)")
    ap.add_argument("--placement", nargs="+", choices=["random", "clustered"], default=["random"],
                    help="where the popular experts live: random ranks, or all on rank 0")
    ap.add_argument("--ffn", type=int, default=128, help="expert FFN width of the three projections used "
                    "for prefetch and the layer step (DeepSeek-V3: 2048); 0 skips both")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CUDA when available")
    ap.add_argument("--transport", default="auto", help="moonep transport: auto, mpi, torch, nvlink")
    ap.add_argument("--num-sms", type=int, default=24, help="moonep NVLink kernels' SM budget")
    ap.add_argument("--ceiling-blocks", type=int, default=32, help="CTAs per peer of the peer-store kernel")
    ap.add_argument("--no-symm", dest="symm", action="store_false", help="skip the symm_mem baseline")
    ap.add_argument("--no-layer", dest="layer", action="store_false", help="skip the layer step")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/suite_<device>_np<R>.json)")
    ap.add_argument("--plot", action="store_true", help="also write <out>.png (matplotlib)")
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="print the tables of an earlier run's JSON (with --plot: redraw its PNG) and exit")
    return ap


def parse(argv):
    ap = parser()
    first, _ = ap.parse_known_args(argv)
    if first.preset:
        ap.set_defaults(**PRESETS[first.preset])
    return ap.parse_args(argv)


def _launcher_prefix() -> tuple[str, int]:
    env = os.environ
    if "OMPI_COMM_WORLD_SIZE" in env:
        root = " --allow-run-as-root" if hasattr(os, "geteuid") and os.geteuid() == 0 else ""
        return f"mpirun{root} -n {env['OMPI_COMM_WORLD_SIZE']}", int(env["OMPI_COMM_WORLD_SIZE"])
    if "PMI_SIZE" in env:
        return f"mpiexec -n {env['PMI_SIZE']}", int(env["PMI_SIZE"])
    if "WORLD_SIZE" in env and "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun --nproc-per-node {env['WORLD_SIZE']}", int(env["WORLD_SIZE"])
    return "", 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.report:
        import json

        from moonep.bench import report

        doc = json.loads(Path(args.report).read_text())
        print(report.tables(doc))
        if args.plot:
            print(f"# wrote {report.plot(doc, Path(args.report))}")
        return 0
    # Settings the shared GPU machines require; harmless elsewhere. Set before any NCCL/NVSHMEM init.
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    from moonep.bench import report
    from moonep.bench.provenance import command
    from moonep.bench.suite import Suite

    prefix, R = _launcher_prefix()
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out or f"benchmarks/results/suite_{device}_np{R}.json")
    cmd = command([Path(sys.executable).name, "-m", "moonep.bench", *argv], launcher=prefix)

    def emit(doc):
        doc["command"] = cmd
        report.write_json(doc, out)

    def checkpoint(doc):
        emit(doc)
        if args.plot:
            report.plot(doc, out)
        print("# main sweep done; the symm_mem baseline follows (tables at the end; if it dies, run "
              f"python -m moonep.bench --report {out})", file=sys.stderr, flush=True)

    suite = Suite(args, emit, checkpoint)
    doc = suite.run()
    if suite.rank == 0:  # everything is saved before the collective teardown
        emit(doc)
        print(report.tables(doc))
        print(f"# wrote {out}")
        if args.plot:
            print(f"# wrote {report.plot(doc, out)}")
        sys.stdout.flush()
    suite.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
