"""Pipeline schedules: micro-batches in flight per stage, and the bubble of a step.

Step time of a pipeline of stages with per-micro-batch times T_i (forward + backward) and
m micro-batches (Narayanan et al. 2021; Qi et al. 2023 for zero bubble):
  GPipe, 1F1B:          m max_i T_i + (sum_i T_i - max_i T_i)
  interleaved (v):      m max_i T_i + (sum_i T_i - max_i T_i) / v
  zero bubble (ZB-H1):  bubble x (F + B - W)/(F + B + W), about 1/3 of 1F1B
  ZBV:                  bubble of ZB-H1 halved (V-shape, two chunks per rank)
"""
from __future__ import annotations

from typing import Any

import numpy as np

from meshplan.spec.plan import Plan

Num = Any  # a float, or a numpy array of one value per plan (and per stage)


def in_flight_array(pp: Num, v: Num, schedule: Num, stage: Num, microbatches: Num) -> np.ndarray:
    """Micro-batches whose activations pipeline stage ``stage`` holds at its peak.

    1F1B: min(m, pp - stage); interleaved (v > 1): Megatron's warm-up count of chunks / v;
    GPipe: m; ZBV: min(m, pp); no pipeline: 1."""
    m = np.asarray(microbatches, dtype=float)
    one_f = np.minimum(m, pp - stage)
    inter = np.minimum(m * v, (pp - stage - 1) * 2 + (v - 1) * pp + 1) / v
    out = np.where(schedule == "gpipe", m, np.where((schedule == "interleaved-1f1b") & (v > 1), inter,
                   np.where(schedule == "zbv", np.minimum(m, pp), one_f)))
    return np.where(pp == 1, 1.0, out)


def bubble_array(total: Num, tmax: Num, pp: Num, v: Num, schedule: Num, w_fraction: Num) -> np.ndarray:
    """Bubble seconds of a step from the per-micro-batch stage times' sum and maximum.

    w_fraction: share of the weight-gradient pass in a micro-batch (zero-bubble fills with it)."""
    bubble = np.where(pp == 1, 0.0, total - tmax)
    bubble = np.where(schedule == "interleaved-1f1b", bubble / v, bubble)
    zb = (schedule == "zero-bubble") | (schedule == "zbv")
    return np.where(zb, bubble * np.maximum(0, 1 - 2 * w_fraction) / np.where(schedule == "zbv", 2, 1),
                    bubble)


def in_flight(plan: Plan, stage: int, microbatches: int) -> float:
    """in_flight_array for one plan and one stage."""
    return float(in_flight_array(plan.pp, plan.virtual_stages, np.asarray(plan.schedule), stage,
                                 microbatches))


def pipeline_time(stage_totals: list[float], microbatches: int, plan: Plan,
                  w_fraction: float) -> tuple[float, float]:
    """(busy time, bubble time) of the pipeline for one step.

    stage_totals: forward + backward seconds of one micro-batch on each stage.
    """
    tmax, total = max(stage_totals), sum(stage_totals)
    bubble = bubble_array(total, tmax, plan.pp, plan.virtual_stages, np.asarray(plan.schedule),
                          w_fraction)
    return microbatches * tmax, float(bubble)
