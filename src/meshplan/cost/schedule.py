"""Pipeline schedules: micro-batches in flight per stage, and the bubble of a step.

Step time of a pipeline of stages with per-micro-batch times T_i (forward + backward) and
m micro-batches (Narayanan et al. 2021):
  GPipe, 1F1B:          m max_i T_i + (sum_i T_i - max_i T_i)
  interleaved (v):      m max_i T_i + (sum_i T_i - max_i T_i) / v

The split-backward schedules (zero-bubble = ZB-H1, zbv = ZB-V; Qi et al. 2024) run the
backward as B (input gradients) and W (weight gradients). Their bubble follows the order in
which torch.distributed.pipelining runs them (ScheduleInterleavedZeroBubble with one chunk
per rank, ScheduleZBVZeroBubble), which ``meshplan.sim`` reproduces. With per-micro-batch
F, B, W seconds of a rank (f, b, w: of one ZBV chunk, half a rank), n = pp - 1 and
j = min(m, pp) - 1, on uniform stages:

  ZB-H1: n (F + B) - j min(F, B, W)                      (= n (F + B - W) for W <= F, B, m >= pp)
  ZBV, m <= pp:        2n (f + b) - j min(2f, f + b, 2b + 2w, 3b + w)
  ZBV, m >= 2pp - 1:   max(n b, 2n (b - w), b + (n-1) w, f + (n-1) w, (2n-1) f - (n-1) b,
                           2n f - n b - w, 2n f - (2n+1) w, (2n-1) f + b - 2n w)
                       (= n max(b, 2 (b - w)) when f <= b and w <= b: transformer blocks)
  ZBV, pp < m < 2pp-1: max(2n b - 2 (m - pp) w, n b + (2pp - 1 - m)(b - w), the m >= 2pp - 1 form)
                       (exact for f <= b, w <= b; otherwise within a few % of the step)

Every form is a path through the schedule's dependency graph (derived from the simulator's
critical paths and checked against it on random stages, tests/unit/test_schedule_bubble.py).
With one rank heavier than the others (the output layer on the last rank, or on rank 0
under ZBV's V), the heavy rank's slack shortens the bubble: ``split_backward_bubble`` takes
the larger of the others' pace (the uniform form on the other ranks' mean, plus the heavy
rank's extra forward and input-gradient time once) and the heavy rank's own pace (idle at
its start and end, the W passes it can shift into them); see that function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.spec.plan import Plan

Num = Any  # a float, or a numpy array of one value per plan (and per stage)

SPLIT_BACKWARD = ("zero-bubble", "zbv")
"""Schedules that run the weight gradients (W) apart from the input gradients (B)."""


def in_flight_array(pp: Num, v: Num, schedule: Num, stage: Num, microbatches: Num) -> np.ndarray:
    """Micro-batches whose activations pipeline stage ``stage`` holds at its peak.

    1F1B: min(m, pp - stage); interleaved (v > 1): Megatron's warm-up count of chunks / v;
    GPipe: m; zero-bubble (ZB-H1 in torch's order: a rank keeps a micro-batch's activations
    until its W, which rank r runs r steps late): min(m, pp) on every rank; ZBV (two chunks
    of half a rank's activations each, freed by W): min(2m, m + stage + 1, 2pp) / 2;
    no pipeline: 1. All are counts of torch's/Megatron's orders (tests compare with the
    simulator's memory over time)."""
    m = np.asarray(microbatches, dtype=float)
    one_f = np.minimum(m, pp - stage)
    inter = np.minimum(m * v, (pp - stage - 1) * 2 + (v - 1) * pp + 1) / v
    zbv = np.minimum(np.minimum(2 * m, m + stage + 1), 2 * pp) / 2
    out = np.where(schedule == "gpipe", m, np.where((schedule == "interleaved-1f1b") & (v > 1), inter,
                   np.where(schedule == "zbv", zbv, np.where(schedule == "zero-bubble", np.minimum(m, pp), one_f))))
    return np.where(pp == 1, 1.0, out)


@dataclass(frozen=True)
class RankPasses:
    """Per-micro-batch seconds of the forward (F), input-gradient (B, with recompute and the
    exposed communication of the backward) and weight-gradient (W) passes, one value per row:
    the critical rank ``crit`` (largest F + B + W), its own passes, the mean of the other
    ranks' (``*_o``) and, for ZBV, the critical rank's two chunks (``chunk0``: virtual stage
    crit, ``chunk1``: virtual stage 2 pp - 1 - crit; each (f, b, w))."""

    crit: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    wgt: np.ndarray
    fwd_o: np.ndarray
    bwd_o: np.ndarray
    wgt_o: np.ndarray
    chunk0: tuple[np.ndarray, np.ndarray, np.ndarray]
    chunk1: tuple[np.ndarray, np.ndarray, np.ndarray]


def rank_passes(fwd: Num, bwd: Num, wgt: Num, valid: Num, chunk1: tuple[Num, Num, Num] | None = None) -> RankPasses:
    """RankPasses from per-rank arrays of shape (rows, stages) (stages beyond a row's pp masked
    out by ``valid``). ``chunk1``: the same arrays for each rank's second ZBV chunk (default:
    half of the rank)."""
    fwd, bwd, wgt = (np.where(valid, np.asarray(x, dtype=float), 0.0) for x in (fwd, bwd, wgt))
    valid = np.broadcast_to(valid, fwd.shape)
    total = np.where(valid, fwd + bwd + wgt, -np.inf)
    crit = np.argmax(total, axis=1)
    rows = np.arange(len(crit))
    others = np.maximum(1, valid.sum(axis=1) - 1)
    pick = [x[rows, crit] for x in (fwd, bwd, wgt)]
    mean = [(x.sum(axis=1) - c) / others for x, c in zip((fwd, bwd, wgt), pick)]
    c1 = tuple(c / 2 for c in pick) if chunk1 is None else tuple(np.asarray(x, dtype=float)[rows, crit] for x in chunk1)
    c0 = tuple(c - d for c, d in zip(pick, c1))
    return RankPasses(crit=crit, fwd=pick[0], bwd=pick[1], wgt=pick[2], fwd_o=mean[0], bwd_o=mean[1],
                     wgt_o=mean[2], chunk0=c0, chunk1=c1)  # type: ignore[arg-type]


def zb_h1_uniform(pp: Num, m: Num, F: Num, B: Num, W: Num) -> Num:
    """ZB-H1 bubble in torch's order on uniform stages (F, B, W per rank): exact for all m."""
    return (pp - 1) * (F + B) - (np.minimum(m, pp) - 1) * np.minimum(np.minimum(F, B), W)


def zbv_uniform(pp: Num, m: Num, f: Num, b: Num, w: Num) -> Num:
    """ZBV bubble in torch's order on uniform stages (f, b, w per chunk): the module's forms."""
    n = pp - 1
    j = np.minimum(m, pp) - 1
    least = np.minimum(np.minimum(2 * f, f + b), np.minimum(2 * b + 2 * w, 3 * b + w))
    few = 2 * n * (f + b) - j * least
    full = np.maximum.reduce([n * b, 2 * n * (b - w), b + (n - 1) * w, f + (n - 1) * w,
                              (2 * n - 1) * f - (n - 1) * b, 2 * n * f - n * b - w,
                              2 * n * f - (2 * n + 1) * w, (2 * n - 1) * f + b - 2 * n * w])
    k = np.minimum(m, 2 * pp - 1)
    mid = np.maximum(np.maximum(2 * n * b - 2 * (k - pp) * w, n * b + (2 * pp - 1 - k) * (b - w)), full)
    # pp < m < 2pp - 1 outside f <= b, w <= b: at most the straight line from m = pp to 2pp - 1
    line = 2 * n * (f + b) - n * least + (k - pp) / np.maximum(n, 1) * (full - 2 * n * (f + b) + n * least)
    return np.where(m <= pp, few, np.minimum(mid, line))


def split_backward_bubble(pp: Num, m: Num, zbv: Num, t: RankPasses) -> np.ndarray:
    """Bubble seconds (step - m x the critical rank's F + B + W) of ZB-H1 (``zbv`` False) or
    ZBV rows in torch's order, the larger of two critical paths:

    - the others' pace: the uniform form on the other ranks' mean (o), minus m (T_c - T_o),
      plus the critical rank's extra forward and input-gradient time, once (ZBV: of its
      heavier chunk, or rank 0's warm-up forwards, min(m, 2pp - 1) of chunk 0, then one pass
      of each chunk);
    - the critical rank's pace (c = its index, q = pp - 1 - c; capital: its per-rank times):
      ZB-H1: c F_o + start + end, start = max(0, q (F_o + B_o) - k F_c,
      (q + k)(F_o + B_o) - k T_c, (q - m + 1)+ (F_o + B_o)) with k = min(m - 1, q) (it waits
      for its first input-gradients), end = max(0, c B_o + W_o - min(m, c + 1) W_c) (the
      last input-gradient travels to rank 0, while the critical rank runs its late Ws);
      ZBV, critical rank 0 (the usual one: it holds the embedding and the output layer),
      chunks (f0, b0, w0), (f1, b1, w1), others per chunk (f, b, w) = o / 2, n = pp - 1:
        base = (2pp - 1 - m)+ f + (f - f0) if m < 2pp - 1 is even   (rank 0's warm-up wait)
        m <= pp:  base + max(0, a, a + 2j (b + w) - j (f1 + b1 + w1), 2 (n - j) b + w - w1),
                  a = 2n b + w - j (b0 + w0) - w1, j = m - 1
        pp < m < 2pp - 1:  base + max(0, E),  E = 2n b - n (b0 + w0) - w1
        m >= 2pp - 1:  max(0, E, (n + 1) b + (2n + 1) w - (n + 1)(b0 + w0) - w1,
                          f + 4n b + w - f0 - n (b0 + w0) - n (f1 + b1 + w1) - 2 w1)
      (E: the last micro-batch's input gradient down the V and back while rank 0 runs its
      cool-down B and W passes); ZBV, other critical ranks (uneven stage splits): c f.
    Both are exact on uniform stages; with one heavy rank (ZB-H1: the last; ZBV: rank 0) they
    are exact or within ~1% of the step; with several near-critical ranks the others' mean
    understates the others (docs/simulation.md gives the error statistics)."""
    m = np.asarray(m, dtype=float)
    pp = np.asarray(pp, dtype=float)
    n, c = pp - 1, t.crit.astype(float)
    Tc = t.fwd + t.bwd + t.wgt
    To = t.fwd_o + t.bwd_o + t.wgt_o
    # ZB-H1 (per rank)
    Fo, Bo, Wo = t.fwd_o, t.bwd_o, t.wgt_o
    q = n - c
    k = np.minimum(m - 1, q)
    h_others = zb_h1_uniform(pp, m, Fo, Bo, Wo) + m * (To - Tc) + (t.fwd - Fo) + (t.bwd - Bo)
    start = np.maximum.reduce([np.zeros_like(Tc), q * (Fo + Bo) - k * t.fwd, (q + k) * (Fo + Bo) - k * Tc,
                               np.maximum(0, q - m + 1) * (Fo + Bo)])
    end = np.maximum(0, c * Bo + Wo - np.minimum(m, c + 1) * t.wgt)
    h1 = np.maximum(h_others, c * Fo + start + end)
    # ZBV (per chunk)
    f, b, w = Fo / 2, Bo / 2, Wo / 2
    (f0, b0, w0), (f1, b1, w1) = t.chunk0, t.chunk1
    excess = np.maximum(f0 + b0, f1 + b1) - f - b
    warm = np.minimum(m, 2 * pp - 1) * (f0 - f) + (b0 - b) + (w0 - w) + (f1 - f) + (b1 - b)
    excess = np.where(c == 0, np.maximum(excess, warm), excess)
    v_others = zbv_uniform(pp, m, f, b, w) + m * (To - Tc) + excess
    base = np.maximum(0, 2 * pp - 1 - m) * f + np.where((m < 2 * pp - 1) & (m % 2 == 0), f - f0, 0.0)
    E = 2 * n * b - n * (b0 + w0) - w1
    j = m - 1
    a = 2 * n * b + w - j * (b0 + w0) - w1
    few = base + np.maximum.reduce([np.zeros_like(a), a, a + 2 * j * (b + w) - j * (f1 + b1 + w1),
                                    2 * (n - j) * b + w - w1])
    full = np.maximum.reduce([np.zeros_like(E), E, (n + 1) * b + (2 * n + 1) * w - (n + 1) * (b0 + w0) - w1,
                              f + 4 * n * b + w - f0 - n * (b0 + w0) - n * (f1 + b1 + w1) - 2 * w1])
    rank0 = np.where(m <= pp, few, np.where(m < 2 * pp - 1, base + np.maximum(0, E), full))
    v_crit = np.where(c == 0, rank0, c * f)
    vb = np.maximum(v_others, v_crit)
    return np.where(pp == 1, 0.0, np.where(zbv, vb, h1))


def bubble_array(total: Num, tmax: Num, pp: Num, v: Num, schedule: Num, w_fraction: Num,
                 microbatches: Num = None, passes: RankPasses | None = None) -> np.ndarray:
    """Bubble seconds of a step from the per-micro-batch stage times' sum and maximum.

    GPipe, 1F1B: sum - max; interleaved: / v. Zero-bubble and ZBV: ``split_backward_bubble``
    of ``passes`` (the ranks' F, B, W) with ``microbatches``. Without them (callers that know
    only w_fraction, the weight-gradient share of a micro-batch), the paper's uniform-stage
    forms: (sum - max)(1 - 2 w_fraction), halved for ZBV; they have no m term and are off for
    ZBV unless F = B = W (docs/simulation.md)."""
    bubble = np.where(pp == 1, 0.0, total - tmax)
    bubble = np.where(schedule == "interleaved-1f1b", bubble / v, bubble)
    zb = (schedule == "zero-bubble") | (schedule == "zbv")
    if passes is None or microbatches is None:
        return np.where(zb, bubble * np.maximum(0, 1 - 2 * w_fraction) / np.where(schedule == "zbv", 2, 1),
                        bubble)
    if not np.any(zb):
        return bubble
    split = split_backward_bubble(pp, microbatches, schedule == "zbv", passes)
    return np.where(zb, split, bubble)


def in_flight(plan: Plan, stage: int, microbatches: int) -> float:
    """in_flight_array for one plan and one stage."""
    return float(in_flight_array(plan.pp, plan.virtual_stages, np.asarray(plan.schedule), stage,
                                 microbatches))


def pipeline_time(stage_totals: list[float], microbatches: int, plan: Plan, w_fraction: float,
                  passes: list[tuple[float, float, float]] | None = None) -> tuple[float, float]:
    """(busy time, bubble time) of the pipeline for one step.

    stage_totals: forward + backward seconds of one micro-batch on each stage; passes: its
    (F, B, W) split per stage, which the split-backward schedules need (ZBV: each rank's two
    chunks taken as halves); without it, bubble_array's uniform-stage fallback.
    """
    tmax, total = max(stage_totals), sum(stage_totals)
    pt = None
    if passes is not None:
        arr = np.asarray(passes, dtype=float)[None, :, :]
        pt = rank_passes(arr[..., 0], arr[..., 1], arr[..., 2], np.ones((1, len(passes)), dtype=bool))
    bubble = bubble_array(np.asarray([total]), np.asarray([tmax]), np.asarray([plan.pp]), plan.virtual_stages,
                          np.asarray([plan.schedule]), w_fraction, microbatches=microbatches, passes=pt)
    return microbatches * tmax, float(bubble[0])
