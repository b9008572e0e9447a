"""moonep/eager_math.py: a function wrapped with ``keep_eager`` gives, compiled with inductor inside ``bitwise()``,
eager's output and gradients bit for bit (forward: the function's own ATen kernels; backward: ``autograd.grad``
of a recompute), for inputs of any layout; by default it is traced as plain code (fused, within tolerance);
the two ops pass ``torch.library.opcheck``; a name is registered once."""
import pytest
import torch

from moonep import eager_math
from moonep.eager_math import _eager_math, _eager_math_backward, _KEYS, keep_eager


def _mix(x, w, eps):
    # transcendental, a reduction, a bf16 chain of products: what inductor would fuse and round its own way
    h = 4.0 * torch.tanh(x / 4.0) * torch.sigmoid(x)
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), w, eps) * x


_kept = keep_eager(_mix, "test_eager_math.mix")


def _step(fn, x0, w0, seed):
    x = x0.detach().clone().requires_grad_()
    w = w0.detach().clone().requires_grad_()
    y = fn(x.transpose(0, 1), w, 1e-6)  # a non-contiguous input
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(y.dtype)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_equals_eager_bitwise(dtype):
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, eps: _kept(x, w, eps) + 1.0, backend="inductor", fullgraph=True)
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        x0 = (3 * torch.randn(24, 16, generator=gen)).to(dtype)
        w0 = torch.randn(24, generator=gen).to(dtype)
        want = _step(lambda x, w, eps: _mix(x, w, eps) + 1.0, x0, w0, seed)
        with eager_math.bitwise():
            got = _step(compiled, x0, w0, seed)
        for name, a, b in zip(("y", "dx", "dw"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), f"{name} ({dtype}, seed {seed}): max diff {(a.double() - b.double()).abs().max()}"


def test_opcheck():
    key = _KEYS["test_eager_math.mix"]
    x = torch.randn(24, 16).t()  # non-contiguous, [16, 24]
    w = torch.randn(24, requires_grad=True)
    torch.library.opcheck(_eager_math, ([x.requires_grad_(), w], key, [1e-6]))
    g = torch.randn(16, 24)
    torch.library.opcheck(_eager_math_backward, ([x.detach(), w.detach()], [g], key, [1e-6]))


def test_name_used_twice_refused():
    with pytest.raises(ValueError, match="name"):
        keep_eager(torch.sigmoid, "test_eager_math.mix")
    assert keep_eager(torch.sigmoid, "test_eager_math.other")(torch.zeros(1)).item() == 0.5  # the next call works


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_by_default_is_fused_within_tolerance(dtype):
    """Outside ``bitwise()`` the wrapped function is inductor's to fuse: within the dtype's tolerance of eager."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, eps: _kept(x, w, eps) + 1.0, backend="inductor", fullgraph=True)
    gen = torch.Generator().manual_seed(7)
    x0, w0 = (3 * torch.randn(24, 16, generator=gen)).to(dtype), torch.randn(24, generator=gen).to(dtype)
    want = _step(lambda x, w, eps: _mix(x, w, eps) + 1.0, x0, w0, 7)
    got = _step(compiled, x0, w0, 7)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=name, **({} if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)))


def test_autocast_keeps_eager_dtypes():
    """Under autocast the wrapped function is traced as plain code, inside ``bitwise()`` too: the compiled
    result has eager's dtype (an op's body would run without autocast, in float32)."""
    lin = keep_eager(lambda x, w: torch.nn.functional.linear(x, w), "test_eager_math.linear")
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: lin(x, w) * 2, backend="inductor", fullgraph=True)
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), eager_math.bitwise():
        want, got = lin(x, w) * 2, f(x, w)
    assert want.dtype == got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_bitwise_is_opt_in_and_guarded():
    """By default the wrapped function is traced as plain code (no moonep op in the graph); inside
    ``bitwise()`` it is one ``moonep::eager_math`` op.  Dynamo guards on the switch: a call on the other side
    of it compiles again; the switch is restored on exit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    f = keep_eager(torch.sigmoid, "test_eager_math.bitwise")
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    g = torch.compile(lambda x: f(x) * 2, backend=cnt)
    x = torch.randn(4)
    g(x)
    with eager_math.bitwise():
        g(x)
    g(x)
    ops = [["moonep.eager_math" in str(n.target) for n in gm.graph.nodes] for gm in cnt.graphs]
    assert cnt.frame_count == 2 and not any(ops[0]) and any(ops[1]), ops
    with eager_math.bitwise():
        with eager_math.bitwise():
            assert eager_math.is_bitwise()
        assert eager_math.is_bitwise()  # a nested exit restores the outer state
    assert not eager_math.is_bitwise()
