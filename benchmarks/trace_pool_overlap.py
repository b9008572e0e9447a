"""Does the replica prefetch overlap the home rows' GEMM?  A torch profiler trace of one LatentMoE layer step
(NVLink backend, bf16, a skewed routing that places replicas), summarised as JSON: every moonep prefetch
kernel and every GEMM kernel of every rank with its stream and time span, and how long they ran together.
Also the layer-step time with the side stream and without it (``overlap=False``), same run.

    mpirun -n 2 python3 benchmarks/trace_pool_overlap.py --out benchmarks/results/x.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import moonep
from moonep.experts import ReplicaPool
from moonep.layers import LatentMoE


class SkewedMoE(LatentMoE):
    """Half of every token's choices on rank 0's first expert: the plan places replicas on every rank."""

    def route(self, x):
        s, K, E = x.shape[0], self.topk, self.num_experts
        g = torch.Generator(device=x.device).manual_seed(7)
        rest = torch.rand(s, E - 1, generator=g, device=x.device).topk(K - 1, dim=1).indices + 1
        idx = torch.cat([torch.zeros(s, 1, dtype=torch.int64, device=x.device), rest], dim=1)
        return idx, torch.full((s, K), 1.0 / K, dtype=x.dtype, device=x.device)


def _layer(rt, overlap: bool, args):
    torch.manual_seed(0)
    return SkewedMoE(args.d, args.d, args.experts_per_rank * rt.world_size, args.topk, args.ffn, num_shared=0,
                     group=rt, balancer=None, dtype=torch.bfloat16, max_tokens=args.tokens,
                     replica_pool=ReplicaPool(overlap=overlap))


def _step(layer, x):
    layer.zero_grad(set_to_none=True)
    layer(x).float().square().mean().backward()


def _time(layer, x, iters: int) -> float:
    for _ in range(3):
        _step(layer, x)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        _step(layer, x)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters * 1e3  # us


def _kernels(prof):
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append(dict(name=e.name, stream=getattr(e, "device_resource_id", None) or e.thread,
                            start_us=e.time_range.start, end_us=e.time_range.end))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from moonep.bench.provenance import command, git_commit, machine
    rt = moonep.init(device="cuda")
    g = torch.Generator().manual_seed(rt.rank)
    x = torch.randn(args.tokens, args.d, generator=g).to(rt.device, torch.bfloat16).requires_grad_()
    times = {}
    for overlap in (True, False):
        times["side_stream" if overlap else "one_stream"] = _time(_layer(rt, overlap, args), x, args.iters)
    layer = _layer(rt, True, args)
    for _ in range(3):
        _step(layer, x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(x)  # the forward: dispatch, prefetch (side stream), home GEMM, replica GEMM, combine
        torch.cuda.synchronize()
    ks = _kernels(prof)
    pre = [k for k in ks if "moonep_prefetch" in k["name"]]
    gemm = [k for k in ks if any(w in k["name"].lower() for w in ("gemm", "cutlass", "sm90", "grouped"))
            and "moonep" not in k["name"]]
    pairs = []
    for p in pre:
        for q in gemm:
            lo, hi = max(p["start_us"], q["start_us"]), min(p["end_us"], q["end_us"])
            if hi > lo:
                pairs.append(dict(prefetch=p["name"], gemm=q["name"][:120], overlap_us=hi - lo,
                                  prefetch_stream=p["stream"], gemm_stream=q["stream"]))
    res = dict(command=command(launcher=f"mpirun -n {rt.world_size}"), commit=git_commit(), machine=machine(),
               ranks=rt.world_size, rank=rt.rank, config=vars(args),
               replicas_on_this_rank=int(layer.last_stats["replicas"][rt.rank]),
               layer_step_us=times, layer_step_ratio_one_stream_over_side=times["one_stream"] / times["side_stream"],
               prefetch_kernels=pre, gemm_kernels=[dict(k, name=k["name"][:120]) for k in gemm],
               overlaps=pairs, total_overlap_us=sum(p["overlap_us"] for p in pairs))
    import torch.distributed as dist
    per_rank = [None] * rt.world_size
    dist.all_gather_object(per_rank, {k: v for k, v in res.items() if k not in ("command", "commit", "machine")},
                           group=rt.cpu_group)
    if rt.rank == 0:
        for r in per_rank:
            print(json.dumps({k: v for k, v in r.items() if k not in ("prefetch_kernels", "gemm_kernels", "overlaps")}))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(dict(command=res["command"], commit=res["commit"], machine=res["machine"],
                               ranks=per_rank), f, indent=1)
    rt.shutdown()  # process groups torn down at interpreter exit can abort in C++


if __name__ == "__main__":
    main()
