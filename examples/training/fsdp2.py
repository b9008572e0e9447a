"""FSDP2 (``fully_shard``) with moonep expert parallelism, mixed precision, on a 1-D or a 2-D mesh.

    mpiexec -n 2 python examples/training/fsdp2.py                # pure expert parallelism, bf16 compute
    mpiexec -n 4 python examples/training/fsdp2.py --dp 2         # (dp=2, ep=2): experts replicated over dp
    torchrun --standalone --nproc-per-node 8 examples/training/fsdp2.py --dp 2

The recipe: ``moonep.training.fully_shard_experts`` first (the experts get their own FSDP2 group over the
ranks that hold the same experts: ``"dp"``), then ``fully_shard`` of every block and of the root, as for any
model.  On a 2-D mesh the experts are sharded over ``mesh["ep"]`` (``patch_hf_moe(model, mesh["ep"])``) and
every other parameter over all ranks.
"""
from __future__ import annotations

import argparse

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import moonep
from moonep.integrations import patch_hf_moe

VOCAB = 64


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas of each expert (a 2-D mesh)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fp32", action="store_true", help="no mixed precision")
    args = ap.parse_args(argv)
    import transformers

    rt = moonep.init()
    world, dev = rt.world_size, rt.device
    if world % args.dp:
        raise SystemExit(f"--dp: expected a divisor of the {world} ranks, got {args.dp}")
    ep = world // args.dp
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     num_local_experts=4 * ep, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(dev)
    mp = None if args.fp32 else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {} if mp is None else dict(mp_policy=mp)
    if args.dp == 1:  # pure expert parallelism: the experts' "dp" dimension is this rank alone
        patch_hf_moe(model, rt)
        moonep.training.fully_shard_experts(model, **kw)
    else:
        mesh = init_device_mesh(dev.type, (args.dp, ep), mesh_dim_names=("dp", "ep"))
        patch_hf_moe(model, mesh["ep"])
        moonep.training.fully_shard_experts(model, mesh=mesh["dp"], **kw)
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(100 * step + rt.rank)
        ids = torch.randint(0, VOCAB, (2, 8), generator=g).to(dev)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = moonep.training.clip_grad_norm_(model, max_norm=1.0)
        opt.step()
        losses.append(loss.item())
        if rt.rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f} (rank 0), grad norm {float(norm):.4f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
