"""Where the MoE layer's training step spends its host time, on moonep and on the Megatron-style path.

    mpiexec -n 2 python tools/profile_training_step.py --out prof.json                  # CPU ranks
    mpiexec -n 2 python tools/profile_training_step.py --tokens 1024 --ek 16x4 --maxvio 2 --out prof.json

The step is ``moonep-bench``'s (:mod:`moonep.bench.training_step`): router, dispatch, replica fetch, SwiGLU
experts, combine, forward and backward, with the same weights and routing on both paths.  The two paths
alternate step by step; each has its own cProfile, enabled around its steps only.  Every rank writes its
breakdown (ms per step) into the JSON, with the paired step times and their per-step ratio:

* the step's parts: ``router``, ``dispatch``, ``replica_fetch`` (moonep), ``experts``, ``combine`` (forward,
  each with everything it calls) and ``backward`` (autograd's whole backward pass);
* summed over the step: ``expert_gemms`` (``torch.mm``, forward and backward: both paths run the experts
  through moonep's slot loops) and ``waiting`` (a rank waiting for its peers inside a collective: moonep's MPI
  transport polling and sleeping; gloo's ``Work.wait``);
* ``total``: the profiled time of the step.

cProfile's view of the host: its own overhead is in every figure, alike for both paths.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

import moonep
from moonep.bench.baselines import MegatronA2A
from moonep.bench.provenance import command, git_commit, machine
from moonep.bench.routing import make_routing
from moonep.bench.suite import gather
from moonep.bench.training_step import (TrainingLayer, differentiable, megatron_train_step, moonep_train_step,
                                        torch_all_to_all)

# cProfile entries, as (file suffix, function name): the parts of a step, disjoint (each the time of its call
# and everything under it), and the leaves whose own time is added up across the step.
BUILTIN = "~"
BACKWARD = (BUILTIN, "<method 'run_backward' of 'torch._C._EngineBase' objects>")
PARTS = {
    "moonep": dict(router=[("moonep/bench/training_step.py", "topk_weights")],
                   dispatch=[("moonep/ep.py", "dispatch")],
                   replica_fetch=[("moonep/bench/layer_step.py", "fetch_replicas")],
                   experts=[("moonep/bench/layer_step.py", "moonep_experts")],
                   combine=[("moonep/ep.py", "combine")],
                   backward=[BACKWARD]),
    "megatron": dict(router=[("moonep/bench/training_step.py", "topk_weights")],
                     dispatch=[("moonep/bench/baselines.py", "dispatch")],
                     experts=[("moonep/bench/layer_step.py", "swiglu_experts")],
                     combine=[("moonep/bench/baselines.py", "combine")],
                     backward=[BACKWARD]),
}
LEAVES = dict(expert_gemms=[(BUILTIN, "<built-in method torch.mm>")],
              # a rank waiting for its peers: moonep's MPI transport polls and sleeps, gloo waits in Work.wait
              waiting=[("moonep/transport/mpi.py", "_poll"), (BUILTIN, "<built-in method time.sleep>"),
                       (BUILTIN, "<method 'Testall' of 'mpi4py.MPI.Request' objects>"),
                       (BUILTIN, "<built-in method torch._C._distributed_c10d.wait>")])


def _time(stats: pstats.Stats, wanted: list, cumulative: bool) -> float:
    return sum((ct if cumulative else tt) for (file, _line, name), (_cc, _nc, tt, ct, _callers) in stats.stats.items()
               if any(file.endswith(f) and name == n for f, n in wanted))


def breakdown(prof: cProfile.Profile, steps: int, path: str) -> dict:
    """ms per step: the step's parts (forward parts and the whole backward), then the leaves summed over the
    step (the expert GEMMs, forward and backward; the waits for peers), then the total."""
    st = pstats.Stats(prof)
    out = {k: _time(st, v, True) for k, v in PARTS[path].items()}
    out.update({k: _time(st, v, False) for k, v in LEAVES.items()})
    out["total"] = st.total_tt
    return {k: round(v / steps * 1e3, 3) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ek", default="16x4", help="experts x top-k")
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--maxvio", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=30, help="profiled steps of each path (after 10 warm-up steps)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rt = moonep.init(device="cpu")
    R, rank = rt.world_size, rt.rank
    E, K = (int(v) for v in a.ek.split("x"))
    s, H = a.tokens, a.hidden
    idx, _ = make_routing(s, E, K, a.maxvio, seed=rank + 1)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(s, H, generator=gen).requires_grad_()
    gy = torch.randn(s, H, generator=gen)
    ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=s, dtype=torch.float32, slack=0)
    meg = MegatronA2A(differentiable(torch_all_to_all(rt.group)), R, E, K, backend="gloo")
    layer = TrainingLayer(E // R, E, H, a.ffn, torch.float32, rt.device)
    paths = {"moonep": lambda: moonep_train_step(ep, layer, x, idx, gy),
             "megatron": lambda: megatron_train_step(meg, layer, x, idx, gy)}
    profs = {name: cProfile.Profile() for name in paths}
    times = {name: [] for name in paths}
    for i in range(10 + a.steps):
        for name in (("moonep", "megatron") if i % 2 == 0 else ("megatron", "moonep")):
            rt.barrier()
            t0 = time.perf_counter()
            if i >= 10:
                profs[name].enable()
            paths[name]()
            if i >= 10:
                profs[name].disable()
                times[name].append((time.perf_counter() - t0) * 1e3)
    mine = {name: dict(step_ms_median=round(statistics.median(times[name]), 3),
                       per_step_ms=breakdown(profs[name], a.steps, name)) for name in paths}
    ratio = statistics.median(b / m for m, b in zip(times["moonep"], times["megatron"]))
    mine["megatron_over_moonep_median"] = round(ratio, 3)
    every = gather(rt, mine)
    if rank == 0:
        doc = dict(command=command(launcher=f"mpiexec -n {R}"), git_commit=git_commit(), machine=machine(),
                   config=dict(tokens=s, hidden=H, experts=E, topk=K, ffn=a.ffn, maxvio=a.maxvio, steps=a.steps,
                               ranks=R, dtype="fp32", slack=0),
                   definitions=__doc__.split("\n\n", 2)[2].strip(), ranks=every)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        for r, e in enumerate(every):
            print(f"rank {r}: megatron / moonep {e['megatron_over_moonep_median']}")
            for name in paths:
                print(f"  {name:9s} step {e[name]['step_ms_median']:8.2f} ms  " +
                      "  ".join(f"{k} {v:.2f}" for k, v in e[name]["per_step_ms"].items()))
    rt.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
