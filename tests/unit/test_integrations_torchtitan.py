"""moonep.integrations.torchtitan in one process: the dispatcher interface call by call against torchtitan's
own dispatcher, the interface pinned (a torchtitan release that changes it fails here, not in training),
the override, single MoE layers against torchtitan's, and every refusal but the CUDA-graph one (it needs a
capture on a GPU)."""
import dataclasses
import inspect
import types

import pytest
import torch

tt = pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/setup.sh installs it)")

from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common import moe as tt_moe  # noqa: E402
from torchtitan.models.common import token_dispatcher as tt_disp  # noqa: E402

from moonep.integrations import torchtitan as mt  # noqa: E402
from tests.harness import torchtitan as ttb  # noqa: E402

E, K, D = 8, 3, 32


# ------------------------------------------------------------------------------------------ the interface
# Every call torchtitan makes on a token dispatcher, with its parameters, as the integration implements it.
DISPATCHER_CALLS = {
    "wire_meshes": ["self", "ep_mesh"],
    "init_buffer": ["self"],
    "dispatch": ["self", "x_TD", "topk_scores_TK", "topk_expert_ids_TK", "num_local_tokens_per_expert_E"],
    "combine": ["self", "routed_output_RD", "metadata", "x_TD"],
}
# ... and on the modules around it (RoutedExperts is what the integration replaces; its inner experts and the
# MoE layer calling it are torchtitan's, used as they are).
MODULE_CALLS = {
    (tt_moe.RoutedExperts, "forward"): ["self", "x_BLD", "topk_scores_BLK", "topk_expert_ids_BLK",
                                        "num_local_tokens_per_expert_E"],
    (tt_moe.RoutedExperts, "parallelize"): ["self", "parallel_dims"],
    (tt_moe.GroupedExperts, "forward"): ["self", "x_RD", "num_tokens_per_expert_E"],
    (tt_moe.TokenChoiceTopKRouter, "forward"): ["self", "x_BLD", "expert_bias_E"],
}


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_the_dispatcher_interface_is_the_one_implemented():
    base = tt_disp.BaseEPTokenDispatcher
    public = {n for n, v in vars(base).items() if callable(v) and not n.startswith("_") and n != "Config"}
    public |= {n for n, v in vars(tt_disp.LocalTokenDispatcher).items()
               if callable(v) and not n.startswith("_") and n != "Config"}
    assert public == set(DISPATCHER_CALLS), f"torchtitan's dispatcher interface changed: {sorted(public)}"
    for name, params in DISPATCHER_CALLS.items():
        assert _params(getattr(base, name)) == params, (name, _params(getattr(base, name)))
        assert _params(getattr(mt.MoonepTokenDispatcher, name)) == params, name
    for (cls, name), params in MODULE_CALLS.items():
        assert _params(getattr(cls, name)) == params, (cls.__name__, name, _params(getattr(cls, name)))
    assert _params(mt.MoonepRoutedExperts.forward) == MODULE_CALLS[(tt_moe.RoutedExperts, "forward")]
    fields = {f.name for f in dataclasses.fields(tt_moe.RoutedExperts.Config)}
    assert {"inner_experts", "token_dispatcher", "sharding_config"} <= fields, fields
    assert {f.name for f in dataclasses.fields(tt_disp.BaseEPTokenDispatcher.Config)} >= {"num_experts", "top_k"}
    # the MoE layer hands RoutedExperts its four arguments positionally, in this order
    src = inspect.getsource(tt_moe.MoE.forward)
    call = src[src.index("self.routed_experts("):]
    args = [a.strip() for a in call[len("self.routed_experts("):call.index(")")].split(",") if a.strip()]
    assert args == ["x_BLD", "topk_scores_BLK", "topk_expert_ids_BLK", "num_local_tokens_per_expert_E"], args


def _routing(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    scores = torch.rand(T, E, generator=g)
    scores[: T // 2, :2] += 1.0  # skewed: the first two experts hot
    w, idx = scores.softmax(-1).topk(K, dim=-1)
    w = w.detach().requires_grad_()
    counts = torch.zeros(E, dtype=torch.int64).scatter_add_(0, idx.reshape(-1), torch.ones(T * K, dtype=torch.int64))
    return x, w, idx, counts


def _dispatchers():
    cfg = dict(num_experts=E, top_k=K)
    ref = tt_disp.LocalTokenDispatcher.Config(**cfg).build()
    mine = mt.MoonepTokenDispatcher.Config(**cfg).build()
    for d in (ref, mine):
        d.wire_meshes(ep_mesh=None)  # EP = 1, as torchtitan wires it without expert parallelism
    mine.init_buffer()
    return ref, mine


@pytest.mark.parametrize("T", [0, 1, 37])
def test_every_dispatcher_call_matches_torchtitans_dispatcher(T):
    """dispatch -> rows per expert, combine -> the same weighted sums, and the same gradients."""
    ref, mine = _dispatchers()
    x, w, idx, counts = _routing(T)
    f = lambda rows: torch.sin(rows) * 2.0  # noqa: E731  (row-wise, zero at zero: padding stays zero)
    r_rows, r_counts, r_meta = ref.dispatch(x, w, idx, counts)
    m_rows, m_counts, m_meta = mine.dispatch(x, w, idx, counts)
    assert m_counts.dtype == torch.int32 and m_counts.shape == (2 * E,)  # EP = 1: epn = E home slots (+ E)
    assert torch.equal(m_counts[:E].long(), r_counts.long())             # one rank: every row at home
    assert int(m_counts[E:].sum()) == 0 and m_rows.shape[1] == D
    cu = [0] + torch.cumsum(m_counts, 0).tolist()
    rc = [0] + torch.cumsum(r_counts, 0).tolist()
    for e in range(E):  # the same rows per expert (as multisets: the order within an expert is free)
        a, b = m_rows[cu[e]:cu[e + 1]], r_rows[rc[e]:rc[e + 1]]
        assert torch.equal(a[a[:, 0].argsort()], b[b[:, 0].argsort()]), e
    y_ref = ref.combine(f(r_rows), r_meta, x)
    y = mine.combine(f(m_rows), m_meta, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    if T:
        g = torch.randn_like(y)
        gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), g)
        gx, gw = torch.autograd.grad(y, (x, w), g)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-6)


def test_dispatcher_refuses_bad_arguments():
    ref, mine = _dispatchers()
    x, w, idx, counts = _routing(8)
    with pytest.raises(ValueError, match="topk_expert_ids_TK"):
        mine.dispatch(x, w, idx[:, :2], counts)
    _, _, r_meta = ref.dispatch(x, w, idx, counts)
    rows, _, _ = mine.dispatch(x, w, idx, counts)
    with pytest.raises(ValueError, match="metadata"):
        mine.combine(rows, r_meta, x)


# ------------------------------------------------------------------------------------------ layers
def _moe_configs(name):
    """(torchtitan's MoE.Config of ``name``'s first MoE layer, the same with moonep's override)."""
    from torchtitan.config import ParallelismConfig
    import copy

    _, cfg = ttb.model_config(name, ParallelismConfig(), torch.device("cpu"))
    moe = next(layer.moe for layer in cfg.layers if getattr(layer, "moe", None) is not None)
    mine = copy.deepcopy(moe)
    apply_overrides(OverrideConfig(imports=[ttb.OVERRIDE]), mine)
    return moe, mine


@pytest.mark.parametrize("name, dtype", [("deepseek_v3", torch.float32), ("gpt_oss", torch.bfloat16)])
def test_a_moe_layer_matches_torchtitans(name, dtype):
    """One MoE layer in one process (EP = 1): the same output and gradients as torchtitan's layer (GPT-OSS in
    bf16: its experts return bf16 whatever the input, which torchtitan's own combine refuses for fp32)."""
    ref_cfg, mine_cfg = _moe_configs(name)
    assert type(mine_cfg.routed_experts) is mt.MoonepRoutedExperts.Config
    assert mine_cfg.routed_experts.inner_experts is not ref_cfg.routed_experts.inner_experts
    assert type(mine_cfg.routed_experts.inner_experts) is type(ref_cfg.routed_experts.inner_experts)
    torch.manual_seed(0)
    ref = ref_cfg.build()
    ref.init_states()
    ref.to(dtype)
    mine = mine_cfg.build().to(dtype)
    mine.load_state_dict(ref.state_dict())
    assert ref.state_dict().keys() == mine.state_dict().keys()
    x = torch.randn(2, 16, ref_cfg.router.gate.in_features, dtype=dtype, requires_grad=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    outs = []
    for m in (ref, mine):
        y = m(x)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in m.named_parameters()}))
        x.grad = None
    torch.testing.assert_close(outs[1][0], outs[0][0], **tol)
    torch.testing.assert_close(outs[1][1], outs[0][1], **tol)
    for n, g in outs[0][2].items():
        scale = g.float().abs().max().clamp_min(1e-30)
        err = float((outs[1][2][n].float() - g.float()).abs().max() / scale)
        assert err < (1e-2 if dtype == torch.float32 else 3e-2), (n, err)  # bf16 experts: rounding order


# ------------------------------------------------------------------------------------------ refusals
def _routed_cfg(name="deepseek_v3"):
    ref_cfg, _ = _moe_configs(name)
    return ref_cfg.routed_experts


@pytest.mark.parametrize("dispatcher", ["torchao", "deepep", "hybridep"])
def test_other_ep_backends_are_refused(dispatcher):
    cfg = _routed_cfg()
    kw = dict(num_experts=E, top_k=K)
    cfg.token_dispatcher = {"torchao": lambda: tt_disp.TorchAOTokenDispatcher.Config(pad_multiple=16, **kw),
                            "deepep": lambda: tt_disp.DeepEPTokenDispatcher.Config(**kw),
                            "hybridep": lambda: tt_disp.HybridEPTokenDispatcher.Config(**kw)}[dispatcher]()
    with pytest.raises(ValueError, match="moe_comm_backend"):
        mt.moonep_experts(cfg)


def test_converted_or_fused_experts_are_refused():
    cfg = _routed_cfg()
    Sub = type("Float8GroupedExperts", (tt_moe.GroupedExperts,), {})
    SubCfg = dataclasses.make_dataclass("Config", [], bases=(tt_moe.GroupedExperts.Config,))
    SubCfg._owner = Sub
    inner = cfg.inner_experts
    cfg.inner_experts = SubCfg(dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts)
    with pytest.raises(ValueError, match="inner_experts"):
        mt.moonep_experts(cfg)


@pytest.mark.parametrize("axis", ["tp", "cp", "pp", "spmd_backend"])
def test_unsupported_parallelism_is_refused_at_parallelize(axis):
    layer = mt.moonep_experts(_routed_cfg()).build()
    dims = types.SimpleNamespace(tp=1, cp=1, pp=1, spmd_backend="partial_dtensor")
    setattr(dims, axis, "spmd_types" if axis == "spmd_backend" else 2)
    name = {"tp": "tensor_parallel_degree", "cp": "context_parallel_degree", "pp": "pipeline_parallel_degree",
            "spmd_backend": "spmd_backend"}[axis]
    with pytest.raises(ValueError, match=name):
        layer.parallelize(dims)


@pytest.mark.parametrize("what", ["compile.enable", "debug.spmd_typechecking"])
def test_compile_and_typechecking_are_refused_at_the_first_forward(what, monkeypatch):
    layer = mt.moonep_experts(_routed_cfg()).build()
    if what == "compile.enable":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    else:
        import spmd_types

        monkeypatch.setattr(spmd_types, "is_type_checking", lambda: True)
    x = torch.zeros(1, 4, layer.inner_experts.w1_EFD.shape[-1])
    ids = torch.zeros(1, 4, K, dtype=torch.int64)
    with pytest.raises(ValueError, match=what.replace(".", r"\.")):
        layer(x, torch.ones(1, 4, K), ids, torch.zeros(layer.inner_experts.num_experts))


# ------------------------------------------------------------------------------------------ the balancer option
def test_quantile_balancer_option_sets_torchtitans_expert_bias():
    """quantile_balancer: the router is torchtitan's (same selection given the bias); after an optimizer step
    the MoE's expert_bias_E is the QuantileBalancer's bias from the step's scores, not the sign rule's."""
    import copy

    from torchtitan.config import ParallelismConfig

    _, cfg = ttb.model_config("deepseek_v3", ParallelismConfig(), torch.device("cpu"))
    ref_cfg = next(layer.moe for layer in cfg.layers if getattr(layer, "moe", None) is not None)
    qb_cfg = copy.deepcopy(ref_cfg)
    apply_overrides(OverrideConfig(imports=[ttb.OVERRIDE, "moonep.integrations.torchtitan.quantile_balancer"]), qb_cfg)
    assert type(qb_cfg.router) is mt.QuantileBalancedRouter.Config
    torch.manual_seed(0)
    ref = ref_cfg.build()
    ref.init_states()
    mine = qb_cfg.build()
    mine.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(mine.parameters(), lr=0.0)
    x = torch.randn(2, 64, ref_cfg.router.gate.in_features)
    x[..., 0] += 3.0  # one direction dominant: skewed routing
    mine(x).sum().backward()
    assert torch.count_nonzero(mine.expert_bias_E) == 0  # the first step's routing: no bias yet
    opt.step()
    mine(x)  # the first forward after the step sets the balancer's bias
    qb = mine.router.balancer
    assert int(qb.num_steps) == 1 and torch.count_nonzero(qb.bias) > 0
    assert torch.equal(mine.expert_bias_E, qb.bias)
    # the same selection as torchtitan's router given that bias
    with torch.no_grad():
        ref.expert_bias_E.copy_(qb.bias)
        a, b = ref.router(x, ref.expert_bias_E), mine.router(x, mine.expert_bias_E)
    assert torch.equal(a[1].sort(-1).values, b[1].sort(-1).values) and torch.equal(a[0].sort(-1).values,
                                                                                  b[0].sort(-1).values)
    with pytest.raises(ValueError, match="num_expert_groups"):
        mt.quantile_balancer(dataclasses.replace(ref_cfg.router, num_expert_groups=2, num_limited_groups=1))
    with pytest.raises(ValueError, match="load_balance_coeff"):  # no expert_bias_E to set
        mine.router(x, None)
