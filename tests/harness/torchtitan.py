"""torchtitan's MoE models built as its trainer builds them, on CPU (gloo) or CUDA ranks, for moonep's tests.

``build(model, ep, moonep=...)`` runs what ``torchtitan.trainer.Trainer`` runs before training: the model
registry's config, ``update_from_config``, the override mechanism (``moonep_experts`` when asked), a build on
the meta device, the model's own ``parallelize_fn`` (EP sharding, FSDP2) and ``init_weights``.  What differs
on CPU, and why:

* torchtitan picks ``"cuda"`` when no accelerator is visible; its mesh is built here on the ranks' device.
* Its language-model attention backends (FlexAttention, varlen) have no CPU backward in torch; on CPU both
  models of a comparison use torchtitan's causal ``ScaledDotProductAttention`` instead (GPT-OSS's attention
  sinks, applied by those backends, are then left out of both).  The MoE layers are untouched.
* gloo has no ``PREMUL_SUM``: FSDP2 reduces by ``SUM`` and divides afterwards (the same gradients).
* ``torchtitan.trainer`` imports its data stack (datasets, pyarrow, tensorboard: hundreds of MB) and
  ``update_from_config`` imports it only to ask whether its argument is a ``Trainer.Config``; where that
  stack is absent, a stand-in module answers "no" (the model-only path torchtitan documents for
  non-trainer callers).
"""
from __future__ import annotations

import importlib
import sys
import types

import torch

MODELS = {  # name -> (torchtitan.models module, debug flavor)
    "deepseek_v3": ("deepseek_v3", "debugmodel"),
    "qwen3_moe": ("qwen3", "debugmodel_moe"),
    "gpt_oss": ("gpt_oss", "debugmodel"),
    "kimi_k2": ("kimi_k2_7", "debugmodel"),
}
OVERRIDE = "moonep.integrations.torchtitan.moonep_experts"


def _trainer_stand_in() -> None:
    try:
        import torchtitan.trainer  # noqa: F401
    except ImportError:
        mod = types.ModuleType("torchtitan.trainer")
        mod.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})
        sys.modules["torchtitan.trainer"] = mod


_DIMS: dict = {}


def parallel_dims(ep: int, world: int, backend: str, device: torch.device):
    """torchtitan's ``ParallelDims`` (meshes built, on ``device``'s type), one per configuration: building
    meshes creates process groups (collective), so every model of a test shares them."""
    import torchtitan.distributed.parallel_dims as pd_mod
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import utils as dist_utils

    key = (ep, world, backend)
    if key not in _DIMS:
        pd_mod.device_type = device.type
        par = ParallelismConfig(expert_parallel_degree=ep, spmd_backend=backend)
        dims = pd_mod.ParallelDims.from_config(par, world)
        dims.build_mesh()
        _DIMS[key] = (par, dims)
    dist_utils.set_spmd_backend(backend)
    return _DIMS[key]


def model_config(name: str, parallelism, device: torch.device, overrides=()):
    """The debug config of ``name`` (see :data:`MODELS`), updated for ``parallelism`` and with
    ``overrides`` (``override.imports`` entries) applied, as the trainer does."""
    from torchtitan.config.override import OverrideConfig, apply_overrides

    _trainer_stand_in()
    module, flavor = MODELS[name]
    spec = importlib.import_module(f"torchtitan.models.{module}").model_registry(flavor)
    cfg = spec.model
    if device.type == "cpu":
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in list(cfg.layers) + list(getattr(cfg, "mtp_layers", [])):
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    if overrides:
        apply_overrides(OverrideConfig(imports=list(overrides)), cfg)
    return spec, cfg


def build(name: str, ep: int, *, moonep=False, backend: str = "partial_dtensor", param_dtype: str = "bfloat16",
          device=None, world: int | None = None):
    """torchtitan's ``name`` debug model at expert-parallel degree ``ep`` over all ranks, FSDP2 over the rest.

    Args:
        moonep: ``False`` (torchtitan's all-to-all dispatcher), ``True`` or a dict of the override's kwargs.
        param_dtype: FSDP2's ``training.mixed_precision_param`` (``"bfloat16"`` or ``"float32"``).
    Returns ``(model, parallel_dims, spec)``; the weights are random: copy them between models to compare.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig

    device = torch.device(device or "cpu")
    world = world or dist.get_world_size()
    par, dims = parallel_dims(ep, world, backend, device)
    overrides = [] if moonep is False else [OVERRIDE if moonep is True else (OVERRIDE, dict(moonep))]
    spec, cfg = model_config(name, par, device, overrides)
    with torch.device("meta"):
        model = cfg.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param=param_dtype),
                                parallelism=par, compile_config=CompileConfig(), ac_config=None,
                                dump_folder="/tmp")
    if device.type == "cpu":
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train(), dims, spec
