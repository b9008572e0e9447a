"""Which parameters of a model are moonep's, and the one preparation a model gets before training.

A model holding moonep layers has three kinds of state:

* **expert shards**: each rank holds its home experts only (:class:`moonep.layers.parallel.ShardedExperts`
  parameters, DTensors; the modules of a :class:`moonep.layers.parallel.ShardedModuleDict`). Their gradients
  already hold every rank's tokens, averaged (``1/R``): data-parallel wrappers must not touch them;
* **moonep's buffers** (a QuantileBalancer's bias and its rank-local histogram counts): moonep keeps them in
  step itself; broadcasting rank 0's counts would silently drop the other ranks' tokens;
* everything else is **replicated**: the same on every rank, gradients averaged by DDP / FSDP or
  :func:`moonep.training.sync_grads`.

:func:`prepare` tells DDP which are which (``_ddp_params_and_buffers_to_ignore`` on the module it will wrap)
and checks that the replicated state agrees across ranks.  ``patch_hf_moe`` and ``patch_generic`` call it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..balance import QuantileBalancer
from ..errors import expect, expect_same, fail
from ..guard import CHECK_STATE
from ..transport.host_group import released

__all__ = ["expert_parameters", "replicated_parameters", "moonep_runtime", "prepare", "check_replicated",
           "mark_for_ddp"]


def _expert_names(model: nn.Module) -> tuple[list, list]:
    """``(expert parameter names, moonep buffer names)`` of ``model``, fully qualified, in model order."""
    from ..layers.parallel import ShardedExperts, ShardedModuleDict

    params, buffers = [], []
    for name, m in model.named_modules(remove_duplicate=False):
        pre = name + "." if name else ""
        if isinstance(m, ShardedExperts):
            params += [pre + p for p in m.sharded_params if getattr(m, p, None) is not None]
        elif isinstance(m, ShardedModuleDict):
            params += [pre + n for n, _ in m.named_parameters()]
        elif isinstance(m, QuantileBalancer):
            buffers += [pre + n for n, _ in m.named_buffers()]
    return params, buffers


def expert_parameters(model: nn.Module) -> list:
    """The expert-shard parameters of ``model`` (each rank's own experts), in model order; for example
    ``ignored_params=set(moonep.training.expert_parameters(model))`` of a wrapper that must leave them alone."""
    names = set(_expert_names(model)[0])
    return [p for n, p in model.named_parameters() if n in names]


def replicated_parameters(model: nn.Module) -> list:
    """Every other parameter of ``model`` (the same on every rank), in model order."""
    names = set(_expert_names(model)[0])
    return [p for n, p in model.named_parameters() if n not in names]


def moonep_runtime(model: nn.Module):
    """The :class:`moonep.Runtime` of the moonep layers in ``model`` (``None`` for a single process without a
    group); ``ValueError`` if ``model`` holds none, or layers of different groups."""
    from ..layers.parallel import ShardedExperts, ShardedModuleDict

    # one entry per process group (layers built from the same group or mesh may hold runtimes of their own)
    rts = {id(getattr(m._rt, "group", None)) if m._rt is not None else None: m._rt for m in model.modules()
           if isinstance(m, (ShardedExperts, ShardedModuleDict))}
    expect(len(rts) >= 1, "model", "a module holding moonep expert-parallel layers (LatentMoE, or a model "
           "patched by patch_hf_moe / patch_generic)", f"a {type(model).__name__} with none")
    expect(len(rts) == 1, "model", "moonep layers of one expert-parallel group", f"layers of {len(rts)} groups")
    return next(iter(rts.values()))


def prepare(model: nn.Module, *, broadcast_from: int | None = None) -> nn.Module:
    """Make ``model`` (holding moonep layers) ready for the tools people train with. Collective.

    * DDP: ``DistributedDataParallel(model)`` leaves the expert shards and moonep's buffers alone (they are
      listed in ``model._ddp_params_and_buffers_to_ignore``): it would otherwise broadcast rank 0's experts
      over every rank's own at wrap time and sum different experts' gradients.  Wrap ``model`` itself.
    * The replicated parameters and buffers must be equal on every rank (same seed or checkpoint): checked
      here, and a mismatch raises ``ValueError`` on every rank naming the first parameter that differs.  With
      ``broadcast_from=r``, rank ``r``'s values are copied to every rank instead.

    Returns ``model``.  ``patch_hf_moe`` and ``patch_generic`` call this themselves; call it on a model built
    from :class:`moonep.LatentMoE` layers (or again after changing which module is the root).
    """
    rt = moonep_runtime(model)
    check_replicated(model, rt, broadcast_from=broadcast_from, skip=set(_expert_names(model)[0]))
    return mark_for_ddp(model)


def mark_for_ddp(model: nn.Module) -> nn.Module:
    """List ``model``'s expert shards and moonep's buffers in ``model._ddp_params_and_buffers_to_ignore``,
    the names ``DistributedDataParallel(model)`` neither broadcasts nor all-reduces. Returns ``model``."""
    params, buffers = _expert_names(model)
    ignore = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | set(params) | set(buffers)
    model._ddp_params_and_buffers_to_ignore = sorted(ignore)
    return model


# --------------------------------------------------------------------------------------------- consistency
_PRIME = 65521  # position weights 1..65521 make a permutation of equal words change the sum too


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]``: two wrap-around integer sums of ``t``'s bytes (plain and position-weighted), on ``t``'s
    device.  Exact integer arithmetic: equal bits give equal sums on every rank, whatever the device."""
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    b = t.contiguous().reshape(-1).view(torch.uint8)
    total = torch.zeros(2, dtype=torch.int64, device=b.device)
    step = 1 << 22  # bytes per chunk: the int64 copy of a chunk stays small whatever the parameter's size
    for lo in range(0, b.numel(), step):
        w = b[lo:lo + step].to(torch.int64)
        pos = (torch.arange(lo, lo + w.numel(), device=w.device, dtype=torch.int64) % _PRIME) + 1
        total += torch.stack([w.sum(), (w * pos).sum()])
    return total


def check_replicated(model: nn.Module, rt, *, broadcast_from: int | None = None, skip=()) -> None:
    """Raise ``ValueError`` on every rank unless every parameter and buffer of ``model`` not in ``skip`` (names)
    is bitwise equal on every rank of ``rt``; with ``broadcast_from=r`` copy rank ``r``'s values instead.
    Collective over ``rt`` (a no-op for one rank)."""
    R = 1 if rt is None else rt.world_size
    expect(broadcast_from is None or (isinstance(broadcast_from, int) and not isinstance(broadcast_from, bool)
                                      and 0 <= broadcast_from < R),
           "broadcast_from", f"None or a rank in [0, {R})", repr(broadcast_from))
    if R == 1:
        return
    named = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
             if n not in skip and not _moonep_buffer(model, n)]
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
    prints = [] if broadcast_from is not None else [fingerprint(t).cpu().tolist() for _, t in named]
    what = "the replicated-state check"
    # header first (moonep.transport.host_group): a rank in another collective is seen, never paired with this
    got = rt.host.all_gather_object((mine, prints, broadcast_from), code=CHECK_STATE, what=what)
    expect_same("broadcast_from", [g[2] for g in got])
    for r, (names, _, _) in enumerate(got):
        if names != mine:
            first = next((a for a, b in zip(names, mine) if a != b), None)
            fail("model", "the same parameters and buffers (names, shapes, dtypes) on every rank",
                 f"rank {r} differs from rank {rt.rank} at {first or 'the count'}")
    if broadcast_from is not None:
        src = dist.get_global_rank(rt.group, broadcast_from)
        with torch.no_grad(), rt.host.span(what):  # left part way on this rank: the group is abandoned
            for _, t in named:
                t = t.to_local() if hasattr(t, "to_local") else t
                buf = t.detach().to(rt.collective_device)
                with released(rt.group, buf):
                    dist.broadcast(buf, src=src, group=rt.group)
                t.copy_(buf)
        return
    for i, (n, _, _) in enumerate(mine):
        vals = [fp[i] for _, fp, _ in got]
        if any(v != vals[0] for v in vals):
            bad = [r for r, v in enumerate(vals) if v != vals[0]]
            fail(n, "the same value on every rank (a replicated parameter: build the model from the same seed or "
                 "checkpoint on every rank, or pass broadcast_from=0 to copy rank 0's)",
                 f"different values on rank(s) {bad} than on rank 0")


def _moonep_buffer(model: nn.Module, name: str) -> bool:
    """``name`` is a buffer of a QuantileBalancer (rank-local counts; kept in step by moonep)."""
    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return isinstance(owner, QuantileBalancer)
