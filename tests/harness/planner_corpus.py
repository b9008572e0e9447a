"""Routing families for tests and benchmarks: the fixed corpus the planner is measured on.

Every generator returns ``topk_idx`` int64 ``[R, s, K]`` (distinct experts per token, drawn by
Gumbel top-k from per-expert probabilities) so layouts can be tested on the same routings; use
``counts_from_topk`` for the int64 ``[R, E]`` count matrix.
"""
from __future__ import annotations

import numpy as np

FAMILIES = ("uniform", "zipf1.0", "zipf1.5", "zipf2.0", "hot", "theorem2", "dirichlet")


def expert_probs(family: str, E: int, R: int, rng: np.random.Generator) -> np.ndarray:
    """float64 [E] expert popularity for a family (Zipf ranks are randomly permuted over experts)."""
    epn = E // R
    if family == "uniform":
        p = np.ones(E)
    elif family.startswith("zipf"):
        s = float(family[4:])
        p = 1.0 / np.arange(1, E + 1) ** s
        p = p[rng.permutation(E)]
    elif family == "hot":
        p = np.ones(E)
        p[rng.integers(E)] = 1e9          # every token picks it
    elif family == "theorem2":
        p = np.ones(E)
        if R > 1:
            p[:epn] = 0.0                 # rank 0's home experts get nothing
    elif family == "dirichlet":
        p = rng.dirichlet(np.full(E, 0.5))
    else:
        raise ValueError(f"unknown family {family!r}")
    return p / p.sum()


def routing(family: str, E: int, R: int, K: int, s: int, seed: int = 0) -> np.ndarray:
    """int64 [R, s, K] top-K expert ids per token for ``family`` (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    p = expert_probs(family, E, R, rng)
    K = min(K, int((p > 0).sum()))
    with np.errstate(divide="ignore"):
        logp = np.log(p)
    g = rng.gumbel(size=(R, s, E)) + logp
    return np.argsort(-g, axis=-1, kind="stable")[..., :K].astype(np.int64)


def counts_from_topk(topk: np.ndarray, E: int) -> np.ndarray:
    """int64 [R, E] copies per (source rank, expert) from ``topk`` int [R, s, K] (-1 ignored)."""
    R = topk.shape[0]
    out = np.zeros((R, E), dtype=np.int64)
    for r in range(R):
        t = topk[r].reshape(-1)
        out[r] = np.bincount(t[t >= 0], minlength=E)
    return out


def corpus(configs=((16, 4, 2, 32), (32, 8, 4, 32), (48, 8, 4, 64)), seeds=(0, 1, 2)):
    """The fixed oracle corpus: list of (family, (E, R, K, s), seed, counts int64 [R, E])."""
    out = []
    for fam in FAMILIES:
        for cfg in configs:
            for seed in seeds:
                E, R, K, s = cfg
                out.append((fam, cfg, seed, counts_from_topk(routing(fam, E, R, K, s, seed), E)))
    return out


def random_counts(family: str, R: int, epn: int, K: int, s: int, seed: int) -> np.ndarray:
    """int64 [R, E] counts drawn per source rank from a family's expert probabilities (fast, for
    property tests; copies need not be distinct per token). Each row sums to ``s * K``."""
    rng = np.random.default_rng(seed)
    E = R * epn
    p = expert_probs(family, E, R, rng)
    return np.stack([rng.multinomial(s * K, p) for _ in range(R)]).astype(np.int64)


def verify_plan(plan, counts: np.ndarray, slack: float = 0.0) -> None:
    """Assert every guarantee of the plan contract (numpy on CPU copies)."""
    from moonep.planner.plan import cap_for
    A = plan.assignment.cpu().numpy()
    rx = plan.replica_experts.cpu().numpy()
    rs = plan.replica_source.cpu().numpy()
    rc = plan.recv_counts.cpu().numpy()
    R, E = counts.shape
    epn = E // R
    assert A.shape == (E, R) and rx.shape == (R, epn) and rs.shape == (R,) and rc.shape == (R,)
    assert (A >= 0).all()
    assert (A.sum(1) == counts.sum(0)).all(), "conservation"
    assert (A.sum(0) == rc).all(), "recv_counts"
    T = int(counts.sum())
    if slack == 0:
        assert (rc == np.array([T // R + (r < T % R) for r in range(R)])).all(), "exact balance"
    else:
        assert (rc <= cap_for(T, R, slack)).all(), "cap"
    home = np.arange(E) // epn
    for r in range(R):
        held = [int(e) for e in rx[r] if e >= 0]
        n = len(held)
        assert (rx[r, n:] == -1).all() and held == sorted(set(held)), "slots ascending, -1 padded"
        remote = [e for e in range(E) if home[e] != r and A[e, r] > 0]
        assert remote == held, "replicas exactly where listed"
        assert n <= epn
        if n:
            assert all(home[e] == rs[r] for e in held) and rs[r] != r, "one source rank"
        else:
            assert rs[r] == -1
