"""What benchmarks/soak_cpu.py and benchmarks/soak_gpu.py share: their common options, the moving skew,
the sampling schedule, memory and collective helpers, and rank 0's JSON (provenance and file)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def parser(doc: str, *, steps: int, warmup: int, sample_every: int, phase: int,
           out_name: str) -> argparse.ArgumentParser:
    """The options of every soak (``--steps --warmup --sample-every --phase --out``); add the others."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--sample-every", type=int, default=sample_every)
    ap.add_argument("--phase", type=int, default=phase)
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{out_name})")
    return ap


def wave(step: int, phase: int, peak: float) -> float:
    """Skew strength at ``step``: rises from 0 to ``peak`` and falls back within every ``phase`` steps."""
    return peak * abs(math.sin(math.pi * step / phase))


def due(step: int, steps: int, every: int) -> bool:
    """Every ``every`` steps, and at the last one."""
    return step % every == 0 or step == steps - 1


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def all_gather(rt, obj) -> list:
    """``obj`` of every rank of ``rt``, in rank order (collective)."""
    if rt.world_size == 1:
        return [obj]
    out = [None] * rt.world_size
    dist.all_gather_object(out, obj, group=rt.cpu_group)
    return out


def provenance(rt, args, benchmark: str, launcher: str, python: str, machine: dict) -> dict:
    """The head of a soak's JSON: which soak, its command line (``launcher -n R python argv``), the commit
    (HEAD, or ``.git_commit`` on the device machine), the machine, the options."""
    from moonep.bench.provenance import git_commit

    return dict(benchmark=benchmark, command=f"{launcher} -n {rt.world_size} {python} " + " ".join(sys.argv),
                git_commit=git_commit(), machine=machine, world_size=rt.world_size, config=vars(args))


def write_json(out, name: str, doc: dict) -> Path:
    """Write ``doc`` to ``out`` (default ``benchmarks/results/<name>``); returns the path."""
    path = Path(out or ROOT / "benchmarks/results" / name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
