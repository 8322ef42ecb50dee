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
           "spec_from_durations", "spec_from_plan", "trace_dict",
           "write_plot", "write_trace"]


def simulate_plan(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                  params: CostParams = DEFAULT_PARAMS) -> tuple[SimResult, dict[str, Any]]:
    """Simulate one step of ``plan``; returns the result and a summary dict that also carries
    the analytical estimate (``analytic_step_time_s``) and the relative difference."""
    spec, d = spec_from_plan(model, cluster, plan, work, params)
    return run_and_summarise(spec, d)
