"""SiTU-GLU: the bounded gated activation of the LatentMoE routed experts (BRIEF section 3).

    situ(g, u) = b1*tanh(g/b1) * sigmoid(g) * b2*tanh(u/b2),   b1 = 4, b2 = 25

Each factor is bounded (|b1 tanh| < b1, sigmoid < 1, |b2 tanh| < b2), so every coordinate satisfies
``|situ| < b1*b2 = 100`` whatever the input: one expert can never blow a token up. Near zero
``b*tanh(x/b) = x + O(x^3)``, so it matches SwiGLU ``g*sigmoid(g)*u`` to first order.
"""
from __future__ import annotations

import torch

BETA1 = 4.0
BETA2 = 25.0


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta1: float = BETA1, beta2: float = BETA2) -> torch.Tensor:
    """Elementwise SiTU-GLU.

    Args:
        g: gate pre-activation ``[..., F]``, any float dtype.
        u: up pre-activation, same shape and dtype as ``g``.
    Returns:
        ``[..., F]`` in the input dtype, every coordinate strictly inside ``(-beta1*beta2, beta1*beta2)``.
    """
    return (beta1 * torch.tanh(g / beta1)) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))


def situ_glu_fused(gu: torch.Tensor, beta1: float = BETA1, beta2: float = BETA2) -> torch.Tensor:
    """SiTU-GLU of a fused projection: ``gu`` ``[..., 2F]`` holds ``g`` then ``u``; returns ``[..., F]``."""
    g, u = gu.chunk(2, dim=-1)
    return situ_glu(g, u, beta1, beta2)


class SiTUGLU(torch.nn.Module):
    """Module form of :func:`situ_glu_fused` (input ``[..., 2F]``, output ``[..., F]``)."""

    def __init__(self, beta1: float = BETA1, beta2: float = BETA2):
        super().__init__()
        self.beta1, self.beta2 = float(beta1), float(beta2)

    def forward(self, gu: torch.Tensor) -> torch.Tensor:
        return situ_glu_fused(gu, self.beta1, self.beta2)

    def extra_repr(self) -> str:
        return f"beta1={self.beta1}, beta2={self.beta2}"
