"""FSDP2 with moonep's experts: the experts are data parallel over the ranks that hold the same experts.

Expert shards are DTensors over the ``"ep"`` dimension of a ``("dp", "ep")`` mesh.  FSDP2 shards and averages
a module's parameters over one mesh; for the experts that is the ``"dp"`` dimension (the ranks holding the
same experts: this rank alone in pure expert parallelism), never the expert-parallel ranks themselves, whose
experts differ.  So the experts modules get their own ``fully_shard`` first, then the blocks and the root get
theirs as usual (which leaves the already-sharded experts alone)::

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    moonep.training.fully_shard_experts(model, mp_policy=mp)
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import expect, fail
from .params import moonep_runtime

__all__ = ["fully_shard_experts"]


def fully_shard_experts(model: nn.Module, *, mesh=None, **fsdp_kwargs) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` on every moonep experts module in ``model``, over ``mesh``.

    Args:
        model: a model holding moonep layers (``LatentMoE`` or a ``patch_hf_moe`` model).
        mesh: the 1-D data-parallel DeviceMesh the experts are replicated over: by default the ``"dp"``
            dimension of the mesh moonep built for a job-wide expert-parallel group (size 1); when the
            experts' group came from your own 2-D mesh (``patch_hf_moe(model, mesh["ep"])``), pass ``mesh["dp"]``.
        fsdp_kwargs: passed to ``fully_shard`` (``mp_policy``, ``reshard_after_forward``, ...); over a mesh of
            one rank ``reshard_after_forward`` defaults to ``False`` (resharding would free nothing).
    Returns ``model``, its experts moved to the mesh's device (as ``fully_shard`` moves plain parameters).
    Call it before ``fully_shard`` of the blocks and the root.  Collective.
    Raises ``ValueError`` (before anything is wrapped) for a mesh that contains other expert-parallel ranks
    (FSDP would shard the experts over ranks whose experts differ), and for ``patch_generic`` blocks, whose
    expert modules FSDP2 cannot shard (exclude them: ``ignored_params=set(expert_parameters(model))``).
    """
    from torch.distributed.fsdp import fully_shard

    from ..layers.parallel import ShardedExperts, ShardedModuleDict

    rt = moonep_runtime(model)
    modules = [m for m in model.modules() if isinstance(m, ShardedExperts)]
    if any(isinstance(m, ShardedModuleDict) for m in model.modules()):
        fail("model", "moonep experts modules FSDP2 can shard (LatentMoE, patch_hf_moe)",
             "patch_generic blocks, whose experts are separate modules: keep them out of FSDP with "
             "ignored_params=set(moonep.training.expert_parameters(model))")
    if mesh is None:
        mesh = getattr(rt, "dp_mesh", None)
        expect(mesh is not None, "mesh", "the data-parallel dimension of your (dp, ep) mesh, mesh['dp'] (the "
               "experts' group came from your own mesh)", None)
    _check_disjoint(mesh, rt)
    if mesh.size() == 1:  # sharded over one rank: resharding after the forward frees nothing, costs a gather
        fsdp_kwargs.setdefault("reshard_after_forward", False)
    for m in modules:
        expect(all(isinstance(getattr(m, n), DTensor) for n in m.sharded_params), "model",
               "expert parameters that are DTensors over the expert-parallel mesh", type(m).__name__)
    if rt is not None and rt.group is not None:
        expect(mesh.device_type == rt.device.type, "mesh",
               f"a {rt.device.type} mesh (the device of the expert-parallel group's ranks)", f"a {mesh.device_type} mesh")
    device = _mesh_device(mesh)
    for m in modules:
        # fully_shard moves plain parameters to the mesh's device itself but refuses DTensors elsewhere: a
        # model patched on the host and sharded over a CUDA mesh gets its experts moved here, like the rest
        m.to(device)
        fully_shard(m, mesh=mesh, **fsdp_kwargs)
    return model


def _mesh_device(mesh) -> torch.device:
    """The device FSDP2 puts a module sharded over ``mesh`` on (the current CUDA device for a CUDA mesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _check_disjoint(mesh, rt) -> None:
    """``mesh`` must meet the expert-parallel group in this rank only (raises ``ValueError``)."""
    expect(getattr(mesh, "ndim", None) == 1, "mesh", "a 1-D DeviceMesh", repr(mesh))
    if rt is None or rt.group is None:
        return
    dp = set(dist.get_process_group_ranks(mesh.get_group()))
    ep = set(dist.get_process_group_ranks(rt.group))
    both = sorted(dp & ep)
    expect(both == [dist.get_rank()], "mesh",
           "the data-parallel ranks holding the same experts as this one (it must share only this rank with the "
           f"expert-parallel group {sorted(ep)}; sharding experts over the expert-parallel ranks is not supported)",
           f"a mesh of ranks {sorted(dp)}")
