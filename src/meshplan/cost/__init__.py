"""The cost model: estimate(model, cluster, plan, workload) -> CostReport (one GPU pool) or
PooledEstimate (several). One entry point, dispatching down cost/'s layers (cost.step). Pure, no torch."""
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.pools import PooledEstimate
from meshplan.cost.report import CostReport
from meshplan.cost.step import check, estimate, estimate_batch, lengths_summary

__all__ = ["CostParams", "CostReport", "DEFAULT_PARAMS", "PooledEstimate", "check", "estimate", "estimate_batch",
           "lengths_summary"]
