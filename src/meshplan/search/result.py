"""SearchResult: ranked plans, counts, rejections, Pareto front, and its JSON form.

Ranking (deterministic): the objective (step time, or dollars per million tokens with
``objective="cost"``: the same order as dollars for a whole training run), then step time (the
time second: plans whose dollars tie, as every plan does at a price of 0, go to the faster), then
fewer GPUs, then lower peak memory per GPU, then the plan's ``short()`` string in plain
lexicographic (code point) order.

Also here, on results of the search (`driver.search`):
  * `apply_deadline`: reject the feasible plans that take longer than a deadline to train a
    number of tokens (reason `OVER_DEADLINE`);
  * `merge`: one result from the results of several cluster sizes searched one at a time.

Searching each size alone and merging gives the same top plans as one search of all sizes
(each of the overall top ``top`` is among the top ``top`` of its size), and makes a deadline
exact: on one cluster size, dollars are proportional to step time, so the plans of a size
that meet a deadline are a prefix of that size's ranking (`apply_deadline` on one size keeps
its best plans that meet it; the merge then takes the cheapest across sizes).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.cost.pools import PooledEstimate
from meshplan.cost.report import CostReport
from meshplan.search.pareto import pareto_mask
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
    export_only: tuple[str, ...] | None = None
    """None: meshplan's runtime runs the plan as planned. Else (listed only with
    --allow-export-only) the export targets that do (spec.support)."""

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "plan": to_dict(self.plan), "short": self.plan.short(),
                "num_gpus": self.plan.num_gpus, "usd_per_mtok": self.usd_per_mtok,
                "export_only": None if self.export_only is None else list(self.export_only),
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
    over_deadline: int = 0
    """Plans that fit but take longer than the deadline (`apply_deadline`)."""
    reason: str | None = None
    """Why no plan of this size is feasible, in a few words (set by the caller; None when
    some plan is)."""


@dataclass(frozen=True)
class PooledCount(ClusterCount):
    """Counts of the search of a cluster of several pools under one GPU budget (--gpus)."""

    used_gpus: int | None = None
    """The GPUs the budget's best plan uses (a plan may use fewer than the budget: e.g. one pool
    alone); None when no plan is feasible."""


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
    """Candidates priced with the full cost model (the rest were rejected before: by a constraint, or,
    among those that pass the constraints, by a memory bound)."""
    feasible: int
    """Candidates that satisfy every constraint and fit in memory."""
    rejected: dict[str, int]
    """Rejected candidates by first reason (sums to considered - feasible)."""
    search_time_s: float
    pareto: list[ParetoPoint]
    """Non-dominated plans over (step time, peak memory per GPU, dollars per million tokens),
    sorted by step time."""
    passed_constraints: int = -1
    """Candidates that pass every constraint (all sizes together): what the progress bar counts, each
    then priced by the cost model (``evaluated``) or ruled out by a memory bound. -1: not counted (pools)."""
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
    train_tokens: float | None = None
    """Tokens of the whole training run, when given (days and dollars to train)."""
    deadline_days: float | None = None
    """Days the training run may take (`apply_deadline`); None: no deadline."""
    passed_over: dict[str, Any] | None = None
    """The fastest plan that fits but was not recommended for its risk of running out of memory,
    when it is faster than the winner: plan, step_time_s, peak_memory_gib, oom_probability."""
    params: Any = None
    """The CostParams the search priced with (profile, calibration, memory policy)."""
    headroom: bool = True
    """False with --no-headroom: plans at risk of running out of memory were listed too."""
    fastest: ParetoPoint | None = None
    """With a deadline: the fastest feasible plan before the deadline was applied (what the
    fastest plan would take when none meets it)."""
    other_objective: str | None = None
    """Where some plan's token-efficiency factor is not 1: the other ranking's objective (time
    per step, or time to target)."""
    other_plans: list[RankedPlan] = field(default_factory=list)
    """The top plans by ``other_objective``."""
    best_synchronous: RankedPlan | None = None
    """Where weak-link methods were searched: the fastest plan that syncs every gradient every
    step uncompressed (the baseline for the cross-site traffic and the time to target)."""
    best_per_step: RankedPlan | None = None
    """... and the soonest to target that syncs every step, compressed or not."""
    best_by_placement: dict[str, RankedPlan] = field(default_factory=dict)
    """Where the search tried several placements (clusters of several sites): per placement
    ('' = the default order), the best feasible plan whose placement decides which axis crosses
    the slow tier (a pipeline and data or context parallelism both > 1)."""
    data_aware: dict[str, Any] | None = None
    """Under a length distribution: the bucket plans tried (search.buckets): bases, candidates,
    fitting, the best bucket plan and the best one-shape plan."""
    # ---- a cluster of several GPU pools (the pools stage, search.pools) ----
    pooled_plans: list[PooledEstimate] | None = None
    """On a cluster of several pools (``clusters`` is that one PooledCluster): the fitting plans of
    every kind (one pool alone, replicas on pools, stages on pools), best first, each priced by
    cost.pools with every rank on its own pool's hardware. None on a cluster of one GPU type."""
    alone: dict[str, PooledEstimate | None] = field(default_factory=dict)
    """The best plan on each pool alone (None: nothing fits there)."""
    best_multi: PooledEstimate | None = None
    """The best plan that uses more than one pool (whether or not it wins)."""
    best_by_kind: dict[str, PooledEstimate | None] = field(default_factory=dict)
    """The best fitting plan of each kind: 'replicas on pools' (pool_dp), 'stages on pools' (pool_pp)."""
    explanation: list[str] = field(default_factory=list)
    """On pools: what each pool does in the winner and why it wins (search.pools.explain)."""

    @property
    def best(self) -> RankedPlan | None:
        return self.plans[0] if self.plans else None

    @property
    def pooled(self) -> bool:
        """Whether this is the search of a cluster of several pools (``pooled_plans``)."""
        return self.pooled_plans is not None

    @property
    def best_pooled(self) -> PooledEstimate | None:
        """On pools: the winner (the first of ``pooled_plans``)."""
        return self.pooled_plans[0] if self.pooled_plans else None

    def pooled_json(self) -> dict[str, Any]:
        """The --json document of a search over pools."""
        pc = self.clusters[0]
        best = self.best_pooled
        return {"cluster": pc.name, "pools": [p.name for p in pc.pools],
                "objective": self.objective, "considered": self.considered, "search_time_s": self.search_time_s,
                "best": best.to_dict() if best else None,
                "best_multi_pool": self.best_multi.to_dict() if self.best_multi else None,
                "alone": {k: (v.to_dict() if v else None) for k, v in self.alone.items()},
                "best_by_kind": {k: (v.to_dict() if v else None) for k, v in self.best_by_kind.items()},
                "plans": [p.to_dict() for p in self.pooled_plans or ()], "explanation": list(self.explanation)}

    def to_json(self, *, timing: bool = True) -> dict[str, Any]:
        """The --json document. ``timing=False`` drops search_time_s (for comparing runs)."""
        if self.pooled:
            return self.pooled_json()
        doc: dict[str, Any] = {
            "model": self.model.name, "clusters": [c.name for c in self.clusters],
            "gpu": self.clusters[0].gpu.name if self.clusters else None,
            "global_batch": self.work.global_batch, "seq_len": self.work.seq_len,
            "optimizer": self.work.optimizer, "objective": self.objective,
            "plans": [p.to_dict() for p in self.plans],
            "considered": self.considered, "passed_constraints": self.passed_constraints,
            "evaluated": self.evaluated, "feasible": self.feasible, "rejected": dict(self.rejected),
            "reject_examples": dict(self.reject_examples),
            "search_time_s": self.search_time_s,
            "pareto": [p.to_dict() for p in self.pareto],
            "per_cluster": [vars(c) for c in self.per_cluster],
            "nearest": list(self.nearest), "notes": list(self.notes),
            "train_tokens": self.train_tokens, "deadline_days": self.deadline_days,
            "passed_over_for_memory_risk": self.passed_over,
            "no_headroom": not self.headroom,
        }
        if self.other_objective is not None:
            doc["other_ranking"] = {"objective": self.other_objective,
                                    "plans": [p.to_dict() for p in self.other_plans]}
        if self.best_synchronous is not None:
            doc["best_synchronous"] = self.best_synchronous.to_dict()
        if self.best_per_step is not None:
            doc["best_per_step_sync"] = self.best_per_step.to_dict()
        if self.best_by_placement:
            doc["best_by_placement"] = {k or "default": v.to_dict() for k, v in self.best_by_placement.items()}
        if self.data_aware is not None:
            doc["data_aware"] = {k: v for k, v in self.data_aware.items() if timing or k != "time_s"}
        if self.deadline_days is not None:
            doc["fastest_ignoring_deadline"] = self.fastest.to_dict() if self.fastest is not None else None
        if timing:
            doc["timings"] = dict(self.timings)
        else:
            doc.pop("search_time_s")
        return doc


# ---- deadline -------------------------------------------------------------------------------

OVER_DEADLINE = "over the deadline"
"""Rejection reason of `apply_deadline`: fits, but training takes longer than the deadline."""


def train_days(step_time_s: Any, tokens_per_step: float, train_tokens: float) -> Any:
    """Days to train ``train_tokens`` tokens at ``step_time_s`` per step of ``tokens_per_step``
    tokens (works on arrays)."""
    return np.asarray(step_time_s, dtype=float) * (train_tokens / tokens_per_step) / 86400.0


def rank_key(p: RankedPlan, objective: str) -> tuple[float, float, int, float, str]:
    """The ranking order of the search (module docstring)."""
    obj = {"time": p.report.step_time_s, "cost": p.usd_per_mtok,
           "time-to-target": p.report.time_to_target_s}[objective]
    return (obj, p.report.step_time_s, p.plan.num_gpus, p.report.peak_memory_gib, p.plan.short())


def apply_deadline(result: SearchResult, train_tokens: float, deadline_days: float) -> SearchResult:
    """Reject (in place) the feasible plans of ``result`` that take more than ``deadline_days``
    days to train ``train_tokens`` tokens: counted under `OVER_DEADLINE`, dropped from the
    plans, the Pareto front, the points and the per-size counts. Exact on a result of one
    cluster size (module docstring); on several sizes, the plans kept are those of the top
    that meet the deadline (search sizes one at a time and `merge` for the exact top)."""
    if not (train_tokens > 0 and deadline_days > 0):
        raise ValueError("train_tokens and deadline_days must be positive")
    tps = result.work.tokens

    def over(t: Any) -> Any:
        return train_days(t, tps, train_tokens) > deadline_days

    result.train_tokens, result.deadline_days = train_tokens, deadline_days
    if result.pareto:  # sorted by step time: the first is the fastest feasible plan
        result.fastest = result.pareto[0]
    t = np.asarray(result.points.get("step_time_s", np.zeros(0)), dtype=float)
    mask = over(t) if len(t) else np.zeros(0, dtype=bool)
    n_over = int(mask.sum())
    # The example: the over-deadline plan closest to meeting it, among those with a Plan at hand.
    late = [(p.report.step_time_s, p.plan) for p in result.plans if over(p.report.step_time_s)]
    late += [(p.step_time_s, p.plan) for p in result.pareto if over(p.step_time_s)]
    result.plans = [dataclasses.replace(p, rank=i + 1)
                    for i, p in enumerate(p for p in result.plans if not over(p.report.step_time_s))]
    result.pareto = [p for p in result.pareto if not over(p.step_time_s)]
    if n_over == 0:
        return result
    result.feasible -= n_over
    result.rejected[OVER_DEADLINE] = result.rejected.get(OVER_DEADLINE, 0) + n_over
    if late:
        st, plan = min(late, key=lambda x: (x[0], x[1].short()))
        result.reject_examples[OVER_DEADLINE] = (
            f"{plan.short()} on {plan.num_gpus:,} GPUs: {float(train_days(st, tps, train_tokens)):,.1f} days "
            f"to train {token_count(train_tokens)} tokens, over the {deadline_days:g}-day deadline")
    else:
        st = float(t[mask].min())
        result.reject_examples[OVER_DEADLINE] = (
            f"the fastest of them takes {float(train_days(st, tps, train_tokens)):,.1f} days to train "
            f"{token_count(train_tokens)} tokens, over the {deadline_days:g}-day deadline")
    gpus = np.asarray(result.points.get("num_gpus", np.zeros(len(t))))
    usd = np.asarray(result.points.get("usd_per_mtok", np.full(len(t), np.nan)))
    result.points = {k: np.asarray(v)[~mask] for k, v in result.points.items()}
    counts = []
    for c in result.per_cluster:
        here = gpus == c.num_gpus
        n = int((mask & here).sum())
        if n == 0:
            counts.append(c)
            continue
        keep = here & ~mask
        best_t = float(t[keep].min()) if keep.any() else None
        best_usd = float(usd[keep].min()) if keep.any() else None
        counts.append(dataclasses.replace(c, feasible=c.feasible - n, over_deadline=c.over_deadline + n,
                                          best_step_time_s=best_t, best_usd_per_mtok=best_usd))
    result.per_cluster = counts
    return result


def token_count(n: float) -> str:
    """A token count for sentences: 2T, 300B, 1.5T, 1,000T (no exponent)."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            v = n / div
            return (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}") + unit
    return f"{n:g}"


# ---- several cluster sizes --------------------------------------------------------------------

def empty_result(model: Any, cluster: ClusterSpec, work: Workload, objective: str, reason: str) -> SearchResult:
    """The result of a cluster size that could not be searched at all (``reason``: why)."""
    return SearchResult(model=model, clusters=[cluster], work=work, objective=objective, plans=[],
                        considered=0, evaluated=0, feasible=0, rejected={}, search_time_s=0.0, pareto=[],
                        per_cluster=[ClusterCount(cluster.num_gpus, 0, 0, None, None, reason=reason)])


def merge(results: Sequence[SearchResult], top: int) -> SearchResult:
    """One result from the results of single cluster sizes (in size order), as one search of
    all the sizes gives: the top ``top`` plans over all, summed counts, the first example of
    each reason, the 3-D Pareto front of the union of the fronts, and the nearest options of
    the largest size when nothing is feasible."""
    if not results:
        raise ValueError("nothing to merge")
    if len(results) == 1:
        return results[0]
    if all(r.pooled for r in results):
        return _merge_pooled(results, top)
    first = results[0]
    objective = first.objective
    plans = sorted((p for r in results for p in r.plans), key=lambda p: rank_key(p, objective))[:top]
    plans = [dataclasses.replace(p, rank=i + 1) for i, p in enumerate(plans)]
    front = [p for r in results for p in r.pareto]
    if front:
        pts = np.asarray([[p.step_time_s, p.peak_memory_gib, p.usd_per_mtok] for p in front], dtype=float)
        front = [p for p, keep in zip(front, pareto_mask(pts)) if keep]
        front.sort(key=lambda p: (p.step_time_s, p.peak_memory_gib))
    rejected: dict[str, int] = {}
    examples: dict[str, str] = {}
    timings: dict[str, float] = {}
    notes: list[str] = []
    for r in results:
        for k, v in r.rejected.items():
            rejected[k] = rejected.get(k, 0) + v
        for k, v in r.reject_examples.items():
            examples.setdefault(k, v)
        for k, v in r.timings.items():
            timings[k] = timings.get(k, 0.0) + v
        notes += [n for n in r.notes if n not in notes]
    with_points = [r for r in results if r.points]  # a size that could not be searched has none
    keys = [k for k in (with_points[0].points if with_points else {}) if all(k in r.points for r in with_points)]
    points = {k: np.concatenate([np.asarray(r.points[k]) for r in with_points]) for k in keys}
    feasible = sum(r.feasible for r in results)
    largest = max(results, key=lambda r: max(c.num_gpus for c in r.clusters))
    fastest = [r.fastest for r in results if r.fastest is not None]
    passed = [r.passed_over for r in results if r.passed_over]
    top_time = plans[0].report.step_time_s if plans else float("inf")
    passed = [po for po in passed if po["step_time_s"] < top_time]
    return SearchResult(
        model=first.model, clusters=[c for r in results for c in r.clusters], work=first.work,
        objective=objective, plans=plans, considered=sum(r.considered for r in results),
        evaluated=sum(r.evaluated for r in results), feasible=feasible, rejected=rejected,
        passed_constraints=sum(max(0, r.passed_constraints) for r in results),
        search_time_s=sum(r.search_time_s for r in results), pareto=front, reject_examples=examples,
        per_cluster=[c for r in results for c in r.per_cluster],
        nearest=list(largest.nearest) if feasible == 0 else [], points=points, notes=notes,
        timings=timings, train_tokens=first.train_tokens, deadline_days=first.deadline_days,
        fastest=min(fastest, key=lambda p: (p.step_time_s, p.peak_memory_gib)) if fastest else None,
        passed_over=min(passed, key=lambda po: po["step_time_s"]) if passed else None, params=first.params,
        headroom=first.headroom)


def pooled_key(e: PooledEstimate, objective: str) -> tuple:
    """The ranking order of plans over pools: dollars per token with objective cost, else step
    time; then step time (dollars that tie go to the faster); then fewer GPUs; then the plan string."""
    first = e.usd_per_m_tokens if objective == "cost" else e.step_time_s
    return (first, e.step_time_s, e.num_gpus, e.plan.short())


def _merge_pooled(results: Sequence[SearchResult], top: int) -> SearchResult:
    """Searches of one cluster of several pools under several GPU budgets (--gpus): the winning
    budget's result (its explanation, its best plan on each pool alone and over several pools),
    with the top ``top`` distinct plans over every budget, summed counts and one count per budget."""
    objective = results[0].objective

    def best_key(r: SearchResult) -> tuple:
        b = r.best_pooled
        return (0, *pooled_key(b, objective)) if b is not None else (1,)
    win = min(results, key=best_key)
    seen: set[str] = set()
    plans = []
    for e in sorted((e for r in results for e in r.pooled_plans or ()), key=lambda e: pooled_key(e, objective)):
        if e.plan.short() not in seen:
            seen.add(e.plan.short())
            plans.append(e)
    out = dataclasses.replace(win, pooled_plans=plans[:top])
    if win.best_pooled is None:  # nothing anywhere: the largest budget speaks for all
        out = dataclasses.replace(max(results, key=lambda r: r.clusters[0].num_gpus), pooled_plans=[])
    # the best on each pool alone, over several pools and of each kind: over every budget (the
    # explanation, search.pools.merge_budgets, is of these, as is the table)

    def best_of(es: Sequence[PooledEstimate | None]) -> PooledEstimate | None:
        es = [e for e in es if e is not None]
        return min(es, key=lambda e: pooled_key(e, objective)) if es else None
    names = list(dict.fromkeys(k for r in results for k in r.alone))
    out.alone = {k: best_of([r.alone.get(k) for r in results]) for k in names}
    out.best_multi = best_of([r.best_multi for r in results])
    kinds = list(dict.fromkeys(k for r in results for k in r.best_by_kind))
    out.best_by_kind = {k: best_of([r.best_by_kind.get(k) for r in results]) for k in kinds}
    front = {p.plan.short(): p for r in results for p in r.pareto}
    if front:  # the front of every budget's plans (the --plot figure)
        fs = list(front.values())
        keep = pareto_mask(np.asarray([[p.step_time_s, p.peak_memory_gib, p.usd_per_mtok] for p in fs], dtype=float))
        out.pareto = sorted((p for p, k in zip(fs, keep) if k), key=lambda p: (p.step_time_s, p.peak_memory_gib))
    with_points = [r for r in results if r.points]
    keys = [k for k in (with_points[0].points if with_points else {}) if all(k in r.points for r in with_points)]
    out.points = {k: np.concatenate([np.asarray(r.points[k]) for r in with_points]) for k in keys}
    out.considered = sum(r.considered for r in results)
    out.evaluated = sum(r.evaluated for r in results)
    out.feasible = sum(r.feasible for r in results)
    out.search_time_s = sum(r.search_time_s for r in results)
    out.per_cluster = [c for r in results for c in r.per_cluster]
    rejected: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in results:
        for k, v in r.rejected.items():
            rejected[k] = rejected.get(k, 0) + v
        for k, v in r.reject_examples.items():
            examples.setdefault(k, v)
    out.rejected, out.reject_examples = rejected, examples
    return out
