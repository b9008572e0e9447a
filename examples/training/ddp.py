"""DistributedDataParallel with moonep expert parallelism: accumulation, clipping, autocast.

    mpiexec -n 2 python examples/training/ddp.py                  # CPU ranks (MPICH from `pip install mpich`)
    torchrun --standalone --nproc-per-node 2 examples/training/ddp.py --autocast
    python examples/training/ddp.py --model latent                # one process: a LatentMoE stack

A tiny Mixtral (or a stack of LatentMoE layers) is built identically on every rank; ``patch_hf_moe`` shards
its experts over the ranks and prepares it for DDP, which then averages every other parameter's gradient.
Each optimizer step accumulates ``--micro`` micro-batches (``no_sync`` on all but the last), clips the global
gradient norm with ``moonep.training.clip_grad_norm_`` (the same norm on every rank) and steps AdamW.
"""
from __future__ import annotations

import argparse
import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import moonep
from moonep.integrations import patch_hf_moe

VOCAB = 64


def build(kind: str, rt):
    """The same model on every rank (one seed), its experts sharded by moonep."""
    torch.manual_seed(0)
    if kind == "latent":
        layers = [moonep.LatentMoE(32, 16, 4 * rt.world_size, 2, 24, num_shared=1, group=rt) for _ in range(2)]
        model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), *layers, torch.nn.Linear(32, VOCAB))
        return moonep.training.prepare(model)  # patch_hf_moe does this itself
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     num_local_experts=4 * rt.world_size, num_experts_per_tok=2)
    return patch_hf_moe(transformers.MixtralForCausalLM(cfg), rt)


def loss_of(model, ids):
    logits = model(ids)
    logits = getattr(logits, "logits", logits)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mixtral", "latent"), default="mixtral")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--autocast", action="store_true", help="bf16 autocast: the experts compute in bf16 too")
    args = ap.parse_args(argv)
    rt = moonep.init()
    dev = rt.device
    model = DDP(build(args.model, rt).to(dev))  # the expert shards are left to moonep
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(100 * step + rt.rank)  # each rank its own data
        batch = torch.randint(0, VOCAB, (2 * args.micro, 8), generator=g).to(dev)
        opt.zero_grad()
        for i, ids in enumerate(batch.chunk(args.micro)):
            sync = contextlib.nullcontext() if i == args.micro - 1 else model.no_sync()
            with sync, amp:
                loss = loss_of(model, ids) / args.micro
            loss.backward()
        norm = moonep.training.clip_grad_norm_(model, max_norm=1.0)  # not torch's: the experts are sharded
        opt.step()
        losses.append(loss.item() * args.micro)
        if rt.rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f} (rank 0's last micro-batch), grad norm {float(norm):.4f}",
                  flush=True)
    return losses


if __name__ == "__main__":
    main()
