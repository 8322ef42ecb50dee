"""Specs: what is trained (ModelSpec), on what (ClusterSpec), how (Plan), how much (Workload).

The names below load their modules on first use, so that importing one light module of the
package (``meshplan.spec.axes``: the axis names) does not import the rest."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshplan.spec.cluster import ClusterSpec, GPUSpec, LinkTier
    from meshplan.spec.model import ModelSpec
    from meshplan.spec.plan import Plan, Workload, parse_plan

_HOMES = {"ClusterSpec": "cluster", "GPUSpec": "cluster", "LinkTier": "cluster", "ModelSpec": "model",
          "Plan": "plan", "Workload": "plan", "parse_plan": "plan"}

__all__ = ["ClusterSpec", "GPUSpec", "LinkTier", "ModelSpec", "Plan", "Workload", "parse_plan"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'meshplan.spec' has no attribute {name!r}")
    return getattr(importlib.import_module(f"meshplan.spec.{home}"), name)
