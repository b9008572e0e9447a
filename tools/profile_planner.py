"""Device-time breakdown of the GPU planner (issue 3): per-kernel times without host overhead.

    python3 tools/profile_planner.py [--out PATH]

For each (E, R, K) and routing family: ``graph_plan_us`` / ``graph_layout_us`` / ``graph_both_us`` are
N calls captured in ONE CUDA graph and replayed, divided by N (device time per call, no launch gaps);
``eager_*`` are single calls timed with CUDA events as a user makes them; ``host_*`` the Python time of a
call without sync; ``*_fused_*`` the same for ``plan_and_destinations`` (plan and layout in one launch). Run under ``ncu --metrics gpu__time_duration.sum -k regex:moonep`` for kernel times.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_planner import _events, bench_routing, graph_time, host_time, loop_time, machine  # noqa: E402
from moonep import cuda_runtime  # noqa: E402
from moonep.bench.provenance import git_commit  # noqa: E402
from moonep.layout import plan_and_destinations, token_destinations  # noqa: E402
from moonep.planner import plan_balanced  # noqa: E402


CLOCK_NAMES = ("colsum", "total", "sort_psum", "fill_loop", "out_assign", "out_write", "out_rpos", "out_scan",
               "step_receiver", "step_donor_fast", "step_donor_slow", "step_fill", "steps", "out_rlist",
               "out_chunks")
PLAN_STAMPS = ("colsum_total", "sorted", "loop_end", "chunks", "published")
LAYOUT_STAMPS = ("pass1_published", "lower_seen", "plan_seen", "tables", None, "end")


def plan_clocks(counts):
    """Cycles per phase of one plan (the MOONEP_PLAN_CLOCKS build writes them to the hist scratch)."""
    p = plan_balanced(counts)
    torch.cuda.synchronize()
    g = p._geo
    clk = p._ws[g.hist:g.hist + 16].tolist()
    return {name: int(v) for name, v in zip(CLOCK_NAMES, clk) if name}


def fused_timeline(c, rank, tk, reps=20, clocks=True, cold=False):
    """The fused launch's phases (planner.cu TS_MARK, clocks build): µs after the plan block's start, medians
    over reps; per layout phase the latest tile block. Plus the plan block's cycle counters in that launch.
    ``cold``: 512 MiB written before each launch, so L2 holds none of its inputs (as in an EP step, where the
    dispatch and combine before it moved hundreds of MB)."""
    from moonep.planner.cuda import _dev, _geo

    R, E = c.shape
    g = _geo(R, E, c.dtype == torch.int32)
    grid, cfg, _, _ = g.fused_cfg(tk.numel(), rank == 0, _dev(c.get_device()).smem_max)
    P = cfg & 0xFF
    runs = []
    flush = torch.empty(1 << 29, dtype=torch.uint8, device=c.device) if cold else None
    for _ in range(reps):
        if cold:
            flush.fill_(1)
        plan, _, _ = plan_and_destinations(c, rank, tk)
        torch.cuda.synchronize()
        runs.append(plan._ws[g.stamps:g.stamps + 32 * grid].view(grid, 32).cpu().numpy())
    t = np.stack(runs)                      # [reps, block, 32]; block 0 = plan
    base = t[:, 0, 0:1]
    row = {f"plan_{k}_us": float(np.median(t[:, 0, i + 1] - base[:, 0])) / 1e3 for i, k in enumerate(PLAN_STAMPS)}
    tiles = t[:, 1 + P:, :]
    row["tile_start_us"] = float(np.median(tiles[:, :, 0].max(1) - base[:, 0])) / 1e3
    for i, k in enumerate(LAYOUT_STAMPS):
        if k is None:
            continue
        row[f"tile_{k}_us"] = float(np.median(tiles[:, :, i + 1].max(1) - base[:, 0])) / 1e3
    if P:
        row["prefix_end_us"] = float(np.median(t[:, 1:1 + P, 1].max(1) - base[:, 0])) / 1e3
    if clocks:
        clk = t[-1, 0, 16:32].tolist()
        row.update({f"fused_{n}": int(v) for n, v in zip(CLOCK_NAMES, clk) if n})
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default="256,8,8;896,64,16;256,2,8")  # 256,2,8: the 2-GPU runs (epn 128)
    ap.add_argument("--families", default="uniform,zipf1.5,theorem2")
    ap.add_argument("--clocks", action="store_true",
                    help="a profiling build of the plan kernel (-DMOONEP_PLAN_CLOCKS): cycles per phase and per "
                         "part of a fill step, from clock64() on warp 0; timings of this build are not reported")
    ap.add_argument("--stamps", action="store_true",
                    help="a profiling build with only the fused launch's %%globaltimer phase stamps: its timeline")
    ap.add_argument("--cold", action="store_true", help="with --stamps/--clocks: L2 flushed before each launch")
    ap.add_argument("--lineinfo", action="store_true", help="compile with -lineinfo (source lines in ncu)")
    a = ap.parse_args()
    # a profiling build of the planner, before its kernels are first compiled (below)
    cuda_runtime.profile_build(lineinfo=a.lineinfo, MOONEP_PLAN_CLOCKS=int(a.clocks), MOONEP_PLAN_STAMPS=int(a.stamps))
    res = {"command": " ".join([sys.executable] + sys.argv), "commit": git_commit(),
           "machine": machine(), "rows": []}
    for cfg in a.configs.split(";"):
        E, R, K = map(int, cfg.split(","))
        for fam in a.families.split(","):
            tk, c = bench_routing(fam, E, R, K, 4096)
            c, tk = torch.from_numpy(c).cuda(), torch.from_numpy(tk).cuda()
            rank = R - 1
            plan = plan_balanced(c)
            fp = lambda: plan_balanced(c)  # noqa: E731
            fl = lambda: token_destinations(plan, rank, tk)  # noqa: E731
            fb = lambda: token_destinations(plan_balanced(c), rank, tk)  # noqa: E731
            ff = lambda: plan_and_destinations(c, rank, tk)  # noqa: E731  (one launch: moonep_plan_layout)
            for f in (fp, fl, fb, ff):
                f(); f()  # noqa: E702
            if a.clocks or a.stamps:
                row = {"E": E, "R": R, "K": K, "family": fam, **(plan_clocks(c) if a.clocks else {}),
                       **fused_timeline(c, rank, tk, clocks=a.clocks, cold=a.cold), "cold": a.cold}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                continue
            row = {"E": E, "R": R, "K": K, "family": fam,
                   "graph_plan_us": graph_time(fp), "graph_layout_us": graph_time(fl), "graph_both_us": graph_time(fb),
                   "eager_plan_us": _events(fp, 50), "eager_layout_us": _events(fl, 50),
                   "eager_both_us": _events(fb, 50),
                   "host_plan_us": host_time(fp), "host_layout_us": host_time(fl), "host_both_us": host_time(fb),
                   "graph_fused_us": graph_time(ff), "eager_fused_us": _events(ff, 50), "host_fused_us": host_time(ff),
                   "loop_fused_us": loop_time(ff)}
            res["rows"].append(row)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
