"""From (model, cluster, plan, workload) to a SimSpec, every duration from the cost model."""
from __future__ import annotations

from meshplan.cost.durations import StageDurations, stage_durations
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.sim.engine import Pass, RankStep, SimSpec, VStage
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload


def spec_from_durations(d: StageDurations) -> SimSpec:
    """Split each rank's per-micro-batch durations over its v chunks (the embedding stays on
    chunk 0 of rank 0, the output layer and loss on the last chunk of the last rank)."""
    pp = d.pp
    v = d.virtual_stages if (d.schedule == "interleaved-1f1b" and pp > 1) else 1
    stages = []
    for s in range(pp * v):
        r, c = s % pp, s // pp
        holds_first, holds_last = (r == 0 and c == 0), (r == pp - 1 and c == v - 1)
        x = 1.0 if (holds_first or holds_last) else 0.0

        def part(total: float, extra: float, x: float = x) -> float:
            return (total - extra) / v + x * extra

        fwd = Pass(part(d.fwd_s[r], d.fwd_extra_s[r]), d.tp_fwd_overlapped_s[r] / v, d.tp_fwd_exposed_s[r] / v,
                   d.dp_fwd_overlapped_s[r] / v, d.dp_fwd_exposed_s[r] / v)
        bwd = Pass(part(d.bwd_input_s[r], d.bwd_input_extra_s[r]) + d.recompute_s[r] / v,
                   d.tp_bwd_overlapped_s[r] / v, d.tp_bwd_exposed_s[r] / v,
                   d.dp_bwd_overlapped_s[r] / v, d.dp_bwd_exposed_s[r] / v)
        wgt = Pass(part(d.bwd_weight_s[r], d.bwd_weight_extra_s[r]))
        stages.append(VStage(fwd, bwd, wgt, act_bytes=d.act_bytes_per_microbatch[r] / v))
    ranks = [RankStep(d.staged_gather_s[r], d.staged_reduce_s[r], d.end_dp_exposed_s[r],
                      d.end_dp_overlapped_s[r], d.optimizer_s[r], d.static_bytes[r]) for r in range(pp)]
    return SimSpec(pp=pp, v=v, microbatches=d.microbatches, schedule=d.schedule if pp > 1 else "1f1b",
                   stages=stages, ranks=ranks, send_s=d.p2p_send_s, send_exposed=d.p2p_exposed,
                   overhead_s=d.overhead_s)


def spec_from_plan(model: ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                   params: CostParams = DEFAULT_PARAMS) -> tuple[SimSpec, StageDurations]:
    d = stage_durations(model, cluster, plan, work, params)
    return spec_from_durations(d), d
