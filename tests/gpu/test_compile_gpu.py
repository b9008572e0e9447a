"""torch.compile on one GPU: one NVLink rank (``mpiexec -n 1``, tests/mp/cases_compile.py: fullgraph, CUDA
graphs), a plain process's LatentMoE (local backend) with fullgraph=True, and QuantileBalancer.route
(its CUDA kernel as ``moonep::qb_record``) without graph breaks.  Skipped without CUDA."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import torch._dynamo  # noqa: E402

from moonep import QuantileBalancer, cuda_runtime, eager_math  # noqa: E402
from moonep.layers import LatentMoE  # noqa: E402
from tests.harness.mp import GPU_ENV, mp_cases  # noqa: E402

pytestmark = [pytest.mark.gpu]

test_compile_nvlink_r1 = mp_cases("tests/mp/cases_compile.py", nranks=[1], env=GPU_ENV, case_timeout=500)


def _step(m, x):
    m.zero_grad()
    x = x.clone().requires_grad_()
    y = m(x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_latent_moe_fullgraph_local(backend):
    """A plain process (local backend on CUDA): fullgraph forward and backward give bitwise the eager output,
    dx and parameter gradients, with aot_eager and with inductor inside ``eager_math.bitwise()`` (the layer's
    own math kept eager: moonep/eager_math.py), and by default (fused) within float32 tolerance."""
    torch._dynamo.reset()
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layers.append(LatentMoE(64, 32, 8, 2, 48, max_tokens=64, device="cuda"))
    eager, mod = layers
    warm = torch.randn(8, 64, device="cuda")
    _step(eager, warm), _step(mod, warm)  # builds the ExpertParallel (fullgraph needs it)
    compiled = torch.compile(mod, backend=backend, fullgraph=True)
    for s in (40, 57, 0, 13):
        x = torch.randn(s, 64, device="cuda")
        want = _step(eager, x)
        with eager_math.bitwise():
            got = _step(compiled, x)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (backend, s, i)
        for i, (a, b) in enumerate(zip(_step(compiled, x), want)):  # the default: fused, recompiled once
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{backend} s={s} #{i}: {m}")


@pytest.mark.skipif(not cuda_runtime.available(), reason="needs CuPy (the balancer's CUDA kernels)")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_balancer_route_fullgraph(backend):
    """QuantileBalancer.route compiles without graph breaks on CUDA (its recording kernel is a custom op) and
    gives the eager picks, histogram and weights bitwise inside ``eager_math.bitwise()`` (the weights'
    normalisation is kept eager)."""
    torch._dynamo.reset()
    a, b = QuantileBalancer(16, 4, device="cuda"), QuantileBalancer(16, 4, device="cuda")
    route = torch.compile(lambda s: b.route(s), backend=backend, fullgraph=True)
    for step in range(3):
        for mb in range(2):
            s = torch.rand(100 + 7 * mb, 16, device="cuda")
            ia, wa = a.route(s)
            with eager_math.bitwise():
                ib, wb = route(s)
            assert torch.equal(ia, ib), (step, mb)
            assert torch.equal(wa, wb), (step, mb)
            assert torch.equal(a._counts, b._counts) and torch.equal(a._lo, b._lo), (step, mb)
        a.step(), b.step()  # eager, outside the compiled region
        assert torch.equal(a.bias, b.bias), step
    torch._dynamo.reset()
    n = torch._dynamo.explain(lambda s: b.route(s))(torch.rand(10, 16, device="cuda")).graph_break_count
    assert n == 0, n


def test_plan_op_fullgraph():
    """moonep::plan_and_destinations on CUDA (one kernel launch), compiled: the eager bits, no graph break."""
    from tests.unit.test_ops import plan_op_matches_eager

    plan_op_matches_eager("cuda")
