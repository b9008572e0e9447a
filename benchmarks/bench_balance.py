"""Quantile Balancing: convergence study (CPU), per-step cost (CPU) and GPU timing.

    python benchmarks/bench_balance.py study [--quick]   # MaxVio vs step: QB, QB+EMA, sign rule, none
    python benchmarks/bench_balance.py cost              # payload and per-step time on CPU
    python benchmarks/bench_balance.py gpu               # CUDA-event timing, E=896, 8192 tokens (kernels
                                                         # and torch fallback; qb_overhead_us = QB's cost)

Router: sigmoid of Zipf-like popularity logits (``-skew * log(rank)``, ranks shuffled) plus N(0, 1) noise
per token and expert. Scenarios:
  * static: one token pool reused every step, i.e. the population itself: no sampling noise, so MaxVio
    shows the balancing dynamics alone (a fresh batch of m tokens adds a ~3/sqrt(q) noise floor).
  * fresh:  a new batch every step (E=64, batches large enough for a floor below 0.05 at K>=8).
  * drift:  the static pool (E=256, K=8), while popularity moves linearly from one Zipf order to another
            (held for steps/2, moving for steps/4, held again): faster than gamma per step can follow.
MaxVio = max_e load_e / mean load - 1 over the step's global batch, with the bias in force during it.
Writes JSON (command, commit, machine) and a PNG to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moonep.balance import QuantileBalancer  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GAMMA = 1e-3   # DeepSeek-V3 sign-rule step
EMA = 0.5      # QB+EMA mixing weight on the old bias
THRESH = 0.05
SKEW = 0.2     # popularity logits -SKEW*log(rank): unbalanced MaxVio 1.4 (E=64,K=8) .. 17 (E=896,K=2)
QB_STATIC_STEPS = 40  # QB settles in a few steps on the static pool; the rest would be flat


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    d = dict(host=platform.node(), cpu=cpu, cores=os.cpu_count(), torch=torch.__version__,
             threads=torch.get_num_threads(), python=platform.python_version())
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name()
    return d


def provenance() -> dict:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(RESULTS)).stdout.strip()
    except OSError:
        head = None
    return dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv), commit=head, machine=machine(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"))


def zipf_logits(E, g, skew):
    return -skew * torch.log(torch.arange(1, E + 1, dtype=torch.float32))[torch.randperm(E, generator=g)]


def maxvio(idx, E):
    load = torch.bincount(idx.flatten(), minlength=E)
    return float(load.max()) / (idx.numel() / E) - 1.0


class Sign:
    """DeepSeek-V3 rule: ``b_e += gamma * sign(mean load - load_e)``."""

    def __init__(self, E, K):
        self.E, self.K, self.bias = E, K, torch.zeros(E)

    def route(self, scores):
        idx = torch.topk(scores + self.bias, self.K, dim=1).indices
        load = torch.bincount(idx.flatten(), minlength=self.E).float()
        self.bias += GAMMA * torch.sign(load.mean() - load)
        return idx


class NoBalance:
    def __init__(self, E, K):
        self.K = K

    def route(self, scores):
        return torch.topk(scores, self.K, dim=1).indices


class QB:
    def __init__(self, E, K, ema=0.0):
        self.qb = QuantileBalancer(E, K, ema=ema, validate=False)

    def route(self, scores):
        idx, _ = self.qb.route(scores)
        self.qb.step()
        return idx


METHODS = {"qb": lambda E, K: QB(E, K), "qb_ema": lambda E, K: QB(E, K, EMA), "sign": Sign, "none": NoBalance}


def run(scenario, E, K, m, steps, seed=0, skew=SKEW):
    """MaxVio per step for every method; the same token stream for all of them."""
    g = torch.Generator().manual_seed(seed)
    pop_a, pop_b = zipf_logits(E, g, skew), zipf_logits(E, g, skew)
    noise = torch.randn(m, E, generator=g)
    out = {}
    for name, make in METHODS.items():
        n_steps = {"none": 1 if scenario == "static" else steps}.get(name, steps)
        if name.startswith("qb") and scenario == "static":
            n_steps = min(steps, QB_STATIC_STEPS)
        meth, curve, below, t0 = make(E, K), [], 0, time.perf_counter()
        gs = torch.Generator().manual_seed(seed + 1)
        for t in range(n_steps):
            if scenario == "fresh":
                logits = pop_a + torch.randn(m, E, generator=gs)
            elif scenario == "drift":  # hold A, move to B over [steps/2, 3*steps/4], hold B
                a = min(max((t - steps / 2) / (steps / 4), 0.0), 1.0)
                logits = (1 - a) * pop_a + a * pop_b + noise
            else:
                logits = pop_a + noise
            curve.append(round(maxvio(meth.route(torch.sigmoid(logits)), E), 5))
            below = below + 1 if curve[-1] < THRESH else 0
            if scenario == "static" and name == "sign" and below >= 20:
                break  # converged and stayed there
        first = {th: next((t for t, v in enumerate(curve) if v < th), None) for th in (THRESH, 0.1, 0.2)}
        tail = curve[-min(20, len(curve)):]
        out[name] = dict(maxvio=curve, steps_to_below=first[THRESH], steps_to=first, final=sum(tail) / len(tail),
                         seconds=round(time.perf_counter() - t0, 2))
    return out


def tokens_for(E, K, quick):
    """Static/drift pool size: q = m*K/E >= 96 (one token ~0.01 of an expert's load), m <= 16384 for
    time on 2 CPU cores (E=896, K=2 gets q=37: its MaxVio floor is above 0.05 for every method)."""
    m = min(16384, max(2048, math.ceil(96 * E / K / 1024) * 1024))
    return m // 4 if quick else m


def study(args):
    quick, res = args.quick, dict(provenance(), gamma=GAMMA, ema=EMA, threshold=THRESH, runs=[])
    steps = 100 if quick else 400
    plan = [("static", E, K, tokens_for(E, K, quick)) for E in (64, 256, 896) for K in (2, 8, 16)]
    plan += [("fresh", 64, K, 4096 if quick else 32768) for K in (2, 8, 16)]
    plan += [("drift", 256, 8, tokens_for(256, 8, quick))]
    for scen, E, K, m in plan:
        r = run(scen, E, K, m, {"static": steps, "fresh": steps // 2, "drift": steps}[scen])
        res["runs"].append(dict(scenario=scen, E=E, K=K, tokens=m, q=m * K / E, results=r))
        print(f"{scen:6s} E={E:4d} K={K:2d} m={m:6d} " + "  ".join(
            f"{n}: to<{THRESH}={v['steps_to_below']} final={v['final']:.3f} ({v['seconds']}s)"
            for n, v in r.items()), flush=True)
    tag = "_quick" if quick else ""
    path = os.path.join(args.out, f"balance_convergence{tag}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(args.out, f"balance_convergence{tag}.png"))
    print("wrote", path)


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("static", E) for E in (64, 256, 896)] + [("fresh", 64)]
    fig, axes = plt.subplots(len(rows) + 1, 3, figsize=(14, 3.1 * (len(rows) + 1)), squeeze=False)
    axes[-1, 1].axis("off")
    axes[-1, 2].axis("off")
    style = {"qb": ("C0", "QB"), "qb_ema": ("C1", f"QB+EMA({EMA})"), "sign": ("C2", f"sign γ={GAMMA}"),
             "none": ("C3", "none")}
    for run in res["runs"]:
        if run["scenario"] == "drift":  # one panel, bottom right of a 4th row shared with fresh K=2/8/16
            ax = axes[len(rows), 0]
        else:
            ax = axes[rows.index((run["scenario"], run["E"])), (2, 8, 16).index(run["K"])]
        for name, v in run["results"].items():
            y = v["maxvio"]
            if len(y) == 1:
                ax.axhline(max(y[0], 1e-3), color=style[name][0], ls="--", label=style[name][1])
            else:
                ax.plot(range(len(y)), [max(x, 1e-3) for x in y], color=style[name][0], lw=1, label=style[name][1])
        ax.axhline(THRESH, color="k", lw=0.5, ls=":")
        ax.set_yscale("log")
        if run["scenario"] == "drift":
            lo_ = len(run["results"]["qb"]["maxvio"])
            ax.axvspan(lo_ / 2, 3 * lo_ / 4, color="0.9")  # popularity moving
            ax.set_xlim(0, lo_)
        else:
            ax.set_xscale("symlog", linthresh=10)
            ax.set_xlim(left=0)
        ax.set_title(f"{run['scenario']}  E={run['E']} K={run['K']} m={run['tokens']} (q={run['q']:.0f})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("global MaxVio", fontsize=8)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print("wrote", path)


def time_cpu(fn, reps):
    """Median seconds per call (the 2-core machine is shared, so the mean is noisy)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def cost(args):
    res = dict(provenance(), rows=[])
    for E, K, n in [(64, 8, 4096), (256, 8, 4096), (896, 16, 4096), (896, 16, 8192)]:
        scores = torch.rand(n, E)
        qb = QuantileBalancer(E, K)
        plain = QuantileBalancer(E, K, frozen=True)
        t_route = time_cpu(lambda: qb.route(scores), 9)
        t_plain = time_cpu(lambda: plain.route(scores), 9)
        t_step = time_cpu(qb.step, 9)
        row = dict(E=E, K=K, tokens=n, bins=qb.bins, payload_bytes=qb._counts.numel() * 4,
                   route_record_ms=round(t_route * 1e3, 3), route_plain_ms=round(t_plain * 1e3, 3),
                   step_ms_no_allreduce=round(t_step * 1e3, 3))
        res["rows"].append(row)
        print(row, flush=True)
    path = os.path.join(args.out, "balance_cost_cpu.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


def gpu(args):
    """CUDA-event timing of route (plain / recording), step and both, per implementation.

    ``qb_overhead_us`` = route+step - plain route: QB's own cost per step (recording one micro-batch of
    ``tokens`` plus the step, without the all-reduce), measured eagerly, so host launch gaps count.
    ``*_graph_us``: the same sequences captured in a CUDA graph and replayed: the device time alone.
    ``impl``: ``kernels`` = the fused CuPy kernels (csrc/balance.cu), ``torch`` = the pure-torch fallback.
    """
    assert torch.cuda.is_available(), "gpu mode needs CUDA"
    from moonep import cuda_runtime

    res = dict(provenance(), rows=[], note="CUDA events, median of --reps; single process, so no all-reduce")

    def med(fn, reps):
        for _ in range(5):
            fn()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return round(sorted(ts)[len(ts) // 2], 2)

    def graphed(fn):
        """``fn`` captured once (after a warm-up on a side stream); returns the replay, or None."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return g.replay
        except Exception as e:  # report, keep timing the rest
            print(f"  graph capture failed: {type(e).__name__}: {e}", flush=True)
            return None

    impls = {"both": ["kernels", "torch"], "kernels": ["kernels"], "torch": ["torch"]}[args.impl]
    if not cuda_runtime.available() and "kernels" in impls:
        print("cupy not available: only the torch fallback is timed", flush=True)
        impls = ["torch"]
    for impl in impls:
        cuda_runtime._AVAILABLE = impl == "kernels"  # (the switch the library reads on every call)
        for E, K, n, dtype in [(896, 16, 8192, torch.bfloat16), (896, 16, 8192, torch.float32),
                               (256, 8, 8192, torch.bfloat16), (64, 8, 4096, torch.bfloat16)]:
            scores = torch.rand(n, E, device="cuda").to(dtype)
            qb = QuantileBalancer(E, K, device="cuda")
            plain = QuantileBalancer(E, K, device="cuda", frozen=True)

            def full():
                qb.route(scores)
                qb.step()

            full()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # the timed path must not sync (checked untimed)
            try:
                for _ in range(3):
                    full()
            finally:
                torch.cuda.set_sync_debug_mode(0)

            row = dict(impl=impl, E=E, K=K, tokens=n, dtype=str(dtype), payload_bytes=qb._counts.numel() * 4,
                       route_plain_us=med(lambda: plain.route(scores), args.reps),
                       route_record_us=med(lambda: qb.route(scores), args.reps),
                       step_us=med(qb.step, args.reps), route_plus_step_us=med(full, args.reps))
            row["qb_overhead_us"] = round(row["route_plus_step_us"] - row["route_plain_us"], 2)
            torch.cuda.synchronize()
            g_plain, g_full = graphed(lambda: plain.route(scores)), graphed(full)
            if g_plain is not None and g_full is not None:
                row["route_plain_graph_us"] = med(g_plain, args.reps)
                row["route_plus_step_graph_us"] = med(g_full, args.reps)
                row["qb_overhead_graph_us"] = round(row["route_plus_step_graph_us"] - row["route_plain_graph_us"], 2)
            torch.cuda.synchronize()
            res["rows"].append(row)
            print(row, flush=True)
    cuda_runtime._AVAILABLE = None
    rows = [r for r in res["rows"] if r["E"] == 896 and r["tokens"] == 8192]
    res["target"] = dict(qb_overhead_us_max=100, E=896, tokens=8192,
                         met={f"{r['impl']} {r['dtype']}": r["qb_overhead_us"] <= 100 for r in rows})
    print("target qb_overhead_us <= 100 (E=896, 8192 tokens):", res["target"]["met"], flush=True)
    path = os.path.join(args.out, "balance_gpu_timing.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["study", "cost", "gpu"])
    ap.add_argument("--quick", action="store_true", help="small token counts and fewer steps (smoke run)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--impl", choices=["both", "kernels", "torch"], default="both",
                    help="gpu mode: the fused CuPy kernels, the pure-torch fallback, or both")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    {"study": study, "cost": cost, "gpu": gpu}[args.mode](args)


if __name__ == "__main__":
    main()
