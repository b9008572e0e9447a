"""Host time of one hot ``plan_and_destinations`` call at (E, R, K) = (256, 8, 8), and of its parts (GPU only).

    python3 tools/host_breakdown.py     -> JSON on stdout (us per call; min over 7 batches of 200 calls,
                                             few enough that the launch queue never fills)
"""
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from moonep.layout import plan_and_destinations  # noqa: E402
from moonep.planner import cuda as pc  # noqa: E402
from tests.harness.planner_corpus import counts_from_topk, routing  # noqa: E402


def t(f, n=200, k=7):
    """min over k batches of n calls (n small enough that the launch queue never fills: host time only)"""
    best = 1e9
    for _ in range(k):
        torch.cuda.synchronize(); a = time.perf_counter_ns()
        for _ in range(n): f()
        b = time.perf_counter_ns(); torch.cuda.synchronize()
        best = min(best, (b - a) / n / 1e3)
    return best


E, R, K = 256, 8, 8
rt = routing("uniform", E, R, K, 4096)
tk = torch.from_numpy(rt[R - 1]).cuda()
c = torch.from_numpy(counts_from_topk(rt, E)).cuda()
rank = R - 1
plan_and_destinations(c, rank, tk); plan_and_destinations(c, rank, tk)
key = (0, c.shape, c.dtype, 0.0, tk.shape, tk.dtype, rank, 1)
f = pc._FUSED_FAST[key]
fn, grid, block, smem, streams, words, device, sk, geo, mid, tail, arg, keep, dev = f
n = sk[0] * sk[1]
buf = torch.empty(words + 2 * n, dtype=torch.int64, device=device)
st = streams.get(pc._cur_stream(0))
p = buf.data_ptr()
args = (arg(c.data_ptr()), arg(p)) + mid + (arg(tk.data_ptr()), arg(p + 8 * words)) + tail + (arg(5),)
res = {
 "full_call": t(lambda: plan_and_destinations(c, rank, tk)),
 "plan_layout_fast": t(lambda: pc.plan_layout_fast(c, 0.0, rank, tk, 1)),
 "empty_buf": t(lambda: torch.empty(words + 2 * n, dtype=torch.int64, device=device)),
 "key_lookup": t(lambda: pc._FUSED_FAST.get((0, c.shape, c.dtype, 0.0, tk.shape, tk.dtype, rank, 1))),
 "cupy_launch_prebuilt_args": t(lambda: fn(grid, block, args, smem, st)),
 "as_strided_x2": t(lambda: (buf.as_strided(sk, (sk[1], 1), words), buf.as_strided(sk, (sk[1], 1), words + n))),
 "unbind": t(lambda: buf[:2 * n].view(2, *sk).unbind(0)),
}
print(json.dumps({k: round(v, 2) for k, v in res.items()}, indent=1))
