"""Expert parallelism for a user-written MoE block: exact, or refused at patch time.

A block here is any module with an ``experts`` ``nn.ModuleList`` of same-structured expert modules. Its
routing rule (softmax or sigmoid, biases, grouping, top-k renormalisation, scaling) is never guessed
from its layers: it comes from the block's own ``route`` method, or from ``route=``, a function of the
block and the hidden states. The patched forward is

    idx, w = route(block, x)                        # the block's own routing code
    y = sum_k w_k * experts[idx_k](x)               # one dispatch / combine over the ranks
    y = y + shared(block, x)                        # only if ``shared=`` is given

so before changing anything :func:`patch_generic` runs the block's own forward and that one on a probe
input (one process, every expert local, eval and train mode with the same random seed, forward and
backward) and refuses the block unless they agree: a block that computes anything else (a shared
expert not given as ``shared=``, an output scale, a routing ``route`` does not reproduce) is refused.

    class MoE(nn.Module):            # the user's block: forward() calls self.route(x), loops over experts
        def route(self, x): ...      # x [s, H] -> (idx int64 [s, K], weights [s, K])
    moonep.integrations.patch_generic(model, group)      # every such block in model, in place

Each rank keeps only its home experts, under their original index (state-dict keys unchanged); their
parameters become views of one ``[epn, ...]`` tensor per name (one copy, at the first forward). A forward
runs each home expert as itself and fetches the replicas the plan placed here into a
:class:`moonep.ReplicaPool` shared by every block, running the expert module on them
(``torch.func.functional_call``; :func:`moonep.experts.module_slots`).
"""
from __future__ import annotations

import inspect
import types

import torch
from torch import nn
from ..errors import expect
from ..experts import default_pool, module_slots, stack_parameters, stacked_views_intact
from ..layers.parallel import EPProvider, ShardedModuleDict, home_range, resolve_group
from ..runtime import local_runtime
from ..training.params import check_replicated, mark_for_ddp
from .common import PROBE_RTOL, agree, ep_kwargs_error, pool_error, rel_diff

PROBE_TOKENS = 16


def softmax_topk(logits: torch.Tensor, topk: int, renormalize: bool = True, dtype=torch.float32):
    """The usual MoE routing: softmax over ``[s, E]`` logits computed in ``dtype``, top-k, optionally
    renormalised. A helper for ``route=``, e.g. ``route=lambda block, x: softmax_topk(block.router(x), 2)``;
    ``dtype`` must be the one the block's own softmax uses, or the probe refuses the patch.

    Returns ``(idx int64 [s, K], weights dtype [s, K])``.
    """
    p = torch.softmax(logits.to(dtype), dim=-1)
    w, idx = torch.topk(p, topk, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return idx, w


# --------------------------------------------------------------------------------------------- maths
def _stacked(experts: list, cache) -> dict:
    """``{name: [epn, *shape]}`` of the experts' parameters, which the pool fetches replicas from.

    ``cache`` (a patched block's dict): the experts' parameters are made views of these tensors, once, and
    again only if the modules were moved since (``.to()``); so no step copies the home experts.  ``None``
    (the patch-time probe): a copy, the user's modules untouched."""
    if cache is None:
        names = [n for n, _ in experts[0].named_parameters()]
        return {n: torch.stack([dict(m.named_parameters())[n].detach() for m in experts]) for n in names}
    st = cache.get("stacked")
    if st is None or not stacked_views_intact(experts, st):
        st = cache["stacked"] = stack_parameters(experts)
    return st


def _experts_apply(provider, experts: list, x, idx, w, cache=None, pool=None):
    """``sum_k w_k experts[idx_k](x)`` over the group: ``x [s, H]``, ``idx [s, K]``, ``w [s, K]`` ->
    ``[s, H]``. ``experts`` are this rank's home experts in order. Collective."""
    ep = provider.get(x.shape[0], idx.shape[1], x.shape[1], x.dtype, x.device)
    h = ep.dispatch(x, idx, w)
    pool = pool or default_pool()
    # the one place weights move: this step's replicas into the shared pool; home experts run in place
    stacked = _stacked(experts, cache)
    replicas = dict(zip(stacked, pool.fetch(ep, h, list(stacked.values()), list(stacked))))  # one collective
    scale = 1.0 / provider.world_size  # expert gradients: the mean over the ranks (moonep.training)
    return ep.combine(module_slots(experts[0], h.tokens, h.cu_seqlens, experts, replicas, x.shape[1], scale), h)


def _forward(block, x, provider, experts, cache=None):
    """The patched forward of ``block``: ``x [..., H]`` -> ``[..., H]``."""
    x2 = x.reshape(-1, x.shape[-1])
    idx, w = block.moonep_route(x2)
    y = _experts_apply(provider, experts, x2, idx, w, cache, getattr(block, "moonep_pool", None)).to(x.dtype)
    if block.moonep_shared is not None:
        y = y + block.moonep_shared(block, x2)
    return y.reshape(x.shape)


def _ep_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Patched forward: ``x [..., H]`` -> ``[..., H]`` (``x.dtype``). Collective."""
    experts = getattr(self, self.moonep_experts)
    home = [experts[str(e)] for e in experts.home]
    # FSDP2 would gather parameters of different experts from different ranks into one (the same on every rank)
    expect(not any(hasattr(p, "device_mesh") for p in home[0].parameters()), "model",
           f"the experts of {type(self).__name__} left out of FSDP2 (fully_shard(..., "
           "ignored_params=set(moonep.training.expert_parameters(model))))", "experts sharded by fully_shard")
    return _forward(self, x, self.moonep_ep, home, self.moonep_cache)


# --------------------------------------------------------------------------------------------- checks
class _Refused(Exception):
    pass


def _width(block, experts, example_input):
    if example_input is not None:
        return example_input
    lin = next((m for m in experts[0].modules() if isinstance(m, nn.Linear)), None)
    if lin is None:
        raise _Refused("the hidden width is not known (its first expert has no nn.Linear): give example_input=")
    p = next(block.parameters())
    return torch.randn(PROBE_TOKENS, lin.in_features, generator=torch.Generator().manual_seed(7)).to(p)


def _check(block, experts, route, shared, example_input):
    """Structure checks, then the probe; raises ``_Refused`` with the reason."""
    if len(experts) == 0:
        raise _Refused("it has no experts")
    first = [(n, p.shape) for n, p in experts[0].named_parameters()]
    if any([(n, p.shape) for n, p in e.named_parameters()] != first for e in experts):
        raise _Refused("its experts differ in structure (parameter names or shapes)")
    if any(True for e in experts for _ in e.buffers()):
        raise _Refused("its experts hold buffers (only parameters are sharded and moved)")
    if type(block).forward is nn.Module.forward:
        raise _Refused("it has no forward of its own, so there is no computation to keep")
    params = [p for p in inspect.signature(block.forward).parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 1:
        raise _Refused(f"its forward{inspect.signature(block.forward)} takes more than the hidden states")
    block.moonep_route, block.moonep_shared = route, shared
    was, provider = block.training, None
    try:
        with torch.inference_mode(False), torch.enable_grad():  # patching may happen under no_grad()
            x = _width(block, experts, example_input).clone()
            provider = EPProvider(local_runtime(x.device), len(experts), transport="local")
            _compare(block, experts, x, provider)
    finally:
        block.train(was)
        for ep in (provider._cache.values() if provider is not None else ()):
            ep.close()


def _compare(block, experts, x, provider):
    """The block's own forward against the patched one, in eval then train mode; ``_Refused`` if unequal."""
    tol = PROBE_RTOL.get(x.dtype, 3e-2)
    for train in (False, True):
        block.train(train)
        want = _run(block, x, lambda x: block(x))
        got = _run(block, x, lambda x: _forward(block, x, provider, list(experts)))
        for what, a, b in zip(["output"] + ["gradient"] * (len(want) - 1), got, want):
            if not isinstance(b, torch.Tensor):
                raise _Refused(f"its forward returns a {type(b).__name__}, not one tensor")
            if not rel_diff(a, b) <= tol:
                raise _Refused(f"on a probe input ({'train' if train else 'eval'} mode) its {what} differs from "
                               f"the block's own forward by {rel_diff(a, b):.3g} (relative; tolerance {tol:g}): "
                               "the block computes something route= and shared= do not describe")


def _run(block, x, fn):
    """``[output, d/dx, d/dparams...]`` of ``fn(x)`` against a fixed random cotangent, the RNG seeded."""
    x = x.detach().requires_grad_()
    params = [p for p in block.parameters() if p.requires_grad]
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        torch.manual_seed(1234)
        y = fn(x)
    if not isinstance(y, torch.Tensor):
        return [y]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y)
    grads = torch.autograd.grad(y, [x] + params, dy, allow_unused=True)
    return [y.detach()] + [torch.zeros_like(p) if g is None else g for g, p in zip(grads, [x] + params)]


def _route_of(block, route):
    if callable(route):
        return types.MethodType(route, block)
    fn = getattr(block, route, None)
    if not callable(fn):
        raise _Refused(f"it has no `{route}` method and no route= was given: its routing rule is never guessed "
                       "from its layers; give route=(block, x [s, H]) -> (idx [s, K], weights [s, K])")
    return fn


def _plans(model, blocks, rt, route, shared, experts, example_input):
    """``(block, route, E)`` of every block, each checked and probed; ``_Refused`` naming the first that
    cannot be run exactly. Nothing is changed."""
    if not blocks:
        raise _Refused(f"no module with an `{experts}` nn.ModuleList in {type(model).__name__}")
    plans, R = [], 1 if rt is None else rt.world_size
    for name, blk in blocks:
        try:
            full = getattr(blk, experts)
            fn = _route_of(blk, route)
            if len(full) % R:
                raise _Refused(f"its {len(full)} experts are not a multiple of the group size {R}")
            _check(blk, full, fn, shared, example_input)
            plans.append((blk, fn, len(full)))
        except _Refused as e:
            raise _Refused(f"block {name or '(the model)'} ({type(blk).__name__}): {e}") from None
    return plans


# --------------------------------------------------------------------------------------------- patch
def patch_generic(model: nn.Module, group=None, *, route="route", shared=None, experts: str = "experts",
                  example_input: torch.Tensor | None = None, max_tokens: int | None = None,
                  replica_pool=None, broadcast_from: int | None = None, **ep_kwargs) -> nn.Module:
    """Run the experts of every block of ``model`` (itself included) that has an ``experts`` ModuleList
    through moonep expert parallelism, in place; or refuse, before changing anything.

    Args:
        group: Runtime / ProcessGroup / ``None`` (see :func:`moonep.layers.parallel.resolve_group`).
        route: the block's routing: the name of a block method ``route(x [s, H]) -> (idx int64 [s, K],
            weights float [s, K])`` (default ``"route"``), or a function ``route(block, x)`` returning
            the same. ``idx`` are distinct expert ids per token (``-1`` masks a choice).
        shared: ``None``, or ``shared(block, x [s, H]) -> [s, H]`` added to the experts' sum (shared
            experts and anything else the block adds).
        experts: attribute name of the expert ModuleList.
        example_input: a probe input ``[s, H]`` (block dtype and device); default: random, ``H`` taken
            from the first ``nn.Linear`` of the first expert.
        max_tokens: static EP capacity per rank (``None``: sized from the largest batch seen).
        replica_pool: the :class:`moonep.ReplicaPool` the replicas are fetched into (default: the process's
            shared pool, shared by every block).
        broadcast_from: ``None``: the model must be bitwise equal on every rank, or the patch is refused
            naming the first parameter that differs; a rank: its values are copied to every rank.
    Returns:
        ``model``; each patched block's forward ``x [..., H] -> [..., H]`` equals its own up to
        floating-point summation order.  Prepared for DDP (:func:`moonep.training.prepare`); its expert
        gradients are the mean over the ranks, as DDP makes the others'.
    Raises:
        ValueError naming the block and what it cannot reproduce, on every rank (collective).
    Every rank must build the same unpatched model (same seed or checkpoint) before patching.
    """
    rt = resolve_group(group)
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, experts, None), nn.ModuleList)]
    err, plans = ep_kwargs_error(ep_kwargs) or pool_error(replica_pool), []
    try:
        if err is None:
            plans = _plans(model, blocks, rt, route, shared, experts, example_input)
    except _Refused as e:
        err = f"model: expected MoE blocks moonep can run exactly, got {e}"
    except Exception as e:  # a crash in the probe must not leave the other ranks waiting in agree()
        err = (f"model: expected MoE blocks moonep can run exactly, got an error while checking them: "
               f"{type(e).__name__}: {e}")
    finally:
        for _, blk in blocks:
            blk.__dict__.pop("moonep_route", None), blk.__dict__.pop("moonep_shared", None)
    agree(rt, err)
    check_replicated(model, rt, broadcast_from=broadcast_from)  # every rank cuts its experts from its own copy
    providers: dict = {}
    for blk, fn, E in plans:
        if E not in providers:
            providers[E] = EPProvider(rt, E, max_tokens=max_tokens, **ep_kwargs)
        home = home_range(E, rt)
        full = getattr(blk, experts)
        setattr(blk, experts, ShardedModuleDict({str(e): full[e] for e in home}, E, home, rt))
        blk.moonep_ep, blk.moonep_route, blk.moonep_shared = providers[E], fn, shared
        blk.moonep_experts, blk.moonep_pool, blk.moonep_cache = experts, replica_pool, {}
        blk.forward = types.MethodType(_ep_forward, blk)
    return mark_for_ddp(model)

