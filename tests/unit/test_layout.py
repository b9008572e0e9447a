"""Token layout: slot table, cu_seqlens, capacity, and every copy's (rank, row)."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moonep.layout import capacity, cu_seqlens, destinations_torch, slot_experts, slot_sizes, token_destinations
from moonep.planner import plan_balanced
from tests.harness.planner_corpus import counts_from_topk, routing


def check_layout(tk, E, slack, align):
    """tk int64 [R, s, K] (-1 masked): plan, place every copy, and check the whole layout."""
    R, s, K = tk.shape
    epn = E // R
    c = counts_from_topk(tk, E)
    plan = plan_balanced(torch.from_numpy(c), slack=slack)
    cu_all = cu_seqlens(plan, None, align)
    assert cu_all.dtype == torch.int32 and cu_all.shape == (R, 2 * epn + 1)
    # the CPU kernel's offsets are the running sums of the torch ops' slot sizes
    assert torch.equal(cu_all, torch.nn.functional.pad(slot_sizes(plan, align).cumsum(1), (1, 0)).to(torch.int32))
    cap = capacity(s, K, R, E, align, slack)
    got = {}  # (dst, row) -> (src, i, k, e)
    for src in range(R):
        dr, row = token_destinations(plan, src, torch.from_numpy(tk[src]).to(torch.int32), align)
        # the CPU kernel and the torch ops (a CUDA plan's fallback) place every copy alike
        tr, tw = destinations_torch(plan, src, torch.from_numpy(tk[src]).to(torch.int32), align)
        assert torch.equal(dr, tr) and torch.equal(row, tw)
        assert dr.dtype == torch.int64 and row.dtype == torch.int64 and dr.shape == (s, K)
        m = tk[src] < 0
        assert (dr.numpy()[m] == -1).all() and (row.numpy()[m] == -1).all()
        for i, k in zip(*np.nonzero(~m)):
            key = (int(dr[i, k]), int(row[i, k]))
            assert key not in got, "two copies in one row"
            got[key] = (src, int(i), int(k), int(tk[src, i, k]))
    assert len(got) == int((tk >= 0).sum())
    for d in range(R):
        cu = cu_seqlens(plan, d, align)
        assert torch.equal(cu, cu_all[d]) and int(cu[0]) == 0 and int(cu[-1]) <= cap
        se = slot_experts(plan, d)
        assert se.shape == (2 * epn,) and torch.equal(se[:epn], torch.arange(d * epn, (d + 1) * epn))
        sizes = slot_sizes(plan, 1)[d]
        for j in range(2 * epn):
            lo = int(cu[j])
            rows = [(r, got[(d, r)]) for r in range(lo, int(cu[j + 1])) if (d, r) in got]
            assert len(rows) == int(sizes[j]), "slot holds exactly its assigned copies"
            assert [r for r, _ in rows] == list(range(lo, lo + len(rows))), "padding only at the end"
            assert all(v[3] == int(se[j]) for _, v in rows), "row in its expert's slot"
            assert [v[:3] for _, v in rows] == sorted(v[:3] for _, v in rows), "(src, i, k) order"
            assert (int(cu[j + 1]) - lo) % align == 0
        assert sum(int(x) for x in sizes) == int(plan.recv_counts[d])


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["uniform", "zipf1.5", "hot", "theorem2", "dirichlet"]), st.integers(1, 8),
       st.integers(1, 6), st.integers(1, 6), st.integers(0, 20), st.integers(0, 2**31),
       st.sampled_from([1, 4]), st.sampled_from([0.0, 0.1]))
def test_layout_properties(fam, R, epn, K, s, seed, align, slack):
    E = R * epn
    K = min(K, E)
    tk = routing(fam, E, R, K, s, seed)
    rng = np.random.default_rng(seed)
    tk[rng.random(tk.shape) < 0.1] = -1  # masked copies
    check_layout(tk, E, slack, align)


def test_capacity_formula():
    assert capacity(4096, 8, 8, 256) == 4096 * 8
    assert capacity(4096, 8, 8, 256, align=128) == 4096 * 8 + 64 * 127
    assert capacity(100, 3, 4, 8, slack=0.1) == 330
    with pytest.raises(ValueError, match="align"):
        capacity(1, 1, 1, 1, align=0)
    with pytest.raises(ValueError, match="num_experts"):
        capacity(1, 1, 3, 4)


def test_bad_topk_shape():
    plan = plan_balanced(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="topk_idx"):
        token_destinations(plan, 0, torch.zeros(4, dtype=torch.int64))


def test_plan_and_destinations_is_plan_then_layout():
    from moonep.layout import plan_and_destinations

    R, E, K, s = 4, 16, 2, 30
    tk = routing("zipf1.5", E, R, K, s, 5)
    c = torch.from_numpy(counts_from_topk(tk, E))
    for slack, align in ((0.0, 1), (0.1, 8)):
        plan, dr, dw = plan_and_destinations(c, 3, torch.from_numpy(tk[3]), slack=slack, align=align)
        ref = plan_balanced(c, slack=slack)
        assert torch.equal(plan.assignment, ref.assignment)
        a, b = token_destinations(ref, 3, torch.from_numpy(tk[3]), align)
        assert torch.equal(dr, a) and torch.equal(dw, b)
    with pytest.raises(ValueError, match="rank"):
        plan_and_destinations(c, 4, torch.from_numpy(tk[3]))
    with pytest.raises(ValueError, match="align"):
        plan_and_destinations(c, 0, torch.from_numpy(tk[0]), align=0)
