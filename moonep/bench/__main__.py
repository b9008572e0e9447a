"""``python -m moonep.bench``: dispatch + combine timed against the raw transport, swept over imbalance.

    mpiexec -n 4 python -m moonep.bench                       # CPU ranks (the default)
    mpiexec -n 4 python -m moonep.bench --tokens 1024 --hidden 2048 --maxvio 0 1 4

For each target maxvio it times, on the same routing and in the same run:
  * moonep ``dispatch`` (planning included) and ``combine`` (identity experts);
  * ``raw``: one plain all-to-all of exactly the bytes moonep put on the wire (its overhead floor);
  * ``per-copy``: the Megatron-style exchange that sends every token copy (s*K rows).
Times are the median over iterations of the slowest rank. Rank 0 prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import moonep
from moonep.bench.provenance import git_commit, machine
from moonep.bench.routing import make_routing, maxvio, zipf_exponent

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def timed(fn, rt, iters: int, warmup: int) -> tuple[float, object]:
    """Median seconds of the slowest rank over ``iters`` calls (barrier before each)."""
    out = None
    samples = []
    for i in range(warmup + iters):
        rt.barrier()
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    t = torch.tensor(sorted(samples)[len(samples) // 2], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.cpu_group)
    return float(t), out


def run(args) -> list[dict]:
    rt = moonep.init(device=args.device)
    R, E, K, H, s = rt.world_size, args.experts, args.topk, args.hidden, args.tokens
    dtype = DTYPES[args.dtype]
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=dtype,
                               transport=args.transport)
    x = torch.randn(s, H, device=rt.device).to(dtype)
    rows = []
    for target in args.maxvio:
        a = zipf_exponent(target, E, K)
        idx, w = make_routing(s, E, K, a, seed=1000 + rt.rank, device=rt.device)
        t_disp, h = timed(lambda: ep.dispatch(x, idx, w), rt, args.iters, args.warmup)
        t_comb, _ = timed(lambda: ep.combine(h.tokens, h), rt, args.iters, args.warmup)
        routing = h.routing
        n_send = sum(routing.send_splits)
        flat = x[routing.pair_token]
        t_raw, _ = timed(lambda: ep.transport.all_to_all(flat, routing.send_splits, routing.recv_splits),
                         rt, args.iters, args.warmup)
        # Megatron-style: every copy travels, grouped by destination rank of its expert's home.
        home = (idx // (E // R)).reshape(-1)
        order = torch.argsort(home, stable=True)
        copies = x.repeat_interleave(K, dim=0)[order]
        c_send = torch.bincount(home, minlength=R)
        c_recv = ep.transport.all_to_all(c_send[:, None], [1] * R, [1] * R)[:, 0].tolist()
        c_send = c_send.tolist()
        t_copy, _ = timed(lambda: ep.transport.all_to_all(copies, c_send, c_recv), rt, args.iters, args.warmup)
        stats = torch.tensor([n_send, s * K, h.num_rows], dtype=torch.int64)
        gathered = [torch.zeros_like(stats) for _ in range(R)]
        dist.all_gather(gathered, stats, group=rt.cpu_group)
        g = torch.stack(gathered)
        counts = h.plan.counts if hasattr(h.plan, "counts") else None
        row = {
            "maxvio_target": target, "maxvio": round(maxvio(h.plan.assignment.t().cpu()) if counts is None
                                                     else maxvio(counts.cpu()), 4),
            "dispatch_us": t_disp * 1e6, "combine_us": t_comb * 1e6, "raw_us": t_raw * 1e6,
            "per_copy_us": t_copy * 1e6,
            "wire_rows": int(g[:, 0].sum()), "token_copies": int(g[:, 1].sum()),
            "max_rows_received": int(g[:, 2].max()), "min_rows_received": int(g[:, 2].min()),
            "replicas": int((h.plan.replica_experts >= 0).sum()),
            "logical_GBps": s * K * H * x.element_size() / t_disp / 1e9,
        }
        row["dedup_ratio"] = row["token_copies"] / max(row["wire_rows"], 1)
        row["overhead_vs_raw"] = (t_disp + t_comb) / (2 * t_raw)
        rows.append(row)
        if rt.rank == 0:
            print(f"\r  maxvio {target:>5} done", end="", file=sys.stderr, flush=True)
    if rt.rank == 0:
        print(file=sys.stderr)
    rt.shutdown()
    return rows if rt.rank == 0 else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moonep.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--maxvio", type=float, nargs="+", default=[0, 0.5, 1, 2, 4])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cpu_a2a_np<R>.json)")
    args = ap.parse_args(argv)
    rows = run(args)
    if not rows:
        return 0
    R = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))))
    print(f"# moonep dispatch/combine  ranks={R} tokens/rank={args.tokens} hidden={args.hidden} "
          f"E={args.experts} K={args.topk} {args.dtype} device={args.device}")
    print(f"# {'maxvio':>7} {'disp_us':>9} {'comb_us':>9} {'raw_us':>9} {'percopy_us':>10} "
          f"{'wire/copies':>11} {'max_recv':>8} {'min_recv':>8} {'replicas':>8} {'vs_raw':>6}")
    for r in rows:
        print(f"  {r['maxvio']:>7.2f} {r['dispatch_us']:>9.0f} {r['combine_us']:>9.0f} {r['raw_us']:>9.0f} "
              f"{r['per_copy_us']:>10.0f} {r['wire_rows']:>5}/{r['token_copies']:<5} {r['max_rows_received']:>8} "
              f"{r['min_rows_received']:>8} {r['replicas']:>8} {r['overhead_vs_raw']:>6.2f}")
    out = Path(args.out or f"benchmarks/results/{args.device}_a2a_np{R}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    launcher = "mpiexec -n %d " % R if "PMI_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ else ""
    out.write_text(json.dumps({
        "command": launcher + "python -m moonep.bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "git_commit": git_commit(), "machine": machine(), "ranks": R, "config": vars(args), "results": rows,
    }, indent=1))
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
