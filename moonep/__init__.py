"""moonep: balanced expert-parallel dispatch/combine for Mixture-of-Experts models.

The data path, one module per stage:
    routing (ep.py checks) -> plan (planner/) -> layout (layout.py) -> transport (backends/, transport/)
    -> experts (experts.py: ReplicaPool, expert_matmul, slot_matmul) -> combine (combine.py, backends/)
"""
from .balance import QuantileBalancer
from .config import Tuning
from .ep import ExpertParallel
from .errors import MoonepError
from .experts import ReplicaPool, Replicas, expert_bias, expert_matmul, module_slots, slot_apply, slot_matmul
from .handles import Dispatched
from .layers import LatentMoE
from . import ops  # noqa: F401,E402  registers the custom ops (torch.ops.moonep.*) that compiled code runs
from . import ops_async  # noqa: F401,E402  and their asynchronous forms (moonep::<op>_async, moonep::wait_work)
from .planner import Plan, plan_balanced
from .runtime import Runtime, init
from .work import Work

__all__ = ["init", "Runtime", "MoonepError", "plan_balanced", "Plan", "ExpertParallel", "Dispatched", "Tuning",
           "slot_matmul", "slot_apply", "ReplicaPool", "Replicas", "expert_matmul", "expert_bias", "module_slots", "QuantileBalancer", "LatentMoE", "Work"]
__version__ = "0.1.0"
