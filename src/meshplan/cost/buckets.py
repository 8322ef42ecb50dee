"""The expected step of a data-aware bucket plan (spec/buckets.py: micro-batch size and
context-parallel degree per length bucket).

A bucket plan forms its micro-batches and deals them to ranks with ``spec.buckets.bucket_layout``
(the runtime runs exactly that layout). The dealing is greedy (longest-processing-time first over
nested context-parallel units), which has no closed form, so the expectation is taken over
COST_DRAWS steps drawn with a fixed seed (the cost model stays deterministic; the simulator draws
its own batches with another seed, sim/buckets.py). Per plan row:

- each bucket k runs as a sub-plan: the plan with cp = the bucket's cp, dp = dp x C / cp (the C
  ranks of a context-parallel group act as C / cp data-parallel units), micro_batch = the
  bucket's; ZeRO 2/3 are priced as zero=1 (the runtime keeps parameters gathered and gradients
  unsharded through a step whose ranks run different micro-batch counts);
- t_k(L, n): one micro-batch of n samples padded to L on the sub-plan's critical rank (the cost
  model's per-micro-batch time at seq_len L, transformers regenerated at L; at n = 1 and n =
  micro_batch, linear between: a bucket's last micro-batch may hold fewer samples);
- a drawn step: every rank runs its micro-batches in the layout's order; a micro-batch starts when
  every rank of its unit is free (``t[unit] = max(t[unit]) + t_k``); the step ends at the busiest
  rank, then the once-per-step work: the gradient sync (exposed: the runtime closes a step with
  one pass that carries the sync for every rank alike, so nothing hides it), the optimizer, the
  overhead;
- step at even load: the drawn step's total work spread evenly over the dp x cp ranks (plus the
  same once-per-step work); the difference is ``time.imbalance``.

Memory is the largest of the buckets' sub-plans at the longest length each holds. Throughput
counts real tokens; model FLOPs are those of the real samples at their own lengths.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from meshplan.cost import batch as _b
from meshplan.cost.lengths import (
    EXTRA_KEYS,
    anchor_lengths,
    check_model,
    expected_batch,
    expected_report,
    graph_at,
    interpolation,
)
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.report import CostReport, report_from_row
from meshplan.cost.uncertainty import step_band
from meshplan.errors import MeshplanError
from meshplan.spec.buckets import Bucket, bucket_layout, check_workload, model_knee
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.lengths import LengthDist
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

COST_DRAWS = 64
"""Steps drawn (fixed seed) for a bucket plan's expected imbalance (the busiest rank's end less
the even share of the step's work, which varies far less from step to step than the work)."""
WORK_DRAWS = 2048
"""Steps drawn for the expected work of a step (micro-batches formed only, not dealt)."""
COST_SEED = 0xB0C4E7

__all__ = ["COST_DRAWS", "DrawnLayouts", "as_run", "bucket_batch", "bucket_plan_problem", "bucket_report",
           "plan_batch", "plan_report", "sub_plan"]


def as_run(plan: Plan) -> Plan:
    """The plan as the runtime runs a bucket plan: zero 2/3 keep parameters gathered and gradients
    unsharded from the first micro-batch to the last (priced as zero=1)."""
    return plan.replace(zero=1) if plan.zero >= 2 else plan


def sub_plan(plan: Plan, bucket: Bucket, samples: int) -> Plan:
    """Bucket ``bucket``'s micro-batches of ``samples`` samples as a one-length plan."""
    base = as_run(plan)
    return base.replace(buckets=None, cp=bucket.cp, dp=plan.dp * plan.cp // bucket.cp, micro_batch=samples)


def bucket_plan_problem(plan: Plan, work: Workload) -> str | None:
    """Why ``plan``'s buckets cannot train ``work`` (None: they can, or the plan has none)."""
    if plan.buckets is None:
        return None
    return check_workload(plan.bucket_specs, work.seq_len, work.varied)


@dataclasses.dataclass(frozen=True)
class DrawnLayouts:
    """COST_DRAWS drawn steps of one (distribution, global batch, dp, cp, buckets, knee), as counts:
    per draw and per cp level (largest first), ``ones`` and ``extra`` (units, K x J): micro-batches
    of bucket k padded to length j per unit, and their samples beyond the first (t is linear in the
    samples); ``own`` (ranks, K x J) and ``own_extra`` the same per rank summed over all levels,
    for the even-load step."""

    levels: tuple[tuple[int, ...], ...]
    ones: tuple[tuple[np.ndarray, ...], ...]
    extra: tuple[tuple[np.ndarray, ...], ...]
    work_ones: tuple[np.ndarray, ...]
    work_extra: tuple[np.ndarray, ...]
    padded_tokens: float
    """Mean tokens per step with padding (each micro-batch x its width)."""


@lru_cache(maxsize=512)
def drawn_layouts(dist: LengthDist, global_batch: int, dp: int, cp: int, buckets: tuple[Bucket, ...],
                  knee: float, draws: int = COST_DRAWS, seed: int = COST_SEED) -> DrawnLayouts:
    K, J = len(buckets), len(dist.lengths)
    index = {n: j for j, n in enumerate(dist.lengths)}
    cps = sorted({b.cp for b in buckets}, reverse=True)
    levels, ones, extra, w1, wx = [], [], [], [], []
    padded = 0.0
    for d in range(draws):
        rng = np.random.default_rng([seed, d])
        lay = bucket_layout(dist.sample(global_batch, rng), buckets, dp, cp, knee)
        per_ones = {c: np.zeros((dp * cp // c, K * J)) for c in cps}
        per_extra = {c: np.zeros((dp * cp // c, K * J)) for c in cps}
        for mb in lay.micro_batches:
            f = mb.bucket * J + index[mb.width]
            per_ones[mb.cp][mb.unit, f] += 1
            per_extra[mb.cp][mb.unit, f] += len(mb.samples) - 1
            padded += len(mb.samples) * mb.width / draws
        levels.append(tuple(cps))
        ones.append(tuple(per_ones[c] for c in cps))
        extra.append(tuple(per_extra[c] for c in cps))
        # work per rank (a unit's micro-batch occupies each of its ranks)
        w1.append(sum(np.repeat(per_ones[c], c, axis=0) for c in cps))
        wx.append(sum(np.repeat(per_extra[c], c, axis=0) for c in cps))
    return DrawnLayouts(tuple(levels), tuple(ones), tuple(extra), tuple(w1), tuple(wx), padded)


@lru_cache(maxsize=512)
def expected_counts(dist: LengthDist, global_batch: int, buckets: tuple[Bucket, ...], draws: int = WORK_DRAWS,
                    seed: int = COST_SEED) -> tuple[np.ndarray, np.ndarray, float]:
    """(ones, extra, padded tokens) of a step in expectation over ``draws`` steps: per (bucket k,
    length j), micro-batches of bucket k padded to length j and their samples beyond the first;
    the micro-batches formed as bucket_layout forms them (sorted, cut per bucket)."""
    K, J = len(buckets), len(dist.lengths)
    L = np.asarray(dist.lengths)
    rng = np.random.default_rng([seed, 1 << 20])
    x = np.sort(dist.sample(draws * global_batch, rng).reshape(draws, global_batch), axis=1)
    limits = np.asarray([b.max_len for b in buckets])
    ones, extra = np.zeros(K * J), np.zeros(K * J)
    padded = 0.0
    for d in range(draws):
        cut = np.searchsorted(x[d], limits, side="right")
        lo = 0
        for k, b in enumerate(buckets):
            seg = x[d, lo:cut[k]]
            lo = cut[k]
            if not len(seg):
                continue
            ends = np.arange(b.micro_batch - 1, len(seg) + b.micro_batch - 1, b.micro_batch).clip(max=len(seg) - 1)
            widths = seg[ends]
            sizes = np.diff(np.concatenate([[-1], ends]))
            f = k * J + np.searchsorted(L, widths)
            np.add.at(ones, f, 1.0)
            np.add.at(extra, f, sizes - 1.0)
            padded += float((sizes * widths).sum())
    return ones / draws, extra / draws, padded / draws


def _at_length(model: LayerGraph | ModelSpec, cluster: ClusterSpec, subs: list[Plan], length: int,
               params: CostParams, work: Workload) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(estimate at ``length`` (with ``_samples``, the samples it prices, and ``_mb.KEY``, each
    per-micro-batch time term on the critical rank), one micro-batch on the critical rank, the
    end-of-step sync the one-length estimate hides under the last backward) per sub-plan (``work``:
    the workload, for its optimizer)."""
    cols = {k: np.asarray(v) if k != "stage_layers" else v for k, v in _b.plans_to_columns(subs).items()}
    g = math.lcm(*{p.dp * p.micro_batch for p in subs})  # one or more micro-batches on every row
    w = work.shaped(g, int(length))
    a = _b.assemble(graph_at(model, length), cluster, w, cols, params)
    est = _b.estimate_assembly(a, cluster, w, params)
    crit = np.argmax(a.totals, axis=1)
    rows = np.arange(len(crit))
    tmax = a.totals[rows, crit]
    hidden_end = est["time.dp_comm_overlapped"] - a.micro * a.terms["dp_comm_overlapped"][rows, crit]
    est["_samples"] = np.asarray([p.dp * p.micro_batch for p in subs], dtype=float) * a.micro
    for k, v in a.terms.items():
        est[f"_mb.{k}"] = v[rows, crit]
    return est, tmax, np.maximum(hidden_end, 0.0)


def bucket_batch(model: LayerGraph | ModelSpec, cluster: ClusterSpec, work: Workload,
                 plans: Sequence[Plan], params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """cost.lengths.expected_batch's keys for bucket plans (every plan must have buckets and fit the
    workload: ``bucket_plan_problem``)."""
    dist = work.lengths
    if dist is None or not work.varied:
        raise MeshplanError("a bucket plan needs samples of several lengths that are not packed",
                            hint="give --seq-len 2048:0.6,8192:0.3,32768:0.1 (--packing padded or bucketed)")
    for plan in plans:
        why = bucket_plan_problem(plan, work)
        if plan.buckets is None or why:
            raise MeshplanError(why or f"{plan.short()} has no buckets")
    L = np.asarray(dist.lengths)
    J = len(L)
    anchors = anchor_lengths(dist.lengths)
    W = interpolation(dist.lengths, anchors)  # (J, A)
    # sub-plans: per plan, per bucket, one sample and the bucket's micro-batch; then the plan itself
    subs: list[Plan] = []
    where: list[list[tuple[int, int]]] = []
    for plan in plans:
        idx = []
        for b in plan.bucket_specs:
            idx.append((len(subs), len(subs) + 1))
            subs += [sub_plan(plan, b, 1), sub_plan(plan, b, b.micro_batch)]
        where.append(idx)
    tops = sorted({int(L[b.max_len >= L].max()) for plan in plans for b in plan.bucket_specs if (b.max_len >= L).any()})
    at = {x: _at_length(model, cluster, subs, x, params, work) for x in sorted(set(anchors) | set(tops))}
    T = np.stack([at[x][1] for x in anchors], axis=1) @ W.T  # (subs, J) one micro-batch at each length
    top = at[int(L[-1])][0]
    n = len(plans)
    keys = [k for k in top if not k.startswith("_") and np.asarray(top[k]).ndim == 1]
    out: dict[str, np.ndarray] = {k: np.empty(n, dtype=np.asarray(top[k]).dtype) for k in keys}
    out["stage_memory_gib"] = np.empty((n, 1))
    expected, even = np.empty(n), np.empty(n)
    for i, plan in enumerate(plans):
        bs = plan.bucket_specs
        K = len(bs)
        t1 = np.concatenate([T[where[i][k][0]] for k in range(K)])  # (K J,) one sample
        tb = np.concatenate([T[where[i][k][1]] for k in range(K)])
        per = np.concatenate([(tb[k * J:(k + 1) * J] - t1[k * J:(k + 1) * J]) / max(1, bs[k].micro_batch - 1)
                              for k in range(K)])  # each sample beyond the first
        last = where[i][-1][1]  # the longest bucket's sub-plan at its micro-batch: the step's own terms
        t_top, hid_top = float(at[int(L[-1])][1][last]), float(at[int(L[-1])][2][last])
        rest = float(top["step_time_s"][last] - top["microbatches"][last] * t_top + hid_top)
        lay = drawn_layouts(dist, work.global_batch, plan.dp, plan.cp, bs, model_knee(model))
        steps, evens = [], []
        for lv, o1, ox, w1, wx in zip(lay.levels, lay.ones, lay.extra, lay.work_ones, lay.work_extra):
            t = np.zeros(plan.dp * plan.cp)
            for c, a1, ax in zip(lv, o1, ox):  # the largest cp first: a unit starts when its ranks are free
                unit = t.reshape(-1, c).max(axis=1) + a1 @ t1 + ax @ per
                t = np.repeat(unit, c)
            steps.append(t.max())
            evens.append(float((w1 @ t1 + wx @ per).sum()) / t.size)
        e1, ex, padded = expected_counts(dist, work.global_batch, bs)
        occupy = np.repeat([b.cp for b in bs], J)  # a micro-batch occupies each rank of its unit
        mean_work = float((e1 * occupy) @ t1 + (ex * occupy) @ per) / (plan.dp * plan.cp)
        even[i] = mean_work + rest
        expected[i] = even[i] + max(0.0, float(np.mean(steps) - np.mean(evens)))
        # memory: the heaviest bucket's sub-plan at the longest length it holds
        worst, worst_gib, worst_e = last, -1.0, top
        for k, b in enumerate(bs):
            held = L[b.max_len >= L]
            if not len(held):
                continue
            e = at[int(held.max())][0]
            j = where[i][k][1]
            if e["peak_memory_gib"][j] > worst_gib:
                worst, worst_gib, worst_e = j, float(e["peak_memory_gib"][j]), e
        for k in keys:
            from_worst = k.startswith("memory.") or k in MEMORY_FIELDS
            out[k][i] = np.asarray((worst_e if from_worst else top)[k])[worst if from_worst else last]
        out["stage_memory_gib"][i, 0] = worst_gib
        out["microbatches"][i] = max(1, round(float(e1 @ occupy) / (plan.dp * plan.cp)))  # per rank, on average
        # model FLOPs of the real samples at their own lengths (per sample, from the top sub-plan)
        mf = np.asarray([_tflop_per_sample(at[x][0], last) for x in anchors]) @ W.T
        real = work.global_batch * float(mf @ np.asarray(dist.probs))
        peak = float(top["tflops_per_gpu"][last] / max(top["mfu"][last], 1e-300))
        out["tflops_per_gpu"][i] = real / expected[i] / plan.num_gpus
        out["mfu"][i] = out["tflops_per_gpu"][i] / peak
        out["hfu"][i] = out["mfu"][i] * float(top["hfu"][last] / max(top["mfu"][last], 1e-300))
        # the breakdown of the even-load step: per-micro-batch terms in the top sub-plan's proportions
        # over the busy time, then the once-per-step terms (the gradient sync exposed)
        busy = even[i] - rest
        for k in _b.TIME_KEYS:
            mb_key = f"_mb.{k}"
            if mb_key in top:
                out[f"time.{k}"][i] = float(top[mb_key][last]) / max(t_top, 1e-300) * busy
        once = sum(float(top[f"time.{k}"][last]) for k in ("optimizer", "outer_sync", "straggler", "overhead"))
        out["time.dp_comm"][i] += rest - once
        for k in ("optimizer", "outer_sync", "outer_sync_overlapped", "straggler", "overhead"):
            out[f"time.{k}"][i] = float(top[f"time.{k}"][last])
        out["time.bubble"][i] = 0.0
        out.setdefault("padded_tokens", np.empty(n))[i] = padded
    out["time.imbalance"] = expected - even
    out["step_time_s"] = expected
    out["step_time_even_s"] = even
    out["imbalance_s"] = expected - even
    out["tokens_per_s"] = work.tokens / expected
    low, high = step_band(expected, np.ones(n, dtype=np.int64), params)
    out["step_time_s_low"], out["step_time_s_high"] = low, high
    out["time_to_target_s"] = expected * np.asarray(out["token_factor"])
    out["padding_fraction"] = 1.0 - work.global_batch * dist.mean_len / out["padded_tokens"]
    assert all(k in out for k in EXTRA_KEYS)
    return out


MEMORY_FIELDS = ("peak_memory_gib", "peak_memory_gib_high", "fits", "at_risk", "oom_probability",
                 "host_memory_gib", "host_fits")
"""estimate_batch results taken from the heaviest bucket (with the memory.* parts)."""


def _tflop_per_sample(est: dict, row: int) -> float:
    """Model TFLOP of one sample at the estimate's length."""
    return float(est["tflops_per_gpu"][row] * est["step_time_s"][row] * est["num_gpus"][row] / est["_samples"][row])


def bucket_report(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                  params: CostParams = DEFAULT_PARAMS) -> CostReport:
    """One bucket plan's estimate (the plan checked as every plan is, its buckets against the
    workload)."""
    why = bucket_plan_problem(plan, work)
    if why:
        raise MeshplanError(f"plan cannot run: {why}")
    check_model(model, work)
    for b in plan.bucket_specs:  # each bucket's sub-plan must be a valid plan at the lengths it holds
        held = [n for n in work.lengths.lengths if n <= b.max_len] if work.lengths else []
        if held:
            _b.check(model, cluster, sub_plan(plan, b, b.micro_batch), work.shaped(
                plan.dp * plan.cp // b.cp * b.micro_batch, max(held)))
    r = bucket_batch(model, cluster, work, [plan], params)
    rep = report_from_row(model, cluster, r, 0, params)
    if plan.zero >= 2:
        rep.notes.append(f"zero={plan.zero} with buckets: the runtime keeps the parameters gathered and the "
                         "gradients unsharded from the first micro-batch to the last (its units run different "
                         "numbers of micro-batches), so the plan is priced, in time and memory, as zero=1")
    return rep


def plan_report(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                params: CostParams = DEFAULT_PARAMS) -> CostReport:
    """A plan on one GPU type: its buckets' expected step if it has buckets, else cost.lengths'
    (the expected step over a length distribution, or the one-length estimate)."""
    if plan.buckets is not None:
        return bucket_report(model, cluster, plan, work, params)
    return expected_report(model, cluster, plan, work, params)


def plan_batch(model: LayerGraph | ModelSpec, cluster: ClusterSpec, work: Workload,
               plans: Sequence[Plan] | Mapping[str, Any], params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """Many plans on one GPU type, vectorised: bucket plans (all of them, Plan objects) by
    bucket_batch, else cost.lengths.expected_batch (plans or columns; one length or a distribution:
    the one-length kernel's keys, and with a distribution EXTRA_KEYS and time.imbalance)."""
    if not isinstance(plans, Mapping) and any(p.buckets is not None for p in plans):
        if not all(p.buckets is not None for p in plans):
            raise MeshplanError("a batch of plans mixes bucket plans and plans without buckets",
                                hint="price the two kinds in separate batches")
        return bucket_batch(model, cluster, work, plans, params)
    if not work.varied:
        return _b.estimate_batch(model, cluster, work, plans, params)
    return expected_batch(model, cluster, work, plans, params)
