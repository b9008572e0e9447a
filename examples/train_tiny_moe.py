"""Train a tiny LatentMoE language model with expert parallelism on a synthetic corpus.

    mpiexec -n 4 python examples/train_tiny_moe.py          # CPU ranks (a few minutes on 2 cores)
    torchrun --standalone --nproc-per-node 2 examples/train_tiny_moe.py   # GPUs, unchanged
    python examples/train_tiny_moe.py                        # one process, R = 1

The corpus is an order-2 Markov chain with a few likely successors per context, so the loss has room to
fall well below log(V). Each rank draws its own batches; the experts are sharded by home rank. Every step
prints the loss (mean over ranks), each layer's MaxVio (max_e load_e / mean load - 1, on the global
routing), the replicas the planner placed, and the per-rank receive counts, which are equal by
construction whatever the imbalance.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import moonep
from moonep.layers import LatentMoE, balancer_step
from moonep.training import sync_grads


class Corpus:
    """Order-2 Markov chain over ``vocab`` tokens; the same chain on every rank (fixed seed)."""

    def __init__(self, vocab: int, branching: int = 3, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.next = torch.randint(0, vocab, (vocab, vocab, branching), generator=g)  # likely successors
        self.entropy = math.log(branching)

    def batch(self, n: int, length: int, g: torch.Generator) -> torch.Tensor:
        """int64 ``[n, length]`` token ids."""
        ids = torch.randint(0, self.vocab, (n, length), generator=g)
        pick = torch.randint(0, self.next.shape[2], (n, length), generator=g)
        for t in range(2, length):
            ids[:, t] = self.next[ids[:, t - 2], ids[:, t - 1], pick[:, t]]
        return ids


class TinyMoELM(nn.Module):
    """Embeddings of the last two tokens -> ``layers`` residual LatentMoE blocks -> vocabulary logits."""

    def __init__(self, vocab, d_model, d_latent, num_experts, topk, d_expert, layers, rt):
        super().__init__()
        self.cur, self.prev = nn.Embedding(vocab, d_model), nn.Embedding(vocab + 1, d_model)
        self.moes = nn.ModuleList(LatentMoE(d_model, d_latent, num_experts, topk, d_expert, num_shared=2,
                                            group=rt) for _ in range(layers))
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)
        self.vocab = vocab

    def forward(self, ids):  # [n, T] -> [n, T, vocab]
        prev = F.pad(ids[:, :-1], (1, 0), value=self.vocab)
        h = self.cur(ids) + self.prev(prev)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(h)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()

    rt = moonep.init()
    R, dev = rt.world_size, rt.device
    torch.manual_seed(0)  # the same replicated weights on every rank (LatentMoE also syncs its init seed)
    corpus = Corpus(vocab=64)
    model = TinyMoELM(64, 64, 32, args.experts, args.topk, 64, layers=2, rt=rt).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(1000 + rt.rank)  # each rank its own data
    if rt.rank == 0:
        print(f"R={R} device={dev} experts={args.experts} (epn={args.experts // R}) topk={args.topk} "
              f"tokens/rank/step={args.batch * args.seq}  floor of the loss ~ {corpus.entropy:.3f}")
    t0 = time.time()
    first = last = None
    for step in range(args.steps):
        ids = corpus.batch(args.batch, args.seq + 1, g).to(dev)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_grads(model)      # all-reduce the replicated weights' gradients; experts are already reduced
        opt.step()
        balancer_step(model)   # QB: one integer all-reduce per layer sets next step's router bias

        mean_loss = loss.detach().clone()
        if R > 1:
            dist.all_reduce(mean_loss, group=rt.group)
        mean_loss = float(mean_loss) / R
        first = mean_loss if first is None else first
        last = mean_loss
        stats = [m.last_stats for m in model.moes]
        recv = [s["recv_counts"].tolist() for s in stats]
        assert all(max(r) - min(r) <= 1 for r in recv), recv  # exactly T*K/R each (+1 for a remainder)
        if rt.rank == 0:
            maxvio = [float(s["expert_load"].max()) / float(s["expert_load"].float().mean()) - 1 for s in stats]
            reps = [int(s["replicas"].sum()) for s in stats]
            print(f"step {step:3d}  loss {mean_loss:.4f}  maxvio " + " ".join(f"{v:5.2f}" for v in maxvio)
                  + f"  replicas {reps}  recv/rank {recv[0]}", flush=True)
    if rt.rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} in {args.steps} steps, {time.time() - t0:.1f}s")
    rt.shutdown()


if __name__ == "__main__":
    main()
