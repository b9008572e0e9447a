"""Expert parallelism for a plain user-written MoE block: a router ``nn.Linear`` + ``nn.ModuleList`` of
expert MLPs. The block keeps its routing rule; only the expert loop is replaced.

    class MoE(nn.Module):                      # the user's block: y = sum_k w_k expert_{e_k}(x)
        def __init__(self): self.router = nn.Linear(H, E); self.experts = nn.ModuleList([...])

    moonep.integrations.patch_generic(model, group, topk=2)   # every such block in model, in place

Each rank keeps only its home experts, under their original index (state-dict keys unchanged). A
forward stacks the home experts' parameters into ``[epn, ...]`` tensors, fetches the replicas the plan
placed here, and runs the expert module per slot with those parameters (``torch.func.functional_call``),
so any expert module works as long as all experts share one structure.
"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch.func import functional_call

from ..errors import expect
from ..layers.grouped import slot_apply
from ..layers.parallel import EPProvider, ShardedModuleDict, home_range, resolve_group


def softmax_topk(logits: torch.Tensor, topk: int, renormalize: bool = True):
    """The usual MoE routing: softmax over ``[s, E]`` logits (float32), top-k, optionally renormalised.

    Returns ``(idx int64 [s, K], weights float32 [s, K])``.
    """
    p = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(p, topk, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return idx, w


def _ep_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Patched forward: ``x [..., H]`` -> ``[..., H]``; routing by ``self.moonep_route``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    idx, w = self.moonep_route(getattr(self, self.moonep_router)(x2))
    ep = self.moonep_ep.get(x2.shape[0], idx.shape[1], x2.shape[1], x2.dtype, x2.device)
    experts = getattr(self, self.moonep_experts)
    home = [experts[str(e)] for e in experts.home]
    names = [n for n, _ in home[0].named_parameters()]
    # [2*epn, ...] per parameter: home experts, then the replicas this step placed here.
    h = ep.dispatch(x2, idx, w)
    slots = {n: ep.prefetch(h, torch.stack([dict(m.named_parameters())[n] for m in home])) for n in names}
    template = home[0]
    out = slot_apply(lambda j, rows: functional_call(template, {n: slots[n][j] for n in names}, (rows,)),
                     h.tokens, h.cu_seqlens, x2.shape[1])
    return ep.combine(out, h).reshape(shape)


def patch_generic(model: nn.Module, group=None, *, topk: int, route=None, router: str = "router",
                  experts: str = "experts", max_tokens: int | None = None, **ep_kwargs) -> nn.Module:
    """Make every block of ``model`` (itself included) that has a ``router`` Linear and an ``experts``
    ModuleList run its experts through moonep expert parallelism. In place; returns ``model``.

    Args:
        group: Runtime / ProcessGroup / ``None`` (see :func:`moonep.layers.parallel.resolve_group`).
        topk: experts per token.
        route: ``logits [s, E] -> (idx [s, K], weights [s, K])``, the block's own routing rule
            (default :func:`softmax_topk` with renormalisation).
        router, experts: attribute names of the router Linear and the expert ModuleList.
        max_tokens: static EP capacity per rank (``None``: sized from the largest batch seen).
    Every rank must build the same unpatched model (same seed or checkpoint) before patching.
    """
    rt = resolve_group(group)
    route = route or (lambda logits: softmax_topk(logits, topk))
    blocks = [m for m in model.modules() if isinstance(getattr(m, router, None), nn.Linear)
              and isinstance(getattr(m, experts, None), nn.ModuleList)]
    expect(len(blocks) > 0, "model", f"a module with a `{router}` nn.Linear and an `{experts}` nn.ModuleList",
           type(model).__name__)
    provider = None
    for blk in blocks:
        E = len(getattr(blk, experts))
        expect(topk <= E, "topk", f"<= the number of experts ({E})", topk)
        home = home_range(E, rt)
        if provider is None or provider.num_experts != E:
            provider = EPProvider(rt, E, max_tokens=max_tokens, **ep_kwargs)
        full = getattr(blk, experts)
        setattr(blk, experts, ShardedModuleDict({str(e): full[e] for e in home}, E, home, rt))
        blk.moonep_ep, blk.moonep_route = provider, route
        blk.moonep_router, blk.moonep_experts = router, experts
        blk.forward = types.MethodType(_ep_forward, blk)
    return model
