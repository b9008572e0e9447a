"""One LatentMoE layer step (forward + backward), eager against torch.compile, on one rank.

    mpirun -n 1 python3 benchmarks/bench_compile.py --out benchmarks/results/h200x1_compile_r1.json   # NVLink
    python3 benchmarks/bench_compile.py --device cpu --tokens 256 --iters 5                            # local

Times are the median of ``--iters`` steps after warm-up, measured with CUDA events on CUDA (wall clock on
CPU).  Modes: ``default`` (inductor), ``reduce-overhead`` (inductor + CUDA graphs, CUDA only) and
``cudagraphs`` (AOTAutograd + CUDA graphs, no code generation); new routing every step (fresh inputs).  A mode
with the suffix ``+bitwise`` compiles inside ``moonep.eager_math.bitwise()``: the layer's own math kept at
eager's bits instead of fused and rounded by inductor (the default), to measure what that costs.
The JSON holds the command, the commit, the machine, the configuration and one time per mode.
``--profile DIR``: also a torch.profiler table per mode (DIR/<mode>.txt: the kernels and ops of 3 steps by
device time, then host time), to see where a mode's time goes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch._dynamo

import moonep
from moonep import eager_math
from moonep.bench.provenance import command, git_commit, machine
from moonep.layers import LatentMoE
from moonep.runtime import detect_launcher

_DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time_steps(m, xs, cuda: bool) -> list:
    """Milliseconds of each step ``m(x).square().sum().backward()`` over the inputs ``xs``."""
    out = []
    for x in xs:
        m.zero_grad(set_to_none=True)
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        m(x).float().square().sum().backward()
        if cuda:
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _profile(m, xs, cuda: bool, path: str) -> None:
    """A torch.profiler table of ``m``'s steps over ``xs`` into ``path``."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        _time_steps(m, xs, cuda)
    ka = prof.key_averages()
    with open(path, "w") as f:
        for key in ("device_time_total", "cpu_time_total"):
            f.write(f"sorted by {key}\n{ka.table(sort_by=key, row_limit=30)}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(_DT), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per step (s)")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-latent", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--d-expert", type=int, default=768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default="default,default+bitwise,reduce-overhead,reduce-overhead+bitwise,cudagraphs")
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--profile", default=None, help="directory for one torch.profiler table per mode")
    ap.add_argument("--library", default="the tree", help="which moonep this run imported (recorded in the JSON)")
    args = ap.parse_args(argv)

    if args.dtype is None:  # CPU: float32, whose matmuls the CPU runs fast (bf16 ones are emulated there)
        args.dtype = "fp32" if args.device == "cpu" else "bf16"
    dev, dt = torch.device(args.device), _DT[args.dtype]
    launched = detect_launcher() != "single"
    rt = moonep.init(device=args.device) if launched else None
    if rt is not None:
        dev = rt.device
    cuda = dev.type == "cuda"
    modes = [m for m in args.modes.split(",") if m and (cuda or m.split("+")[0] == "default")]
    kw = dict(group=rt, max_tokens=args.tokens, dtype=dt, device=dev)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(args.tokens, args.d_model, generator=g).to(dev, dt) for _ in range(args.warmup + args.iters)]

    def layer():
        torch.manual_seed(0)
        return LatentMoE(args.d_model, args.d_latent, args.experts, args.topk, args.d_expert, **kw)

    results = {}
    m = layer()
    results["eager"] = statistics.median(_time_steps(m, xs, cuda)[args.warmup:])
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        _profile(m, xs[:3], cuda, os.path.join(args.profile, "eager.txt"))
    transport = m._ep.get(args.tokens, args.topk, args.d_latent, dt, dev).transport_name
    for mode in modes:
        base, exact = mode.split("+")[0], mode.endswith("+bitwise")
        torch._dynamo.reset()
        m = layer()
        _time_steps(m, xs[:1], cuda)  # builds the layer's ExpertParallel eagerly (fullgraph needs it)
        if base == "cudagraphs":
            c = torch.compile(m, backend="cudagraphs", fullgraph=True)
        else:
            c = torch.compile(m, mode=None if base == "default" else base, fullgraph=cuda)
        with eager_math.bitwise() if exact else contextlib.nullcontext():
            t0 = time.perf_counter()
            _time_steps(c, xs[:1], cuda)
            compile_s = time.perf_counter() - t0
            results[mode] = statistics.median(_time_steps(c, xs, cuda)[args.warmup:])
            if args.profile:
                _profile(c, xs[:3], cuda, os.path.join(args.profile, f"{mode}.txt"))
        results[mode + "_first_step_s"] = round(compile_s, 2)
    rank = 0 if rt is None else rt.rank
    speedup = {k: results["eager"] / v for k, v in results.items() if not k.endswith("_first_step_s")}
    if rank == 0:
        print(f"LatentMoE step (forward + backward), {transport} backend, s={args.tokens}, {dt} on {dev}")
        print(f"{'mode':<18}{'ms / step':>12}{'eager / mode':>14}")
        for k, r in speedup.items():
            print(f"{k:<18}{results[k]:>12.3f}{r:>14.2f}")
        print("legend: median of --iters steps (CUDA events on CUDA); eager = no torch.compile; "
              "eager / mode > 1: the mode is faster")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"command": command(launcher="mpirun -n 1" if launched else ""), "commit": git_commit(),
                           "machine": machine(), "library": args.library,
                           "config": vars(args) | {"transport": transport},
                           "ms_per_step": results,
                           "speedup_vs_eager": {k: r for k, r in speedup.items() if k != "eager"}}, f, indent=1)
    if rt is not None:
        rt.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
