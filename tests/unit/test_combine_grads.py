"""moonep.combine.product_grads (combine's backward products): the casts ride in the products, and the result
is bitwise that of casting the rows to the accumulation dtype first (every row dtype, weighted and unweighted,
on CPU and CUDA, in a backward's no-grad mode and with grad mode on, as under ``create_graph=True``)."""
import pytest
import torch

from moonep.combine import acc_dtype, product_grads

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _reference(g_rows, expert_out, weights):
    adt = acc_dtype(expert_out.dtype)
    g = g_rows.to(adt)
    if weights is None:
        return g.to(expert_out.dtype), None
    return (g * weights.to(adt).unsqueeze(-1)).to(expert_out.dtype), (g * expert_out.to(adt)).sum(-1).to(weights.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("grad_mode", [False, True])
def test_product_grads_equal_the_cast_first_form(device, dtype, weighted, grad_mode):
    g = torch.Generator().manual_seed(3)
    cap, H = 257, 72
    g_rows = (4 * torch.randn(cap, H, generator=g)).to(device, dtype)
    expert_out = torch.randn(cap, H, generator=g).to(device, dtype)
    weights = torch.rand(cap, generator=g).to(device) if weighted else None
    with torch.set_grad_enabled(grad_mode):
        got = product_grads(g_rows, expert_out, weights, True, True)
    want = _reference(g_rows, expert_out, weights)
    for name, a, b in zip(("g_out", "g_w"), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert product_grads(g_rows, expert_out, weights, False, False) == (None, None)
    if weighted:  # rows in another dtype than the outputs: the cast-first form
        got = product_grads(g_rows.double(), expert_out, weights, True, True)
        want = _reference(g_rows.double(), expert_out, weights)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
