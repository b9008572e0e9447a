"""Expert parameters as DTensors: ``Shard(0)`` of the full ``[E, ...]`` tensor over the expert-parallel mesh.

Why DTensors: every tool that reads a model's parameters then knows that rank ``r`` holds rows
``r*epn .. r*epn+epn-1`` of one ``[E, ...]`` tensor, and not a replicated copy of an ``[epn, ...]`` one:

* ``torch.distributed.checkpoint`` saves and reshards them (save at 4 ranks, load at 2), and so the
  optimizer's state created from them (``exp_avg`` of a DTensor parameter is a DTensor);
* ``get_model_state_dict(..., full_state_dict=True)`` gathers the full tensor;
* DDP refuses to broadcast them (instead of overwriting every rank's experts with rank 0's), and FSDP2 composes
  with them on a 2-D ``("dp", "ep")`` mesh (:func:`moonep.training.fully_shard_experts`).

The layers compute with :func:`local_experts`, the ``[epn, ...]`` local tensor, whose gradient is scaled by
``1/R`` on its way back: the data-parallel convention (DDP and FSDP average the other parameters' gradients
over the ranks, so an expert's gradient, which already holds every rank's tokens, is averaged too).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["expert_mesh", "shard_experts_param", "local_experts", "is_expert_dtensor", "full_tensor"]


def expert_mesh(rt) -> DeviceMesh | None:
    """The 1-D ``"ep"`` DeviceMesh of runtime ``rt`` (``None`` without a process group), built once.

    When ``rt`` came from a DeviceMesh (``moonep.init(mesh["ep"])``) that mesh is used, so FSDP2 can shard the
    experts over its sibling ``"dp"`` dimension.  Otherwise, for a group that spans the whole job, the mesh is
    the ``"ep"`` dimension of a ``(1, R)`` ``("dp", "ep")`` mesh (its ``"dp"`` dimension is this rank alone), so
    that the same FSDP2 recipe applies; for a sub-group it is a 1-D mesh of that group. Collective the first time.
    """
    if rt is None or rt.group is None:
        return None
    mesh = getattr(rt, "mesh", None)
    if mesh is not None:
        return mesh
    kind = rt.device.type
    key = (id(rt.group), kind)
    if key not in _MESHES:  # one per group: every runtime over it (moonep.init() again) shares the mesh
        R = rt.world_size
        if dist.get_world_size() == R:
            mine, _ = dist.new_subgroups(group_size=1, backend=dist.get_backend(rt.group))
            root = DeviceMesh.from_group([mine, rt.group], kind, mesh=torch.arange(R).view(1, R),
                                         mesh_dim_names=("dp", "ep"))
            _MESHES[key] = (rt.group, root["ep"], root["dp"])
        else:
            _MESHES[key] = (rt.group, DeviceMesh.from_group(rt.group, kind, mesh_dim_names=("ep",)), None)
    _, rt.mesh, rt.dp_mesh = _MESHES[key]
    return rt.mesh


_MESHES: dict = {}  # (id of a process group, device type) -> (the group, its "ep" mesh, its "dp" mesh or None)


def shard_experts_param(local: torch.Tensor, rt, num_experts: int, requires_grad: bool = True) -> torch.nn.Parameter:
    """``local [epn, *D]`` (this rank's home experts) as a parameter: a ``Shard(0)`` DTensor of the
    ``[num_experts, *D]`` tensor over :func:`expert_mesh` (no copy), or ``local`` itself without a group."""
    mesh = expert_mesh(rt)
    if mesh is None:
        return torch.nn.Parameter(local, requires_grad=requires_grad)
    from .optim import install

    install()  # optimizers holding these and plain parameters step under implicit replication (optim.py)
    shape = (num_experts, *local.shape[1:])
    stride, n = [], 1
    for d in reversed(shape):  # the full tensor's contiguous strides
        stride.insert(0, n)
        n *= d
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=tuple(stride))
    return torch.nn.Parameter(dt, requires_grad=requires_grad)


def is_expert_dtensor(p) -> bool:
    """Whether ``p`` is an expert shard (a ``Shard(0)`` DTensor over an ``"ep"`` mesh dimension)."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


class _MeanGrad(torch.autograd.Function):
    """Identity forward; the gradient divided by ``R`` (the mean over the data-parallel ranks)."""

    @staticmethod
    def forward(ctx, t, world_size: int):
        ctx.world_size = world_size
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.world_size, None


def local_experts(p: torch.Tensor, world_size: int) -> torch.Tensor:
    """The ``[epn, *D]`` tensor a layer computes with, from its expert parameter ``p``.

    ``p`` is a :func:`shard_experts_param` DTensor (FSDP2 may hand an unsharded one in another dtype) or a plain
    tensor.  Its gradient reaches ``p`` divided by ``world_size``: expert gradients are the mean over the ranks
    of their losses' gradients, as DDP and FSDP make every other parameter's."""
    t = p.to_local() if isinstance(p, DTensor) else p
    return _MeanGrad.apply(t, world_size) if world_size > 1 and t.requires_grad else t


def full_tensor(t: DTensor) -> torch.Tensor:
    """``t.full_tensor()``, also where the mesh's groups are gloo and ``t`` lives on a GPU (ranks sharing a
    GPU: NCCL refuses them): DTensor's collectives would hand gloo device memory, so the local part is
    gathered on the host over the same groups, then moved back.  Collective over ``t``'s mesh."""
    mesh = t.device_mesh
    if t.to_local().device.type == "cpu" or not any(dist.get_backend(mesh.get_group(i)) == "gloo"
                                                    for i in range(mesh.ndim)):
        return t.full_tensor()
    return _via_host(t)


def _via_host(t: DTensor) -> torch.Tensor:
    """``t.full_tensor()`` gathered on the host: ``t``'s local part on the CPU, over the same groups."""
    local, mesh = t.to_local(), t.device_mesh
    key = id(mesh)
    if key not in _HOST_MESHES:
        groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        _HOST_MESHES[key] = (mesh, DeviceMesh.from_group(groups if mesh.ndim > 1 else groups[0], "cpu",
                                                         mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names))
    host = DTensor.from_local(local.cpu(), _HOST_MESHES[key][1], t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())
    return host.full_tensor().to(local.device)


_HOST_MESHES: dict = {}  # id of a gloo mesh of GPU tensors -> (the mesh, the same groups as a "cpu" mesh)
