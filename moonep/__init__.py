"""moonep: balanced expert-parallel dispatch/combine for Mixture-of-Experts models.

The data path, one module per stage:
    routing -> plan (planner/) -> layout (layout.py) -> transport (transport/) -> experts -> combine (ep.py)
"""
from .errors import MoonepError
from .runtime import Runtime, init
from .balance import QuantileBalancer  # noqa: F401  (issue 7)

__all__ = ["init", "Runtime", "MoonepError"]
__version__ = "0.1.0"
