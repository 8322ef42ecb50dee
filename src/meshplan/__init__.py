"""meshplan: find, estimate, simulate and run parallel training plans.

Planning (spec, cost, search, sim) needs only the standard library and numpy;
only ``meshplan.runtime`` and ``meshplan.ingest`` import torch, lazily.
"""
from meshplan.errors import MeshplanError

__version__ = "0.1.0"
__all__ = ["MeshplanError", "__version__"]
