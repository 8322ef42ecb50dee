"""Simulated steps of a data-aware bucket plan (spec/buckets.py) over sampled batches.

Each sampled batch (its own seed, not the cost model's draws): the step's lengths drawn, its
micro-batches formed and dealt with ``spec.buckets.bucket_layout`` (what the runtime runs), every
micro-batch timed by the simulator's engine on its bucket's sub-plan (cost.buckets.sub_plan) at
its own padded width and its own sample count (sim.engine: the step of two micro-batches less the
step of one, memoised), every rank's micro-batches run in the layout's order with each starting
when all ranks of its unit are free; the step ends at the busiest rank, then the once-per-step
work of the longest bucket's sub-plan with the gradient sync exposed (the runtime's closing pass
carries it; nothing hides it). The even-load step spreads the batch's work evenly over the ranks.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from meshplan.cost.buckets import bucket_plan_problem, sub_plan
from meshplan.cost.durations import stage_durations
from meshplan.cost.lengths import check_model, graph_at
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.errors import MeshplanError
from meshplan.sim.build import spec_from_durations
from meshplan.sim.engine import Event, SimResult, SimSpec, run
from meshplan.spec.axes import AX
from meshplan.spec.buckets import bucket_layout, model_knee
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

BUCKET_SEED = 0x51B0C4


class _Timer:
    """Seconds of one micro-batch (bucket, samples, width) and the once-per-step work, memoised."""

    def __init__(self, model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, params: CostParams,
                 work: Workload) -> None:
        self.model, self.cluster, self.plan, self.params, self.work = model, cluster, plan, params, work
        self.memo: dict[tuple[int, int, int], float] = {}
        self.buckets = plan.bucket_specs

    def spec(self, k: int, samples: int, width: int, micro: int) -> SimSpec:
        sub = sub_plan(self.plan, self.buckets[k], samples)
        w = self.work.shaped(sub.dp * samples * micro, int(width))
        d = stage_durations(graph_at(self.model, width), self.cluster, sub, w, self.params)
        return spec_from_durations(d, d.output_static_bytes)

    def micro_batch(self, k: int, samples: int, width: int) -> float:
        key = (k, samples, width)
        if key not in self.memo:
            one = run(self.spec(k, samples, width, 1)).step_time_s
            two = run(self.spec(k, samples, width, 2)).step_time_s
            self.memo[key] = two - one
        return self.memo[key]

    def rest(self, width: int) -> float:
        """Once-per-step seconds of the longest bucket's sub-plan at ``width``, its gradient sync
        exposed (the closing pass carries it)."""
        k = len(self.buckets) - 1
        b = self.buckets[k].micro_batch
        spec = self.spec(k, b, width, 1)
        hidden = max(r.end_dp_overlapped_s for r in spec.ranks)
        return run(spec).step_time_s - self.micro_batch(k, b, width) + hidden


@dataclasses.dataclass
class BucketSimResult:
    steps: np.ndarray
    even: np.ndarray
    batches: int
    seed: int
    rank_ends: np.ndarray
    """(batches, dp x cp) each rank's end of its micro-batches (before the once-per-step work)."""


def simulate_buckets(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                     params: CostParams = DEFAULT_PARAMS, *, batches: int = 100, seed: int = 0) -> BucketSimResult:
    """Simulate ``batches`` sampled batches of ``work`` under bucket plan ``plan``."""
    why = bucket_plan_problem(plan, work)
    if plan.buckets is None or why:
        raise MeshplanError(why or f"{plan.short()} has no buckets")
    check_model(model, work)
    dist = work.lengths
    assert dist is not None
    timer = _Timer(model, cluster, plan, params, work)
    rest = timer.rest(work.seq_len)
    knee = model_knee(model)
    rng = np.random.default_rng([seed, BUCKET_SEED])
    n = plan.dp * plan.cp
    steps, even, ends = np.empty(batches), np.empty(batches), np.empty((batches, n))
    for i in range(batches):
        lay = bucket_layout(dist.sample(work.global_batch, rng), plan.bucket_specs, plan.dp, plan.cp, knee)
        t = np.zeros(n)
        work_s = 0.0
        for mb in lay.micro_batches:  # the dealing order: on every rank, its run order
            d = timer.micro_batch(mb.bucket, len(mb.samples), mb.width)
            sl = slice(mb.unit * mb.cp, (mb.unit + 1) * mb.cp)
            t[sl] = t[sl].max() + d
            work_s += d * mb.cp
        ends[i] = t
        steps[i] = t.max() + rest
        even[i] = work_s / n + rest
    return BucketSimResult(steps, even, batches, seed, ends)


def bucket_timeline(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                    params: CostParams = DEFAULT_PARAMS, *, seed: int = 0) -> SimResult:
    """The first sampled batch of ``simulate_buckets(..., seed=seed)`` as a per-rank timeline (one
    row per dp x cp rank, for --trace / --plot): each micro-batch's forward and backward on the
    compute stream (named by bucket, samples, width and cp; drawn as 1/3 forward, 2/3 backward),
    the waits for context-parallel peers as gaps, then the closing
    pass's gradient sync (exposed) and the optimizer step."""
    why = bucket_plan_problem(plan, work)
    if plan.buckets is None or why:
        raise MeshplanError(why or f"{plan.short()} has no buckets")
    dist = work.lengths
    assert dist is not None
    timer = _Timer(model, cluster, plan, params, work)
    rest = timer.rest(work.seq_len)
    rng = np.random.default_rng([seed, BUCKET_SEED])
    lay = bucket_layout(dist.sample(work.global_batch, rng), plan.bucket_specs, plan.dp, plan.cp, model_knee(model))
    n = plan.dp * plan.cp
    t = np.zeros(n)
    events: list[Event] = []
    for j, mb in enumerate(lay.micro_batches):
        d = timer.micro_batch(mb.bucket, len(mb.samples), mb.width)
        members = range(mb.unit * mb.cp, (mb.unit + 1) * mb.cp)
        start = float(max(t[r] for r in members))
        what = f"mb {j} (bucket {mb.bucket}: {len(mb.samples)} x {mb.width} tokens, cp {mb.cp})"
        info = {"bucket": mb.bucket, "samples": len(mb.samples), "width": mb.width, AX.CP: mb.cp}
        fwd = d / 3  # forward : backward as 1 : 2 (drawn apart; timed as one micro-batch)
        for r in members:
            events.append(Event(r, "compute", f"F {what}", start, start + fwd, info))
            events.append(Event(r, "compute", f"B {what}", start + fwd, start + d, info))
            t[r] = start + d
    end = float(t.max())
    for r in range(n):
        events.append(Event(r, AX.DP, "gradient sync + optimizer (closing pass)", end, end + rest))
    return SimResult(step_time_s=end + rest, events=events, memory=[[(0.0, 0.0)] for _ in range(n)], pp=n,
                     wait_s=[end - float(x) for x in t], rank_label="dp x cp rank")
