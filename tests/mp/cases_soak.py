"""Short soak + determinism on every rank (the CI version of benchmarks/soak_cpu.py).

Two runs of the same seed in one launch must give a bitwise-identical loss curve (every step's float64 mean
loss over ranks), identical on every rank; the resident set must not keep growing after warm-up (relaxed to
5 %: 150 steps leave the allocator less time to settle than the 2,000-step benchmark, which holds 1 %).
"""
import importlib.util
import sys
from pathlib import Path

import torch

from tests.harness.mp import SkipCase

SkipCase = getattr(sys.modules.get("__main__"), "SkipCase", SkipCase)  # noqa: F811  (see cases_layers.py)

_spec = importlib.util.spec_from_file_location("soak_cpu", Path(__file__).resolve().parents[2] / "benchmarks/soak_cpu.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

STEPS, WARMUP = 150, 50


def case_soak_short_deterministic_and_flat(rt):
    if rt.device.type != "cpu":
        raise SkipCase("CPU soak")
    torch.set_num_threads(1)
    kw = dict(steps=STEPS, seed=3, warmup=WARMUP, sample_every=10, phase=50)
    a = soak.run_soak(rt, **kw)
    b = soak.run_soak(rt, **kw)
    assert a["losses"] == b["losses"] and a["loss_hash"] == b["loss_hash"], \
        next(i for i, (u, v) in enumerate(zip(a["losses"], b["losses"])) if u != v)
    hashes = soak.all_gather(rt, a["loss_hash"])
    assert len(set(hashes)) == 1, hashes
    assert a["losses"][-1] < a["losses"][0], (a["losses"][0], a["losses"][-1])  # it trains
    assert max(a["maxvio"]) > 2 * min(a["maxvio"]), "the skew must move"
    growth = soak.rss_growth(b["rss"], WARMUP)  # the second run: imports and first-touch pages are behind us
    assert growth < 5.0, (growth, b["rss"])
