"""Gradients of a model with moonep layers: averaging the replicated ones, and one global norm for clipping.

Expert gradients come out of the backward complete and averaged (every rank's tokens, divided by ``R``:
:func:`moonep.training.sharding.local_experts`).  The replicated parameters' gradients hold this rank's
tokens only: DDP and FSDP average them; without a wrapper, :func:`sync_grads` does.

``torch.nn.utils.clip_grad_norm_`` cannot add up a norm whose parts live on different ranks and meshes (it
raises on a mix of plain and DTensor gradients, or of DTensors of two meshes); :func:`clip_grad_norm_` does,
and returns the same global norm on every rank.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import MoonepError, expect, expect_same
from ..guard import GRAD_NORM, SYNC_GRADS
from ..transport.host_group import released
from .params import _expert_names, moonep_runtime
from .sharding import full_tensor

__all__ = ["sync_grads", "clip_grad_norm_", "all_reduce_grads"]


def sync_grads(model: nn.Module) -> None:
    """Average the replicated parameters' gradients over the ranks (what DDP does), for training without a
    data-parallel wrapper.  Expert gradients are left as they are (already complete and averaged).

    Safe to call at any point and more than once per step (after each micro-batch of an accumulation, say):
    averaging values that are already equal on every rank leaves them equal.  Collective.  Do not call it
    under DDP or FSDP, which average the gradients themselves."""
    rt = moonep_runtime(model)
    if rt is None or rt.world_size == 1:
        return
    experts = set(_expert_names(model)[0])
    rep = [p for n, p in model.named_parameters() if p.requires_grad and n not in experts]
    expect(not any(isinstance(p, DTensor) for p in rep), "model",
           "replicated parameters that are plain tensors (sync_grads replaces DDP; under FSDP do not call it)",
           "DTensor parameters")
    all_reduce_grads(rep, rt, average=True)


def all_reduce_grads(params: list, rt, average: bool = False) -> None:
    """Sum (or average) the gradients of ``params`` over ``rt``'s group in one flat all-reduce; a missing
    gradient counts as zeros, so every rank contributes the same layout (checked first, in a header that
    also tells a rank making another collective: :mod:`moonep.transport.host_group`).  Collective."""
    n = sum(p.numel() for p in params)
    sizes = rt.host.agree(SYNC_GRADS, n, what="sync_grads")
    expect_same("model", [f"{v} replicated gradient values" for v in sizes])
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dev = flat.device
    if dist.get_backend(rt.group) == "nccl" and dev.type != "cuda":
        flat = flat.cuda()
    with rt.host.span("sync_grads"), _named("sync_grads"), released(rt.group, flat):
        dist.all_reduce(flat, group=rt.group)
    if average:
        flat /= rt.world_size
    flat = flat.to(dev)
    off = 0
    for p in params:
        p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
        off += p.numel()


def _groups(model_or_params):
    """Gradients grouped by how their norm adds up across ranks: ``{key: [grad, ...]}`` with key ``None`` for
    plain replicated gradients, a DeviceMesh for DTensor gradients, ``"sharded"`` for plain expert shards."""
    if isinstance(model_or_params, nn.Module):
        experts = set(_expert_names(model_or_params)[0])
        named = list(model_or_params.named_parameters())
        rt = moonep_runtime(model_or_params)
    else:
        experts, named, rt = set(), [(None, p) for p in model_or_params], None
    groups: dict = {}
    for n, p in named:
        if p.grad is None:
            continue
        g = p.grad
        key = g.device_mesh if isinstance(g, DTensor) else ("sharded" if n in experts else None)
        groups.setdefault(key, []).append(g)
    return groups, rt


def clip_grad_norm_(model_or_parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for models with moonep layers, under DDP, FSDP2 or neither.

    Args:
        model_or_parameters: the model (preferred: its plain expert shards, from ``patch_generic``, are known
            by their module), or an iterable of parameters (plain tensors count as replicated, DTensors as
            sharded over their mesh).
        max_norm, norm_type, error_if_nonfinite: as in torch.
    Returns:
        float32 0-dim tensor: the total norm of all gradients as one vector (the expert shards of every rank
        counted once), the same on every rank. Gradients are scaled in place by
        ``min(1, max_norm / (total + 1e-6))``, as torch does.  Collective over the experts' group.
    """
    expect(isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm >= 0,
           "max_norm", "a number >= 0", repr(max_norm))
    expect(isinstance(norm_type, (int, float)) and not isinstance(norm_type, bool) and norm_type > 0, "norm_type",
           "a number > 0 (float('inf') for the max norm)", repr(norm_type))
    norm_type = float(norm_type)
    groups, rt = _groups(model_or_parameters)
    if rt is not None and rt.world_size > 1:  # what every rank adds up must agree, or the norms differ
        shape = [(str(k) if k is not None else "plain", len(v)) for k, v in groups.items()]
        got = rt.host.all_gather_object((float(max_norm), norm_type, shape), code=GRAD_NORM,
                                        what="clip_grad_norm_")
        for i, name in enumerate(("max_norm", "norm_type", "model_or_parameters")):
            expect_same(name, [g[i] for g in got])
    device = next((g.to_local().device if isinstance(g, DTensor) else g.device
                   for gs in groups.values() for g in gs), torch.device("cpu"))
    parts = []
    for key, grads in groups.items():
        if isinstance(key, str):  # plain expert shards: their norms add up over the experts' group
            local = torch.nn.utils.get_total_norm(grads, norm_type).to(device)
            parts.append(_reduce_norm(local, norm_type, rt))
            continue
        n = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(n, DTensor):
            with _span(rt, "clip_grad_norm_"):
                n = full_tensor(n)
        parts.append(n.to(device))
    total = (torch.nn.utils.get_total_norm(parts, norm_type) if parts
             else torch.zeros((), device=device))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in groups.values():
        for g in grads:
            t = g.to_local() if isinstance(g, DTensor) else g
            t.mul_(coef.to(t.device, t.dtype))
    return total


def _reduce_norm(local: torch.Tensor, norm_type: float, rt) -> torch.Tensor:
    """The norm over every rank's shards from this rank's ``local`` norm. Collective over ``rt``."""
    if rt is None or rt.world_size == 1:
        return local
    inf = norm_type == float("inf")
    t = (local if inf else local.double() ** norm_type).to(rt.collective_device).reshape(1)
    with _span(rt, "clip_grad_norm_"), released(rt.group, t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=rt.group)
    t = t.to(local.device).reshape(())
    return (t if inf else t ** (1.0 / norm_type)).to(local.dtype)


@contextmanager
def _named(what: str):
    """A failure of the collective inside (gloo: a dead or stalled peer) as :class:`moonep.MoonepError`."""
    try:
        yield
    except MoonepError:
        raise
    except RuntimeError as exc:
        raise MoonepError(f"{what}: a collective over the expert-parallel group failed (a peer is dead, stalled "
                          f"or made another call): {str(exc).strip()[:400]}") from exc


@contextmanager
def _span(rt, what: str):
    """The collectives of one agreed call: named failures; left part way, the group is abandoned."""
    if rt is None or rt.world_size == 1:
        yield
        return
    with rt.host.span(what), _named(what):
        yield
