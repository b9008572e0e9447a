"""Adapters that run existing MoE blocks' experts through moonep expert parallelism."""
from .generic import patch_generic, softmax_topk
from .hf import EPExperts, patch_hf_moe

__all__ = ["patch_generic", "softmax_topk", "patch_hf_moe", "EPExperts"]
