"""Which MoE parts of a transformers model :func:`moonep.integrations.patch_hf_moe` can run exactly.

The structure decides the layout (:func:`layout`); then the module's own forward and the patched one run
on a float64 probe (:func:`probe`) and must agree, forward and backward. Nothing here communicates.
"""
from __future__ import annotations

import copy
import inspect
import re

import torch
from torch import nn

from ..layers.parallel import EPProvider
from ..runtime import local_runtime
from .common import rel_diff
from .hf_experts import EPDenseExperts, EPExperts, EPRoutedExperts, clone, ep_class, setup

# float64 probe; 1e-5 relative admits experts that round through float32 inside (RMS norms, routers)
PROBE_EXPERTS, PROBE_TOKENS, PROBE_SCALES, PROBE_RTOL = 3, 12, (1.0, 30.0), 1e-5
# Class names of MoE parts; any such module that is not a fused experts module (or its block) is refused.
_MOE_CLASS = re.compile(r"(MoE|Moe|MoA|Experts|MoeBlock|MoEBlock)$")


class Refused(Exception):
    """A model part patch_hf_moe cannot run exactly; the message is the reason."""



# --------------------------------------------------------------------------------------------- layout
def eager_forward(ex):
    """The module's own forward (transformers wraps it to dispatch on ``config._experts_implementation``)."""
    f = type(ex).forward
    return getattr(f, "__wrapped__", f)


def layout(ex: nn.Module):
    """``(base class, E, sharded parameter names, forward signature)`` of a fused experts
    module; raises ``Refused`` with the reason when its structure is not one of the two conventions."""
    down = ex._parameters.get("down_proj")
    if not (isinstance(down, nn.Parameter) and down.dim() == 3):
        raise Refused("its `experts` module has no fused `down_proj [E, ...]` parameter")
    gated = isinstance(ex._parameters.get("gate_up_proj"), nn.Parameter)
    up = ex._parameters.get("gate_up_proj" if gated else "up_proj")
    if not (isinstance(up, nn.Parameter) and up.dim() == 3):
        raise Refused("its `experts` module has neither a fused `gate_up_proj` nor an `up_proj` [E, ...]")
    E = down.shape[0]
    names = [n for n, p in ex._parameters.items() if p is not None and p.dim() >= 1 and p.shape[0] == E]
    if up.shape[0] != E:  # the expert shards are Shard(0) DTensors of [E, ...]: one row per expert
        raise Refused(f"`{'gate_up_proj' if gated else 'up_proj'}` has {up.shape[0]} experts and "
                       f"`down_proj` {E}")
    others = [n for n, p in ex._parameters.items() if p is not None and n not in names]
    if others:
        raise Refused(f"its `experts` module has parameters {others} that are not per-expert")
    sig = inspect.signature(eager_forward(ex))
    args = [p for p in list(sig.parameters.values())[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) == 3 and len(sig.parameters) == 4:
        base = EPRoutedExperts
    elif len(args) == 1 and len(sig.parameters) == 2 and gated:
        base = EPDenseExperts
        if any(n.endswith("_bias") for n in names):
            raise Refused("its dense (Llama-4 style) experts have biases, so unselected experts are not zero")
    else:
        raise Refused(f"`experts.forward{sig}` is neither (hidden_states, top_k_index, top_k_weights) nor "
                       "Llama-4's (hidden_states)")
    return base, E, tuple(names), sig


# --------------------------------------------------------------------------------------------- probe
def _probe_inputs(base, n, H, scale, g):
    if base is EPDenseExperts:
        x = torch.randn(n * PROBE_TOKENS, H, generator=g, dtype=torch.float64) * scale
        x = x * (torch.rand(n * PROBE_TOKENS, 1, generator=g) < 0.5)   # unselected experts' rows are zero
        return (x.requires_grad_(),)
    ids = list(range(n))
    K = min(2, len(ids))
    idx = torch.stack([torch.tensor(ids)[torch.randperm(len(ids), generator=g)[:K]] for _ in range(PROBE_TOKENS)])
    idx[: PROBE_TOKENS // 4, -1] = idx[: PROBE_TOKENS // 4, 0]   # a few tokens pick one expert twice
    x = torch.randn(PROBE_TOKENS, H, generator=g, dtype=torch.float64) * scale
    w = torch.rand(PROBE_TOKENS, K, generator=g, dtype=torch.float64) + 0.1
    return x.requires_grad_(), idx, w.requires_grad_()


def probe(ex: nn.Module, layout) -> None:
    """Run the module's own forward and the patched one (R = 1, local backend) in float64 on a few experts
    and random inputs, forward and backward; raise ``Refused`` unless they agree to round-off."""
    with torch.inference_mode(False), torch.enable_grad():  # patching may happen under no_grad()
        _probe_grad_on(ex, layout)


def _probe_grad_on(ex: nn.Module, layout) -> None:
    base, E, names, sig = layout
    n = min(E, PROBE_EXPERTS)
    to = dict(dtype=torch.float64, device=torch.device("cpu"))
    params = {k: nn.Parameter(p.detach()[:n].to(**to)) if k in names else nn.Parameter(p.detach().to(**to))
              for k, p in ex._parameters.items() if p is not None}
    ref_mod = clone(ex, type(ex), params, to)
    mine = clone(ex, ep_class(base, type(ex)), dict(params), to)
    if getattr(ex, "config", None) is not None:  # float64: the eager experts implementation (grouped_mm has none)
        cfg = copy.copy(ex.config)
        cfg._experts_implementation = "eager"
        ref_mod.config = mine.config = cfg
    provider = EPProvider(local_runtime("cpu"), n, transport="local")
    setup(mine, base, n, names, sig, provider, None)
    g = torch.Generator().manual_seed(1234)
    H = ex._parameters["down_proj"].shape[1 if not mine.moonep_transposed else 2]
    eager = eager_forward(ex)
    for scale in PROBE_SCALES:
        args = _probe_inputs(base, n, H, scale, g)
        want, got = eager(ref_mod, *args), mine(*args)
        dy = torch.randn(want.shape, generator=g, dtype=torch.float64)
        leaves = [a for a in args if a.requires_grad]
        gw = torch.autograd.grad(want, leaves + list(ref_mod.parameters()), dy, allow_unused=True)
        gg = torch.autograd.grad(got, leaves + list(mine.parameters()), dy, allow_unused=True)
        for what, a, b in [("output", got, want)] + [("gradient", x, y) for x, y in zip(gg, gw)]:
            a = torch.zeros_like(b) if a is None and b is not None else a
            b = torch.zeros_like(a) if b is None and a is not None else b
            if a is None:
                continue
            err = rel_diff(a, b)
            if not err <= PROBE_RTOL:
                raise Refused(f"on a probe input its {what} differs from {type(ex).__name__}.forward's by "
                               f"{err:.3g} (relative): its experts compute something the fused layout does not")


# --------------------------------------------------------------------------------------------- patch
def find_moe_modules(model: nn.Module):
    """``(fused, other)``: ``fused`` lists ``(name, block, experts)`` for every block whose ``experts``
    child holds stacked per-expert parameters; ``other`` lists ``(name, module)`` of MoE parts of any other
    structure (an ``experts`` ModuleList, classes named ``*MoE``/``*Experts``/``*MoA`` elsewhere)."""
    fused, other, seen = [], [], set()
    for name, m in model.named_modules():
        ex = getattr(m, "experts", None)
        if isinstance(ex, nn.Module) and not isinstance(ex, (nn.ModuleList, nn.ModuleDict)) and any(
                p is not None and p.dim() == 3 for p in ex._parameters.values()):
            fused.append((name, m, ex))
            seen.update((id(m), id(ex)))
        elif isinstance(ex, nn.Module):
            other.append((f"{name}.experts".lstrip("."), ex))
            seen.update((id(m), id(ex)))
    for name, m in model.named_modules():
        if (id(m) not in seen and _MOE_CLASS.search(type(m).__name__) and "Shared" not in type(m).__name__
                and not any(name.startswith(n + ".") for n, _, _ in fused)):
            other.append((name, m))
    return fused, other


def model_type(model) -> str:
    """``model.config.model_type`` (``"mixtral"``), or the class name of a model without a config."""
    return str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__)


def verdict(model, rt):
    """Every fused experts module's layout (checked and probed), or the first reason to refuse."""
    fused, other = find_moe_modules(model)
    if other:
        name, m = other[0]
        kind = ("per-expert modules in a ModuleList/ModuleDict, not the fused experts layout"
                if isinstance(m, (nn.ModuleList, nn.ModuleDict)) else "no fused `experts` module")
        raise Refused(f"{name} ({type(m).__name__}) is an MoE part with {kind}")
    if not fused:
        raise Refused("no MoE block with a fused `experts` module found")
    R = 1 if rt is None else rt.world_size
    layouts = []
    for name, block, ex in fused:
        try:
            if isinstance(ex, EPExperts):
                raise Refused("it is already patched")
            lay = layout(ex)
            if lay[1] % R:
                raise Refused(f"{lay[1]} experts are not a multiple of the group size {R}")
            probe(ex, lay)  # every layer: its code may depend on its own attributes (layer index, ...)
        except Refused as e:
            raise Refused(f"{name}.experts ({type(ex).__name__}): {e}") from None
        layouts.append(lay)
    return fused, layouts


