"""The cross-rank check of :class:`moonep.QuantileBalancer`'s state, carried by the counts' all-reduce.

Every rank must hold the same ``bias`` and ``num_steps`` (they are replicated; a checkpoint loaded on one
rank only, or a refused step on one rank, makes them differ, and the ranks would then route with different
biases for ever).  Each rank writes one bit per slot of a hash of its state into ``STATE_BITS`` extra slots
of the int32 counts it all-reduces anyway: a slot sums to 0 or ``R`` where every rank has the same bit, to
anything else where they differ.  No extra message, no host sync (device ops), and every rank sees the same
sums, so every rank refuses the same step.
"""
from __future__ import annotations

import torch

STATE_BITS = 31
_P = 2**31 - 1  # prime: a weighted sum of bytes that differ in one place differs mod _P


def state_bits(bias: torch.Tensor, num_steps: torch.Tensor) -> torch.Tensor:
    """int32 ``[STATE_BITS]``: the bits of a 31-bit hash of ``bias``'s bytes (any float dtype, contiguous)
    and ``num_steps`` (int64 0-dim), on their device."""
    b = bias.detach().reshape(-1).view(torch.uint8).to(torch.int64)
    i = torch.arange(b.numel(), dtype=torch.int64, device=b.device)
    weight = (i * 40503 + 12345) % 65521 + 1  # fixed, distinct per byte: the same on every rank
    h = (b * weight).sum() % _P  # < 2**8 * 2**16 * bytes: no int64 overflow below 2**39 bytes
    h = (h * 65599 + num_steps.to(h.device) % _P) % _P
    return ((h >> torch.arange(STATE_BITS, device=h.device)) & 1).to(torch.int32)


def states_differ(sums: torch.Tensor, world_size: int) -> torch.Tensor:
    """bool 0-dim: the all-reduced ``sums`` of :func:`state_bits` show ranks whose states differ."""
    return ((sums != 0) & (sums != world_size)).any()
