"""Planner benchmark: CPU / GPU timing, replicas per rank per routing family, gap to the ILP oracle.

    PYTHONPATH=. python benchmarks/bench_planner.py [--no-oracle] [--no-gpu] [--out PATH]

GPU times use CUDA events, median over ``--reps`` calls, for the layout of the LAST rank (its global
copy index needs the counts of every other source, the most work): ``eager_plan_only``,
``eager_layout_only`` (plan precomputed), ``eager_plan_layout`` (both, as a user calls them from Python)
and ``graph_plan_layout`` (the same sequence captured once in a CUDA graph and replayed: device time
without Python/launch overhead). ``host_plan_layout_us`` is the Python-side time of one eager call (no
sync), the floor of the eager number for small plans. Issue 3 targets: eager plan+layout <= 20 us at
(256, 8, 8) and <= 100 us at (896, 64, 16). Writes JSON to benchmarks/results/ with the command, commit
and machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moonep.layout import plan_and_destinations, token_destinations  # noqa: E402
from moonep.planner import plan_balanced  # noqa: E402
from tests.harness.planner_corpus import FAMILIES, corpus, expert_probs  # noqa: E402

CONFIGS = [(256, 8, 8), (384, 16, 8), (896, 64, 16), (8192, 1024, 16)]


def machine():
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"hostname": socket.gethostname(), "cpu": cpu, "cpu_count": os.cpu_count(), "gpu": gpu,
            "torch": torch.__version__, "python": platform.python_version()}


def rev():
    """The commit measured (HEAD, or ``.git_commit`` on the device machine)."""
    from moonep.bench.provenance import git_commit
    return git_commit()


def tokens_for(E, R):
    return 4096 if R <= 64 else 256  # s per rank (keeps the 1024-rank routing small to generate)


def bench_routing(fam, E, R, K, s, seed=0):
    """The last rank's topk int64 [s, K] (Gumbel top-K) and counts int64 [R, E] (other ranks multinomial:
    token-level sampling of every rank would need R*s*E random numbers at (8192, 1024))."""
    rng = np.random.default_rng(seed)
    p = expert_probs(fam, E, R, rng)
    K = min(K, int((p > 0).sum()))
    with np.errstate(divide="ignore"):
        g = rng.gumbel(size=(s, E)) + np.log(p)
    tk = np.argsort(-g, axis=-1, kind="stable")[:, :K].astype(np.int64)
    c = np.stack([rng.multinomial(s * K, p) for _ in range(R)]).astype(np.int64)
    c[R - 1] = np.bincount(tk.reshape(-1), minlength=E)
    return tk, c


def cpu_time(c, n):
    plan_balanced(c)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        plan_balanced(c)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6, float(np.min(ts)) * 1e6


def _events(fn, n):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record(); fn(); b.record()  # noqa: E702
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) for a, b in ev])) * 1e3


def loop_time(fn, n=200):
    """Time [us] per call of ``n`` back-to-back eager calls between two CUDA events (as a training loop
    issues them: the host enqueues the next call while the GPU runs this one), i.e. max(host, device)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def graph_time(fn, n=20, reps=20):
    """Device time [us] of one ``fn()``: ``n`` calls captured in ONE CUDA graph (after a warm-up call on a
    side stream), the graph replayed ``reps`` times under CUDA events; the median replay divided by ``n``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return _events(g.replay, reps) / n


def host_time(fn, n=200):
    """Python-side time [us] of one ``fn()``: the mean over ``n`` calls without sync (synchronised before
    and after, outside the timed loop)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


def gpu_time(c, tk, n):
    c, tk = c.cuda(), tk.cuda()
    rank = c.shape[0] - 1
    run = lambda: token_destinations(plan_balanced(c), rank, tk)  # noqa: E731
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    plan = plan_balanced(c)
    res = {"eager_plan_only_us": _events(lambda: plan_balanced(c), n),
           "eager_layout_only_us": _events(lambda: token_destinations(plan, rank, tk), n),
           "eager_plan_layout_us": _events(run, n)}
    res["host_plan_layout_us"] = host_time(run, n)
    # device time: g calls in one graph (a one-call graph would time the host's graph launch too)
    g = 20 if rank < 1000 else 2
    res["graph_plan_layout_us"] = graph_time(run, g, reps=n)
    # The library's one-call form (what the NVLink path runs each step): plan and layout in one launch
    fused = lambda: plan_and_destinations(c, rank, tk)  # noqa: E731
    for _ in range(3):
        fused()
    res["eager_fused_us"] = _events(fused, n)
    res["loop_fused_us"] = loop_time(fused, 10 * n)
    res["host_fused_us"] = host_time(fused, n)
    res["graph_fused_us"] = graph_time(fused, g, reps=n)
    return res


TARGET_US = {(256, 8, 8): 20.0, (896, 64, 16): 100.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--oracle-time-limit", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gpu = torch.cuda.is_available() and not a.no_gpu
    res = {"command": " ".join([sys.executable] + sys.argv), "commit": rev(), "machine": machine(),
           "configs": []}
    for E, R, K in CONFIGS:
        s = tokens_for(E, R)
        row = {"E": E, "R": R, "K": K, "s": s, "families": {}}
        for fam in FAMILIES:
            tk, c = bench_routing(fam, E, R, K, s)
            c = torch.from_numpy(c)
            p = plan_balanced(c)
            n = p.num_replicas().float()
            f = {"max_replicas": int(n.max()), "mean_replicas": float(n.mean()),
                 "total_replicas": int(n.sum()), "epn": E // R,
                 }
            f["cpu_plan_us_median"], f["cpu_plan_us_min"] = cpu_time(c, a.reps if R < 1000 else 5)
            if gpu:
                f.update(gpu_time(c, torch.from_numpy(tk), a.reps))
            row["families"][fam] = f
            print(E, R, K, fam, json.dumps(f), flush=True)
        res["configs"].append(row)
        if gpu:
            fams = row["families"].values()
            worst = {k: max(f[k] for f in fams) for k in ("eager_plan_only_us", "eager_layout_only_us",
                                                            "eager_plan_layout_us", "graph_plan_layout_us",
                                                            "host_plan_layout_us", "eager_fused_us",
                                                            "graph_fused_us", "host_fused_us", "loop_fused_us")}
            med = {k: float(np.median([f[k] for f in fams])) for k in worst}
            tgt = TARGET_US.get((E, R, K))
            # the target is checked on the one-call form (plan_and_destinations), the path the library runs
            row["gpu_summary"] = {"worst": worst, "median": med, "target_eager_plan_layout_us": tgt,
                                  "meets_target": None if tgt is None else worst["eager_fused_us"] <= tgt,
                                  # device time (graph replay) and back-to-back eager calls (loop): the same
                                  # target on the other two clocks; eager is one isolated call, host launch
                                  # latency included
                                  "meets_target_graph": None if tgt is None else worst["graph_fused_us"] <= tgt,
                                  "meets_target_loop": None if tgt is None else worst["loop_fused_us"] <= tgt}
            print(f"== GPU (E,R,K)=({E},{R},{K}) over families, median / worst [us]: "
                  + ", ".join(f"{k[:-3]} {med[k]:.1f} / {worst[k]:.1f}" for k in worst)
                  + "".join(f"; target {k} <= {tgt:.0f}: {'MET' if worst[k + '_us'] <= tgt else 'MISSED'}"
                            for k in ("eager_fused", "loop_fused", "graph_fused") if tgt), flush=True)
    if not a.no_oracle:
        from tests.harness.planner_oracle import oracle_plan
        cases, eq, ratios = [], 0, []
        for fam, cfg, seed, c in corpus():
            got = plan_balanced(torch.from_numpy(c)).num_replicas()
            t = time.perf_counter()
            o = oracle_plan(c, time_limit=a.oracle_time_limit, total=False)
            m, om = int(got.max()), o.max_replicas
            eq += m == om
            ratios.append(m / om if om else 1.0)
            cases.append({"family": fam, "E_R_K_s": cfg, "seed": seed, "planner_max": m, "oracle_max": om,
                          "planner_total": int(got.sum()), "oracle_status": o.status,
                          "oracle_s": time.perf_counter() - t})
            print(cases[-1], flush=True)
        res["oracle"] = {"cases": cases, "equal": eq, "n": len(cases), "mean_ratio": float(np.mean(ratios)),
                         "worst_ratio": float(np.max(ratios))}
        print("oracle: equal on", eq, "/", len(cases), "mean ratio", np.mean(ratios), "worst", np.max(ratios))
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"planner_{'gpu' if gpu else 'cpu'}_{socket.gethostname()}.json")
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
