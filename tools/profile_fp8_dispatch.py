"""A fixed number of dispatch calls on one GPU, one rank, NVLink backend, for ncu to profile one of them.

    ncu --set full -k regex:moonep_dispatch_fused --launch-skip 5 -c 1 -o rep \
        python3 tools/profile_fp8_dispatch.py --wire fp8

The configuration of benchmarks/bench_fp8_dispatch.py (4096 tokens, hidden 7168, top-8 of 256, bf16 tokens),
with one wire format per process (``--wire``: bf16, fp8, or fp8_pre for the pre-quantised pair), so that a
report holds one kernel of known kind: the fp8 dispatch's source-level stalls against the bf16 one's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _profile_build  # noqa: E402
from bench_fp8_dispatch import add_problem_args, expert_parallel, problem  # noqa: E402

import moonep  # noqa: E402
from moonep.quant import quantize_fp8  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wire", choices=("bf16", "fp8", "fp8_pre"), default="fp8")
    add_problem_args(ap)
    ap.add_argument("--calls", type=int, default=8)
    _profile_build.add_args(ap, tuning=False)  # --lineinfo for source lines in ncu, --switch...
    a = ap.parse_args(argv)
    _profile_build.apply(a)
    rt = moonep.init(device="cuda")
    x, idx, w = problem(a)
    xin = quantize_fp8(x) if a.wire == "fp8_pre" else x
    with expert_parallel(rt, torch.bfloat16, a.wire != "bf16", x, idx, a.experts) as ep, torch.no_grad():
        for _ in range(a.calls):
            ep.dispatch(xin, idx, w)
        ep.synchronize()
    rt.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
