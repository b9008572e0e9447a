"""How much communication the two-micro-batch schedule (moonep.layers.overlap.two_batch_moe) hides.

    mpirun -n 1 python3 benchmarks/bench_overlap.py --out benchmarks/results/h200x1_overlap.json     # GPU preset
    mpiexec -n 2 python benchmarks/bench_overlap.py --device cpu --out benchmarks/results/cpu_overlap_np2.json

One layer step of two micro-batches: router weights in, ``dispatch -> SwiGLU experts (ReplicaPool +
moonep.expert_matmul) -> combine``, forward and backward (``--forward-only``: forward under no_grad).  In every
timed iteration, one after the other (paired timing: a busy machine slows both alike):

* ``serial``: the schedule with every call waited at once (``overlap=False``);
* ``overlapped``: ``overlap=True``;
* ``comm``: the same step with the experts replaced by a copy of the rows (communication and little else);
* ``compute``: the experts alone (with their replica fetch), forward and backward, on both micro-batches' rows
  (no dispatch or combine).

``efficiency = (serial - overlapped) / min(comm, compute)``: 1 when the shorter of the two is hidden entirely.
Also, on CUDA, the slowdown of one expert GEMM while a dispatch runs beside it on the communication stream
(``--num-sms`` SMs), against the GEMM alone.  Times are medians (CUDA events on CUDA, wall clock on CPU; the
slowest rank's), and each iteration's ratio is kept so its median and spread are reported too.  One more step
of each schedule checks that the overlapped one gives the serial one's outputs and gradients bitwise, on every
rank (on 2 ranks sharing one GPU: a correctness-under-concurrency run, not a speed figure).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import moonep
from moonep.bench.provenance import command, git_commit, machine
from moonep.layers.overlap import two_batch_moe

PRESETS = {  # DeepSeek-V3's shape on one GPU; a CPU shape that a 2-core machine runs in seconds
    "h200": dict(tokens=4096, hidden=7168, experts=256, topk=8, ffn=2048, dtype="bfloat16", device="cuda"),
    "cpu": dict(tokens=1024, hidden=256, experts=8, topk=2, ffn=512, dtype="float32", device="cpu"),
}
_DT = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: h200 on CUDA, else cpu")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--tokens", type=int, help="tokens per micro-batch per rank")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--experts", type=int, help="experts in all (at least one per rank)")
    ap.add_argument("--topk", type=int)
    ap.add_argument("--ffn", type=int, help="SwiGLU intermediate width of one expert")
    ap.add_argument("--dtype", choices=sorted(_DT))
    ap.add_argument("--num-sms", type=int, default=24, help="SMs of moonep's NVLink kernels (Tuning)")
    ap.add_argument("--sm-carveout", type=int, default=0,
                    help="CUDA: SMs that torch's GEMMs leave free while the overlapped schedule runs "
                    "(torch._C._set_sm_carveout_experimental; 0: none)")
    ap.add_argument("--forward-only", action="store_true", help="forward under no_grad (inference)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--profile", default=None, help="path prefix: torch.profiler tables (.txt) and trace (.json) "
                    "of one serial and one overlapped step (diagnosis; not part of the timing)")
    args = ap.parse_args(argv)
    preset = args.preset or ("h200" if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
                             else "cpu")
    for k, v in PRESETS[preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.preset = preset
    return args


class Timer:
    """Elapsed milliseconds of a callable: CUDA events on CUDA (the slowest rank's via the caller), else wall.
    ``last_host``: the last call's wall time until the callable returned (on CUDA: the host's share; when it is
    close to the elapsed time, the step is bound by the host and no stream schedule can hide anything)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.last_host = 0.0

    def __call__(self, fn) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            fn()
            self.last_host = (time.perf_counter() - t0) * 1e3
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t0 = time.perf_counter()
        fn()
        self.last_host = (time.perf_counter() - t0) * 1e3
        return self.last_host


def build(args, rt):
    dev, dt = rt.device, _DT[args.dtype]
    R = rt.world_size
    E = max(args.experts, R)
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=args.topk, hidden=args.hidden, max_tokens=args.tokens,
                               dtype=dt, tuning=moonep.Tuning(num_sms=args.num_sms) if dev.type == "cuda" else None)
    g = torch.Generator(device="cpu").manual_seed(1234 + rt.rank)
    gd = torch.Generator(device=dev).manual_seed(1234 + rt.rank)  # the weights drawn where they live (GBs)
    epn = ep.epn
    w1 = (torch.randn(epn, args.hidden, 2 * args.ffn, generator=gd, device=dev) / args.hidden ** 0.5).to(dt)
    w2 = (torch.randn(epn, args.ffn, args.hidden, generator=gd, device=dev) / args.ffn ** 0.5).to(dt)
    w1.requires_grad_()
    w2.requires_grad_()
    pool = moonep.ReplicaPool()

    def fetch(h):  # the replica fetch, given to the schedule apart (before the next collective is issued)
        return pool.fetch(ep, h, [w1, w2], ["w1", "w2"])

    def experts(h, reps):
        gate, up = moonep.expert_matmul(h.tokens, h.cu_seqlens, w1, reps[0]).chunk(2, -1)
        return moonep.expert_matmul(F.silu(gate) * up, h.cu_seqlens, w2, reps[1])

    def batch():  # Zipf-skewed routing: the planner places replicas, the pool fetches them
        x = torch.randn(args.tokens, args.hidden, generator=g).to(dev, dt)
        logits = -1.2 * torch.log(torch.arange(1, E + 1, dtype=torch.float64)) + torch.rand(args.tokens, E,
                                                                                            generator=g,
                                                                                            dtype=torch.float64)
        idx = logits.topk(args.topk, dim=1).indices.to(dev)
        w = torch.softmax(torch.randn(args.tokens, args.topk, generator=g), -1).to(dev)
        return x, idx, w

    return ep, fetch, experts, (w1, w2), [batch(), batch()]


def main(argv=None) -> int:
    args = parse(argv)
    rt = moonep.init(device=args.device)
    ep, fetch, experts, params, batches = build(args, rt)
    train = not args.forward_only
    timer = Timer(rt.device)

    def inputs():
        return [(x.detach().requires_grad_(train), i, w.detach().requires_grad_(train)) for x, i, w in batches]

    def carved(fn):  # the overlapped schedule with the GEMMs kept off --sm-carveout SMs
        if not args.sm_carveout:
            return fn

        def run():
            before = torch._C._get_sm_carveout_experimental()
            torch._C._set_sm_carveout_experimental(args.sm_carveout)
            try:
                return fn()
            finally:
                torch._C._set_sm_carveout_experimental(before)
        return run

    def step(expert_fn, overlap):
        def run():
            for p in params:
                p.grad = None
            with torch.set_grad_enabled(train):
                ys = two_batch_moe(ep, inputs(), expert_fn, params, fetch=fetch, overlap=overlap)
                if train:
                    (ys[0].float().sum() + ys[1].float().sum()).backward()
        return run

    def outcome(overlap):  # outputs and gradients of one step (the overlapped schedule must give the serial bits)
        for p in params:
            p.grad = None
        bs = inputs()
        with torch.set_grad_enabled(train):
            ys = two_batch_moe(ep, bs, experts, params, fetch=fetch, overlap=overlap)
            if train:
                (ys[0].float().sum() + ys[1].float().sum()).backward()
        got = [y.detach() for y in ys]
        if train:
            got += [t.grad for x, _, w in bs for t in (x, w)] + [p.grad.clone() for p in params]
        return got

    def copy_rows(h, reps):  # communication and a copy: the schedule without its compute
        return h.tokens * 1

    held = {}

    def compute():  # the experts alone on both micro-batches' rows (dispatched once, outside the timing)
        for p in params:
            p.grad = None
        with torch.set_grad_enabled(train):
            for h in held["hs"]:
                out = experts(h._replace(tokens=h.tokens.detach().requires_grad_(train)), fetch(h))
                if train:
                    out.float().sum().backward()

    held["hs"] = [ep.dispatch(x, i, w) for x, i, w in batches]
    cases = {"serial": step(experts, False), "overlapped": carved(step(experts, True)), "comm": step(copy_rows, True),
             "compute": compute}
    for _ in range(args.warmup):
        for fn in cases.values():
            fn()
    times = {k: [] for k in cases}
    host = {k: [] for k in cases}
    for _ in range(args.iters):
        for k, fn in cases.items():
            ep.sync()
            times[k].append(timer(fn))
            host[k].append(timer.last_host)
    if args.profile:
        profile(args.profile, {k: cases[k] for k in ("serial", "overlapped")}, rt)
    # the slowest rank's time per iteration
    same = all(torch.equal(a, b) for a, b in zip(outcome(False), carved(lambda: outcome(True))()))
    gathered = ep.transport.all_gather_object((times, same))
    same_everywhere = all(ok for _, ok in gathered)
    gathered = [t for t, _ in gathered]
    slow = {k: [max(t[k][i] for t in gathered) for i in range(args.iters)] for k in cases}
    med = {k: statistics.median(v) for k, v in slow.items()}
    hidden = [(s - o) / max(min(c, m), 1e-9) for s, o, c, m in zip(slow["serial"], slow["overlapped"], slow["comm"],
                                                                    slow["compute"])]
    result = dict(
        benchmark="bench_overlap", command=command(), git_commit=git_commit(), machine=machine(),
        config=dict(vars(args), ranks=rt.world_size, num_experts=ep.num_experts, transport=ep.transport_name,
                    step="forward+backward" if train else "forward (no_grad)"),
        median_ms=med, per_iteration_ms=slow, host_median_ms={k: statistics.median(v) for k, v in host.items()},
        efficiency=(med["serial"] - med["overlapped"]) / max(min(med["comm"], med["compute"]), 1e-9),
        efficiency_per_iteration=dict(median=statistics.median(hidden), min=min(hidden), max=max(hidden)),
        overlapped_over_serial=med["overlapped"] / med["serial"],
        compute_over_comm=med["compute"] / med["comm"],
        overlapped_bitwise_equal_to_serial=same_everywhere,
    )
    if rt.device.type == "cuda":
        result["gemm_beside_dispatch"] = gemm_slowdown(ep, batches, params[0], timer, args.iters, carved)
    if rt.rank == 0:
        print(json.dumps({k: result[k] for k in ("median_ms", "host_median_ms", "efficiency",
                                                  "efficiency_per_iteration", "overlapped_over_serial",
                                                  "compute_over_comm", "overlapped_bitwise_equal_to_serial")},
                         indent=1))
        if "gemm_beside_dispatch" in result:
            print(json.dumps(result["gemm_beside_dispatch"]))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    ep.close()
    return 0


def profile(prefix: str, cases: dict, rt) -> None:
    """One step of each case under torch.profiler: ``{prefix}_{case}.txt`` (ops by self CPU time and by device
    time) and ``{prefix}_{case}.json`` (a Chrome trace, streams side by side)."""
    from torch.profiler import ProfilerActivity, profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    for name, fn in cases.items():
        fn()
        with prof(activities=acts) as p:
            fn()
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
        if rt.rank == 0:
            ka = p.key_averages()
            with open(f"{prefix}_{name}.txt", "w") as f:
                f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60) + "\n")
                if rt.device.type == "cuda":
                    f.write(ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=60))
            p.export_chrome_trace(f"{prefix}_{name}.json")


def gemm_slowdown(ep, batches, w1, timer, iters: int, carved=lambda fn: fn) -> dict:
    """One expert GEMM's time alone, and beside a dispatch on the communication stream (DeepEP's trade-off: the
    SMs the dispatch holds)."""
    x, i, w = batches[0]
    a = torch.randn(x.shape[0] * ep.topk, w1.shape[1], device=x.device, dtype=x.dtype)
    b = w1[0].detach()

    def gemm():
        for _ in range(4):
            a @ b

    def both():
        work = ep.dispatch(x, i, w, async_op=True)
        carved(gemm)()
        work.wait()

    def dispatch_alone():
        ep.dispatch(x, i, w, async_op=True).wait()

    for fn in (gemm, both, dispatch_alone):
        fn()
    alone, beside, disp = [], [], []
    for _ in range(iters):
        alone.append(timer(gemm))
        beside.append(timer(both))
        disp.append(timer(dispatch_alone))
    m = {k: statistics.median(v) for k, v in (("gemm_ms", alone), ("gemm_and_dispatch_ms", beside),
                                              ("dispatch_ms", disp))}
    m["slowdown"] = m["gemm_and_dispatch_ms"] / m["gemm_ms"]
    m["note"] = ("gemm_and_dispatch: 4 GEMMs [T*K, H] x [H, 2F] on the current stream with one async dispatch beside "
                 "them; slowdown = that / the GEMMs alone (1.0: the dispatch was free)")
    return m


if __name__ == "__main__":
    raise SystemExit(main())
