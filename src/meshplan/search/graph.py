"""Plan search on a general layer graph (issue 5).

    search_graph(graph, clusters, work, space=None, *, params=None, objective="time", top=10)
        -> SearchResult   (the same result the transformer search returns; the plan views,
                           explain() and SearchResult.to_json() print it)

Per cluster size, the candidates (`GraphSpace` documents each dimension's values):

  tp              the degrees every TP-able layer allows (graph.tp_degrees) that divide the node
  pp              divisors of N/tp up to the number of layers;  dp = N/(tp pp)
  zero            0..3, hybrid shard groups spanning 1, 2, 4 nodes, optimizer/parameter offload
                  (search.space.zero_options, as the transformer search)
  micro_batch     divisors of B/dp
  recompute       none, full
  schedule, v     pp = 1: 1f1b; pp > 1: gpipe, 1f1b, zero-bubble, zbv (v = 2), interleaved-1f1b
                  (v = 2..max_virtual_stages)
  stage split     v = 1: the dynamic-programming split of search.stages over the real per-layer
                  times of the candidate (forward + backward + recompute + exposed TP
                  communication at its tp and micro-batch; embeddings pinned to the first
                  stage, heads and the loss to the last), as explicit Plan.stage_layers; with
                  ``even_stages`` also the even split by layer count. v > 1: the even split
                  into pp x v chunks (Plan.stage_layers cannot name a chunked split).

Every candidate passes `meshplan.cost.graph.graph_violations` (counted under its first reason
otherwise) and the search-only zero-bubble rule, then is priced by the graph cost model
(`cost.graph.finish`, vectorised over the ZeRO/offload variants of one layout) and counted
"out of memory" when it does not fit. Ranking, Pareto front, rejection examples and the
nearest feasible options (when nothing fits) are those of the transformer search.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from meshplan.cost.graph import (
    GRAPH_CHECKS,
    GraphArrays,
    LayerCosts,
    Layout,
    StageSums,
    estimate_graph,
    finish,
    graph_arrays,
    graph_violations,
    layer_costs,
    make_layout,
    stage_sums,
    unsupported_reason,
)
from meshplan.cost.memory import usable_gib
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.errors import MeshplanError
from meshplan.search.constraints import AT_RISK, OUT_OF_MEMORY
from meshplan.search.driver import checked_request
from meshplan.search.nearest import Corner, growth_limit, larger_memory_gpus, next_size
from meshplan.search.pareto import pareto_mask, usd_per_million_tokens
from meshplan.search.result import ClusterCount, ParetoPoint, RankedPlan, SearchResult
from meshplan.search.sizes import nice_sizes, node_size, resized
from meshplan.search.space import check_space, divisors, micro_batch_values, schedule_options, zero_options
from meshplan.search.stages import split_layers
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.plan import SCHEDULES, Plan, Workload, microbatches
from meshplan.spec.support import RULES, runtime_violations
from meshplan.units import gib_need

GRAPH_RECOMPUTE = ("none", "full")
REASONS = [*GRAPH_CHECKS, *RULES, OUT_OF_MEMORY, AT_RISK]
"""Rejection reasons, in counting order (a candidate counts under its first): the graph's
constraints, the runtime's rules (spec.support), memory, headroom."""
_OOM = REASONS.index(OUT_OF_MEMORY)
_RISK = REASONS.index(AT_RISK)
_ZERO2_PP = REASONS.index("zero=2 under a pipeline")


@dataclass(frozen=True, kw_only=True)
class GraphSpace:
    """What to enumerate on a layer graph. None means the module docstring's default."""

    base: Plan = field(default_factory=lambda: Plan(p2p_sharded=False))
    """Fields not searched (precision, fused_loss, async_tp, p2p_sharded, grad_sync) come from here.
    p2p_sharded=False by default: with no sequence parallelism on a layer graph, the runtime's
    pipeline sends carry whole activations (spec.support)."""
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    micro_batch: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = SCHEDULES
    recompute: tuple[str, ...] = GRAPH_RECOMPUTE
    max_virtual_stages: int = 4
    hybrid_nodes: tuple[int, ...] = (1, 2, 4)
    offload: bool = True
    offload_only: bool = False
    """Only the offload variants (`search.space.zero_options`; ``offload`` must be True)."""
    even_stages: bool = False
    """Also try the even split by layer count (v = 1; the dynamic-programming split is always tried)."""
    headroom: bool = True
    """Reject plans at risk of running out of memory (search.constraints.AT_RISK)."""

    def __post_init__(self) -> None:
        check_space(self, "graph search space", ("tp", "pp", "micro_batch"))
        for r in self.recompute:
            if r not in GRAPH_RECOMPUTE:
                raise MeshplanError(f"graph search space: recompute={r!r} is not modelled on a layer graph "
                                    "(it records whole layers)", hint="use recompute none and/or full")
        if self.max_virtual_stages < 1:
            raise MeshplanError("graph search space: max_virtual_stages must be >= 1")

    def replace(self, **changes: object) -> GraphSpace:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# ---- one cluster size ------------------------------------------------------------------------

@dataclass
class _Scan:
    """The candidates of one cluster size: plan fields per row, reason, and prices."""

    cluster: ClusterSpec
    rows: list[tuple] = field(default_factory=list)
    """(tp, pp, dp, micro_batch, zero, shard_group, offload_optimizer, offload_params, schedule,
    virtual_stages, recompute, stage_layers) per row."""
    reason: list[int] = field(default_factory=list)
    """Index into REASONS, -1 = feasible."""
    step: list[float] = field(default_factory=list)
    peak: list[float] = field(default_factory=list)
    evaluated: int = 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.asarray(self.reason, dtype=np.int64), np.asarray(self.step, dtype=float),
                np.asarray(self.peak, dtype=float))


def row_plan(base: Plan, row: tuple) -> Plan:
    tp, pp, dp, mb, zero, sg, offo, offp, sched, v, rc, split = row
    return base.replace(tp=tp, pp=pp, dp=dp, cp=1, ep=1, micro_batch=mb, zero=zero, shard_group=sg,
                        offload_optimizer=offo, offload_params=offp, schedule=sched, virtual_stages=v,
                        recompute=rc, recompute_layers=None, stage_layers=split, sequence_parallel=False)


class _Pricer:
    """Caches per (tp, micro_batch) layer costs and per (tp, micro_batch, recompute, pp) splits."""

    def __init__(self, graph: LayerGraph, ga: GraphArrays, cluster: ClusterSpec, base: Plan,
                 params: CostParams) -> None:
        self.graph, self.ga, self.cluster, self.base, self.params = graph, ga, cluster, base, params
        self._lc: dict[tuple[int, int], LayerCosts] = {}
        self._split: dict[tuple, tuple[int, ...] | None] = {}
        self._layout: dict[tuple, Layout] = {}
        self._sums: dict[tuple, StageSums] = {}

    def costs(self, tp: int, mb: int) -> LayerCosts:
        key = (tp, mb)
        if key not in self._lc:
            b = self.base
            self._lc[key] = layer_costs(self.graph, self.ga, self.cluster, tp, mb, b.precision, b.fused_loss,
                                        self.params)
        return self._lc[key]

    def layer_times(self, tp: int, mb: int, rc: str) -> np.ndarray:
        """Per-layer seconds of one micro-batch (what the pipeline split balances)."""
        lc = self.costs(tp, mb)
        tp_t = (lc.tp3 if rc == "full" else lc.tp2) * (self.params.tp_exposed_async if self.base.async_tp else 1.0)
        return lc.f + lc.b + (lc.rc if rc == "full" else 0.0) + tp_t

    def dp_split(self, tp: int, mb: int, rc: str, pp: int) -> tuple[int, ...] | None:
        """The dynamic-programming split (None when there are fewer free layers than stages)."""
        key = (tp, mb, rc, pp)
        if key not in self._split:
            self._split[key] = balanced_split(self.ga, self.layer_times(tp, mb, rc), pp, self.costs(tp, mb).loss_s)
        return self._split[key]

    def sums(self, tp: int, pp: int, dp: int, mb: int, rc: str, v: int, sched: str,
             split: tuple[int, ...] | None) -> StageSums:
        """Stage sums of a candidate (shared by the schedules with the same layout)."""
        key = (tp, dp, mb, rc, pp, v, sched == "zbv", split)
        if key not in self._sums:
            b = self.base
            self._sums[key] = stage_sums(self.graph, self.cluster, self.costs(tp, mb), self.layout(pp, v, sched, split),
                                         tp=tp, cp=1, dp=dp, recompute=rc, recompute_layers=None,
                                         p2p_sharded=b.p2p_sharded, async_tp=b.async_tp, params=self.params)
        return self._sums[key]

    def layout(self, pp: int, v: int, sched: str, split: tuple[int, ...] | None) -> Layout:
        key = (pp, v, sched == "zbv", split)
        if key not in self._layout:
            self._layout[key] = make_layout(self.graph.num_layers, pp, v, sched, split)
        return self._layout[key]


def balanced_split(ga: GraphArrays, times: np.ndarray, pp: int, loss_s: float = 0.0) -> tuple[int, ...] | None:
    """Layers per stage minimising the slowest stage (search.stages.split_layers) with the
    embeddings (layers before ga.prefix) on the first stage and the heads (from ga.suffix) and
    the loss on the last; each stage holds at least one other layer. None if impossible."""
    L = len(times)
    if pp == 1:
        return (L,)
    lo, hi = ga.prefix, ga.suffix
    if hi - lo < pp:
        return None
    split = list(split_layers(times[lo:hi], pp, first_extra=float(times[:lo].sum()),
                              last_extra=float(times[hi:].sum()) + loss_s))
    split[0] += lo
    split[-1] += L - hi
    return tuple(split)


def tp_values(graph: LayerGraph, cluster: ClusterSpec, space: GraphSpace) -> list[int]:
    """Default: the degrees the graph's TP-able layers allow, dividing the node and the cluster."""
    n, g = cluster.num_gpus, cluster.gpus_per_node
    if space.tp is not None:
        return [t for t in space.tp if n % t == 0]
    return [t for t in graph.tp_degrees(g) if g % t == 0 and n % t == 0]


@dataclass(frozen=True)
class _ZeroOpts:
    """The ZeRO / hybrid-shard / offload variants of one mesh, as row arrays."""

    opts: list[tuple[int, int, bool, bool]]
    zero: np.ndarray
    shard: np.ndarray
    offload_optimizer: np.ndarray
    offload_params: np.ndarray

    @staticmethod
    def of(cluster: ClusterSpec, tp: int, dp: int, space: GraphSpace) -> _ZeroOpts:
        opts = [(int(a), int(b), bool(c), bool(d)) for a, b, c, d in zero_options(cluster, tp, dp, 1, space)]  # type: ignore[arg-type]
        z = np.asarray(opts, dtype=np.int64).reshape(-1, 4)
        zero, sg = z[:, 0], z[:, 1]
        shard = np.where(zero == 0, 1, np.where((sg > 0) & (sg < dp), sg, dp))
        return _ZeroOpts(opts, zero, shard, z[:, 2].astype(bool), z[:, 3].astype(bool))


def _scan(graph: LayerGraph, ga: GraphArrays, cluster: ClusterSpec, work: Workload, space: GraphSpace,
          params: CostParams) -> _Scan:
    """Enumerate, check and price every candidate of ``space`` on ``cluster``."""
    scan = _Scan(cluster)
    pricer = _Pricer(graph, ga, cluster, space.base, params)
    n = cluster.num_gpus
    checked: dict[tuple, int] = {}
    for tp in tp_values(graph, cluster, space):
        pps = space.pp if space.pp is not None else divisors(n // tp)
        for pp in [p for p in pps if (n // tp) % p == 0 and p <= graph.num_layers]:
            dp = n // (tp * pp)
            zs = _ZeroOpts.of(cluster, tp, dp, space)
            mbs = micro_batch_values(work, dp, space)  # type: ignore[arg-type]
            for rc, mb, (sched, v) in itertools.product(space.recompute, mbs,
                                                        schedule_options(pp, graph, space)):  # type: ignore[arg-type]
                for split in _splits(pricer, ga, tp, mb, rc, pp, v, space):
                    _price(scan, pricer, work, space, checked, (tp, pp, dp, mb), (sched, v, rc, split), zs)
    return scan


def _price(scan: _Scan, pricer: _Pricer, work: Workload, space: GraphSpace, checked: dict[tuple, int],
           head: tuple, tail: tuple, zs: _ZeroOpts) -> None:
    """Check and price the ZeRO variants of one candidate (one row each)."""
    tp, pp, dp, mb = head
    sched, v, rc, split = tail
    graph, cluster, base, params = pricer.graph, scan.cluster, space.base, pricer.params
    rows = [(*head, *z, *tail) for z in zs.opts]
    key = (*head, sched, v, split)
    if key not in checked:  # the checks do not depend on the ZeRO variant (all valid by construction)
        checked[key] = _first_reason(graph, cluster, work, row_plan(base, rows[0]))
    nan = np.full(len(rows), np.nan)
    if checked[key] >= 0:  # the ZeRO-2-under-a-pipeline constraint may come first for some variants
        first = [min(checked[key], _ZERO2_PP) if z[0] == 2 and pp > 1 else checked[key] for z in zs.opts]
        _record(scan, rows, first, nan, nan)
        return
    s = pricer.sums(tp, pp, dp, mb, rc, v, sched, split)
    r = finish(cluster, work, s, tp=tp, dp=dp, cp=1, micro_batch=mb, schedule=sched, v=v, zero=zs.zero,
               shard=zs.shard, offload_params=zs.offload_params, offload_optimizer=zs.offload_optimizer,
               grad_sync=np.full(len(rows), base.grad_sync), params=params)
    scan.evaluated += len(rows)
    fits = np.asarray(r["fits"], dtype=bool)
    reasons = np.where(fits & np.asarray(r["at_risk"], dtype=bool) & space.headroom, _RISK, np.where(fits, -1, _OOM))
    for i, z in enumerate(zs.opts):  # the rules that depend on the ZeRO / offload variant
        if z[0] == 2 and pp > 1:
            reasons[i] = _ZERO2_PP
        elif z[2] or z[3]:
            bad = runtime_violations(row_plan(base, rows[i]), microbatches(work.global_batch, dp, mb))
            if bad:
                reasons[i] = REASONS.index(bad[0][0].name)
    _record(scan, rows, reasons.tolist(), r["step_time_s"], r["peak_memory_gib"])


def _splits(pricer: _Pricer, ga: GraphArrays, tp: int, mb: int, rc: str, pp: int, v: int,
            space: GraphSpace) -> list[tuple[int, ...] | None]:
    if pp == 1:
        return [None]
    if v > 1:
        return [None]  # even chunks (stage_layers cannot name a chunked split)
    best = pricer.dp_split(tp, mb, rc, pp)
    out: list[tuple[int, ...] | None] = [best]
    if space.even_stages:
        base, extra = divmod(len(ga.params), pp)
        even = tuple(base + (1 if j < extra else 0) for j in range(pp))
        if even != best and base >= 1:
            out.append(even)
    return out


def _first_reason(graph: LayerGraph, cluster: ClusterSpec, work: Workload, plan: Plan) -> int:
    bad = graph_violations(graph, cluster, plan, work)
    if bad:
        return REASONS.index(bad[0][0])
    bad = runtime_violations(plan, microbatches(work.global_batch, plan.dp, plan.micro_batch))
    return REASONS.index(bad[0][0].name) if bad else -1


def _record(scan: _Scan, rows: list[tuple], reasons: list[int], step: np.ndarray, peak: np.ndarray) -> None:
    scan.rows += rows
    scan.reason += reasons
    scan.step += np.asarray(step, dtype=float).tolist()
    scan.peak += np.asarray(peak, dtype=float).tolist()


# ---- the search ------------------------------------------------------------------------------

def _check_request(graph: LayerGraph, work: Workload, space: GraphSpace) -> None:
    if work.seq_len != graph.sample_tokens:
        raise MeshplanError(f"the workload has {work.seq_len} tokens per sample but graph {graph.name} was traced "
                            f"at {graph.sample_tokens}",
                            hint=f"use seq_len={graph.sample_tokens} (cost.graph.graph_workload) or ingest again")
    why = unsupported_reason(space.base)
    if why:
        raise MeshplanError(why)


def search_graph(graph: LayerGraph, clusters: ClusterSpec | Sequence[ClusterSpec], work: Workload,
                 space: GraphSpace | None = None, *, params: CostParams | None = None, objective: str = "time",
                 top: int = 10) -> SearchResult:
    """Find the best plans for ``graph`` on each of ``clusters`` (one or several sizes).

    ``work.seq_len`` must equal graph.sample_tokens (`cost.graph.graph_workload` builds it);
    global_batch counts samples. The result's ``model`` is the graph (it has a ``name``)."""
    p = DEFAULT_PARAMS if params is None else params
    t0 = time.perf_counter()
    clusters = checked_request(clusters, objective, top)
    space = space or GraphSpace()
    _check_request(graph, work, space)
    ga = graph_arrays(graph)
    scans = [_scan(graph, ga, c, work, space, p) for c in clusters]
    t1 = time.perf_counter()
    result = _collect(graph, work, scans, space, p, objective, top)
    t2 = time.perf_counter()
    if result.feasible == 0:
        result.nearest = nearest_graph(graph, max(clusters, key=lambda c: c.num_gpus), work, space, p)
    result.search_time_s = time.perf_counter() - t0
    result.timings = {"enumerate_and_evaluate_s": t1 - t0, "rank_s": t2 - t1,
                      "nearest_s": result.search_time_s - (t2 - t0)}
    degrees = graph.tp_degrees(max(c.gpus_per_node for c in clusters))
    result.notes += [f"layer graph {graph.name}: {graph.num_layers} layers, {graph.params:,} parameters; "
                     f"tp limited to {degrees} by the layers' tp_max",
                     "pipeline stages (v = 1): dynamic-programming split over each candidate's per-layer times"]
    return result


def _collect(graph: LayerGraph, work: Workload, scans: list[_Scan], space: GraphSpace, params: CostParams,
             objective: str, top: int) -> SearchResult:
    counts = np.zeros(len(REASONS), dtype=np.int64)
    feas_which, feas_rows, t, m, d, g = [], [], [], [], [], []
    for i, s in enumerate(scans):
        reason, step, peak = s.arrays()
        counts += np.bincount(reason[reason >= 0], minlength=len(REASONS))
        ok = np.nonzero(reason == -1)[0]
        feas_which += [i] * len(ok)
        feas_rows += ok.tolist()
        t.append(step[ok])
        m.append(peak[ok])
        d.append(usd_per_million_tokens(s.cluster.num_gpus, s.cluster.price_per_hour, step[ok], work.tokens))
        g.append(np.full(len(ok), s.cluster.num_gpus, dtype=float))
    pts = {"step_time_s": np.concatenate(t), "peak_memory_gib": np.concatenate(m),
           "usd_per_mtok": np.concatenate(d), "num_gpus": np.concatenate(g)}
    which, rows = np.asarray(feas_which, dtype=np.int64), np.asarray(feas_rows, dtype=np.int64)
    result = SearchResult(
        model=graph, clusters=[s.cluster for s in scans], work=work, objective=objective,  # type: ignore[arg-type]
        plans=[], considered=sum(len(s.rows) for s in scans), evaluated=sum(s.evaluated for s in scans),
        feasible=len(rows), rejected={n: int(c) for n, c in zip(REASONS, counts) if c}, search_time_s=0.0,
        pareto=[], points=pts)

    def plan_of(j: int) -> Plan:
        return row_plan(space.base, scans[which[j]].rows[rows[j]])

    if len(rows):
        obj = pts["step_time_s"] if objective == "time" else pts["usd_per_mtok"]
        keys = (pts["peak_memory_gib"], pts["num_gpus"], obj)
        order = np.lexsort(keys)
        last = min(top, len(order))
        kth = order[last - 1]
        while last < len(order) and all(k[order[last]] == k[kth] for k in keys):
            last += 1
        head = order[:last].tolist()
        head.sort(key=lambda j: (obj[j], pts["num_gpus"][j], pts["peak_memory_gib"][j], plan_of(j).short()))
        for rank, j in enumerate(head[:top], start=1):
            plan, cluster = plan_of(j), scans[which[j]].cluster
            report = estimate_graph(graph, cluster, plan, work, params)
            usd = float(usd_per_million_tokens(plan.num_gpus, cluster.price_per_hour, report.step_time_s, work.tokens))
            result.plans.append(RankedPlan(rank=rank, plan=plan, cluster=cluster, report=report, usd_per_mtok=usd))
        front = np.nonzero(pareto_mask(np.stack([pts["step_time_s"], pts["peak_memory_gib"],
                                                 pts["usd_per_mtok"]], axis=1)))[0]
        front = front[np.lexsort((pts["peak_memory_gib"][front], pts["step_time_s"][front]))]
        result.pareto = [ParetoPoint(plan_of(int(j)), float(pts["step_time_s"][j]), float(pts["peak_memory_gib"][j]),
                                     float(pts["usd_per_mtok"][j])) for j in front]
    result.reject_examples = _examples(graph, work, scans, space, params)
    for s in scans:
        reason, step, _ = s.arrays()
        ok = np.nonzero(reason == -1)[0]
        best = float(step[ok].min()) if len(ok) else None
        usd = (float(usd_per_million_tokens(s.cluster.num_gpus, s.cluster.price_per_hour, best, work.tokens))
               if best is not None else None)
        result.per_cluster.append(ClusterCount(s.cluster.num_gpus, len(s.rows), len(ok), best, usd))
    return result


def _examples(graph: LayerGraph, work: Workload, scans: list[_Scan], space: GraphSpace,
              params: CostParams) -> dict[str, str]:
    """One message per rejection reason, from the first row rejected for it."""
    out: dict[str, str] = {}
    for i, name in enumerate(REASONS):
        for s in scans:
            reason, _, peak = s.arrays()
            hit = np.nonzero(reason == i)[0]
            if len(hit) == 0:
                continue
            if name == OUT_OF_MEMORY:
                j = int(hit[np.argmin(peak[hit])])
                plan = row_plan(space.base, s.rows[j])
                out[name] = (f"closest to fitting on {s.cluster.num_gpus} GPUs: {plan.short()} needs "
                             f"{gib_need(float(peak[j]), usable_gib(s.cluster, params))}")
            elif name == AT_RISK:
                j = int(hit[np.argmin(peak[hit])])
                plan = row_plan(space.base, s.rows[j])
                out[name] = (f"{plan.short()} needs {gib_need(float(peak[j]), usable_gib(s.cluster, params))}"
                             f", closer to the limit than the memory model's demonstrated error "
                             f"({100 * params.memory_error:.1f}%)")
            elif name in RULES:
                plan = row_plan(space.base, s.rows[int(hit[0])])
                m = microbatches(work.global_batch, plan.dp, plan.micro_batch)
                out[name] = f"{plan.short()}: {RULES[name].why(plan, m) or name}"
            else:
                plan = row_plan(space.base, s.rows[int(hit[0])])
                why = dict(graph_violations(graph, s.cluster, plan, work))
                out[name] = f"{plan.short()}: {why.get(name, name)}"
            break
    return out


# ---- nothing fits: the nearest feasible options ----------------------------------------------

def corner_space(space: GraphSpace) -> GraphSpace:
    """Least memory per GPU: the highest ZeRO level sharded over all ranks (with offload where
    the space has it), full recompute, micro-batch 1; every mesh and schedule."""
    rc = ("full",) if "full" in space.recompute else space.recompute
    return space.replace(zero=(max(space.zero),), hybrid_nodes=(), recompute=rc, micro_batch=(1,))


def _best(graph: LayerGraph, ga: GraphArrays, cluster: ClusterSpec, work: Workload, space: GraphSpace,
          params: CostParams) -> Corner:
    """The fastest fitting plan of ``space`` on ``cluster``, else its least-memory plan."""
    s = _scan(graph, ga, cluster, work, space, params)
    reason, step, peak = s.arrays()
    priced = np.nonzero((reason == -1) | (reason == _OOM))[0]
    if len(priced) == 0:
        return Corner(cluster, None, float("inf"), False, float("inf"))
    fits = priced[reason[priced] == -1]
    j = int(fits[np.argmin(step[fits])]) if len(fits) else int(priced[np.argmin(peak[priced])])
    return Corner(cluster, row_plan(space.base, s.rows[j]), float(peak[j]), bool(reason[j] == -1), float(step[j]))


def _corner(graph: LayerGraph, ga: GraphArrays, cluster: ClusterSpec, work: Workload, space: GraphSpace,
            params: CostParams) -> Corner:
    """The corner, refined when it fits: the fastest fitting plan of the full space on its mesh."""
    c = _best(graph, ga, cluster, work, corner_space(space), params)
    if c.plan is None or not c.fits:
        return c
    return _best(graph, ga, cluster, work, space.replace(tp=(c.plan.tp,), pp=(c.plan.pp,)), params)


def nearest_graph(graph: LayerGraph, cluster: ClusterSpec, work: Workload, space: GraphSpace,
                  params: CostParams = DEFAULT_PARAMS) -> list[str]:
    """Sentences naming what would make the request feasible (never just 'no plan')."""
    ga = graph_arrays(graph)
    out = []
    gpu, usable = cluster.gpu.name, usable_gib(cluster, params)
    here = _best(graph, ga, cluster, work, corner_space(space), params)
    if here.plan is not None and not here.fits:
        out.append(f"on {cluster.num_gpus} x {gpu} the most memory-saving plan ({here.plan.short()}) needs "
                   f"{gib_need(here.peak_memory_gib, usable)}")
    open_space = GraphSpace(base=space.base, even_stages=space.even_stages)
    if space != open_space:
        free = _corner(graph, ga, cluster, work, open_space, params)
        if free.fits and free.plan is not None:
            out.append(f"without the restrictions it fits on {cluster.num_gpus} GPUs: {free.plan.short()} "
                       f"({free.peak_memory_gib:.1f} GiB per GPU)")
    node = node_size(cluster)
    if here.plan is None:  # the constraints, not memory, rule everything out
        for n in reversed(nice_sizes(1, cluster.num_gpus - 1, node)):
            c = _corner(graph, ga, resized(cluster, n), work, space, params)
            if c.fits and c.plan is not None:
                out.append(f"no plan passes the constraints on {cluster.num_gpus} GPUs (see the rejection "
                           f"reasons); on fewer GPUs it fits: {n} x {gpu}, e.g. {c.plan.short()} "
                           f"({c.peak_memory_gib:.1f} GiB per GPU)")
                break
        else:
            out.append(f"no plan passes the constraints on {cluster.num_gpus} GPUs nor on fewer (see the "
                       "rejection reasons: the global batch must divide over data-parallel ranks, the layers "
                       "over pipeline stages)")
        return out
    size, limit = cluster.num_gpus, growth_limit(cluster)
    more, blocked = None, None
    while more is None:
        size = next_size(size, node)
        if size > limit:
            break
        c = _corner(graph, ga, resized(cluster, size), work, space, params)
        if c.plan is None:  # more GPUs than the batch, layers and TP degrees can be split over
            blocked = size
            break
        if c.fits:
            more = c
    if more is not None and more.plan is not None:
        out.append(f"needs at least {more.cluster.num_gpus} x {gpu}: e.g. {more.plan.short()} "
                   f"({more.peak_memory_gib:.1f} GiB per GPU)")
    for g in larger_memory_gpus(cluster):
        c = _corner(graph, ga, cluster.replace(gpu=g, name=f"{g.name}:{cluster.num_gpus}"), work, space, params)
        if c.fits and c.plan is not None:
            out.append(f"or {cluster.num_gpus} x {g.name}: {c.plan.short()} ({c.peak_memory_gib:.1f} GiB per GPU)")
            break
    if more is None and blocked is not None:
        out.append(f"no larger cluster up to {blocked} x {gpu} fits, and from {blocked} GPUs on no plan passes the "
                   f"constraints (global batch {work.global_batch} limits dp, {graph.num_layers} layers limit pp, "
                   f"the layers allow tp in {graph.tp_degrees(cluster.gpus_per_node)}); a larger global batch allows "
                   "more GPUs")
    elif more is None:
        out.append(f"no cluster of up to {limit} x {gpu} fits global batch {work.global_batch} x "
                   f"{work.seq_len} tokens; try shorter samples or GPUs with more memory")
    return out


__all__ = ["GraphSpace", "REASONS", "balanced_split", "nearest_graph", "row_plan", "search_graph", "tp_values"]
