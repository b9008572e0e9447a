"""Model layers on top of ExpertParallel: LatentMoE, SiTU-GLU, the two-micro-batch overlap schedule, and the
QuantileBalancer step."""
from .activations import SiTUGLU, situ_glu
from .latent_moe import LatentMoE
from .overlap import two_batch_moe
from .parallel import balancer_step

__all__ = ["LatentMoE", "SiTUGLU", "situ_glu", "balancer_step", "two_batch_moe"]
