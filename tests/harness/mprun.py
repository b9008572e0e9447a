"""Runs every ``case_*`` function of one cases file on every rank; started by ``mpiexec -n N``.

    mpiexec -n 4 python -m tests.harness.mprun tests/mp/cases_bootstrap.py --out DIR

Each rank appends one JSON line per case to ``DIR/rank<r>.jsonl``. The first failure on any rank prints
that rank's traceback and aborts the whole MPI job, so no peer is left waiting in a collective. A case
that outlives ``--case-timeout`` dumps every thread's stack and exits, which also ends the job.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import json
import os
import sys
import time
import traceback


if __name__ == "__main__":  # run as a script: share the one SkipCase class that cases files import
    from tests.harness.mprun import SkipCase  # noqa: F401
else:
    class SkipCase(Exception):
        """Raise inside a case to report it as skipped (for example: needs CUDA)."""


def quiet_barrier(comm, timeout: float | None = None) -> bool:
    """``comm.Barrier()`` that sleeps between polls; False if ``timeout`` seconds passed first.

    A blocking MPI barrier spins: with more ranks than cores, ranks that arrived early starve the one
    still working (a rank in ``gc.collect()`` was seen getting 3% of a core, for seconds)."""
    req = comm.Ibarrier()
    t0 = time.monotonic()
    while not req.Test():
        if timeout is not None and time.monotonic() - t0 > timeout:
            return False
        time.sleep(1e-4 if time.monotonic() - t0 < 0.01 else 2e-3)
    return True


def load_cases(path: str):
    spec = importlib.util.spec_from_file_location(f"mpcases_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec.loader.exec_module(mod)
    return [(n, getattr(mod, n)) for n in vars(mod) if n.startswith("case_") and callable(getattr(mod, n))]


def apply_test_build(spec: str | None = None) -> dict:
    """Ask for the kernel build ``spec`` names (default ``MOONEP_TEST_BUILD``: comma-separated ``NAME=INT``
    switches of ``moonep.cuda_runtime.profile_build``, e.g. ``MOONEP_DISPATCH_THREADS=768``), before any kernel
    loads; the tests then run on that build.  Returns the switches (empty: the shipped build)."""
    from moonep import cuda_runtime

    spec = os.environ.get("MOONEP_TEST_BUILD", "") if spec is None else spec
    switches = cuda_runtime.parse_switches(spec, "MOONEP_TEST_BUILD")
    if switches:
        cuda_runtime.profile_build(**switches)
    return switches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases")
    ap.add_argument("--out", required=True)
    ap.add_argument("--case-timeout", type=float, default=120.0)
    ap.add_argument("--device", default=os.environ.get("MOONEP_TEST_DEVICE", "cpu"))
    ap.add_argument("--tag", default="")  # lets tests find stray processes of this launch
    # Diagnosis runs (one GPU session, many cases): after a failure, go on if every rank reaches the next
    # barrier within this many seconds (a failure on every rank at once); else abort as usual.
    ap.add_argument("--keep-going", type=float, default=0.0)
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the cases naming one")
    args = ap.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    log = open(os.path.join(args.out, f"rank{rank}.jsonl"), "a", buffering=1)

    def fail(name, exc_text, may_go_on=False):
        msg = f"[rank {rank}/{comm.Get_size()}] {name} FAILED\n{exc_text}"
        log.write(json.dumps({"case": name, "status": "failed", "rank": rank, "msg": msg}) + "\n")
        log.flush()
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
        if may_go_on and args.keep_going > 0 and quiet_barrier(comm, args.keep_going):
            return
        comm.Abort(1)

    try:
        import moonep

        apply_test_build()  # MOONEP_TEST_BUILD: every rank compiles that profiling build
        rt = moonep.init(device=args.device)
        # several files (comma-separated) share one launch: their cases run in file order
        cases = [c for path in args.cases.split(",") for c in load_cases(path)]
        if args.only:
            cases = [(n, fn) for n, fn in cases if any(k in n for k in args.only.split(","))]
        names = [n for n, _ in cases]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"cases: expected unique case names across {args.cases}, got {dup} more than once")
    except BaseException:
        fail("<setup>", traceback.format_exc())
        return 1
    failed = False
    for name, fn in cases:
        faulthandler.dump_traceback_later(args.case_timeout, exit=True)
        t0 = time.perf_counter()
        try:
            fn(rt)
            status, msg = "passed", ""
        except SkipCase as exc:
            status, msg = "skipped", str(exc)
        except BaseException:
            faulthandler.cancel_dump_traceback_later()
            fail(name, traceback.format_exc(), may_go_on=True)
            failed = True
            continue
        finally:
            faulthandler.cancel_dump_traceback_later()
        log.write(json.dumps({"case": name, "status": status, "rank": rank, "msg": msg,
                              "seconds": round(time.perf_counter() - t0, 4)}) + "\n")
        # Keeps cases in lockstep so a failure is attributed to the case that caused it.
        quiet_barrier(comm)
    rt.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
