"""torchtitan's own training entry point (``torchtitan.train.main``), also on torch 2.13 and on CPU ranks.

    torchrun --nproc-per-node 2 -m tests.harness.torchtitan_train --module deepseek_v3 \\
        --config deepseek_v3_debugmodel --override.imports \\
        tests.harness.torchtitan_train.cpu_attention_flexattention,moonep.integrations.torchtitan.moonep_experts

Everything after the module name is torchtitan's command line.  Importing this module patches torchtitan and
torch in its process (it is meant for processes of its own), before ``main()`` runs, for only what stands in
the way.  On every machine:

* torch 2.13 has no ``torch.distributed.set_timeout``, which torchtitan 0.3 calls after the first step: its
  private equivalent stands in.

Without CUDA (torchtitan's trainer assumes an accelerator):

* the device: torchtitan picks ``"cuda"`` when it sees no accelerator; here ``"cpu"``, with a stand-in for
  the handful of ``torch.cuda`` calls its trainer and memory monitor make (no memory statistics on CPU);
* gloo reduces with neither ``AVG`` nor ``PREMUL_SUM``: FSDP2 sums and divides afterwards (the same
  gradients);
* attention: FlexAttention and varlen have no CPU backward in torch; the overrides
  ``cpu_attention_flexattention`` and ``cpu_attention_varlenattention`` (list them in ``--override.imports``)
  swap them for torchtitan's causal ``ScaledDotProductAttention`` (documents are then not masked apart: a
  difference of the model, the same for every EP backend compared).
"""
from __future__ import annotations

import inspect
import sys
import types

import torch


def _cpu_device_module() -> types.SimpleNamespace:
    """What torchtitan calls on ``torch.cuda``, answered for the CPU."""
    noop = lambda *a, **k: None  # noqa: E731
    return types.SimpleNamespace(
        set_device=noop, current_device=lambda: 0, device_count=lambda: 1, synchronize=noop, empty_cache=noop,
        reset_peak_memory_stats=noop, memory_stats=lambda *a, **k: {}, get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 40), is_available=lambda: True,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed)


def patch_torch_2_13() -> None:
    """``torch.distributed.set_timeout`` (torchtitan 0.3 calls it; torch 2.13 has it as ``_set_pg_timeout``)."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)


def patch_for_cpu() -> None:
    """Point torchtitan at the CPU (before its modules copy ``device_type``) and make FSDP2 sum on gloo."""
    import torchtitan.tools.utils as tu

    tu.device_type, tu.device_module = "cpu", _cpu_device_module()
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    original = fc._get_gradient_divide_factors
    sig = inspect.signature(original)

    def sum_then_divide(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.arguments["force_sum_reduction_for_comms"] = True  # gloo has no AVG / PREMUL_SUM
        return original(*bound.args, **bound.kwargs)

    fc._get_gradient_divide_factors = sum_then_divide


def _register_cpu_attention() -> None:
    from torchtitan.config import override
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    for target in (FlexAttention, VarlenAttention):
        def swap(cfg, _target=target):
            return ScaledDotProductAttention.Config()

        swap.__name__ = swap.__qualname__ = f"cpu_attention_{target.__name__.lower()}"
        swap.__module__ = __name__
        globals()[swap.__name__] = override(target=target.Config, description="CPU: causal SDPA")(swap)


def main(argv=None) -> None:
    """``torchtitan.train.main()`` with ``argv`` (default: this process's arguments) as its command line."""
    from torchtitan.train import main as train_main

    sys.argv = [sys.argv[0]] + list(sys.argv[1:] if argv is None else argv)
    train_main()


if __name__ == "__main__":  # run as `-m`: the work happens in the module imported by name (registered once)
    from tests.harness import torchtitan_train

    torchtitan_train.main()
else:  # patched on import: before any torchtitan module copies its device
    patch_torch_2_13()
    if not torch.cuda.is_available():
        patch_for_cpu()
    _register_cpu_attention()
