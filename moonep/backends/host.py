"""The host-driven backend: MPI (mpi4py) or torch.distributed (gloo, NCCL) with host-known split sizes.

Each step all-gathers the routing counts, plans on every rank (the same plan everywhere), computes this
rank's destinations, then moves rows with ``all_to_all``: one row per (token, destination rank) out, one
partial sum per (token, rank) back.  The row operations are :mod:`moonep.dispatch`, :mod:`moonep.combine`
and :mod:`moonep.replicas` (numba kernels for CPU tensors, torch ops elsewhere); the bytes move through a
:class:`moonep.transport.Transport`.  Errors in one rank's routing values are gathered with the counts, so
every rank raises the same ``ValueError``.
"""
from __future__ import annotations

import torch

from .. import cpu_kernels, layout
from ..combine import combine_rows, gather_choices, sum_choices_by_rank
from ..dispatch import build_routing, dispatch_packed, expand, expand_weights, pick_weights, send_tokens
from ..errors import RefusedEverywhere, expect, raise_together
from ..handles import HostStep
from ..planner import plan_balanced
from ..replicas import (prefetch_replicas_into, prefetch_weights, reduce_replica_grads,
                        reduce_replicas)
from .base import Backend


class HostBackend(Backend):
    """Rows through ``transport`` (``"mpi"`` or ``"torch"``), planning on every rank."""

    step_type = HostStep

    def __init__(self, ep, transport):
        self.transport, self.name = transport, transport.name
        self.rank, self.world_size, self.device = ep.rank, ep.world_size, ep.device
        self.num_experts, self.capacity, self.align, self.slack = ep.num_experts, ep.capacity, ep.align, ep.slack

    def abandon_call(self, why: str) -> None:
        self.transport.abandon_call(why)

    # -- plan --------------------------------------------------------------------------------------
    def _check_values(self, topk_idx, topk_weights) -> None:
        """Expert ids in range and distinct per token, finite weights (raises ``ValueError``)."""
        E = self.num_experts
        if topk_idx.device.type == "cpu":
            lo, hi, i = cpu_kernels.check_topk(topk_idx.to(torch.int64).contiguous().numpy())
            expect(lo >= -1 and hi < E, "topk_idx", f"expert ids in [-1, {E})", f"values in [{lo}, {hi}]")
            if i >= 0:
                raise ValueError(f"topk_idx: expected distinct experts per token, got {topk_idx[i].tolist()} "
                                 f"for token {i}")
        else:
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            expect(lo >= -1 and hi < E, "topk_idx", f"expert ids in [-1, {E})", f"values in [{lo}, {hi}]")
            srt = topk_idx.sort(dim=1).values
            dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(dim=1)
            if bool(dup.any()):
                i = int(dup.nonzero()[0, 0])
                raise ValueError(f"topk_idx: expected distinct experts per token, got {topk_idx[i].tolist()} "
                                 f"for token {i}")
        bad = ~torch.isfinite(topk_weights)
        if bool(bad.any()):
            i = int(bad.any(dim=1).nonzero()[0, 0])
            raise ValueError(f"topk_weights: expected finite values, got {topk_weights[i].tolist()} "
                             f"for token {i}")

    def plan_step(self, x, topk_idx, topk_weights, num_global_tokens=None):
        E = self.num_experts
        err = None
        try:
            if x.shape[0]:
                self._check_values(topk_idx, topk_weights)
            idx = topk_idx.to(torch.int64)
            counts = torch.bincount(idx[idx >= 0], minlength=E).to(torch.int64)
            s = x.shape[0]
        except ValueError as exc:
            err = str(exc)
        if err is not None:
            counts, s = torch.zeros(E, dtype=torch.int64, device=self.device), 0
        # One gather carries the counts, s and an error flag, so bad input on one rank fails every rank.
        flag = torch.tensor([s, err is not None], dtype=torch.int64, device=counts.device)
        meta = self.transport.all_gather(torch.cat([counts, flag]))
        if bool(meta[:, -1].any()):
            raise_together(err, self.transport.all_gather_object)
        if num_global_tokens is not None:  # the same on every rank (the call's signature): all raise together
            total = int(meta[:, E].sum())
            if total != num_global_tokens:
                raise RefusedEverywhere(f"num_global_tokens: expected the sum of tokens over ranks ({total}), "
                                        f"got {num_global_tokens}")
        plan = plan_balanced(meta[:, :E].contiguous(), slack=self.slack)
        st = build_routing(plan, self.rank, topk_idx.to(torch.int64), self.transport, self.capacity,
                           align=self.align, exchange_rows=x.device.type != "cpu")
        return plan, st

    def slots(self, plan, st):
        return layout.cu_seqlens(plan, self.rank, align=self.align), layout.slot_experts(plan, self.rank)

    # -- rows --------------------------------------------------------------------------------------
    def dispatch(self, x, topk_weights, st, tracked):
        if st.recv_rows is None:  # CPU: tokens, row lists and weights travel in one message
            return dispatch_packed(x, topk_weights, st, self.transport)
        tokens = expand(send_tokens(x, st, self.transport), st.recv_rows, st.capacity)
        recv_w = self.transport.all_to_all(pick_weights(topk_weights, st), st.send_splits, st.recv_splits)
        return tokens, expand_weights(recv_w, st.recv_rows, st.capacity)

    def combine(self, rows, weights, st, out_dtype):
        return combine_rows(rows, weights, st, self.transport, out_dtype)

    def dispatch_backward(self, g_tokens, g_weights, st, want_x, want_w, x_dtype, w_dtype):
        # dx: a combine of the rows' gradients without weights (the sum of the token's copies)
        gx = combine_rows(g_tokens, None, st, self.transport, x_dtype) if want_x else None
        gw = None
        if want_w:
            # Per-choice weight gradients travel back K-aligned; each (token, k) is non-zero on one rank.
            back = gather_choices(g_weights, st.recv_rows)
            back = self.transport.all_to_all(back.contiguous(), st.recv_splits, st.send_splits)
            gw = sum_choices_by_rank(back, st).to(w_dtype)
        return gx, gw

    def combine_backward(self, gy, st, own: bool = False):
        return expand(send_tokens(gy.contiguous(), st, self.transport), st.recv_rows, st.capacity)

    # -- replica weights ---------------------------------------------------------------------------
    def prefetch(self, plan, local_weight):
        return prefetch_weights(plan, self.rank, local_weight.contiguous(), self.transport)

    def prefetch_replicas(self, plan, local_weights, replicas, fresh: bool = False):
        # a buffer without the pool's zero-slot set (a fresh one) gets every empty slot zeroed
        return prefetch_replicas_into(plan, self.rank, local_weights, self.transport, replicas)

    def reduce_grad(self, plan, grad):
        return reduce_replica_grads(plan, self.rank, grad.contiguous(), self.transport)

    def reduce_replicas(self, plan, home_grad, replica_grad, scratch: bool = False):
        return reduce_replicas(plan, self.rank, home_grad.contiguous(), replica_grad.contiguous(), self.transport,
                               scratch=scratch)
