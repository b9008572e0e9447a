"""Rows each rank's experts compute under a skewed routing: torchtitan's all-to-all dispatcher against moonep.

    mpiexec -n 2 python benchmarks/bench_torchtitan_balance.py --out benchmarks/results/cpu_torchtitan_balance_np2.json

torchtitan's debug models at EP = world size on CPU ranks (:mod:`tests.harness.torchtitan`), the same weights
for both dispatchers.  The routing is skewed the way a hot group of experts skews it in training: every MoE
layer's ``expert_bias_E`` is frozen (no load-balancing update) with ``--hot-bias`` added to the experts of
rank 0 (experts ``0 .. E/R - 1``), so most choices land on them.  One forward pass per dispatcher; each
records, per layer and rank, the rows its experts computed: the all-to-all dispatcher's received rows,
moonep's home plus replica rows.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _record(dispatcher_cls, rows_of, log: list):
    """Wrap ``dispatcher_cls.dispatch`` to append each call's computed rows (``rows_of(result)``) to ``log``."""
    original = dispatcher_cls.dispatch

    def dispatch(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        log.append(int(rows_of(out)))
        return out

    dispatcher_cls.dispatch = dispatch
    return lambda: setattr(dispatcher_cls, "dispatch", original)


def rows_per_rank(model, ids, dispatcher_cls, rows_of) -> list:
    """``[layer][rank]`` rows computed by each rank's experts in one forward pass of ``model``."""
    log: list = []
    undo = _record(dispatcher_cls, rows_of, log)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        undo()
    t = torch.tensor(log, dtype=torch.int64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out, 1).tolist()


def skew(model, epn: int, hot: float) -> None:
    """Freeze every MoE layer's expert bias at ``hot`` on experts ``0 .. epn-1`` (rank 0's), 0 elsewhere."""
    for layer in model.layers.values():
        if getattr(layer, "moe_enabled", False):
            b = layer.moe.expert_bias_E
            b = b.to_local() if hasattr(b, "to_local") else b
            b.zero_()[:epn] = hot


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="deepseek_v3,qwen3_moe")
    ap.add_argument("--hot-bias", dest="hot", type=float, default=0.2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    import moonep
    from moonep.bench.provenance import command, git_commit, machine
    from moonep.integrations.torchtitan import MoonepTokenDispatcher
    from tests.harness import torchtitan as tt
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    rt = moonep.init(device="cpu")
    R = rt.world_size
    results = []
    for name in args.models.split(","):
        ref, _, _ = tt.build(name, R, param_dtype="float32")
        mine, _, _ = tt.build(name, R, moonep=True, param_dtype="float32")
        mine.load_state_dict(ref.state_dict())
        E = ref.layers[str(len(ref.layers) - 1)].moe.routed_experts.inner_experts.num_experts
        K = ref.layers[str(len(ref.layers) - 1)].moe.router.top_k
        for m in (ref, mine):
            skew(m, E // R, args.hot)
        g = torch.Generator().manual_seed(rt.rank)
        ids = torch.randint(0, ref.tok_embeddings.num_embeddings, (args.batch, args.seq), generator=g)
        a2a_cls = AllToAllTokenDispatcher if R > 1 else LocalTokenDispatcher
        a2a = rows_per_rank(ref, ids, a2a_cls, lambda out: out[1].sum())
        mo = rows_per_rank(mine, ids, MoonepTokenDispatcher, lambda out: out[1].sum())
        spread = lambda rows: [max(r) - min(r) for r in rows]  # noqa: E731
        rec = dict(model=name, num_experts=E, topk=K, ranks=R, tokens_per_rank=args.batch * args.seq,
                   hot_experts=list(range(E // R)), hot_bias=args.hot,
                   all_to_all_rows=a2a, moonep_rows=mo, all_to_all_spread=spread(a2a), moonep_spread=spread(mo),
                   all_to_all_max_over_mean=[round(max(r) * R / sum(r), 3) for r in a2a],
                   moonep_max_over_mean=[round(max(r) * R / sum(r), 3) for r in mo])
        results.append(rec)
        if rt.rank == 0:
            print(f"{name} R={R}: all-to-all rows per rank {a2a[-1]} (spread {rec['all_to_all_spread']}), "
                  f"moonep {mo[-1]} (spread {rec['moonep_spread']})", flush=True)
    if rt.rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(
            what="rows computed per rank and MoE layer under a frozen, skewed expert bias (one hot expert group)",
            command=command(launcher=f"mpiexec -n {R}"), commit=git_commit(), machine=machine(),
            results=results), indent=1))
    rt.shutdown()


if __name__ == "__main__":
    main()
