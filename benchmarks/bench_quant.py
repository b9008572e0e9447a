"""CUDA-event timing of the FP8 quantiser (moonep/quant.py, csrc/quant.cu) on one GPU.

    python benchmarks/bench_quant.py [--tokens 4096] [--hidden 7168] [--out benchmarks/results]

For bf16 input (and fp16/fp32 with ``--dtypes``), amax and power-of-two scales, reports:

* ``kernel_us``: device time of one call (``bench_planner.graph_time``: 20 calls in one CUDA graph, median
  of the replays, after a warm-up that compiles the kernel) and its effective bandwidth ``kernel_GBps``
  (bytes read + written: ``s*H*elem + s*H + s*H/128*4``);
* ``eager_us``: back-to-back eager calls under one CUDA-event pair (``--iters``; host launch cost shows
  when it exceeds the kernel's), ``host_us``: the Python time of one call;
* ``torch_us``: the pure-torch path's device time (what a CUDA install without CuPy runs).

Prints one JSON object; ``--out DIR`` also writes it to ``DIR/gpu_quant_<tokens>x<hidden>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_planner import graph_time, host_time  # noqa: E402
from moonep import cuda_runtime  # noqa: E402
from moonep.bench.provenance import command, git_commit, machine  # noqa: E402
from moonep.quant import quantize_fp8  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_quant: needs CUDA")
    s, H = args.tokens, args.hidden
    have_kernel = cuda_runtime.available()
    rows = []
    for name in args.dtypes:
        x = torch.randn(s, H, device="cuda").to(DTYPES[name])
        nbytes = s * H * x.element_size() + s * H + s * (H // 128) * 4
        for pow2 in (False, True):
            row = {"dtype": name, "pow2_scales": pow2}
            fn = lambda: quantize_fp8(x, pow2_scales=pow2)  # noqa: E731
            if have_kernel:
                us = graph_time(fn)
                row.update(kernel_us=round(us, 2), kernel_GBps=round(nbytes / us / 1e3, 1),
                           eager_us=round(time_us(fn, args.iters), 2), host_us=round(host_time(fn), 2))
            orig = cuda_runtime.available
            cuda_runtime.available = lambda: False  # the torch path, as without CuPy
            try:
                row["torch_us"] = round(graph_time(fn, n=5, reps=5), 2)
            finally:
                cuda_runtime.available = orig
            rows.append(row)
    out = {"bench": "quant", "tokens": s, "hidden": H, "iters": args.iters, "kernel": have_kernel,
           "device": torch.cuda.get_device_name(), "results": rows, "commit": git_commit(), "machine": machine(),
           "command": command(sys.argv if argv is None else ["benchmarks/bench_quant.py", *argv])}
    print(json.dumps(out, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"gpu_quant_{s}x{H}.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
