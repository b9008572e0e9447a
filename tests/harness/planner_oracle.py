"""Exact integer-programming oracle for the balanced plan (tests and benchmarks only).

Solves, with ``scipy.optimize.milp`` (HiGHS), the same problem as the planner under the same
placement rules, minimising ``max replicas per rank`` first and the total number of replicas second
(lexicographic, folded into one objective with weight ``E + 1`` on the maximum, since the total can
never exceed ``E``). Only practical for small cases (``E * R`` up to a few hundred).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class OracleResult:
    max_replicas: int          # optimum of max_r (replicas on rank r)
    total_replicas: int        # optimum total under that maximum
    assignment: np.ndarray     # int64 [E, R]
    status: str


def oracle_plan(counts, *, slack: float = 0.0, time_limit: float = 60.0,
                total: bool = True) -> OracleResult:
    """Optimal plan for ``counts`` (int array-like ``[R, E]``).

    ``slack == 0``: every rank receives exactly ``T // R + (r < T % R)`` copies. ``slack > 0``: every
    rank receives at most ``ceil((1 + slack) * T / R)`` (the planner's cap, see ``planner.cap_for``).
    Each rank may hold replicas of the home experts of a single other rank only. ``total=False``
    minimises the maximum only (much faster; ``total_replicas`` is then just a feasible value).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    from moonep.planner.plan import cap_for

    c = np.asarray(counts, dtype=np.int64)
    R, E = c.shape
    epn = E // R
    L = c.sum(0)
    T = int(L.sum())
    home_load = L.reshape(R, epn).sum(1)
    # Variables: x[e,r], y[e,r] for r != home(e) and L[e] > 0; z[o,r] for o != r; then M.
    pairs = [(e, r) for e in range(E) if L[e] > 0 for r in range(R) if r != e // epn]
    P = len(pairs)
    zpairs = [(o, r) for o in range(R) for r in range(R) if o != r]
    zi = {p: i for i, p in enumerate(zpairs)}
    nz = len(zpairs)
    nv = 2 * P + nz + 1
    iM = nv - 1
    lo, hi = [], []
    A = lil_matrix((3 * P + R + E + R + R + 1, nv))
    k = 0

    def add(lb, ub):
        nonlocal k
        lo.append(lb)
        hi.append(ub)
        k += 1

    for i, (e, r) in enumerate(pairs):
        A[k, i] = 1            # x <= L*y
        A[k, P + i] = -int(L[e])
        add(-np.inf, 0)
        A[k, P + i] = 1        # y <= z[home, r]
        A[k, 2 * P + zi[(e // epn, r)]] = -1
        add(-np.inf, 0)
    for r in range(R):         # one source rank per receiver
        for o in range(R):
            if o != r:
                A[k, 2 * P + zi[(o, r)]] = 1
        add(-np.inf, 1)
    by_e = [[] for _ in range(E)]
    in_r = [[] for _ in range(R)]
    for i, (e, r) in enumerate(pairs):
        by_e[e].append(i)
        in_r[r].append(i)
    for e in range(E):         # cannot give away more than the expert has
        for i in by_e[e]:
            A[k, i] = 1
        add(-np.inf, int(L[e]))
    cap = cap_for(T, R, slack)
    for r in range(R):         # recv[r] = home_load - out + in
        for i in in_r[r]:
            A[k, i] += 1
        for e in range(r * epn, (r + 1) * epn):
            for i in by_e[e]:
                A[k, i] -= 1
        if slack == 0:
            t = T // R + (1 if r < T % R else 0)
            add(t - int(home_load[r]), t - int(home_load[r]))
        else:
            add(-np.inf, cap - int(home_load[r]))
    for r in range(R):         # replicas on r <= M
        for i in in_r[r]:
            A[k, P + i] = 1
        A[k, iM] = -1
        add(-np.inf, 0)
    A = A[:k].tocsr()
    obj = np.zeros(nv)
    obj[P:2 * P] = 1 if total else 0
    obj[iM] = E + 1
    ub = np.concatenate([L[[e for e, _ in pairs]].astype(float), np.ones(P + nz), [epn]])
    integrality = np.ones(nv)
    res = milp(obj, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), ub), options={"time_limit": time_limit})
    if res.x is None:
        raise RuntimeError(f"oracle failed: {res.message}")
    x = np.round(res.x).astype(np.int64)
    assign = np.zeros((E, R), dtype=np.int64)
    assign[np.arange(E), np.arange(E) // epn] = L
    reps = np.zeros(R, dtype=np.int64)
    for i, (e, r) in enumerate(pairs):
        if x[i] > 0:
            assign[e, r] += x[i]
            assign[e, e // epn] -= x[i]
            reps[r] += 1
    return OracleResult(int(reps.max(initial=0)), int(reps.sum()), assign,
                        "optimal" if res.status == 0 else str(res.message))
