"""An end-to-end MoE layer step whose expert time follows the rows each rank received.

moonep:    dispatch -> prefetch the three projections' replicas into persistent pools -> SwiGLU over the
           ``2*epn`` slots -> combine
Megatron:  permute + all-to-all (host-known splits) + regroup -> SwiGLU over the ``epn`` home experts
           -> un-regroup + all-to-all + weighted scatter-add

The expert is ``(silu(x W_g) * (x W_u)) W_d`` with ``W_g, W_u: [H, F]`` and ``W_d: [F, H]`` per expert,
run by :func:`moonep.layers.grouped.slot_matmul` (``torch._grouped_mm`` with device offsets on CUDA, a
loop over slots elsewhere), so its cost is proportional to the rows a rank received: under imbalance the
Megatron path's most loaded rank computes longest and every other rank waits for it in combine.

Each projection lives in a persistent ``[2*epn, ...]`` slot pool allocated once; its home weights are the
view ``pool[:epn]`` (what both paths compute with), so ``ep.prefetch(h, home, out=pool)`` copies nothing
for the home experts and writes only the replica slots ``pool[epn:]``.  The three projections are
distinct tensors: the bytes moved and the FLOPs are those of three projections.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moonep.layers.grouped import slot_matmul


class ExpertWeights:
    """This rank's ``epn`` experts: three projections ``[epn, H, F]``, ``[epn, H, F]``, ``[epn, F, H]`` in
    ``dtype``, each the home half of a persistent ``[2*epn, ...]`` slot pool (``pools``) whose second half
    ``ep.prefetch(h, home, out=pool)`` fills with the step's replicas."""

    def __init__(self, epn: int, H: int, ffn: int, dtype, device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.epn, self.H, self.ffn = epn, H, ffn
        self.pools = tuple(torch.zeros(2 * epn, *shape, dtype=dtype, device=device)
                           for shape in ((H, ffn), (H, ffn), (ffn, H)))
        for pool in self.pools:
            pool[:epn].normal_(0.0, H ** -0.5, generator=gen)
        self.gate, self.up, self.down = (pool[:epn] for pool in self.pools)

    @property
    def projections(self):
        """The home weights, views of the pools' first halves."""
        return (self.gate, self.up, self.down)

    def nbytes_per_expert(self) -> int:
        """Bytes of one expert's three projections."""
        return 3 * self.H * self.ffn * self.pools[0].element_size()


def swiglu_experts(a, cu_seqlens, wg, wu, wd):
    """Rows grouped by slot ``[n, H]`` -> ``[n, H]``; slot ``j`` uses ``wg[j], wu[j], wd[j]``."""
    g = slot_matmul(a, cu_seqlens, wg)
    u = slot_matmul(a, cu_seqlens, wu)
    return slot_matmul(F.silu(g) * u, cu_seqlens, wd)


def moonep_step(ep, x, idx, w, weights: ExpertWeights):
    """One forward layer step on moonep; returns ``(y [s, H], h)``."""
    h = ep.dispatch(x, idx, w)
    wg, wu, wd = (ep.prefetch(h, p, out=pool) for p, pool in zip(weights.projections, weights.pools))
    out = swiglu_experts(h.tokens, h.cu_seqlens, wg, wu, wd)
    return ep.combine(out, h), h


def megatron_step(meg, x, idx, w, weights: ExpertWeights):
    """One forward layer step on the Megatron-style path; returns ``(y [s, H], rows received)``."""
    tokens, ctx = meg.dispatch(x, idx)
    out = swiglu_experts(tokens, ctx["cu_seqlens"], *weights.projections)
    return meg.combine(out, w, ctx), ctx["n_recv"]
