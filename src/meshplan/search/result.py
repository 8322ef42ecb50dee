"""SearchResult: ranked plans, counts, rejections, Pareto front, and its JSON form.

Ranking (deterministic): the objective (step time, or dollars per million tokens with
``objective="cost"``), then fewer GPUs, then lower peak memory per GPU, then the plan's
``short()`` string in plain lexicographic (code point) order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.cost.report import CostReport
from meshplan.spec.base import to_dict
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload


@dataclass(frozen=True)
class RankedPlan:
    """One plan of the ranking with its full cost report."""

    rank: int
    """1 = best."""
    plan: Plan
    cluster: ClusterSpec
    report: CostReport
    usd_per_mtok: float
    """Dollars per million trained tokens on this plan's cluster."""

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "plan": to_dict(self.plan), "short": self.plan.short(),
                "num_gpus": self.plan.num_gpus, "usd_per_mtok": self.usd_per_mtok,
                "cost": self.report.to_dict()}


@dataclass(frozen=True)
class ParetoPoint:
    plan: Plan
    step_time_s: float
    peak_memory_gib: float
    usd_per_mtok: float

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.short(), "num_gpus": self.plan.num_gpus,
                "step_time_s": self.step_time_s, "peak_memory_gib": self.peak_memory_gib,
                "usd_per_mtok": self.usd_per_mtok}


@dataclass(frozen=True)
class ClusterCount:
    """Counts of the search on one cluster size."""

    num_gpus: int
    considered: int
    feasible: int
    best_step_time_s: float | None
    best_usd_per_mtok: float | None


@dataclass
class SearchResult:
    model: ModelSpec
    clusters: list[ClusterSpec]
    work: Workload
    objective: str
    plans: list[RankedPlan]
    """The top plans, best first."""
    considered: int
    """Candidate plans enumerated (all cluster sizes together)."""
    evaluated: int
    """Candidates priced with the full cost model (the rest were rejected before)."""
    feasible: int
    """Candidates that satisfy every constraint and fit in memory."""
    rejected: dict[str, int]
    """Rejected candidates by first reason (sums to considered - feasible)."""
    search_time_s: float
    pareto: list[ParetoPoint]
    """Non-dominated plans over (step time, peak memory per GPU, dollars per million tokens),
    sorted by step time."""
    reject_examples: dict[str, str] = field(default_factory=dict)
    """One example message per rejection reason (what was wrong and how to fix it)."""
    per_cluster: list[ClusterCount] = field(default_factory=list)
    nearest: list[str] = field(default_factory=list)
    """When nothing is feasible: the nearest feasible options, as sentences."""
    points: dict[str, np.ndarray] = field(default_factory=dict)
    """Every feasible candidate: step_time_s, peak_memory_gib, usd_per_mtok, num_gpus (plots)."""
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    """Wall seconds by phase: enumerate_s, constraints_s, bounds_s, evaluate_s, rank_s, nearest_s."""

    @property
    def best(self) -> RankedPlan | None:
        return self.plans[0] if self.plans else None

    def to_json(self, *, timing: bool = True) -> dict[str, Any]:
        """The --json document. ``timing=False`` drops search_time_s (for comparing runs)."""
        doc: dict[str, Any] = {
            "model": self.model.name, "clusters": [c.name for c in self.clusters],
            "gpu": self.clusters[0].gpu.name if self.clusters else None,
            "global_batch": self.work.global_batch, "seq_len": self.work.seq_len,
            "objective": self.objective,
            "plans": [p.to_dict() for p in self.plans],
            "considered": self.considered, "evaluated": self.evaluated,
            "feasible": self.feasible, "rejected": dict(self.rejected),
            "reject_examples": dict(self.reject_examples),
            "search_time_s": self.search_time_s,
            "pareto": [p.to_dict() for p in self.pareto],
            "per_cluster": [vars(c) for c in self.per_cluster],
            "nearest": list(self.nearest), "notes": list(self.notes),
        }
        if timing:
            doc["timings"] = dict(self.timings)
        else:
            doc.pop("search_time_s")
        return doc
