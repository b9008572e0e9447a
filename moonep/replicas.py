"""Replica weights: fetch the plan's replicas from their home rank, send their gradients back.

Every replica on a rank comes from one home rank (``plan.replica_source``), so a rank fetches weights from
a single peer and at most ``epn`` experts per projection.
"""
from __future__ import annotations

import torch

from .transport import Transport


def _replica_lists(plan, R: int):
    """Per rank ``u``: its source rank and the valid replica slot indices ``j`` (ascending)."""
    rep = plan.replica_experts.cpu()
    src = plan.replica_source.cpu().tolist()
    slots = [[j for j in range(rep.shape[1]) if rep[u, j] >= 0] for u in range(R)]
    return rep, src, slots


def prefetch_weights(plan, rank: int, local_weight: torch.Tensor, transport: Transport) -> torch.Tensor:
    """``[epn, *D]`` home weights -> ``[2*epn, *D]``: home experts, then replica slots (zero if empty)."""
    R, epn = transport.world_size, local_weight.shape[0]
    rep, src, slots = _replica_lists(plan, R)
    flat = local_weight.reshape(epn, -1)
    send_rows, send_splits = [], []
    for u in range(R):
        mine = [int(rep[u, j]) - rank * epn for j in slots[u]] if src[u] == rank else []
        send_rows += mine
        send_splits.append(len(mine))
    recv_splits = [len(slots[rank]) if r == src[rank] else 0 for r in range(R)]
    idx = torch.tensor(send_rows, dtype=torch.int64, device=flat.device)
    got = transport.all_to_all(flat[idx], send_splits, recv_splits)
    replicas = flat.new_zeros((epn, flat.shape[1]))
    if slots[rank]:
        replicas[torch.tensor(slots[rank], device=flat.device)] = got
    return torch.cat([flat, replicas]).reshape(2 * epn, *local_weight.shape[1:])


def reduce_replica_grads(plan, rank: int, grad_view: torch.Tensor, transport: Transport) -> torch.Tensor:
    """``[2*epn, *D]`` slot gradients -> ``[epn, *D]`` home gradients, replica parts summed in rank order."""
    R, epn = transport.world_size, grad_view.shape[0] // 2
    rep, src, slots = _replica_lists(plan, R)
    flat = grad_view.reshape(2 * epn, -1)
    send_splits = [len(slots[rank]) if r == src[rank] else 0 for r in range(R)]
    send = flat[torch.tensor([epn + j for j in slots[rank]], dtype=torch.int64, device=flat.device)]
    recv_splits, targets = [], []
    for u in range(R):
        mine = [int(rep[u, j]) - rank * epn for j in slots[u]] if src[u] == rank else []
        targets += mine
        recv_splits.append(len(mine))
    got = transport.all_to_all(send, send_splits, recv_splits)
    home = flat[:epn].clone()
    for row, e in enumerate(targets):  # rows arrive grouped by rank in rank order: a fixed summation order
        home[e] += got[row]
    return home.reshape(epn, *grad_view.shape[1:])
