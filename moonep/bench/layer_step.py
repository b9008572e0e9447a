"""An end-to-end MoE layer step whose expert time follows the rows each rank received.

moonep:    dispatch -> prefetch the three projections' replicas -> SwiGLU over the ``2*epn`` slots -> combine
Megatron:  permute + all-to-all (host-known splits) + regroup -> SwiGLU over the ``epn`` home experts
           -> un-regroup + all-to-all + weighted scatter-add

The expert is ``(silu(x W_g) * (x W_u)) W_d`` with ``W_g, W_u: [H, F]`` and ``W_d: [F, H]`` per expert,
run by :func:`moonep.layers.grouped.slot_matmul` (``torch._grouped_mm`` with device offsets on CUDA, a
loop over slots elsewhere), so its cost is proportional to the rows a rank received: under imbalance the
Megatron path's most loaded rank computes longest and every other rank waits for it in combine.

To keep memory bounded the three projections share one ``[epn, H*F]`` home tensor (viewed as ``[H, F]``
or ``[F, H]``): the bytes moved and the FLOPs are those of three distinct projections.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moonep.layers.grouped import slot_matmul


class ExpertWeights:
    """Home weights of this rank's ``epn`` experts: three projections ``[epn, H, F]``, ``[epn, H, F]``,
    ``[epn, F, H]`` in ``dtype`` (one shared buffer)."""

    def __init__(self, epn: int, H: int, ffn: int, dtype, device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.flat = torch.empty(epn, H * ffn, dtype=dtype, device=device).normal_(0.0, H ** -0.5, generator=gen)
        self.epn, self.H, self.ffn = epn, H, ffn
        self.gate = self.flat.view(epn, H, ffn)
        self.up = self.gate
        self.down = self.flat.view(epn, ffn, H)

    @property
    def projections(self):
        return (self.gate, self.up, self.down)

    def nbytes_per_expert(self) -> int:
        """Bytes of one expert's three projections."""
        return 3 * self.H * self.ffn * self.flat.element_size()


def swiglu_experts(a, cu_seqlens, wg, wu, wd):
    """Rows grouped by slot ``[n, H]`` -> ``[n, H]``; slot ``j`` uses ``wg[j], wu[j], wd[j]``."""
    g = slot_matmul(a, cu_seqlens, wg)
    u = slot_matmul(a, cu_seqlens, wu)
    return slot_matmul(F.silu(g) * u, cu_seqlens, wd)


def moonep_step(ep, x, idx, w, weights: ExpertWeights):
    """One forward layer step on moonep; returns ``(y [s, H], h)``."""
    h = ep.dispatch(x, idx, w)
    wg, wu, wd = (ep.prefetch(h, p) for p in weights.projections)
    out = swiglu_experts(h.tokens, h.cu_seqlens, wg, wu, wd)
    return ep.combine(out, h), h


def megatron_step(meg, x, idx, w, weights: ExpertWeights):
    """One forward layer step on the Megatron-style path; returns ``(y [s, H], rows received)``."""
    tokens, ctx = meg.dispatch(x, idx)
    out = swiglu_experts(tokens, ctx["cu_seqlens"], *weights.projections)
    return meg.combine(out, w, ctx), ctx["n_recv"]
