"""moonep as torchtitan's expert-parallel backend (torchtitan 0.3.x), chosen through torchtitan's overrides.

    --override.imports moonep.integrations.torchtitan.moonep_experts            # on the train command line
    --override.imports 'moonep.integrations.torchtitan.moonep_experts={"slack": 0.1}'

replaces every ``RoutedExperts`` of the model by :class:`MoonepRoutedExperts`: the same module (its inner
experts, their ``w1/w2/w3`` DTensors and state-dict keys, its sharding config) whose token dispatcher is
:class:`MoonepTokenDispatcher` and whose inner experts compute every slot moonep delivers: the home slots
with their own parameters, in place, the replica slots with the replica pool's copies
(:mod:`moonep.integrations.torchtitan_slots`).  Every rank computes the same number of rows whatever the
routing.  Routing stays torchtitan's; :func:`quantile_balancer` (a second override) swaps its sign-rule
expert-bias update for moonep's :class:`~moonep.balance.QuantileBalancer`.

What the integration cannot reproduce is refused when the model is built or parallelized, naming the
option: tensor parallelism (``parallelism.tensor_parallel_degree``, expert TP included), context parallelism,
pipeline parallelism, float8/MXFP8 experts converters and other inner-experts classes, another EP backend
(``moe_comm_backend`` other than ``"standard"``); ``compile.enable`` and ``debug.spmd_typechecking`` are
refused at the first forward (the model is built before they are visible).
"""
from __future__ import annotations

import dataclasses
import threading

import torch
from torch.distributed.tensor import DTensor
from torchtitan.config import override
from torchtitan.config.override import derive
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import (AllToAllTokenDispatcher, BaseEPTokenDispatcher,
                                                       LocalTokenDispatcher)

from ..errors import expect
from ..experts import default_pool
from ..layers.parallel import EPProvider
from ..runtime import init, local_runtime
from .torchtitan_slots import module_on_slots

# Inner-experts classes whose forward is ``(rows [R, D], counts [e]) -> [R, D]`` over ``[e, ...]`` parameters
# and nothing else (checked by exact class: a converter's subclass changes the GEMM and is refused).
SUPPORTED_EXPERTS = {GroupedExperts}
try:
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
    SUPPORTED_EXPERTS.add(GptOssGroupedExperts)
except ImportError:  # pragma: no cover - a torchtitan without GPT-OSS
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoonepDispatchMetadata:
    """What :meth:`MoonepTokenDispatcher.dispatch` hands to ``combine``: the step's
    :class:`moonep.Dispatched` ``h`` and its :class:`moonep.ExpertParallel` ``ep``."""

    h: object
    ep: object


_PROVIDERS: dict = {}
_LOCK = threading.Lock()


def _provider(ep_mesh, num_experts: int, device, opts: dict) -> EPProvider:
    """One :class:`EPProvider` per (EP mesh, E, options), shared by every layer: one runtime and one set of
    ExpertParallel buffers per model, whatever its depth.  ``ep_mesh=None`` (EP = 1): a one-rank runtime
    (each rank its own experts' rows, no process group)."""
    key = (id(ep_mesh), num_experts, device.type, tuple(sorted(opts.items())))
    with _LOCK:
        if key not in _PROVIDERS:
            rt = local_runtime(device) if ep_mesh is None else init(ep_mesh)
            _PROVIDERS[key] = (ep_mesh, EPProvider(rt, num_experts, **opts))  # the mesh kept alive with its id
        return _PROVIDERS[key][1]


class MoonepTokenDispatcher(BaseEPTokenDispatcher):
    """torchtitan's token-dispatcher interface over :class:`moonep.ExpertParallel`.

    ``dispatch`` returns moonep's rows: ``[cap, D]`` grouped by slot, this rank's ``epn`` home experts then
    ``epn`` replica slots, with ``counts`` int32 ``[2*epn]`` rows per slot (rows past ``counts.sum()`` are
    padding); the same ``cap`` and about the same ``counts.sum()`` on every rank.  Only
    :class:`MoonepRoutedExperts` knows which weights the replica slots need: a plain ``RoutedExperts`` fed
    ``2*epn`` counts for ``epn`` experts fails in its grouped GEMM instead of training wrongly.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        slack: float = 0.0           # a rank may receive (1+slack)*T/R rows, for fewer replicas
        align: int = 1               # each slot padded to a multiple of this many rows
        max_tokens: int | None = None  # static buffers for this many tokens per rank (None: grown as seen)
        transport: str = "auto"

    def __init__(self, config: Config):
        super().__init__(config)
        self.opts = dict(slack=config.slack, align=config.align, transport=config.transport)
        self.max_tokens = config.max_tokens
        self._wired = False
        self._eps: dict = {}

    def wire_meshes(self, *, ep_mesh) -> None:
        """Install the EP mesh (``None`` at EP = 1); moonep's runtime over it is built on first use."""
        self.ep_mesh, self._wired = ep_mesh, True

    def _ep(self, x: torch.Tensor, topk: int):
        prov = _provider(self.ep_mesh, self.num_experts, x.device, dict(self.opts, max_tokens=self.max_tokens))
        return prov.get(x.shape[0], topk, x.shape[1], x.dtype, x.device)

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """Args: ``x_TD [T, D]`` tokens, ``topk_scores_TK`` float ``[T, K]`` (applied in ``combine``),
        ``topk_expert_ids_TK`` int ``[T, K]``, ``num_local_tokens_per_expert_E [E]`` (unused: moonep plans
        from the ids).  Collective.  Returns ``(rows [cap, D] in x's dtype, counts int32 [2*epn], metadata)``."""
        del num_local_tokens_per_expert_E
        expect(x_TD.dim() == 2 and topk_expert_ids_TK.shape == topk_scores_TK.shape
               and topk_expert_ids_TK.shape[0] == x_TD.shape[0], "dispatch(x_TD, topk_scores_TK, "
               "topk_expert_ids_TK)", "[T, D], [T, K], [T, K]",
               [list(x_TD.shape), list(topk_scores_TK.shape), list(topk_expert_ids_TK.shape)])
        ep = self._ep(x_TD, topk_expert_ids_TK.shape[1])
        h = ep.dispatch(x_TD, topk_expert_ids_TK, topk_scores_TK)
        return h.tokens, h.cu_seqlens[1:] - h.cu_seqlens[:-1], MoonepDispatchMetadata(h=h, ep=ep)

    def combine(self, routed_output_RD, metadata, x_TD):
        """``routed_output_RD [cap, D]`` (row ``i``: the expert output of ``rows[i]``) -> ``[T, D]`` in
        ``x_TD``'s dtype: each token's score-weighted sum of its experts' outputs.  Collective."""
        expect(isinstance(metadata, MoonepDispatchMetadata), "metadata",
               "the MoonepDispatchMetadata of this dispatcher's dispatch", type(metadata).__name__)
        return metadata.ep.combine(routed_output_RD.to(x_TD.dtype), metadata.h)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class MoonepRoutedExperts(RoutedExperts):
    """``RoutedExperts`` whose experts compute moonep's slots: home rows with the inner experts' own
    parameters (their ``[epn, ...]`` local shards, read in place), replica rows with the replica pool's
    copies (:func:`moonep.experts.default_pool`, shared by every layer).  Same parameters, state-dict keys,
    sharding config and forward signature as ``RoutedExperts``."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        expect(type(self.inner_experts) in SUPPORTED_EXPERTS, "routed_experts.inner_experts",
               "GroupedExperts or GptOssGroupedExperts (float8/MXFP8 experts converters, fused-SwiGLU overrides "
               "and other experts classes are not supported by moonep.integrations.torchtitan)",
               type(self.inner_experts).__name__)
        expect(isinstance(self.token_dispatcher, MoonepTokenDispatcher), "routed_experts.token_dispatcher",
               "a MoonepTokenDispatcher.Config", type(self.token_dispatcher).__name__)

    def parallelize(self, parallel_dims) -> None:
        """Refuse what moonep cannot reproduce, then torchtitan's parallelization (the expert weights become
        ``Shard(0)`` DTensors over the EP mesh) and the mesh wiring."""
        for name, size in (("parallelism.tensor_parallel_degree (tensor and expert tensor parallelism)",
                            parallel_dims.tp), ("parallelism.context_parallel_degree", parallel_dims.cp),
                           ("parallelism.pipeline_parallel_degree", parallel_dims.pp)):
            expect(size == 1, name, "1 with moonep.integrations.torchtitan", size)
        super().parallelize(parallel_dims)

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        """Same contract as ``RoutedExperts.forward``: ``x_BLD [B, L, D]``, scores and ids ``[B, L, K]`` ->
        ``[B, L, D]``.  Collective over the EP mesh."""
        expect(not torch.compiler.is_compiling(), "compile.enable",
               "off for the model (or 'model' not in compile.components) with moonep.integrations.torchtitan",
               "torch.compile tracing a MoonepRoutedExperts")
        _refuse_typechecking()
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        rows, _, meta = self.token_dispatcher.dispatch(x_BLD.reshape(B * L, D), topk_scores_BLK.reshape(-1, K),
                                                       topk_expert_ids_BLK.reshape(-1, K),
                                                       num_local_tokens_per_expert_E)
        out = self.expert_rows(rows, meta)
        return self.token_dispatcher.combine(out, meta, x_BLD.reshape(B * L, D)).view(B, -1, D)

    def expert_rows(self, rows: torch.Tensor, meta: MoonepDispatchMetadata) -> torch.Tensor:
        """``rows [cap, D]`` -> ``[cap, D]``: the inner experts' forward on the home slots (own parameters) and
        on the replica slots (the pool's); collective (the replica fetch, and the gradient reduce)."""
        inner, pool = self.inner_experts, default_pool()
        names = [n for n, _ in inner.named_parameters(recurse=False)]
        homes = [_local(getattr(inner, n)) for n in names]
        reps = [pool.fetch(meta.ep, meta.h, w, f"torchtitan.{type(inner).__name__}.{n}") for n, w in zip(names, homes)]

        def fn(params, x, counts):
            return torch.func.functional_call(inner, params, (x, counts), strict=True)

        return module_on_slots(fn, rows, meta.h.cu_seqlens, names, homes, reps)


def _refuse_typechecking() -> None:
    try:
        import spmd_types as spmd
    except ImportError:  # pragma: no cover - torchtitan requires it
        return
    expect(not spmd.is_type_checking(), "debug.spmd_typechecking", "False with moonep.integrations.torchtitan",
           True)


_BACKENDS = (AllToAllTokenDispatcher.Config, LocalTokenDispatcher.Config)


def _convertible(cfg) -> None:
    """Refuse a ``RoutedExperts.Config`` the integration cannot run, naming the option that made it."""
    disp, inner = cfg.token_dispatcher, cfg.inner_experts
    kind = type(inner).__qualname__
    expect(type(inner) in {e.Config for e in SUPPORTED_EXPERTS}, "routed_experts.inner_experts",
           "GroupedExperts.Config or GptOssGroupedExperts.Config (no float8/MXFP8 experts converter, no "
           "fused-SwiGLU override)", kind)
    expect(type(disp) in _BACKENDS, "moe_comm_backend",
           '"standard" (moonep replaces its all-to-all; DeepEP, HybridEP, MinimalAsyncEP and the padded '
           "TorchAO dispatcher of a quantized-experts converter are refused)", type(disp).__qualname__)


@override(target=RoutedExperts.Config, description="moonep: balanced expert parallelism (replicas of hot experts)")
def moonep_experts(cfg: RoutedExperts.Config, *, slack: float = 0.0, align: int = 1, max_tokens: int | None = None,
                   transport: str = "auto") -> MoonepRoutedExperts.Config:
    """The override: ``cfg`` -> :class:`MoonepRoutedExperts.Config` with the same inner experts and sharding
    config, its dispatcher :class:`MoonepTokenDispatcher` (``slack``, ``align``, ``max_tokens``, ``transport``:
    :class:`moonep.ExpertParallel`'s)."""
    _convertible(cfg)
    disp = MoonepTokenDispatcher.Config(num_experts=cfg.token_dispatcher.num_experts,
                                        top_k=cfg.token_dispatcher.top_k, slack=float(slack), align=int(align),
                                        max_tokens=max_tokens, transport=transport)
    return derive(cfg, MoonepRoutedExperts.Config, token_dispatcher=disp)
