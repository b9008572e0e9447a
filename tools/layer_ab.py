"""Paired A/B in one process: an older moonep against the working tree, step by step.

    python3 tools/layer_ab.py --old .old --out ab.json            # .old holds moonep/ and csrc/ of the older commit
    python3 tools/layer_ab.py --old .old --device cpu --out ab.json   # no GPU: a small host-bound shape
    python3 tools/layer_ab.py --old .old --steps 50 --entries 200 --out ab.json  # + host time per entry point

The older tree is copied under the name ``moonep_old`` (its imports and its ``moonep::`` op namespace renamed),
so both libraries live in one process on one device.  Each iteration runs one eager ``LatentMoE`` step
(forward + backward, the configuration of tools/time_ep.py) of each, in alternating order; then, in a second
phase, each iteration runs 20 one-rank eager dispatches and combines of each (no_grad, 4096 x 7168 bf16,
top-8 of 256); in a third (CUDA), one replay of a CUDA graph of 10 such dispatches and one of 10 combines.
Host-bound steps vary by 20-30% between processes on a shared machine; within one process, paired, the
per-iteration ratio holds still.

Reported per version: medians of the step's host time (until backward() returned), of its wall time (until
the device finished) and of its device time (CUDA events); and the median of the per-iteration ratio
new / old with its 25th and 75th percentiles.  The first step's outputs and gradients are compared bitwise.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def renamed_copy(tree: Path, dest: Path) -> str:
    """Copy ``tree/moonep`` to ``dest/moonep_old`` (and ``tree/csrc`` beside it), renaming the package's absolute
    imports and its op namespace; returns the older commit (``tree/COMMIT`` if present)."""
    shutil.copytree(tree / "moonep", dest / "moonep_old")
    shutil.copytree(tree / "csrc", dest / "csrc")
    subs = [(r'"moonep::', '"moonep_old::'), (r'Library\("moonep"', 'Library("moonep_old"'),
            (r"torch\.ops\.moonep\b", "torch.ops.moonep_old"), (r"(?m)^(\s*)from moonep\.", r"\1from moonep_old."),
            (r"(?m)^(\s*)from moonep import", r"\1from moonep_old import"),
            (r"(?m)^(\s*)import moonep$", r"\1import moonep_old as moonep")]
    for p in (dest / "moonep_old").rglob("*.py"):
        s = p.read_text()
        for a, b in subs:
            s = re.sub(a, b, s)
        p.write_text(s)
    c = tree / "COMMIT"
    if tree == ROOT:
        return f"{_commit()} (the tree itself, renamed: an A/A check of this benchmark)"
    return c.read_text().strip() if c.exists() else str(tree)


def quantiles(v: list) -> dict:
    q = statistics.quantiles(v, n=4)
    return {"median": round(statistics.median(v), 4), "p25": round(q[0], 4), "p75": round(q[2], 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="a folder holding the older moonep/ and csrc/")
    ap.add_argument("--steps", type=int, default=200, help="paired iterations (default 200)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a small host-bound shape (the layer and calls' own host time, no GPU needed)")
    ap.add_argument("--entries", type=int, default=0, metavar="N",
                    help="then N more paired layer steps with host timers around the step's entry points (dispatch, "
                         "the pool's fetch, each expert GEMM, combine, routing, shared experts; the backward): "
                         "where the difference per step sits, per call")
    ap.add_argument("--profile", default=None, help="path prefix: then 20 steps of each under cProfile "
                    "({prefix}_old.pstats, {prefix}_new.pstats)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="moonep_ab_"))
    old_commit = renamed_copy(Path(args.old).resolve(), tmp)
    sys.path.insert(0, str(tmp))
    import torch

    import moonep
    import moonep.layers
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_planner import loop_time  # n back-to-back calls between two CUDA events (after one more)
    import moonep_old
    import moonep_old.layers

    libs = {"old": moonep_old, "new": moonep}
    cuda = args.device == "cuda"
    # (layer: d_model, d_latent, experts, top-k, d_expert, tokens, dtype; comm: experts, top-k, hidden, tokens, dtype)
    layer_cfg = (2048, 1024, 64, 6, 768, 4096, torch.bfloat16) if cuda else (64, 32, 16, 4, 32, 64, torch.float32)
    comm_cfg = (256, 8, 7168, 4096, torch.bfloat16) if cuda else (8, 2, 16, 24, torch.float64)
    rts = {k: lib.init(device=args.device) for k, lib in libs.items()}
    layers, eps = {}, {}
    for k, lib in libs.items():
        torch.manual_seed(0)
        *dims, T, dt = layer_cfg
        layers[k] = lib.layers.LatentMoE(*dims, group=rts[k], max_tokens=T, dtype=dt, device=rts[k].device)
        E, K, H, S, dt = comm_cfg
        eps[k] = lib.ExpertParallel(rts[k], num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=dt,
                                    **(dict(transport="nvlink", zero_copy=True) if cuda else {}))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(layer_cfg[5], layer_cfg[0], generator=g).to(args.device, layer_cfg[6]) for _ in range(8)]
    E, K, H, S, dt = comm_cfg
    xd = torch.randn(S, H, generator=g).to(args.device, dt)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).to(args.device)
    wd = torch.rand(S, K, generator=g).to(args.device)

    def layer_step(k, x):
        """``(y, host ms until backward() returned, of which the forward's, wall ms, device ms)``."""
        m = layers[k]
        m.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        y = m(x)
        fwd = time.perf_counter() - t0
        y.float().square().sum().backward()
        host = time.perf_counter() - t0
        if not cuda:  # host time is all there is
            return y, host * 1e3, fwd * 1e3, host * 1e3, host * 1e3
        b.record()
        b.synchronize()
        return y, host * 1e3, fwd * 1e3, (time.perf_counter() - t0) * 1e3, a.elapsed_time(b)

    def comm_calls(k, n=20):  # n back-to-back eager calls of each, no_grad: microseconds per call
        ep = eps[k]
        out = {}
        with torch.no_grad():
            hs = [None]  # the last dispatch's handle only: each call frees the one before, inside the timing
            for name, fn in (("dispatch_us", lambda: hs.__setitem__(0, ep.dispatch(xd, idx, wd))),
                             ("combine_us", lambda: ep.combine(hs[0].tokens, hs[0]))):
                if not cuda:
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fn()
                    out[name] = (time.perf_counter() - t0) * 1e6 / n
                    continue
                out[name] = loop_time(fn, n)
        return out

    # bitwise: the first step of each from the same weights and input
    first = {k: layer_step(k, xs[0])[0] for k in libs}
    same = torch.equal(first["old"], first["new"]) and all(
        (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
        for p, q in zip(layers["old"].parameters(), layers["new"].parameters()))
    rec = {k: {"host_ms": [], "forward_host_ms": [], "wall_ms": [], "device_ms": [], "dispatch_us": [],
               "combine_us": []} for k in libs}
    # Two phases, each paired: the layer steps, then the dispatch/combine calls.  Interleaved, the calls'
    # handles would die between two layer steps, and the tree's step registry (which drops dead steps when
    # the next one is stored) would free them inside the next layer step's dispatch: a cost of this
    # benchmark's own calls that a training loop does not pay, charged to the layer.
    for i in range(args.warmup):
        for k in libs:
            layer_step(k, xs[i % len(xs)])
    for i in range(args.steps):
        for k in (("old", "new") if i % 2 == 0 else ("new", "old")):
            _, host, fwd, wall, dev = layer_step(k, xs[i % len(xs)])
            for name, v in (("host_ms", host), ("forward_host_ms", fwd), ("wall_ms", wall), ("device_ms", dev)):
                rec[k][name].append(v)
    for i in range(args.warmup):
        for k in libs:
            comm_calls(k, 2)
    for i in range(args.steps):
        for k in (("old", "new") if i % 2 == 0 else ("new", "old")):
            for name, v in comm_calls(k).items():
                rec[k][name].append(v)
    if cuda:  # third phase: the same calls replayed from CUDA graphs (their device work alone), paired
        graphs = {k: replay_graphs(eps[k], xd, idx, wd) for k in libs}
        for i in range(args.steps):
            for k in (("old", "new") if i % 2 == 0 else ("new", "old")):
                for name, g in graphs[k][0].items():
                    rec[k].setdefault(name, []).append(replay_us(g, 10))
    result = {
        "benchmark": "tools/layer_ab.py (an older moonep and the tree in one process, paired per iteration)",
        "command": "python3 tools/layer_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "old": old_commit, "new": _commit(),
        "machine": machine(),
        "config": {"device": args.device,
                   "layer": "LatentMoE({}, {}, {} experts, top-{}, d_expert {}), {} tokens, {}, forward+backward, "
                            "1 rank".format(*layer_cfg),
                   "comm": "ExpertParallel {3} x {2} {4}, top-{1} of {0}, {5}, no_grad, 20 back-to-back eager "
                           "calls ({6})".format(*comm_cfg, "nvlink, zero_copy" if cuda else "one CPU rank",
                                                "CUDA events" if cuda else "wall clock"),
                   "steps": args.steps, "warmup": args.warmup,
                   "order": "the layer steps, then the calls; each old-new, then new-old, alternating"},
        "first_step_bitwise_equal": bool(same),
        "median": {k: {m: round(statistics.median(v), 4) for m, v in r.items()} for k, r in rec.items()},
        "new_over_old": {m: quantiles([n / o for n, o in zip(rec["new"][m], rec["old"][m])]) for m in rec["new"]},
        "per_iteration": {k: {m: [round(v, 4) for v in vs] for m, vs in r.items()} for k, r in rec.items()},
    }
    if args.entries:  # last: the timers themselves cost host time, in both libraries alike
        result["entries"] = entry_times(libs, layer_step, xs, args.entries)
        result["config"]["entries"] = ("host µs per call, medians over the paired steps with timers (the wrapped "
                                       "functions' own time, callees included); backward: per step")
    print(json.dumps({k: result[k] for k in ("first_step_bitwise_equal", "median", "new_over_old")}, indent=1))
    if "entries" in result:
        print(json.dumps(result["entries"], indent=1))
    if args.profile:
        import cProfile

        for k in libs:
            pr = cProfile.Profile()
            pr.enable()
            for i in range(20):
                layer_step(k, xs[i % len(xs)])
            pr.disable()
            pr.dump_stats(f"{args.profile}_{k}.pstats")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for k in libs:
        eps[k].close()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def replay_graphs(ep, x, idx, w, n: int = 10) -> tuple:
    """``({name: graph}, h)``: CUDA graphs of ``n`` no-grad dispatches and of ``n`` combines of the step ``h``
    (captured after a warm-up call on a side stream, as benchmarks/bench_planner.py's ``graph_time``).  The
    combine graph reads ``h``'s device tables by address: keep ``h`` while it is replayed."""
    import torch

    out, hs = {}, [None]
    with torch.no_grad():
        for name, fn in (("dispatch_graph_us", lambda: ep.dispatch(x, idx, w)),
                         ("combine_graph_us", lambda: ep.combine(hs[0].tokens, hs[0]))):
            hs[0] = ep.dispatch(x, idx, w)  # (zero-copy rows: valid until the next dispatch)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = out[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(n):
                    fn()
            g.replay()
        torch.cuda.synchronize()
    return out, hs[0]


def replay_us(g, n: int) -> float:
    """Device µs per call of one replay of ``g`` (``n`` calls), between two CUDA events."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / n


ENTRIES = (("dispatch", "ExpertParallel", "dispatch"), ("fetch", "ReplicaPool", "fetch"),
           ("expert_matmul", None, "expert_matmul"), ("combine", "ExpertParallel", "combine"),
           ("routing", "LatentMoE", "_select"), ("shared", "LatentMoE", "shared"),
           ("experts", "LatentExperts", "forward"), ("forward", "LatentMoE", "forward"))


def entry_times(libs: dict, layer_step, xs, steps: int) -> dict:
    """Host µs per call of the layer step's entry points (:data:`ENTRIES`), old and new, over ``steps``
    paired steps: each function is replaced by a timed wrapper (the layer module's name for ``expert_matmul``).
    """
    import importlib

    acc = {k: {name: [] for name, _, _ in ENTRIES} | {"backward": []} for k in libs}
    cur = [None]

    def timed(fn, name):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[cur[0]][name].append((time.perf_counter() - t0) * 1e6)
        return call

    for k, lib in libs.items():
        mod = importlib.import_module(lib.__name__ + ".layers.latent_moe")
        for name, cls, attr in ENTRIES:
            owner = mod if cls is None else getattr(lib, cls, None) or getattr(mod, cls)
            setattr(owner, attr, timed(getattr(owner, attr), name))
    for i in range(steps):
        for k in (("old", "new") if i % 2 == 0 else ("new", "old")):
            cur[0] = k
            _, host, fwd, _, _ = layer_step(k, xs[i % len(xs)])
            acc[k]["backward"].append((host - fwd) * 1e3)
    out = {}
    for name in acc["new"]:
        o, n = acc["old"][name], acc["new"][name]
        mo, mn = statistics.median(o), statistics.median(n)
        out[name] = {"old_us": round(mo, 1), "new_us": round(mn, 1), "new_minus_old_us": round(mn - mo, 1),
                     "calls_per_step": len(n) // steps}
    return out


def _commit() -> str:
    sys.path.insert(0, str(ROOT))
    from moonep.bench.provenance import git_commit

    return git_commit()


def machine() -> dict:
    from moonep.bench.provenance import machine as m

    return m()


if __name__ == "__main__":
    raise SystemExit(main())
