"""QuantileBalancer on CUDA: no device-to-host sync, same counts as the CPU path, deferred validation.

With CuPy the fused kernels of ``csrc/balance.cu`` run; they must give the CPU path's counts, range and
uncentred quantiles bit for bit, for every score dtype, with and without shared-memory privatisation, and be
capturable in a CUDA graph. The pure-torch fallback (no CuPy) must give the same counts.
"""
import pytest
import torch

from moonep import cuda_runtime as cuda_kernels
from moonep.balance import QuantileBalancer, histogram_quantiles
from tests.harness.cuda_graph import capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def zipf_scores(n, E, seed):
    g = torch.Generator().manual_seed(seed)
    pop = -torch.log(torch.arange(1, E + 1, dtype=torch.float64))[torch.randperm(E, generator=g)]
    return torch.sigmoid(pop + torch.randn(n, E, generator=g, dtype=torch.float64)).float()


class no_sync:
    """Any device-to-host sync inside raises."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_and_step_without_sync(dtype):
    E, K, n = 896, 16, 8192
    scores = zipf_scores(n, E, 0).to(dtype)
    cpu = QuantileBalancer(E, K)
    gpu = QuantileBalancer(E, K, device="cuda")
    dev_scores = scores.cuda().requires_grad_(True)
    with no_sync():
        outs = [gpu.route(chunk) for chunk in dev_scores.split([4096, 1, 4095])]
    cpu.route(scores)
    # Integer counts are exact, so the device histogram must equal the CPU one.
    assert torch.equal(gpu._counts.cpu(), cpu._counts)
    with no_sync():
        gpu.step()
        loss = sum((w * w).sum() for _, w in outs)
        loss.backward()
    cpu.step()
    assert torch.allclose(gpu.bias.cpu(), cpu.bias, atol=1e-6, rtol=0)
    assert dev_scores.grad is not None and bool(dev_scores.grad.abs().sum() > 0)
    # a few more steps stay sync-free, including micro-batches and frozen inference routing
    with no_sync():
        for _ in range(3):
            gpu.route(dev_scores.detach())
            gpu.step()
        gpu.frozen = True
        idx, w = gpu.route(dev_scores.detach())
        gpu.step()
    assert idx.shape == (n, K) and w.dtype == dtype


def test_deferred_validation_reports_later_without_sync():
    E, K = 64, 4
    qb = QuantileBalancer(E, K, device="cuda")
    good = zipf_scores(512, E, 1).cuda()
    bad = good.clone()
    bad[7, 3] = float("nan")
    with no_sync():
        qb.route(good)
        qb.step()
    before = qb.bias.clone()
    with no_sync():
        qb.route(bad)  # no error and no sync here
        qb.step()      # the update is skipped on device
    torch.cuda.synchronize()
    assert torch.equal(qb.bias, before)
    qb.route(good)
    with pytest.raises(ValueError, match=r"scores: expected values in \[0, 1\] and no NaN.*1 micro-batch"):
        qb.step()  # the count reached the host: reported now
    assert not torch.equal(qb.bias, before)  # the good step itself did update


def test_eager_validation_on_cuda():
    qb = QuantileBalancer(8, 2, device="cuda", validate="eager")
    with pytest.raises(ValueError, match=r"scores: expected values in \[0, 1\]"):
        qb.route(torch.full((3, 8), 2.0, device="cuda"))


needs_cupy = pytest.mark.skipif(not cuda_kernels.available(), reason="needs cupy (fused kernels)")


@needs_cupy
def test_kernels_in_use():
    qb = QuantileBalancer(16, 2, device="cuda")
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert qb._use_kernels(torch.zeros(1, 16, device="cuda", dtype=dt))


def random_bias(E, seed, scale=0.3):
    b = scale * torch.randn(E, generator=torch.Generator().manual_seed(seed))
    return b - b.mean()


@needs_cupy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("E,K,bins,n", [(896, 16, 1000, 3000), (64, 8, 37, 1500), (256, 8, 1000, 777),
                                        (8, 3, 30000, 500)])  # last: bins too many for shared memory
def test_kernels_bit_identical_to_cpu(dtype, E, K, bins, n, monkeypatch):
    cpu = QuantileBalancer(E, K, bins=bins)
    gpu = QuantileBalancer(E, K, bins=bins, device="cuda")
    ref = QuantileBalancer(E, K, bins=bins, device="cuda")  # pure-torch path on the device
    for step in range(3):
        bias = random_bias(E, step) if step else torch.zeros(E)
        for qb in (cpu, gpu, ref):
            qb.bias.copy_(bias)
        scores = zipf_scores(n, E, 10 + step).to(dtype)
        dev = scores.cuda()
        sizes = [n // 2, 0, 1, n - n // 2 - 1]  # micro-batches, one empty
        with no_sync():
            for chunk in dev.split(sizes):
                gpu.route(chunk)
        cpu.route(scores)
        with monkeypatch.context() as m:
            m.setattr(cuda_kernels, "_AVAILABLE", False)
            ref.route(dev)
        assert gpu._lo.item() == cpu._lo.item() and gpu._width.item() == cpu._width.item()
        counts = cpu._counts  # int32 [E*B + 1 + 31]: the histograms, the bad-score count, the state check
        hist = counts[:E * bins]
        assert int(hist.sum()) == n * E
        assert torch.equal(gpu._counts.cpu(), counts), f"step {step}: kernel counts differ from the CPU's"
        assert torch.equal(ref._counts.cpu()[:E * bins], hist) or step > 0  # torch path: range may differ by an ulp
        raw, m_ = histogram_quantiles(hist.view(E, bins), K, cpu._lo, cpu._width)
        with no_sync():
            gpu.step()
        cpu.step()
        ref._reset_counts()
        got = gpu._work[:E].view(torch.float64).cpu()
        assert torch.equal(got, raw), f"uncentred quantiles differ: {float((got - raw).abs().max())}"
        assert int(gpu._work[E]) == int(m_) == n
        assert torch.allclose(gpu.bias.cpu(), cpu.bias, atol=1e-6, rtol=0)
        assert int(gpu.num_steps) == int(cpu.num_steps) == step + 1
        assert int(gpu._counts.abs().sum()) == 0, "step must reset the counts"


@needs_cupy
def test_kernels_ema_and_empty_step():
    E, K = 96, 4
    cpu = QuantileBalancer(E, K, ema=0.5)
    gpu = QuantileBalancer(E, K, ema=0.5, device="cuda")
    for step in range(4):
        scores = zipf_scores(1000, E, 20 + step)
        cpu.route(scores)
        gpu.route(scores.cuda())
        assert torch.equal(gpu._counts.cpu(), cpu._counts)
        cpu.step()
        gpu.step()
        assert torch.allclose(gpu.bias.cpu(), cpu.bias, atol=1e-6, rtol=0)
        gpu.bias.copy_(cpu.bias)  # keep the ranges identical
    before = gpu.bias.clone()
    gpu.step()  # nothing recorded: the range comes from the bias, the bias stays
    cpu.step()
    assert torch.equal(gpu.bias, before) and gpu._lo.item() == cpu._lo.item()
    assert gpu._width.item() == cpu._width.item()


@needs_cupy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_cuda_graph_replay(dtype):
    E, K, n = 256, 8, 2048
    static = zipf_scores(n, E, 30).to(dtype).cuda()
    qb = QuantileBalancer(E, K, device="cuda")
    def step():
        out = qb.route(static)
        qb.step()
        return out

    g, (idx, w) = capture(step)
    eager = QuantileBalancer(E, K, device="cuda")
    eager.bias.copy_(qb.bias)
    for seed in range(3):
        scores = zipf_scores(n, E, 40 + seed).to(dtype).cuda()
        static.copy_(scores)
        g.replay()
        eidx, ew = eager.route(scores)
        eager.step()
        torch.cuda.synchronize()
        assert torch.equal(idx, eidx) and torch.equal(w, ew)
        assert torch.equal(qb.bias, eager.bias), f"replay {seed}"
