"""moonep models inside PyTorch's training tools: DDP, FSDP2, accumulation, clipping, checkpoints.

A model holding moonep layers (``LatentMoE``, or a model patched by ``patch_hf_moe`` / ``patch_generic``)
trains as the unpatched model does, with these rules (``docs/training.md`` has a recipe for each):

* :func:`prepare` once, before wrapping (``patch_hf_moe`` and ``patch_generic`` call it): DDP then leaves
  the expert shards and moonep's buffers alone, and the replicated state is checked to agree across ranks.
* DDP and FSDP2 average the replicated gradients; expert gradients arrive complete and averaged.  Without
  a wrapper, :func:`sync_grads` averages the replicated ones.
* FSDP2: :func:`fully_shard_experts`, then ``fully_shard`` of the blocks and the root.
* Clipping: :func:`clip_grad_norm_` (one global norm, the same on every rank).
* Checkpoints: ``torch.distributed.checkpoint`` as is (expert shards are DTensors); :func:`full_state_dict`
  for a single-file checkpoint of the unpatched model's layout.
"""
from .checkpoint import full_state_dict
from .fsdp import fully_shard_experts
from .grads import clip_grad_norm_, sync_grads
from .params import expert_parameters, prepare, replicated_parameters
from .sharding import expert_mesh, local_experts

__all__ = ["prepare", "expert_parameters", "replicated_parameters", "sync_grads", "clip_grad_norm_",
           "fully_shard_experts", "full_state_dict", "expert_mesh", "local_experts"]
