"""Combine on the host-driven path: reduce per (token, rank), send one row back, sum in rank order.

The order of every floating-point addition is fixed (choices ``k = 0..K-1`` on the destination, then
ranks ``0..R-1`` on the source), so the result is bitwise reproducible and independent of the transport.
Accumulation is fp32 for 16/32-bit inputs and fp64 for fp64.

Precision of the returned partial rows (the bytes that cross the wire): each destination's per-(token, rank)
partial sum is rounded to the **token dtype** when that is bf16 or fp16 (half the wire bytes of fp32), and
kept in the accumulation dtype for fp32/fp64.  The source then sums the rounded partials in fp32, in rank
order, and rounds once more to the output dtype.  For bf16/fp16 this adds at most one extra rounding of a
partial (relative error ~2^-8 resp. 2^-11 per partial, the precision of the output itself); fp32 and fp64
results are unchanged and exact with respect to the fixed summation order.  Every transport (host and
NVLink) applies the same rule, so results stay bitwise equal across transports.
"""
from __future__ import annotations

import torch

from .dispatch import Routing
from .transport import Transport


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the partial rows combine sends back: the token dtype for bf16/fp16, else the acc dtype."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else acc_dtype(dtype)


def gather_rows(buf: torch.Tensor, rows: torch.Tensor) -> list:
    """``K`` tensors ``[n, *D]``: ``buf[rows[:, k]]``, zero where ``rows[:, k] == -1``."""
    ext = torch.cat([buf, buf.new_zeros((1, *buf.shape[1:]))])  # row `cap` is the zero row for -1
    idx = torch.where(rows >= 0, rows, torch.full_like(rows, buf.shape[0]))
    return [ext[idx[:, k]] for k in range(rows.shape[1])]


def reduce_local(out: torch.Tensor, weights, rows: torch.Tensor) -> torch.Tensor:
    """Sum, in ``k`` order, the (weighted) rows of each received token: ``[n_recv, H]`` in acc dtype.

    Args:
        out: ``[cap, H]`` expert outputs on this rank.
        weights: ``[cap]`` routing weight of each row, or ``None`` for an unweighted sum.
        rows: int64 ``[n_recv, K]``.
    """
    adt = acc_dtype(out.dtype)
    n, K = rows.shape
    flat = rows.reshape(-1)
    valid = flat >= 0
    r = flat[valid]
    pair = torch.arange(n, device=rows.device).repeat_interleave(K)[valid]  # pair-major, k-minor order
    src = out[r].to(adt)
    if weights is not None:
        src = src * weights[r].to(adt).unsqueeze(-1)
    # index_add_ adds the copies of a pair one after another in k order: acc = ((0 + c0) + c1) + ...
    return torch.zeros((n, *out.shape[1:]), dtype=adt, device=out.device).index_add_(0, pair, src)


def sum_by_rank(back: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Sum the rows that came back from each destination rank, in rank order: ``[s, *D]``."""
    y = back.new_zeros((routing.num_tokens, *back.shape[1:]))
    start = 0
    for n in routing.send_splits:
        if n:
            # Tokens are unique inside one rank's block, so index_add_ here is an exact, ordered add.
            y.index_add_(0, routing.pair_token[start:start + n], back[start:start + n])
        start += n
    return y


def combine_rows(out: torch.Tensor, weights, routing: Routing, transport: Transport) -> torch.Tensor:
    """Full combine: ``[cap, H]`` expert outputs -> ``[s, H]`` in the accumulation dtype."""
    adt = acc_dtype(out.dtype)
    acc = reduce_local(out, weights, routing.recv_rows).to(wire_dtype(out.dtype))
    back = transport.all_to_all(acc.contiguous(), routing.recv_splits, routing.send_splits)
    return sum_by_rank(back.to(adt), routing)
