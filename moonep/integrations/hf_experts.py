"""The patched experts modules of :func:`moonep.integrations.patch_hf_moe` and their expert maths.

A patched module is the original transformers experts module (same class through a subclass made on the
fly, same attributes and sub-modules, same state-dict keys) whose per-expert parameters hold only this
rank's home experts ``[epn, ...]`` and whose forward runs :class:`moonep.ExpertParallel`. The expert maths
lives in one function, :func:`fused_expert_maths`; the replica weights move in one method, ``_expert_out``
(into a :class:`moonep.ReplicaPool` shared by all layers; the home experts are read in place).
"""
from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from .. import eager_math
from ..errors import expect
from ..experts import default_pool, expert_matmul
from ..layers.parallel import ShardedExperts


# --------------------------------------------------------------------------------------------- maths
def _slot_linear(a: torch.Tensor, cu: torch.Tensor, w, rw, b, rb, transposed: bool) -> torch.Tensor:
    """Rows of slot ``j`` through slot ``j``'s linear map: ``a [cap, D]``, home weights ``w [epn, N, D]``
    (``[epn, D, N]`` when ``transposed``) and their replicas ``rw``, home biases ``b [epn, N]`` and ``rb``, or
    ``None`` -> ``[cap, N]``; rows past ``cu[-1]`` stay zero."""
    return expert_matmul(a, cu, w, rw, transpose=not transposed, bias=b, bias_replicas=rb)


def fused_expert_maths(ex: nn.Module, rows: torch.Tensor, cu_seqlens: torch.Tensor, home: dict,
                       replicas: dict, linear=None) -> torch.Tensor:
    """The expert maths of a transformers fused experts module, over the dispatched slots.

    Args:
        ex: the experts module (its flags, ``_apply_gate`` / ``act_fn`` and ``post_expert_norm`` are used).
        rows: ``[cap, H]`` dispatched rows grouped by slot (``cu_seqlens`` int32 ``[2*epn + 1]``).
        home: this rank's home parameters by name, read in place: ``gate_up_proj [epn, 2I, H]``
            (``up_proj [epn, I, H]`` without a gate; ``[epn, H, 2I]`` when ``ex.is_transposed``),
            ``down_proj [epn, H, I]`` (``[epn, I, H]``), optionally ``*_bias [epn, N]``; the dtype of ``rows``.
        replicas: what :meth:`moonep.ReplicaPool.fetch` returned for each (compiled: :class:`moonep.ops.Fetched`).
        linear: ``(a, weight, weight_replicas, bias, bias_replicas, transposed) -> [cap, N]``, one projection
            of every slot (default: :func:`moonep.expert_matmul` with its ``bias``, eager and compiled).
    Returns:
        ``[cap, H]``: ``f_{e_j}(row)`` for each row of slot ``j``; rows past ``cu_seqlens[-1]`` are zero.
    """
    t = ex.moonep_transposed
    up = "gate_up_proj" if ex.moonep_gated else "up_proj"
    if linear is None:
        linear = lambda a, w, rw, b, rb, tr: _slot_linear(a, cu_seqlens, w, rw, b, rb, tr)  # noqa: E731
    lin = lambda a, n: linear(a, home[n], replicas[n], home.get(n + "_bias"), replicas.get(n + "_bias"),  # noqa: E731
                              t)
    h = lin(rows, up)
    key = getattr(ex, "moonep_act_key", None)
    # compiled inside bitwise(): the activation as eager_math's op (eager's rounding); else the module's own code
    h = eager_math.call(key, h)[0] if key is not None and eager_math.as_ops() else _act(ex, h)
    out = lin(h, "down_proj")
    if getattr(ex, "has_post_expert_norm", False):
        out = ex.post_expert_norm(out)
    return out


def _act(ex, h):
    return _gate(ex, h) if ex.moonep_gated else ex.act_fn(h)


def _act_key(ex: nn.Module) -> int:
    """The module's activation as a :mod:`moonep.eager_math` function, so that compiled inside
    ``eager_math.bitwise()`` it rounds as eager: called on a shallow copy without parameters, buffers or
    moonep's state (``_apply_gate`` and ``act_fn`` read only plain attributes and the activation sub-module),
    which the registry may keep for good."""
    shell = copy.copy(ex)
    shell.__dict__ = {k: v for k, v in ex.__dict__.items() if not k.startswith("moonep_") and k != "_rt"}
    shell.__dict__.update(_parameters={}, _buffers={}, moonep_gated=ex.moonep_gated)
    return eager_math.register(lambda h: _act(shell, h), f"hf_experts.act.{next(_ACT_IDS)}")


_ACT_IDS = itertools.count()


def _gate(ex, h):
    if hasattr(ex, "_apply_gate"):  # the module's own gate (GPT-OSS: interleaved, clamped, alpha)
        return ex._apply_gate(h)
    gate, up = h.chunk(2, dim=-1)   # modules without one (Llama-4, LongCat-Flash): act(gate) * up
    return ex.act_fn(gate) * up


# --------------------------------------------------------------------------------------------- dtypes
# transformers' experts implementations (config._experts_implementation) differ in the dtype they compute in:
# "eager" (F.linear per expert) and "batched_mm" (torch.bmm) follow torch.autocast and refuse activations whose
# dtype differs from the weights'; the others ("grouped_mm", ...) cast the activations to the weights' dtype
# and ignore autocast.  A patched module computes where its own implementation would.
_AUTOCAST_IMPLS = ("eager", "batched_mm")


def compute_dtype(ex: nn.Module, x: torch.Tensor, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the unpatched experts module ``ex`` computes in, for activations ``x`` and weights of
    ``weight_dtype`` (raises ``ValueError`` where it would refuse the mix)."""
    impl = getattr(getattr(ex, "config", None), "_experts_implementation", None) or "eager"
    if impl not in _AUTOCAST_IMPLS:
        return weight_dtype
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    expect(x.dtype == weight_dtype, "hidden_states", f"dtype {weight_dtype}, the experts' weights' (their "
           f"{impl!r} implementation multiplies the two as they are, outside torch.autocast)", x.dtype)
    return x.dtype


# --------------------------------------------------------------------------------------------- modules
class EPExperts(ShardedExperts, nn.Module):
    """Base of the patched experts modules. A patched module is the original module (same class, via a
    subclass made on the fly, same attributes and sub-modules, same state-dict keys) whose per-expert
    parameters hold only this rank's home experts (``Shard(0)`` DTensors of the full ``[E, ...]`` tensors)
    and whose forward runs ExpertParallel.

    A checkpoint loads at any ``R`` (each rank keeps its rows); ``torch.distributed.checkpoint`` reshards it;
    :func:`moonep.training.full_state_dict` gathers the unpatched layout.
    """

    sharded_params: tuple = ()

    def _home(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``[epn, ...]`` home experts of parameter ``name`` in ``dtype`` (a cast keeps the gradient path)."""
        w = self.expert_weight(name)
        return w if w.dtype == dtype else w.to(dtype)

    def _weight_dtype(self) -> torch.dtype:
        return getattr(self, self.sharded_params[0]).dtype

    def _expert_out(self, ep, h, dtype: torch.dtype) -> torch.Tensor:
        """``[cap, H]`` outputs of every dispatched row, in ``dtype``: the home experts' parameters are read in
        place (cast to ``dtype`` if they differ) and the replicas this step placed here are fetched into the
        model's replica pool, here, the one place of this adapter that moves weights."""
        pool = getattr(self, "moonep_pool", None) or default_pool()
        home = {n: self._home(n, dtype) for n in self.sharded_params}
        replicas = dict(zip(home, pool.fetch(ep, h, list(home.values()), list(home))))  # one collective
        with torch.autocast(h.tokens.device.type, enabled=False):  # the dtype is decided: no second cast
            return fused_expert_maths(self, h.tokens, h.cu_seqlens, home, replicas)

    def _dtype_or_refuse(self, x: torch.Tensor, ep_of) -> torch.dtype:
        """:func:`compute_dtype` of ``x``; a refusal is raised on every rank together (through the dispatch that
        the peers are making: ``ep_of(dtype)`` gives its ExpertParallel)."""
        try:
            return compute_dtype(self, x, self._weight_dtype())
        except ValueError as exc:
            ep_of(x.dtype).refuse("dispatch", str(exc))
            raise


class EPRoutedExperts(EPExperts):
    """``forward(hidden_states [T, H], top_k_index int [T, K], top_k_weights float [T, K]) -> [T, H]``
    (``hidden_states.dtype``), the arguments named as the original module names them. Collective."""

    def forward(self, *args, **kwargs):
        x, idx, w = self.moonep_signature.bind(*args, **kwargs).args
        expect(x.dim() == 2 and idx.dim() == 2 and idx.shape == w.shape, "experts(hidden_states, top_k_index, "
               "top_k_weights)", "[T, H], [T, K], [T, K]", [list(x.shape), list(idx.shape), list(w.shape)])
        # A token may pick one expert twice (DeepSeek-V4's hash routing): the first copy carries the summed
        # weight, the others are masked; for distinct ids the weights are unchanged (w + 0 + ... == w).
        same = idx[:, :, None] == idx[:, None, :]
        w = (same * w[:, None, :]).sum(-1)
        idx = idx.masked_fill(torch.tril(same, diagonal=-1).any(-1), -1)
        ep_of = lambda dt: self.moonep_ep.get(x.shape[0], idx.shape[1], x.shape[1], dt, x.device)  # noqa: E731
        dt = self._dtype_or_refuse(x, ep_of)
        # one code path, eager and compiled (each collective one node of the graph: moonep/ops.py)
        ep = ep_of(dt)
        h = ep.dispatch(x.to(dt), idx, w)  # rows travel in the compute dtype: a cast commutes with a move
        y = ep.combine(self._expert_out(ep, h, dt), h)
        return y.to(x.dtype)


class EPDenseExperts(EPExperts):
    """Llama-4: ``forward(routed_in [E*T, H]) -> [E*T, H]``: expert ``e`` maps rows ``e*T .. e*T+T-1``.
    The block sets the rows of unselected experts to zero and these experts map zero to zero (no
    biases), so only the non-zero rows travel, each as its own token with one choice. Collective."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        E, H = self.moonep_num_experts, hidden_states.shape[-1]
        x = hidden_states.view(E, -1, H)
        e_idx, t_idx = (x != 0).any(-1).nonzero(as_tuple=True)   # host sync: the rows that can contribute
        rows = x[e_idx, t_idx]
        ep_of = lambda dt: self.moonep_ep.get(rows.shape[0], 1, H, dt, x.device)  # noqa: E731
        dt = self._dtype_or_refuse(rows, ep_of)
        ep = ep_of(dt)
        h = ep.dispatch(rows.to(dt), e_idx[:, None], torch.ones(rows.shape[0], 1, dtype=dt, device=x.device))
        y = ep.combine(self._expert_out(ep, h, dt), h)
        return x.new_zeros(x.shape).index_put((e_idx, t_idx), y.to(x.dtype)).view(-1, H)


_CLASSES: dict = {}


def ep_class(base, cls):
    """``base`` (routed or dense) mixed into the original experts class, so every attribute and method
    the block or ``_apply_gate`` may read stays where it was."""
    key = (base, cls)
    if key not in _CLASSES:
        name = f"EP{cls.__name__}"
        _CLASSES[key] = type(name, (base, cls), {"__module__": __name__, "__qualname__": name})
    return _CLASSES[key]


def clone(ex: nn.Module, cls, params: dict, to=None) -> nn.Module:
    """A shallow copy of ``ex`` as ``cls`` with ``params`` in place of its own; ``to`` (a dtype/device)
    deep-copies its sub-modules and buffers there (the float64 probe copies)."""
    new = cls.__new__(cls)
    new.__dict__.update({k: (copy.copy(v) if isinstance(v, (dict, set)) else v) for k, v in ex.__dict__.items()})
    new._parameters.update(params)
    if to is not None:
        for k, m in ex._modules.items():
            new._modules[k] = None if m is None else copy.deepcopy(m).to(**to)
        for k, b in ex._buffers.items():
            if b is not None:
                new._buffers[k] = b.detach().to(**to) if b.is_floating_point() else b.to(to["device"])
    return new


def setup(new, base, E, names, sig, provider, rt):
    """Give a cloned module what its patched forward reads: the provider of ExpertParallel instances,
    ``E`` and this rank's share, the layout flags and the original forward's signature. Returns ``new``."""
    R, r = (1, 0) if rt is None else (rt.world_size, rt.rank)
    new.moonep_ep, new._rt, new.sharded_params = provider, rt, tuple(names)
    new.moonep_num_experts, new.moonep_epn, new.moonep_rank = E, E // R, r
    new.moonep_gated = "gate_up_proj" in names
    new.moonep_transposed = bool(getattr(new, "is_transposed", base is EPDenseExperts))
    # bind() of the module's own signature, without `self`: the block may name the arguments its way
    new.moonep_signature = sig.replace(parameters=list(sig.parameters.values())[1:])
    new.moonep_act_key = _act_key(new)
    return new
