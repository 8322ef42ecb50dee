"""The cost model: estimate(model, cluster, plan, workload) -> CostReport. Pure, no torch."""
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.report import CostReport
from meshplan.cost.step import check, estimate

__all__ = ["CostParams", "CostReport", "DEFAULT_PARAMS", "check", "estimate"]
