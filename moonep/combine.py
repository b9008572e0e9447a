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

CPU tensors go through the numba kernels of :mod:`moonep.cpu_kernels`, which perform exactly these
operations in exactly this order (the torch code below is the reference and the path for other devices).
"""
from __future__ import annotations

import torch

from . import cpu_kernels as ck
from .handles import HostStep
from .transport import Transport


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def product_grads(g_rows: torch.Tensor, expert_out: torch.Tensor, weights, want_out: bool, want_w: bool):
    """Gradients of combine's products ``weights[i] * expert_out[i]`` from the rows' gradient.

    Args:
        g_rows: ``[cap, H]`` in ``expert_out``'s dtype: each row's gradient (combine's backward dispatch).
        expert_out: ``[cap, H]``; weights: ``[cap]`` or ``None`` (an unweighted sum).
    Returns:
        ``(g_out [cap, H] in expert_out's dtype or None, g_w [cap] in weights' dtype or None)``: both
        products in the accumulation dtype, each rounded once, bitwise as if the rows were cast first.  The
        rows' cast rides in the products (the accumulation dtype of the other factor promotes them), and
        ``g_out`` is written in its dtype directly: no cast copy of the rows.
    """
    adt = acc_dtype(expert_out.dtype)
    g_out = g_w = None
    if want_out:
        if weights is None:
            g_out = g_rows.to(expert_out.dtype, copy=True)
        elif g_rows.dtype == expert_out.dtype and not torch.is_grad_enabled():  # out= records no graph
            g_out = torch.mul(g_rows, weights.to(adt).unsqueeze(-1),
                              out=torch.empty(g_rows.shape, dtype=expert_out.dtype, device=g_rows.device))
        else:
            g_out = (g_rows.to(adt) * weights.to(adt).unsqueeze(-1)).to(expert_out.dtype)
    if want_w and weights is not None:
        g_w = torch.mul(g_rows.to(adt) if g_rows.dtype != expert_out.dtype else g_rows,
                        expert_out.to(adt)).sum(-1).to(weights.dtype)
    return g_out, g_w


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
    if out.is_cuda:
        return _reduce_local_ordered(out, weights, rows, adt)
    flat = rows.reshape(-1)
    valid = flat >= 0
    r = flat[valid]
    pair = torch.arange(n, device=rows.device).repeat_interleave(K)[valid]  # pair-major, k-minor order
    src = out[r].to(adt)
    if weights is not None:
        src = src * weights[r].to(adt).unsqueeze(-1)
    # On CPU index_add_ adds the copies of a pair one after another in k order: acc = ((0 + c0) + c1) + ...
    return torch.zeros((n, *out.shape[1:]), dtype=adt, device=out.device).index_add_(0, pair, src)


def _reduce_local_ordered(out, weights, rows, adt):
    """reduce_local for CUDA tensors: an explicit k-order sum, bitwise the CPU result. (index_add_ uses
    atomics on CUDA: repeated pairs would be summed in a different order on every run.) One choice at a
    time, so the temporaries are [n, *D], not [n, K, *D]."""
    n, K = rows.shape
    shape = (n,) + (1,) * (out.dim() - 1)
    zero = torch.zeros((), dtype=adt, device=out.device)
    acc = torch.zeros((n, *out.shape[1:]), dtype=adt, device=out.device)
    for k in range(K):
        r = rows[:, k]
        src = out[r.clamp(min=0)].to(adt)
        if weights is not None:
            src = src * weights[r.clamp(min=0)].to(adt).view(shape)
        acc += torch.where((r >= 0).view(shape), src, zero)
    return acc


def sum_by_rank(back: torch.Tensor, routing: HostStep) -> torch.Tensor:
    """Sum the rows that came back from each destination rank, in rank order: ``[s, *D]``."""
    y = back.new_zeros((routing.num_tokens, *back.shape[1:]))
    start = 0
    for n in routing.send_splits:
        if n:
            # Tokens are unique inside one rank's block, so index_add_ here is an exact, ordered add.
            y.index_add_(0, routing.pair_token[start:start + n], back[start:start + n])
        start += n
    return y


def gather_choices(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[n, K]``: ``buf[rows[:, k]]`` for a ``[cap]`` per-row tensor, zero where ``rows[:, k] == -1``."""
    if buf.device.type == "cpu":
        out = buf.new_empty(rows.shape)
        ck.gather_choices(ck.u8(buf), rows.contiguous().numpy(), ck.u8_choices(out))
        return out
    return torch.stack(gather_rows(buf, rows), dim=1)


def _cpu_fast(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def reduce_to_wire(out: torch.Tensor, weights, rows: torch.Tensor) -> torch.Tensor:
    """:func:`reduce_local` rounded to :func:`wire_dtype`: the partial rows a destination sends back."""
    wdt = wire_dtype(out.dtype)
    if out.device.type != "cpu" or not _cpu_fast(out.dtype):
        return reduce_local(out, weights, rows).to(wdt)
    adt = acc_dtype(out.dtype)
    rows_np = rows.contiguous().numpy()
    w = (weights.detach().to(adt).contiguous() if weights is not None else torch.zeros(1, dtype=adt)).numpy()
    use_w = weights is not None
    out = out.detach().contiguous()
    H = 1
    for d in out.shape[1:]:
        H *= d
    if out.dtype == torch.bfloat16:
        part = torch.empty((rows.shape[0], *out.shape[1:]), dtype=wdt)
        ck.reduce_pairs_bf16(ck.bits16(out).reshape(out.shape[0], H), w, use_w, rows_np,
                             ck.bits16(part).reshape(part.shape[0], H), ck.bf16_nan_bits())
        return part
    src = out.to(adt)  # fp16 widens exactly; fp32/fp64: no copy
    part = torch.empty((rows.shape[0], *out.shape[1:]), dtype=adt)
    ck.reduce_pairs_float(src.numpy().reshape(src.shape[0], H), w, use_w, rows_np,
                          part.numpy().reshape(part.shape[0], H))
    return part.to(wdt)


def sum_by_rank_to(back: torch.Tensor, routing: HostStep, out_dtype: torch.dtype) -> torch.Tensor:
    """``sum_by_rank(back.to(acc_dtype)).to(out_dtype)`` (the source side of combine)."""
    adt = acc_dtype(back.dtype)
    if back.device.type != "cpu" or not _cpu_fast(back.dtype) or not _cpu_fast(out_dtype):
        return sum_by_rank(back.to(adt), routing).to(out_dtype)
    start, pairs = token_order(routing)
    s = routing.num_tokens
    back = back.detach().contiguous()
    H = 1
    for d in back.shape[1:]:
        H *= d
    if back.dtype == torch.bfloat16 and out_dtype == torch.bfloat16:
        y = torch.empty((s, *back.shape[1:]), dtype=torch.bfloat16)
        ck.sum_by_rank_bf16(ck.bits16(back).reshape(back.shape[0], H), start, pairs,
                            ck.bits16(y).reshape(s, H), ck.bf16_nan_bits())
        return y
    src = back.to(adt)
    y = torch.empty((s, *back.shape[1:]), dtype=adt)
    ck.sum_by_rank_float(src.numpy().reshape(src.shape[0], H), start, pairs, y.numpy().reshape(s, H))
    return y.to(out_dtype)


def sum_choices_by_rank(back: torch.Tensor, routing: HostStep) -> torch.Tensor:
    """:func:`sum_by_rank` in ``back``'s own dtype (the per-choice weight gradients, ``[n_send, K]``)."""
    if back.device.type == "cpu" and back.dtype in (torch.float32, torch.float64):
        start, pairs = token_order(routing)
        back = back.detach().contiguous()
        y = back.new_empty((routing.num_tokens, back.shape[1]))
        ck.sum_by_rank_float(back.numpy(), start, pairs, y.numpy())
        return y
    return sum_by_rank(back, routing)


def token_order(routing: HostStep):
    """The pairs of each local token in rank order, as a CSR ``(start [s+1], pairs [n_send])`` (cached)."""
    got = routing.cache.get("token_order")
    if got is None:
        got = ck.token_order(routing.pair_token.numpy(), routing.num_tokens)
        routing.cache["token_order"] = got
    return got


def combine_rows(out: torch.Tensor, weights, routing: HostStep, transport: Transport,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Full combine: ``[cap, H]`` expert outputs -> ``[s, H]`` in ``out_dtype`` (default: the acc dtype).

    The result is the acc-dtype sum rounded once to ``out_dtype``."""
    adt = acc_dtype(out.dtype)
    part = reduce_to_wire(out, weights, routing.recv_rows)
    back = transport.all_to_all(part.contiguous(), routing.recv_splits, routing.send_splits)
    return sum_by_rank_to(back, routing, adt if out_dtype is None else out_dtype)
