"""Model layers on top of ExpertParallel: LatentMoE, SiTU-GLU, and expert-sharding helpers."""
from .activations import SiTUGLU, situ_glu
from .latent_moe import LatentMoE
from .parallel import balancer_step, full_state_dict, load_full_state_dict, sync_grads

__all__ = ["LatentMoE", "SiTUGLU", "situ_glu", "balancer_step", "full_state_dict", "load_full_state_dict",
           "sync_grads"]
