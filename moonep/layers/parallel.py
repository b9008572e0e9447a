"""Expert sharding for layers: which group, the ExpertParallel engine, and the expert-shard modules.

Expert weights hold only this rank's home experts (rows ``rank*epn .. rank*epn+epn-1`` of the full
``[E, ...]``), as DTensors (:mod:`moonep.training.sharding`).  Everything else is replicated; how the two
meet DDP, FSDP2, clipping and checkpoints is :mod:`moonep.training`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..balance import QuantileBalancer
from ..ep import ExpertParallel
from ..eager_only import eager_only
from ..errors import expect
from ..guard import SIZING
from ..runtime import Runtime, detect_launcher, init
from ..training.sharding import local_experts


# --------------------------------------------------------------------------------------------- group
def resolve_group(group):
    """``None`` -> the launcher's job (``moonep.init()``) or, for a plain single process, no group at all; a
    ProcessGroup or a 1-D DeviceMesh (``mesh["ep"]``) -> a runtime over it.

    Returns a :class:`moonep.Runtime` or ``None`` (one process, no ``torch.distributed`` needed).
    """
    if isinstance(group, Runtime):
        return group
    if group is not None:
        return init(group)
    if dist.is_available() and dist.is_initialized() or detect_launcher() != "single":
        return init()
    return None


class EPProvider:
    """One ``ExpertParallel`` per (topk, width, dtype), shared by every layer of a model.

    ``max_tokens=None`` sizes the buffers from the largest ``s`` seen on any rank (one small header exchange
    per call; grows in powers of two). Give ``max_tokens`` for fixed shapes and no extra collective.
    """

    def __init__(self, rt, num_experts: int, *, max_tokens=None, **ep_kwargs):
        self.rt, self.num_experts, self.max_tokens, self.ep_kwargs = rt, num_experts, max_tokens, ep_kwargs
        self.world_size = 1 if rt is None else rt.world_size
        self.rank = 0 if rt is None else rt.rank
        self._cache: dict = {}

    def __deepcopy__(self, memo) -> "EPProvider":
        """A provider of the same configuration with nothing built yet: a copied model (``copy.deepcopy``)
        gets ExpertParallel objects of its own, on its first call (collective, as building always is), and
        never shares the original's buffers or its place in the collectives' call order."""
        return EPProvider(self.rt, self.num_experts, max_tokens=self.max_tokens, **self.ep_kwargs)

    def built(self, topk: int, width: int, dtype: torch.dtype, device: torch.device):
        """The ExpertParallel that :meth:`get` would return without host work or a collective (fixed
        ``max_tokens``, instance already built), else ``None``.  A dict lookup: compiled code traces it."""
        if self.max_tokens is None:
            return None
        ep = self._cache.get((topk, width, dtype, device if self.rt is None else None))
        return ep if ep is not None and ep.max_tokens >= self.max_tokens else None

    def get(self, s: int, topk: int, width: int, dtype: torch.dtype, device: torch.device):
        """The ExpertParallel for ``s`` tokens of ``width`` in ``dtype`` on ``device`` (collective when it
        must be built or grown).  Without a runtime (a plain process) it is the local backend's.  Under
        ``torch.compile``: a traced dict lookup once it is built with a fixed ``max_tokens``, else one graph
        break (the sizing exchange and the construction run eagerly)."""
        ep = self.built(topk, width, dtype, device)
        return ep if ep is not None else self._get(s, topk, width, dtype, device)

    @eager_only  # host work, perhaps a collective: outside the graph
    def _get(self, s: int, topk: int, width: int, dtype: torch.dtype, device: torch.device):
        need = self.max_tokens
        if need is None:  # the largest s of any rank: one header exchange (moonep.transport.host_group)
            most = max(self.rt.host.agree(SIZING, s, what="EPProvider sizing")) if self.world_size > 1 else s
            need = max(16, 1 << max(most - 1, 0).bit_length())
        key = (topk, width, dtype, device if self.rt is None else None)
        ep = self._cache.get(key)
        if ep is None or ep.max_tokens < need:
            where = dict(device=device) if self.rt is None else {}
            ep = ExpertParallel(self.rt, num_experts=self.num_experts, topk=topk, hidden=width,
                                max_tokens=need, dtype=dtype, **where, **self.ep_kwargs)
            self._cache[key] = ep
        return ep


# --------------------------------------------------------------------------------------------- state
class ShardedExperts:
    """Mixin for modules whose parameters named in ``sharded_params`` hold this rank's home experts.

    Each is a ``Shard(0)`` DTensor of the full ``[E, ...]`` tensor over the expert-parallel mesh (a plain
    ``[epn, ...]`` tensor without a process group): :mod:`moonep.training.sharding`.  A layer computes with
    :meth:`expert_weight`.  ``load_state_dict`` accepts the full ``[E, ...]`` tensor (each rank keeps its home
    rows), the ``[epn, ...]`` shard, or a DTensor (a DCP or ``get_model_state_dict`` checkpoint), so a
    checkpoint loads at any ``R``.  Set ``moonep_num_experts``, ``moonep_epn``, ``moonep_rank`` and ``_rt``.
    """

    sharded_params: tuple = ()

    def expert_weight(self, name: str) -> torch.Tensor:
        """``[epn, ...]``: this rank's home experts of parameter ``name``, read in place, their gradient averaged
        over the ranks (:func:`moonep.training.local_experts`)."""
        return local_experts(getattr(self, name), 1 if self._rt is None else self._rt.world_size)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in self.sharded_params:
            t, p = state_dict.get(prefix + name), getattr(self, name, None)
            if t is not None and p is not None:
                state_dict[prefix + name] = self._in_layout(t, p)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _in_layout(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """A checkpoint's tensor ``t`` for parameter ``p``: full, shard or DTensor -> ``p``'s layout."""
        if isinstance(t, DTensor):
            if isinstance(p, DTensor) and t.device_mesh == p.device_mesh and t.placements == p.placements:
                return t
            t = t.full_tensor()
        E, epn = self.moonep_num_experts, self.moonep_epn
        if t.dim() == 0 or t.shape[0] not in (E, epn):
            return t  # a wrong shape: load_state_dict reports it
        rows = t[self.moonep_rank * epn:(self.moonep_rank + 1) * epn] if t.shape[0] == E else t
        if not isinstance(p, DTensor):
            return rows
        local = p.to_local()
        return DTensor.from_local(rows.to(local.device), p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())


class ShardedModuleDict(torch.nn.ModuleDict):
    """Home experts of a ``ModuleList`` kept under their global index (``"5"``), so their state-dict keys
    match the unpatched model's; keys of other ranks' experts are ignored on load."""

    def __init__(self, modules: dict, num_experts: int, home: range, rt):
        super().__init__(modules)
        self.num_experts, self.home, self._rt = num_experts, home, rt

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            head = key[len(prefix):].split(".", 1)[0]
            if head.isdigit() and int(head) not in self.home:
                del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


# --------------------------------------------------------------------------------------------- training
def balancer_step(model: torch.nn.Module) -> None:
    """``step()`` every QuantileBalancer in ``model`` (collective); call once per optimizer step."""
    for m in model.modules():
        if isinstance(m, QuantileBalancer):
            m.step()


def home_range(num_experts: int, rt) -> range:
    R = 1 if rt is None else rt.world_size
    expect(num_experts % R == 0, "num_experts", f"a multiple of the group size {R}", num_experts)
    epn = num_experts // R
    r = 0 if rt is None else rt.rank
    return range(r * epn, (r + 1) * epn)
