"""Expert parallelism for Hugging Face transformers MoE models: every type either runs exactly, or is refused.

transformers >= 5 splits a sparse MoE block into a router and a fused experts module (``block.experts``).
:func:`patch_hf_moe` keeps the block and its router, shared experts and routing rule (softmax or sigmoid,
biases, groups, top-k renormalisation, scaling) untouched, and swaps only the experts module for one that
runs the same expert maths through :class:`moonep.ExpertParallel`, its experts sharded by home rank.
Two call conventions of the experts module are understood:

* **routed** (Mixtral, Qwen, DeepSeek, GPT-OSS, LongCat-Flash, ...):
  ``experts(hidden [T, H], top_k_index int [T, K], top_k_weights [T, K]) -> sum_k w_k f_{e_k}(x)``.
* **dense** (Llama-4): ``experts(routed_in [E*T, H]) -> [E*T, H]``, every expert applied to its own
  block of rows, the rows of unselected experts being zeros (the block pre-scales them by the router).

The expert maths is the fused layout ``down(gate(up(x)))``: gate/up weights ``[E, 2I, H]`` (or
``[E, H, 2I]`` transposed, Llama-4 and GPT-OSS), optional biases, the module's own ``_apply_gate``
(GPT-OSS's clamped, alpha-scaled SwiGLU on interleaved columns) or ``act_fn``, optional post-expert norm.
Whatever the module, :func:`patch_hf_moe` runs the module's own code and the moonep one on a probe input
at patch time (float64, a few experts, forward and backward, no collective) and refuses the model unless
they agree; every rank reaches the same verdict (it is agreed over the group before anything changes).
Under ``torch.compile`` the block's router and the experts' activation run as eager runs them (one opaque
op each: :mod:`moonep.integrations.hf_router`, :mod:`moonep.eager_math`), so a compiled patched block gives
the eager block's bits.
"""
from __future__ import annotations

import types

from torch import nn

from ..errors import MoonepError
from ..guard import GENERATE_END
from ..layers.parallel import EPProvider, home_range, resolve_group
from ..training.params import check_replicated, mark_for_ddp
from ..training.sharding import shard_experts_param
from .common import agree, ep_kwargs_error, pool_error
from .hf_check import Refused, find_moe_modules, model_type, verdict
from .hf_experts import EPDenseExperts, EPExperts, EPRoutedExperts, clone, ep_class, fused_expert_maths, setup
from .hf_router import keep_router_eager

__all__ = ["patch_hf_moe", "find_moe_modules", "fused_expert_maths", "EPExperts", "EPRoutedExperts",
           "EPDenseExperts"]


def patch_hf_moe(model: nn.Module, group=None, *, max_tokens: int | None = None, replica_pool=None,
                 broadcast_from: int | None = None, **ep_kwargs) -> nn.Module:
    """Run every MoE block's experts of a transformers model through moonep, in place; or refuse.

    Args:
        model: a transformers (>= 5) model, built identically on every rank (same seed or checkpoint).
        group: Runtime / ProcessGroup / 1-D DeviceMesh (``mesh["ep"]`` of a ``("dp", "ep")`` mesh) / ``None``
            (the launcher's job, or one process).
        max_tokens: static per-rank capacity (rows ``T`` of one experts call; for Llama-4, selected
            (token, expert) pairs); ``None`` sizes the buffers from the largest call seen.
        replica_pool: the :class:`moonep.ReplicaPool` the replicas are fetched into (default: the process's
            shared pool); every layer shares it, the home experts are used in place.
        broadcast_from: ``None`` (default): the model must be bitwise equal on every rank, or the patch is
            refused naming the first parameter that differs; a rank: its values are copied to every rank.
        ep_kwargs: passed to :class:`moonep.ExpertParallel` (``slack``, ``align``, ``transport``, ...).
    Returns:
        ``model``, whose outputs equal the unpatched model's up to floating-point summation order.  Each rank
        holds its home experts as ``Shard(0)`` DTensors of the original ``[E, ...]`` parameters; the model is
        prepared for DDP, FSDP2 and checkpoints (:func:`moonep.training.prepare`; docs/training.md), and its
        ``save_pretrained`` writes the full model (collective: call it on every rank; rank 0 writes).
    Raises:
        ValueError naming the model type and the reason, on every rank, before anything is changed, when
        some MoE part has another structure or its experts compute something the fused layout does not.
        Collective (the verdict is agreed over the group).
    """
    rt = resolve_group(group)
    err = ep_kwargs_error(ep_kwargs) or pool_error(replica_pool)
    try:
        if err is None:
            fused, layouts = verdict(model, rt)
    except Refused as e:
        err = f"model: expected an MoE model moonep can run exactly, got model type {model_type(model)!r}: {e}"
    except Exception as e:  # a crash here must not leave the other ranks waiting below
        err = (f"model: expected an MoE model moonep can run exactly, got model type {model_type(model)!r}: "
               f"checking it raised {type(e).__name__}: {e}")
    agree(rt, err)
    # the experts are cut from every rank's full copy: every parameter, experts too, must agree first
    check_replicated(model, rt, broadcast_from=broadcast_from)
    providers: dict = {}
    for (name, block, ex), (base, E, names, sig) in zip(fused, layouts):
        if E not in providers:
            providers[E] = EPProvider(rt, E, max_tokens=max_tokens, **ep_kwargs)
        home = home_range(E, rt)
        params = {k: shard_experts_param(ex._parameters[k].detach()[home.start:home.stop].clone(), rt, E,
                                         ex._parameters[k].requires_grad) for k in names}
        new = clone(ex, ep_class(base, type(ex)), params)
        block.experts = setup(new, base, E, names, sig, providers[E], rt)
        block.experts.moonep_pool = replica_pool
        keep_router_eager(block)  # compiled, the router computes what it computes eagerly (hf_router.py)
    mark_for_ddp(model)
    model.moonep_providers = list(providers.values())
    for name, fn in (("save_pretrained", _save_pretrained), ("generate", _generate)):
        if hasattr(model, name):
            setattr(model, name, types.MethodType(fn, model))
    return model


def _generate(self, *args, **kwargs):
    """``generate`` of a patched model: every forward is collective, so every rank must run as many as the
    others.  After generating, the ranks check that they stopped together; a rank that stopped earlier
    (its sequences finished first) and the ones still decoding all raise :class:`moonep.MoonepError` at once,
    telling to pass ``synced_gpus=True`` (finished ranks then keep joining the forwards)."""
    try:
        out = type(self).generate(self, *args, **kwargs)
        rt = self.moonep_providers[0].rt if self.moonep_providers else None
        if rt is not None and rt.world_size > 1 and any(p.max_tokens is None for p in self.moonep_providers):
            # a rank still decoding makes its next call on the host group (its buffers' sizing), which the
            # instances' transport may not be (MPI): meet it there first, or both would wait out the timeout
            rt.host.agree(GENERATE_END, what="generate() end")
        for provider in self.moonep_providers:
            for ep in list(provider._cache.values()):
                ep.sync()
        return out
    except MoonepError as exc:
        raise MoonepError(f"generate(): the ranks left the collective at different steps ({exc}); every rank "
                          "must run as many forward passes as the others: pass synced_gpus=True to "
                          "generate()") from exc


def _save_pretrained(self, save_directory, *args, **kwargs):
    """``save_pretrained`` of a patched model: the full model, its experts gathered from every rank, in the
    unpatched layout (``from_pretrained`` of the unpatched class loads it).  Collective: call it on every rank;
    only ``is_main_process`` (default: rank 0) writes."""
    from ..training import full_state_dict
    from ..training.params import moonep_runtime

    rt = moonep_runtime(self)
    if "state_dict" in kwargs:
        raise ValueError("state_dict: expected None for a patched model (moonep gathers the full state dict from "
                         "every rank), got a state dict")
    try:
        full = full_state_dict(self)
    except RuntimeError as exc:  # a rank that never called save_pretrained: the gather times out
        raise MoonepError(f"save_pretrained: gathering the experts from every rank failed ({str(exc)[:300]}); it "
                          "is collective on a patched model: call it on every rank (rank 0 writes)") from exc
    kwargs.setdefault("is_main_process", rt is None or rt.rank == 0)
    return type(self).save_pretrained(self, save_directory, *args, state_dict=full, **kwargs)
