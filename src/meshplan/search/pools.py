"""Search over a cluster of several GPU pools (spec.cluster.PooledCluster).

Three kinds of plan compete, every one priced by cost.pools (each rank on its own hardware):

1. **One pool alone** (the others left out): the ordinary search on that pool.
2. **Replicas on every pool** (``pool_dp``): a replica shape (tp, pp, cp, ZeRO, micro-batch,
   recompute, ...) taken from the best plans of the single-pool searches, as many replicas as
   each pool holds, and the global batch's micro-batches dealt to the pools in proportion to
   their speed (``dp_shares``): each pool's step is fitted as a + b x (micro-batches per
   replica) from two cost-model evaluations, the integer split that minimises the slowest
   pool's step is found exactly, and the plan is then priced in full.
3. **Pipeline stages on every pool** (``pool_pp``): a stage shape (dp, cp, tp, ...) from the
   same shortlist, as many stages as each pool holds, and the layers split so that every stage
   takes about as long on its own GPU (in proportion to each pool's measured time per layer),
   then moved one at a time from the slowest stage while that helps and memory allows.

The result ranks them together and says what each pool does, and why the winner wins: against
the best plan on each pool alone, with the numbers.

This is a stage of the one search (search.driver.search on a PooledCluster): the driver runs
each pool's own search (kind 1, and the shortlist of shapes), then `rank_over_pools` builds and
prices kinds 2 and 3 and returns the SearchResult (its pooled fields: ``pooled_plans``,
``alone``, ``best_multi``, ``best_by_kind``, ``explanation``). A GPU budget (--gpus) cuts the
pools first (`budget_pools`).
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost import PooledEstimate, estimate
from meshplan.cost.pools import device_order
from meshplan.errors import MeshplanError
from meshplan.search.pareto import pareto_mask
from meshplan.search.sizes import resized
from meshplan.search.result import (
    OVER_DEADLINE,
    ParetoPoint,
    PooledCount,
    SearchResult,
    merge,
    pooled_key,
    token_count,
    train_days,
)
from meshplan.spec.capabilities import capabilities
from meshplan.spec.cluster import ClusterSpec, PooledCluster
from meshplan.spec.graph import LayerGraph
from meshplan.spec.plan import Plan, Workload
from meshplan.units import human_seconds

KINDS = {"replicas on pools": "pool_dp", "stages on pools": "pool_pp"}
"""The kinds of plan over several pools, by the Plan field that places them."""
MIXED = "stages or replicas mixing GPU types"
"""The kind of plan in device order (cost.pools.device_order): tried only where a shape cannot use every GPU
of the pools as replicas or stages on pools (`_mixed_on_pools`)."""
MIXED_SHAPES = 6
"""Shapes (the best of the pools' own searches, in turn) tried in device order."""
MIXED_DEPTHS = 2
"""Pipeline depths tried per shape in device order (the shallowest that mix GPU types in a stage)."""
SHORTLIST = 12
"""Replica / stage shapes tried per pool (the best distinct shapes of its own search)."""
VARIED_STAGE_SHAPES = 4
"""Under a length distribution, the stage shapes tried for pipelines over pools (the best few: a
pipeline pads every micro-batch to the longest length, so it rarely wins there, and each of its
prices is an expected step over the lengths)."""


def fastest_first(cluster: PooledCluster) -> list[ClusterSpec]:
    """The pools, fastest GPU (its dense 16-bit peak) first; ties in the cluster file's order."""
    return sorted(cluster.pools, key=lambda p: -p.gpu.peak("bf16"))


def budget_pools(cluster: PooledCluster) -> list[ClusterSpec]:
    """The pools a search of ``cluster`` uses under its budget of ``max_gpus`` GPUs in all
    (--gpus): the GPUs taken fastest pool first (`fastest_first`), whole nodes (or a divisor of a
    node below one), up to the budget; a pool that gets none is left out. Without a budget: every
    GPU of every pool. Each pool keeps its name; the list is in the cluster's order."""
    gpus = cluster.max_gpus
    if gpus is None:
        return list(cluster.pools)
    left, cut = gpus, {}
    for p in fastest_first(cluster):
        n = min(left, p.num_gpus)
        per = p.gpus_per_node
        n = n if n == p.num_gpus or (n < per and per % n == 0) else (n // per) * per
        if n > 0:
            cut[p.name] = p if n == p.num_gpus else resized(p, n).replace(name=p.name)
            left -= n
        if left <= 0:
            break
    return [cut[p.name] for p in cluster.pools if p.name in cut]


def rank_over_pools(graph: LayerGraph, cluster: PooledCluster, work: Workload,
                    per_pool: dict[str, list[SearchResult]], *, pools: list[ClusterSpec] | None = None,
                    headroom: bool = True, params: CostParams = DEFAULT_PARAMS, objective: str = "time",
                    top: int = 10, deadline: tuple[float, float] | None = None,
                    allow_export_only: bool | None = None) -> SearchResult:
    """The pools stage of the search (module docstring): ``per_pool`` holds each pool's own searches
    (the driver runs them: the first without bucket plans, ranked for the shortlist of shapes; a
    second, under a length distribution, with its data-aware stage); plans over several pools are
    built on ``pools`` (default: every pool of ``cluster``; `budget_pools` under a GPU budget).
    ``deadline``: (tokens to train, days): the plans that take longer are rejected.

    ``allow_export_only`` (--allow-export-only; None: whether the pools' own searches kept such
    plans, which they do only when it was given): a pool alone may win with a plan that only an
    export target runs as planned (it is one GPU type: `meshplan export` takes it). A plan over
    several pools runs only on meshplan's own runtime (export refuses it), so it must run there as
    planned either way; the shapes it is built from are those the runtime runs."""
    alone: dict[str, PooledEstimate | None] = {}
    own_shapes: list[list[Plan]] = []
    bucketed: list[Plan] = []
    considered = 0
    if allow_export_only is None:
        allow_export_only = any(rp.export_only is not None for rs in per_pool.values() for r in rs for rp in r.plans)
    blocked: list[Any] = []  # (pool, its best plan) where the shapes of the pools' best plans cannot run over several pools
    for name, results in per_pool.items():
        considered += results[0].considered
        runnable = [rp.plan for rp in results[0].plans if rp.export_only is None]
        own_shapes.append(runnable)
        ok = [rp for rp in results[0].plans if allow_export_only or rp.export_only is None]
        best = [rp.plan for rp in ok[:1]]
        if results[0].plans and not runnable:
            blocked.append((name, results[0].plans[0]))
        for res_b in results[1:]:  # the pool's own search with its data-aware stage: its best may be a bucket plan
            best += [rp.plan for rp in res_b.plans if allow_export_only or rp.export_only is None][:1]
            bucketed += [p for p in best[-1:] if p.buckets is not None and p not in bucketed
                         and any(rp.plan == p and rp.export_only is None for rp in res_b.plans)]
        ests = [estimate(graph, cluster, p.replace(pools=(name,)), work, params) for p in best]
        alone[name] = min(ests, key=lambda e: pooled_key(e, objective)) if ests else None
    shapes = _distinct(own_shapes)
    multi: list[PooledEstimate] = []
    on: PooledCluster | None = cluster
    if pools is not None and [p.num_gpus for p in pools] != [p.num_gpus for p in cluster.pools]:
        on = (PooledCluster(name=cluster.name, pools=tuple(pools), inter_pool=cluster.inter_pool)
              if len(pools) >= 2 else None)
    tries = [(build, shape) for i, shape in enumerate(shapes) for build in (_replicas_on_pools, _stages_on_pools)
             if not (build is _stages_on_pools and work.varied and i >= VARIED_STAGE_SHAPES)]
    tries += [(_buckets_on_pools, shape) for shape in bucketed]  # a pool's bucket plan as every pool's replica shape
    if not work.varied:  # device order: where replicas or stages on pools leave GPUs unused
        tries += [(_mixed_on_pools, shape) for shape in shapes[:MIXED_SHAPES]]
    mixed_tried = 0
    for build, shape in tries if on is not None else ():
        try:
            e = build(graph, on, shape, work, params)
        except MeshplanError:
            continue
        considered += 1
        mixed_tried += build is _mixed_on_pools and e is not None
        if e is not None and e.fits and e.runs_as_planned and not (headroom and e.at_risk):
            multi.append(e)
    over: list[PooledEstimate] = []
    if deadline is not None:
        late = _late(work, *deadline)
        over = [e for e in [*alone.values(), *multi] if e is not None and late(e)]
        alone = {k: (None if v is not None and late(v) else v) for k, v in alone.items()}
        multi = [e for e in multi if not late(e)]
    multi = _dedupe(sorted(multi, key=lambda e: pooled_key(e, objective)))
    ranked = sorted([e for e in alone.values() if e is not None] + multi, key=lambda e: pooled_key(e, objective))
    out = SearchResult(model=graph, clusters=[cluster], work=work, objective=objective, plans=[],
                       considered=considered, evaluated=sum(r.evaluated for rs in per_pool.values() for r in rs),
                       feasible=len(ranked), rejected={}, search_time_s=0.0, pareto=_front(ranked),
                       points=_points(ranked, work), params=params, headroom=headroom,
                       pooled_plans=ranked[:top], alone=alone, best_multi=multi[0] if multi else None)
    why = None if ranked else (f"no plan meets the {deadline[1]:g}-day deadline" if over else
                               "no plan fits on any pool, alone or together")
    out.per_cluster = [PooledCount(cluster.num_gpus, considered, len(ranked),
                                   ranked[0].step_time_s if ranked else None,
                                   ranked[0].usd_per_m_tokens if ranked else None, over_deadline=len(over),
                                   reason=why, used_gpus=ranked[0].num_gpus if ranked else None)]
    if deadline is not None:
        out.train_tokens, out.deadline_days = deadline
        if over:
            out.rejected[OVER_DEADLINE] = len(over)
            e = min(over, key=lambda x: (x.step_time_s, x.plan.short()))
            days = float(train_days(e.step_time_s, work.tokens, deadline[0]))
            out.reject_examples[OVER_DEADLINE] = (
                f"{e.plan.short()} on {e.num_gpus:,} GPUs: {days:,.1f} days to train {token_count(deadline[0])} "
                f"tokens, over the {deadline[1]:g}-day deadline")
    for kind, field_ in KINDS.items():
        out.best_by_kind[kind] = next((e for e in multi if getattr(e.plan, field_) is not None), None)
    if mixed_tried or any(device_order(e.plan) for e in multi):
        out.best_by_kind[MIXED] = next((e for e in multi if device_order(e.plan)), None)
    if blocked and not shapes and on is not None:
        out.notes.append(_blocked(blocked, work, graph))
    out.explanation = explain(out)
    return out


def merge_budgets(results: list[SearchResult], top: int) -> SearchResult:
    """The searches of one cluster of pools under several GPU budgets (--gpus) as one result
    (search.result.merge: the top plans, and the best on each pool alone, over several pools and
    of each kind, over every budget), explained from those merged plans."""
    out = merge(results, top)
    if len(results) > 1:
        out.explanation = explain(out)
    return out


def _late(work: Workload, tokens: float, days: float) -> Any:
    return lambda e: float(train_days(e.step_time_s, work.tokens, tokens)) > days


def _points(plans: list[PooledEstimate], work: Workload) -> dict[str, np.ndarray]:
    """Every fitting plan's step time, peak memory, dollars and GPUs (the --plot figure's cloud)."""
    return {"step_time_s": np.asarray([e.step_time_s for e in plans], dtype=float),
            "peak_memory_gib": np.asarray([e.peak_memory_gib for e in plans], dtype=float),
            "usd_per_mtok": np.asarray([e.usd_per_m_tokens for e in plans], dtype=float),
            "num_gpus": np.asarray([e.num_gpus for e in plans], dtype=float),
            "time_to_target_s": np.asarray([e.step_time_s for e in plans], dtype=float)}


def _front(plans: list[PooledEstimate]) -> list[ParetoPoint]:
    """The Pareto front over (step time, peak memory per GPU, dollars per million tokens)."""
    if not plans:
        return []
    arr = np.asarray([[e.step_time_s, e.peak_memory_gib, e.usd_per_m_tokens] for e in plans], dtype=float)
    keep = [plans[int(i)] for i in np.nonzero(pareto_mask(arr))[0]]
    keep.sort(key=lambda e: (e.step_time_s, e.peak_memory_gib))
    return [ParetoPoint(e.plan, e.step_time_s, e.peak_memory_gib, e.usd_per_m_tokens) for e in keep]


def _distinct(per_pool: list[list[Plan]]) -> list[Plan]:
    """Shapes without their dp (a shape is what a replica or a stage is), taken from every pool's
    own best plans in turn (its best, then the next pool's best, ...), first come first kept, at
    most SHORTLIST x 2 in all. In turn, so that a small pool's shapes are tried too: the larger
    pool's best shapes are often wider than the small pool holds, and could fill the shortlist
    alone (then no replica shape would fit on both)."""
    seen, out = set(), []
    for p in (p for row in itertools.zip_longest(*per_pool) for p in row if p is not None):
        k = p.replace(dp=1, shard_group=0, stage_layers=None).short()
        if k not in seen:
            seen.add(k)
            out.append(p)
        if len(out) >= SHORTLIST * 2:
            break
    return out


BLOCKED = "plans over several pools: "
"""The head of the result's notes that say why the pools' best shapes were not placed over several
pools (a plan over several pools runs only on meshplan's runtime)."""


def _blocked(blocked: list[Any], work: Workload, model: Any) -> str:
    """Why no shape was placed over several pools: every plan of the pools' own searches is
    export-only (``blocked``: (pool name, its best RankedPlan) each)."""
    from meshplan.spec.plan import microbatches
    from meshplan.spec.support import runtime_violations
    rp = blocked[0][1]
    bad = runtime_violations(rp.plan, microbatches(work.global_batch, rp.plan.dp, rp.plan.micro_batch), model)
    why = f" ({bad[0][1]})" if bad else ""
    return (f"{BLOCKED}none tried: every plan of the pools' own searches ({', '.join(n for n, _ in blocked)}) is "
            f"export-only{why}, and a plan over several pools runs only on meshplan's runtime (`meshplan export` "
            "refuses it)")


def _dedupe(es: list[PooledEstimate]) -> list[PooledEstimate]:
    seen, out = set(), []
    for e in es:
        k = e.plan.short()
        if k not in seen:
            seen.add(k)
            out.append(e)
    return out


def _replicas_on_pools(graph: LayerGraph, cluster: PooledCluster, shape: Plan, work: Workload,
                       params: CostParams) -> PooledEstimate | None:
    """Replicas of ``shape`` on every pool, micro-batches split by speed: the best of a few replica
    counts per pool (as many as each pool holds; the same count in every pool)."""
    per = shape.tp * shape.pp * shape.cp
    able = [p for p in cluster.pools if p.num_gpus // per >= 1]
    if len(able) < 2:
        return None
    if shape.zero >= 2:
        # uneven shares under zero=2/3: the runtime keeps the parameters gathered for the step (its
        # replicas make different numbers of collectives), as zero=1 does: plan and price it as zero=1
        shape = shape.replace(zero=1)
    best = None
    for k in range(len(able), 1, -1):  # every subset of two or more pools (a small pool may hurt)
        for pools in itertools.combinations(able, k):
            most = [p.num_gpus // per for p in pools]
            variants = [most] + ([[min(most)] * len(most)] if len(set(most)) > 1 else [])
            for n in variants:
                for sh in _enough_micro_batches(shape, sum(n), work):
                    e = _replicas(graph, cluster, list(pools), sh, n, work, params)
                    if e is not None and e.fits and _better(e, best):
                        best = e
    return best


def _better(e: PooledEstimate, best: PooledEstimate | None) -> bool:
    """``e`` beats ``best``: it fits with headroom where ``best`` does not, else it is faster (a faster plan at
    risk of running out of memory must not hide a safe one: the search recommends only the safe)."""
    return best is None or (e.at_risk, e.step_time_s) < (best.at_risk, best.step_time_s)


def _kept(graph: LayerGraph, cluster: PooledCluster, plan: Plan, work: Workload, params: CostParams,
          best: PooledEstimate | None) -> PooledEstimate | None:
    """``plan``'s estimate where it fits and beats ``best`` (_better), else ``best`` (also where the cost
    model refuses the plan)."""
    try:
        e = estimate(graph, cluster, plan, work, params)
    except MeshplanError:
        return best
    return e if e.fits and _better(e, best) else best


def _enough_micro_batches(shape: Plan, replicas: int, work: Workload) -> list[Plan]:
    """``shape``, or (when the step has fewer of its micro-batches than ``replicas``) the shape with the largest
    smaller micro-batch that gives every replica at least one: a pool's own best shape may take micro-batches too
    large for the replicas of every pool together. [] when none does."""
    mb = shape.micro_batch
    if work.global_batch // mb >= replicas:
        return [shape]
    ok = [d for d in range(mb - 1, 0, -1) if work.global_batch % d == 0 and work.global_batch // d >= replicas]
    return [shape.replace(micro_batch=ok[0])] if ok else []


def _buckets_on_pools(graph: LayerGraph, cluster: PooledCluster, shape: Plan, work: Workload,
                      params: CostParams) -> PooledEstimate | None:
    """Replicas of a bucket plan (``shape``: micro-batch and cp per length bucket, from a pool's own
    data-aware stage) on every subset of two or more pools, as many as each pool holds (or the same
    count in every pool). A bucket plan deals each step's samples to its ranks by length, so its
    replicas take even shares (no dp_shares): the slower pool sets the step."""
    per = shape.tp * shape.pp * shape.cp
    able = [p for p in cluster.pools if p.num_gpus // per >= 1]
    best = None
    for k in range(len(able), 1, -1):
        for pools in itertools.combinations(able, k):
            most = [p.num_gpus // per for p in pools]
            for n in [most] + ([[min(most)] * len(most)] if len(set(most)) > 1 else []):
                group = math.gcd(*n) * shape.cp
                plan = shape.replace(dp=sum(n), pools=tuple(p.name for p in pools), pool_dp=tuple(n), dp_shares=None,
                                     shard_group=group if shape.zero >= 1 and group < sum(n) * shape.cp else 0)
                best = _kept(graph, cluster, plan, work, params, best)
    return best


def _replicas(graph: LayerGraph, cluster: PooledCluster, pools: list[Any], shape: Plan, n: list[int],
              work: Workload, params: CostParams) -> PooledEstimate | None:
    """n[i] replicas on pool i. ZeRO/FSDP shards within groups of gcd(n) replicas (x cp), so that
    every group lies in one pool (HSDP across pools and groups, as meshplan's runtime runs it)."""
    mb = shape.micro_batch
    if work.global_batch % mb:
        return None
    M = work.global_batch // mb  # micro-batches in the step, all replicas together
    if sum(n) > M:
        return None
    group = math.gcd(*n) * shape.cp
    base = shape.replace(dp=sum(n), pools=tuple(p.name for p in pools), pool_dp=tuple(n), dp_shares=None,
                         shard_group=group if shape.zero >= 1 and group < sum(n) * shape.cp else 0)
    # each pool's step as a + b m (m micro-batches per replica)
    def pool_step(i: int, m: int) -> float:
        one = base.replace(pools=(pools[i].name,), pool_dp=None, dp=n[i],
                           shard_group=base.shard_group if base.shard_group < n[i] * shape.cp else 0)
        return estimate(graph, cluster, one, work.shaped(n[i] * m * mb, work.seq_len, work.lengths),
                        params).step_time_s
    split = _split_by_speed(n, M, pool_step)
    if split is None:
        return None
    g = math.gcd(*split)
    plan = base.replace(dp_shares=tuple(m // g for m in split))  # one share per pool (Plan.replica_shares)
    return estimate(graph, cluster, plan, work, params)


def _split_by_speed(n: list[int], M: int, step: Any) -> list[int] | None:
    """The rule that deals a step's ``M`` micro-batches to groups of replicas by speed (replicas on pools;
    classes of replicas in device order): group i (n[i] replicas) takes ``step(i, m)`` seconds at m
    micro-batches per replica, fitted as a + b m from two evaluations (m = 1 and the even share); the
    integer split minimising the slowest group's step (`_best_split`). None: no split (more than three
    groups, or too few micro-batches)."""
    if len(n) > 3 or sum(n) > M:
        return None
    lines = []
    lo, hi = 1, max(2, M // sum(n))
    for i in range(len(n)):
        t0, t1 = step(i, lo), step(i, hi)
        b = (t1 - t0) / (hi - lo)
        lines.append((t0 - b * lo, b))
    return _best_split(n, M, lines)


def _best_split(n: list[int], M: int, lines: list[tuple[float, float]]) -> list[int] | None:
    """Micro-batches per replica m_i >= 1 with sum n_i m_i = M minimising max_i a_i + b_i m_i
    (exact for two pools, by enumeration; three: nested; more: None)."""
    best, arg = math.inf, None
    if len(n) == 2:
        for m0 in range(1, M // n[0] + 1):
            rest = M - n[0] * m0
            if rest < n[1] or rest % n[1]:
                continue
            m1 = rest // n[1]
            t = max(lines[0][0] + lines[0][1] * m0, lines[1][0] + lines[1][1] * m1)
            if t < best:
                best, arg = t, [m0, m1]
    elif len(n) == 3:
        for m0 in range(1, M // n[0] + 1):
            for m1 in range(1, (M - n[0] * m0) // n[1] + 1):
                rest = M - n[0] * m0 - n[1] * m1
                if rest < n[2] or rest % n[2]:
                    continue
                m2 = rest // n[2]
                t = max(a + b * m for (a, b), m in zip(lines, (m0, m1, m2)))
                if t < best:
                    best, arg = t, [m0, m1, m2]
    return arg


def _stages_on_pools(graph: LayerGraph, cluster: PooledCluster, shape: Plan, work: Workload,
                     params: CostParams) -> PooledEstimate | None:
    """Every pool gets as many stages of ``shape``'s dp x cp x tp as it holds; layers by speed. Under a
    length distribution too: cost.pools prices each stage's step with the runtime's padding (a pipeline's
    micro-batches are padded to the longest length)."""
    if shape.virtual_stages > 1 or shape.schedule in ("zbv", "interleaved-1f1b"):
        shape = shape.replace(virtual_stages=1, schedule="1f1b")
    g = shape.dp * shape.cp * shape.tp
    pools = [p for p in cluster.pools if p.num_gpus // g >= 1]
    if len(pools) < 2:
        return None
    layers = graph.num_blocks or capabilities(graph).blocks
    k = [min(p.num_gpus // g, max(1, layers // len(pools))) for p in pools]
    pp = sum(k)
    if pp > layers or pp < 2:
        return None
    plan = shape.replace(pp=pp, dp_shares=None, pools=tuple(p.name for p in pools), pool_dp=None,
                         pool_pp=tuple(k), stage_layers=None)
    # time per layer on each pool, from an even split
    even = _even(layers, pp)
    e = estimate(graph, cluster, plan.replace(stage_layers=even), work, params)
    owner = [i for i, c in enumerate(k) for _ in range(c)]
    speed = []
    for i in range(len(pools)):
        ranks = [r for r, o in enumerate(owner) if o == i]
        speed.append(sum(1.0 / max(1e-12, e.parts[i].step_s / max(1, even[r])) for r in ranks) / len(ranks))
    want = [speed[o] for o in owner]
    split = _apportion(layers, want)
    best = estimate(graph, cluster, plan.replace(stage_layers=tuple(split)), work, params)
    for _ in range(layers):  # memory: move layers from the fullest pool's stages to the one with most room
        if best.fits and not best.at_risk:
            break
        fill = [p.peak_memory_gib / p.usable_memory_gib for p in best.parts]
        full, room = fill.index(max(fill)), fill.index(min(fill))
        s = list(best.plan.stage_layers or split)
        src = max((r for r, o in enumerate(owner) if o == full), key=lambda r: s[r])
        dst = min((r for r, o in enumerate(owner) if o == room), key=lambda r: s[r])
        if full == room or s[src] <= 1:
            break
        s[src] -= 1
        s[dst] += 1
        best = estimate(graph, cluster, plan.replace(stage_layers=tuple(s)), work, params)
    for _ in range(2 * pp):  # move a layer off the slowest stage while it helps (and fits)
        slow = max(range(len(best.parts)), key=lambda i: best.parts[i].step_s)
        fast = min(range(len(best.parts)), key=lambda i: best.parts[i].step_s)
        if slow == fast:
            break
        s = list(best.plan.stage_layers or split)
        src = max((r for r, o in enumerate(owner) if o == slow), key=lambda r: s[r])
        dst = min((r for r, o in enumerate(owner) if o == fast), key=lambda r: s[r])
        if s[src] <= 1:
            break
        s[src] -= 1
        s[dst] += 1
        trial = estimate(graph, cluster, plan.replace(stage_layers=tuple(s)), work, params)
        if trial.step_time_s >= best.step_time_s or not trial.fits or (trial.at_risk and not best.at_risk):
            break
        best = trial
    if not best.fits:
        return None
    return best


def _mixed_on_pools(graph: LayerGraph, cluster: PooledCluster, shape: Plan, work: Workload,
                    params: CostParams) -> PooledEstimate | None:
    """``shape`` in device order over every pool (fastest first; cost.pools.device_order), using all their
    GPUs, in plans that replicas or stages on pools cannot express: the shallowest MIXED_DEPTHS pipelines
    (pp >= 2, dp = GPUs / (pp tp cp)) whose stage of dp x cp x tp GPUs does not divide some pool's (a stage
    then spans pools: 12 A100 + 4 V100 at pp=2, dp=8 puts 4 A100 and 4 V100 in stage 1), and with its dp x cp x tp per
    stage (pp = GPUs / (dp cp tp)) when that does not divide some pool's GPUs. A stage or a replica group then spans GPU types
    (a stage runs at its slowest member's pace). Layers split evenly. None when neither applies or nothing
    fits; the best that fits otherwise (a safe plan before one at risk)."""
    pools = fastest_first(cluster)
    held = [p.num_gpus for p in pools]
    n, unit = sum(held), shape.tp * shape.cp
    if shape.ep > 1 or any(h % unit for h in held) or n % unit:
        return None
    layers = graph.num_blocks or capabilities(graph).blocks
    base = shape.replace(pools=tuple(p.name for p in pools), pool_dp=None, pool_pp=None, dp_shares=None,
                         stage_layers=None, shard_group=0, virtual_stages=1,
                         schedule="1f1b" if shape.schedule in ("zbv", "interleaved-1f1b") else shape.schedule)
    dims = []
    for pp in (d for d in range(2, min(layers, n // unit) + 1) if (n // unit) % d == 0):
        dp = n // (unit * pp)  # a pipeline of pp stages of dp x cp x tp GPUs: mixed where that divides not every pool
        if any(h % (unit * dp) for h in held) and len(dims) < MIXED_DEPTHS:
            dims.append((pp, dp))
    if any(h % (unit * shape.dp) for h in held) and n % (unit * shape.dp) == 0:
        dims.append((n // (unit * shape.dp), shape.dp))
    best = None
    for pp, dp in dict.fromkeys(dims):
        if pp > layers or dp < 1:
            continue
        mb = next((m for m in range(shape.micro_batch, 0, -1) if work.global_batch % (dp * m) == 0), None)
        if mb is None:
            continue
        plan = base.replace(pp=pp, dp=dp, micro_batch=mb, stage_layers=_even(layers, pp) if pp > 1 else None)
        best = _kept(graph, cluster, plan, work, params, best)
        shared = _shares_by_speed(graph, cluster, plan, work, params)
        if shared is not None:
            best = _kept(graph, cluster, shared, work, params, best)
    return best


def _shares_by_speed(graph: LayerGraph, cluster: PooledCluster, plan: Plan, work: Workload,
                     params: CostParams) -> Plan | None:
    """``plan`` (in device order) with dp_shares by speed: its replicas grouped into classes that run on the
    same GPUs (cost.pools.replica_classes), the step's micro-batches dealt to the classes by the rule of
    replicas on pools (`_split_by_speed`, on each class's own pipeline: cost.pools.class_step), so that a
    replica whose GPUs include a slower type gets a smaller share. ZeRO 2/3 as 1 (uneven shares keep the
    parameters gathered). None where every replica runs alike, or no split helps."""
    from meshplan.cost.pools import class_step, device_layout, plan_pools, replica_classes
    try:
        layout = device_layout(plan_pools(cluster, plan), plan)
    except MeshplanError:
        return None
    classes = replica_classes(layout, [0] * plan.dp)
    if len(classes) < 2 or work.global_batch % plan.micro_batch:
        return None
    plan = plan.replace(zero=min(plan.zero, 1))
    M = work.global_batch // plan.micro_batch
    n = [len(c.replicas or ()) for c in classes]
    split = _split_by_speed(n, M, lambda i, m: class_step(graph, cluster, plan, work, params,
                                                          classes[i].replicas or (), m))
    if split is None or len(set(split)) == 1:
        return None
    per = [0] * plan.dp
    for c, m in zip(classes, split):
        for d in c.replicas or ():
            per[d] = m
    return plan.replace(dp_shares=block_shares(per))


def block_shares(per: list[int]) -> tuple[int, ...]:
    """Per-replica shares written as dp_shares: the fewest equal blocks of consecutive replicas (Plan.replica_shares
    expands them back), divided by their greatest common divisor."""
    dp = len(per)
    k = next(k for k in range(1, dp + 1) if dp % k == 0
             and all(per[i] == per[(i // (dp // k)) * (dp // k)] for i in range(dp)))
    blocks = [per[i * (dp // k)] for i in range(k)]
    g = math.gcd(*blocks)
    return tuple(b // g for b in blocks)


def _even(layers: int, pp: int) -> tuple[int, ...]:
    q, r = divmod(layers, pp)
    return tuple(q + (i < r) for i in range(pp))


def _apportion(total: int, weights: list[float]) -> list[int]:
    """Whole layers >= 1 per stage in proportion to weights (largest remainder)."""
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [max(1, int(x)) for x in raw]
    while sum(out) > total:
        i = max(range(len(out)), key=lambda j: out[j] - raw[j])
        out[i] -= 1
    while sum(out) < total:
        i = max(range(len(out)), key=lambda j: raw[j] - out[j])
        out[i] += 1
    return out


def _s(t: float) -> str:
    return human_seconds(t)


def _fmt(e: PooledEstimate) -> str:
    return f"{_s(e.step_time_s)} per step, ${e.usd_per_m_tokens:.3f} per M tokens ({e.plan.short()})"


def explain(r: SearchResult) -> list[str]:
    """What each pool does in the winner, and why it wins, with the numbers."""
    lines: list[str] = []
    best = r.best_pooled
    if best is None:
        lines.append(f"no plan meets the {r.deadline_days:g}-day deadline on any pool, alone or together"
                     if r.deadline_days is not None and r.rejected.get(OVER_DEADLINE) else
                     "no plan fits on any pool, alone or together")
        return lines
    used = best.plan.pools or ()
    alone = {k: v for k, v in r.alone.items() if v is not None}
    held = budget_pools(r.clusters[0]) if isinstance(r.clusters[0], PooledCluster) else []
    one_pool = len(r.per_cluster) <= 1 and len(held) < 2  # a GPU budget (--gpus) that one pool holds
    if len(used) > 1:
        lines.append(f"uses {len(used)} pools ({', '.join(used)}): {_s(best.step_time_s)} per step")
        for p in best.parts:
            lines.append(f"  {p.name} ({p.gpus} of {p.gpus_total} {p.gpu}): {p.role}; its own part {_s(p.step_s)}, "
                         f"then waits {_s(p.idle_s)} for the slowest pool (busy {100 * p.busy_fraction:.0f}% of the "
                         f"step on average); {p.peak_memory_gib:.1f} of {p.usable_memory_gib:.1f} GiB")
        if best.plan.pool_dp is not None and best.plan.dp_shares is not None:
            shares = ":".join(map(str, best.plan.dp_shares))
            lines.append(f"  the micro-batches are dealt by speed (dp_shares={shares}), so that the pools finish "
                         "together; the rest of the gap is whole micro-batches")
        if device_order(best.plan) and best.plan.dp_shares is not None:
            shares = ":".join(map(str, best.plan.dp_shares))
            lines.append(f"  the micro-batches are dealt by speed (dp_shares={shares}): a replica whose GPUs include a "
                         "slower type takes fewer, so that every class of replicas finishes about together")
        if best.plan.pool_pp is not None:
            lines.append(f"  stage_layers={':'.join(map(str, best.plan.stage_layers or ()))}: more layers on the "
                         "faster pool's stages, so that every stage takes about as long")
        link = r.clusters[0].inter_pool
        lines.append(f"  across pools: {_s(best.cross_pool_s)} per step exposed over inter_pool (a GPU sends up to "
                     f"{best.cross_pool_gb:.2f} GB per step over it, at {link.bandwidth_gbps:g} GB/s x "
                     f"{link.efficiency:.2f} achieved); time lost to "
                     f"imbalance {_s(best.imbalance_s)} per step (GPU-weighted)")
        for name, e in alone.items():
            gain = 100 * (1 - best.step_time_s / e.step_time_s)
            dearer = 100 * (best.usd_per_m_tokens / e.usd_per_m_tokens - 1) if e.usd_per_m_tokens else 0.0
            lines.append(f"  vs {name} alone ({e.num_gpus} GPUs): {_fmt(e)}: the pools together are "
                         f"{abs(gain):.0f}% {'faster' if gain >= 0 else 'slower'} and cost "
                         f"${best.usd_per_m_tokens:.3f} vs ${e.usd_per_m_tokens:.3f} per M tokens "
                         f"({dearer:+.0f}%)")
    else:
        lines.append(f"uses pool {used[0] if used else '?'} alone: {_fmt(best)}")
        if best.runtime:  # --allow-export-only: a plan of one GPU type that an export target runs as planned
            from meshplan.spec.support import export_targets
            from meshplan.spec.plan import microbatches
            sub = best.plan.replace(pools=None)
            targets = export_targets(sub, microbatches(r.work.global_batch, sub.dp, sub.micro_batch), r.model)
            lines.append(f"  export only ({', '.join(targets or ()) or 'no target'}): meshplan's runtime does not "
                         f"run it as planned ({best.runtime[0]['reason']})")
        if best.plan.buckets is not None:
            lines.append("  a data-aware plan (context parallelism and micro-batch by length bucket) of that pool's "
                         "own search: over several pools its replicas take even shares (a bucket plan deals the "
                         "samples by length, not by speed), so the slower pool sets the step")
        m = r.best_multi
        if m is None and one_pool:
            lines.append(f"  a budget of {r.clusters[0].num_gpus:,} GPUs takes them from one pool "
                         f"({held[0].name if held else '?'}, the fastest first): no plan over several pools")
        elif m is None and any(n.startswith(BLOCKED) for n in r.notes):
            lines += [f"  {n}" for n in r.notes if n.startswith(BLOCKED)]
            return lines
        elif m is None:
            lines.append("  the search found no plan over several pools that fits with memory headroom"
                         + (" and meets the deadline" if r.deadline_days is not None else "")
                         + " among the replica and stage shapes it tried (each pool's best plans' shapes)")
        elif r.objective == "cost":
            lines.append(f"  the best plan over several pools costs more: ${m.usd_per_m_tokens:.3f} vs "
                         f"${best.usd_per_m_tokens:.3f} per M tokens, though it takes {_fmt(m)} against "
                         f"{_s(best.step_time_s)} (objective cost: dollars per token first)")
        else:
            lines.append(f"  the best plan over several pools is slower: {_fmt(m)} (across pools "
                         f"{_s(m.cross_pool_s)}, imbalance {_s(m.imbalance_s)} per step, slowest pool "
                         f"{_s(max(p.step_s for p in m.parts))})")
            for p in m.parts:
                lines.append(f"    {p.name}: {p.role}, {_s(p.step_s)}")
    for kind, e in r.best_by_kind.items():
        if e is None and one_pool:
            continue  # (one pool under the budget: said above)
        if e is None:
            lines.append(f"  {kind}: none of the shapes tried fits with memory headroom"
                         + (" and meets the deadline" if r.deadline_days is not None else ""))
        elif e is not best:
            slow = max(e.parts, key=lambda p: p.step_s)
            sign = "+" if e.step_time_s >= best.step_time_s else "-"
            gap = _s(abs(e.step_time_s - best.step_time_s))
            lines.append(f"  best with {kind}: {_fmt(e)}: {sign}{gap}; its slowest "
                         f"pool ({slow.name}: {slow.role}) takes {_s(slow.step_s)}, across pools "
                         f"{_s(e.cross_pool_s)}, imbalance {_s(e.imbalance_s)}")
    return lines
