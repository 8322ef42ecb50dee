"""Simulation of a plan on a layer graph (any ingested model): the same engine, the durations of
``cost.graph_durations``.

    simulate_graph_plan(graph, cluster, plan, work) -> (SimResult, summary)   # as simulate_plan

``spec_from_durations`` gives the ranks' once-per-step work, the schedule, the send and the
overhead; the virtual stages are the graph's own chunks (each the sum of its layers: an
embedding, a head, unequal blocks), not a rank's total divided by v. The last layer, the loss
and a tied copy sit where the graph's cost model puts them (rank 0 under ZBV's V), so no
static memory moves between ranks. The simulator has one send size per pipeline: the mean
over the boundaries that cross ranks (a graph's boundaries may carry different tensors).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from meshplan.cost.graph_durations import ChunkDurations, GraphStageDurations, graph_stage_durations
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.sim.build import run_and_summarise, spec_from_durations
from meshplan.sim.engine import Pass, SimResult, SimSpec, VStage
from meshplan.sim.schedules import rank_chunk
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.plan import Plan, Workload

_SUMMED = tuple(f.name for f in dataclasses.fields(ChunkDurations)
                if f.name not in ("rank", "first_layer", "end_layer", "send_s"))


def _merge(chunks: list[ChunkDurations]) -> ChunkDurations:
    """One chunk of several on one rank (a pipeline of one rank runs its chunks as one stage)."""
    return dataclasses.replace(chunks[0], end_layer=chunks[-1].end_layer, send_s=0.0,
                               **{k: sum(getattr(c, k) for c in chunks) for k in _SUMMED})


def _stage(c: ChunkDurations) -> VStage:
    return VStage(fwd=Pass(c.fwd_s, c.tp_fwd_overlapped_s, c.tp_fwd_exposed_s, c.dp_fwd_overlapped_s,
                           c.dp_fwd_exposed_s),
                  bwd=Pass(c.bwd_input_s + c.recompute_s, c.tp_bwd_overlapped_s, c.tp_bwd_exposed_s,
                           c.dp_bwd_overlapped_s, c.dp_bwd_exposed_s),
                  wgt=Pass(c.bwd_weight_s), act_bytes=c.act_bytes)


def spec_from_graph(graph: LayerGraph, cluster: ClusterSpec, plan: Plan, work: Workload,
                    params: CostParams = DEFAULT_PARAMS) -> tuple[SimSpec, GraphStageDurations]:
    """The SimSpec of ``plan`` on ``graph`` (one virtual stage per model chunk) and its durations."""
    d = graph_stage_durations(graph, cluster, plan, work, params)
    spec = spec_from_durations(d)
    chunks = list(d.chunks)
    if len(chunks) != spec.pp * spec.v:  # e.g. pp=1 with virtual stages: one stage
        chunks = [_merge([c for c in chunks if c.rank == r]) for r in range(spec.pp)]
    for s, c in enumerate(chunks):
        if rank_chunk(spec.schedule, spec.pp, s)[0] != c.rank:  # the two placements must agree
            raise AssertionError(f"chunk {s} is on rank {c.rank} in the cost model, "
                                 f"{rank_chunk(spec.schedule, spec.pp, s)[0]} in the simulator")
    return dataclasses.replace(spec, stages=[_stage(c) for c in chunks]), d


def simulate_graph_plan(graph: LayerGraph, cluster: ClusterSpec, plan: Plan, work: Workload,
                        params: CostParams = DEFAULT_PARAMS) -> tuple[SimResult, dict[str, Any]]:
    """Simulate one step of ``plan`` on ``graph``; returns what ``simulate_plan`` returns: the
    result and a summary with the analytical estimate (``estimate_graph``'s step time) and the
    relative difference. Raises MeshplanError when the plan cannot run on the graph."""
    spec, d = spec_from_graph(graph, cluster, plan, work, params)
    return run_and_summarise(spec, d)
