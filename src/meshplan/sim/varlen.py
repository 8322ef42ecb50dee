"""Simulated steps of a workload whose samples have a distribution of lengths.

Each sampled batch: draw the global batch's sample lengths (seeded), form micro-batches as
spec/lengths.py defines them (and meshplan's runtime runs them: runtime.hetero.step_layout), give
each micro-batch the passes of a micro-batch of its padded length (cost.durations at that length,
memoised), simulate every data-parallel replica's pipeline with its own micro-batches
(sim.engine's per-micro-batch stages), and take the step as the slowest replica's end (its
gradient sync and optimizer step follow its last backward, so the sync waits for it). The
once-per-step work of a replica (gradient sync and its overlap, optimizer, outer sync) is that of
its last micro-batch's length; the straggler wait (a fraction of the compute per step) is the mean
over its micro-batches'.

The even-load step of a batch is the same simulation with every micro-batch of the step given
the mean of the step's micro-batches' passes; mean(step) - mean(even) is the simulated imbalance.

A one-length distribution (or packed) gives exactly sim.simulate's step at that length.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.cost import lengths_summary
from meshplan.cost.durations import StageDurations, stage_durations
from meshplan.cost.lengths import check_model, graph_at
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.errors import MeshplanError
from meshplan.sim.buckets import bucket_timeline, simulate_buckets
from meshplan.sim.build import spec_from_durations
from meshplan.sim.engine import Pass, RankStep, SimResult, SimSpec, VStage, run
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.lengths import LengthDist
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload, checked_microbatches

DEFAULT_BATCHES = 100
MAX_BATCHES = 100_000


def form_microbatches(lengths: np.ndarray, dp: int, micro_batch: int, packing: str) -> list[list[int]]:
    """Per data-parallel replica, the padded length of each of its micro-batches in the order it
    runs them. padded: replica r takes samples [r n, (r + 1) n) in data order (n = G / dp), cut into
    micro-batches of micro_batch; bucketed: all samples sorted (stable), cut into micro-batches in
    that order, micro-batch j to replica j mod dp."""
    G = len(lengths)
    b = micro_batch
    if packing == "bucketed":
        srt = np.sort(lengths, kind="stable")
        pads = srt[b - 1::b]  # each micro-batch's longest sample
        return [[int(x) for x in pads[r::dp]] for r in range(dp)]
    n = G // dp
    return [[int(lengths[r * n + k:r * n + k + b].max()) for k in range(0, n, b)] for r in range(dp)]


@dataclass
class VarlenResult:
    """Simulated steps over sampled batches (seconds)."""

    steps: np.ndarray
    even: np.ndarray
    batches: int
    seed: int
    packing: str
    lengths: str
    per_length: dict[int, float] = field(default_factory=dict)
    """The simulated step of a batch of one length (every sample of that length), per length."""
    example: SimSpec | None = None
    """The first sampled batch's slowest replica (for a trace or a plot)."""
    example_lengths: list[int] = field(default_factory=list)
    """Its micro-batches' padded lengths, in the order it runs them."""

    @property
    def mean_s(self) -> float:
        return float(self.steps.mean())

    def summary(self) -> dict[str, Any]:
        s = self.steps
        return {"batches": self.batches, "seed": self.seed, "lengths": self.lengths, "packing": self.packing,
                "mean_step_s": float(s.mean()), "p50_step_s": float(np.percentile(s, 50)),
                "p90_step_s": float(np.percentile(s, 90)), "min_step_s": float(s.min()),
                "max_step_s": float(s.max()), "mean_even_step_s": float(self.even.mean()),
                "imbalance_s": float(s.mean() - self.even.mean()),
                "step_at_length_s": {str(k): v for k, v in self.per_length.items()}}


Durations = Callable[[int], StageDurations]
"""The cost model's durations of the plan at one padded length (default: cost.durations on one
GPU type; sim.pools splices a pipeline over pools)."""


class _Lengths:
    """Durations and simulator pieces per padded length, memoised."""

    def __init__(self, model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                 params: CostParams, durations: Durations | None = None) -> None:
        self.model, self.cluster, self.plan, self.gb, self.params = model, cluster, plan, work.global_batch, params
        self.work = work
        self.durations = durations
        self.d: dict[int, StageDurations] = {}
        self.spec: dict[int, SimSpec] = {}

    def get(self, length: int) -> tuple[StageDurations, SimSpec]:
        if length not in self.d:
            w = self.work.shaped(self.gb, int(length))
            d = (self.durations(int(length)) if self.durations is not None else
                 stage_durations(graph_at(self.model, length), self.cluster, self.plan, w, self.params))
            self.d[length] = d
            self.spec[length] = spec_from_durations(d, d.output_static_bytes)
        return self.d[length], self.spec[length]


def _mean_pass(ps: list[Pass]) -> Pass:
    return Pass(*(float(np.mean([getattr(p, f) for p in ps])) for f in
                  ("compute", "tp_overlapped", "tp_exposed", "dp_overlapped", "dp_exposed")))


def _mean_stages(specs: list[SimSpec]) -> list[VStage]:
    out = []
    for s in range(len(specs[0].stages)):
        st = [sp.stages[s] for sp in specs]
        out.append(VStage(_mean_pass([x.fwd for x in st]), _mean_pass([x.bwd for x in st]),
                          _mean_pass([x.wgt for x in st]), float(np.mean([x.act_bytes for x in st]))))
    return out


def _mean_ranks(specs: list[SimSpec]) -> list[RankStep]:
    out = []
    for r in range(len(specs[0].ranks)):
        rk = [sp.ranks[r] for sp in specs]
        out.append(RankStep(*(float(np.mean([getattr(x, f) for x in rk])) for f in
                              ("staged_gather_s", "staged_reduce_s", "end_dp_exposed_s", "end_dp_overlapped_s",
                               "optimizer_s", "static_bytes"))))
    return out


def replica_spec(pieces: _Lengths, mbs: list[int]) -> SimSpec:
    """The SimSpec of one replica running micro-batches of padded lengths ``mbs`` in that order."""
    specs = [pieces.get(x)[1] for x in mbs]
    last = specs[-1]
    if all(x == mbs[0] for x in mbs):
        return last
    return SimSpec(pp=last.pp, v=last.v, microbatches=len(mbs), schedule=last.schedule, stages=last.stages,
                   ranks=last.ranks, send_s=last.send_s,
                   boundary_send_s=last.boundary_send_s, send_exposed=last.send_exposed, overhead_s=last.overhead_s,
                   overlap_slowdown=last.overlap_slowdown,
                   straggler_s=float(np.mean([s.straggler_s for s in specs])), outer_sync_s=last.outer_sync_s,
                   outer_sync_full_s=last.outer_sync_full_s, sync_every=last.sync_every,
                   mb_stages=[s.stages for s in specs])


def even_spec(pieces: _Lengths, all_mbs: list[int], m: int) -> SimSpec:
    """Every micro-batch the mean of the step's micro-batches (``all_mbs``: every replica's)."""
    specs = [pieces.get(x)[1] for x in all_mbs]
    base = specs[-1]
    return SimSpec(pp=base.pp, v=base.v, microbatches=m, schedule=base.schedule, stages=_mean_stages(specs),
                   ranks=_mean_ranks(specs), send_s=base.send_s,
                   boundary_send_s=base.boundary_send_s, send_exposed=base.send_exposed,
                   overhead_s=base.overhead_s, overlap_slowdown=base.overlap_slowdown,
                   straggler_s=float(np.mean([s.straggler_s for s in specs])),
                   outer_sync_s=float(np.mean([s.outer_sync_s for s in specs])),
                   outer_sync_full_s=base.outer_sync_full_s, sync_every=base.sync_every)


def simulate_lengths(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                     params: CostParams = DEFAULT_PARAMS, *, batches: int = DEFAULT_BATCHES,
                     seed: int = 0, durations: Durations | None = None) -> VarlenResult:
    """Simulate ``batches`` sampled batches of ``work`` (its length distribution) under ``plan`` (on
    one GPU type, or with ``durations``, the plan's durations at each length, from the stage above)."""
    if not 1 <= batches <= MAX_BATCHES:
        raise MeshplanError(f"--batches must be between 1 and {MAX_BATCHES:,}; got {batches}")
    if plan.dp_shares is not None or plan.pools is not None:
        raise MeshplanError("simulating a length distribution with dp_shares or pools is not supported",
                            hint="simulate the plan without them, or with one length")
    if plan.buckets is not None:  # a data-aware plan: sim.buckets times every rank of the layout
        b = simulate_buckets(model, cluster, plan, work, params, batches=batches, seed=seed)
        d = work.lengths
        return VarlenResult(b.steps, b.even, batches, seed, d.packing if d else "padded",
                            d.text() if d else str(work.seq_len))
    check_model(model, work)
    m = checked_microbatches(plan, work.global_batch)
    dist: LengthDist | None = work.lengths
    pieces = _Lengths(model, cluster, plan, work, params, durations)
    per_length = {}
    if dist is None or not work.varied or (plan.pp > 1 and not params.pipeline_variable_shapes):
        # one length, packed, or a pipeline of one shape (every micro-batch padded to the longest)
        spec = pieces.get(work.seq_len)[1]
        step = run(spec).step_time_s
        steps = np.full(batches, step)
        per_length[work.seq_len] = step
        return VarlenResult(steps, steps.copy(), batches, seed, dist.packing if dist else "padded",
                            dist.text() if dist else str(work.seq_len), per_length, spec, [work.seq_len] * m)
    rng = np.random.default_rng(seed)
    memo: dict[tuple[int, ...], float] = {}

    def step_of(spec_key: tuple[int, ...], make: Any) -> float:
        if spec_key not in memo:
            memo[spec_key] = run(make()).step_time_s
        return memo[spec_key]

    steps, even = np.empty(batches), np.empty(batches)
    example: list[int] = []
    for k in range(batches):
        lengths = dist.sample(work.global_batch, rng)
        reps = form_microbatches(lengths, plan.dp, plan.micro_batch, dist.packing)
        each = [step_of(tuple(r), lambda r=r: replica_spec(pieces, r)) for r in reps]
        steps[k] = max(each)
        if k == 0:
            example = reps[int(np.argmax(each))]
        flat = [x for r in reps for x in r]
        counts = tuple(int((np.asarray(flat) == L).sum()) for L in dist.lengths)
        even[k] = step_of((-1, *counts), lambda flat=flat: even_spec(pieces, flat, m))
    for L in dist.lengths:
        per_length[L] = run(pieces.get(L)[1]).step_time_s
    return VarlenResult(steps, even, batches, seed, dist.packing, dist.text(), per_length,
                        replica_spec(pieces, example), example)


def varied_timeline(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                    params: CostParams, example: SimSpec, seed: int) -> tuple[SimResult, str]:
    """(timeline, what it shows) of the first sampled batch of a length distribution: a bucket
    plan's every dp x cp rank (sim.buckets), else ``example``, simulate_lengths' slowest replica."""
    if plan.buckets is not None:
        return (bucket_timeline(model, cluster, plan, work, params, seed=seed),
                "every data-parallel x context-parallel rank of the first sampled batch")
    return run(example), "the slowest replica of the first sampled batch"


def sampled(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
            params: CostParams = DEFAULT_PARAMS, *, batches: int = DEFAULT_BATCHES, seed: int = 0,
            durations: Durations | None = None, analytic: dict[str, Any] | None = None) -> tuple[SimResult, dict[str, Any]]:
    """A step under a length distribution: ``batches`` sampled steps (simulate_lengths; a bucket
    plan's by sim.buckets) beside the cost model's expected step (``analytic``: default
    cost.lengths_summary of the plan on ``cluster``), and as the timeline the first sampled batch (a
    bucket plan: every dp x cp rank; else the slowest replica). The summary has a one-length
    step's keys (``step_time_s``: the mean sampled step), ``sampled`` (batches, seed, lengths,
    packing, p50/p90, imbalance, what the timeline shows), ``varlen`` (every statistic of the
    sampled steps), ``analytic`` and ``example_replica_lengths``."""
    res = simulate_lengths(model, cluster, plan, work, params, batches=batches, seed=seed, durations=durations)
    est = lengths_summary(model, cluster, plan, work, params) if analytic is None else analytic
    ex, shows = varied_timeline(model, cluster, plan, work, params, res.example, seed)
    rs = res.summary()
    mean, a = rs["mean_step_s"], est["expected_step_s"]
    s = ex.summary()
    s |= {"step_time_s": mean, "analytic_step_time_s": a, "sim_vs_analytic_pct": 100 * (mean / a - 1),
          "microbatches": "varied", "schedule": plan.schedule if plan.pp > 1 else "none",
          "virtual_stages": plan.virtual_stages if plan.pp > 1 else 1,
          "sampled": {"batches": rs["batches"], "seed": rs["seed"], "lengths": est["lengths"],
                      "packing": est["packing"], "p50_step_s": rs["p50_step_s"], "p90_step_s": rs["p90_step_s"],
                      "imbalance_s": rs["imbalance_s"], "timeline": shows,
                      "timeline_step_s": ex.step_time_s},
          "varlen": rs, "analytic": est, "example_replica_lengths": res.example_lengths}
    return ex, s
