"""QuantileBalancer across ranks (run on every rank by tests.harness.mprun; see tests/mp/test_mp_balance.py).

Balancers live on ``rt.collective_device`` (the GPU under NCCL, else the host), where the group's
all-reduce wants them.

The reference is the same balancer fed every token in one process (a singleton group, so no all-reduce);
the pooled biases must be bit-identical to it for any split of the tokens over ranks and micro-batches.
"""
import time

import torch
import torch.distributed as dist

from moonep.balance import QuantileBalancer
from tests.harness.mp import SkipCase

_SOLO = None


def solo_group():
    """A group holding only this rank (created once, collectively)."""
    global _SOLO
    if _SOLO is None:
        _SOLO, _ = dist.new_subgroups(group_size=1)
    return _SOLO


def global_scores(step, n, E, seed):
    """The step's global batch ``[n, E]`` float32, identical on every rank (skewed sigmoid router)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    pop = -torch.log(torch.arange(1, E + 1, dtype=torch.float64))[torch.randperm(E, generator=g)]
    return torch.sigmoid(pop + torch.randn(n, E, generator=g, dtype=torch.float64)).float()


def split_sizes(n, parts, g, zeros=True):
    """Random sizes summing to ``n``; some parts empty when ``zeros``."""
    w = torch.rand(parts, generator=g, dtype=torch.float64) ** 3
    if zeros and parts > 1:
        w[torch.randint(parts, (1,), generator=g)] = 0
    cut = (w.cumsum(0) / w.sum() * n).floor().long()
    cut[-1] = n
    return torch.diff(cut, prepend=torch.zeros(1, dtype=torch.long)).tolist()


def run_split(rt, E, K, n, bins, seed, steps=3, ema=0.0):
    """Train ``steps`` steps on this rank's share; compare every step's bias with the solo reference."""
    dev = rt.collective_device
    pooled = QuantileBalancer(E, K, bins=bins, group=rt.group, ema=ema, device=dev)
    ref = QuantileBalancer(E, K, bins=bins, group=solo_group(), ema=ema, device=dev)
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        scores = global_scores(t, n, E, seed)
        ref.route(scores.to(dev))
        ref.step()
        sizes = split_sizes(n, rt.world_size, g)  # same draw on every rank
        start = sum(sizes[:rt.rank])
        mine = scores[start:start + sizes[rt.rank]]
        micro = split_sizes(mine.shape[0], 3, g)  # drawn on every rank, so g stays in step
        for chunk in torch.split(mine, micro):
            pooled.route(chunk.to(dev))
        pooled.step()
        assert torch.equal(pooled.bias, ref.bias), (
            f"E={E} K={K} step {t}: max |diff| {float((pooled.bias - ref.bias).abs().max())}, sizes {sizes}")
    return pooled


def case_split_invariance(rt):
    for E, K, n, bins, seed in [(64, 8, 1000, 1000, 1), (256, 16, 777, 1000, 2), (32, 2, 97, 50, 3),
                                (896, 16, 300, 1000, 4)]:
        run_split(rt, E, K, n, bins, seed)


def case_split_invariance_ema(rt):
    run_split(rt, 48, 4, 600, 1000, 5, steps=4, ema=0.5)


def case_fewer_tokens_than_ranks(rt):
    run_split(rt, 16, 3, 2, 100, 6)  # most ranks hold nothing at all


def case_default_group(rt):
    """``group=None`` pools over the default group, like passing it explicitly."""
    if not dist.is_initialized():
        return
    a = QuantileBalancer(32, 4, device=rt.collective_device)
    b = QuantileBalancer(32, 4, group=dist.group.WORLD, device=rt.collective_device)
    scores = global_scores(rt.rank, 100, 32, 7).to(rt.collective_device)  # different tokens per rank
    for qb in (a, b):
        qb.route(scores)
        qb.step()
    assert torch.equal(a.bias, b.bias)
    got = [torch.zeros_like(a.bias) for _ in range(dist.get_world_size())]
    dist.all_gather(got, a.bias)
    assert all(torch.equal(x, a.bias) for x in got), "ranks disagree on the bias"


def case_empty_everywhere(rt):
    qb = QuantileBalancer(24, 2, group=rt.group, device=rt.collective_device)
    qb.bias.copy_(torch.linspace(-0.1, 0.1, 24, device=rt.collective_device) - 0.0)
    before = qb.bias.clone()
    qb.route(torch.empty(0, 24, device=rt.collective_device))
    qb.step()
    assert torch.equal(qb.bias, before)


def case_bad_scores_on_one_rank(rt):
    """Deferred validation: bad scores on rank 0 alone stop the update on every rank, and all raise."""
    if rt.collective_device.type == "cuda":
        return  # the CUDA path reports a step late; covered by tests/gpu/test_balance_gpu.py
    E = 16
    qb = QuantileBalancer(E, 2, group=rt.group, validate="deferred", device=rt.collective_device)
    scores = global_scores(rt.rank, 50, E, 8)
    qb.route(scores)
    qb.step()
    before = qb.bias.clone()
    if rt.rank == 0:
        scores = scores.clone()
        scores[0, 0] = 1.5
    qb.route(scores)
    try:
        qb.step()
    except ValueError as exc:
        assert "scores: expected values in [0, 1]" in str(exc)
    else:
        raise AssertionError("step() did not raise on a rank whose peer saw bad scores")
    assert torch.equal(qb.bias, before)


def case_cuda_all_reduce_without_sync(rt):
    """On CUDA the pooled step (NCCL all-reduce included) makes no device-to-host sync."""
    if rt.collective_device.type != "cuda":
        raise SkipCase("needs NCCL on CUDA (a CUDA collective device)")
    E, K = 896, 16
    qb = QuantileBalancer(E, K, group=rt.group, device=rt.collective_device)
    scores = global_scores(rt.rank, 1024, E, 9).to(rt.collective_device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            qb.route(scores)
            qb.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = [torch.zeros_like(qb.bias) for _ in range(rt.world_size)]
    dist.all_gather(got, qb.bias, group=rt.group)
    assert all(torch.equal(x, qb.bias) for x in got), "ranks disagree on the bias"


def _step_until_refused(qb, scores, dev, steps=4):
    """``step()`` until it raises (CPU: at once; CUDA: once the flag reached the host, a step or so late);
    the state must not move meanwhile.  Returns the message."""
    state = [qb.bias.clone(), qb.num_steps.clone()]
    for _ in range(steps):
        qb.route(scores)
        t0 = time.perf_counter()
        try:
            qb.step()
        except ValueError as exc:
            print(f"timing: QuantileBalancer.step refused, states differ, rank {dist.get_rank()}: "
                  f"{time.perf_counter() - t0:.4f}s", flush=True)
            assert torch.equal(qb.bias, state[0]) and torch.equal(qb.num_steps, state[1]), "a refused step moved"
            return str(exc)
        assert torch.equal(qb.bias, state[0]) and torch.equal(qb.num_steps, state[1]), "a refused step moved"
        if dev.type == "cuda":
            torch.cuda.synchronize()
    raise AssertionError(f"step() was not refused in {steps} steps although the ranks' states differ")


def case_state_differs_across_ranks(rt):
    """A checkpoint loaded on the last rank only (its bias, then its num_steps, differ): the next step is
    refused on every rank, the state left as it was on every rank; loading the same state everywhere makes
    the steps work again, equal on every rank."""
    if rt.world_size == 1:
        return
    dev, E, K = rt.collective_device, 16, 2
    qb = QuantileBalancer(E, K, group=rt.group, device=dev)
    scores = global_scores(rt.rank, 60, E, 11).to(dev)
    for _ in range(2):
        qb.route(scores)
        qb.step()
    good = {k: v.clone() for k, v in qb.state_dict().items()}
    for field in ("bias", "num_steps"):
        mine = {k: v.clone() for k, v in good.items()}
        if rt.rank == rt.world_size - 1:
            mine[field] = mine[field] + (1e-6 if field == "bias" else 1)
        qb.load_state_dict(mine)
        msg = _step_until_refused(qb, scores, dev)
        assert "expected the same bias and num_steps on every rank" in msg, msg
    qb.load_state_dict(good)
    for _ in range(2):
        qb.route(scores)
        qb.step()
    got = [torch.zeros_like(qb.bias) for _ in range(rt.world_size)]
    dist.all_gather(got, qb.bias, group=rt.group)
    assert all(torch.equal(x, qb.bias) for x in got), "ranks disagree on the bias after loading the same state"
    assert int(qb.num_steps) == int(good["num_steps"]) + 2
