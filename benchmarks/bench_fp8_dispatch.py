"""FP8 dispatch against bf16 dispatch on one GPU, one rank, NVLink backend.

    python3 benchmarks/bench_fp8_dispatch.py --out benchmarks/results/fp8_dispatch_h200.json

Same process, same device, same routing: 4096 tokens, hidden 7168, top-8 of 256 experts by default.
Reported, in microseconds:
* kernels: per-kernel device time of one dispatch from CUDA events around every launch (eager calls);
  ``data_path_us`` is what moves the tokens: the quantiser (fp8 only) plus the dispatch kernels; the routing
  kernels (route_gather, planner) are the same for both and reported apart;
* ``call_graph_us``: a whole ``ep.dispatch`` replayed from a CUDA graph (device time only).
Target: fp8 data path <= 0.65 x bf16 data path.  The JSON records the command, the commit and
the machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ep_gpu import _phases  # noqa: E402
from bench_planner import graph_time  # noqa: E402

import moonep  # noqa: E402
from moonep.bench.provenance import command, git_commit, machine  # noqa: E402

_DATA = ("moonep_quant_wire", "dispatch", "zero", "send", "expand")  # labels of bench_ep_gpu._phases
_ROUTE = ("route_gather", "planner", "layout", "validate", "gather")


def measure(rt, dtype, fp8, x, idx, w, E, iters):
    """One ExpertParallel (bf16 tokens, fp8 or bf16 on the wire): per-kernel and whole-call times [us]."""
    H, (s, K) = x.shape[1], idx.shape
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=dtype,
                               transport="nvlink", zero_copy=True,
                               dispatch_dtype=torch.float8_e4m3fn if fp8 else None)
    with torch.no_grad():
        for _ in range(5):
            ep.dispatch(x, idx, w)
        torch.cuda.synchronize()
        ph = _phases(ep._backend, lambda: ep.dispatch(x, idx, w), iters)
        res = dict(kernels=ph, data_path_us=round(sum(ph.get(k, 0.0) for k in _DATA), 1),
                   routing_us=round(sum(ph.get(k, 0.0) for k in _ROUTE), 1),
                   call_graph_us=round(graph_time(lambda: ep.dispatch(x, idx, w), n=10, reps=7), 1))
        h = ep.dispatch(x, idx, w)
        res["rows"] = int(h.num_rows)
        res["row_bytes"] = (h.tokens.shape[1] + 4 * h.scales.shape[1]) if fp8 else H * x.element_size()
        ep.synchronize()
    ep.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args(argv)
    rt = moonep.init(device="cuda")
    g = torch.Generator().manual_seed(1234)
    s, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x = torch.randn(s, H, generator=g).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]).cuda()
    w = torch.rand(s, K, generator=g).cuda()
    res = {"bf16": measure(rt, torch.bfloat16, False, x, idx, w, E, args.iters),
           "fp8": measure(rt, torch.bfloat16, True, x, idx, w, E, args.iters)}
    res["bf16_again"] = measure(rt, torch.bfloat16, False, x, idx, w, E, args.iters)  # drift shows as spread
    bf = min(res["bf16"]["data_path_us"], res["bf16_again"]["data_path_us"])
    ratio = res["fp8"]["data_path_us"] / bf
    call_ratio = res["fp8"]["call_graph_us"] / min(res["bf16"]["call_graph_us"], res["bf16_again"]["call_graph_us"])
    out = dict(benchmark="fp8_dispatch", command=command(), commit=git_commit(), machine=machine(),
               config=dict(tokens=s, hidden=H, experts=E, topk=K, ranks=1, transport="nvlink", iters=args.iters),
               results=res, fp8_over_bf16_data_path=round(ratio, 3), fp8_over_bf16_call=round(call_ratio, 3),
               target="fp8 data path <= 0.65 x bf16", meets_target=bool(ratio <= 0.65))
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    rt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
