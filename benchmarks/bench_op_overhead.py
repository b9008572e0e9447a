"""Host cost of one call through a ``torch.library`` custom op against an ``autograd.Function``, eagerly.

    python3 benchmarks/bench_op_overhead.py --out benchmarks/results/cpu_op_overhead.json

What running moonep's eager data path through its ``torch.library`` ops (one definition for eager and compiled
code) adds per call: the same trivial body (two clones of small CPU tensors) called as a plain function,
through an ``autograd.Function`` (the eager path before the ops), through a ``custom_op`` with
``register_autograd``, through a ``Library``-defined op with ``register_autograd``, and through a
``Library``-defined op with moonep's own Autograd kernel (``moonep.ops._define`` and ``_autograd``, what the
eager path uses), with grad mode on (inputs that require grad) and off.  Median microseconds per call over
``--reps`` rounds of ``--calls`` calls.
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


_LIB = torch.library.Library("moonep_bench", "FRAGMENT")


def _body(x, w, i):
    return x.clone(), w.clone()


def _fake(x, w, i):
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output):
    pass


def _library_ops():
    """The trivial body as two Library-defined ops: one with ``register_autograd``, one with moonep's kernel."""
    from moonep.ops import _autograd, _define

    reg = _define("pair_reg(Tensor x, Tensor w, int i) -> (Tensor, Tensor)", _body, _fake, collective=False, lib=_LIB)
    torch.library.register_autograd("moonep_bench::pair_reg", lambda ctx, a, b: (a, b, None), setup_context=_setup,
                                    lib=_LIB)
    own = _define("pair_own(Tensor x, Tensor w, int i) -> (Tensor, Tensor)", _body, _fake, collective=False, lib=_LIB)
    _autograd(own, _body, _setup, lambda ctx, a, b: (a, b, None), inputs=(0, 1), tracked=2, lib=_LIB)
    return reg, own


class _Pair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, i):
        return x.clone(), w.clone()

    @staticmethod
    def backward(ctx, a, b):
        return a, b, None


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
    reg, own = _library_ops()
    for name, fn in (("plain", _body), ("autograd_function", _Pair.apply), ("custom_op", _pair),
                     ("library_register_autograd", reg), ("library_moonep_autograd", own)):
        res[name] = {"grad_us": _us_per_call(fn, x, w, a.calls, a.reps)}
        with torch.no_grad():
            res[name]["no_grad_us"] = _us_per_call(fn, x, w, a.calls, a.reps)
    extra = {name: {k: round(res[name][k] - res["autograd_function"][k], 2) for k in ("grad_us", "no_grad_us")}
             for name in ("custom_op", "library_register_autograd", "library_moonep_autograd")}
    print(f"{'path':<20}{'grad (us)':>12}{'no grad (us)':>14}")
    for name, r in res.items():
        print(f"{name:<20}{r['grad_us']:>12.1f}{r['no_grad_us']:>14.1f}")
    for name, e in extra.items():
        print(f"{name} - autograd.Function: {e['grad_us']:.1f} us with grad, {e['no_grad_us']:.1f} us without")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"command": command(), "commit": git_commit(), "machine": machine(),
                       "config": vars(a), "us_per_call": res, "minus_function_us": extra}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
