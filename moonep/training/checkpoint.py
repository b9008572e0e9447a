"""Checkpoints of models with moonep layers.

* ``torch.distributed.checkpoint`` (DCP) needs nothing from moonep: expert shards are ``Shard(0)`` DTensors of
  the full ``[E, ...]`` tensors, so DCP saves them once, with their optimizer state, and reshards them on load
  (save at 4 ranks, load at 2).  Use ``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)`` /
  ``set_state_dict`` as for any model.
* :func:`full_state_dict` gathers the model as one process would hold it, for a single-file checkpoint that
  the unpatched model loads with ``strict=True``; ``model.load_state_dict(full)`` then loads it back at any
  number of ranks (each rank keeps its rows).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import expect_same
from ..guard import GATHER_STATE
from .grads import _span
from .sharding import full_tensor
from .params import moonep_runtime

__all__ = ["full_state_dict"]


def full_state_dict(model: nn.Module) -> dict:
    """The state dict of the whole model (full ``[E, ...]`` experts), the same on every rank.

    Collective over the experts' group (every rank calls it).  DTensor entries (expert shards; FSDP2's shards)
    are gathered in place of their shards; the expert modules of ``patch_generic`` blocks (a
    ``ShardedModuleDict``, each rank holding its own under their global index) come from every rank.
    Gathered entries are on the CPU.  Meant for models whose state fits in host memory.
    """
    rt = moonep_runtime(model)
    sd = model.state_dict()
    prefixes = _module_expert_prefixes(model)
    gathered = [k for k, v in sd.items() if isinstance(v, DTensor)]
    many = rt is not None and rt.world_size > 1
    if many:  # header first: every rank gathers the same entries, and a rank in another call is seen
        keys = [(k, tuple(sd[k].shape)) for k in gathered]
        expect_same("model", rt.host.all_gather_object(keys, code=GATHER_STATE, what="full_state_dict"))
    out = dict(sd)
    with _span(rt, "full_state_dict"):
        for k in gathered:
            out[k] = full_tensor(sd[k]).cpu()
    mine = {k: v.detach().cpu() for k, v in out.items() if any(k.startswith(p) for p in prefixes)}
    if prefixes:
        parts = [mine]
        if many:
            parts = rt.host.all_gather_object(mine, code=GATHER_STATE, seq=1, what="full_state_dict")
        for p in parts:
            out.update(p)
    return out


def _module_expert_prefixes(model: nn.Module) -> list:
    """State-dict prefixes of ``ShardedModuleDict`` expert modules (keys ``<prefix><global index>.``)."""
    from ..layers.parallel import ShardedModuleDict

    return [(n + "." if n else "") for n, m in model.named_modules() if isinstance(m, ShardedModuleDict)]
