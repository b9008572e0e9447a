"""Balanced planner (CPU): contract properties, oracle agreement, bad input."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moonep.planner import cap_for, plan_balanced
from tests.harness.planner_corpus import random_counts, verify_plan

FAMS = ["uniform", "zipf1.0", "zipf2.0", "hot", "theorem2", "dirichlet"]
SET = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


def adversarial(kind, R, epn, K, s, seed):
    if kind == "all_to_one":
        c = np.zeros((R, R * epn), np.int64)
        c[:, seed % (R * epn)] = s * K
        return c
    if kind == "random":
        rng = np.random.default_rng(seed)
        return rng.integers(0, 50, size=(R, R * epn)).astype(np.int64)
    return random_counts(kind, R, epn, K, s, seed)


routings = st.tuples(st.sampled_from(FAMS + ["all_to_one", "random"]), st.integers(1, 64),
                     st.integers(1, 16), st.integers(1, 16), st.integers(0, 64), st.integers(0, 2**31))


@SET
@given(routings)
def test_exact_balance_properties(args):
    kind, R, epn, K, s, seed = args
    c = adversarial(kind, R, epn, K, s, seed)
    plan = plan_balanced(torch.from_numpy(c))
    verify_plan(plan, c)
    assert plan.assignment.dtype == torch.int64 and plan.replica_experts.dtype == torch.int64


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(routings, st.sampled_from([0.01, 0.05, 0.1, 0.5, 2.0]))
def test_slack_properties(args, slack):
    kind, R, epn, K, s, seed = args
    c = adversarial(kind, R, epn, K, s, seed)
    plan = plan_balanced(torch.from_numpy(c), slack=slack)
    verify_plan(plan, c, slack)


def test_deterministic_and_dtypes():
    c = random_counts("zipf1.5", 8, 4, 4, 100, 7)
    p1 = plan_balanced(torch.from_numpy(c))
    p2 = plan_balanced(torch.from_numpy(c).to(torch.int32))
    for a, b in [(p1.assignment, p2.assignment), (p1.replica_experts, p2.replica_experts),
                 (p1.replica_source, p2.replica_source), (p1.recv_counts, p2.recv_counts)]:
        assert torch.equal(a, b)


def test_theorem2_bound_reached():
    # rank 0's experts get nothing: rank 0 needs about E(R-1)/R^2 replicas, never more than epn
    R, epn = 8, 16
    c = np.ones((R, R * epn), np.int64) * 7
    c[:, :epn] = 0
    plan = plan_balanced(torch.from_numpy(c))
    verify_plan(plan, c)
    n = plan.num_replicas()
    assert int(n[0]) == -(-(R * epn) * (R - 1) // R**2)
    assert int(n.max()) <= epn


def test_empty_and_single_rank():
    for R, E in [(1, 4), (4, 8)]:
        c = np.zeros((R, E), np.int64)
        p = plan_balanced(torch.from_numpy(c))
        verify_plan(p, c)
        assert int(p.num_replicas().sum()) == 0


@pytest.mark.parametrize("fam", ["uniform", "zipf1.0", "zipf1.5", "zipf2.0", "hot", "theorem2", "dirichlet"])
def test_matches_oracle_small(fam):
    pytest.importorskip("scipy")
    from tests.harness.planner_oracle import oracle_plan
    eq = n = 0
    for R, epn, seed in [(2, 2, 0), (3, 2, 1), (4, 2, 2), (4, 3, 3), (3, 4, 4)]:
        c = random_counts(fam, R, epn, 2, 12, seed)
        got = int(plan_balanced(torch.from_numpy(c)).num_replicas().max())
        opt = oracle_plan(c, time_limit=20).max_replicas
        assert got >= opt  # sanity: the oracle is a lower bound
        eq += got == opt
        n += 1
    assert eq == n, f"{fam}: optimal on {eq}/{n}"


def test_bad_input():
    ok = torch.ones(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="counts.*negative"):
        plan_balanced(torch.tensor([[1, -1], [0, 0]]))
    with pytest.raises(ValueError, match="counts.*integer dtype.*float32"):
        plan_balanced(ok.float())
    with pytest.raises(ValueError, match=r"counts.*\[R, E\].*\(8,\)"):
        plan_balanced(ok.view(-1))
    with pytest.raises(ValueError, match="E % R == 0.*E=4, R=3"):
        plan_balanced(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="counts.*torch.Tensor"):
        plan_balanced(np.ones((2, 4), np.int64))
    with pytest.raises(ValueError, match="slack"):
        plan_balanced(ok, slack=-0.1)
    with pytest.raises(ValueError, match=r"row 1 sums to 5, expected .* = 4"):
        plan_balanced(torch.tensor([[1, 1, 1, 1], [1, 1, 1, 2]]), tokens_per_rank=2, topk=2)
    with pytest.raises(ValueError, match="tokens_per_rank and topk"):
        plan_balanced(ok, tokens_per_rank=2)
    with pytest.raises(ValueError, match="tokens_per_rank"):
        plan_balanced(ok, tokens_per_rank=[1, 2, 3], topk=1)
    plan_balanced(torch.tensor([[1, 1, 1, 1], [1, 1, 1, 2]]), tokens_per_rank=[4, 5], topk=1)
