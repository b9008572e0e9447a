"""Checkpoints of a model with moonep expert parallelism: DCP (resharding), a full state dict, save_pretrained.

    mpiexec -n 4 python examples/training/checkpoint.py --save /tmp/ckpt        # train 2 steps, save
    mpiexec -n 2 python examples/training/checkpoint.py --resume /tmp/ckpt      # load at 2 ranks, go on

``torch.distributed.checkpoint`` works as for any model: the expert shards are DTensors of the full
``[E, ...]`` tensors, so DCP saves each expert once with its optimizer state and reshards on load (4 ranks to
2 here).  ``--export DIR`` also writes the full model with ``save_pretrained`` (every rank calls it, rank 0
writes), which the unpatched transformers class loads.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import moonep
from moonep.integrations import patch_hf_moe

VOCAB = 64


def build(rt, seed: int = 0):
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     num_local_experts=8, num_experts_per_tok=2)  # 8 experts: 1, 2, 4 or 8 ranks
    torch.manual_seed(seed)
    return patch_hf_moe(transformers.MixtralForCausalLM(cfg).to(rt.device), rt)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", help="DCP checkpoint directory to write after training")
    ap.add_argument("--resume", help="DCP checkpoint directory to load before training")
    ap.add_argument("--export", help="directory for save_pretrained (the full, unpatched layout)")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    rt = moonep.init()
    model = DDP(build(rt))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    if args.resume:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": torch.zeros((), dtype=torch.int64)}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
    losses = []
    for step in range(start, start + args.steps):
        # one global batch of 8 sequences per step, split over the ranks: the same data at any number of ranks
        ids = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(step))
        ids = ids.chunk(rt.world_size)[rt.rank].to(rt.device)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        mean = loss.detach().reshape(1).cpu()
        torch.distributed.all_reduce(mean, group=rt.cpu_group)  # the global batch's loss
        losses.append(mean.item() / rt.world_size)
        if rt.rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    if args.save:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": torch.tensor(start + args.steps)}, checkpoint_id=args.save)
    if args.export:
        model.module.save_pretrained(args.export)  # collective: every rank gathers, rank 0 writes
        torch.distributed.barrier(group=rt.cpu_group)  # written, when any rank goes on to read it
    return losses


if __name__ == "__main__":
    main()
