"""moonep as torchtitan's expert-parallel backend (torchtitan 0.3.x), chosen through torchtitan's overrides.

    --override.imports moonep.integrations.torchtitan.moonep_experts            # on the train command line
    --override.imports 'moonep.integrations.torchtitan.moonep_experts={"slack": 0.1}'

replaces every ``RoutedExperts`` of the model by :class:`MoonepRoutedExperts`: the same module (its inner
experts, their ``w1/w2/w3`` DTensors and state-dict keys, its sharding config) whose token dispatcher is
:class:`MoonepTokenDispatcher` and whose inner experts compute every slot moonep delivers: the home slots
with their own parameters, in place, the replica slots with the replica pool's copies
(:mod:`moonep.integrations.torchtitan.slots`).  Every rank computes the same number of rows whatever the
routing.  Routing stays torchtitan's; the option

    --override.imports moonep.integrations.torchtitan.moonep_experts,moonep.integrations.torchtitan.quantile_balancer

swaps its sign-rule expert-bias update for moonep's :class:`~moonep.balance.QuantileBalancer`
(:mod:`moonep.integrations.torchtitan.balance`).

What the integration cannot reproduce is refused when the model is built or parallelized, naming the
option: tensor parallelism (``parallelism.tensor_parallel_degree``, expert TP included), context parallelism,
pipeline parallelism, an SPMD backend other than ``partial_dtensor``, float8/MXFP8 experts converters and
other inner-experts classes, another EP backend (``moe_comm_backend`` other than ``"standard"``);
``compile.enable`` and ``debug.spmd_typechecking`` are refused at the first forward (the model is built
before they are visible), and so is a CUDA graph capture (``--training.disable_cuda_graphs``, which
torchtitan itself demands for EP > 1).
"""
from __future__ import annotations

from torchtitan.config import override
from torchtitan.config.override import derive
from torchtitan.models.common.moe import RoutedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

from ...errors import expect
from .balance import QuantileBalancedRouter
from .dispatcher import MoonepDispatchMetadata, MoonepTokenDispatcher
from .experts import SUPPORTED_EXPERTS, MoonepRoutedExperts

__all__ = ["moonep_experts", "quantile_balancer", "QuantileBalancedRouter", "MoonepRoutedExperts",
           "MoonepTokenDispatcher", "MoonepDispatchMetadata", "SUPPORTED_EXPERTS"]


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


@override(target=TokenChoiceTopKRouter.Config, description="moonep: QuantileBalancer expert-bias update")
def quantile_balancer(cfg: TokenChoiceTopKRouter.Config, *, bins: int = 1000,
                      ema: float = 0.0) -> QuantileBalancedRouter.Config:
    """The option: ``cfg`` -> :class:`QuantileBalancedRouter.Config` (the same router; its expert bias from
    moonep's QuantileBalancer with ``bins`` and ``ema``)."""
    expect(cfg.num_expert_groups is None, "router.num_expert_groups",
           "None with moonep's quantile balancer (group-limited routing is not balanced by it)",
           cfg.num_expert_groups)
    return derive(cfg, QuantileBalancedRouter.Config, bins=int(bins), ema=float(ema))
