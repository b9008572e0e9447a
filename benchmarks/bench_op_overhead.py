"""Host cost of one call through a ``torch.library`` custom op against an ``autograd.Function``, eagerly.

    python3 benchmarks/bench_op_overhead.py --out benchmarks/results/cpu_op_overhead.json

What moving moonep's eager data path onto its custom ops (one definition for eager and compiled code) would
add per call: the same trivial body (two clones of small CPU tensors) called as a plain function, through an
``autograd.Function``, and through a ``custom_op`` with ``register_autograd``, with grad mode on (inputs that
require grad) and off.  Median microseconds per call over ``--reps`` rounds of ``--calls`` calls.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch import Tensor

from moonep.bench.provenance import command, git_commit, machine


@torch.library.custom_op("moonep_bench::pair", mutates_args=())
def _pair(x: Tensor, w: Tensor, i: int) -> tuple[Tensor, Tensor]:
    return x.clone(), w.clone()


@_pair.register_fake
def _(x, w, i):
    return x.new_empty(x.shape), w.new_empty(w.shape)


_pair.register_autograd(lambda ctx, a, b: (a, b, None), setup_context=lambda ctx, inputs, output: None)


class _Pair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, i):
        return x.clone(), w.clone()

    @staticmethod
    def backward(ctx, a, b):
        return a, b, None


def _plain(x, w, i):
    return x.clone(), w.clone()


def _us_per_call(fn, x, w, calls: int, reps: int) -> float:
    for _ in range(200):
        fn(x, w, 3)
    rounds = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn(x, w, 3)
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(4, requires_grad=True)
    res = {}
    for name, fn in (("plain", _plain), ("autograd_function", _Pair.apply), ("custom_op", _pair)):
        res[name] = {"grad_us": _us_per_call(fn, x, w, a.calls, a.reps)}
        with torch.no_grad():
            res[name]["no_grad_us"] = _us_per_call(fn, x, w, a.calls, a.reps)
    extra = {k: res["custom_op"][k] - res["autograd_function"][k] for k in ("grad_us", "no_grad_us")}
    print(f"{'path':<20}{'grad (us)':>12}{'no grad (us)':>14}")
    for name, r in res.items():
        print(f"{name:<20}{r['grad_us']:>12.1f}{r['no_grad_us']:>14.1f}")
    print(f"custom_op - autograd.Function: {extra['grad_us']:.1f} us with grad, {extra['no_grad_us']:.1f} us without")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"command": command(), "commit": git_commit(), "machine": machine(),
                       "config": vars(a), "us_per_call": res, "custom_op_minus_function_us": extra}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
