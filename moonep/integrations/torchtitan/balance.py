"""moonep's QuantileBalancer as torchtitan's expert-bias update (an option: the ``quantile_balancer`` override).

torchtitan routes with ``top-K(scores + expert_bias_E)`` and, in an optimizer pre-step hook, moves
``expert_bias_E`` by ``load_balance_coeff * sign(mean load - load)``.  :class:`QuantileBalancedRouter` keeps
that routing and replaces only the bias: each training forward records the step's margins into a
:class:`~moonep.balance.QuantileBalancer` (pooled over every rank), and the first training forward after an
optimizer step sets the balancer's new bias and writes it into ``expert_bias_E`` (overwriting the sign rule's
update, which still runs).  ``expert_bias_E`` stays the state torchtitan checkpoints; a resumed run starts
its balancer from it.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torchtitan.models.common.moe import TokenChoiceTopKRouter

from ...balance import QuantileBalancer
from ...errors import expect

_STEPS = [0]  # optimizer steps taken in this process (a global step post-hook counts them)
_HOOK: list = []


def _count_step(*_args, **_kwargs) -> None:
    _STEPS[0] += 1


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class QuantileBalancedRouter(TokenChoiceTopKRouter):
    """torchtitan's token-choice top-K router whose expert bias comes from moonep's QuantileBalancer.

    Config: the router's own fields, plus ``bins`` and ``ema`` (:class:`~moonep.balance.QuantileBalancer`'s).
    Needs ``moe.load_balance_coeff`` set (``expert_bias_E`` exists) and no group-limited routing
    (``num_expert_groups``: the balancer's cutoff is the (K+1)-th score over all experts).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        bins: int = 1000
        ema: float = 0.0

    def __init__(self, config: Config):
        super().__init__(config)
        expect(config.num_expert_groups is None, "router.num_expert_groups",
               "None with moonep's quantile balancer (group-limited routing is not balanced by it)",
               config.num_expert_groups)
        self.bins, self.ema = config.bins, config.ema
        self.balancer: QuantileBalancer | None = None  # built on the scores' device at the first forward
        self._seen_steps = _STEPS[0]
        if not _HOOK:
            _HOOK.append(register_optimizer_step_post_hook(_count_step))

    def _balancer(self, bias: torch.Tensor) -> QuantileBalancer:
        if self.balancer is None:  # not a submodule: its state is expert_bias_E, which torchtitan checkpoints
            qb = QuantileBalancer(self.num_experts, self.top_k, bins=self.bins, ema=self.ema, device=bias.device)
            with torch.no_grad():
                qb.bias.copy_(bias)  # a resumed run goes on from the checkpointed bias
            object.__setattr__(self, "balancer", qb)
        return self.balancer

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        """torchtitan's router with ``expert_bias_E`` set from the balancer first; records when training.
        Collective (the balancer's step) at the first training forward after each optimizer step."""
        expect(expert_bias_E is not None, "moe.load_balance_coeff", "set (the quantile balancer writes its bias "
               "into the MoE's expert_bias_E)", None)
        bias = _local(expert_bias_E)
        qb = self._balancer(bias)
        if self.training and self._seen_steps != _STEPS[0]:
            qb.step()  # pools the last step's margins over the ranks and sets the new bias
            self._seen_steps = _STEPS[0]
        with torch.no_grad():
            bias.copy_(qb.bias)
        scores_TK, ids_TK, scores_BLE = super().forward(x_BLD, expert_bias_E)
        if self.training:
            s = _local(scores_BLE).detach()
            qb.route(s.reshape(-1, s.shape[-1]).float())  # records the margins; its selection is torchtitan's
        return scores_TK, ids_TK, scores_BLE
