"""CPU balanced planner (numba ``@njit``; integer-only and deterministic).

The algorithm (bit-identical to ``csrc/planner.cu``; see ``docs/design.md``):

*Exact mode* (``slack == 0``), targets ``t[r] = T // R + (r < T % R)``. Repeat: take the rank ``u``
with the largest deficit ``d = t[u] - load[u] > 0`` (ties: lowest index). Among over-loaded ranks
``o`` pick the one minimising, lexicographically, ``(k_o, x_o < d, -x_o, o)``, where ``x_o`` is the
excess and ``k_o`` the number of ``o``'s largest remaining home experts needed to cover ``d``: fewest
replicas first, then a donor that stays over-loaded (no cascade), then the largest excess. Fill ``u``
exactly from ``o``'s largest remaining experts (ties: lowest expert id). ``o`` may drop under its
target and is then filled later, once. Each rank is filled at most once, from one peer, so it holds at
most ``epn`` replicas (K3 report, App. E). Choosing by ``k_o`` instead of plain largest excess matched
the ILP optimum of max replicas on the whole oracle corpus (largest excess alone missed 3/63).

*Cap mode* (``slack > 0``), cap ``c``: repeat: take the rank ``o`` with the largest excess over ``c``
and shed it to fresh receivers (never a donor, never filled, room ``c - load > 0``): the one with the
smallest room that takes it all (best fit, keeps large rooms for large excesses), else the largest
room, filled completely, and repeat. A receiver gets one donor only. If no receiver is left (rare: all
remaining room is on ranks already used), fall back to the exact plan, which is always under the cap.

Per-rank home experts are kept sorted by (remaining load desc, id asc) in ``order`` so that ``k_o``
and the largest-first fill are prefix walks.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _resort(rem, order, o, epn):
    # insertion sort of rank o's local experts by (rem desc, id asc)
    base = o * epn
    for a in range(1, epn):
        j = order[base + a]
        v = rem[base + j]
        b = a - 1
        while b >= 0:
            jb = order[base + b]
            vb = rem[base + jb]
            if vb > v or (vb == v and jb < j):
                break
            order[base + b + 1] = jb
            b -= 1
        order[base + b + 1] = j


@njit(cache=True)
def _kneed(rem, order, o, epn, d):
    base = o * epn
    acc = 0
    for a in range(epn):
        acc += rem[base + order[base + a]]
        if acc >= d:
            return a + 1
    return epn + 1  # cannot cover d (never for a valid donor)


@njit(cache=True)
def _fill(rem, order, amt, rep_exp, rep_src, load, u, o, epn, need):
    # move `need` copies from o's largest remaining experts to u; record slots ascending by id
    base = o * epn
    load[u] += need
    load[o] -= need
    rep_src[u] = o
    a = 0
    while need > 0:
        j = order[base + a]
        take = min(rem[base + j], need)
        rem[base + j] -= take
        amt[u * epn + j] += take
        need -= take
        a += 1
    n = 0
    for j in range(epn):
        if amt[u * epn + j] > 0:
            rep_exp[u, n] = base + j
            n += 1
    _resort(rem, order, o, epn)


@njit(cache=True)
def _largest_gap(a, b, R):
    """``(r, a[r] - b[r])`` for the first rank with the largest positive gap, or ``(-1, 0)``: the most
    under-loaded rank (``a`` = target, ``b`` = load) or the most over-loaded one (swapped)."""
    r_best, gap = -1, 0
    for r in range(R):
        if a[r] - b[r] > gap:
            gap = a[r] - b[r]
            r_best = r
    return r_best, gap


@njit(cache=True)
def _plan_core(L, R, epn, cap):
    """L int64 [E] expert loads; cap int64 (-1: exact mode). Returns
    (rem int64 [E] copies kept home, amt int64 [R*epn] copies of donor-local expert j on receiver r,
    rep_exp int64 [R, epn], rep_src int64 [R], load int64 [R], fellback int64)."""
    E = R * epn
    T = 0
    for e in range(E):
        T += L[e]
    for attempt in range(2):
        exact = cap < 0 or attempt == 1
        rem = L.copy()
        amt = np.zeros(E, np.int64)
        rep_exp = np.full((R, epn), -1, np.int64)
        rep_src = np.full(R, -1, np.int64)
        load = np.zeros(R, np.int64)
        order = np.empty(E, np.int64)
        for r in range(R):
            for j in range(epn):
                load[r] += L[r * epn + j]
                order[r * epn + j] = j
            _resort(rem, order, r, epn)
        tgt = np.empty(R, np.int64)
        for r in range(R):
            tgt[r] = T // R + (1 if r < T % R else 0) if exact else cap
        if exact:
            while True:
                u, d = _largest_gap(tgt, load, R)
                if u < 0:
                    break
                o = -1
                bk = 0
                bc = 0
                bx = 0
                for c in range(R):
                    x = load[c] - tgt[c]
                    if x <= 0:
                        continue
                    k = _kneed(rem, order, c, epn, d)
                    cs = 1 if x < d else 0
                    if o < 0 or k < bk or (k == bk and (cs < bc or (cs == bc and x > bx))):
                        o, bk, bc, bx = c, k, cs, x
                _fill(rem, order, amt, rep_exp, rep_src, load, u, o, epn, d)
            return rem, amt, rep_exp, rep_src, load, attempt
        used = np.zeros(R, np.bool_)
        stuck = False
        while not stuck:
            o, x = _largest_gap(load, tgt, R)
            if o < 0:
                return rem, amt, rep_exp, rep_src, load, attempt
            used[o] = True
            while x > 0:
                fit = -1   # smallest room >= x
                big = -1   # largest room
                for v in range(R):
                    room = tgt[v] - load[v]
                    if used[v] or room <= 0:
                        continue
                    if room >= x and (fit < 0 or room < tgt[fit] - load[fit]):
                        fit = v
                    if big < 0 or room > tgt[big] - load[big]:
                        big = v
                v = fit if fit >= 0 else big
                if v < 0:
                    stuck = True
                    break
                a = min(x, tgt[v] - load[v])
                used[v] = True
                _fill(rem, order, amt, rep_exp, rep_src, load, v, o, epn, a)
                x -= a
    return rem, amt, rep_exp, rep_src, load, 2  # unreachable


def plan_arrays(L: np.ndarray, R: int, cap: int):
    """Run the planner on expert loads ``L`` int64 [E]. Returns numpy arrays
    (assignment int64 [E, R], replica_experts int64 [R, epn], replica_source int64 [R],
    recv_counts int64 [R], fellback int)."""
    E = L.shape[0]
    epn = E // R
    rem, amt, rep_exp, rep_src, load, fb = _plan_core(np.ascontiguousarray(L, np.int64), R, epn, cap)
    assign = np.zeros((E, R), np.int64)
    e = np.arange(E)
    assign[e, e // epn] = rem
    got = rep_src >= 0
    rr = np.nonzero(got)[0]
    if rr.size:
        src = rep_src[rr]
        ee = (src[:, None] * epn + np.arange(epn)[None, :]).reshape(-1)
        assign[ee, np.repeat(rr, epn)] += amt.reshape(R, epn)[rr].reshape(-1)
    return assign, rep_exp, rep_src, load, int(fb)
