"""Pipeline schedules: stage layer split, micro-batches in flight, and step time.

Step time of a pipeline of stages with per-micro-batch times T_i (forward + backward) and
m micro-batches (Narayanan et al. 2021; Qi et al. 2023 for zero bubble):
  GPipe, 1F1B:          m max_i T_i + (sum_i T_i - max_i T_i)
  interleaved (v):      m max_i T_i + (sum_i T_i - max_i T_i) / v
  zero bubble (ZB-H1):  bubble x (F + B - W)/(F + B + W), about 1/3 of 1F1B
  ZBV:                  bubble of ZB-H1 halved (V-shape, two chunks per rank)
"""
from __future__ import annotations

from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan


def stage_layers(model: ModelSpec, plan: Plan) -> tuple[int, ...]:
    """Transformer blocks on each pipeline stage (explicit, or an even split)."""
    if plan.stage_layers is not None:
        return plan.stage_layers
    base, extra = divmod(model.num_layers, plan.pp)
    return tuple(base + (1 if i < extra else 0) for i in range(plan.pp))


def in_flight(plan: Plan, stage: int, microbatches: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak."""
    pp, v, m = plan.pp, plan.virtual_stages, microbatches
    if pp == 1:
        return 1.0
    if plan.schedule == "gpipe":
        return float(m)
    if plan.schedule == "interleaved-1f1b" and v > 1:
        chunks = min(m * v, (pp - stage - 1) * 2 + (v - 1) * pp + 1)
        return chunks / v
    if plan.schedule == "zbv":
        return float(min(m, pp))
    return float(min(m, pp - stage))


def pipeline_time(stage_totals: list[float], microbatches: int, plan: Plan,
                  w_fraction: float) -> tuple[float, float]:
    """(busy time, bubble time) of the pipeline for one step.

    stage_totals: forward + backward seconds of one micro-batch on each stage.
    w_fraction: share of the weight-gradient pass in a micro-batch (zero-bubble fills with it).
    """
    tmax, total = max(stage_totals), sum(stage_totals)
    busy = microbatches * tmax
    if plan.pp == 1:
        return busy, 0.0
    bubble = total - tmax
    if plan.schedule == "interleaved-1f1b":
        bubble /= plan.virtual_stages
    elif plan.schedule in ("zero-bubble", "zbv"):
        bubble *= max(0.0, 1.0 - 2.0 * w_fraction)
        if plan.schedule == "zbv":
            bubble /= 2.0
    return busy, bubble
