"""Host time of ``ExpertParallel.dispatch`` / ``combine`` on the NVLink transport, and where it goes
(cProfile), one rank per GPU:

    mpirun --allow-run-as-root -n 1 python3 tools/host_profile_ep.py [--out DIR]

Also the host time of one dispatch + combine, eager and replayed from a CUDA graph.  For another version of
the library, put its ``moonep`` package first on ``PYTHONPATH`` (the JSON records the commit it names).

Back-to-back GPU timings are the larger of the GPU time and this host time per call.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

import moonep
from moonep.bench.provenance import git_commit, machine
from moonep.ep import ExpertParallel
from tests.harness.cuda_graph import capture


def host_us(fn, n=60, k=5):
    best = 1e9
    for _ in range(k):
        torch.cuda.synchronize()
        a = time.perf_counter_ns()
        for _ in range(n):
            fn()
        b = time.perf_counter_ns()
        torch.cuda.synchronize()
        best = min(best, (b - a) / n / 1e3)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--out", default=None)
    ap.add_argument("--library", default="", help="which library version this run used (recorded in the JSON)")
    a = ap.parse_args()
    rt = moonep.init()
    s, H, E, K = a.tokens, a.hidden, 256, 8
    g = torch.Generator().manual_seed(rt.rank)
    x = torch.randn(s, H, generator=g).to(torch.bfloat16).to(rt.device)
    idx = torch.rand(s, E, generator=g).topk(K, dim=1).indices.to(rt.device)
    w = torch.rand(s, K, generator=g).to(rt.device)
    res = {}
    with ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=torch.bfloat16,
                        transport="nvlink", zero_copy=True) as ep, torch.no_grad():
        h = ep.dispatch(x, idx, w)
        for _ in range(10):
            h = ep.dispatch(x, idx, w)
            ep.combine(h.tokens, h)
        ep.synchronize()
        res["dispatch_host_us"] = round(host_us(lambda: ep.dispatch(x, idx, w)), 1)
        h = ep.dispatch(x, idx, w)
        res["combine_host_us"] = round(host_us(lambda: ep.combine(h.tokens, h)), 1)
        # the backend that plans each step (its attribute name differs between versions of ep.py)
        eng = next(b for b in (getattr(ep, n, None) for n in ("backend", "_backend", "_engine")) if b is not None)
        res["plan_step_host_us"] = round(host_us(lambda: eng.plan_step(x, idx, w)), 1)
        # the layers of an eager no-grad dispatch, where the version has them: the op (its dispatcher pass and
        # kernel), the op's body, and the call with Python's garbage collector off
        if hasattr(torch.ops.moonep, "dispatch") and hasattr(ep, "_dispatch_body"):
            op = torch.ops.moonep.dispatch.default
            args = (x, idx, w, None, -1, ep.op_id, ep.capacity, ep.num_experts, ep.world_size,
                    eng.token_state_words, ep.fp8, ep.dtype, False, 0)
            res["dispatch_op_host_us"] = round(host_us(lambda: op(*args)), 1)
            res["dispatch_body_host_us"] = round(host_us(lambda: ep._dispatch_body(x, idx, w, None, -1, 0, False)), 1)
        import gc
        gc.disable()
        res["dispatch_host_us_gc_off"] = round(host_us(lambda: ep.dispatch(x, idx, w)), 1)
        gc.enable()
        res["dispatch_host_us_again"] = round(host_us(lambda: ep.dispatch(x, idx, w)), 1)

        def step():  # one dispatch + combine, eager and then replayed from a CUDA graph
            hs = ep.dispatch(x, idx, w)
            return ep.combine(hs.tokens, hs)

        res["step_eager_host_us"] = round(host_us(step), 1)
        graph, _ = capture(step)
        res["step_graph_replay_host_us"] = round(host_us(graph.replay), 1)
        graph.reset()
        hh = {}
        for name, fn in (("dispatch", lambda: ep.dispatch(x, idx, w)), ("combine", lambda: ep.combine(hh["h"].tokens, hh["h"]))):
            hh["h"] = ep.dispatch(x, idx, w)  # a zero-copy view is valid until the next dispatch
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            for _ in range(60):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
            res[f"{name}_profile"] = buf.getvalue()
        # the GPU side of 20 back-to-back dispatches: every kernel (name, count, total device time) and
        # the wall time they took (wall - busy = the GPU's idle time between kernels)
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter_ns()
            for _ in range(20):
                ep.dispatch(x, idx, w)
            torch.cuda.synchronize()
            t1 = time.perf_counter_ns()
        rows = []
        for ev in prof.key_averages():
            if ev.self_device_time_total > 0:
                rows.append((ev.key[:70], ev.count, round(ev.self_device_time_total / 20, 2)))
        rows.sort(key=lambda r: -r[2])
        res["dispatch_wall_us"] = round((t1 - t0) / 20 / 1e3, 1)
        res["dispatch_gpu_kernels_us_per_call"] = rows[:25]
        cpu = [(ev.key[:70], round(ev.count / 20, 2), round(ev.self_cpu_time_total / 20, 2))
               for ev in prof.key_averages() if ev.self_cpu_time_total > 0]
        cpu.sort(key=lambda r: -r[2])
        res["dispatch_cpu_ops_us_per_call"] = cpu[:30]
        ep.synchronize()
    if rt.rank == 0:
        print(json.dumps({k: v for k, v in res.items() if not k.endswith("profile")}, indent=0))
        for k in ("dispatch_profile", "combine_profile"):
            print(f"==== {k}\n" + res[k][:6000])
        if a.out:
            res.update(benchmark="host_profile_ep", git_commit=git_commit(), library=a.library or "the tree",
                       moonep_path=os.path.dirname(moonep.__file__),
                       machine=machine(), world_size=rt.world_size,
                       command=" ".join(sys.argv))
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / "host_profile_ep.json").write_text(json.dumps(res, indent=1))
    rt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
