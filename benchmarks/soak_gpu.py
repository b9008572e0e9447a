"""GPU soak: 10,000 dispatch/combine steps; device memory stays flat and nothing leaks once closed.

    mpirun -n 2 python3 benchmarks/soak_gpu.py                       # 2 GPUs, NVLink transport ("auto")
    mpirun -n 2 python3 benchmarks/soak_gpu.py --transport torch     # the NCCL path
    mpiexec -n 2 python benchmarks/soak_gpu.py --device cpu --steps 300   # the script's own logic on CPU

Two cycles on every rank, each: construct an ``ExpertParallel``, run steps, ``close()``, drop it,
``torch.cuda.empty_cache()``. Cycle 1 (``--warm-steps``) loads the kernels and the allocator's pools; cycle
2 runs ``--steps`` steps. A step draws a routing whose skew moves (a hot expert that changes every
``--phase`` steps, with a rising and falling strength), dispatches, prefetches replica weights into a
persistent pool, combines, and every ``--grad-every`` steps runs the backward pass too. Checked:

* ``torch.cuda.memory_allocated`` sampled every ``--sample-every`` steps (after a sync) stays within
  ``--tol-bytes`` of its value after ``--warmup`` steps;
* after ``close()``: ``memory_allocated`` is back to its value before construction (exactly), and the
  device's free memory (``cudaMemGetInfo``, which also sees the raw ``cudaMalloc`` of the NVLink region)
  is back to cycle 1's after-close value within ``--tol-free``;
* every ``--check-every`` steps the combine equals ``sum_k w_k x`` (identity experts) and every rank
  received the same number of rows.

Rank 0 writes JSON (command, commit, machine, samples, verdicts) to ``--out``.  Exit code 1 on failure.
"""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _soak_common import all_gather, due, parser, provenance, rss_bytes, wave, write_json  # noqa: E402


def mem(dev) -> int:
    """Bytes held by live tensors (CUDA) or the resident set (CPU, for a dry run of this script)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return torch.cuda.memory_allocated(dev)
    return rss_bytes()


def free_bytes(dev) -> int:
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(dev)[0]


def routing(step: int, s: int, E: int, K: int, phase: int, g: torch.Generator, dev):
    """``topk_idx [s, K]`` distinct experts with a moving hot expert, and weights ``[s, K]``."""
    hot = (step // phase * 7) % E
    strength = wave(step, phase, 6.0)
    scores = torch.rand(s, E, generator=g)
    scores[:, hot] += strength * torch.rand(s, generator=g)
    idx = scores.topk(K, dim=1).indices
    idx[torch.rand(s, K, generator=g) < 0.02] = -1  # a few masked choices
    w = torch.rand(s, K, generator=g) + 0.1
    return idx.to(dev), w.to(dev)


def cycle(rt, args, steps: int, record: bool) -> dict:
    import moonep

    dev, R = rt.device, rt.world_size
    E, K, H, S = args.experts_per_rank * R, args.topk, args.hidden, args.tokens
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(1000 + rt.rank)
    xs = [torch.randn(S, H, generator=g).to(dtype).to(dev) for _ in range(4)]  # rotated, allocated up front
    before = mem(dev)
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dtype,
                               transport=args.transport)
    epn = ep.epn
    pool = torch.zeros(2 * epn, 16, 16, dtype=dtype, device=dev)
    home = torch.randn(epn, 16, 16, generator=g).to(dtype).to(dev)
    pool[:epn].copy_(home)
    samples, checks, t0, warm_mem = [], 0, time.monotonic(), None
    for step in range(steps):
        s = S - (step % 5) * (S // 8)              # varying token counts, s <= S
        idx, w = routing(step, s, E, K, args.phase, g, dev)
        w = w.to(dtype)
        x = xs[step % len(xs)][:s]
        grad = step % args.grad_every == 0
        if grad:
            x = x.detach().requires_grad_()
        h = ep.dispatch(x, idx, w)
        slots = ep.prefetch(h, pool[:epn])
        y = ep.combine(h.tokens * (1 + 0 * slots[0, 0, 0]), h)  # identity experts (keeps the pool in use)
        if grad:
            y.float().square().sum().backward()
        if due(step, steps, args.check_every):
            want = ((w.float() * (idx >= 0)).sum(1, keepdim=True) * x.detach().float())
            err = float((y.detach().float() - want).abs().max()) if s else 0.0
            tol = 1e-4 if dtype == torch.float32 else 0.05 * max(1.0, float(want.abs().max()))
            assert err <= tol, f"step {step}: combine off by {err}"
            rows = all_gather(rt, int(h.num_rows) if not torch.is_tensor(h.num_rows) else int(h.num_rows.item()))
            assert max(rows) - min(rows) <= 1, rows
            checks += 1
            del want  # the reference must not count as memory held after close()
        del h, slots, y, x, idx, w
        if record and step == args.warmup:
            warm_mem = mem(dev)
        if record and due(step, steps, args.sample_every):
            samples.append((step, mem(dev)))
    ep.synchronize()
    seconds = time.monotonic() - t0
    transport = ep.transport_name
    ep.close()
    del ep, pool, home
    after_close = mem(dev)
    return dict(before=before, after_close=after_close, free_after_close=free_bytes(dev), samples=samples,
                warm_mem=warm_mem, checks=checks, seconds=seconds, transport=transport)


def main():
    ap = parser(__doc__, steps=10_000, warmup=500, sample_every=250, phase=400,
                out_name="soak_gpu_np{R}_{device type}.json")
    ap.add_argument("--warm-steps", type=int, default=50)
    ap.add_argument("--check-every", type=int, default=500)
    ap.add_argument("--grad-every", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--device", default=None, help="cpu for a dry run of the script without GPUs")
    ap.add_argument("--tol-bytes", type=int, default=0, help="allowed memory_allocated growth after warm-up")
    ap.add_argument("--tol-free", type=int, default=8 << 20, help="allowed drop of free device memory, bytes")
    args = ap.parse_args()
    if args.device == "cpu":
        args.tol_bytes = max(args.tol_bytes, 16 << 20)  # RSS moves with the Python heap: a loose dry run
    import moonep

    rt = moonep.init()
    if args.device == "cpu" and rt.device.type != "cpu":
        raise SystemExit("--device cpu: moonep.init() picked a GPU; run on a machine without one")
    dev = rt.device
    c1 = cycle(rt, args, args.warm_steps, record=False)
    c2 = cycle(rt, args, args.steps, record=True)
    growth = max(v for s, v in c2["samples"] if s >= args.warmup) - c2["warm_mem"]
    verdict = dict(
        allocated_growth_after_warmup_bytes=growth,
        allocated_flat=growth <= args.tol_bytes,
        allocated_back_after_close=(c2["after_close"] == c2["before"]) if dev.type == "cuda" else True,
        free_memory_back_after_close=(c2["free_after_close"] >= c1["free_after_close"] - args.tol_free),
    )
    verdict["passed"] = all(verdict[k] for k in ("allocated_flat", "allocated_back_after_close",
                                                  "free_memory_back_after_close"))
    per_rank = all_gather(rt, dict(rank=rt.rank, device=str(dev), cycle1=c1, cycle2=c2, verdict=verdict))
    ok = all(r["verdict"]["passed"] for r in per_rank)
    if rt.rank == 0:
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none"
        machine = dict(hostname=platform.node(), gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda,
                       gpus=torch.cuda.device_count())
        out = dict(provenance(rt, args, "soak_gpu", "mpirun", "python3", machine),
                   transport=c2["transport"], steps=args.steps, seconds=round(c2["seconds"], 2),
                   passed=ok, ranks=per_rank)
        path = write_json(args.out, f"soak_gpu_np{rt.world_size}_{dev.type}.json", out)
        for r in per_rank:
            v = r["verdict"]
            print(f"rank {r['rank']}: {args.steps} steps in {r['cycle2']['seconds']:.1f}s on {r['cycle2']['transport']}"
                  f"  allocated growth {v['allocated_growth_after_warmup_bytes']} B  back after close "
                  f"{v['allocated_back_after_close']}  free memory back {v['free_memory_back_after_close']}  "
                  f"checks {r['cycle2']['checks']}", flush=True)
        print(f"{'PASS' if ok else 'FAIL'} -> {path}", flush=True)
    rt.shutdown()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
