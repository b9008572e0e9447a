"""CPU soak and determinism: many LatentMoE training steps on CPU ranks with routing skew that moves.

    mpiexec -n 4 python benchmarks/soak_cpu.py --steps 2000 --seed 0 --out benchmarks/results/cpu_soak_np4_run1.json
    mpiexec -n 4 python benchmarks/soak_cpu.py --steps 2000 --seed 0 --compare benchmarks/results/cpu_soak_np4_run1.json \
        --out benchmarks/results/cpu_soak_np4_run2.json

Every step runs forward and backward of a small LatentMoE (dispatch, prefetch, combine, their backward passes,
gradient sync, QB step) on inputs whose skew changes over time: the tokens lean towards a direction that
changes every ``--phase`` steps with an amplitude that rises and falls, so the hot experts, the replicas the
planner places and the imbalance keep moving. Measured: the resident set size of every rank (sampled every
``--sample-every`` steps; growth after ``--warmup`` steps must stay under ``--max-growth`` percent) and a
SHA-256 of the loss curve (float64 mean over ranks of every step). ``--compare`` checks that the curve is
bitwise that of an earlier run with the same seed. The JSON records the command, the commit, the machine.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import struct
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _soak_common import all_gather, due, parser, provenance, rss_bytes, wave, write_json  # noqa: E402


def machine() -> dict:
    return dict(hostname=platform.node(), platform=platform.platform(), python=platform.python_version(),
                torch=torch.__version__, cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads())


def curve_hash(losses) -> str:
    return hashlib.sha256(b"".join(struct.pack("<d", v) for v in losses)).hexdigest()


def run_soak(rt, *, steps: int, seed: int, warmup: int, sample_every: int, phase: int = 250, tokens: int = 64,
             d_model: int = 32, d_latent: int = 16, experts_per_rank: int = 2, topk: int = 2,
             log_every: int = 0) -> dict:
    """Train ``steps`` steps from ``seed``; returns the loss curve, its hash, RSS samples and skew figures.

    Collective: every rank of ``rt`` calls it. The result is identical on every rank except ``rss``."""
    from moonep.layers import LatentMoE, balancer_step
    from moonep.training import sync_grads

    R = rt.world_size
    E = experts_per_rank * R
    torch.manual_seed(seed)  # weights: LatentMoE broadcasts its init seed, the rest is drawn identically
    model = torch.nn.ModuleDict(dict(
        moe=LatentMoE(d_model, d_latent, E, topk, 2 * d_latent, num_shared=1, d_shared=d_latent, group=rt,
                      max_tokens=tokens),
        head=torch.nn.Linear(d_model, d_model)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed * 1009 + 17)           # the skew schedule: same on every rank
    n_phases = steps // phase + 1
    directions = torch.randn(n_phases, d_model, generator=g)
    directions = directions / directions.norm(dim=1, keepdim=True)
    target = torch.randn(d_model, d_model, generator=g) / math.sqrt(d_model)
    data = torch.Generator().manual_seed(seed * 7919 + rt.rank)  # each rank its own tokens
    losses, maxvio, replicas, rss = [], [], [], []
    t0 = time.monotonic()
    for step in range(steps):
        amp = wave(step, phase, 4.0)
        x = torch.randn(tokens, d_model, generator=data) + amp * directions[step // phase]
        y = model["head"](model["moe"](x))
        loss = torch.nn.functional.mse_loss(y, torch.tanh(x @ target))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_grads(model)
        opt.step()
        balancer_step(model)
        mean = loss.detach().double().reshape(1)
        if R > 1:
            dist.all_reduce(mean, group=rt.cpu_group)
        losses.append(float(mean) / R)
        st = model["moe"].last_stats
        load = st["expert_load"].double()
        maxvio.append(float(load.max() / load.mean().clamp(min=1e-9) - 1))
        replicas.append(int(st["replicas"].sum()))
        recv = st["recv_counts"]
        assert int(recv.max()) - int(recv.min()) <= 1, recv.tolist()
        if due(step, steps, sample_every):
            rss.append((step, rss_bytes()))
        if log_every and rt.rank == 0 and step % log_every == 0:
            print(f"step {step:5d} loss {losses[-1]:.5f} maxvio {maxvio[-1]:5.2f} replicas {replicas[-1]} "
                  f"rss {rss[-1][1] / 2**20:.1f} MiB  {time.monotonic() - t0:.1f}s", flush=True)
    return dict(losses=losses, loss_hash=curve_hash(losses), maxvio=maxvio, replicas=replicas, rss=rss,
                seconds=time.monotonic() - t0)


def rss_growth(rss, warmup: int) -> float:
    """Percent growth of the RSS from the first sample at or after ``warmup`` to the largest one after it."""
    after = [v for s, v in rss if s >= warmup]
    return 100.0 * (max(after) - after[0]) / after[0] if after else float("nan")


def main():
    ap = parser(__doc__, steps=2000, warmup=200, sample_every=50, phase=250, out_name="soak_cpu_np{R}.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-growth", type=float, default=1.0, help="allowed RSS growth after warm-up, percent")
    ap.add_argument("--compare", help="JSON of an earlier run with the same seed: the loss curve must match bitwise")
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args()

    torch.set_num_threads(1)  # ranks share the cores; also keeps the reductions' order fixed
    import moonep

    rt = moonep.init()
    res = run_soak(rt, steps=args.steps, seed=args.seed, warmup=args.warmup, sample_every=args.sample_every,
                   phase=args.phase, log_every=args.log_every)
    rss_all = all_gather(rt, res["rss"])
    hashes = all_gather(rt, res["loss_hash"])
    if rt.rank == 0:
        growth = [rss_growth(r, args.warmup) for r in rss_all]
        out = dict(
            provenance(rt, args, "soak_cpu", "mpiexec", "python", machine()), seconds=round(res["seconds"], 2),
            loss_hash=res["loss_hash"], hash_equal_on_all_ranks=len(set(hashes)) == 1,
            loss_first=res["losses"][0], loss_last=res["losses"][-1],
            losses_float64_hex=[v.hex() for v in res["losses"]],
            maxvio=dict(min=min(res["maxvio"]), max=max(res["maxvio"]), mean=sum(res["maxvio"]) / len(res["maxvio"])),
            replicas=dict(min=min(res["replicas"]), max=max(res["replicas"])),
            rss_bytes={f"rank{r}": v for r, v in enumerate(rss_all)},
            rss_growth_pct_after_warmup={f"rank{r}": round(v, 4) for r, v in enumerate(growth)},
            rss_growth_pct_max=round(max(growth), 4),
        )
        ok = out["hash_equal_on_all_ranks"] and out["rss_growth_pct_max"] < args.max_growth
        if args.compare:
            ref = json.loads(Path(args.compare).read_text())
            same = ref["loss_hash"] == out["loss_hash"] and ref["losses_float64_hex"] == out["losses_float64_hex"]
            first_diff = next((i for i, (a, b) in enumerate(zip(ref["losses_float64_hex"],
                                                                  out["losses_float64_hex"])) if a != b), None)
            out["compare"] = dict(reference=args.compare, reference_hash=ref["loss_hash"],
                                  reference_commit=ref["git_commit"], bitwise_identical=same,
                                  first_differing_step=first_diff,
                                  reference_rss_growth_pct_max=ref["rss_growth_pct_max"])
            ok = ok and same
        out["passed"] = ok
        path = write_json(args.out, f"soak_cpu_np{rt.world_size}.json", out)
        print(f"loss {out['loss_first']:.5f} -> {out['loss_last']:.5f}  hash {out['loss_hash'][:16]}  "
              f"rss growth {out['rss_growth_pct_max']:.3f}%  maxvio {out['maxvio']['min']:.2f}..{out['maxvio']['max']:.2f}"
              + (f"  bitwise identical to reference: {out['compare']['bitwise_identical']}" if args.compare else "")
              + f"  -> {path}  {'PASS' if ok else 'FAIL'}", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
