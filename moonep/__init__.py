"""moonep: balanced expert-parallel dispatch/combine for Mixture-of-Experts models.

The data path, one module per stage:
    routing -> plan (planner/) -> layout (layout.py) -> transport (transport/) -> experts -> combine (ep.py)
"""
from .balance import QuantileBalancer
from .ep import Dispatched, ExpertParallel
from .errors import MoonepError
from .layers import LatentMoE
from .planner import Plan, plan_balanced
from .runtime import Runtime, init

__all__ = ["init", "Runtime", "MoonepError", "plan_balanced", "Plan", "ExpertParallel", "Dispatched",
           "QuantileBalancer", "LatentMoE"]
__version__ = "0.1.0"
