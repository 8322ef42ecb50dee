"""Discrete-event simulation of one training step (timelines, traces, memory over time).

Durations come from the analytical cost model (meshplan.cost.durations, for any model: a
LayerGraph, or a transformer description generated into one); the search ranks plans with
the analytical model, the simulator shows how a chosen plan runs. Numpy only.
"""
from __future__ import annotations

from typing import Any

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.sim.build import run_and_summarise, spec_from_durations, spec_from_plan
from meshplan.sim.engine import STREAMS, Pass, RankStep, SimResult, SimSpec, VStage, simulate
from meshplan.sim.output import trace_dict, write_plot, write_trace
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

__all__ = ["STREAMS", "Pass", "RankStep", "SimResult", "SimSpec", "VStage", "simulate", "simulate_plan",
           "simulate_varied", "spec_from_durations", "varied_timeline", "spec_from_plan", "trace_dict",
           "write_plot", "write_trace"]


def simulate_plan(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                  params: CostParams = DEFAULT_PARAMS) -> tuple[SimResult, dict[str, Any]]:
    """Simulate one step of ``plan``; returns the result and a summary dict that also carries
    the analytical estimate (``analytic_step_time_s``) and the relative difference."""
    spec, d = spec_from_plan(model, cluster, plan, work, params)
    return run_and_summarise(spec, d)


VARIED_BATCHES = 100
"""Sampled batches per simulated step of a length distribution (the report's, a pooled simulation's)."""


def varied_timeline(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                    params: CostParams, example: SimSpec, seed: int) -> tuple[SimResult, str]:
    """(timeline, what it shows) of the first sampled batch of a length distribution: a bucket
    plan's every dp x cp rank (sim.buckets), else ``example``, sim.varlen's slowest replica."""
    if plan.buckets is not None:
        from meshplan.sim.buckets import bucket_timeline
        return (bucket_timeline(model, cluster, plan, work, params, seed=seed),
                "every data-parallel x context-parallel rank of the first sampled batch")
    return simulate(example), "the slowest replica of the first sampled batch"


def simulate_varied(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                    params: CostParams = DEFAULT_PARAMS, *, batches: int = VARIED_BATCHES,
                    seed: int = 0) -> tuple[SimResult, dict[str, Any]]:
    """``simulate_plan`` for a workload with a length distribution: ``batches`` sampled steps
    (sim.varlen; a bucket plan's by sim.buckets) beside the cost model's expected step, and as
    the timeline the first sampled batch (a bucket plan: every dp x cp rank; else the slowest
    replica). The summary has simulate_plan's keys (``step_time_s``: the mean sampled step) and
    ``sampled`` (batches, seed, lengths, packing, p50/p90, imbalance, what the timeline shows)."""
    from meshplan.cost.lengths import lengths_summary
    from meshplan.sim.varlen import simulate_lengths
    res = simulate_lengths(model, cluster, plan, work, params, batches=batches, seed=seed)
    est = lengths_summary(model, cluster, plan, work, params)
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
                      "timeline_step_s": ex.step_time_s}}
    return ex, s
