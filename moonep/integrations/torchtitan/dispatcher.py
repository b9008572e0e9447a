"""torchtitan's token-dispatcher interface over :class:`moonep.ExpertParallel` (one runtime and one set of
buffers per EP mesh, shared by every layer)."""
from __future__ import annotations

import dataclasses
import threading

import torch
from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher

from ...errors import expect
from ...layers.parallel import EPProvider
from ...runtime import init, local_runtime


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
