"""QuantileBalancer, single process: estimator vs an exact sort-based reference, edge cases, state, errors."""
import math

import pytest
import torch

from moonep.balance import QuantileBalancer, histogram_quantiles


def zipf_scores(n, E, seed=0, skew=1.0, noise=1.0, dtype=torch.float32):
    """Sigmoid scores ``[n, E]``: Zipf-like popularity logits plus per-token noise."""
    g = torch.Generator().manual_seed(seed)
    pop = -skew * torch.log(torch.arange(1, E + 1, dtype=torch.float64))[torch.randperm(E, generator=g)]
    return torch.sigmoid(pop + noise * torch.randn(n, E, generator=g, dtype=torch.float64)).to(dtype)


def required_biases(scores, bias, K):
    """Reference ``r = alpha - s`` ([n, E], float32) computed independently of the balancer."""
    s = scores.float()
    vals = torch.sort(s + bias, dim=1, descending=True).values
    return vals[:, K:K + 1] - s


def sort_quantile(r, K):
    """Exact ceil(q)-th smallest required bias per expert ([E] float64)."""
    n, E = r.shape
    need = -(-n * K // E)
    return torch.sort(r.double(), dim=0).values[need - 1]


def maxvio(idx, E):
    load = torch.bincount(idx.flatten(), minlength=E).double()
    return float(load.max() / load.mean() - 1)


@pytest.mark.parametrize("E,K,n,bins,seed", [(64, 8, 3000, 1000, 0), (256, 8, 2049, 1000, 1),
                                              (96, 2, 1001, 37, 2), (32, 16, 500, 200, 3), (8, 1, 777, 5, 4)])
def test_estimator_vs_sort_reference(E, K, n, bins, seed):
    scores = zipf_scores(n, E, seed)
    qb = QuantileBalancer(E, K, bins=bins)
    qb.bias.copy_(0.3 * torch.randn(E, generator=torch.Generator().manual_seed(seed)))
    qb.bias.sub_(qb.bias.mean())
    old = qb.bias.clone()
    qb.route(scores)
    counts = qb._counts[:E * bins].view(E, bins).clone()  # the histograms (then the bad count, the state bits)
    assert int(counts.sum()) == n * E and (counts.sum(1) == n).all()
    lo = old.min() - 1
    width = (old.max() + 1 - lo) / bins
    assert qb._lo == lo and qb._width == width
    raw, m = histogram_quantiles(counts, K, qb._lo, qb._width)
    assert int(m) == n
    r = required_biases(scores, old, K)
    ref = sort_quantile(r, K)
    w = float(width)
    assert (raw - ref).abs().max() <= w * (1 + 1e-5), "bias error above one bin width"
    # Coordinate step: with b_j applied (cutoffs fixed), expert j's load is within its bin's count of q.
    q = n * K / E
    load = (r.double() <= raw).sum(0)
    l = ((raw - float(lo)) / w).floor().long().clamp(0, bins - 1)
    h = counts.gather(1, l[:, None]).squeeze(1)
    assert ((load - q).abs() <= h + 1).all()
    # step: mean-centred raw estimate, used from then on.
    qb.step()
    assert torch.equal(qb.bias, (raw - raw.mean()).float())
    assert int(qb.num_steps) == 1 and not qb._counts.any()


def test_new_bias_balances_same_batch():
    E, K, n = 64, 8, 8192
    scores = zipf_scores(n, E, 5, skew=1.2)
    qb = QuantileBalancer(E, K)
    before = maxvio(qb.route(scores)[0], E)
    qb.step()
    qb.eval()
    after = maxvio(qb.route(scores)[0], E)
    for _ in range(3):  # a few exact coordinate steps on the same batch settle it
        qb.train()
        qb.route(scores)
        qb.step()
    qb.eval()
    settled = maxvio(qb.route(scores)[0], E)
    assert before > 3 and after < 0.5 and settled < 0.05, (before, after, settled)


def test_micro_batches_and_order_are_bit_identical():
    E, K = 48, 4
    scores = zipf_scores(1500, E, 6)
    ref = QuantileBalancer(E, K)
    ref.route(scores)
    ref.step()
    qb = QuantileBalancer(E, K)
    for chunk in torch.split(scores[torch.randperm(1500)], [0, 1, 700, 99, 700]):
        qb.route(chunk)
    qb.step()
    assert torch.equal(qb.bias, ref.bias)


def test_histogram_edge_cases():
    lo, w = torch.tensor(-1.0), torch.tensor(0.2)
    # q on a bin boundary: E=4, K=1, m=8 -> q=2 reached exactly at the end of bin 1 -> its right edge.
    c = torch.zeros(4, 10, dtype=torch.int32)
    c[:, 0], c[:, 1], c[:, 9] = 1, 1, 6
    b, m = histogram_quantiles(c, 1, lo, w)
    assert int(m) == 8 and torch.allclose(b, torch.full((4,), -1 + 2 * 0.2, dtype=torch.float64))
    # non-integer q = 9/4: third count sits in bin 9 (6 of them), frac = (2.25 - 2) / 7 ... here h = 7.
    c[:, 9] = 7
    b, _ = histogram_quantiles(c, 1, lo, w)
    assert torch.allclose(b, torch.full((4,), -1 + (9 + 0.25 / 7) * 0.2, dtype=torch.float64))
    # empty histogram: finite, m = 0
    b, m = histogram_quantiles(torch.zeros(4, 10, dtype=torch.int32), 1, lo, w)
    assert int(m) == 0 and torch.isfinite(b).all()
    # everything in one bin (ties at margin 0)
    c = torch.zeros(3, 5, dtype=torch.int32)
    c[:, 2] = 10
    b, _ = histogram_quantiles(c, 1, lo, w)
    assert torch.allclose(b, torch.full((3,), -1 + (2 + (10 / 3) / 10) * 0.2, dtype=torch.float64))


def test_empty_steps_keep_bias():
    qb = QuantileBalancer(16, 2)
    qb.bias.copy_(torch.linspace(-0.5, 0.5, 16))
    before = qb.bias.clone()
    qb.step()  # nothing routed
    idx, w = qb.route(torch.empty(0, 16))
    assert idx.shape == (0, 2) and idx.dtype == torch.int64 and w.shape == (0, 2)
    qb.step()  # only an empty micro-batch
    assert torch.equal(qb.bias, before) and int(qb.num_steps) == 2


def test_ties_and_boundary_scores():
    E, K = 16, 4
    for scores in (torch.full((100, E), 0.5), torch.zeros(50, E), torch.ones(50, E),
                   torch.randint(0, 2, (200, E)).float()):
        qb = QuantileBalancer(E, K)
        for _ in range(3):
            idx, w = qb.route(scores)
            qb.step()
            assert torch.isfinite(qb.bias).all() and torch.isfinite(w).all()
            assert abs(float(qb.bias.mean())) < 1e-6
    # all-equal scores: every required bias is 0, so the bias stays 0
    qb = QuantileBalancer(E, K)
    qb.route(torch.full((64, E), 0.3))
    qb.step()
    assert qb.bias.abs().max() < 2.5 / 1000


def test_never_selected_expert_gets_pulled_in():
    E, K, n = 32, 2, 4000
    scores = zipf_scores(n, E, 7)
    scores[:, 5] = 0.0  # never wins on its own
    qb = QuantileBalancer(E, K)
    assert not (qb.route(scores)[0] == 5).any()
    qb.step()
    assert int(qb.bias.argmax()) == 5
    loads = []
    for _ in range(4):
        loads.append(int(torch.bincount(qb.route(scores)[0].flatten(), minlength=E)[5]))
        qb.step()
    # A constant-score expert competes through its bias alone; the (K+1)-th cutoff under-estimates what it
    # needs to beat the K-th, so it climbs towards q over several steps rather than one.
    assert 0 < loads[0] < loads[1] < loads[2] < loads[3] <= n * K / E, loads
    assert torch.isfinite(qb.bias).all()


def test_ema():
    E, K = 32, 4
    a, b = zipf_scores(1000, E, 8), zipf_scores(1000, E, 9)
    plain = QuantileBalancer(E, K)
    plain.route(a)
    plain.step()
    ema = QuantileBalancer(E, K, ema=0.25)
    ema.route(a)
    ema.step()
    want = 0.75 * plain.bias.double()
    assert torch.allclose(ema.bias.double(), want - want.mean(), atol=1e-6)
    # second step: mix of the old bias and the new (centred) estimate
    old = ema.bias.clone().double()
    probe = QuantileBalancer(E, K)
    probe.bias.copy_(ema.bias)
    probe.route(b)
    probe.step()
    ema.route(b)
    ema.step()
    want = 0.25 * old + 0.75 * probe.bias.double()
    assert torch.allclose(ema.bias.double(), want - want.mean(), atol=1e-6)


def test_routing_weights_and_dtypes():
    E, K = 24, 3
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        scores = zipf_scores(200, E, 10, dtype=dtype)
        qb = QuantileBalancer(E, K)
        qb.bias.copy_(torch.randn(E) * 0.2)
        idx, w = qb.route(scores)
        assert idx.dtype == torch.int64 and idx.shape == (200, K) and w.dtype == dtype
        want_idx = torch.topk(scores.float() + qb.bias, K, dim=1).indices
        assert torch.equal(idx.sort(1).values, want_idx.sort(1).values)
        raw = scores.gather(1, idx)
        assert torch.allclose(w.float(), (raw / raw.sum(1, keepdim=True)).float(), rtol=1e-2)


def test_gradients_flow_to_scores():
    E, K = 12, 3
    qb = QuantileBalancer(E, K, frozen=True)
    qb.bias.copy_(torch.linspace(-0.2, 0.2, E))
    scores = zipf_scores(20, E, 11, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: qb.route(s)[1], (scores,))
    # training mode too; the bias receives no gradient
    qb2 = QuantileBalancer(E, K)
    idx, w = qb2.route(scores)
    (w * torch.arange(K, dtype=w.dtype)).sum().backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0
    assert not qb2.bias.requires_grad


def test_frozen_and_eval_modes():
    E, K = 16, 2
    scores = zipf_scores(300, E, 12)
    qb = QuantileBalancer(E, K, frozen=True)
    qb.bias.copy_(torch.linspace(-0.3, 0.3, E))
    before = qb.bias.clone()
    qb.route(scores)
    assert not qb._counts.any()
    qb.step()
    assert torch.equal(qb.bias, before) and int(qb.num_steps) == 0
    qb.frozen = False
    qb.eval()  # evaluation passes route without recording
    qb.route(scores)
    assert not qb._counts.any()
    qb.train()
    qb.route(scores)
    qb.step()
    assert not torch.equal(qb.bias, before)


def test_state_dict_round_trip():
    E, K = 20, 4
    scores = zipf_scores(500, E, 13)
    qb = QuantileBalancer(E, K)
    qb.route(scores)
    qb.step()
    sd = qb.state_dict()
    assert set(sd) == {"bias", "num_steps"}
    other = QuantileBalancer(E, K)
    other.route(zipf_scores(50, E, 14))  # pending counts are dropped by the load
    other.load_state_dict(sd)
    assert not other._counts.any()
    assert torch.equal(other.bias, qb.bias) and int(other.num_steps) == 1
    assert torch.equal(other.route(scores)[0], qb.route(scores)[0])
    qb.step()
    other.step()
    assert torch.equal(other.bias, qb.bias)
    with pytest.raises(ValueError, match=r"state_dict\['bias'\].*\[20\].*\[21\]"):
        other.load_state_dict({"bias": torch.zeros(21), "num_steps": torch.tensor(0)})


@pytest.mark.parametrize("bias, num_steps, name, why", [
    (float("nan"), 3, "bias", "finite values"), (float("inf"), 3, "bias", "finite values"),
    (float("-inf"), 3, "bias", "finite values"), (0.1, -1, "num_steps", "a count >= 0"),
    (0.1, 2.5, "num_steps", "an integer tensor"), (0.1, [1, 2], "num_steps", "an integer tensor")])
def test_load_state_dict_refuses_bad_values(bias, num_steps, name, why):
    """A NaN bias routed every token to the same experts for ever; a negative or fractional step count is no
    count.  Refused, naming the entry; nothing changes."""
    E, K = 6, 2
    qb = QuantileBalancer(E, K)
    qb.route(zipf_scores(40, E, 3))
    qb.step()
    before = {k: v.clone() for k, v in qb.state_dict().items()}
    b = torch.full((E,), 0.1)
    b[2] = bias
    with pytest.raises(ValueError, match=rf"state_dict\['{name}'\]: expected {why}"):
        qb.load_state_dict({"bias": b, "num_steps": torch.tensor(num_steps)})
    assert all(torch.equal(v, before[k]) for k, v in qb.state_dict().items())


def test_select_then_record_equals_route():
    """select() + record() is route(): the same choices and weights, the same counts (what LatentMoE does
    so that a refused forward records nothing)."""
    E, K = 10, 3
    a, b = QuantileBalancer(E, K), QuantileBalancer(E, K)
    for seed in (1, 2):
        scores = zipf_scores(64, E, seed)
        ia, wa = a.route(scores)
        ib, wb, pending = b.select(scores)
        assert torch.equal(ia, ib) and torch.equal(wa, wb) and not b._counts.any()
        b.record(pending)
        assert torch.equal(a._counts, b._counts)
        a.step()
        b.step()
        assert torch.equal(a.bias, b.bias)
    assert b.eval().select(zipf_scores(8, E, 3))[2] is None  # nothing to record in eval mode


def test_bad_inputs():
    E, K = 8, 2
    qb = QuantileBalancer(E, K)
    ok = torch.full((4, E), 0.5)
    cases = [(ok.clone().fill_(float("nan")), r"scores: expected values in \[0, 1\].*4 NaN|NaN"),
             (ok + 0.6, r"scores: expected values in \[0, 1\].*got 32 invalid"),
             (ok - 0.6, r"scores: expected values in \[0, 1\]"),
             (ok[0], r"scores: expected 2 dimensions, got shape \(8,\)"),
             (torch.full((4, E + 1), 0.5), r"scores: expected shape \[s, 8\].*got \[4, 9\]"),
             (torch.ones(4, E, dtype=torch.int64), r"scores: expected a floating dtype"),
             ([[0.5] * E], r"scores: expected a torch.Tensor, got list")]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            qb.route(bad)
    assert not qb._counts.any()
    for kwargs, msg in [(dict(num_experts=8, topk=8), r"topk: expected an int in \[1, num_experts=8\).*got 8"),
                        (dict(num_experts=8, topk=0), r"topk: expected"),
                        (dict(num_experts=1, topk=1), r"num_experts: expected an int >= 2, got 1"),
                        (dict(num_experts=8, topk=2, bins=0), r"bins: expected"),
                        (dict(num_experts=8, topk=2, ema=1.0), r"ema: expected a float in \[0, 1\), got 1.0"),
                        (dict(num_experts=8, topk=2, validate="x"), r"validate: expected")]:
        with pytest.raises(ValueError, match=msg):
            QuantileBalancer(**kwargs)


def test_deferred_validation_on_cpu():
    E, K = 8, 2
    qb = QuantileBalancer(E, K, validate="deferred")
    good = zipf_scores(100, E, 15)
    qb.route(good)
    qb.step()
    before = qb.bias.clone()
    bad = good.clone()
    bad[3, 1] = float("nan")
    qb.route(good)
    qb.route(bad)  # no error yet, and the binning stays in bounds
    with pytest.raises(ValueError, match=r"scores: expected values in \[0, 1\].*1 micro-batch.*not updated"):
        qb.step()
    assert torch.equal(qb.bias, before) and not qb._counts.any()
    off = QuantileBalancer(E, K, validate=False)
    off.route(bad)
    off.step()  # unchecked, but safe
    assert torch.isfinite(off.bias).all()
