"""Dispatch on the host-driven path: pack one row per (token, destination rank), exchange, expand.

A token is sent **once per destination rank**, whatever number of its K copies land there, together with
the K-aligned list of its rows on that rank (``-1`` for choices that go elsewhere). The receiver copies
it into all of those rows: that local expansion is the dispatch epilogue, and local copies are far
cheaper than wire bytes.

All functions take and return plain tensors; :mod:`moonep.backends.host` composes them and the autograd
wiring lives in ``moonep.ep``. CPU tensors go
through the numba kernels of :mod:`moonep.cpu_kernels` (byte copies, same results), others through torch.
"""
from __future__ import annotations

import torch

from . import cpu_kernels as ck
from . import layout
from .handles import HostStep
from .transport import Transport


def build_routing(plan, rank: int, topk_idx: torch.Tensor, transport: Transport, capacity: int,
                  align: int = 1, exchange_rows: bool = True) -> HostStep:
    """Compute this rank's destinations from the plan, then swap row lists with the peers.

    Args:
        plan: the :class:`moonep.planner.Plan` every rank computed from the same counts.
        topk_idx: int64 ``[s, K]`` expert ids, ``-1`` for masked choices.
        exchange_rows: ``False`` (CPU tensors only) leaves ``recv_rows`` and ``recv_splits`` ``None``:
            :func:`dispatch_packed` then carries the row lists in the same message as the tokens, and learns
            the splits with it (two collectives fewer on the MPI transport, one on others).
    """
    R = transport.world_size
    s, K = topk_idx.shape
    if topk_idx.device.type == "cpu":  # numba passes (plan_step checked this routing and counted it into the plan)
        dst_rank, dst_row = layout.destinations_cpu(plan, rank, topk_idx, align)
        pair_token, send_rows, splits = ck.route_pairs(dst_rank.numpy(), dst_row.numpy(), R)
        pair_token, send_rows = torch.from_numpy(pair_token), torch.from_numpy(send_rows)
        send_splits = splits.tolist()
        if not exchange_rows:  # dispatch_packed learns recv_splits with the rows (all_to_all_sized)
            return HostStep(s, pair_token, send_rows, send_splits, None, None, capacity)
        recv_splits = transport.all_to_all(torch.from_numpy(splits)[:, None], [1] * R, [1] * R)[:, 0].tolist()
        recv_rows = transport.all_to_all(send_rows, send_splits, recv_splits)
        return HostStep(s, pair_token, send_rows, send_splits, recv_rows, recv_splits, capacity)
    dst_rank, dst_row = layout.token_destinations(plan, rank, topk_idx, align=align)
    hits = torch.zeros(s, R + 1, dtype=torch.bool, device=topk_idx.device)
    col = torch.where(dst_rank >= 0, dst_rank, torch.full_like(dst_rank, R))  # column R: masked choices
    hits[torch.arange(s, device=topk_idx.device).repeat_interleave(K), col.reshape(-1)] = True
    hits = hits[:, :R]
    pair_rank, pair_token = hits.t().nonzero(as_tuple=True)  # sorted by rank, then token
    send_splits = hits.sum(0).tolist()
    send_rows = torch.where(dst_rank[pair_token] == pair_rank[:, None], dst_row[pair_token],
                            torch.full_like(dst_row[pair_token], -1))
    splits = torch.tensor(send_splits, dtype=torch.int64, device=topk_idx.device)[:, None]
    recv_splits = transport.all_to_all(splits, [1] * R, [1] * R)[:, 0].tolist()
    recv_rows = transport.all_to_all(send_rows, send_splits, recv_splits)
    return HostStep(s, pair_token, send_rows, send_splits, recv_rows, recv_splits, capacity)


def dispatch_packed(x: torch.Tensor, topk_weights: torch.Tensor, routing: HostStep, transport: Transport):
    """CPU dispatch in one exchange: each wire row is the token's bytes, its K int32 destination rows and
    its K routing weights (zero for choices that go elsewhere). Fills ``routing.recv_rows`` and
    ``routing.recv_splits``.

    Returns:
        ``(tokens [capacity, H], weights [capacity])`` exactly as ``expand``/``expand_weights`` of the
        separate exchanges would.
    """
    n, K = routing.send_rows.shape
    bx = x.shape[1] * x.element_size()  # x is [s, H]
    bw = topk_weights.element_size()
    send = torch.empty((n, bx + K * (4 + bw)), dtype=torch.uint8)
    ck.pack_pairs(ck.u8(x), ck.u8_choices(topk_weights), routing.pair_token.numpy(), routing.send_rows.numpy(),
                  send.numpy())
    recv, routing.recv_splits = transport.all_to_all_sized(send, routing.send_splits)
    tokens = x.new_empty((routing.capacity, *x.shape[1:]))
    weights = topk_weights.new_empty(routing.capacity)
    rows = torch.empty((recv.shape[0], K), dtype=torch.int64)
    ck.unpack_pairs(recv.numpy(), ck.u8(tokens), ck.u8(weights), rows.numpy())
    routing.recv_rows = rows
    return tokens, weights


def send_tokens(x: torch.Tensor, routing: HostStep, transport: Transport) -> torch.Tensor:
    """Send row ``x[i]`` once to each destination rank of token ``i``.

    Args:
        x: ``[s, H]`` on the source rank.
    Returns:
        ``[n_recv, H]``: the rows this rank received, grouped by source rank.
    """
    if x.device.type == "cpu":
        send = torch.empty((routing.pair_token.shape[0], *x.shape[1:]), dtype=x.dtype)
        ck.gather_rows(ck.u8(x), routing.pair_token.numpy(), ck.u8(send))
    else:
        send = x[routing.pair_token]
    return transport.all_to_all(send, routing.send_splits, routing.recv_splits)


def expand(recv: torch.Tensor, rows: torch.Tensor, capacity: int) -> torch.Tensor:
    """Copy each received row into all of its slot rows (the dispatch epilogue).

    Args:
        recv: ``[n_recv, *D]`` received rows.
        rows: int64 ``[n_recv, K]`` destination rows, ``-1`` for none.
    Returns:
        ``[capacity, *D]``, zero in rows nobody writes.
    """
    if recv.device.type == "cpu":
        out = recv.new_empty((capacity, *recv.shape[1:]))
        ck.expand_rows(ck.u8(recv), rows.contiguous().numpy(), ck.u8(out))
        return out
    out = recv.new_zeros((capacity, *recv.shape[1:]))
    flat = rows.reshape(-1)
    valid = flat >= 0
    src = torch.arange(rows.shape[0], device=rows.device).repeat_interleave(rows.shape[1])
    out[flat[valid]] = recv[src[valid]]
    return out


def pick_weights(topk_weights: torch.Tensor, routing: HostStep) -> torch.Tensor:
    """``[n_send, K]``: the routing weights of each sent pair, zero for choices that go elsewhere."""
    if topk_weights.device.type == "cpu":
        out = topk_weights.new_empty(routing.send_rows.shape)
        ck.pick_choices(ck.u8_choices(topk_weights), routing.pair_token.numpy(), routing.send_rows.numpy(),
                        ck.u8_choices(out))
        return out
    return torch.where(routing.send_rows >= 0, topk_weights[routing.pair_token],
                       torch.zeros((), dtype=topk_weights.dtype, device=topk_weights.device))


def expand_weights(recv_w: torch.Tensor, rows: torch.Tensor, capacity: int) -> torch.Tensor:
    """Scatter K-aligned per-choice values ``[n_recv, K]`` to their rows: ``[capacity]`` (zero elsewhere)."""
    if recv_w.device.type == "cpu":
        out = recv_w.new_empty(capacity)
        ck.scatter_choices(ck.u8_choices(recv_w), rows.contiguous().numpy(), ck.u8(out))
        return out
    out = recv_w.new_zeros(capacity)
    valid = rows >= 0
    out[rows[valid]] = recv_w[valid]
    return out
