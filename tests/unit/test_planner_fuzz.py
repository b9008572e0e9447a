"""Planner + layout fuzz: 10,000 random routings on CPU, every contract guarantee checked on each.

Routings are generated with numpy (fast, seeded) from adversarial families: the corpus ones (uniform, Zipf,
one hot expert, rank 0's experts cold, Dirichlet), everything to one expert, a random rank's experts cold,
all-masked / empty batches, and random masking on top. Each routing is planned with ``slack = 0`` (exact
balance) and with one ``slack > 0`` (cap); the plan is checked with ``tests.harness.planner_corpus.verify_plan``
(conservation, balance or cap, replica placement: only replica experts off-home, ``<= E/R`` per rank, one
source rank) and the token layout of every source rank with the vectorised :func:`check_layout_fast`.

``tests/gpu/test_planner_fuzz_gpu.py`` replays the same generator on CUDA and compares bit for bit.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from moonep.layout import capacity, cu_seqlens, slot_experts, slot_sizes, token_destinations
from moonep.planner import plan_balanced
from tests.harness.planner_corpus import counts_from_topk, routing, verify_plan

FAMILIES = ("uniform", "zipf1.0", "zipf1.5", "zipf2.0", "hot", "theorem2", "dirichlet", "all_to_one",
            "cold_rank", "zeros", "masked")
SLACKS = (0.01, 0.05, 0.1, 0.5, 2.0)
N_ROUTINGS = int(__import__("os").environ.get("MOONEP_FUZZ_N", 10_000))


def fuzz_routing(rng: np.random.Generator, family: str | None = None):
    """One random routing: ``(family, E, topk_idx int64 [R, s, K])`` (``-1`` = masked copy)."""
    fam = family or FAMILIES[int(rng.integers(len(FAMILIES)))]
    R, epn = int(rng.integers(1, 17)), int(rng.integers(1, 9))
    E = R * epn
    K, s = int(rng.integers(1, min(8, E) + 1)), int(rng.integers(0, 33))
    seed = int(rng.integers(2**31))
    if fam in ("all_to_one", "cold_rank", "zeros", "masked"):
        tk = routing("uniform", E, R, K, s, seed)
        if fam == "all_to_one":        # every token's only live choice is the same expert
            tk[..., 0] = int(rng.integers(E))
            tk[..., 1:] = -1
        elif fam == "cold_rank":       # one random rank's home experts get nothing
            cold = int(rng.integers(R))
            tk[(tk // epn) == cold] = -1
        elif fam == "zeros":           # no copies at all (or no tokens)
            tk[:] = -1
        else:
            tk[rng.random(tk.shape) < rng.random()] = -1
    else:
        tk = routing(fam, E, R, K, s, seed)
        if rng.random() < 0.3:
            tk[rng.random(tk.shape) < 0.2] = -1
    return fam, E, tk


def check_layout_fast(plan, tk: np.ndarray, align: int, slack: float) -> None:
    """Every copy lands in a distinct row of its expert's slot on its destination, rows ordered by
    ``(src, i, k)`` inside a slot, slots holding exactly their assigned copies (vectorised numpy)."""
    R, s, K = tk.shape
    E = plan.num_experts
    epn = E // R
    dst = np.empty(tk.shape, np.int64)
    row = np.empty(tk.shape, np.int64)
    for src in range(R):
        d, r = token_destinations(plan, src, torch.from_numpy(tk[src]), align)
        dst[src], row[src] = d.numpy(), r.numpy()
    live = tk >= 0
    assert (dst[~live] == -1).all() and (row[~live] == -1).all(), "masked copies get -1"
    cu = cu_seqlens(plan, None, align).numpy().astype(np.int64)          # [R, 2*epn + 1]
    assert (cu[:, -1] <= capacity(s, K, R, E, align, slack)).all(), "capacity"
    se = np.stack([slot_experts(plan, r).numpy() for r in range(R)])   # [R, 2*epn]
    size = slot_sizes(plan, 1).numpy()                                  # [R, 2*epn], unpadded
    assert (size.sum(1) == plan.recv_counts.numpy()).all()
    assert ((cu[:, 1:] - cu[:, :-1]) % align == 0).all()
    d, r, e = dst[live], row[live], tk[live]
    if d.size == 0:
        return
    assert ((d >= 0) & (d < R)).all()
    slot = _slots(cu, d, r)
    assert ((slot >= 0) & (slot < 2 * epn)).all(), "row inside the slot table"
    assert (se[d, slot] == e).all(), "row in its expert's slot"
    assert (r - cu[d, slot] < size[d, slot]).all(), "padding only after the slot's copies"
    key = d * (int(cu[:, -1].max()) + 1) + r
    assert np.unique(key).size == key.size, "two copies in one row"
    # rows inside a slot follow (src, i, k): the copies, taken in (src, i, k) order by the mask, have rows increasing
    # within each (dst, slot) group
    g = d * (2 * epn) + slot
    order = np.argsort(g, kind="stable")
    gs, rs = g[order], r[order]
    same = gs[1:] == gs[:-1]
    assert (rs[1:][same] > rs[:-1][same]).all(), "(src, i, k) order inside a slot"
    cnt = np.bincount(g, minlength=R * 2 * epn).reshape(R, 2 * epn)
    assert (cnt == size).all(), "slot holds exactly its assigned copies"


def _slots(cu: np.ndarray, d: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Slot of each (dst, row): one searchsorted over rows offset by rank."""
    span = int(cu[:, -1].max()) + 1
    flat = (cu + np.arange(cu.shape[0])[:, None] * span).reshape(-1)
    pos = np.searchsorted(flat, d * span + r, side="right") - 1
    return pos - d * cu.shape[1]


def test_planner_fuzz_10k():
    rng = np.random.default_rng(20261201)
    seen = dict.fromkeys(FAMILIES, 0)
    layouts = 0
    t0 = time.monotonic()
    for n in range(N_ROUTINGS):
        fam, E, tk = fuzz_routing(rng)
        seen[fam] += 1
        c = counts_from_topk(tk, E)
        ct = torch.from_numpy(c)
        align = 1 if n % 3 else 4
        p0 = plan_balanced(ct)
        verify_plan(p0, c, 0.0)
        slack = SLACKS[n % len(SLACKS)]
        p1 = plan_balanced(ct, slack=slack)
        verify_plan(p1, c, slack)
        # Layouts cost R token_destinations calls each: every plan is checked, the layouts of 5/8 of them
        # (exact plans of even routings, cap plans of one in eight), to stay within ~40 s on 2 cores.
        if n % 2 == 0:
            check_layout_fast(p0, tk, align, 0.0)
            layouts += 1
        elif n % 8 == 1:
            check_layout_fast(p1, tk, align, slack)
            layouts += 1
    assert min(seen.values()) > N_ROUTINGS // (2 * len(FAMILIES)), seen
    print(f"{N_ROUTINGS} routings ({2 * N_ROUTINGS} plans, {layouts} layouts) in {time.monotonic() - t0:.1f}s: "
          f"{seen}")
