"""``moonep-bench`` / ``python -m moonep.bench``: see :mod:`moonep.bench.cli` for the flags and
:mod:`moonep.bench.suite` for what is measured."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moonep.bench.cli import (launch_rank, launcher_prefix, missing_packages, parse, parse_on_rank, program,
                              result_path)

__all__ = ["main", "parse"]


def _fail_missing(lines, rank: int) -> int:
    """Exit status 1 on every rank; the message from rank 0 only (once, not once per rank)."""
    if rank == 0:
        print("moonep-bench: optional packages this run needs are missing; nothing was measured.\n"
              + "\n".join(lines), file=sys.stderr, flush=True)
    return 1


def _report(args, rank: int) -> int:
    """``--report JSON``: the tables (and with --plot the PNG) of an earlier run."""
    from moonep.bench import report

    missing = missing_packages(args.plot, "cpu", progress=False)
    if missing:
        return _fail_missing(missing, rank)
    try:
        doc = json.loads(Path(args.report).read_text())
    except (OSError, ValueError) as exc:  # a missing, unreadable or not-JSON file: one line, no traceback
        if rank == 0:
            print(f"moonep-bench: --report: expected a JSON file written by moonep-bench, got {args.report!r} "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return 2
    print(report.tables(doc))
    if args.plot:
        print(f"# wrote {report.plot(doc, Path(args.report))}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = launch_rank()
    args = parse_on_rank(argv, rank)
    if args.report:
        return _report(args, rank)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    missing = missing_packages(args.plot, device)
    if missing:  # before moonep.init: no rank has started anything another rank would wait for
        return _fail_missing(missing, rank)
    # Settings the shared GPU machines require; harmless elsewhere. Set before any NCCL/NVSHMEM init.
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    from tqdm import tqdm

    from moonep.bench import report
    from moonep.bench.provenance import command
    from moonep.bench.suite import Suite

    prefix, ranks = launcher_prefix()
    out = result_path(args.out, device, ranks)
    cmd = command([*program(), *argv], launcher=prefix)

    def emit(doc):
        doc["command"] = cmd
        report.write_json(doc, out)

    def checkpoint(doc):
        emit(doc)
        if args.plot:
            report.plot(doc, out)
        tqdm.write(f"# main sweep done and saved; the symm_mem baseline follows (tables at the end; if it "
                   f"dies: {' '.join(program())} --report {out})", file=sys.stderr)

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
