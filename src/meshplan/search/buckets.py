"""The data-aware stage of the search: micro-batch size and context-parallel degree per length
bucket (spec/buckets.py), for a workload whose samples have a distribution of lengths.

After the search has ranked one-shape plans by their expected step (cost.lengths), this stage
takes the best distinct configurations without a pipeline that meshplan's runtime runs (tensor
parallelism, the dp x cp ranks, ZeRO, recomputation, precision...; BASES of them among the best
POOL one-shape plans, whatever the request's ``top``) and, for each, tries bucket plans built by a
token budget:

- the budget is the tokens per rank of the base plan's micro-batch (micro_batch x the longest
  length / its cp): what it already holds in memory;
- bucket limits: the longest length alone (one bucket: every sample over the same cp, sorted and
  dealt by weight), or split at one or two of the distribution's lengths (at most
  LIMIT_CANDIDATES of them, spread geometrically);
- each bucket takes the smallest context-parallel degree (a power of two) at which a sample of
  its limit fits the budget, and as many samples per micro-batch as the budget holds at that
  degree; the plan's cp is the last bucket's, and a variant doubles every bucket's cp past 1
  (shorter ranks of attention for the longest samples, at more communication);
- a candidate needs the context-parallel groups to divide the base plan's dp x cp ranks.

Every candidate is priced by cost.buckets (memory of its heaviest bucket, its imbalance); those
that fit with the search's headroom join the ranking, which is then cut to ``top`` again. The
stage says what it tried and how the best bucket plan compares with the best one-shape plan.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any

import numpy as np

from meshplan.cost import estimate, estimate_batch
from meshplan.cost.lengths import anchor_lengths
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.search.pareto import pareto_mask, usd_per_million_tokens
from meshplan.search.result import ParetoPoint, RankedPlan, SearchResult, rank_key
from meshplan.spec.axes import AX
from meshplan.spec.buckets import Bucket
from meshplan.spec.plan import Plan, Workload, microbatches, parse_plan
from meshplan.spec.support import export_targets

BASES = 6
"""Distinct base configurations (best first) the stage builds bucket plans from."""
POOL = 40
"""One-shape plans the search collects for the bases, whatever its ``top``."""
LIMIT_CANDIDATES = 5
"""Most distribution lengths tried as bucket limits (below the longest)."""
MAX_SAMPLES = 64
"""Most samples per micro-batch a bucket is given."""


def _pow2_at_least(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, x))))


def bucket_sets(work: Workload) -> list[tuple[int, ...]]:
    """Limit sets: (longest,), (a, longest), (a, b, longest) over LIMIT_CANDIDATES lengths."""
    d = work.lengths
    assert d is not None
    below = list(d.lengths[:-1])
    cand = anchor_lengths(below, LIMIT_CANDIDATES) if below else []
    out: list[tuple[int, ...]] = [(d.max_len,)]
    for k in (1, 2):
        out += [(*c, d.max_len) for c in itertools.combinations(cand, k)]
    return out


def candidates(base: Plan, work: Workload) -> list[Plan]:
    """Bucket plans built from ``base`` by its token budget (module docstring)."""
    d = work.lengths
    assert d is not None
    ranks = base.dp * base.cp
    budget = base.micro_batch * d.max_len / base.cp
    if base.zero >= 2:  # the runtime runs bucket plans with parameters gathered (cost.buckets.as_run): say so
        base = base.replace(zero=1, shard_group=0)
    out: list[Plan] = []
    for limits in bucket_sets(work):
        cps = [min(_pow2_at_least(n / budget), ranks) for n in limits]
        for double in (False, True):
            cs = [c * 2 if double and c > 1 else c for c in cps]
            if double and cs == cps:
                continue
            C = cs[-1]
            if ranks % C or any(C % c for c in cs):
                continue
            bs = tuple(Bucket(n, max(1, min(MAX_SAMPLES, work.global_batch * c // ranks,  # a unit's share at most
                                            int(budget * c // n))), c) for n, c in zip(limits, cs))
            if any((a.micro_batch, a.cp) == (b.micro_batch, b.cp) for a, b in zip(bs, bs[1:])):
                continue  # two neighbours alike: the same plan as the set without the limit between them
            try:
                out.append(base.replace(cp=C, dp=ranks // C, micro_batch=bs[-1].micro_batch,
                                        buckets=tuple(b.text() for b in bs)))
            except Exception:  # noqa: BLE001 - a combination the plan rules refuse: not a candidate
                continue
    return out


def base_key(p: Plan) -> tuple:
    """A configuration up to its split of dp x cp, its micro-batch and its ZeRO sharding (the best
    of those stands for it), but with its token budget (micro_batch / cp: the tokens per rank it
    holds, relative to the longest length)."""
    fields = tuple(sorted((k, v) for k, v in p.flat_dict().items() if k not in (AX.DP, AX.CP, "micro_batch", "buckets",
                                                                          "shard_group", "zero")))
    return (*fields, ("budget", p.micro_batch / p.cp))


def pick_bases(result: SearchResult, params: CostParams, pool: list[Plan] | None) -> list[Plan]:
    """BASES configurations to build bucket plans from: the ``pool`` (distinct configurations
    without a pipeline, fastest first; default: the ranking's), re-ranked by their expected step
    under bucketed packing (a bucket plan sorts the step's samples itself, so the bases must not
    depend on the request's packing), among those meshplan's runtime runs with buckets."""
    cluster = result.plans[0].cluster
    if pool is None:
        pool = [p.plan for p in result.plans if p.cluster is cluster]
    keep: list[Plan] = []
    seen: set[tuple] = set()
    for plan in pool:
        key = base_key(plan)
        if plan.pp != 1 or plan.ep != 1 or plan.buckets is not None or plan.periodic or key in seen \
                or plan.num_gpus != cluster.num_gpus:
            continue
        probe = plan.replace(buckets=(f"{result.work.seq_len}x{plan.micro_batch}cp{plan.cp}",))
        micro = microbatches(result.work.global_batch, probe.dp, probe.micro_batch)
        if export_targets(probe, micro, result.model) is not None:
            continue  # the runtime refuses it (e.g. an optimizer offloaded alone): so would it its buckets
        seen.add(key)
        keep.append(plan)
    if not keep:
        return []
    d = result.work.lengths
    assert d is not None
    sorted_work = Workload.of(result.work.global_batch, d.with_packing("bucketed"))
    steps = estimate_batch(result.model, cluster, sorted_work, keep, params)["step_time_s"]
    order = np.argsort(steps, kind="stable")
    return [keep[int(i)] for i in order[:BASES]]


def _needs_buckets(plan: Plan) -> bool:
    """A one-shape plan that meshplan's runtime refuses on samples of several lengths (cp > 1
    without a pipeline: runtime.hetero.check_lengths)."""
    return plan.buckets is None and plan.cp > 1 and plan.pp == 1


def data_aware(result: SearchResult, params: CostParams = DEFAULT_PARAMS, top: int | None = None,
               one_shape: RankedPlan | None = None, base_pool: list[Plan] | None = None) -> None:
    """Add fitting bucket plans to ``result``'s ranking (one cluster: the first), cut it to ``top``
    (default: its length; the driver collects POOL one-shape plans for the bases, whatever
    ``top``) and record the stage in ``result.data_aware``; ``one_shape``: the best one-shape plan
    the runtime runs (what the bucket plans are compared with; else the best in the ranking)."""
    work = result.work
    top = len(result.plans) if top is None else top
    if not work.varied or not result.plans:
        result.plans = result.plans[:top]
        return
    t0 = time.perf_counter()
    cluster = result.plans[0].cluster
    bases = pick_bases(result, params, base_pool)
    cands: list[Plan] = []
    for b in bases:
        for c in candidates(b, work):
            micro = microbatches(work.global_batch, c.dp, c.micro_batch)
            if c not in cands and export_targets(c, micro, result.model) is None:
                cands.append(c)  # (the runtime runs it as planned: spec.support)
    info: dict[str, Any] = {"bases": [b.short() for b in bases], "candidates": len(cands), "fitting": 0,
                            "best": None, "best_one_shape": None}
    runnable = [p for p in result.plans if not _needs_buckets(p.plan) and p.export_only is None]
    runnable += [one_shape] if one_shape is not None else []
    if runnable:
        one = min(runnable, key=lambda p: rank_key(p, result.objective))
        info["best_one_shape"] = {"plan": one.plan.short(), "step_time_s": one.report.step_time_s}
    ranked: list[RankedPlan] = []
    fitting: list[int] = []
    r: dict[str, np.ndarray] = {}
    if cands:
        r = estimate_batch(result.model, cluster, work, cands, params)
        ok = r["fits"] & np.isfinite(r["step_time_s"]) & np.asarray(r["host_fits"], dtype=bool)
        if result.headroom:
            ok &= ~np.asarray(r["at_risk"], dtype=bool)
        for i in np.argsort(r["step_time_s"]):
            if not ok[i]:
                continue
            plan = cands[int(i)]
            try:
                report = estimate(result.model, cluster, plan, work, params)
            except Exception:  # noqa: BLE001 - a sub-plan the cost model's checks refuse
                continue
            fitting.append(int(i))
            if len(ranked) < top:
                usd = float(usd_per_million_tokens(plan.num_gpus, cluster.price_per_hour, report.step_time_s,
                                                   work.tokens))
                ranked.append(RankedPlan(rank=0, plan=plan, cluster=cluster, report=report, usd_per_mtok=usd))
        info["fitting"] = len(fitting)
        if ranked:
            best = min(ranked, key=lambda p: rank_key(p, result.objective))
            info["best"] = {"plan": best.plan.short(), "step_time_s": best.report.step_time_s}
    # one-shape plans with cp > 1 and no pipeline: meshplan's runtime splits a micro-batch of its own
    # width into cp chunks only under a bucket plan (their single-bucket twins are among the candidates)
    keep = [p for p in result.plans if not _needs_buckets(p.plan)]
    info["replaced"] = sum(1 for p in result.plans[:top] if _needs_buckets(p.plan))
    merged = sorted(keep + ranked, key=lambda p: rank_key(p, result.objective))[:top]
    result.plans = [dataclasses.replace(p, rank=k + 1) for k, p in enumerate(merged)]
    result.other_plans = result.other_plans[:top]
    _pareto_with(result, cands, r, fitting, cluster)
    po = result.passed_over
    if po is not None:
        best_now = result.plans[0].report.step_time_s if result.plans else float("inf")
        if _needs_buckets(parse_plan(po["plan"])) or po["step_time_s"] >= best_now:
            result.passed_over = None
    info["pipelines_padded"] = sum(1 for p in result.plans if p.plan.pp > 1)
    info["time_s"] = time.perf_counter() - t0
    result.data_aware = info


def _pareto_with(result: SearchResult, cands: list[Plan], r: dict[str, np.ndarray], fitting: list[int],
                 cluster: Any) -> None:
    """The Pareto front (time, memory, $) without the one-shape plans the runtime refuses, with the
    fitting bucket plans."""
    pts = [q for q in result.pareto if not _needs_buckets(q.plan)]
    for i in fitting:
        t = float(r["step_time_s"][i])
        pts.append(ParetoPoint(cands[i], t, float(r["peak_memory_gib"][i]),
                               float(usd_per_million_tokens(cands[i].num_gpus, cluster.price_per_hour, t,
                                                            result.work.tokens))))
    if not pts:
        result.pareto = []
        return
    arr = np.asarray([[q.step_time_s, q.peak_memory_gib, q.usd_per_mtok] for q in pts])
    keep = np.nonzero(pareto_mask(arr))[0]
    result.pareto = sorted((pts[int(k)] for k in keep), key=lambda q: (q.step_time_s, q.peak_memory_gib))
