"""From (model, cluster, plan, workload) to a SimSpec, every duration from the cost model."""
from __future__ import annotations

from typing import Any

from meshplan.cost.durations import StageDurations, stage_durations
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.sim.engine import Pass, RankStep, SimResult, SimSpec, VStage, run
from meshplan.sim.schedules import chunks_per_rank, rank_chunk
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload


def spec_from_durations(d: StageDurations, output_static_bytes: float = 0.0) -> SimSpec:
    """Split each rank's per-micro-batch durations over its chunks. The embedding stays on
    the first virtual stage and the output layer + loss on the last one, where ``d`` lists
    their pass pieces (``*_extra_s``) at ranks 0 and pp - 1. Under ZBV the V puts the last
    stage on rank 0: the output layer's passes land there with that stage, and its static
    memory, ``output_static_bytes`` (``cost.durations.output_static_bytes``), which
    ``cost.durations`` lists at rank pp - 1, moves to rank 0 here. The once-per-step work of
    each rank (gradient sync, optimizer, pipelined FSDP) and the parameter offload are taken
    as ``d`` places them (rank 0 holds the output layer's under ZBV): no move."""
    pp = d.pp
    sched = d.schedule if pp > 1 else "1f1b"
    v = chunks_per_rank(sched, pp, d.virtual_stages)
    nvs = pp * v
    stages = []
    for s in range(nvs):
        r, _ = rank_chunk(sched, pp, s)

        def part(total: list[float], extra: list[float], r: int = r, s: int = s) -> float:
            if pp == 1:
                return total[0]
            # the cost model's rank 0 holds the embedding, rank pp - 1 the output layer
            return (total[r] - extra[r]) / v + (s == 0) * extra[0] + (s == nvs - 1) * extra[pp - 1]

        fwd = Pass(part(d.fwd_s, d.fwd_extra_s), d.tp_fwd_overlapped_s[r] / v, d.tp_fwd_exposed_s[r] / v,
                   d.dp_fwd_overlapped_s[r] / v, d.dp_fwd_exposed_s[r] / v)
        bwd = Pass(part(d.bwd_input_s, d.bwd_input_extra_s) + d.recompute_s[r] / v,
                   d.tp_bwd_overlapped_s[r] / v, d.tp_bwd_exposed_s[r] / v,
                   d.dp_bwd_overlapped_s[r] / v, d.dp_bwd_exposed_s[r] / v)
        wgt = Pass(part(d.bwd_weight_s, d.bwd_weight_extra_s))
        stages.append(VStage(fwd, bwd, wgt, act_bytes=d.act_bytes_per_microbatch[r] / v))
    static = list(d.static_bytes)
    if sched == "zbv" and pp > 1:
        static[0] += output_static_bytes
        static[pp - 1] -= output_static_bytes
    ranks = [RankStep(d.staged_gather_s[r], d.staged_reduce_s[r], d.end_dp_exposed_s[r],
                      d.end_dp_overlapped_s[r], d.optimizer_s[r], static[r],
                      d.reserved_extra_bytes[r] if r < len(d.reserved_extra_bytes) else 0.0) for r in range(pp)]
    return SimSpec(pp=pp, v=v, microbatches=d.microbatches, schedule=sched,
                   stages=stages, ranks=ranks, send_s=d.p2p_send_s, send_exposed=d.p2p_exposed,
                   boundary_send_s=d.boundary_send_s,
                   overhead_s=d.overhead_s, overlap_slowdown=d.overlap_slowdown,
                   straggler_s=d.straggler_s, outer_sync_s=d.outer_sync_s,
                   outer_sync_full_s=d.outer_sync_full_s, sync_every=d.sync_every)


def spec_from_plan(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                   params: CostParams = DEFAULT_PARAMS) -> tuple[SimSpec, StageDurations]:
    """The SimSpec of ``plan`` and the cost model's durations it is built from."""
    d = stage_durations(model, cluster, plan, work, params)
    return spec_from_durations(d, d.output_static_bytes), d


def run_and_summarise(spec: SimSpec, d: StageDurations) -> tuple[SimResult, dict[str, Any]]:
    """Simulate ``spec`` and summarise it beside the analytical step time of its durations ``d``
    (``analytic_step_time_s`` and the relative difference ``sim_vs_analytic_pct``)."""
    res = run(spec)
    s = res.summary()
    a = d.analytic["step_time_s"]
    s |= {"analytic_step_time_s": a, "sim_vs_analytic_pct": 100 * (res.step_time_s / a - 1),
          "microbatches": d.microbatches, "schedule": spec.schedule, "virtual_stages": spec.v}
    return res, s
