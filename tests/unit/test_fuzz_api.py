"""Fuzz every public entry point with hypothesis: random shapes, dtypes, values (NaN, inf, huge and negative
ids), empty and non-contiguous tensors, wrong devices ("meta", a CUDA device that does not exist).

The oracle is the same everywhere: an input the docs accept gives the right answer (checked against an
independent computation, and non-contiguous inputs against their contiguous copy); any other input raises
``ValueError`` whose message starts with the argument's name and says what was expected and what came
(``TypeError`` only for an unknown keyword). Never another exception type, a crash, a hang or a silent
wrong answer. ``ExpertParallel`` runs as one process (``moonep.init()``, world size 1) here; the
multi-rank bad-input cases live in ``tests/mp/cases_ep.py``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moonep
from moonep.layout import capacity, cu_seqlens, slot_experts, slot_sizes, token_destinations
from moonep.planner import plan_balanced
from tests.harness.planner_corpus import counts_from_topk, routing, verify_plan

SET = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
INT_DT = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
ALL_DT = INT_DT + [torch.float32, torch.float64, torch.bfloat16, torch.bool]
FLOAT_DT = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
WEIRD = st.sampled_from([None, "1", [1], 1.5, True, -1, float("nan"), float("inf"), -0.5, 2**70])
DEVICES = st.sampled_from(["cpu", "cpu", "cpu", "meta"])


def raises_named(fn, *names):
    """``fn()`` must raise ValueError naming one of ``names`` with "expected"; returns the message."""
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert any(msg.startswith(n) for n in names) and "expected" in msg, msg
    return msg


def odd_layout(t: torch.Tensor, transpose: bool) -> torch.Tensor:
    """The same values, stored transposed (non-contiguous) when asked."""
    if not transpose or t.dim() != 2:
        return t
    return t.t().contiguous().t()


# ------------------------------------------------------------------------------------------ plan_balanced
@SET
@given(st.integers(0, 4), st.integers(0, 6), st.sampled_from(ALL_DT), DEVICES, st.booleans(),
       st.sampled_from(["small", "negative", "huge", "zero"]),
       st.one_of(st.sampled_from([0.0, 0.05, 1.0, 1e300]), WEIRD), st.integers(0, 2**31))
def test_fuzz_plan_balanced(R, E, dtype, device, transpose, values, slack, seed):
    rng = np.random.default_rng(seed)
    hi = {"small": 50, "negative": 50, "huge": 2**62, "zero": 1}[values]
    arr = rng.integers(0, hi, size=(R, E), dtype=np.int64)
    if values == "negative" and arr.size:
        arr.flat[rng.integers(arr.size)] = -int(rng.integers(1, 2**40))
    c = torch.from_numpy(arr)
    if dtype not in (torch.int64,):
        c = c.clamp(-100, 100).to(dtype)
    c = odd_layout(c, transpose).to(device)
    ok_slack = isinstance(slack, (int, float)) and not isinstance(slack, bool) and math.isfinite(slack) and slack >= 0
    valid = (dtype in INT_DT and R >= 1 and E >= 1 and E % R == 0 and device == "cpu" and ok_slack
             and bool((c.to(torch.int64) >= 0).all()) and float(c.double().sum()) < 2**62)
    if not valid:
        raises_named(lambda: plan_balanced(c, slack=slack), "counts", "slack")
        return
    p = plan_balanced(c, slack=slack)
    verify_plan(p, c.to(torch.int64).numpy(), slack)


@SET
@given(st.integers(1, 4), st.integers(1, 3), st.one_of(st.integers(-3, 40), WEIRD, st.just([4, 5])),
       st.one_of(st.integers(-1, 3), WEIRD))
def test_fuzz_plan_declared_tokens(R, epn, tokens_per_rank, topk):
    c = torch.full((R, R * epn), 2, dtype=torch.int64)
    per_row = 2 * R * epn
    declared_ok = (isinstance(topk, int) and not isinstance(topk, bool) and topk >= 1 and
                   isinstance(tokens_per_rank, int) and not isinstance(tokens_per_rank, bool)
                   and tokens_per_rank * topk == per_row) or (tokens_per_rank is None and topk is None)
    if declared_ok:
        verify_plan(plan_balanced(c, tokens_per_rank=tokens_per_rank, topk=topk), c.numpy())
    else:
        raises_named(lambda: plan_balanced(c, tokens_per_rank=tokens_per_rank, topk=topk),
                     "counts", "topk", "tokens_per_rank")


# ------------------------------------------------------------------------------------------ layout
def _plan_and_routing(R, epn, K, s, seed, slack=0.0):
    E = R * epn
    K = min(K, E)
    tk = routing("zipf1.5", E, R, K, s, seed)
    tk[np.random.default_rng(seed).random(tk.shape) < 0.1] = -1
    return plan_balanced(torch.from_numpy(counts_from_topk(tk, E)), slack=slack), tk


@SET
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 4), st.integers(0, 12), st.integers(0, 2**31),
       st.one_of(st.integers(-2, 7), WEIRD), st.one_of(st.sampled_from([1, 4]), WEIRD, st.just(0)),
       st.sampled_from(["ok", "float", "bool", "meta", "too_big", "below_minus_one", "extra_copy", "missing_copy",
                        "transposed", "1d", "list", "int32"]))
def test_fuzz_layout(R, epn, K, s, seed, rank, align, corrupt):
    plan, tk = _plan_and_routing(R, epn, K, s, seed)
    E = R * epn
    rank_ok = isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < R
    align_ok = isinstance(align, int) and not isinstance(align, bool) and align >= 1
    src = rank if rank_ok else 0
    idx = torch.from_numpy(tk[src].copy())
    valid = rank_ok and align_ok
    if corrupt == "float":
        idx, valid = idx.float(), False
    elif corrupt == "bool":
        idx, valid = idx >= 0, False
    elif corrupt == "meta":
        idx, valid = idx.to("meta"), False
    elif corrupt == "too_big" and idx.numel():
        idx[0, 0], valid = E + int(np.random.default_rng(seed).integers(0, 2**40)), False
    elif corrupt == "below_minus_one" and idx.numel():
        idx[-1, -1], valid = -2 - int(np.random.default_rng(seed).integers(0, 2**40)), False
    elif corrupt == "extra_copy":
        idx, valid = torch.cat([idx, torch.zeros(1, idx.shape[1], dtype=idx.dtype)]), False
    elif corrupt == "missing_copy" and (idx >= 0).any():
        idx[idx >= 0] = torch.where(torch.arange(int((idx >= 0).sum())) == 0, -1, idx[idx >= 0])
        valid = False
    elif corrupt == "transposed":
        idx = odd_layout(idx, True)
    elif corrupt == "1d":
        idx, valid = idx.reshape(-1), False
    elif corrupt == "list":
        idx, valid = idx.tolist(), False
    elif corrupt == "int32":
        idx = idx.to(torch.int32)
    if not valid:
        raises_named(lambda: token_destinations(plan, rank, idx, align), "topk_idx", "rank", "align")
        if not rank_ok:
            raises_named(lambda: slot_experts(plan, rank), "rank")
            if rank is not None:  # None means every rank for cu_seqlens
                raises_named(lambda: cu_seqlens(plan, rank), "rank")
        if not align_ok:
            raises_named(lambda: slot_sizes(plan, align), "align")
            raises_named(lambda: cu_seqlens(plan, None, align), "align")
        return
    d, r = token_destinations(plan, rank, idx, align)
    ref = token_destinations(plan, rank, torch.from_numpy(tk[src]), align)
    assert torch.equal(d, ref[0]) and torch.equal(r, ref[1])
    cu = cu_seqlens(plan, rank, align).to(torch.int64)
    se = slot_experts(plan, rank)
    live = idx.to(torch.int64) >= 0
    mine = live & (d == rank)
    slot = torch.searchsorted(cu, r[mine], right=True) - 1  # every copy placed here is in its expert's slot
    assert torch.equal(se[slot], idx.to(torch.int64)[mine])
    raises_named(lambda: token_destinations("plan", rank, idx, align), "plan")


@SET
@given(st.one_of(st.integers(-2, 64), WEIRD), st.one_of(st.integers(-1, 8), WEIRD), st.one_of(st.integers(-1, 8), WEIRD),
       st.integers(1, 64), st.one_of(st.sampled_from([1, 128]), WEIRD), st.one_of(st.sampled_from([0.0, 0.1]), WEIRD))
def test_fuzz_capacity(S, K, R, E, align, slack):
    isint = lambda v, lo: isinstance(v, int) and not isinstance(v, bool) and v >= lo  # noqa: E731
    ok_slack = isinstance(slack, (int, float)) and not isinstance(slack, bool) and math.isfinite(slack) and slack >= 0
    if isint(S, 0) and isint(K, 1) and isint(R, 1) and isint(align, 1) and ok_slack and E % R == 0:
        cap = capacity(S, K, R, E, align, slack)
        assert cap >= S * K and cap == math.ceil(max(S * K, (1 + slack) * S * K)) + 2 * (E // R) * (align - 1)
    else:
        raises_named(lambda: capacity(S, K, R, E, align, slack), "max_tokens", "topk", "num_ranks", "num_experts",
                     "align", "slack")


# ------------------------------------------------------------------------------------------ ExpertParallel
@pytest.fixture(scope="module")
def rt():
    return moonep.init()


CTOR = dict(num_experts=4, topk=2, hidden=8, max_tokens=6)


@SET
@given(st.sampled_from(["num_experts", "topk", "hidden", "max_tokens", "align", "slack", "dtype", "device",
                        "apply_weights", "transport", "zero_copy", "timeout", "tuning"]),
       st.one_of(WEIRD, st.sampled_from([0, 3, "meta", "cuda:7", "nope", torch.int32, "float32", 1e300])))
def test_fuzz_ep_constructor(rt, name, value):
    kw = dict(CTOR, **{name: value})
    try:
        ep = moonep.ExpertParallel(rt, **kw)
    except ValueError as e:
        assert str(e).startswith(name) and "expected" in str(e), str(e)
        return
    # accepted: the value must be a sensible one for that argument
    assert getattr(ep, name, value) == value or name in ("device", "transport", "zero_copy", "timeout", "tuning")
    if name == "slack":
        assert isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _ref_combine(x, idx, w):
    """sum_k w_k x over live choices (identity experts), float64."""
    live = (idx >= 0).to(torch.float64)
    return (w.double() * live).sum(1, keepdim=True) * x.double()


@SET
@given(st.integers(0, 6), st.sampled_from(FLOAT_DT), DEVICES, st.booleans(),
       st.sampled_from(["ok", "nan_x", "nan_w", "inf_w", "huge_id", "neg_id", "dup", "float_idx", "bad_H",
                        "too_many", "w_shape", "w_int", "x_3d", "idx_meta"]), st.integers(0, 2**31))
def test_fuzz_dispatch_combine(rt, s, dtype, device, transpose, corrupt, seed):
    E, K, H, S = 4, 2, 8, 6
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]) if s else torch.zeros(0, K, dtype=torch.int64)
    idx[torch.rand(s, K, generator=g) < 0.2] = -1
    w = torch.rand(s, K, generator=g, dtype=torch.float64).to(dtype)
    valid = device == "cpu"
    if corrupt == "nan_x" and s:
        x[0, 0] = float("nan")  # data, not routing: accepted and propagated
    elif corrupt in ("nan_w", "inf_w") and s:
        w[-1, 0], valid = float("nan" if corrupt == "nan_w" else "inf"), False
    elif corrupt == "huge_id" and s:
        idx[0, 0], valid = 2**62, False
    elif corrupt == "neg_id" and s:
        idx[0, 0], valid = -(2**40), False
    elif corrupt == "dup" and s:
        idx[0, :] = 1
        valid = False
    elif corrupt == "float_idx":
        idx, valid = idx.float(), False
    elif corrupt == "bad_H":
        x, valid = torch.randn(s, H + 1).to(dtype), False
    elif corrupt == "too_many":
        x, idx, w, valid = x.repeat(2, 1)[:S + 1], torch.full((S + 1, K), -1), torch.ones(S + 1, K, dtype=dtype), False
        x = torch.randn(S + 1, H).to(dtype)
    elif corrupt == "w_shape":
        w, valid = w[:, :1], False
    elif corrupt == "w_int":
        w, valid = (w > 0.5).to(torch.int64), False
    elif corrupt == "x_3d":
        x, valid = x[None], False
    elif corrupt == "idx_meta":
        idx, valid = idx.to("meta"), False
    x, idx, w = (odd_layout(t, transpose).to(device) if isinstance(t, torch.Tensor) and t.device.type != "meta"
                 else t for t in (x, idx, w))
    ep = moonep.ExpertParallel(rt, dtype=dtype, **CTOR)
    if not valid:
        raises_named(lambda: ep.dispatch(x, idx, w), "x", "topk_idx", "topk_weights")
        return
    h = ep.dispatch(x, idx, w)
    y = ep.combine(h.tokens, h)
    tol = 1e-12 if dtype == torch.float64 else 0.05
    want = _ref_combine(x, idx, w)
    ok = torch.isclose(y.double(), want, rtol=tol, atol=tol) | (want.isnan() & y.double().isnan())
    assert ok.all(), (corrupt, y, want)
    assert int(h.num_rows) == int((idx >= 0).sum())
    # the same values stored contiguously give bitwise the same result
    h2 = ep.dispatch(x.contiguous(), idx.contiguous(), w.contiguous())
    assert torch.equal(ep.combine(h2.tokens, h2).nan_to_num(), y.nan_to_num())
    # the other entry points on the same step
    raises_named(lambda: ep.combine(h.tokens[:-1] if h.tokens.shape[0] else h.tokens[:, :0].t(), h), "expert_out")
    raises_named(lambda: ep.combine(h.tokens.to("meta"), h), "expert_out")
    raises_named(lambda: ep.combine(h.tokens, None), "h")
    lw = torch.randn(ep.epn, 3, generator=g)
    assert torch.equal(ep.prefetch(h, odd_layout(lw, transpose))[:ep.epn], lw)
    raises_named(lambda: ep.prefetch(h, lw[:-1]), "local_weight")
    raises_named(lambda: ep.prefetch(h, lw.to("meta")), "local_weight")
    raises_named(lambda: ep.prefetch(None, lw), "h")
    raises_named(lambda: ep.prefetch(h, lw, out=torch.empty(2 * ep.epn, 4)), "out")
    # the fields later calls read must be what dispatch returned: replaced or sliced, they are refused
    for field, value in (("weights", h.weights[:-1]), ("weights", h2.weights), ("step", torch.zeros(1).long())):
        bad = h._replace(**{field: value})
        raises_named(lambda: ep.combine(h.tokens, bad) if field == "weights" else ep.prefetch(bad, lw), f"h.{field}")
    h.weights.mul_(1)  # in place: the same tensor, accepted
    assert torch.equal(ep.combine(h.tokens, h).nan_to_num(), y.nan_to_num())
    gv = torch.randn(2 * ep.epn, 3, generator=g)
    assert torch.equal(ep.reduce_grad(h, gv), gv[:ep.epn])  # one rank: no replicas to add
    raises_named(lambda: ep.reduce_grad(h, gv[:1]), "grad_view")
    raises_named(lambda: ep.reduce_grad(None, gv), "h")


def test_dispatch_and_combine_refuse_sparse_tensors_and_sequences_by_name(rt):
    """A sparse tensor (every op reads strides) and a list or tuple of rows (not a pre-quantised pair) are
    refused, naming the argument and what came; the next valid call works."""
    ep = moonep.ExpertParallel(rt, **CTOR)
    x, idx, w = torch.randn(3, 8), torch.tensor([[0, 1], [1, 2], [2, 3]]), torch.rand(3, 2)
    cases = [((x.to_sparse(), idx, w), "x", "got a torch.sparse_coo tensor"),
             ((x, idx.to_sparse(), w), "topk_idx", "got a torch.sparse_coo tensor"),
             ((x, idx, w.to_sparse()), "topk_weights", "got a torch.sparse_coo tensor"),
             ((list(x), idx, w), "x", "got a list of 3 items"),
             ((tuple(x[:2]), idx[:2], w[:2]), "x", "dispatch_dtype=torch.float8_e4m3fn), got a pair of tensors")]
    for args, name, got in cases:
        with pytest.raises(ValueError) as e:
            ep.dispatch(*args)
        assert str(e.value).startswith(f"{name}: expected ") and str(e.value).endswith(got), str(e.value)
    h = ep.dispatch(x, idx, w)
    with pytest.raises(ValueError, match="^expert_out: expected a dense"):
        ep.combine(h.tokens.to_sparse(), h)
    torch.testing.assert_close(ep.combine(h.tokens, h), _ref_combine(x, idx, w).float())


def test_expert_matmul_refuses_rows_of_the_wrong_form_by_name(rt):
    """``a`` as an empty, one- or three-item sequence (not the pair (fp8 tokens, scales)) is refused naming
    ``a`` (the empty one raised IndexError); the next valid call is the dense product."""
    ep = moonep.ExpertParallel(rt, **CTOR)
    x, idx, w = torch.randn(3, 8), torch.tensor([[0, 1], [1, 2], [2, 3]]), torch.rand(3, 2)
    h = ep.dispatch(x, idx, w)
    home = torch.randn(4, 8, 5)
    rep = moonep.ReplicaPool().fetch(ep, h, home, "w")
    for a, n in (((), 0), ((h.tokens,), 1), ((h.tokens, h.tokens, h.tokens), 3)):
        with pytest.raises(ValueError, match=rf"^a: expected a tensor, a Dispatched or a pair .*, got {n} items$"):
            moonep.expert_matmul(a, h.cu_seqlens, home, rep)
    y = moonep.expert_matmul(h.tokens, h.cu_seqlens, home, rep)
    cu, slots = h.cu_seqlens.tolist(), h.slot_experts.tolist()
    for j in range(len(cu) - 1):
        if cu[j + 1] > cu[j]:
            torch.testing.assert_close(y[cu[j]:cu[j + 1]], h.tokens[cu[j]:cu[j + 1]] @ home[slots[j]])


# ------------------------------------------------------------------------------------------ QuantileBalancer
@SET
@given(st.integers(0, 9), st.sampled_from(FLOAT_DT + [torch.int64]), DEVICES, st.booleans(),
       st.sampled_from(["ok", "nan", "inf", "neg", "above_one", "width", "3d"]), st.booleans(), st.integers(0, 2**31))
def test_fuzz_quantile_balancer(s, dtype, device, transpose, corrupt, training, seed):
    E, K = 6, 2
    qb = moonep.QuantileBalancer(E, K).train(training)
    g = torch.Generator().manual_seed(seed)
    sc = torch.rand(s, E, generator=g, dtype=torch.float64)
    valid = device == "cpu" and dtype != torch.int64
    if corrupt in ("nan", "inf", "neg", "above_one") and s:
        sc[s // 2, 1] = {"nan": float("nan"), "inf": float("inf"), "neg": -1e-3, "above_one": 1.5}[corrupt]
        valid = False
    elif corrupt == "width":
        sc, valid = torch.rand(s, E + 1, dtype=torch.float64), False
    elif corrupt == "3d":
        sc, valid = sc[None], False
    sc = odd_layout(sc.to(dtype), transpose).to(device)
    if not valid:
        raises_named(lambda: qb.route(sc), "scores")
        return
    idx, w = qb.route(sc)
    assert idx.shape == (s, K) and w.shape == (s, K) and w.dtype == dtype
    assert ((idx >= 0) & (idx < E)).all() and all(len(set(r)) == K for r in idx.tolist())
    wsum = w.double().sum(1)
    assert (((wsum - 1).abs() < 1e-2) | (wsum == 0)).all()
    ref = qb.route(sc.contiguous())
    assert torch.equal(ref[0], idx) and torch.equal(ref[1], w)
    qb.step()
    assert torch.isfinite(qb.bias).all()


# ------------------------------------------------------------------------------------------ LatentMoE
@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    return moonep.LatentMoE(16, 8, 6, 2, 12, num_shared=1, d_shared=4, dtype=torch.float64)


@SET
@given(st.sampled_from([(0, 16), (3, 16), (2, 4, 16), (5, 8), (16,), ()]), st.sampled_from([torch.float64, torch.float32]),
       DEVICES, st.booleans(), st.sampled_from(["ok", "nan", "inf", "huge"]), st.integers(0, 2**31))
def test_fuzz_latent_moe(moe, shape, dtype, device, transpose, corrupt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) if shape else torch.tensor(1.0, dtype=torch.float64)
    valid = device == "cpu" and dtype == torch.float64 and len(shape) >= 1 and shape[-1] == 16
    if corrupt == "nan" and x.numel() and valid:
        x.view(-1)[0], valid = float("nan"), False  # NaN tokens make NaN router scores: refused
    elif corrupt == "inf" and x.numel() and valid:
        x.view(-1)[0] = float("inf")  # scores saturate to 0/1 (valid) or turn NaN (refused)
        try:
            y = moe(odd_layout(x, transpose))
        except ValueError as e:
            assert str(e).startswith("x: ") and "router scores" in str(e) and "expected" in str(e), str(e)
            return
        assert not torch.isfinite(y).all()  # propagated, never a finite wrong answer
        return
    elif corrupt == "huge" and x.numel():
        x = x * 1e300  # finite but overflowing: saturated scores are still valid routing
    x = odd_layout(x.to(dtype), transpose).to(device)
    if not valid:
        raises_named(lambda: moe(x), "x")
        return
    y = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    if corrupt == "ok":
        assert torch.isfinite(y).all()
        # a transposed x takes another BLAS path: equal to rounding, not bitwise
        torch.testing.assert_close(moe(x.contiguous()), y, rtol=1e-12, atol=1e-12)


def test_fuzz_constructors_wrong_devices():
    for dev in ("meta", "cuda:7", "nope"):
        raises_named(lambda: moonep.QuantileBalancer(8, 2, device=dev), "device")
        raises_named(lambda: moonep.LatentMoE(16, 8, 4, 2, 8, device=dev), "device")
    raises_named(lambda: moonep.QuantileBalancer(8, 2, group="world"), "group")
    raises_named(lambda: moonep.LatentMoE(16, 8, 4, 2, 8, eps=float("nan")), "eps")
    raises_named(lambda: moonep.LatentMoE(16, 8, 4, 2, 8, num_shared=True), "num_shared")
