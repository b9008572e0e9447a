"""Peak memory of a forward + backward through a stack of L LatentMoE layers: the shared ReplicaPool against
the per-layer ``ep.prefetch`` path it replaced, at several L.

    mpiexec -n 2 python benchmarks/bench_pool_memory.py --layers 2 4 8 --out benchmarks/results/x.json
    mpirun -n 4 python3 benchmarks/bench_pool_memory.py --device cuda --dtype bf16 ...   # one GPU, IPC

CPU memory is the CPU allocator's running total ("Total Allocated" of the profiler's memory events), GPU
memory ``torch.cuda.max_memory_allocated``; both relative to what was allocated before the step.  Paths:
``pool`` (the default: home weights in place, one shared pool), ``keep`` (the pool, each layer keeping its
replicas for its backward), ``buffers2`` (two pool buffers) and ``prefetch`` (the old layer forward:
``ep.prefetch`` builds a ``[2*epn]`` copy of every projection, held until the backward).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from torch import nn

import moonep
from moonep.experts import ReplicaPool
from moonep.layers import LatentMoE
from moonep.layers.activations import situ_glu_fused

DIMS = dict(d_model=64, d_latent=64, d_expert=128)  # expert weights dominate: what the pool is about


class PrefetchLatentMoE(LatentMoE):
    """LatentMoE with the forward it had before the pool: ``ep.prefetch`` of each projection."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.d_model)
        x_r, x_d, x_s = self._inputs(x)
        idx, w = self.route(x_r)
        ep = self._ep.get(x.shape[0], self.topk, self.d_latent, x.dtype, x.device)
        h = ep.dispatch(self.down(x_d), idx, w)
        w_in = ep.prefetch(h, self.experts.expert_weight("w_in"))
        w_out = ep.prefetch(h, self.experts.expert_weight("w_out"))
        a = situ_glu_fused(moonep.slot_matmul(h.tokens, h.cu_seqlens, w_in, self.matmul))
        u = ep.combine(moonep.slot_matmul(a, h.cu_seqlens, w_out, self.matmul), h)
        return (self.up(self.norm(u)) + self.shared(x_s)).reshape(shape)


class Stack(nn.Module):
    """``x + layer(x)``, L times."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.d = layers[0].d_model

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def stack(rt, L: int, *, path: str = "pool", dtype=torch.float32, E_per_rank: int = 4, topk: int = 2):
    """``(model, pool)``: L identical-seeded LatentMoE layers (no balancer: plain top-K) on ``rt``."""
    E = E_per_rank * rt.world_size
    pool = {"pool": ReplicaPool(), "keep": ReplicaPool(backward="keep"), "buffers2": ReplicaPool(buffers=2),
            "prefetch": None}[path]
    cls = PrefetchLatentMoE if path == "prefetch" else LatentMoE
    torch.manual_seed(0)
    kw = {} if pool is None else dict(replica_pool=pool)
    layers = [cls(num_experts=E, topk=topk, num_shared=1, group=rt, balancer=None, dtype=dtype, max_tokens=64,
                  **DIMS, **kw) for _ in range(L)]
    return Stack(layers), pool


def _step(model, tokens: int, device, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, model.d, generator=g).to(device, dtype).requires_grad_()
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()


def peak_memory(rt, model, tokens: int = 16) -> int:
    """Bytes above the starting level at the peak of one forward + backward (after a warm-up step)."""
    dev = rt.device
    dtype = next(model.parameters()).dtype
    _step(model, tokens, dev, dtype)  # buffers that live across steps (EP, pool) exist from here on
    model.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        _step(model, tokens, dev, dtype)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, tokens, dev, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            mem = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"
                   and e["args"].get("Device Type", 0) == 0]
    if not mem:
        return 0
    base = mem[0]["Total Allocated"] - mem[0]["Bytes"]
    return max(m["Total Allocated"] for m in mem) - base


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--paths", nargs="+", default=["pool", "keep", "prefetch"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp64"], default="fp32")
    ap.add_argument("--out", default=None, help="JSON file (rank 0 writes it)")
    args = ap.parse_args(argv)
    from moonep.bench.provenance import command, git_commit, machine
    rt = moonep.init(device=args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[args.dtype]
    rows = []
    for L in args.layers:
        for path in args.paths:
            model, pool = stack(rt, L, path=path, dtype=dtype)
            peak = peak_memory(rt, model)
            layer = model.layers[0]
            epn = layer.experts.moonep_epn
            local = [p.to_local() if hasattr(p, "to_local") else p for p in (layer.experts.w_in, layer.experts.w_out)]
            expert = sum(p.numel() * p.element_size() for p in local) // epn
            rows.append(dict(layers=L, path=path, peak_bytes=peak, pool_bytes=pool.nbytes() if pool else 0,
                             expert_bytes=expert, epn=epn,
                             home_expert_bytes_per_layer=expert * epn))
            del model, pool
    peaks = torch.tensor([r["peak_bytes"] for r in rows], dtype=torch.int64)
    if rt.world_size > 1:  # the largest rank's figure
        import torch.distributed as dist
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=rt.cpu_group)
    for r, p in zip(rows, peaks.tolist()):
        r["peak_bytes_max_rank"] = p
    if rt.rank == 0:
        print(f"{'layers':>6} {'path':>9} {'peak MiB (max over ranks)':>26} {'pool MiB':>9}")
        for r in rows:
            print(f"{r['layers']:>6} {r['path']:>9} {r['peak_bytes_max_rank'] / 2**20:>26.3f} {r['pool_bytes'] / 2**20:>9.3f}")
        print(f"one expert (both projections): {rows[0]['expert_bytes'] / 2**20:.3f} MiB; epn = {rows[0]['epn']}")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(dict(command=command(launcher=f"mpiexec -n {rt.world_size}"), commit=git_commit(),
                               machine=machine(), ranks=rt.world_size, device=args.device, dtype=args.dtype,
                               dims=DIMS, rows=rows), f, indent=1)
    rt.shutdown()  # process groups torn down at interpreter exit can abort in C++
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
