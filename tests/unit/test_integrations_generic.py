"""patch_generic in one process: every patched block equals the original (forward and backward), and a
block it cannot reproduce is refused before anything changes."""
import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mp"))  # tests/mp: the shared references
from layers_reference import PlainLM, RoutedMoE  # noqa: E402

from moonep.integrations import patch_generic, softmax_topk  # noqa: E402
from moonep.training import full_state_dict  # noqa: E402


def _forward_backward(block, x, dy):
    x = x.clone().requires_grad_()
    y = block(x)
    (y * dy).sum().backward()
    # an expert no token chose has no gradient in one and a zero one in the other
    # (a compiled module names its parameters "_orig_mod.<name>")
    return y.detach(), x.grad, {k.removeprefix("_orig_mod."): torch.zeros_like(p) if p.grad is None else p.grad
                                for k, p in block.named_parameters()}


def _assert_same(block, x, wrap=lambda m: m, **patch_kw):
    """Patch a copy of ``block``; its output and every gradient equal the original's (float64).  ``wrap``:
    what runs the patched copy (``torch.compile``)."""
    ref, pat = block, copy.deepcopy(block)
    patch_generic(pat, **patch_kw)
    run = wrap(pat)
    dy = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(3))
    for train in (False, True):
        ref.train(train), pat.train(train)
        ref.zero_grad(), pat.zero_grad()
        y0, gx0, g0 = _forward_backward(ref, x, dy)
        y1, gx1, g1 = _forward_backward(run, x, dy)
        tol = dict(rtol=0, atol=1e-12)
        torch.testing.assert_close(y1, y0, **tol)
        torch.testing.assert_close(gx1, gx0, **tol)
        assert g1.keys() == g0.keys()
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], **tol, msg=lambda s: f"d{k}: {s}")
    return pat


def _block(kind, **kw):
    torch.manual_seed(0)
    return RoutedMoE(kind, **kw).double()


X = torch.randn(20, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_sigmoid_plus_bias_router_block_own_route():
    pat = _assert_same(_block("sigmoid_bias"), X)  # route: the block's own `route` method
    assert pat.moonep_route.__func__ is RoutedMoE.route


def test_softmax_router_with_user_route():
    _assert_same(_block("softmax"), X, route=lambda b, x: softmax_topk(b.router(x), 2, False, torch.float64))


def test_topk_renormalised_router():
    _assert_same(_block("renorm"), X)
    _assert_same(_block("renorm"), X, route=lambda b, x: softmax_topk(b.router(x), 2, dtype=torch.float64))


def test_shared_expert_kept_or_refused():
    _assert_same(_block("renorm", shared=True), X, shared=lambda b, x: b.shared(x))
    blk = _block("renorm", shared=True)
    with pytest.raises(ValueError, match=r"block \(the model\) \(RoutedMoE\): on a probe input .* output differs"):
        patch_generic(blk)  # the shared expert is not described: refused, not dropped
    assert isinstance(blk.experts, torch.nn.ModuleList) and "forward" not in blk.__dict__  # unchanged


def test_unreproducible_router_is_refused():
    # capacity dropping happens in forward, not in route: the patch cannot reproduce it
    blk = _block("capacity")
    with pytest.raises(ValueError, match="RoutedMoE.*differs from the block's own forward") as e:
        patch_generic(blk)
    assert "model: expected MoE blocks moonep can run exactly" in str(e.value)
    # a routing rule that is not the block's (softmax for a sigmoid router)
    with pytest.raises(ValueError, match="differs from the block's own forward"):
        patch_generic(_block("sigmoid_bias"), route=lambda b, x: softmax_topk(b.router(x), 2, True, torch.float64))
    # no route at all: never guessed from the router Linear
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="PlainMoE.*no `route` method and no route= was given"):
        patch_generic(PlainLM())


def test_refusals_name_the_problem():
    torch.manual_seed(0)
    bare = torch.nn.Module()
    bare.router = torch.nn.Linear(8, 4)
    bare.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
    with pytest.raises(ValueError, match="no forward of its own"):
        patch_generic(bare, route=lambda b, x: softmax_topk(b.router(x), 2))
    with pytest.raises(ValueError, match="no module with an `experts` nn.ModuleList in Linear"):
        patch_generic(torch.nn.Linear(3, 3))


def test_model_of_blocks_state_dict_unchanged():
    torch.manual_seed(1)
    model = PlainLM().double()
    ids = torch.randint(0, 32, (3, 5))
    ref = model(ids)
    keys = model.state_dict().keys()
    patch_generic(model, route=lambda b, x: softmax_topk(b.router(x), 3))
    torch.testing.assert_close(model(ids), ref, rtol=0, atol=1e-12)
    assert full_state_dict(model).keys() == keys


def test_patching_under_no_grad_still_probes_backward():
    blk = _block("renorm")
    with torch.no_grad():
        patch_generic(blk)
    cap = _block("capacity")
    with torch.inference_mode(), pytest.raises(ValueError, match="differs"):
        patch_generic(cap)
    y = blk(X)
    assert y.requires_grad


def test_unknown_keyword_refused_at_patch_time():
    # the old API's topk= would otherwise reach ExpertParallel at the first forward
    with pytest.raises(ValueError, match="topk: expected a keyword argument of moonep.ExpertParallel"):
        patch_generic(_block("renorm"), topk=2)


def test_patched_block_compiles():
    """A block patched by patch_generic under torch.compile (aot_eager): the dispatch, fetch and combine are
    graph nodes, the per-module expert calls (module_slots) run eagerly around them (graph breaks), and the
    output and every gradient equal the unpatched block's."""
    torch._dynamo.reset()
    _assert_same(_block("sigmoid_bias"), X, wrap=lambda m: torch.compile(m, backend="aot_eager"))
