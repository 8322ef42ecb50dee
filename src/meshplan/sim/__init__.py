"""Discrete-event simulation of one training step (timelines, traces, memory over time).

Durations come from the analytical cost model (meshplan.cost.durations, for any model: a
LayerGraph, or a transformer description generated into one); the search ranks plans with
the analytical model, the simulator shows how a chosen plan runs. Numpy only.

``simulate`` is the one entry point, for any cluster, plan and workload; it dispatches once,
downward, through the package's layers (each imports only those below it): sim.engine (``run``: the
event loop of one SimSpec) <- sim.build (a plan's SimSpec from the cost model's durations) <-
sim.buckets (a bucket plan's sampled steps) <- sim.varlen (sampled steps of a length
distribution) <- sim.pools (a plan over several GPU pools, or uneven shares under a distribution).
"""
from __future__ import annotations

from typing import Any

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.sim.build import run_and_summarise, spec_from_durations, spec_from_plan
from meshplan.sim.engine import STREAMS, Pass, RankStep, SimResult, SimSpec, VStage, run
from meshplan.sim.output import trace_dict, write_plot, write_trace
from meshplan.sim.pools import simulate_pooled
from meshplan.sim.varlen import DEFAULT_BATCHES, sampled
from meshplan.spec.cluster import ClusterSpec, PooledCluster
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

__all__ = ["STREAMS", "VARIED_BATCHES", "Pass", "RankStep", "SimResult", "SimSpec", "VStage", "run", "simulate",
           "spec_from_durations", "spec_from_plan", "trace_dict", "write_plot", "write_trace"]

VARIED_BATCHES = DEFAULT_BATCHES
"""Sampled batches per simulated step of a length distribution (the default of ``simulate``)."""


def simulate(model: LayerGraph | ModelSpec, cluster: ClusterSpec | PooledCluster, plan: Plan, work: Workload,
             params: CostParams = DEFAULT_PARAMS, *, batches: int = VARIED_BATCHES,
             seed: int = 0) -> tuple[SimResult, dict[str, Any]]:
    """Simulate one step of ``plan``: (the timeline, a summary that also carries the analytical
    estimate, ``analytic_step_time_s``, and the relative difference, ``sim_vs_analytic_pct``).

    - one length on one pool: the step (sim.build);
    - a length distribution on one pool (a plan on one pool of several included): ``batches``
      sampled steps drawn with ``seed`` (sim.varlen, a bucket plan's by sim.buckets); ``step_time_s``
      is their mean, the timeline the first batch's; the summary adds ``sampled``, ``varlen``,
      ``analytic`` (cost.lengths_summary) and ``example_replica_lengths``;
    - a plan over several pools, or with dp_shares under a distribution (sim.pools): every pool's
      ranks on its own hardware, the pools' timelines one after another; the summary adds
      ``pools``, ``cross_pool_s``, ``imbalance_s`` and ``notes``."""
    one_pool = len(cluster.pools) == 1
    if work.varied and (plan.dp_shares is None or len(set(plan.replica_shares)) == 1) and (
            one_pool or (plan.pools is not None and len(plan.pools) == 1)):  # sampled steps on one pool
        pool = cluster.pool(plan.pools[0]) if plan.pools else cluster.pools[0]
        return sampled(model, pool, plan.replace(pools=None, dp_shares=None), work, params, batches=batches,
                       seed=seed)
    if one_pool and not work.varied:
        return run_and_summarise(*spec_from_plan(model, cluster, plan, work, params))
    sim = simulate_pooled(model, cluster, plan, work, params, batches=batches, seed=seed)
    return sim.result, sim.summary()
