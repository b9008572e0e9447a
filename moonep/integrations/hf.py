"""Expert parallelism for Hugging Face transformers MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, ...).

transformers >= 5 splits a sparse MoE block into a router (``block.gate``) and a fused experts module
(``block.experts``) called as ``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])`` with
``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``. The expert maths is
``down @ (act(gate @ x) * (up @ x))``, scaled by the routing weight and summed over the K choices.

:func:`patch_hf_moe` swaps each such experts module for :class:`EPExperts`: same call signature, same
maths, experts sharded by home rank and run through ExpertParallel. The router, the shared experts
(Qwen2-MoE) and every routing detail (softmax, top-k, ``norm_topk_prob``) stay the model's own, which is
why the patched logits equal the unpatched ones.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import expect
from ..layers.grouped import slot_matmul
from ..layers.parallel import EPProvider, ShardedExperts, home_range, resolve_group


class EPExperts(ShardedExperts, nn.Module):
    """Drop-in replacement for a transformers fused experts module, sharded by home rank.

    Parameters: ``gate_up_proj [epn, 2I, H]`` and ``down_proj [epn, H, I]`` (this rank's rows of the
    original ``[E, ...]`` tensors; a full state dict loads at any R).
    """

    sharded_params = ("gate_up_proj", "down_proj")

    def __init__(self, experts: nn.Module, provider: EPProvider, rt):
        super().__init__()
        E = experts.gate_up_proj.shape[0]
        home = home_range(E, rt)
        self.num_experts, self.epn, self.ep_rank, self._rt = E, len(home), (0 if rt is None else rt.rank), rt
        sl = slice(home.start, home.stop)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[sl].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[sl].clone())
        self.act_fn = experts.act_fn
        self.moonep_ep = provider

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states [T, H]``, ``top_k_index`` int64 ``[T, K]``, ``top_k_weights [T, K]`` (any float)
        -> ``[T, H]`` in ``hidden_states.dtype``. Collective."""
        T, H = hidden_states.shape
        ep = self.moonep_ep.get(T, top_k_index.shape[1], H, hidden_states.dtype, hidden_states.device)
        h = ep.dispatch(hidden_states, top_k_index, top_k_weights)
        gu = ep.prefetch(h, self.gate_up_proj)          # [2*epn, 2I, H]
        down = ep.prefetch(h, self.down_proj)           # [2*epn, H, I]
        gate, up = slot_matmul(h.tokens, h.cu_seqlens, gu.transpose(1, 2)).chunk(2, dim=-1)  # [cap, I] each
        out = slot_matmul(self.act_fn(gate) * up, h.cu_seqlens, down.transpose(1, 2))        # [cap, H]
        return ep.combine(out, h)


def _is_fused_experts(m: nn.Module) -> bool:
    return (isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)
            and isinstance(getattr(m, "down_proj", None), nn.Parameter) and hasattr(m, "act_fn")
            and m.gate_up_proj.dim() == 3)


def patch_hf_moe(model: nn.Module, group=None, *, max_tokens: int | None = None, **ep_kwargs) -> nn.Module:
    """Run every sparse MoE block's experts of a transformers model through moonep. In place.

    Args:
        model: e.g. ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` built identically on every rank.
        group: Runtime / ProcessGroup / ``None`` (the launcher's job, or one process).
        max_tokens: static per-rank capacity; ``None`` sizes the buffers from the largest batch seen.
    Returns:
        ``model``; its logits equal the unpatched model's (up to summation order) on every rank.
    """
    rt = resolve_group(group)
    targets = [(name, m) for name, m in model.named_modules()
               if _is_fused_experts(getattr(m, "experts", None) or nn.Module())]
    expect(len(targets) > 0, "model", "a transformers (>= 5) MoE model with fused `experts` modules "
           "(gate_up_proj [E, 2I, H], down_proj [E, H, I])", type(model).__name__)
    provider = None
    for name, block in targets:
        ex = block.experts
        # Only the default fused layout is understood; other layouts would silently compute other maths.
        for flag, want in (("is_transposed", False), ("has_bias", False), ("is_concatenated", True),
                           ("has_gate", True)):
            expect(getattr(ex, flag, want) == want, f"{name}.experts.{flag}", repr(want),
                   repr(getattr(ex, flag, None)))
        E = ex.gate_up_proj.shape[0]
        if provider is None or provider.num_experts != E:
            provider = EPProvider(rt, E, max_tokens=max_tokens, **ep_kwargs)
        block.experts = EPExperts(ex, provider, rt)
    return model
