"""LatentMoE and SiTU-GLU in one process (R = 1, no process group), against a dense float64 reference."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mp"))  # tests/mp: the shared references
from layers_reference import PlainLM, dense_latent_moe, situ  # noqa: E402

from moonep.layers import LatentMoE, SiTUGLU, situ_glu  # noqa: E402
from moonep.training import full_state_dict  # noqa: E402
from moonep.layers.grouped import slot_matmul  # noqa: E402
from moonep.layers.parallel import home_range  # noqa: E402
from moonep.runtime import local_runtime  # noqa: E402


# ------------------------------------------------------------------------------------------ SiTU-GLU
def test_situ_glu_is_bounded_by_100():
    g = torch.tensor([-1e6, -50.0, -1.0, 0.0, 1.0, 50.0, 1e6, 1e30], dtype=torch.float64)
    u = torch.tensor([1e6, -1e30, 3.0, 7.0, -1e6, 1e6, 1e6, -1e30], dtype=torch.float64)
    out = situ_glu(g[:, None], u[None, :])
    assert torch.isfinite(out).all() and out.abs().max() <= 100.0
    assert float(situ_glu(torch.tensor(1e4), torch.tensor(1e4))) == pytest.approx(100.0)  # the bound is tight


def test_situ_glu_matches_swiglu_to_first_order():
    g = torch.linspace(-1, 1, 41, dtype=torch.float64)
    for scale in (1e-2, 1e-3):
        gs, us = g * scale, g.flip(0) * scale
        swiglu = gs * torch.sigmoid(gs) * us
        diff = (situ_glu(gs, us) - swiglu).abs().max()
        assert diff <= 0.1 * scale ** 4 + 1e-30  # the tanh terms only differ at third order
    assert torch.equal(situ_glu(torch.zeros(3), torch.ones(3)), torch.zeros(3))


def test_situ_glu_reference_gradcheck_and_module():
    g = torch.randn(5, 3, dtype=torch.float64, requires_grad=True) * 10
    u = torch.randn(5, 3, dtype=torch.float64, requires_grad=True) * 40
    torch.testing.assert_close(situ_glu(g, u), situ(g, u), rtol=1e-14, atol=0)
    assert torch.autograd.gradcheck(situ_glu, (g.detach().requires_grad_(), u.detach().requires_grad_()))
    torch.testing.assert_close(SiTUGLU()(torch.cat([g, u], -1)), situ(g, u))


# ------------------------------------------------------------------------------------------ slot GEMMs
@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_slot_matmul(impl):
    if impl == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("no torch._grouped_mm")
    a = torch.randn(11, 8, requires_grad=True)
    w = torch.randn(4, 8, 12, requires_grad=True)
    cu = torch.tensor([0, 3, 3, 7, 9], dtype=torch.int32)
    out = slot_matmul(a, cu, w, impl)
    ref = torch.cat([a[0:3] @ w[0], a[7:7] @ w[1], a[3:7] @ w[2], a[7:9] @ w[3], torch.zeros(2, 12)])
    torch.testing.assert_close(out, ref)
    assert torch.equal(out[9:], torch.zeros(2, 12))
    gw = torch.autograd.grad((out * torch.arange(12.0)).sum(), w)[0]
    torch.testing.assert_close(gw, torch.autograd.grad((ref * torch.arange(12.0)).sum(), w)[0])


# ------------------------------------------------------------------------------------------ LatentMoE
def _layer(dtype=torch.float64, **kw):
    # one process without a group, whatever other tests left initialised (moonep.init()): plain parameters
    args = dict(d_model=16, d_latent=8, num_experts=6, topk=2, d_expert=12, num_shared=2, d_shared=4,
                group=local_runtime(kw.get("device", "cpu")))
    args.update(kw)
    torch.manual_seed(0)
    return LatentMoE(dtype=dtype, **args)


@pytest.mark.parametrize("matmul,dtype", [("loop", torch.float64), ("auto", torch.float64),
                                          ("grouped", torch.float32)])
def test_latent_moe_matches_dense_reference(matmul, dtype):
    m = _layer(dtype, matmul=matmul)
    with torch.no_grad():  # a bias that changes the selection but never the weights
        m.balancer.bias.copy_(torch.linspace(-0.3, 0.3, 6))
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    gy = torch.randn(3, 7, 16, dtype=torch.float64)
    xl = x.to(dtype).clone().requires_grad_()
    y = m(xl)
    (y * gy.to(dtype)).sum().backward()

    p = {k: v.detach().double().clone().requires_grad_() for k, v in m.named_parameters()}
    rx = x.detach().reshape(-1, 16).clone().requires_grad_()
    ry = dense_latent_moe(p, rx, 2, m.balancer.bias)
    (ry * gy.reshape(-1, 16)).sum().backward()
    tol = dict(rtol=0, atol=1e-11) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.double().reshape(-1, 16), ry.detach(), **tol)
    torch.testing.assert_close(xl.grad.double().reshape(-1, 16), rx.grad, **tol)
    for k, v in m.named_parameters():
        torch.testing.assert_close(v.grad.double(), p[k].grad, **tol, msg=lambda s: f"{k}: {s}")
    st = m.last_stats
    assert int(st["recv_counts"].sum()) == 21 * 2 and int(st["expert_load"].sum()) == 42
    assert y.dtype == dtype and y.shape == x.shape


def test_latent_moe_edge_shapes():
    m = _layer(num_shared=0, topk=6, balancer="qb")  # K = E: no balancer needed
    assert m.balancer is None
    y = m(torch.zeros(0, 16, dtype=torch.float64))
    assert y.shape == (0, 16)
    x = torch.randn(4, 16, dtype=torch.float64)
    p = {k: v.detach() for k, v in m.named_parameters()}
    p["shared_w_in"], p["shared_w_out"] = torch.zeros(0, 16, 8), torch.zeros(0, 4, 16)
    torch.testing.assert_close(m(x), dense_latent_moe(p, x, 6), rtol=0, atol=1e-11)


def test_state_dict_roundtrip_and_init_independent_of_seed_state():
    a = _layer()
    torch.manual_seed(123)
    b = LatentMoE(16, 8, 6, 2, 12, d_shared=4, dtype=torch.float64)
    full = full_state_dict(a)
    assert full.keys() == a.state_dict().keys() and full["experts.w_in"].shape == (6, 8, 24)
    b.load_state_dict(full)
    x = torch.randn(5, 16, dtype=torch.float64)
    assert torch.equal(a(x), b(x))
    assert "bias" in "".join(full)  # the QB bias travels with the checkpoint


# ------------------------------------------------------------------------------------------ integrations
def test_generic_patch_single_process():
    from moonep.integrations import patch_generic, softmax_topk

    torch.manual_seed(1)
    model = PlainLM().double()
    ids = torch.randint(0, 32, (3, 5))
    ref = model(ids)
    patch_generic(model, route=lambda b, x: softmax_topk(b.router(x), 3))
    torch.testing.assert_close(model(ids), ref, rtol=0, atol=1e-12)
    assert full_state_dict(model).keys() == PlainLM().state_dict().keys()


def test_hf_patch_single_process():
    pytest.importorskip("transformers")
    from layers_reference import tiny_hf
    from moonep.integrations import patch_hf_moe

    for kind in ("mixtral", "qwen3_moe", "qwen2_moe"):
        torch.manual_seed(2)
        model = tiny_hf(kind, num_experts=6)
        ids = torch.randint(0, 64, (2, 6))
        ref = model(ids).logits
        full = model.state_dict()
        patch_hf_moe(model)
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=1e-6)
        got = full_state_dict(model)
        assert all(torch.equal(got[k], full[k]) for k in full), kind


# ------------------------------------------------------------------------------------------ bad input
def _raises(match, fn):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_latent_moe_under_autocast_computes_its_experts_in_bf16(device):
    """Under torch.autocast (bf16) a float32 layer computes as autocast has it: the latent rows travel and the
    experts compute in bf16 (a bf16 ExpertParallel, bf16 expert GEMMs), its output is bf16 and within bf16's
    precision of the float32 output; the gradients reach the float32 parameters; a bf16 ``x`` is taken."""
    from moonep import experts as ex_mod

    m = _layer(torch.float32, device=device)
    x = torch.randn(9, 16, device=device)
    want = m(x)
    want.square().sum().backward()
    want_g = {k: v.grad.clone() for k, v in m.named_parameters()}
    m.zero_grad()
    from moonep import ops as ops_mod

    seen = []
    real = ex_mod._run
    spy = lambda impl, grouped, loop, a, *args: seen.append(a.dtype) or real(impl, grouped, loop, a, *args)  # noqa: E731
    ex_mod._run = ops_mod._run = spy  # (the expert GEMM op's body runs the one in moonep.ops)
    try:
        with torch.autocast(device, dtype=torch.bfloat16):
            got = m(x)
    finally:
        ex_mod._run = ops_mod._run = real
    assert got.dtype == torch.bfloat16 and seen and set(seen) == {torch.bfloat16}, seen
    assert any(key[2] == torch.bfloat16 for key in m._ep._cache), list(m._ep._cache)  # rows moved in bf16
    scale = float(want.detach().abs().max())
    assert float((got.float() - want).abs().max().detach()) <= 0.05 * scale, "bf16 autocast far from float32"
    got.float().square().sum().backward()
    for k, v in m.named_parameters():
        assert v.grad.dtype == torch.float32 and torch.isfinite(v.grad).all(), k
        g = v.grad.to_local() if hasattr(v.grad, "to_local") else v.grad
        w = want_g[k].to_local() if hasattr(want_g[k], "to_local") else want_g[k]
        assert float((g - w).abs().max()) <= 0.1 * float(w.abs().max()) + 1e-6, k
    xb = x.bfloat16().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        yb = m(xb)
    yb.float().sum().backward()
    assert yb.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="x: expected dtype torch.float32"):  # outside autocast: refused
        m(xb.detach())


def test_bad_inputs_name_argument_expected_actual():
    msg = _raises("d_latent", lambda: LatentMoE(16, 32, 6, 2, 8))
    assert "<= d_model (16)" in msg and "got 32" in msg
    msg = _raises("topk", lambda: LatentMoE(16, 8, 6, 7, 8))
    assert "<= num_experts (6)" in msg and "got 7" in msg
    msg = _raises("num_experts", lambda: home_range(6, SimpleNamespace(world_size=4, rank=0)))
    assert "multiple of the group size 4" in msg and "got 6" in msg
    _raises("d_expert: expected a positive int", lambda: LatentMoE(16, 8, 6, 2, 0))
    _raises("dtype", lambda: LatentMoE(16, 8, 6, 2, 8, dtype=torch.int32))
    m = _layer()
    msg = _raises(r"x: expected shape \[..., d_model=16\]", lambda: m(torch.randn(3, 8, dtype=torch.float64)))
    assert "[3, 8]" in msg
    msg = _raises("x: expected dtype torch.float64", lambda: m(torch.randn(3, 16)))
    assert "got torch.float32" in msg
    _raises("balancer", lambda: LatentMoE(16, 8, 6, 2, 8, balancer="aux"))
    from moonep.balance import QuantileBalancer
    _raises("balancer: expected a QuantileBalancer with num_experts=6",
            lambda: LatentMoE(16, 8, 6, 2, 8, balancer=QuantileBalancer(8, 2)))
