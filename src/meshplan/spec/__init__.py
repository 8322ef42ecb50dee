"""Specs: what is trained (ModelSpec), on what (ClusterSpec), how (Plan), how much (Workload)."""
from meshplan.spec.cluster import ClusterSpec, GPUSpec, LinkTier
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload, parse_plan

__all__ = ["ClusterSpec", "GPUSpec", "LinkTier", "ModelSpec", "Plan", "Workload", "parse_plan"]
