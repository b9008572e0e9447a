"""Replica weights: fetch the plan's replicas from their home rank, send their gradients back.

Every replica on a rank comes from one home rank (``plan.replica_source``), so a rank fetches weights from
a single peer and at most ``epn`` experts per projection.
"""
from __future__ import annotations

import numpy as np
import torch

from .transport import Transport

# A replica buffer owned by a ReplicaPool (nothing else writes it) carries the set of its slots known to hold
# zeros: a fetch zeroes only the empty slots that an earlier fetch filled, not all of them every step.
_ZERO = "_moonep_zero_slots"


def track_zero_slots(buffer: torch.Tensor) -> torch.Tensor:
    """Mark a freshly zeroed ``[epn, *D]`` replica buffer that only fetches write (a pool's)."""
    setattr(buffer, _ZERO, set(range(buffer.shape[0])))
    return buffer


def forget_zero_slots(buffer: torch.Tensor) -> None:
    """Another writer (the nvlink kernels) filled ``buffer``: no slot of it is known to hold zeros now."""
    if getattr(buffer, _ZERO, None) is not None:
        setattr(buffer, _ZERO, set())


def _replica_lists(plan, R: int):
    """Per rank ``u``: its source rank and the valid replica slot indices ``j`` (ascending)."""
    rep = plan.replica_experts.cpu().numpy()
    src = plan.replica_source.cpu().tolist()
    slots = [np.flatnonzero(rep[u] >= 0).tolist() for u in range(R)]
    return rep, src, slots


def _fetch_replicas(plan, rank: int, flats: list, transport: Transport):
    """Send the home rows peers replicate, receive this rank's replicas, of every projection in one all-to-all.

    Args:
        flats: ``[epn, n_i]`` this rank's home weights of each projection, one row per expert.
    Returns:
        ``(gots, slots)``: per projection the received rows ``[n, n_i]``, and the replica slot index of each
        row (ascending).  Several projections travel as the bytes of their rows side by side.
    """
    R, epn = transport.world_size, flats[0].shape[0]
    rep, src, slots = _replica_lists(plan, R)
    send_rows, send_splits = [], []
    for u in range(R):
        mine = [int(rep[u, j]) - rank * epn for j in slots[u]] if src[u] == rank else []
        send_rows += mine
        send_splits.append(len(mine))
    recv_splits = [len(slots[rank]) if r == src[rank] else 0 for r in range(R)]
    idx = torch.tensor(send_rows, dtype=torch.int64, device=flats[0].device)
    if len(flats) == 1:
        return [transport.all_to_all(flats[0][idx], send_splits, recv_splits)], slots[rank]
    parts = [f[idx].view(torch.uint8) for f in flats]  # only the sent rows are gathered
    got = transport.all_to_all(torch.cat(parts, 1), send_splits, recv_splits)
    gots, at = [], 0
    for f, part in zip(flats, parts):
        nb = part.shape[1]
        block = got.new_empty((got.shape[0], nb))  # fresh: a dtype view needs aligned offset and strides
        block.copy_(got[:, at:at + nb])
        gots.append(block.view(f.dtype))
        at += nb
    return gots, slots[rank]


def prefetch_weights(plan, rank: int, local_weight: torch.Tensor, transport: Transport) -> torch.Tensor:
    """``[epn, *D]`` home weights -> ``[2*epn, *D]``: home experts, then replica slots (zero if empty)."""
    epn = local_weight.shape[0]
    out = local_weight.new_empty((2 * epn, *local_weight.shape[1:]))
    out[:epn].copy_(local_weight)
    prefetch_replicas_into(plan, rank, [local_weight], transport, [out[epn:]])
    return out


def prefetch_replicas_into(plan, rank: int, local_weights: list, transport: Transport, replicas: list) -> list:
    """This rank's replica slots of every projection into ``replicas[i] [epn, *D_i]`` (filled slots written,
    the others zeroed), in one all-to-all; the home weights ``local_weights[i] [epn, *D_i]`` are only read.
    Returns ``replicas``."""
    if not local_weights:
        return replicas
    epn = local_weights[0].shape[0]
    gots, mine = _fetch_replicas(plan, rank, [w.reshape(epn, -1) for w in local_weights], transport)
    filled = set(mine)
    idx = {}  # the index tensors, built once per device (every projection shares them)

    def index(name, rows, device):
        if (name, device) not in idx:
            idx[name, device] = torch.tensor(rows, dtype=torch.int64, device=device)
        return idx[name, device]

    for got, buf in zip(gots, replicas):
        flat = buf.view(epn, -1)
        zero = getattr(buf, _ZERO, None)
        empty = [j for j in range(epn) if j not in filled and (zero is None or j not in zero)]
        if zero is not None:
            setattr(buf, _ZERO, set(range(epn)) - filled)
        if empty:
            flat.index_fill_(0, torch.tensor(empty, dtype=torch.int64, device=flat.device), 0)
        if mine:
            flat.index_copy_(0, index("mine", mine, flat.device), got)
    return replicas


def reduce_replica_grads(plan, rank: int, grad_view: torch.Tensor, transport: Transport) -> torch.Tensor:
    """``[2*epn, *D]`` slot gradients -> ``[epn, *D]`` home gradients, replica parts summed in rank order."""
    epn = grad_view.shape[0] // 2
    return reduce_replicas(plan, rank, grad_view[:epn], grad_view[epn:], transport)


def reduce_replicas(plan, rank: int, home_grad: torch.Tensor, replica_grad: torch.Tensor,
                    transport: Transport, scratch: bool = False) -> torch.Tensor:
    """``home_grad [epn, *D]`` plus every rank's replica gradients (``replica_grad [epn, *D]`` here) of this
    rank's experts -> ``[epn, *D]``, added in rank order (a fixed summation order).  ``scratch``: the sum is
    made in ``home_grad`` itself (a backward's own tensor: no copy of the home experts' gradients)."""
    R, epn = transport.world_size, home_grad.shape[0]
    rep, src, slots = _replica_lists(plan, R)
    flat = replica_grad.reshape(epn, -1)
    send_splits = [len(slots[rank]) if r == src[rank] else 0 for r in range(R)]
    send = flat[torch.tensor(slots[rank], dtype=torch.int64, device=flat.device)]
    recv_splits, targets = [], []
    for u in range(R):
        mine = [int(rep[u, j]) - rank * epn for j in slots[u]] if src[u] == rank else []
        targets += mine
        recv_splits.append(len(mine))
    got = transport.all_to_all(send, send_splits, recv_splits)
    home = home_grad.reshape(epn, -1)
    if not scratch:
        home = home.clone()
    for row, e in enumerate(targets):  # rows arrive grouped by rank in rank order: a fixed summation order
        home[e] += got[row]
    return home.reshape(home_grad.shape)
