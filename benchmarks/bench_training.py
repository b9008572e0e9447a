"""One training step (forward, backward, AdamW) of a transformers Mixtral, with and without moonep, under the
tools people train with: no wrapper, DDP and FSDP2.

    mpirun -n 1 python3 benchmarks/bench_training.py --out benchmarks/results/h200x1_training_r1.json
    mpirun -n 2 python3 benchmarks/bench_training.py --out benchmarks/results/h200x1_training_r2.json
    mpiexec -n 2 python benchmarks/bench_training.py --device cpu --hidden 64 --seq 16 --iters 3   # smoke

Setups (every rank its own batch; the same bf16 model built on every rank):

* ``moonep``: the patched model (``patch_hf_moe``), no wrapper, ``moonep.training.sync_grads`` before the
  step: bare moonep, the reference of the wrapper overhead;
* ``moonep_ddp`` / ``moonep_fsdp2``: the patched model under DDP / FSDP2 (``fully_shard_experts``, then every
  block and the root);
* ``moonep_fsdp2_glue``: the patched model under FSDP2 without ``fully_shard_experts``: the experts left out
  of FSDP with ``ignored_params`` (their gradients come out of the backward complete), every block and the
  root sharded.  That is FSDP2's own traffic, so ``moonep_fsdp2`` / ``moonep_fsdp2_glue`` is what the wrapper
  costs under FSDP2 (``moonep_fsdp2`` / ``moonep`` also holds FSDP2's gathers of every other parameter);
* ``plain_ddp`` / ``plain_fsdp2``: the unpatched model (every expert on every rank) under DDP / FSDP2.

Times are the median of ``--iters`` steps after ``--warmup`` (CUDA events on CUDA, wall clock on CPU), the
slowest rank's.  ``host_syncs``: device-to-host synchronisations in one step (``torch.cuda.set_sync_debug_mode``;
CUDA only).  The JSON holds the command, the commit, the machine, the configuration, every setup's time and
host syncs, and the ratios ``moonep_*`` / ``moonep``, ``moonep_fsdp2`` / ``moonep_fsdp2_glue`` (the wrapper's
overhead) and ``moonep_*`` / ``plain_*``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import moonep
from moonep.bench.provenance import command, git_commit, machine
from moonep.integrations import patch_hf_moe

SETUPS = ("moonep", "moonep_ddp", "moonep_fsdp2", "moonep_fsdp2_glue", "plain_ddp", "plain_fsdp2")


def build(args, rt, setup: str):
    """The model of ``setup`` on ``rt``'s device, wrapped as ``setup`` says."""
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = transformers.MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                     num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                     num_key_value_heads=max(1, args.heads // 4), head_dim=args.hidden // args.heads,
                                     num_local_experts=args.experts, num_experts_per_tok=args.topk,
                                     max_position_embeddings=args.seq)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(device=rt.device, dtype=_DT[args.dtype])
    if setup.startswith("moonep"):
        patch_hf_moe(model, rt, max_tokens=args.batch * args.seq)
    if setup.endswith("ddp"):
        return DDP(model)
    if setup == "moonep_fsdp2_glue":
        kw = dict(ignored_params=set(moonep.training.expert_parameters(model)))
        for block in model.model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    elif setup.endswith("fsdp2"):
        if setup.startswith("moonep"):
            moonep.training.fully_shard_experts(model)
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    return model


def step(model, opt, ids, setup: str) -> None:
    opt.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    if setup == "moonep":
        moonep.training.sync_grads(model)
    opt.step()


def time_setup(args, rt, setup: str) -> dict:
    model = build(args, rt, setup)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rt.rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(rt.device)
               for _ in range(args.warmup + args.iters)]
    cuda = rt.device.type == "cuda"
    times = []
    for i, ids in enumerate(batches):
        dist.barrier(group=rt.cpu_group)  # every rank starts the step together
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        step(model, opt, ids, setup)
        if cuda:
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if i >= args.warmup:
            times.append(ms)
    if args.profile and rt.rank == 0:
        _profile(model, opt, batches[:3], setup, os.path.join(args.profile, f"{setup}.txt"))
    elif args.profile:
        for ids in batches[:3]:  # the peers take part in the profiled steps' collectives
            step(model, opt, ids, setup)
    syncs = None
    if cuda:  # one more step, counting the host synchronisations torch reports
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(model, opt, batches[0], setup)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.cpu_group)  # the slowest rank's median
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return {"ms_per_step": float(t), "host_syncs": syncs, "ms_rank": statistics.median(times)}


_DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _profile(model, opt, batches, setup: str, path: str) -> None:
    """A torch.profiler table of ``setup``'s steps over ``batches`` into ``path``: ops by device time, then
    by host time (where a setup's time goes)."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                   if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as prof:
        for ids in batches:
            step(model, opt, ids, setup)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ka = prof.key_averages()
    with open(path, "w") as f:
        for key in ("self_device_time_total", "self_cpu_time_total"):
            f.write(f"sorted by {key}\n{ka.table(sort_by=key, row_limit=40)}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(_DT), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2048, help="each expert's hidden width")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--profile", default=None, help="directory for a torch.profiler table per setup (rank 0)")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    rt = moonep.init(device=args.device)
    results = {s: time_setup(args, rt, s) for s in args.setups.split(",")}
    ratios = {f"{s}/moonep": results[s]["ms_per_step"] / results["moonep"]["ms_per_step"]
              for s in results if s.startswith("moonep_") and "moonep" in results}
    ratios |= {f"{s}/plain_{s.split('_', 1)[1]}": results[s]["ms_per_step"] /
               results[f"plain_{s.split('_', 1)[1]}"]["ms_per_step"]
               for s in results if s.startswith("moonep_") and f"plain_{s.split('_', 1)[1]}" in results}
    if "moonep_fsdp2" in results and "moonep_fsdp2_glue" in results:
        ratios["moonep_fsdp2/moonep_fsdp2_glue"] = (results["moonep_fsdp2"]["ms_per_step"] /
                                                    results["moonep_fsdp2_glue"]["ms_per_step"])
    if rt.rank == 0:
        print(f"training step of a Mixtral ({args.layers} layers, hidden {args.hidden}, {args.experts} experts "
              f"top-{args.topk}, {args.batch}x{args.seq} tokens per rank, {args.dtype}) on {rt.world_size} "
              f"rank(s), {rt.device.type}")
        for s, r in results.items():
            print(f"  {s:<14}{r['ms_per_step']:>10.2f} ms   host syncs {r['host_syncs']}")
        for k, v in ratios.items():
            print(f"  {k:<26}{v:>8.3f}")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"command": command(launcher=f"mpirun -n {rt.world_size}"), "commit": git_commit(),
                           "machine": machine(), "config": vars(args) | {"world_size": rt.world_size},
                           "results": results, "ratios": ratios}, f, indent=1)
    rt.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
