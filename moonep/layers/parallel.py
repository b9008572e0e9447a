"""Expert sharding for layers: which group, the ExpertParallel engine, sharded state dicts, gradients.

Expert weights are ordinary ``nn.Parameter``s holding only this rank's home experts (``[epn, ...]`` rows
``rank*epn .. rank*epn+epn-1`` of the full ``[E, ...]``). Everything else is replicated: its gradient
covers this rank's tokens only, so :func:`sync_grads` all-reduces it (DDP would broadcast rank 0's
parameters and clobber the expert shards, so it must not wrap these models as is).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..balance import QuantileBalancer
from ..ep import ExpertParallel
from ..errors import expect
from ..guard import SIZING
from ..runtime import Runtime, detect_launcher, init


# --------------------------------------------------------------------------------------------- group
def resolve_group(group):
    """``None`` -> the launcher's job (``moonep.init()``) or, for a plain single process, no group at all.

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

    def get(self, s: int, topk: int, width: int, dtype: torch.dtype, device: torch.device):
        """The ExpertParallel for ``s`` tokens of ``width`` in ``dtype`` on ``device`` (collective when it
        must be built or grown).  Without a runtime (a plain process) it is the local backend's."""
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
    """Mixin for modules whose parameters named in ``sharded_params`` are ``[epn, ...]`` home shards.

    ``load_state_dict`` accepts either the shard or the full ``[E, ...]`` tensor (the home rows are taken),
    so a full checkpoint loads at any ``R``; :func:`full_state_dict` builds one.
    Set ``self.num_experts``, ``self.epn``, ``self.ep_rank`` and ``self._rt`` in ``__init__``.
    """

    sharded_params: tuple = ()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        lo = self.ep_rank * self.epn
        for name in self.sharded_params:
            t = state_dict.get(prefix + name)
            if t is not None and t.shape[0] == self.num_experts and self.num_experts != self.epn:
                state_dict[prefix + name] = t[lo:lo + self.epn]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


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


def _sharded(model):
    """``(stacked keys, per-expert key prefixes, runtime)`` of every sharded module in ``model``."""
    stacked, prefixes, rt = [], [], None
    for name, m in model.named_modules():
        pre = name + "." if name else ""
        if isinstance(m, ShardedExperts):
            stacked += [pre + p for p in m.sharded_params]
            rt = rt or m._rt
        elif isinstance(m, ShardedModuleDict):
            prefixes.append(pre)
            rt = rt or m._rt
    return stacked, prefixes, rt


def full_state_dict(model: torch.nn.Module) -> dict:
    """The state dict of the whole model as one process would hold it (full ``[E, ...]`` experts).

    Collective over the experts' group (every rank calls it; every rank gets the same dict, on CPU for
    the gathered entries). Meant for checkpoints of models whose experts fit in host memory.
    """
    sd = model.state_dict()
    stacked, prefixes, rt = _sharded(model)
    mine = {k: v.detach().cpu() for k, v in sd.items()
            if k in stacked or any(k.startswith(p) for p in prefixes)}
    parts = [mine]
    if rt is not None and rt.world_size > 1:
        parts = [None] * rt.world_size
        dist.all_gather_object(parts, mine, group=rt.cpu_group)
    out = {k: v for k, v in sd.items() if k not in mine}
    for k in stacked:
        out[k] = torch.cat([p[k] for p in parts])
    for p in parts:
        out.update({k: v for k, v in p.items() if k not in stacked})
    return out


def load_full_state_dict(model: torch.nn.Module, state_dict: dict, strict: bool = True):
    """Load a full (unsharded) state dict into a model sharded over any ``R``; each rank keeps its rows."""
    return model.load_state_dict(state_dict, strict=strict)


# --------------------------------------------------------------------------------------------- training
def sync_grads(model: torch.nn.Module, average: bool = True) -> None:
    """Finish the backward of an expert-parallel model: all-reduce the replicated parameters' gradients.

    Expert gradients already hold every rank's contribution (reduce_grad). With ``average=True`` every
    gradient is divided by ``R``, which is the gradient of the mean of the ranks' losses. Collective.
    """
    stacked, prefixes, rt = _sharded(model)
    if rt is None or rt.world_size == 1:
        return
    params = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    shard = [p for k, p in params if k in stacked or any(k.startswith(q) for q in prefixes)]
    shard_ids = {id(p) for p in shard}
    rep = [p for _, p in params if id(p) not in shard_ids]
    all_reduce_grads(rep, rt.group)
    if average:
        for p in rep + shard:
            if p.grad is not None:
                p.grad.div_(rt.world_size)


def all_reduce_grads(params: list, group) -> None:
    """Sum the gradients of ``params`` over ``group``, in one flat all-reduce; a missing gradient counts as
    zeros (every rank must contribute the same layout). Collective."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    off = 0
    for p in params:
        p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
        off += p.numel()


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
