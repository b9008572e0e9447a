"""Lane-level Python emulation of moonep_plan in csrc/planner.cu (exact/cap loops, wfill32 register fill,
warp_argmax_pos hi/lo __reduce_*_sync split, k = 1 donor fast path, assignment zero + scatter) checked against
moonep.planner.cpu. No GPU needed:  .venv/bin/python tools/emulate_plan_kernel.py [ncases]"""
import sys, math
import numpy as np
sys.path.insert(0, '.')
from moonep.planner.cpu import _plan_core, plan_arrays
from moonep.planner import cap_for
NONE = 0x7fffffff
M32 = 0xffffffff

def warp_argmax_pos(vals, idxs):
    ok = [v > 0 for v in vals]
    hi = [(v >> 32) & M32 if o else 0 for v, o in zip(vals, ok)]
    mh = max(hi)
    ml = max([(v & M32) if (o and h == mh) else 0 for v, o, h in zip(vals, ok, hi)])
    m = (mh << 32) | ml
    bi = min([i if (o and v == m) else NONE for v, o, i in zip(vals, ok, idxs)])
    return m, bi

def warp_min2(a, i):  # lexicographic min over lanes
    best = None
    for aa, ii in zip(a, i):
        if ii == NONE: continue
        if best is None or (aa, ii) < best: best = (aa, ii)
    return best if best else (0, NONE)

def kneed(ps, epn, d):
    if epn <= 16:  # csrc: independent loads, count of prefix sums below d
        return 1 + sum(1 for a in range(epn) if ps[a] < d)
    lo, hi = 0, epn
    while lo < hi:
        mid = (lo + hi) >> 1
        if ps[mid] >= d: hi = mid
        else: lo = mid + 1
    return lo + 1

class S: pass

def rank_sort_psum(s, r):
    epn = s.epn; base = r * epn
    for j in range(epn):
        v = s.rem[base + j]
        pos = sum(1 for q in range(epn) if s.rem[base+q] > v or (s.rem[base+q] == v and q < j))
        s.order[base + pos] = j
    acc = 0
    for a in range(epn):
        acc += s.rem[base + s.order[base + a]]; s.psum[base + a] = acc
    return acc

def wfill32(s, u, o, need):
    epn = s.epn; base = o * epn
    assert epn <= 32
    L = range(32)
    inn = [l < epn for l in L]
    j = [s.order[base + l] if inn[l] else l for l in L]
    P = [s.psum[base + l] if inn[l] else 0 for l in L]
    Pp = [0] + P[:31]
    v = [P[l] - Pp[l] for l in L]
    left = [need - Pp[l] for l in L]
    take = [(min(v[l], left[l]) if (inn[l] and left[l] > 0) else 0) for l in L]
    nv = [v[l] - take[l] for l in L]
    t = sum(1 for l in L if take[l] > 0)
    # touched is a prefix
    assert all(take[l] > 0 for l in range(t))
    Pt = P[t - 1] if t else 0
    # O(t) passes (csrc wfill32): untouched lanes keep their order; touched ones count untouched before them
    pos = [0 if take[l] > 0 else l - t for l in L]
    acc = [0 if take[l] > 0 else Pp[l] - Pt for l in L]
    slot = [0] * 32
    ub = [0] * 32
    for q in range(t):
        xq, jq = nv[q], j[q]
        qb = [xq > nv[l] or (xq == nv[l] and jq < j[l]) for l in L]
        for l in L:
            if q != l and qb[l]:
                pos[l] += 1; acc[l] += xq
            slot[l] += jq < j[l]
        ub[q] = sum(1 for l in L if inn[l] and take[l] == 0 and not qb[l])
    if 4 * t > epn:  # csrc: the O(epn) pass when many experts are touched
        for l in L:
            pos[l] = sum(1 for q in range(epn) if nv[q] > nv[l] or (nv[q] == nv[l] and j[q] < j[l]))
            acc[l] = sum(nv[q] for q in range(epn) if nv[q] > nv[l] or (nv[q] == nv[l] and j[q] < j[l]))
        ub = [0] * 32
    for l in L:
        if take[l] > 0 and 4 * t <= epn:
            pos[l] += ub[l]
            acc[l] += (P[(t + ub[l] - 1) & 31] - Pt) if ub[l] else 0
    new = {l: (pos[l], slot[l], acc[l]) for l in L}
    for l in L:
        pos, slot, acc = new[l]
        if inn[l]:
            s.rem[base + j[l]] = nv[l]; s.order[base + pos] = j[l]; s.psum[base + pos] = acc + nv[l]
        if take[l] > 0:
            s.amt[u * epn + j[l]] = take[l]; s.rx[u * epn + slot] = base + j[l]
    s.bal[u] += need; s.bal[o] -= need; s.rsrc[u] = o

def lanes(R):
    return [list(range(l, R, 32)) for l in range(32)]

def run_exact(s, R, stats):
    epn = s.epn
    LN = lanes(R)
    while True:
        dv, bi = [], []
        for l in range(32):
            d, b = 0, NONE
            for r in LN[l]:
                dr = -s.bal[r]
                if dr > d: d, b = dr, r
            dv.append(d); bi.append(b)
        d, u = warp_argmax_pos(dv, bi)
        if u == NONE: return 0
        BC, BX, BO = [], [], []
        for l in range(32):
            bc, bx, bo = 2, 0, NONE
            for c in LN[l]:
                x, top = s.bal[c], s.psum[c * epn]
                if x <= 0 or top < d: continue
                cs = 1 if x < d else 0
                if cs < bc or (cs == bc and x > bx): bc, bx, bo = cs, x, c
            BC.append(bc); BX.append(bx); BO.append(bo)
        cmin = min(BC)
        if cmin < 2:
            _, o = warp_argmax_pos([BX[l] if BC[l] == cmin else 0 for l in range(32)], BO)
            stats['fast'] += 1
        else:
            stats['slow'] += 1
            best = None
            for c in range(R):
                x = s.bal[c]
                if x <= 0: continue
                key = (2 * kneed(s.psum[c*epn:(c+1)*epn], epn, d) + (1 if x < d else 0), -x, c)
                if best is None or key < best: best = key
            o = best[2] if best else NONE
        if o == NONE: return 0
        wfill32(s, u, o, d)

def run_cap(s, R):
    LN = lanes(R)
    while True:
        best = warp_min2([-s.bal[r] if s.bal[r] > 0 else 0 for r in range(R)],
                         [r if s.bal[r] > 0 else NONE for r in range(R)])
        ba, bi = best
        if bi == NONE: return 0
        o, x = bi, -ba
        s.used[o] = 1
        while x > 0:
            fa = [(-s.bal[v], v) for v in range(R) if not s.used[v] and -s.bal[v] > 0 and -s.bal[v] >= x]
            ga = [(s.bal[v], v) for v in range(R) if not s.used[v] and -s.bal[v] > 0]
            if fa: room, v = min(fa)
            elif ga: a_, v = min(ga); room = -a_
            else: return 1
            a = min(x, room)
            s.used[v] = 1
            wfill32(s, v, o, a)
            x -= a

def plan_gpu_emu(counts, slack, stats):
    R, E = counts.shape; epn = E // R
    L = [int(x) for x in counts.sum(0)]
    T = sum(L)
    cap = (T + R - 1) // R
    capf = math.ceil((1.0 + slack) * float(T) / float(R))
    cap = max(cap, capf)
    flags_cap = slack > 0
    for attempt in range(2):
        exact = (not flags_cap) or attempt == 1
        s = S(); s.epn = epn
        s.rem = list(L); s.amt = [0]*E; s.rx = [-1]*E; s.rsrc = [-1]*R; s.used = [0]*R
        s.order = [0]*E; s.psum = [0]*E; s.bal = [0]*R
        for r in range(R):
            tot = rank_sort_psum(s, r)
            tg = (T // R + (1 if r < T % R else 0)) if exact else cap
            s.bal[r] = tot - tg
        st = run_exact(s, R, stats) if exact else run_cap(s, R)
        if not st: break
    rc = [s.bal[r] + ((T // R + (1 if r < T % R else 0)) if exact else cap) for r in range(R)]
    # assignment: zero, then scatter
    A = np.zeros(E * R, np.int64)
    for idx in range(E):
        r, j = idx // epn, idx % epn
        h = s.rsrc[r]
        A[idx * R + r] = s.rem[idx]
        if h >= 0: A[(h * epn + j) * R + r] = s.amt[r * epn + j]
    return A.reshape(E, R), np.array(s.rx).reshape(R, epn), np.array(s.rsrc), np.array(rc), attempt

def main(n=1200, seed=0):
    from tests.harness.planner_corpus import random_counts, FAMILIES
    rng = np.random.default_rng(seed)
    stats = {'fast': 0, 'slow': 0}
    cases = []
    shapes = [(1, 4), (2, 1), (3, 5), (8, 32), (16, 24), (64, 14), (64, 16), (7, 16), (8, 31), (5, 32)]
    i = 0
    while len(cases) < n:
        k = i % 4; i += 1
        if k == 0:
            R, epn = shapes[int(rng.integers(len(shapes)))]
            fam = FAMILIES[int(rng.integers(len(FAMILIES)))]
            c = random_counts(fam, R, epn, 8, int(rng.integers(1, 200)), int(rng.integers(1 << 30)))
        elif k == 1:
            R = int(rng.integers(1, 70)); epn = int(rng.integers(1, 33))
            c = rng.integers(0, 30, size=(R, R * epn)) ** int(rng.integers(1, 4))
        elif k == 2:  # huge values: exercises the hi/lo split
            R = int(rng.integers(1, 40)); epn = int(rng.integers(1, 20))
            c = rng.integers(0, 1 << 40, size=(R, R * epn)) * int(rng.integers(1, 3)) + (rng.integers(0, 2, size=(R, R*epn)) << 32)
        else:  # sparse / hot / ties
            R = int(rng.integers(1, 70)); epn = int(rng.integers(1, 33))
            c = np.zeros((R, R * epn), np.int64)
            m = rng.random(c.shape) < rng.random() * 0.3
            c[m] = rng.integers(1, 4, size=int(m.sum())) * int(rng.integers(1, 1000))
        cases.append(np.asarray(c, np.int64))
    bad = 0
    for ci, c in enumerate(cases):
        for slack in (0.0, 0.05, 0.5):
            R, E = c.shape
            L = c.sum(0)
            T = int(L.sum())
            cap = -1 if slack == 0 else cap_for(T, R, slack)
            a, rx, rs, rc, fb = plan_arrays(L, R, cap)
            g = plan_gpu_emu(c, slack, stats)
            ok = np.array_equal(a, g[0]) and np.array_equal(rx, g[1]) and np.array_equal(rs, g[2]) and np.array_equal(rc, g[3])
            if not ok:
                bad += 1
                if bad < 5: print("MISMATCH case", ci, c.shape, slack)
    print(f"cases {len(cases)} x 3 slacks, mismatches {bad}, donor fast/slow steps {stats}")
    return bad

if __name__ == "__main__":
    sys.exit(1 if main(int(sys.argv[1]) if len(sys.argv) > 1 else 1200) else 0)
