"""A fixed number of dispatch calls on one GPU, one rank, NVLink backend, for ncu to profile one of them.

    ncu --set full -k regex:moonep_dispatch_fused --launch-skip 5 -c 1 -o rep \
        python3 tools/profile_fp8_dispatch.py --wire fp8

The configuration of benchmarks/bench_fp8_dispatch.py (4096 tokens, hidden 7168, top-8 of 256, bf16 tokens),
with one wire format per process (``--wire``: bf16, fp8, or fp8_pre for the pre-quantised pair), so that a
report holds one kernel of known kind: the fp8 dispatch's source-level stalls against the bf16 one's.
"""
from __future__ import annotations

import argparse

import torch

import moonep
from moonep.quant import quantize_fp8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wire", choices=("bf16", "fp8", "fp8_pre"), default="fp8")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--calls", type=int, default=8)
    a = ap.parse_args(argv)
    rt = moonep.init(device="cuda")
    g = torch.Generator().manual_seed(1234)
    s, H, E, K = a.tokens, a.hidden, a.experts, a.topk
    x = torch.randn(s, H, generator=g).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]).cuda()
    w = torch.rand(s, K, generator=g).cuda()
    fp8 = a.wire != "bf16"
    xin = quantize_fp8(x) if a.wire == "fp8_pre" else x
    with moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=torch.bfloat16,
                               transport="nvlink", zero_copy=True,
                               dispatch_dtype=torch.float8_e4m3fn if fp8 else None) as ep, torch.no_grad():
        for _ in range(a.calls):
            ep.dispatch(xin, idx, w)
        ep.synchronize()
    rt.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
