"""``MoonepRoutedExperts``: torchtitan's ``RoutedExperts`` computing moonep's slots (home and replica rows)."""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

from ...errors import expect
from ...experts import default_pool
from .dispatcher import MoonepDispatchMetadata, MoonepTokenDispatcher
from .slots import module_on_slots

# Inner-experts classes whose forward is ``(rows [R, D], counts [e]) -> [R, D]`` over ``[e, ...]`` parameters
# and nothing else (checked by exact class: a converter's subclass changes the GEMM and is refused).
SUPPORTED_EXPERTS = {GroupedExperts}
try:
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
    SUPPORTED_EXPERTS.add(GptOssGroupedExperts)
except ImportError:  # pragma: no cover - a torchtitan without GPT-OSS
    pass


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
        # the backend tested with moonep (the others: spmd_types' FSDP2 needs a newer torch than 2.13 at >1 rank,
        # full_dtensor is not covered by moonep's tests yet)
        expect(parallel_dims.spmd_backend == "partial_dtensor", "parallelism.spmd_backend",
               '"partial_dtensor" with moonep.integrations.torchtitan', repr(parallel_dims.spmd_backend))
        super().parallelize(parallel_dims)

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        """Same contract as ``RoutedExperts.forward``: ``x_BLD [B, L, D]``, scores and ids ``[B, L, K]`` ->
        ``[B, L, D]``.  Collective over the EP mesh."""
        expect(not torch.compiler.is_compiling(), "compile.enable",
               "off for the model (or 'model' not in compile.components) with moonep.integrations.torchtitan",
               "torch.compile tracing a MoonepRoutedExperts")
        _refuse_typechecking()
        expect(not (x_BLD.is_cuda and torch.cuda.is_current_stream_capturing()), "training.disable_cuda_graphs",
               "True with moonep.integrations.torchtitan (torchtitan refuses CUDA graphs for EP > 1 itself)",
               "a CUDA graph capturing a MoonepRoutedExperts")
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
        reps = pool.fetch(meta.ep, meta.h, list(homes), [f"torchtitan.{type(inner).__name__}.{n}" for n in names])

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
