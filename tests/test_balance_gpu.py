"""QuantileBalancer on CUDA: no device-to-host sync, same counts as the CPU path, deferred validation."""
import pytest
import torch

from moonep.balance import QuantileBalancer

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
