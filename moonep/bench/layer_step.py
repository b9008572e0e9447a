"""An end-to-end MoE layer step (forward only: the inference step) whose expert time follows the rows each
rank received.

moonep:    dispatch -> ReplicaPool.fetch of the three projections' replicas -> SwiGLU over the ``2*epn``
           slots (:func:`moonep.expert_matmul`: home rows on the home weights in place, replica rows on
           the pool) -> combine
Megatron:  permute + all-to-all (host-known splits) + regroup -> SwiGLU over the ``epn`` home experts
           (:func:`moonep.slot_matmul`) -> un-regroup + all-to-all + weighted scatter-add

The expert is ``(silu(x W_g) * (x W_u)) W_d`` with ``W_g, W_u: [H, F]`` and ``W_d: [F, H]`` per expert.
Its cost is proportional to the rows a rank received: under imbalance the Megatron path's most loaded rank
computes longest and every other rank waits for it in combine.  The three projections are distinct
tensors: the bytes moved and the FLOPs are those of three projections.  The training step (forward and
backward) is :mod:`moonep.bench.training_step`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moonep.experts import ReplicaPool, expert_matmul, slot_matmul

NAMES = ("w_gate", "w_up", "w_down")


class ExpertWeights:
    """This rank's ``epn`` experts: three projections ``[epn, H, ffn]``, ``[epn, H, ffn]``, ``[epn, ffn, H]``
    in ``dtype`` (``projections``), and the :class:`moonep.ReplicaPool` their replicas are fetched into."""

    def __init__(self, epn: int, H: int, ffn: int, dtype, device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.epn, self.H, self.ffn = epn, H, ffn
        self.projections = tuple((torch.randn(epn, *shape, generator=gen, device=device) * shape[0] ** -0.5)
                                 .to(dtype) for shape in ((H, ffn), (H, ffn), (ffn, H)))
        self.pool = ReplicaPool()

    def fetch(self, ep, h):
        """This step's replicas of the three projections (collective)."""
        return fetch_replicas(self.pool, ep, h, self.projections)

    def nbytes_per_expert(self) -> int:
        """Bytes of one expert's three projections."""
        return 3 * self.H * self.ffn * self.projections[0].element_size()


def swiglu_experts(a, cu_seqlens, wg, wu, wd):
    """Rows grouped by slot ``[n, H]`` -> ``[n, H]``; slot ``j`` uses ``wg[j], wu[j], wd[j]``."""
    g = slot_matmul(a, cu_seqlens, wg)
    u = slot_matmul(a, cu_seqlens, wu)
    return slot_matmul(F.silu(g) * u, cu_seqlens, wd)


def fetch_replicas(pool, ep, h, projections):
    """This step's replicas of the three projections ``(w_gate, w_up, w_down)`` from ``pool`` (collective)."""
    return pool.fetch(ep, h, list(projections), list(NAMES))  # one collective


def moonep_experts(h, projections, reps):
    """The SwiGLU experts over the ``2*epn`` slots of ``h``: ``projections`` the home ``(w_gate, w_up,
    w_down)``, ``reps`` their replicas (:func:`fetch_replicas`)."""
    (wg, wu, wd), (rg, ru, rd), cu = projections, reps, h.cu_seqlens
    g = expert_matmul(h.tokens, cu, wg, rg)
    u = expert_matmul(h.tokens, cu, wu, ru)
    return expert_matmul(F.silu(g) * u, cu, wd, rd)


def moonep_step(ep, x, idx, w, weights: ExpertWeights):
    """One forward layer step on moonep; returns ``(y [s, H], h)``."""
    h = ep.dispatch(x, idx, w)
    out = moonep_experts(h, weights.projections, weights.fetch(ep, h))
    return ep.combine(out, h), h


def megatron_step(meg, x, idx, w, weights: ExpertWeights):
    """One forward layer step on the Megatron-style path; returns ``(y [s, H], rows received)``."""
    tokens, ctx = meg.dispatch(x, idx)
    out = swiglu_experts(tokens, ctx["cu_seqlens"], *weights.projections)
    return meg.combine(out, w, ctx), ctx["n_recv"]
