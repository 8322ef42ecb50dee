"""The search: enumerate, reject with reasons, bound, evaluate, rank, Pareto front.

    search(model, clusters, work, space) -> SearchResult

``clusters``: one cluster, several sizes of one GPU type, or a cluster of several GPU pools
(a PooledCluster: each pool's own search as below, then the pools stage, search.pools);
``work``: one length, or a length distribution (the expected step, cost.lengths, and the
data-aware bucket stage, search.buckets, after step 5).

Per cluster size:
  1. enumerate the declared space as columns (`space.enumerate_space`);
  2. vectorised constraints; each rejected row counted once under its first reason;
  3. model-state memory lower bound: rows that cannot fit even before activations are
     "out of memory" without a full estimate (`bounds`);
  4. `evaluate` the rest (vectorised, ``chunk`` rows per call), smallest micro-batch first:
     once a plan does not fit, the same plan with larger micro-batches is "out of memory"
     too (memory never decreases with micro_batch; see `bounds`). ``prune=False`` evaluates
     every row instead;
  5. rank the feasible rows (`result` documents the order) and take the Pareto front.
The top plans are re-estimated for their full CostReport (time breakdown for the explanation).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.cost import estimate, estimate_batch
from meshplan.cost.memory import usable_gib
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.uncertainty import risk_words
from meshplan.errors import MeshplanError
from meshplan.search.bounds import states_lower_bound_gib
from meshplan.search.columns import PlanColumns
from meshplan.search.constraints import (
    AT_RISK,
    LIKELY_OOM,
    COST_MODEL_REFUSED,
    HOST_OOM,
    NO_EXPORT_TARGET,
    OUT_OF_MEMORY,
    RUNTIME_CHECKS,
    VARIED_CP,
    first_violation,
    reason_names,
    violation_masks,
)
from meshplan.search.buckets import POOL, base_key, data_aware
from meshplan.search.evaluate import EXPOSED_TERMS, FLOAT_COLUMNS, empty_columns, evaluate
from meshplan.search.nearest import nearest_options
from meshplan.search.pareto import pareto_mask, usd_per_million_tokens
from meshplan.search.pools import SHORTLIST, budget_pools, merge_budgets, rank_over_pools
from meshplan.search.result import ClusterCount, ParetoPoint, RankedPlan, SearchResult, apply_deadline
from meshplan.search.sizes import MAX_GPUS
from meshplan.search.space import SearchSpace, enumerate_space
from meshplan.spec.axes import AX
from meshplan.spec.cluster import ClusterSpec, PooledCluster
from meshplan.spec.constraints import violations
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload, microbatches
from meshplan.spec.support import RULES, export_targets, runtime_violations
from meshplan.spec.transformer import as_graph
from meshplan.units import gib_need

Progress = Callable[[int, int], None]
Evaluator = Callable[[ModelSpec, ClusterSpec, Workload, PlanColumns, CostParams],
                     dict[str, np.ndarray]]
OBJECTIVES = ("time", "cost", "time-to-target")
"""time: step time; cost: dollars per million tokens; time-to-target: step time x the plan's
token-efficiency factor (cost.convergence: tokens its sync method needs relative to fully
synchronous training)."""


@dataclass
class _Scan:
    """One cluster size: candidates, why each was rejected, and the prices of the evaluated."""

    cluster: ClusterSpec
    cols: PlanColumns
    reason: np.ndarray
    """Index into reason_names() of each row's rejection; -1 = feasible; -2 = not decided yet."""
    todo: np.ndarray
    """Rows left for the cost model after constraints and the lower bound."""
    lower_bound: np.ndarray
    """Model-state lower bound on peak memory (GiB) where computed, else nan."""
    res: dict[str, np.ndarray]
    evaluated: int = 0


def _prepare(model: ModelSpec, cluster: ClusterSpec, work: Workload, space: SearchSpace,
             params: CostParams, timings: dict[str, float]) -> _Scan:
    t0 = time.perf_counter()
    cols = enumerate_space(model, cluster, work, space, params)
    n = cols.num_rows
    t1 = time.perf_counter()
    masks = violation_masks(model, cluster, work, cols, export_only=space.allow_export_only)
    reason = first_violation(masks, n)
    if work.varied and not space.buckets:  # no bucket stage: cp > 1 without a pipeline does not run
        cp, pp = np.asarray(cols[AX.CP]), np.asarray(cols[AX.PP])
        reason[(reason < 0) & (cp > 1) & (pp == 1)] = reason_names().index(VARIED_CP)
    reason[reason < 0] = -2
    ok = np.nonzero(reason == -2)[0]
    t2 = time.perf_counter()
    lb = np.full(n, np.nan)
    lb[ok] = states_lower_bound_gib(model, cols.take(ok), work, params)
    timings["enumerate_s"] += t1 - t0
    timings["constraints_s"] += t2 - t1
    timings["bounds_s"] += time.perf_counter() - t2
    oom_idx = reason_names().index(OUT_OF_MEMORY)
    reason[ok[lb[ok] > usable_gib(cluster, params)]] = oom_idx
    res = {"step_time_s": np.full(n, np.nan), "tokens_per_s": np.full(n, np.nan),
           "time_to_target_s": np.full(n, np.nan), "cross_site_gb": np.full(n, np.nan),
           "mfu": np.full(n, np.nan), "peak_memory_gib": np.full(n, np.nan), "oom_probability": np.full(n, np.nan),
           "dominant": np.full(n, "", dtype=object)}
    return _Scan(cluster, cols, reason, reason == -2, lb, res)


def _evaluate_scan(model: ModelSpec, work: Workload, scan: _Scan, params: CostParams, prune: bool,
                   chunk: int, tick: Callable[[int], None], evaluator: Evaluator, headroom: bool = True) -> None:
    """Price the rows left in ``scan`` (smallest micro-batch first when pruning). With
    ``headroom``, plans at risk of running out of memory are rejected as such (and, like those
    that do not fit, end the larger micro-batches of the same plan, whose memory is no less)."""
    names = reason_names()
    oom_idx, refused_idx = names.index(OUT_OF_MEMORY), names.index(COST_MODEL_REFUSED)
    risk_idx, host_idx, likely_idx = names.index(AT_RISK), names.index(HOST_OOM), names.index(LIKELY_OOM)
    group, rank = scan.cols.meta.get("group"), scan.cols.meta.get("mb_rank")
    if not prune or group is None or rank is None:
        group, rank = np.arange(scan.cols.num_rows), np.zeros(scan.cols.num_rows, dtype=np.int64)
    dead = np.zeros(int(group.max()) + 1 if len(group) else 0, dtype=bool)
    for r in np.unique(rank[scan.todo]):
        rows = np.nonzero(scan.todo & (rank == r))[0]
        skipped = rows[dead[group[rows]]]
        scan.reason[skipped] = oom_idx
        tick(len(skipped))
        rows = rows[~dead[group[rows]]]
        for start in range(0, len(rows), chunk):
            part = rows[start:start + chunk]
            out = evaluator(model, scan.cluster, work, scan.cols.take(part), params)
            for k in scan.res:
                scan.res[k][part] = out[k]
            priced = np.isfinite(out["step_time_s"])
            fits = out["fits"] & priced
            risky = fits & np.asarray(out.get("at_risk", np.zeros(len(part), dtype=bool))) & headroom
            host = fits & ~np.asarray(out.get("host_fits", np.ones(len(part), dtype=bool)))
            # a plan whose estimate is within the usable memory but whose chance of running out is 1/2 or more
            # (the codebase's measured bias pushes it over) is at risk, not "out of memory" (issue 29 edge 5);
            # like a does-not-fit plan no flag accepts it (cost.uncertainty)
            within = priced & ~fits & (np.asarray(out["peak_memory_gib"]) <= usable_gib(scan.cluster, params))
            reason = np.where(risky, risk_idx, np.where(within, likely_idx,
                              np.where(fits, -1, np.where(priced, oom_idx, refused_idx))))
            scan.reason[part] = np.where(host, host_idx, reason)
            # the larger micro-batches of a plan over the limit are over it too (counted so, unpriced); those of
            # a plan at risk are priced, since they may be at risk or over (the counts stay exact)
            dead[group[part[priced & ((~fits & ~within) | host)]]] = True
            scan.evaluated += len(part)
            tick(len(part))


def evaluate_lengths(model: ModelSpec, cluster: ClusterSpec, work: Workload, cols: PlanColumns,
                     params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """`evaluate` for a workload with varied sample lengths: the expected step of cost.lengths
    (its imbalance term counts towards ``dominant``)."""
    if cols.num_rows == 0:
        return empty_columns()
    r = estimate_batch(model, cluster, work, cols.plain(), params)
    names = (*EXPOSED_TERMS, "imbalance")
    terms = np.stack([np.asarray(r[f"time.{k}"], dtype=float) for k in names])
    out = {k: np.asarray(r[k], dtype=float) for k in FLOAT_COLUMNS}
    return out | {"fits": np.asarray(r["fits"], dtype=bool), "at_risk": np.asarray(r["at_risk"], dtype=bool),
                  "host_fits": np.asarray(r["host_fits"], dtype=bool),
                  "dominant": np.asarray(names)[np.argmax(terms, axis=0)]}


def checked_request(clusters: ClusterSpec | Sequence[ClusterSpec], objective: str, top: int) -> list[ClusterSpec]:
    """The clusters of a search request as a list, after checking the request's options."""
    if objective not in OBJECTIVES:
        raise MeshplanError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    if top < 1:
        raise MeshplanError(f"top must be >= 1; got {top}")
    clusters = [clusters] if isinstance(clusters, ClusterSpec) else list(clusters)
    if not clusters:
        raise MeshplanError("no cluster to search")
    for c in clusters:
        if c.num_gpus > MAX_GPUS:
            raise MeshplanError(f"cluster {c.name}: {c.num_gpus:,} GPUs is more than the search "
                                f"handles ({MAX_GPUS:,})", hint="search a smaller cluster")
    return clusters


def search(model: LayerGraph | ModelSpec, clusters: ClusterSpec | PooledCluster | Sequence[ClusterSpec],
           work: Workload, space: SearchSpace | None = None, *, params: CostParams = DEFAULT_PARAMS,
           objective: str = "time", top: int = 10, prune: bool = True,
           progress: Progress | None = None, chunk: int = 32768,
           evaluator: Evaluator = evaluate, deadline: tuple[float, float] | None = None) -> SearchResult:
    """Find the best plans for ``model`` on each of ``clusters`` (one or several sizes of one GPU
    type), or on a cluster of several GPU pools (a PooledCluster: the pools stage, search.pools).
    ``work`` is one length or a length distribution (then the data-aware bucket stage runs too,
    search.buckets, unless ``space.buckets`` is off).

    ``evaluator`` has the signature and contract of `meshplan.search.evaluate.evaluate` (the
    default); ``chunk`` is how many rows it receives per call. ``deadline``: (tokens to train,
    days): plans that take longer are rejected (`search.result.apply_deadline`; exact on one
    cluster size). A PooledCluster's ``max_gpus`` is a budget of GPUs in all
    (`search.pools.budget_pools`)."""
    if isinstance(clusters, PooledCluster):
        return _search_pools(model, clusters, work, space, params=params, objective=objective, top=top,
                             deadline=deadline)
    if not isinstance(clusters, ClusterSpec) and any(isinstance(c, PooledCluster) for c in clusters):
        # several GPU budgets of one cluster of pools: each searched, then merged (search.pools.merge_budgets)
        return merge_budgets([_search_pools(model, c, work, space, params=params, objective=objective, top=top,
                                            deadline=deadline) for c in clusters], top)
    t0 = time.perf_counter()
    clusters = checked_request(clusters, objective, top)
    space = space or SearchSpace()
    model = as_graph(model, work.seq_len)
    if work.varied and evaluator is evaluate:  # a length distribution: the expected step (cost.lengths)
        evaluator = evaluate_lengths
    timings = {"enumerate_s": 0.0, "constraints_s": 0.0, "bounds_s": 0.0}
    scans = [_prepare(model, c, work, space, params, timings) for c in clusters]
    total, done = sum(int(s.todo.sum()) for s in scans), 0

    def tick(k: int) -> None:
        nonlocal done
        done += k
        if progress is not None and k:
            progress(done, total)

    t1 = time.perf_counter()
    for s in scans:
        _evaluate_scan(model, work, s, params, prune, chunk, tick, evaluator, space.headroom)
    t2 = time.perf_counter()
    bucket_stage = work.varied and evaluator is evaluate_lengths and space.buckets
    result = _collect(model, work, scans, params, objective, max(top, POOL) if bucket_stage else top)
    result.passed_constraints = total  # what the progress bar counted: priced (evaluated) or over a memory bound
    result.headroom = space.headroom
    if bucket_stage:  # micro-batch and cp per length bucket, built from the best one-shape plans
        data_aware(result, params, top, _best_runnable_one_shape(scans, model, work, params, objective),
                   _base_pool(scans, work))
    timings |= {"evaluate_s": t2 - t1, "rank_s": time.perf_counter() - t2}
    if result.feasible == 0:
        result.nearest = nearest_options(model, max(clusters, key=lambda c: c.num_gpus), work,
                                         space, params)
    result.search_time_s = time.perf_counter() - t0
    result.timings = timings | {"nearest_s": result.search_time_s - sum(timings.values())}
    if deadline is not None:
        apply_deadline(result, *deadline)
    return result


def _search_pools(model: LayerGraph | ModelSpec, cluster: PooledCluster, work: Workload, space: SearchSpace | None,
                  *, params: CostParams, objective: str, top: int,
                  deadline: tuple[float, float] | None) -> SearchResult:
    """The search on a cluster of several pools: each pool's own search (the stages above: its
    shortlist of one-shape plans, and under a length distribution its data-aware stage, whose best
    may be a bucket plan on that pool alone), then the pools stage (search.pools.rank_over_pools)
    places replicas and pipeline stages over several pools and ranks every kind together.
    ``objective`` time-to-target ranks by step time (the sync methods are not searched over pools)."""
    t0 = time.perf_counter()
    objective = objective if objective in ("time", "cost") else "time"
    checked_request(list(cluster.pools), objective, top)
    graph = as_graph(model, work.seq_len)
    own = space or SearchSpace()
    no_buckets = dataclasses.replace(own, buckets=False)  # the shapes placed over several pools: one-shape plans
    pools = budget_pools(cluster)
    per_pool: dict[str, list[SearchResult]] = {}
    for pool in pools:
        runs = [search(graph, pool, work, no_buckets, params=params, objective=objective, top=SHORTLIST * 4)]
        if work.varied and own.buckets:  # bucket plans run on one GPU type: a pool alone may use them
            runs.append(search(graph, pool, work, own, params=params, objective=objective, top=1))
        per_pool[pool.name] = runs
    result = rank_over_pools(graph, cluster, work, per_pool, pools=pools, headroom=own.headroom,
                             params=params, objective=objective, top=top, deadline=deadline,
                             allow_export_only=own.allow_export_only)
    result.search_time_s = time.perf_counter() - t0
    return result


def _base_pool(scans: list[_Scan], work: Workload, most: int = 30) -> list[Plan]:
    """Under a length distribution: feasible plans without a pipeline that the runtime runs (or
    would, as a bucket plan), one per configuration of search.buckets' key, fastest first, on the
    largest cluster size: the bucket stage's candidate bases."""
    s = max(scans, key=lambda x: x.cluster.num_gpus)
    feas = np.nonzero(s.reason == -1)[0]
    pp, ep = np.asarray(s.cols[AX.PP])[feas], np.asarray(s.cols[AX.EP])[feas]
    rows = feas[(pp == 1) & (ep == 1)]
    out: list[Plan] = []
    seen: set[tuple] = set()
    for j in rows[np.argsort(s.res["step_time_s"][rows], kind="stable")]:
        plan = s.cols.plan(int(j))
        key = base_key(plan)
        if key in seen or plan.periodic:
            continue
        seen.add(key)
        out.append(plan)
        if len(out) == most:
            break
    return out


def _best_runnable_one_shape(scans: list[_Scan], model: ModelSpec, work: Workload, params: CostParams,
                             objective: str) -> RankedPlan | None:
    """Under a length distribution: the best feasible one-shape plan meshplan's runtime runs as
    planned (not cp > 1 without a pipeline, which it runs only as a bucket plan), by ``objective``
    ("cost" by dollars, which grow with time on one cluster size)."""
    key = "time_to_target_s" if objective == "time-to-target" else "step_time_s"
    best: tuple[float, _Scan, int] | None = None
    for s in scans:
        feas = np.nonzero(s.reason == -1)[0]
        if not len(feas):
            continue
        cp, pp = np.asarray(s.cols[AX.CP])[feas], np.asarray(s.cols[AX.PP])[feas]
        ok = feas[~((cp > 1) & (pp == 1))]
        for j in ok[np.argsort(s.res[key][ok])][:8]:  # the first the runtime runs as planned
            plan = s.cols.plan(int(j))
            if export_targets(plan, microbatches(work.global_batch, plan.dp, plan.micro_batch), model) is not None:
                continue
            v = float(s.res[key][j])
            if objective == "cost":
                v = float(_usd(s, np.asarray([j]), work)[0])
            if best is None or v < best[0]:
                best = (v, s, int(j))
            break
    return None if best is None else _ranked(0, best[1], best[2], model, work, params)


# ---- collecting ----------------------------------------------------------------------------

def _usd(scan: _Scan, rows: np.ndarray, work: Workload) -> np.ndarray:
    return usd_per_million_tokens(scan.cluster.num_gpus, scan.cluster.price_per_hour,
                                  scan.res["step_time_s"][rows], work.tokens)


def _collect(model: ModelSpec, work: Workload, scans: list[_Scan], params: CostParams,
             objective: str, top: int) -> SearchResult:
    names = reason_names()
    counts = np.zeros(len(names), dtype=np.int64)
    for s in scans:
        counts += np.bincount(s.reason[s.reason >= 0], minlength=len(names))
    feas = [np.nonzero(s.reason == -1)[0] for s in scans]
    which = np.concatenate([np.full(len(f), i) for i, f in enumerate(feas)]) if feas else np.zeros(0)
    rows = np.concatenate(feas) if feas else np.zeros(0, dtype=np.int64)
    pts = {
        "step_time_s": _gather(scans, feas, lambda s, r: s.res["step_time_s"][r]),
        "time_to_target_s": _gather(scans, feas, lambda s, r: s.res["time_to_target_s"][r]),
        "peak_memory_gib": _gather(scans, feas, lambda s, r: s.res["peak_memory_gib"][r]),
        "usd_per_mtok": _gather(scans, feas, lambda s, r: _usd(s, r, work)),
        "num_gpus": _gather(scans, feas, lambda s, r: np.full(len(r), s.cluster.num_gpus)),
    }
    method = _sync_method_rows(scans, which, rows)
    # each sync method a plan adds (compression; a periodic sync) must gain CostParams.sync_method_min_gain to rank above
    # the plan without it
    pts["rank_factor"] = (1.0 / (1.0 - params.sync_method_min_gain)) ** method
    result = SearchResult(
        model=model, clusters=[s.cluster for s in scans], work=work, objective=objective,
        plans=[], considered=sum(s.cols.num_rows for s in scans),
        evaluated=sum(s.evaluated for s in scans), feasible=len(rows),
        rejected={n: int(c) for n, c in zip(names, counts) if c}, search_time_s=0.0,
        pareto=[], points=pts)
    order = _rank(scans, which, rows, pts, objective, top)
    result.plans = [_ranked(i + 1, scans[which[j]], int(rows[j]), model, work, params)
                    for i, j in enumerate(order)]
    held = _held_back_method(scans, which, rows, pts, objective, order, method, params)
    if held:
        result.notes.append(held)
    # the other ranking (per step, or per token of progress) where the two differ
    other = "time" if objective == "time-to-target" else "time-to-target"
    if objective != "cost" and len(rows) and np.any(pts["time_to_target_s"] != pts["step_time_s"]):
        result.other_objective = other
        result.other_plans = [_ranked(i + 1, scans[which[j]], int(rows[j]), model, work, params)
                              for i, j in enumerate(_rank(scans, which, rows, pts, other, top))]
        result.best_synchronous = _best_synchronous(scans, which, rows, pts, model, work, params)
        result.best_per_step = _best_synchronous(scans, which, rows, pts, model, work, params, compressed=True)
    result.best_by_placement = _best_by_placement(scans, which, rows, pts, objective, model, work, params)
    result.pareto = _pareto(scans, which, rows, pts)
    result.reject_examples = _examples(model, work, scans, names, params)
    result.per_cluster = [_count(s, work) for s in scans]
    result.params = params
    result.passed_over = _passed_over(scans, names, result)
    return result


def _passed_over(scans: list[_Scan], names: list[str], result: SearchResult) -> dict[str, Any] | None:
    """The fastest at-risk plan, when it beats the recommended one."""
    k = names.index(AT_RISK)
    best: tuple[float, _Scan, int] | None = None
    for s in scans:
        prob = np.asarray(s.res["oom_probability"], dtype=float)
        hit = np.nonzero((s.reason == k) & ~(prob >= 0.5))[0]  # a flag accepts it
        if len(hit):
            t = s.res["step_time_s"][hit]
            j = int(hit[int(np.argmin(t))])
            if best is None or float(s.res["step_time_s"][j]) < best[0]:
                best = (float(s.res["step_time_s"][j]), s, j)
    if best is None or (result.best is not None and best[0] >= result.best.report.step_time_s):
        return None
    t, s, j = best
    return {"plan": s.cols.plan(j).short(), "step_time_s": t, "num_gpus": s.cluster.num_gpus,
            "peak_memory_gib": float(s.res["peak_memory_gib"][j]),
            "oom_probability": float(s.res["oom_probability"][j])}


def _gather(scans: list[_Scan], feas: list[np.ndarray], fn: Callable) -> np.ndarray:
    parts = [np.asarray(fn(s, r), dtype=float) for s, r in zip(scans, feas)]
    return np.concatenate(parts) if parts else np.zeros(0)


def _rank(scans: list[_Scan], which: np.ndarray, rows: np.ndarray, pts: dict[str, np.ndarray],
          objective: str, top: int) -> list[int]:
    """Indices into the feasible arrays of the top plans, in rank order."""
    if len(rows) == 0:
        return []
    obj = {"time": pts["step_time_s"], "cost": pts["usd_per_mtok"],
           "time-to-target": pts["time_to_target_s"]}[objective]
    obj = obj * pts.get("rank_factor", 1.0)  # sync methods need a meaningful gain (CostParams.sync_method_min_gain)
    keys = (pts["peak_memory_gib"], pts["num_gpus"], pts["step_time_s"], obj)  # last = first: result.rank_key
    order = np.lexsort(keys)
    kth = order[min(top, len(order)) - 1]
    last = min(top, len(order))
    while last < len(order) and all(k[order[last]] == k[kth] for k in keys):
        last += 1  # include every row tied with the k-th so the short() tie-break is complete
    head = order[:last].tolist()

    def short(j: int) -> str:
        return scans[which[j]].cols.plan(int(rows[j])).short()

    def axes(j: int) -> int:
        """Parallel dimensions beyond data parallelism: on an exact tie the simpler plan ranks first."""
        p = scans[which[j]].cols.plan(int(rows[j]))
        return sum(int(x > 1) for x in (p.tp, p.pp, p.cp, p.ep, p.virtual_stages))
    head.sort(key=lambda j: (obj[j], pts["step_time_s"][j], pts["num_gpus"][j], pts["peak_memory_gib"][j], axes(j),
                             short(j)))
    return head[:top]


def _sync_method_rows(scans: list[_Scan], which: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per feasible row, how many gradient-sync methods it uses (0 to 2): compression (bf16, fp8, powersgd), and
    a sync that is not every full gradient every step (local-sgd, diloco)."""
    out = np.zeros(len(rows), dtype=np.int64)
    for i, s in enumerate(scans):
        idx = np.nonzero(which == i)[0]
        gs = np.asarray(s.cols["grad_sync"])[rows[idx]]
        comp = np.asarray(s.cols["grad_compression"])[rows[idx]]
        out[idx] = (~np.isin(gs, ("auto", "all-reduce", "reduce-scatter"))).astype(np.int64) + (comp != "none")
    return out


def _held_back_method(scans: list[_Scan], which: np.ndarray, rows: np.ndarray, pts: dict[str, np.ndarray],
                      objective: str, order: list[int], method: np.ndarray, params: CostParams) -> str | None:
    """A note when the best plan by the objective alone uses more sync methods than the winner, for a gain below
    CostParams.sync_method_min_gain per method."""
    if not order or not method.any():
        return None
    obj = {"time": pts["step_time_s"], "cost": pts["usd_per_mtok"],
           "time-to-target": pts["time_to_target_s"]}[objective]
    w = order[0]
    j = int(np.argmin(np.where(method > method[w], obj, np.inf)))
    if not method[j] > method[w] or not obj[j] < obj[w]:
        return None
    plan = scans[which[j]].cols.plan(int(rows[j]))
    what = ",".join(f"{k}={v}" for k, v in (("grad_sync", plan.grad_sync), ("grad_compression", plan.grad_compression))
                    if v not in ("auto", "none"))
    unit = {"time": "per step", "cost": "in $ per token", "time-to-target": "to the target loss"}[objective]
    return (f"{what} ({plan.short()}) would be {100 * (1 - obj[j] / obj[w]):.2f}% faster {unit}"
            if objective != "cost" else
            f"{what} ({plan.short()}) would be {100 * (1 - obj[j] / obj[w]):.2f}% cheaper per token") + (
        f" than the winner: below the {100 * params.sync_method_min_gain:g}% each gradient-sync method (compression, "
        "a periodic sync) must gain to rank above a plan without it (CostParams.sync_method_min_gain)")


def _best_synchronous(scans: list[_Scan], which: np.ndarray, rows: np.ndarray, pts: dict[str, np.ndarray],
                      model: ModelSpec, work: Workload, params: CostParams,
                      compressed: bool = False) -> RankedPlan | None:
    """The fastest feasible plan that syncs every gradient every step uncompressed (grad_sync
    auto, all-reduce or reduce-scatter, no compression): the baseline weak-link plans beat; with
    ``compressed``, compressed ones too (by time to target)."""
    sync = np.zeros(len(rows), dtype=bool)
    for i, s in enumerate(scans):
        idx = np.nonzero(which == i)[0]
        gs = np.asarray(s.cols["grad_sync"])[rows[idx]]
        comp = np.asarray(s.cols["grad_compression"])[rows[idx]]
        sync[idx] = np.isin(gs, ("auto", "all-reduce", "reduce-scatter")) & ((comp == "none") | compressed)
    if not sync.any():
        return None
    cand = np.nonzero(sync)[0]
    j = int(cand[np.lexsort((pts["peak_memory_gib"][cand], pts["time_to_target_s"][cand]))[0]])
    return _ranked(0, scans[which[j]], int(rows[j]), model, work, params)


def _best_by_placement(scans: list[_Scan], which: np.ndarray, rows: np.ndarray, pts: dict[str, np.ndarray],
                       objective: str, model: ModelSpec, work: Workload, params: CostParams) -> dict[str, RankedPlan]:
    """Per placement tried (Plan.mesh_order as text, '' = the default), the best feasible plan by
    the objective among those a placement decides (pp > 1 and dp x cp > 1): the fair comparison
    of the orders (each with its own best mesh, schedule and micro-batch). {} when one order."""
    if len(rows) == 0:
        return {}
    orders = np.empty(len(rows), dtype=object)
    decides = np.zeros(len(rows), dtype=bool)
    for i, s in enumerate(scans):
        idx = np.nonzero(which == i)[0]
        r = rows[idx]
        orders[idx] = np.asarray(s.cols["mesh_order"])[r]
        decides[idx] = (np.asarray(s.cols[AX.PP])[r] > 1) & (
            np.asarray(s.cols[AX.DP])[r] * np.asarray(s.cols[AX.CP])[r] > 1)
    kinds = set(orders[decides].tolist())
    if len(kinds) < 2:
        return {}
    obj = {"time": pts["step_time_s"], "cost": pts["usd_per_mtok"],
           "time-to-target": pts["time_to_target_s"]}[objective]
    out = {}
    for o in sorted(kinds):
        cand = np.nonzero(decides & (orders == o))[0]
        j = int(cand[np.lexsort((pts["peak_memory_gib"][cand], obj[cand]))[0]])
        out[str(o)] = _ranked(0, scans[which[j]], int(rows[j]), model, work, params)
    return out


def _ranked(rank: int, scan: _Scan, row: int, model: ModelSpec, work: Workload,
            params: CostParams) -> RankedPlan:
    plan = scan.cols.plan(row)
    report = estimate(model, scan.cluster, plan, work, params)  # one length or the expected step (cost)
    usd = float(usd_per_million_tokens(plan.num_gpus, scan.cluster.price_per_hour,
                                       report.step_time_s, work.tokens))
    micro = microbatches(work.global_batch, plan.dp, plan.micro_batch)
    return RankedPlan(rank=rank, plan=plan, cluster=scan.cluster, report=report, usd_per_mtok=usd,
                      export_only=export_targets(plan, micro, model, scan.cluster))


def _pareto(scans: list[_Scan], which: np.ndarray, rows: np.ndarray,
            pts: dict[str, np.ndarray]) -> list[ParetoPoint]:
    """Front over (time, memory, $). Within one cluster size dollars grow with time, so a 2-D
    front per size is exact there; the 3-D filter then runs on the union of those fronts."""
    if len(rows) == 0:
        return []
    t, m, d = pts["step_time_s"], pts["peak_memory_gib"], pts["usd_per_mtok"]
    cand = []
    for i in range(len(scans)):
        idx = np.nonzero(which == i)[0]
        cand.append(idx[pareto_mask(np.stack([t[idx], m[idx]], axis=1))])
    cand_idx = np.concatenate(cand)
    keep = cand_idx[pareto_mask(np.stack([t[cand_idx], m[cand_idx], d[cand_idx]], axis=1))]
    keep = keep[np.lexsort((m[keep], t[keep]))]
    return [ParetoPoint(scans[which[j]].cols.plan(int(rows[j])), float(t[j]), float(m[j]), float(d[j]))
            for j in keep]


def _examples(model: ModelSpec, work: Workload, scans: list[_Scan], names: list[str],
              params: CostParams) -> dict[str, str]:
    """One message per rejection reason, from the first rejected row (for constraints: the
    predicate's own reason, which says how to fix it)."""
    out: dict[str, str] = {}
    for i, name in enumerate(names):
        for s in scans:
            hit = np.nonzero(s.reason == i)[0]
            if len(hit) == 0:
                continue
            if name == OUT_OF_MEMORY:
                out[name] = _oom_example(s, hit, params)
            elif name in (AT_RISK, LIKELY_OOM):
                out[name] = _at_risk_example(s, hit, params)
            elif name == HOST_OOM:
                plan = s.cols.plan(int(hit[0]))
                r = estimate(model, s.cluster, plan, work, params)
                c = s.cluster
                out[name] = (f"{plan.short()}: its offload needs {r.host_memory_gib:.0f} GiB of host memory per GPU, "
                             f"over the {c.host_memory_per_gpu_gib:.0f} GiB a GPU has ({c.host_memory_per_node_gib:,.0f} "
                             f"GiB per node over {c.gpus_per_node} GPUs: {c.host_memory_basis()}); offload less, "
                             "or shard more (zero=3, more GPUs)")
            elif name == COST_MODEL_REFUSED:
                out[name] = _refused_example(model, s, int(hit[0]), work, params)
            else:
                plan = s.cols.plan(int(hit[0]))
                out[name] = _message(name, model, s.cluster, plan, work)
            break
    return out


def _message(name: str, model: ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload) -> str:
    if name == VARIED_CP:
        return (f"{plan.short()}: cp={plan.cp} without a pipeline on samples of several lengths: meshplan train splits "
                "a micro-batch of its own width over cp ranks only under a bucket plan, which is not searched here "
                "(one GPU type per bucket plan)")
    if name == NO_EXPORT_TARGET:
        return _no_target_message(model, plan, work, cluster)
    if name in RUNTIME_CHECKS:
        reason = RULES[name].why(plan, microbatches(work.global_batch, plan.dp, plan.micro_batch), model)
        return f"{plan.short()}: {reason or name}"
    reasons = dict(violations(model, cluster, plan, work))
    return f"{plan.short()}: {reasons.get(name, name)}"


def _no_target_message(model: ModelSpec, plan: Plan, work: Workload, cluster: ClusterSpec | None = None) -> str:
    """The rules ``plan`` breaks, each with the export targets that run it as planned, and what
    keeps each of those targets from running the rest of the plan as planned (spec.export_limits)."""
    from meshplan.spec.export_limits import Ctx, limits
    from meshplan.spec.support import is_traced
    bad = runtime_violations(plan, microbatches(work.global_batch, plan.dp, plan.micro_batch), model)
    rules = "; ".join(f"{rule.name}: {' or '.join(rule.targets) or 'no target'}" for rule, _ in bad)
    common = [t for t in dict.fromkeys(t for rule, _ in bad for t in rule.targets)
              if all(t in rule.targets for rule, _ in bad)]
    if is_traced(model):
        tail = "; no export target takes a traced model"
    else:
        g = as_graph(model, work.seq_len)
        ctx = Ctx(num_layers=g.model.num_layers if g.model is not None else None, cluster=cluster)
        hits = [f"{t} does not run its {', '.join(limits(t, plan, ctx))}" for t in common]
        tail = f"; {'; '.join(hits)}" if hits else ""
    return (f"{plan.short()}: no export target runs it as planned (the targets that run each runtime rule it breaks "
            f"as planned: {rules}{tail}); drop the options behind the rules or settings the chosen target does not run")


def _oom_example(s: _Scan, hit: np.ndarray, params: CostParams) -> str:
    usable = usable_gib(s.cluster, params)
    peak = s.res["peak_memory_gib"][hit]
    if np.isfinite(peak).any():
        j = hit[np.nanargmin(np.where(np.isfinite(peak), peak, np.inf))]
        need = float(s.res["peak_memory_gib"][j])
        odds = (f" (within it, but a {100 * float(s.res['oom_probability'][j]):.0f}% chance of running out: this "
                "codebase's runs used more than the model predicts)" if need <= usable else "")  # pre-check rows
        return (f"closest to fitting on {s.cluster.num_gpus} GPUs: {s.cols.plan(int(j)).short()} "
                f"needs {gib_need(need, usable)}{odds}")
    lb = s.lower_bound[hit]
    j = hit[np.nanargmin(lb)]
    return (f"{s.cols.plan(int(j)).short()}: model states alone need {s.lower_bound[j]:.1f} GiB "
            f"per GPU of {usable:.1f} usable")


def _at_risk_example(s: _Scan, hit: np.ndarray, params: CostParams) -> str:
    """The at-risk plan closest to safe: its need, its chance of running out, and what accepts it (a
    chance of 1/2 or more: nothing does, the codebase's measured bias puts its peak over the limit)."""
    usable = usable_gib(s.cluster, params)
    prob = np.asarray(s.res["oom_probability"], dtype=float)[hit]
    peak = s.res["peak_memory_gib"][hit]
    key = np.where(np.isfinite(prob), prob, np.where(np.isfinite(peak), 1.0 + peak, np.inf))
    j = hit[int(np.argmin(key))]
    need, p = float(s.res["peak_memory_gib"][j]), float(s.res["oom_probability"][j])
    head = f"{s.cols.plan(int(j)).short()} needs {gib_need(need, usable)}"
    if np.isfinite(p) and p >= 0.5:
        return (f"{head}, but has a {100 * p:.0f}% chance of running out of memory: this codebase's runs used more "
                "than the model predicts (the memory model's out-of-sample errors), which puts it over the limit; "
                "no flag accepts such a plan")
    from meshplan.cost.uncertainty import risk_reason
    why = risk_reason(need, usable, p, params) if np.isfinite(p) else risk_words(params)
    return (f"{head}: {why} (from the memory model's out-of-sample errors); "
            "--max-oom-risk or --no-headroom accept such plans")


def _refused_example(model: ModelSpec, s: _Scan, row: int, work: Workload,
                     params: CostParams) -> str:
    plan = s.cols.plan(row)
    try:
        estimate(model, s.cluster, plan, work, params)
    except MeshplanError as e:
        return f"{plan.short()}: {e}"
    return plan.short()  # pragma: no cover - refused by evaluate, accepted by estimate


def _count(s: _Scan, work: Workload) -> ClusterCount:
    ok = np.nonzero(s.reason == -1)[0]
    if len(ok) == 0:
        return ClusterCount(s.cluster.num_gpus, s.cols.num_rows, 0, None, None)
    t = float(s.res["step_time_s"][ok].min())
    usd = float(usd_per_million_tokens(s.cluster.num_gpus, s.cluster.price_per_hour, t, work.tokens))
    return ClusterCount(s.cluster.num_gpus, s.cols.num_rows, len(ok), t, usd)
