"""numba kernels for the host-driven data path on CPU tensors (dispatch expand, combine reduce, rank sum).

They reproduce the torch reference arithmetic of :mod:`moonep.dispatch` / :mod:`moonep.combine` bit for
bit (the GPU path is checked bitwise against it):

* row copies move bytes (``uint8`` views), so one specialisation serves every dtype;
* the local reduce computes, per received pair, ``acc = 0; acc = acc + w * o`` in ``k`` order with a
  separate fp32 (fp64) multiply and add (numba does not contract them into FMAs without ``fastmath``);
  bf16 rows are widened exactly (``bits << 16``) and the partial is rounded to bf16 with
  round-to-nearest-even, NaN mapped to the pattern torch's CPU conversion produces on this machine;
* the source sums the partials of each token in rank order starting from ``0`` (``0 + -0 == +0`` as in
  ``zeros().index_add_()``).

Single-threaded on purpose: MPI ranks already share the cores. Every kernel is compiled once per dtype it
sees (``cache=True`` keeps the machine code on disk for the next process). Use :func:`u8` to get the
byte view of a CPU tensor; callers keep CUDA tensors on the torch path.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

__all__ = ["dense", "u8", "u8_choices", "bits16", "bf16_nan_bits", "gather_rows", "expand_rows", "scatter_choices",
           "gather_choices", "pick_choices", "reduce_pairs_bf16", "reduce_pairs_float",
           "pack_pairs", "unpack_pairs", "token_order", "sum_by_rank_bf16", "sum_by_rank_float", "route_pairs", "check_topk",
           "copy_destinations", "slot_offsets"]


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` (detached) with row-major strides: itself when it has them, else a copy.

    Why not ``contiguous()``: it leaves an empty tensor, and a dimension of size 1, with any stride (the
    ``[0, H]`` gradient of ``y.sum()`` has strides ``(0, 0)``), and a byte view needs the last stride 1."""
    t = t.detach()
    want, step = [], 1
    for n in reversed(t.shape):
        want.append(step)
        step *= max(n, 1)
    if t.stride() == tuple(reversed(want)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def u8(t: torch.Tensor) -> np.ndarray:
    """Byte view ``[t.shape[0], bytes per row]`` of a CPU tensor (``t``'s memory when row-major, else a copy's)."""
    t = dense(t)
    row = 1
    for d in t.shape[1:]:
        row *= d
    return t.reshape(t.shape[0], row).view(torch.uint8).numpy()


def u8_choices(t: torch.Tensor) -> np.ndarray:
    """``[n, K, itemsize]`` byte view of an ``[n, K]`` CPU tensor (a copy unless row-major)."""
    n, K = t.shape
    return dense(t).view(torch.uint8).numpy().reshape(n, K, t.element_size())


def bits16(t: torch.Tensor) -> np.ndarray:
    """``uint16`` numpy view of a bf16/fp16 CPU tensor (a copy unless row-major)."""
    return dense(t).view(torch.int16).numpy().view(np.uint16)


_NAN_BITS = None


def bf16_nan_bits() -> int:
    """The bf16 pattern torch's (vectorised) fp32 -> bf16 conversion gives a NaN on this machine.

    AVX2/AVX-512 builds produce ``0xFFFF`` whatever the NaN's sign or payload, the scalar path ``0x7FC0``.
    Probed once with the same kind of contiguous conversion ``combine`` used to do."""
    global _NAN_BITS
    if _NAN_BITS is None:
        probe = np.full(64, 0x7FC00000, dtype=np.uint32)
        probe[1::2] = 0xFFC00001
        got = bits16(torch.from_numpy(probe.view(np.float32)).to(torch.bfloat16))
        _NAN_BITS = int(got[0])
        if not (got == got[0]).all():  # payload-dependent: never seen; keep the kernels honest
            raise RuntimeError("moonep.cpu_kernels: torch's bf16 NaN rounding depends on the payload")
    return _NAN_BITS


# -- byte copies ---------------------------------------------------------------------------------------
@njit(cache=True)
def gather_rows(src, idx, out):
    """``out[j] = src[idx[j]]`` (byte rows)."""
    B = src.shape[1]
    for j in range(idx.shape[0]):
        i = idx[j]
        for b in range(B):
            out[j, b] = src[i, b]


@njit(cache=True)
def expand_rows(recv, rows, out):
    """``out[rows[p, k]] = recv[p]`` for every ``rows[p, k] >= 0``; every other row of ``out`` is zeroed."""
    n, K = rows.shape
    cap, B = out.shape
    written = np.zeros(cap, np.bool_)
    for p in range(n):
        for k in range(K):
            r = rows[p, k]
            if r >= 0:
                written[r] = True
                for b in range(B):
                    out[r, b] = recv[p, b]
    for r in range(cap):
        if not written[r]:
            for b in range(B):
                out[r, b] = 0


@njit(cache=True)
def scatter_choices(vals, rows, out):
    """``out[rows[p, k]] = vals[p, k]`` (byte elements ``[n, K, B]`` -> ``[cap, B]``), zero elsewhere."""
    n, K = rows.shape
    cap, B = out.shape
    for r in range(cap):
        for b in range(B):
            out[r, b] = 0
    for p in range(n):
        for k in range(K):
            r = rows[p, k]
            if r >= 0:
                for b in range(B):
                    out[r, b] = vals[p, k, b]


@njit(cache=True)
def gather_choices(src, rows, out):
    """``out[p, k] = src[rows[p, k]]``, zero bytes where ``rows[p, k] < 0`` (``[cap, B]`` -> ``[n, K, B]``)."""
    n, K = rows.shape
    B = src.shape[1]
    for p in range(n):
        for k in range(K):
            r = rows[p, k]
            for b in range(B):
                out[p, k, b] = src[r, b] if r >= 0 else 0


@njit(cache=True)
def pick_choices(vals, pair_token, send_rows, out):
    """``out[p, k] = vals[pair_token[p], k]`` where ``send_rows[p, k] >= 0``, else zero bytes."""
    n, K = send_rows.shape
    B = vals.shape[2]
    for p in range(n):
        i = pair_token[p]
        for k in range(K):
            keep = send_rows[p, k] >= 0
            for b in range(B):
                out[p, k, b] = vals[i, k, b] if keep else 0


# -- packed dispatch: one wire row per pair = token bytes | K int32 rows | K weights ----------------------
@njit(cache=True)
def pack_pairs(x, tw, pair_token, send_rows, out):
    """``out[p] = x[i] | int32 send_rows[p] | tw[i, k] (zero where send_rows[p, k] < 0)``, ``i = pair_token[p]``.

    ``x`` ``[s, Bx]`` and ``tw`` ``[s, K, Bw]`` are byte views, ``out`` ``[n, Bx + 4K + K*Bw]``."""
    n, K = send_rows.shape
    Bx = x.shape[1]
    Bw = tw.shape[2]
    for p in range(n):
        i = pair_token[p]
        for b in range(Bx):
            out[p, b] = x[i, b]
        o = Bx
        for k in range(K):
            v = send_rows[p, k]
            for b in range(4):
                out[p, o + b] = (v >> (8 * b)) & 0xFF
            o += 4
        for k in range(K):
            keep = send_rows[p, k] >= 0
            for b in range(Bw):
                out[p, o + b] = tw[i, k, b] if keep else 0
            o += Bw


@njit(cache=True)
def unpack_pairs(recv, tokens, weights, rows):
    """Inverse of :func:`pack_pairs` on the receiver, fused with the expand: ``rows [n, K]`` (int64) gets the
    row lists, each token's bytes go to all its rows of ``tokens [cap, Bx]`` and each choice's weight
    bytes to its row of ``weights [cap, Bw]``; rows nobody writes are zeroed in both."""
    n, K = rows.shape
    cap, Bx = tokens.shape
    Bw = weights.shape[1]
    written = np.zeros(cap, np.bool_)
    for p in range(n):
        o = Bx
        for k in range(K):
            u = np.int64(0)
            for b in range(4):
                u |= np.int64(recv[p, o + b]) << (8 * b)
            rows[p, k] = u - (np.int64(1) << 32) if u >= (np.int64(1) << 31) else u
            o += 4
        for k in range(K):
            r = rows[p, k]
            if r < 0:
                continue
            written[r] = True
            for b in range(Bx):
                tokens[r, b] = recv[p, b]
            for b in range(Bw):
                weights[r, b] = recv[p, o + k * Bw + b]
    for r in range(cap):
        if not written[r]:
            for b in range(Bx):
                tokens[r, b] = 0
            for b in range(Bw):
                weights[r, b] = 0


# -- arithmetic ----------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _bf16_to_f32(v):
    return np.uint32(np.uint32(v) << np.uint32(16)).view(np.float32)


@njit(cache=True, inline="always")
def _f32_to_bf16(x, nan_bits):
    """Round to nearest even (torch's ``c10::BFloat16``); every NaN becomes ``nan_bits``."""
    u = np.float32(x).view(np.uint32)
    rnd = np.uint16((u + ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)) >> np.uint32(16))
    return nan_bits if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rnd


@njit(cache=True)
def reduce_pairs_bf16(out, w, use_w, rows, part, nan_bits):
    """bf16 rows (``uint16``): ``part[p] = bf16(sum_k w[r] * fp32(out[r]))``, ``r = rows[p, k] >= 0``."""
    n, K = rows.shape
    H = out.shape[1]
    acc = np.empty(H, np.float32)
    nb = np.uint16(nan_bits)
    for p in range(n):
        for h in range(H):
            acc[h] = 0.0
        for k in range(K):
            r = rows[p, k]
            if r < 0:
                continue
            o = out[r]
            if use_w:
                wv = w[r]
                for h in range(H):
                    acc[h] = acc[h] + wv * _bf16_to_f32(o[h])
            else:
                for h in range(H):
                    acc[h] = acc[h] + _bf16_to_f32(o[h])
        dst = part[p]
        for h in range(H):
            dst[h] = _f32_to_bf16(acc[h], nb)


@njit(cache=True)
def reduce_pairs_float(out, w, use_w, rows, part):
    """fp32/fp64 rows: ``part[p] = sum_k w[r] * out[r]`` in the rows' dtype (``w`` already in it)."""
    n, K = rows.shape
    H = out.shape[1]
    for p in range(n):
        acc = part[p]
        for h in range(H):
            acc[h] = 0.0
        for k in range(K):
            r = rows[p, k]
            if r < 0:
                continue
            if use_w:
                wv = w[r]
                for h in range(H):
                    acc[h] = acc[h] + wv * out[r, h]
            else:
                for h in range(H):
                    acc[h] = acc[h] + out[r, h]


@njit(cache=True)
def token_order(pair_token, num_tokens):
    """CSR of the pairs of each token, in pair (= rank) order: ``(start [s+1], pairs [n])``."""
    n = pair_token.shape[0]
    start = np.zeros(num_tokens + 1, np.int64)
    for j in range(n):
        start[pair_token[j] + 1] += 1
    for t in range(num_tokens):
        start[t + 1] += start[t]
    fill = start[:-1].copy()
    pairs = np.empty(n, np.int64)
    for j in range(n):
        t = pair_token[j]
        pairs[fill[t]] = j
        fill[t] += 1
    return start, pairs


@njit(cache=True)
def sum_by_rank_bf16(back, start, pairs, y, nan_bits):
    """``y[t] = bf16(0 + fp32(back[j0]) + fp32(back[j1]) + ...)`` over the pairs of token ``t`` in order."""
    H = back.shape[1]
    acc = np.empty(H, np.float32)
    nb = np.uint16(nan_bits)
    for t in range(y.shape[0]):
        for h in range(H):
            acc[h] = 0.0
        for q in range(start[t], start[t + 1]):
            src = back[pairs[q]]
            for h in range(H):
                acc[h] = acc[h] + _bf16_to_f32(src[h])
        dst = y[t]
        for h in range(H):
            dst[h] = _f32_to_bf16(acc[h], nb)


@njit(cache=True)
def sum_by_rank_float(back, start, pairs, y):
    """``y[t] = 0 + back[j0] + back[j1] + ...`` over the pairs of token ``t`` in order (fp32/fp64)."""
    H = back.shape[1]
    for t in range(y.shape[0]):
        acc = y[t]
        for h in range(H):
            acc[h] = 0.0
        for q in range(start[t], start[t + 1]):
            j = pairs[q]
            for h in range(H):
                acc[h] = acc[h] + back[j, h]


# -- routing -------------------------------------------------------------------------------------------
@njit(cache=True)
def _first_choice(dst_rank, i, k):
    """Whether choice ``k`` is the first of token ``i``'s choices that goes to rank ``dst_rank[i, k]``."""
    r = dst_rank[i, k]
    for k2 in range(k):
        if dst_rank[i, k2] == r:
            return False
    return True


@njit(cache=True)
def route_pairs(dst_rank, dst_row, R):
    """Pairs (token, destination rank) grouped by rank, ascending token inside a group.

    Returns ``(pair_token [n], send_rows [n, K], splits [R])``; ``send_rows[p, k]`` is the row of choice
    ``k`` on the pair's rank, ``-1`` where the choice goes elsewhere or is masked."""
    s, K = dst_rank.shape
    splits = np.zeros(R, np.int64)
    for i in range(s):
        for k in range(K):
            r = dst_rank[i, k]
            if r < 0:
                continue
            if _first_choice(dst_rank, i, k):
                splits[r] += 1
    fill = np.zeros(R, np.int64)
    for r in range(1, R):
        fill[r] = fill[r - 1] + splits[r - 1]
    n = fill[R - 1] + splits[R - 1] if R > 0 else 0
    pair_token = np.empty(n, np.int64)
    send_rows = np.full((n, K), -1, np.int64)
    for i in range(s):
        for k in range(K):
            r = dst_rank[i, k]
            if r < 0:
                continue
            if not _first_choice(dst_rank, i, k):
                continue
            p = fill[r]
            fill[r] += 1
            pair_token[p] = i
            for k2 in range(k, K):
                if dst_rank[i, k2] == r:
                    send_rows[p, k2] = dst_row[i, k2]
    return pair_token, send_rows, splits


@njit(cache=True)
def check_topk(idx):
    """``(min, max, first token with a repeated non-negative expert or -1)`` of int64 ``[s, K]`` expert ids."""
    s, K = idx.shape
    lo = idx[0, 0]
    hi = lo
    dup = -1
    for i in range(s):
        for k in range(K):
            v = idx[i, k]
            lo = min(lo, v)
            hi = max(hi, v)
            if dup < 0 and v >= 0:
                for k2 in range(k):
                    if idx[i, k2] == v:
                        dup = i
                        break
    return lo, hi, dup


@njit(cache=True)
def copy_destinations(flat, before, A, rep, cu, epn, dst_rank, dst_row):
    """The layout of one source rank's copies (:func:`moonep.layout.token_destinations` on CPU plans).

    ``flat`` int64 ``[n]`` expert ids in (token, choice) order (``-1``: masked); ``before [E]`` copies of
    each expert on lower source ranks; ``A [E, R]`` the plan's assignment; ``rep [R, epn]`` replica experts
    (``-1`` empty); ``cu [R, 2*epn+1]`` slot offsets.  The ``g``-th copy of expert ``e`` (over all sources in
    rank order) goes to the rank whose chunk of ``A[e]`` holds ``g``, into ``e``'s slot there (home, or
    ``epn`` + its replica index), at ``g`` minus the chunk's start.  Writes ``dst_rank``, ``dst_row``.
    """
    E, R = A.shape
    slot = np.full((R, E), -1, dtype=np.int64)
    for r in range(R):
        for j in range(epn):
            slot[r, r * epn + j] = j
            e = rep[r, j]
            if e >= 0:
                slot[r, e] = epn + j
    seen = before.copy()
    for i in range(flat.shape[0]):
        e = flat[i]
        if e < 0:
            dst_rank[i] = -1
            dst_row[i] = -1
            continue
        g = seen[e]
        seen[e] += 1
        start = 0
        r = 0
        while r < R - 1 and g >= start + A[e, r]:
            start += A[e, r]
            r += 1
        dst_rank[i] = r
        dst_row[i] = cu[r, slot[r, e]] + g - start


@njit(cache=True)
def slot_offsets(A, rep, align, cu):
    """Every rank's slot offsets (:func:`moonep.layout.cu_seqlens` on CPU plans): ``A [E, R]`` the plan's
    assignment, ``rep [R, epn]`` its replica experts (``-1`` empty); writes int64 ``cu [R, 2*epn+1]``, slot
    ``j``'s rows of rank ``r`` rounded up to a multiple of ``align``.  One call instead of a dozen small torch
    ops (each costs more host time than this whole loop)."""
    E, R = A.shape
    epn = E // R
    for r in range(R):
        acc = 0
        cu[r, 0] = 0
        for j in range(2 * epn):
            if j < epn:
                n = A[r * epn + j, r]
            else:
                e = rep[r, j - epn]
                n = A[e, r] if e >= 0 else 0
            acc += (n + align - 1) // align * align
            cu[r, j + 1] = acc
