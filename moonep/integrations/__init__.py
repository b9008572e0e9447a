"""Adapters that run existing MoE blocks' experts through moonep expert parallelism, exactly or not at all.

* :func:`patch_hf_moe`: transformers MoE models (fused experts modules), every type checked at patch time.
* :func:`patch_generic`: user-written blocks with an ``experts`` ModuleList and their own routing.
"""
from .generic import patch_generic, softmax_topk
from .hf import EPExperts, find_moe_modules, fused_expert_maths, patch_hf_moe

__all__ = ["patch_generic", "softmax_topk", "patch_hf_moe", "EPExperts",
           "find_moe_modules", "fused_expert_maths"]
