"""The integrations on every rank: each patched model equals its unpatched self, or is refused on every rank."""
import copy

import torch

import moonep  # noqa: F401
from layers_reference import RoutedMoE
from moonep.integrations import patch_generic, softmax_topk
from moonep.training import full_state_dict, sync_grads
from tests.harness.mp import SkipCase


def _hf_or_skip():
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SkipCase("transformers is not installed (pip install -e .[hf])")


# ------------------------------------------------------------------------------------------ transformers
def case_hf_every_moe_model_type(rt):
    """Every MoE model type found in the installed transformers: matched or refused, on every rank.  At 2 ranks,
    the survey of docs/integrations.md (a minute more at 4 ranks; the 4-rank patched models are the cases below)."""
    _hf_or_skip()
    if rt.world_size != 2:
        raise SkipCase("the survey runs at 2 ranks")
    from moonep.integrations import hf_survey

    rows = hf_survey.survey(rt)
    if rt.rank == 0:
        print(hf_survey.table(rows, ranks=rt.world_size), flush=True)
    bad = [r for r in rows if not r.ok]
    assert not bad, "\n" + hf_survey.table(bad, ranks=rt.world_size)
    status = {r.model_type: r.status for r in rows}
    for t in ("mixtral", "gpt_oss", "llama4_text", "longcat_flash"):
        assert status.get(t, "matched") == "matched", (t, status.get(t))


def case_hf_checkpoint_round_trip(rt):
    """GPT-OSS (biases), Llama-4 (dense experts), LongCat-Flash (zero-expert rows on the last rank): the
    gathered state dict is the unpatched one."""
    _hf_or_skip()
    from moonep.integrations import hf_tiny, patch_hf_moe

    types = dict(hf_tiny.moe_model_types())
    for t in ("gpt_oss", "llama4_text", "longcat_flash"):
        if t not in types:
            continue
        model = hf_tiny.build(t, types[t])
        full = model.state_dict()
        patch_hf_moe(model, rt)
        got = full_state_dict(model)
        assert got.keys() == full.keys(), t
        for k in full:
            assert torch.equal(got[k].cpu(), full[k].cpu()), (t, k)


def case_hf_patched_model_deepcopies(rt):
    """copy.deepcopy of a patched Mixtral: the copy shares the runtime, builds ExpertParallel objects of its
    own, and gives the original's output and gradients bitwise; the two then run in turns."""
    _hf_or_skip()
    from layers_reference import tiny_hf
    from moonep.integrations import patch_hf_moe

    torch.manual_seed(41)
    model = tiny_hf("mixtral", num_experts=4 * rt.world_size).double()
    patch_hf_moe(model, rt, max_tokens=16)
    ids = torch.randint(0, 64, (1, 5 + rt.rank), generator=torch.Generator().manual_seed(rt.rank))
    model(ids)  # the original has built its ExpertParallel before the copy
    twin = copy.deepcopy(model)
    exp, exp2 = model.model.layers[0].mlp.experts, twin.model.layers[0].mlp.experts
    assert exp2._rt is rt and exp2.moonep_ep is not exp.moonep_ep and not exp2.moonep_ep._cache
    for step in range(2):
        outs = []
        for m in (model, twin):
            m.zero_grad()
            logits = m(ids).logits
            logits.square().sum().backward()
            outs.append([logits.detach()] + [p.grad for p in m.parameters() if p.grad is not None])
        assert len(outs[0]) == len(outs[1]) > 1
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), f"rank {rt.rank} step {step} tensor {i}"


def case_hf_block_under_autocast(rt):
    """Under torch.autocast (bf16) a patched Mixtral block runs (its experts in the model's float32) and agrees
    with the unpatched block under the same autocast to bf16's epsilon (relative, in norm)."""
    _hf_or_skip()
    from layers_reference import tiny_hf
    from moonep.integrations import patch_hf_moe

    torch.manual_seed(41)
    ref = tiny_hf("mixtral", num_experts=4 * rt.world_size)
    model = copy.deepcopy(ref)
    patch_hf_moe(model, rt, max_tokens=16)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rt.world_size, 5, 32, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref.model.layers[0].mlp(x)
        got = model.model.layers[0].mlp(x[rt.rank:rt.rank + 1])
    want, got = (t[0] if isinstance(t, tuple) else t for t in (want, got))
    assert got.dtype == want.dtype == torch.float32
    want = want[rt.rank:rt.rank + 1]
    err = float((got - want).norm() / want.norm())
    assert err < 2 ** -7, f"rank {rt.rank}: relative difference {err:.2e}, above bf16's epsilon"


def case_hf_refusal_on_one_rank_reaches_every_rank(rt):
    """Only rank 0's probe fails: every rank raises, nothing is patched, and the group stays usable."""
    _hf_or_skip()
    from moonep.integrations import hf_experts as hf_mod
    from moonep.integrations import hf_tiny, patch_hf_moe

    model = hf_tiny.build("mixtral", dict(hf_tiny.moe_model_types())["mixtral"])
    saved = hf_mod._gate
    if rt.rank == 0:
        hf_mod._gate = lambda ex, h: h.chunk(2, dim=-1)[1]   # some other maths
    try:
        patch_hf_moe(model, rt)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("patched")
    finally:
        hf_mod._gate = saved
    assert "model type 'mixtral'" in msg and "differs" in msg, msg
    assert (rt.rank == 0) != msg.endswith("(on rank 0)"), msg
    assert not any(type(m).__name__.startswith("EP") for m in model.modules())
    patch_hf_moe(model, rt)  # the next call works


# ------------------------------------------------------------------------------------------ generic
def _generic_check(rt, kind, seed, **patch_kw):
    """The patched block on this rank's tokens == the unpatched block on every rank's (float64): output,
    input gradient, home experts' and replicated parameters' gradients."""
    R, dev = rt.world_size, rt.device
    torch.manual_seed(seed)
    ref = RoutedMoE(kind, shared=kind == "shared_renorm").double()
    if kind == "shared_renorm":
        ref.kind = "renorm"
    model = copy.deepcopy(ref).to(dev)
    sizes = [3 + (r * 5) % 7 for r in range(R)]
    sizes[R // 2] = 0  # a rank without tokens
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), 16, generator=g, dtype=torch.float64)
    dy = torch.randn(sum(sizes), 16, generator=g, dtype=torch.float64)
    lo = sum(sizes[:rt.rank])
    sl = slice(lo, lo + sizes[rt.rank])
    patch_generic(model, rt, **patch_kw)
    xl = x[sl].to(dev).requires_grad_()
    y = model(xl)
    (y * dy[sl].to(dev)).sum().backward()
    sync_grads(model)  # every gradient: the mean over the ranks' losses
    rx = x.clone().requires_grad_()
    (ref(rx) * dy).sum().backward()
    tol = dict(rtol=0, atol=1e-11)
    ctx = f"{kind} rank {rt.rank}/{R}"
    torch.testing.assert_close(y.detach().cpu(), ref(x)[sl].detach(), **tol, msg=lambda s: f"y {ctx}: {s}")
    torch.testing.assert_close(xl.grad.cpu(), rx.grad[sl], **tol, msg=lambda s: f"dx {ctx}: {s}")
    want = {k: torch.zeros_like(p) if p.grad is None else p.grad / R for k, p in ref.named_parameters()}
    for k, p in model.named_parameters():
        got = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(got.cpu(), want[k], **tol, msg=lambda s: f"d{k} {ctx}: {s}")
    assert len(model.experts) == 8 // R


def case_generic_routers_match(rt):
    if 8 % rt.world_size:
        raise SkipCase("8 experts")
    f64 = torch.float64
    _generic_check(rt, "sigmoid_bias", 1)  # the block's own route(): sigmoid + bias selection, scaled
    _generic_check(rt, "softmax", 2, route=lambda b, x: softmax_topk(b.router(x), 2, False, f64))
    _generic_check(rt, "renorm", 3, route=lambda b, x: softmax_topk(b.router(x), 2, True, f64))
    _generic_check(rt, "shared_renorm", 4, shared=lambda b, x: b.shared(x))


def case_generic_refusal_on_one_rank_reaches_every_rank(rt):
    if 8 % rt.world_size:
        raise SkipCase("8 experts")
    torch.manual_seed(5)
    blk = RoutedMoE("capacity" if rt.rank == rt.world_size - 1 else "renorm").double()
    try:
        patch_generic(blk, rt)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("patched")
    assert "RoutedMoE" in msg and "differs from the block's own forward" in msg, msg
    assert (rt.rank == rt.world_size - 1) != msg.endswith(f"(on rank {rt.world_size - 1})"), msg
    assert isinstance(blk.experts, torch.nn.ModuleList) and len(blk.experts) == 8
