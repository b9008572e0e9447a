"""Micro-benchmark of the NVLink transport: dispatch and combine latency and bandwidth.

    mpirun --allow-run-as-root -n 2 python3 benchmarks/bench_ep_gpu.py --out benchmarks/results

Defaults: 4096 tokens per rank, hidden 7168, bf16 tokens, top-8 of 256 experts (DeepEP's intranode
configuration).  Times are CUDA-event averages over back-to-back iterations (every collective starts with
an entry barrier, so ranks run in lockstep).  Reported per rank and SM budget:

* ``plan_us``: validation + counts all-gather (peer stores) + GPU planner + destinations;
* ``dispatch_us``: send kernel + receiver expand (the plan reused); ``dispatch_full_us`` includes the plan;
* ``combine_us``: local k-ordered reduce + push of one bf16 row per (token, rank) + local rank-order sum;
* logical bandwidth ``s*K*H*2 / t`` (MoonEP/DeepEP v2 convention) and wire bandwidth (bytes that cross
  NVLink: one bf16 row per (token, remote rank) in each direction), and efficiency against the measured
  ~360 GB/s one-way peer-store ceiling (``--ceiling``);
* ``phases_us``: CUDA events around every kernel of full steps (plan, dispatch, combine) run back to back.
  Fused kernels (default): ``route_gather`` (validation + histogram + counts all-gather, one kernel; its
  time includes waiting for the slower peer), ``planner``, ``layout``, ``dispatch`` (send on ``num_sms``
  SMs overlapped with the local expansion on the others, chunk-pipelined), ``zero`` (unwritten rows),
  ``combine`` (reduce + push overlapped with the local rank-order sums), ``gaps`` (GPU idle between
  kernels: launch/Python overhead, small ops).  With ``--fused 0``: ``validate``, ``gather``, ``send``,
  ``expand``, ``reduce_push``, ``sum`` as before;
* ``copy_*``: the same dispatch/combine in copy mode (fresh output tensors) against zero-copy;
* ``*_graph_us``: full dispatch (plan included), combine and the step replayed from CUDA graphs of 10
  calls (``bench_planner.graph_time``, median of 5 replays): device time without the host's launch time
  (what back-to-back eager calls show when the host is the slower side).

``--maxvio 0 1 4`` sweeps routing imbalance with the generator of ``python -m moonep.bench``
(``moonep.bench.routing``: Zipf popularity, exponent bisected to the target) and reports the achieved
maxvio of the global batch; without it, ``--skew`` (a Zipf exponent, 0 = uniform) picks one routing.
The kernel build and the Tuning measured: ``benchmarks/_profile_build.py`` (``--fused``, ``--chunks``,
``--switch``, ``--patch``, ``--lineinfo``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
from pathlib import Path

import torch

import moonep
from moonep.bench.provenance import git_commit
from moonep import ExpertParallel, Tuning

import _profile_build  # noqa: E402  (benchmarks/, this script's directory, is on sys.path)
from bench_planner import graph_time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _routing(s, E, K, skew, gen):
    logits = -skew * torch.log(torch.arange(1, E + 1, dtype=torch.float64)).float().expand(s, E)
    g = -torch.log(-torch.log(torch.rand(s, E, generator=gen).clamp(1e-9, 1 - 1e-9)))
    return (logits + g).topk(K, dim=1).indices


def _time(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters  # microseconds


_PHASES = {"validate": "validate", "moonep_gather": "gather", "planner": "planner", "layout": "layout",
           "moonep_dispatch_send": "send", "moonep_dispatch_expand": "expand",
           "moonep_combine_reduce": "reduce_push", "moonep_combine_sum": "sum", "gap": "gaps",
           "moonep_route_gather": "route_gather", "moonep_dispatch_fused": "dispatch",
           "moonep_dispatch_zero": "zero", "moonep_combine_fused": "combine"}


def phase_sums(eng, step) -> dict:
    """Microseconds per phase of ``step()`` (its calls' kernels grouped by :data:`_PHASES`), from the CUDA
    events the engine records around every launch."""
    torch.cuda.synchronize()
    eng.profile = []
    try:
        step()
        torch.cuda.synchronize()
        marks = eng.profile
    finally:
        eng.profile = None
    acc = {}
    for (_, a), (label, b) in zip(marks, marks[1:]):
        key = _PHASES.get(label, label)
        acc[key] = acc.get(key, 0.0) + a.elapsed_time(b) * 1e3
    return acc


def _phases(eng, step, iters):
    """Per-phase microseconds per step, averaged over ``iters`` steps."""
    acc = phase_sums(eng, lambda: [step() for _ in range(iters)])
    return {k: round(v / iters, 1) for k, v in acc.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--sms", default="16,24,32")
    ap.add_argument("--skew", type=float, default=0.0, help="zipf exponent of expert popularity (0: uniform)")
    ap.add_argument("--maxvio", type=float, nargs="*", default=None,
                    help="sweep target maxvio values (moonep.bench.routing generator), e.g. --maxvio 0 1 4")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--ceiling", type=float, default=360.0, help="one-way peer-store ceiling, GB/s")
    _profile_build.add_args(ap)
    args = ap.parse_args()
    tuning_kw = _profile_build.apply(args)  # the kernel build and Tuning this run measures

    rt = moonep.init()
    R, rank, d = rt.world_size, rt.rank, rt.device
    s, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(s, H, generator=gen).to(torch.bfloat16).to(d)
    routings = []  # (target maxvio or None, idx, w)
    if args.maxvio:
        from moonep.bench.routing import make_routing, zipf_exponent

        for mv in args.maxvio:
            ri, rw = make_routing(s, E, K, zipf_exponent(mv, E, K), seed=1234 + rank, popularity_seed=0)
            routings.append((mv, ri.to(d), rw.to(d)))
    else:
        routings.append((None, _routing(s, E, K, args.skew, gen).to(d), torch.rand(s, K, generator=gen).to(d)))
    rows = []
    sms_list = [int(v) for v in args.sms.split(",")]
    for (mv_target, idx, w), sms in [(r, m) for r in routings for m in sms_list]:
        with ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=torch.bfloat16,
                                   transport="nvlink", zero_copy=True, tuning=Tuning(num_sms=sms, **tuning_kw)) as ep, torch.no_grad():
            eng = ep._backend
            counts = torch.bincount(idx.reshape(-1).cpu(), minlength=E)
            load = sum(ep.transport.all_gather_object(counts)).double()
            mv_achieved = float(load.max() / load.mean() - 1)
            h = ep.dispatch(x, idx, w)
            st = ep._step_of(h).routing
            w32 = w.float().contiguous()
            remote = sum(int(((st.dst_rank == r).any(dim=1)).sum()) for r in range(R) if r != rank)
            local = int(((st.dst_rank == rank).any(dim=1)).sum())
            for _ in range(args.warmup):
                ep.dispatch(x, idx, w)
                eng._combine_rows(h.tokens, h.weights, None, st, torch.bfloat16)
            torch.cuda.synchronize()
            plan_us = _time(lambda: eng.plan_step(x, idx, w), args.iters)
            full_us = _time(lambda: ep.dispatch(x, idx, w), args.iters)
            h = ep.dispatch(x, idx, w)
            st = ep._step_of(h).routing
            disp_us = _time(lambda: eng._dispatch_rows(x, w32, st, True), args.iters)
            h_tokens, h_w = eng.recv, eng.wbuf
            comb_us = _time(lambda: eng._combine_rows(h_tokens, h_w, None, st, torch.bfloat16), args.iters)
            # copy mode: fresh output tensors, the same kernels with the local expansion on the receiver
            ct, cw = eng._dispatch_rows(x, w32, st, False)
            copy_disp_us = _time(lambda: eng._dispatch_rows(x, w32, st, False), args.iters)
            ct, cw = eng._dispatch_rows(x, w32, st, False)
            copy_comb_us = _time(lambda: eng._combine_rows(ct, cw, None, st, torch.bfloat16), args.iters)

            def full_step():
                hh = ep.dispatch(x, idx, w)
                eng._combine_rows(hh.tokens, hh.weights, None, ep._step_of(hh).routing, torch.bfloat16)

            phases = _phases(eng, full_step, args.iters)
            step_us = _time(full_step, args.iters)
            ep.synchronize()
            # the same calls replayed from CUDA graphs: device time, host launch time excluded
            full_graph_us = graph_time(lambda: ep.dispatch(x, idx, w), n=10, reps=5)
            hg = ep.dispatch(x, idx, w)
            comb_graph_us = graph_time(lambda: ep.combine(hg.tokens, hg), n=10, reps=5)
            step_graph_us = graph_time(full_step, n=10, reps=5)
            ep.synchronize()
            logical = s * K * H * 2
            wire = remote * H * 2  # bf16 rows each way (combine partials travel in the token dtype)
            ceil_us = wire / (args.ceiling * 1e3)
            rows.append(dict(rank=rank, sms=sms, maxvio_target=mv_target, maxvio=round(mv_achieved, 3),
                             fused=[n for n in ("route", "dispatch", "combine") if getattr(eng, "fused_" + n)], nnv_dispatch=eng.nnv_dispatch, nnv_combine=eng.nnv_combine,
                             chunks=eng.nch, plan_us=round(plan_us, 1), dispatch_us=round(disp_us, 1),
                             dispatch_full_us=round(full_us, 1), combine_us=round(comb_us, 1),
                             step_us=round(step_us, 1), dispatch_full_graph_us=round(full_graph_us, 1),
                             combine_graph_us=round(comb_graph_us, 1), step_graph_us=round(step_graph_us, 1),
                             copy_dispatch_us=round(copy_disp_us, 1), copy_combine_us=round(copy_comb_us, 1),
                             dispatch_logical_GBps=round(logical / disp_us / 1e3, 1),
                             combine_logical_GBps=round(logical / comb_us / 1e3, 1),
                             dispatch_wire_GBps=round(wire / disp_us / 1e3, 1),
                             combine_wire_GBps=round(wire / comb_us / 1e3, 1),
                             dispatch_efficiency=round(ceil_us / disp_us, 3),
                             dispatch_full_efficiency=round(ceil_us / full_us, 3),
                             combine_efficiency=round(ceil_us / comb_us, 3),
                             phases_us=phases,
                             remote_pairs=remote, local_pairs=local, recv_rows=int(h.num_rows)))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    everything = ep.transport.all_gather_object(rows)
    if rank == 0:
        result = dict(
            benchmark="bench_ep_gpu", time=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            command=os.environ.get("MOONEP_BENCH_COMMAND", " ".join([sys.executable] + sys.argv)),
            launcher=rt.launcher, world_size=R, git_commit=git_commit(), host=socket.gethostname(),
            machine=dict(gpu=torch.cuda.get_device_name(d), gpus=torch.cuda.device_count(), torch=torch.__version__,
                         cuda=torch.version.cuda, python=platform.python_version(),
                         cupy=__import__("cupy").__version__),
            config=dict(tokens=s, hidden=H, experts=E, topk=K, dtype="bfloat16", skew=args.skew, maxvio=args.maxvio,
                        iters=args.iters, warmup=args.warmup, ceiling_GBps=args.ceiling,
                        build=_profile_build.describe(args)),
            results=[r for per_rank in everything for r in per_rank])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = out / f"ep_gpu_R{R}_{stamp}.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    rt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
