"""Time dispatch and combine through the public API on one rank, to compare two versions of the code.

    python3 tools/time_ep.py --label after --out timings.jsonl            # PYTHONPATH picks the version
    python3 tools/time_ep.py --report timings.jsonl                       # medians per label, and ratios

Defaults: 4096 tokens, hidden 7168, bf16, top-8 of 256 experts (DeepEP's intranode shape), the nvlink
backend on one GPU (rows stay local).  Reported per call, in microseconds: back-to-back eager calls timed
with CUDA events (host launch time included when the host is the slower side), the same calls replayed
from a CUDA graph (device time only), with the helpers of benchmarks/bench_planner.py, and dispatch +
combine + their backward under autograd; then an eager ``LatentMoE`` step (forward + backward, ms) at the
configuration of benchmarks/bench_compile.py.  Only public API is
used, so older versions run it unchanged; run the versions alternately in one device call (A B A B) so
that drift of the machine shows up as spread, not as a difference.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _bench_helpers():
    """CUDA-event timing helpers of benchmarks/bench_planner.py (the timing every benchmark here shares)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_planner import _events, graph_time

    return _events, graph_time


def measure(args) -> dict:
    import torch

    import moonep

    _events, graph_time = _bench_helpers()
    rt = moonep.init(device="cuda")
    if args.layer_only:
        res = {"layer_step_ms": _layer_step_ms(rt)}
        rt.shutdown()
        return {k: round(v, 3) for k, v in res.items()}
    s, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(s, H, generator=g).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]).cuda()
    w = torch.rand(s, K, generator=g).cuda()
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=torch.bfloat16,
                               transport="nvlink", zero_copy=True)
    res = {}
    with torch.no_grad():
        for _ in range(args.warmup):
            h = ep.dispatch(x, idx, w)
            ep.combine(h.tokens, h)
        torch.cuda.synchronize()
        h = ep.dispatch(x, idx, w)
        res["dispatch_us"] = statistics.median(_events(lambda: ep.dispatch(x, idx, w), args.iters)
                                               for _ in range(args.reps))
        h = ep.dispatch(x, idx, w)
        res["combine_us"] = statistics.median(_events(lambda: ep.combine(h.tokens, h), args.iters)
                                              for _ in range(args.reps))
        res["dispatch_graph_us"] = graph_time(lambda: ep.dispatch(x, idx, w), n=10, reps=args.reps)
        h = ep.dispatch(x, idx, w)
        res["combine_graph_us"] = graph_time(lambda: ep.combine(h.tokens, h), n=10, reps=args.reps)
        ep.synchronize()
    # under autograd (the default zero_copy: rows copied for the backward): dispatch, combine, both backwards
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    ept = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=torch.bfloat16,
                                transport="nvlink")

    def train_pair():
        hh = ept.dispatch(xg, idx, wg)
        ept.combine(hh.tokens, hh).float().sum().backward()

    for _ in range(args.warmup):
        train_pair()
    res["dispatch_combine_grad_us"] = statistics.median(_events(train_pair, args.iters) for _ in range(args.reps))
    ept.synchronize()
    ept.close()
    res["layer_step_ms"] = _layer_step_ms(rt)
    ep.close()
    rt.shutdown()
    return {k: round(v, 3) for k, v in res.items()}


def _layer_step_ms(rt) -> float:
    """Median milliseconds of an eager ``LatentMoE`` step (forward + backward, bf16) at the configuration of
    benchmarks/bench_compile.py: 4096 tokens, d_model 2048, d_latent 1024, top-6 of 64 experts, d_expert 768."""
    import torch

    m = _latent_layer(rt)
    g = torch.Generator().manual_seed(0)
    # 8 inputs in turn, 10 steps of warm-up, 60 timed: a host-bound step's median moved by 30% between runs of
    # the same code with 20 (H100, one process per run)
    xs = [torch.randn(4096, 2048, generator=g).to(rt.device, torch.bfloat16) for _ in range(8)]
    times = []
    for i in range(70):
        x = xs[i % len(xs)]
        m.zero_grad(set_to_none=True)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        m(x).float().square().sum().backward()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[10:])


def _latent_layer(rt):
    """The eager ``LatentMoE`` that :func:`_layer_step_ms` times and :func:`profile_layer` profiles."""
    import torch

    from moonep.layers import LatentMoE

    torch.manual_seed(0)
    return LatentMoE(2048, 1024, 64, 6, 768, group=rt, max_tokens=4096, dtype=torch.bfloat16, device=rt.device)


def profile_layer(prefix: str) -> None:
    """One eager ``LatentMoE`` step (the configuration of :func:`_layer_step_ms`) under torch.profiler, after
    warm-up: ``{prefix}.txt`` (ops by self CPU time and by device time, and the step's host and device
    milliseconds), ``{prefix}.json.gz`` (a Chrome trace), and 20 steps under cProfile: ``{prefix}_python.txt``
    and ``{prefix}.pstats``."""
    import cProfile
    import os
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    import moonep

    rt = moonep.init(device="cuda")
    m = _latent_layer(rt)
    x = torch.randn(4096, 2048, generator=torch.Generator().manual_seed(0)).to(rt.device, torch.bfloat16)

    def step():
        m.zero_grad(set_to_none=True)
        m(x).float().square().sum().backward()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    host = []
    for _ in range(10):  # the host's share of a step: until the step's last launch returned
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step()
        torch.cuda.synchronize()
    ka = p.key_averages()
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".txt", "w") as f:
        f.write(f"{moonep.__file__}\nhost ms per step (median of 10): {statistics.median(host):.3f}\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=50, max_name_column_width=70) + "\n")
        f.write(ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70) + "\n")
    p.export_chrome_trace(prefix + ".json.gz")  # (torch gzips a path ending in .gz)
    cp = cProfile.Profile()  # the host's Python: which functions the step's time goes to
    cp.enable()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    cp.disable()
    cp.dump_stats(prefix + ".pstats")  # (pstats.Stats(path) reads it: every function, callers and callees)
    with open(prefix + "_python.txt", "w") as f:
        st = pstats.Stats(cp, stream=f)
        st.sort_stats("tottime").print_stats(60)
        st.sort_stats("cumulative").print_stats(80)
    rt.shutdown()


def report(path: str) -> int:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    labels = list(dict.fromkeys(r["label"] for r in rows))  # in the order they first ran
    keys = [k for k in rows[0]["times"]]
    out = {}
    print(f"{'metric':20s}" + "".join(f"{lab:>28s}" for lab in labels))
    for k in keys:
        vals = {lab: [r["times"][k] for r in rows if r["label"] == lab] for lab in labels}
        out[k] = {lab: dict(runs=v, median=statistics.median(v)) for lab, v in vals.items()}
        print(f"{k:20s}" + "".join(f"{statistics.median(v):12.1f} ({min(v):.1f}-{max(v):.1f})".rjust(28)
                                   for v in vals.values()))
    if len(labels) == 2:
        a, b = labels
        for k in keys:
            out[k][f"{b}/{a}"] = round(out[k][b]["median"] / out[k][a]["median"], 3)
        print("ratios " + f"{b}/{a}: " + ", ".join(f"{k} {out[k][f'{b}/{a}']}" for k in keys))
    with open(path + ".summary.json", "w") as f:
        json.dump(out, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="run")
    ap.add_argument("--out")
    ap.add_argument("--report")
    ap.add_argument("--layer-only", action="store_true", help="time the LatentMoE step only")
    ap.add_argument("--profile", help="path prefix: profile one eager LatentMoE step instead of timing")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report)
    if args.profile:
        profile_layer(args.profile)
        return 0
    t0 = time.time()
    times = measure(args)
    rec = dict(label=args.label, times=times, seconds=round(time.time() - t0, 1))
    print(json.dumps(rec))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
