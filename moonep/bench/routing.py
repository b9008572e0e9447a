"""Synthetic routings with a target imbalance, for benchmarks.

``maxvio = max_e(T_e / T_mean) - 1`` over the global batch. Expert popularity follows a Zipf law
``p_e ~ (1 + perm(e))^-a``; the exponent ``a`` is found by bisection so that the *expected* loads of
top-K sampling without replacement hit the target, then each token draws K distinct experts by Gumbel
top-K on ``log p``. The achieved maxvio of the sampled batch is measured and reported, never assumed.
(A target above ``E/K - 1`` is unreachable: an expert takes at most one copy per token.)

Placement of the popular experts:

* ``"random"``: popularity ranks are a random permutation of the experts (the same on every rank), so
  with few ranks the rank-level load stays close to even even when the expert-level maxvio is large;
* ``"clustered"``: expert ``e`` is the ``e``-th most popular, so the hottest experts are all homed on
  rank 0 (correlated experts on one device): the rank-level imbalance a per-copy all-to-all suffers.
"""
from __future__ import annotations

import torch


def expected_maxvio(a: float, E: int, K: int, samples: int = 4096, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    logp = -a * torch.log(torch.arange(1, E + 1, dtype=torch.float64))
    g = -torch.log(-torch.log(torch.rand(samples, E, generator=gen, dtype=torch.float64)))
    idx = (logp + g).topk(K, dim=1).indices
    load = torch.bincount(idx.reshape(-1), minlength=E).double()
    return float(load.max() / load.mean() - 1)


def zipf_exponent(target: float, E: int, K: int) -> float:
    """Exponent ``a`` whose sampled routing has maxvio close to ``target`` (0 -> uniform)."""
    if target <= 0:
        return 0.0
    cap = E / K - 1  # an expert can take at most one copy per token
    target = min(target, cap * 0.999)
    lo, hi = 0.0, 8.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_maxvio(mid, E, K) < target else (lo, mid)
    return (lo + hi) / 2


def make_routing(s: int, E: int, K: int, a: float, seed: int, device="cpu", popularity_seed: int = 0,
                 placement: str = "random"):
    """``topk_idx`` int64 ``[s, K]`` and ``topk_weights`` float32 ``[s, K]`` (renormalised).

    ``popularity_seed`` must be equal on every rank (the same experts are hot everywhere, as with a
    real router); ``seed`` differs per rank. ``placement``: ``"random"`` or ``"clustered"`` (see above).
    """
    if placement == "clustered":
        perm = torch.arange(E)
    elif placement == "random":  # hot experts: random ranks
        perm = torch.randperm(E, generator=torch.Generator().manual_seed(popularity_seed))
    else:
        raise ValueError(f"placement: expected 'random' or 'clustered', got {placement!r}")
    gen = torch.Generator().manual_seed(seed)
    logp = -a * torch.log(1 + perm.double())
    g = -torch.log(-torch.log(torch.rand(s, E, generator=gen, dtype=torch.float64).clamp_min(1e-300)))
    idx = (logp + g).topk(K, dim=1).indices
    w = torch.rand(s, K, generator=gen) + 0.1
    return idx.to(device), (w / w.sum(1, keepdim=True)).to(device)


def maxvio(counts: torch.Tensor) -> float:
    """``counts``: ``[E]`` or ``[R, E]`` global loads -> ``max/mean - 1``."""
    load = counts.reshape(-1, counts.shape[-1]).sum(0).double()
    return float(load.max() / load.mean() - 1) if load.sum() > 0 else 0.0

