"""Model layers on top of ExpertParallel: LatentMoE, SiTU-GLU, and the QuantileBalancer step."""
from .activations import SiTUGLU, situ_glu
from .latent_moe import LatentMoE
from .parallel import balancer_step

__all__ = ["LatentMoE", "SiTUGLU", "situ_glu", "balancer_step"]
