"""FP8 dispatch against bf16 dispatch on one GPU, one rank, NVLink backend.

    python3 benchmarks/bench_fp8_dispatch.py --out benchmarks/results/fp8_dispatch_h200.json
    python3 benchmarks/bench_fp8_dispatch.py --switch MOONEP_FP8_WORDS=0 --out ...  # the narrow send fanout

Same process, same device, same routing: 4096 tokens, hidden 7168, top-8 of 256 experts by default.  The
three variants (bf16, fp8, fp8 pre-quantised) are built and warmed up first, then timed interleaved in
``--rounds`` rounds (``rounds``: each round's dispatch_us medians; ``fp8_over_bf16_by_round``), so that the
GPU's clocks coming up during the run reach every variant alike.  Reported, in microseconds:
* kernels: per-kernel device time of one dispatch from CUDA events around every launch (eager calls), the
  median over all timed calls (``kernels_mean``: the mean).  Every timed call is queued behind ~1 ms of GPU
  sleep (``QUEUE_CYCLES``), so that the host launches its kernels while the GPU is busy and the events time
  the kernels alone: launched onto an idle GPU, the event before a kernel is passed at once and the span
  also holds the host's launch call (``dispatch_us_launch_bound``, timed in the same rounds: how earlier
  versions of this bench measured).  The fp8 dispatch quantises inside the dispatch
  kernels, so ``quantiser_kernels`` lists any separate quantiser launch (none expected);
* ``dispatch_us``: what moves the tokens, the dispatch kernels plus any quantiser; the routing kernels
  (route_gather, planner) are the same for both and reported apart (``routing_us``);
* ``call_graph_us``: a whole ``ep.dispatch`` replayed from a CUDA graph (device time only);
* ``fp8_prequantised``: the same fp8 dispatch given the pair ``quantize_fp8(x)``, whose wire rows the kernels
  move as bytes: the same bytes as the fused path without the quantisation in the send (the pair's packing
  into wire rows is a torch copy outside the dispatch kernels, in ``call_graph_us`` only).
* ``torch_gather_*``, ``torch_fill_*`` (``device_us``): torch kernels storing the same bytes in the same rounds
  (:func:`references`), the reference for what the dispatch kernels could reach.
Target: fp8 ``dispatch_us`` <= 0.65 x bf16 ``dispatch_us``.  The fp8 rows received are also checked bitwise
against ``moonep.quant.quantize_fp8`` of the token each row holds (``fp8_rows_bitwise``).  The JSON records
the command, the commit, the machine and, in its config, the send fanout the "ep" program was compiled with
(``fp8_fanout``, ``fp8_words``: ``MOONEP_FP8_WORDS``; ``ep_defines``: its compile-time switches;
csrc/common.cuh).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _profile_build  # noqa: E402
from bench_ep_gpu import phase_sums  # noqa: E402
from bench_planner import graph_time  # noqa: E402

import moonep  # noqa: E402
from moonep import cuda_runtime  # noqa: E402
from moonep.fp8 import pack_pair  # noqa: E402
from moonep.bench.provenance import command, git_commit, machine  # noqa: E402
from moonep.quant import quantize_fp8  # noqa: E402

_DISPATCH = ("dispatch", "zero", "send", "expand")  # labels of bench_ep_gpu._PHASES
_ROUTE = ("route_gather", "planner", "layout", "validate", "gather")


def _median(v) -> float:
    return round(float(np.median(v)), 1)


def _medians(per):
    """{label: [us per call]} -> ({label: median}, {label: mean}), rounded to 0.1 us."""
    med = {k: _median(v) for k, v in per.items()}
    mean = {k: round(float(np.mean(v)), 1) for k, v in per.items()}
    return med, mean


def _dispatch_us(kernels) -> float:
    """What moves the tokens in one call: the dispatch kernels plus any separate quantiser."""
    return round(sum(v for k, v in kernels.items() if k in _DISPATCH or "quant" in k), 1)


# GPU cycles of sleep queued before every timed call (~1 ms): the host then launches the call's kernels while
# the GPU is still busy, so the events around a launch time the kernel, not the host's launch call as well.
QUEUE_CYCLES = 2_000_000


def _queued(fn):
    """``fn`` behind :data:`QUEUE_CYCLES` of GPU sleep."""
    def step():
        torch.cuda._sleep(QUEUE_CYCLES)
        return fn()
    return step


def _device_us(fn) -> float:
    """Device time [us] of one ``fn()`` between two CUDA events, queued behind a sleep (see QUEUE_CYCLES)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(QUEUE_CYCLES)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def references(x, idx):
    """{name: fn}: torch kernels moving the bytes a dispatch stores, timed in the same rounds as the dispatches.
    ``torch_gather_*``: ``torch.index_select`` of the token rows (bf16) or the fp8 wire rows into the ``s * K``
    rows in expert order (each row read per copy, stored once); ``torch_fill_*``: ``zero_()`` of those ``s * K``
    rows, the store-only rate of the memory system for the same bytes."""
    s, K = idx.shape
    tok = (torch.argsort(idx.flatten(), stable=True) // K).to(x.device)
    wire = pack_pair(*quantize_fp8(x))  # uint8 [s, wire_bytes(H)]
    out_bf16 = torch.empty(s * K, x.shape[1], dtype=x.dtype, device=x.device)
    out_wire = torch.empty(s * K, wire.shape[1], dtype=wire.dtype, device=x.device)
    return {"torch_gather_bf16": lambda: torch.index_select(x, 0, tok, out=out_bf16),
            "torch_gather_wire": lambda: torch.index_select(wire, 0, tok, out=out_wire),
            "torch_fill_bf16": out_bf16.zero_, "torch_fill_wire": out_wire.zero_}


def _check_fp8_rows(ep, h, x) -> bool:
    """Every used row of an fp8 dispatch on one rank holds the wire row of its token (codes and scale bits of
    quantize_fp8), every other row zeros."""
    st = ep._step_of(h).routing
    q, sc = quantize_fp8(x)
    rf = st.row_first.long()
    used = rf >= 0
    tok = st.src.long()[rf[used]]  # src = src_rank * S + token: rank 0 here
    codes, scales = h.tokens.view(torch.uint8), h.scales
    ok = torch.equal(codes[used], q.view(torch.uint8)[tok])
    ok = ok and torch.equal(scales[used].view(torch.int32), sc.view(torch.int32)[tok])
    ok = ok and not bool(codes[~used].any()) and not bool(scales[~used].view(torch.int32).any())
    return bool(ok)


def _fanout() -> dict:
    """The fp8 send fanout of this process's "ep" program (``--switch MOONEP_FP8_WORDS=N``), and what reached
    the compile options."""
    defines = [o for o in cuda_runtime.compile_options("ep") if o.startswith("-D")]
    words = [int(o.split("=", 1)[1]) for o in defines if o.startswith("-DMOONEP_FP8_WORDS=")]
    words = words[0] if words else 4  # csrc/common.cuh's default
    return dict(fp8_fanout="narrow" if words == 0 else f"16-channel, {words} words per lane in flight",
                fp8_words=words, ep_defines=defines)


def expert_parallel(rt, dtype, fp8, x, idx, E):
    """The benchmark's ExpertParallel for tokens ``x [s, H]`` and choices ``idx [s, K]`` (NVLink, zero copy; fp8
    or the token dtype on the wire)."""
    H, (s, K) = x.shape[1], idx.shape
    return moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=dtype,
                                 transport="nvlink", zero_copy=True,
                                 dispatch_dtype=torch.float8_e4m3fn if fp8 else None)


# name: (fp8 on the wire, the input given as the pre-quantised pair)
VARIANTS = {"bf16": (False, False), "fp8": (True, False), "fp8_prequantised": (True, True)}


def measure(rt, x, idx, w, E, iters, rounds):
    """Every variant of :data:`VARIANTS` on its own ExpertParallel (bf16 tokens), all built and warmed up first,
    then timed in ``rounds`` interleaved rounds of ``iters // rounds`` calls each, so that a drift of the GPU's
    clocks during the run reaches every variant alike, and with them the torch gathers of the same bytes
    (:func:`references`: ``device_us``).  Returns ({variant: per-kernel and
    whole-call times [us], rows, row bytes, the fp8 rows' check}, [per round: {variant: median us}])."""
    eps, inputs, per, launch_bound = {}, {}, {}, {}
    for name, (fp8, pre) in VARIANTS.items():
        eps[name] = expert_parallel(rt, torch.bfloat16, fp8, x, idx, E)
        inputs[name] = quantize_fp8(x) if pre else x
        per[name], launch_bound[name] = {}, []
    refs = references(x, idx)
    per.update({name: {} for name in refs})
    n = max(1, iters // rounds)  # calls per variant and round
    by_round = []
    with torch.no_grad():
        for name, ep in eps.items():
            for _ in range(5):
                ep.dispatch(inputs[name], idx, w)
        for fn in refs.values():
            fn()
        torch.cuda.synchronize()
        for _ in range(rounds):
            this = {}
            for name, ep in eps.items():
                call = lambda: ep.dispatch(inputs[name], idx, w)  # noqa: E731
                calls = [phase_sums(ep._backend, _queued(call)) for _ in range(n)]
                for c in calls:
                    for k, v in c.items():
                        per[name].setdefault(k, []).append(v)
                this[name] = _median([_dispatch_us(c) for c in calls])
                # the same calls launched onto an idle GPU, as earlier versions of this bench timed them
                idle = [_dispatch_us(phase_sums(ep._backend, call)) for _ in range(n)]
                launch_bound[name] += idle
                this[name + "_launch_bound"] = _median(idle)
            for name, fn in refs.items():
                ts = [_device_us(fn) for _ in range(n)]
                per[name].setdefault("device", []).extend(ts)
                this[name] = _median(ts)
            by_round.append(this)
        res = {}
        for name, ep in eps.items():
            med, mean = _medians(per[name])
            xin = inputs[name]
            r = dict(kernels=med, kernels_mean=mean, quantiser_kernels=sorted(k for k in med if "quant" in k),
                     dispatch_us=_dispatch_us(med), dispatch_us_launch_bound=_median(launch_bound[name]),
                     routing_us=round(sum(med.get(k, 0.0) for k in _ROUTE), 1),
                     call_graph_us=round(graph_time(lambda: ep.dispatch(xin, idx, w), n=10, reps=7), 1))
            h = ep.dispatch(xin, idx, w)
            r["rows"] = int(h.num_rows)
            r["row_bytes"] = h.tokens.stride(0) * h.tokens.element_size()
            if VARIANTS[name][0]:
                r["fp8_rows_bitwise"] = _check_fp8_rows(ep, h, x)
            ep.synchronize()
            res[name] = r
    for name in refs:
        res[name] = dict(device_us=_medians(per[name])[0]["device"])
    for ep in eps.values():
        ep.close()
    return res, by_round


def add_problem_args(ap) -> None:
    """The problem's command-line arguments (also tools/profile_fp8_dispatch.py's)."""
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)


def problem(args):
    """``(x bf16 [s, H], topk_idx int64 [s, K], topk_weights float32 [s, K])`` on CUDA, from a fixed seed:
    uniform random top-K choices of ``args.experts``."""
    g = torch.Generator().manual_seed(1234)
    s, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x = torch.randn(s, H, generator=g).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]).cuda()
    return x, idx, torch.rand(s, K, generator=g).cuda()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_problem_args(ap)
    ap.add_argument("--iters", type=int, default=60, help="timed calls per variant")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds the calls are split into")
    ap.add_argument("--out", help="JSON file to write")
    _profile_build.add_args(ap, tuning=False)  # the bench sets its own Tuning
    args = ap.parse_args(argv)
    _profile_build.apply(args)  # the kernel build measured (--switch MOONEP_FP8_WORDS=0, --patch...)
    rt = moonep.init(device="cuda")
    s, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x, idx, w = problem(args)
    res, by_round = measure(rt, x, idx, w, E, args.iters, args.rounds)
    bf = res["bf16"]["dispatch_us"]
    ratio = res["fp8"]["dispatch_us"] / bf
    call_ratio = res["fp8"]["call_graph_us"] / res["bf16"]["call_graph_us"]
    fused = not res["fp8"]["quantiser_kernels"]
    round_ratios = [round(r["fp8"] / r["bf16"], 3) for r in by_round]
    out = dict(benchmark="fp8_dispatch", command=command(), commit=git_commit(), machine=machine(),
               config=dict(tokens=s, hidden=H, experts=E, topk=K, ranks=1, transport="nvlink", iters=args.iters,
                           rounds=args.rounds, build=_profile_build.describe(args), **_fanout()),
               results=res, rounds=by_round, fp8_over_bf16_by_round=round_ratios,
               fp8_over_bf16_by_round_launch_bound=[round(r["fp8_launch_bound"] / r["bf16_launch_bound"], 3)
                                                    for r in by_round],
               fp8_over_bf16_dispatch=round(ratio, 3), fp8_over_bf16_call=round(call_ratio, 3),
               fp8_over_bf16_dispatch_launch_bound=round(res["fp8"]["dispatch_us_launch_bound"]
                                                         / res["bf16"]["dispatch_us_launch_bound"], 3),
               prequantised_over_bf16_dispatch=round(res["fp8_prequantised"]["dispatch_us"] / bf, 3),
               torch_gather_wire_over_bf16=round(res["torch_gather_wire"]["device_us"]
                                                 / res["torch_gather_bf16"]["device_us"], 3),
               torch_fill_wire_over_bf16=round(res["torch_fill_wire"]["device_us"]
                                               / res["torch_fill_bf16"]["device_us"], 3),
               quantisation_fused=fused, fp8_rows_bitwise=res["fp8"]["fp8_rows_bitwise"],
               target="fp8 dispatch (quantisation included) <= 0.65 x bf16 dispatch",
               meets_target=bool(ratio <= 0.65 and fused and res["fp8"]["fp8_rows_bitwise"]))
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    rt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
