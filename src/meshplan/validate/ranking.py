"""Ranking within sweeps: does meshplan order a sweep's configurations as the runs did, and is the
plan it would pick the fastest that ran?

A planner is judged by the plan it picks, so beside the mean error ``validate`` reports, for every
**sweep** (runs of one source that share the model, the GPU type and count, the global batch and
the sequence length: several ways to run the same job) with at least ``MIN_RUNS`` runs that
trained and were timed:

- **Spearman's rank correlation** between predicted and measured step times (ties get their
  mean rank);
- **plan quality**: the measured best time of the sweep divided by the measured time of the run
  meshplan would recommend among the sweep's configurations, that is the fastest predicted among
  those it calls "fits" (neither "at-risk" nor "does-not-fit": what ``meshplan plan`` recommends
  under its memory policy). 1.0 is the best pick;
- whether that pick **ran out of memory** (its quality is then 0: the job would not have run).

Out-of-memory runs of the sweep take part in the pick (they are the configurations a user would
lose a job to) but not in the correlation (they have no time). ``rank_rows_from_validate`` reads
the in-sample rows of ``validate``; calibration.out_of_sample.rank_rows the leave-one-source-out
predictions of ``validate --cross-validate`` (each source predicted, and its verdicts judged, by
the calibration and the bands fitted without it).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_RUNS = 4
"""A sweep needs this many timed runs that trained to be scored (the issue's threshold)."""


@dataclass(frozen=True)
class RankRow:
    """One configuration of a sweep: what it measured and what meshplan predicted."""

    row_id: str
    source_id: str
    sweep: str
    measured_s: float | None
    predicted_s: float | None
    recommended: bool
    """meshplan would recommend it (verdict 'fits')."""
    measured_fits: bool | None
    """False: the run went out of memory."""


def sweep_key(case: Any) -> str | None:
    """The sweep a run belongs to (source, model, GPUs, global batch, sequence length); None for a
    run meshplan cannot express."""
    if case.cluster is None or case.work is None or case.model is None:
        return None
    c, w = case.cluster, case.work
    return f"{case.source_id} | {case.model_name} | {c.num_gpus}x {c.gpu.name} | B={w.global_batch} | s={w.seq_len}"


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's of the mean ranks); None where either side is constant."""
    ra, rb = _ranks(np.asarray(a, dtype=float)), _ranks(np.asarray(b, dtype=float))
    if len(ra) < 2 or np.ptp(ra) == 0 or np.ptp(rb) == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):  # ties: their mean rank
        tie = x == v
        if tie.sum() > 1:
            r[tie] = r[tie].mean()
    return r


def score_sweeps(rows: Iterable[RankRow], min_runs: int = MIN_RUNS) -> dict[str, Any]:
    """{"sweeps": [per sweep], "summary": {...}} over the sweeps with ``min_runs`` timed runs."""
    by: dict[str, list[RankRow]] = {}
    for r in rows:
        by.setdefault(r.sweep, []).append(r)
    out = []
    pairs = right = 0
    for key, rs in by.items():
        timed = [r for r in rs if r.measured_fits is not False and r.measured_s is not None
                 and r.predicted_s is not None and math.isfinite(r.predicted_s)]
        for i, a in enumerate(timed):  # every pair of a sweep, however small: ordered as the runs were?
            for b in timed[i + 1:]:
                if a.measured_s != b.measured_s:
                    pairs += 1
                    right += (a.measured_s < b.measured_s) == (a.predicted_s < b.predicted_s)  # type: ignore[operator]
        if len(timed) < min_runs:
            continue
        rho = spearman([r.predicted_s for r in timed], [r.measured_s for r in timed])  # type: ignore[misc]
        best = min(timed, key=lambda r: r.measured_s)  # type: ignore[arg-type,return-value]
        # the pick: the fastest predicted configuration meshplan would recommend; out-of-memory runs
        # compete (a pick that ran out of memory is the failure this metric exists to catch), runs that
        # trained but were not timed cannot be judged and are left out
        cands = [r for r in rs if r.recommended and r.predicted_s is not None and math.isfinite(r.predicted_s)
                 and (r.measured_fits is False or r.measured_s is not None)]
        pick = min(cands, key=lambda r: r.predicted_s) if cands else None  # type: ignore[arg-type,return-value]
        if pick is None:
            quality, oom = None, False
        elif pick.measured_fits is False:
            quality, oom = 0.0, True
        else:
            quality, oom = float(best.measured_s / pick.measured_s), False  # type: ignore[operator]
        out.append({"sweep": key, "source_id": rs[0].source_id, "runs": len(timed),
                    "oom_runs": sum(r.measured_fits is False for r in rs),
                    "spearman": None if rho is None else round(rho, 4),
                    "plan_quality": None if quality is None else round(quality, 4),
                    "pick": None if pick is None else pick.row_id, "best": best.row_id,
                    "pick_ran_oom": oom, "no_pick": pick is None})
    return {"sweeps": out, "summary": summarize(out) | {
        "pairs": pairs, "pairs_ordered_right": right,
        "pairwise_accuracy": round(right / pairs, 4) if pairs else None}}


def summarize(sweeps: list[dict[str, Any]]) -> dict[str, Any]:
    rhos = [s["spearman"] for s in sweeps if s["spearman"] is not None]
    qs = [s["plan_quality"] for s in sweeps if s["plan_quality"] is not None]
    return {"sweeps": len(sweeps),
            "mean_spearman": round(float(np.mean(rhos)), 4) if rhos else None,
            "min_spearman": round(float(np.min(rhos)), 4) if rhos else None,
            "mean_plan_quality": round(float(np.mean(qs)), 4) if qs else None,
            "min_plan_quality": round(float(np.min(qs)), 4) if qs else None,
            "sweeps_below_0_95": sum(q < 0.95 for q in qs),
            "picks_ran_oom": sum(bool(s["pick_ran_oom"]) for s in sweeps),
            "sweeps_without_a_pick": sum(bool(s["no_pick"]) for s in sweeps)}


def rank_rows_from_validate(cases: Sequence[Any], rows: Sequence[dict[str, Any]]) -> list[RankRow]:
    """RankRows of ``validate``'s rows (in sample), keyed to their cases by row_id."""
    key = {c.row_id: sweep_key(c) for c in cases}
    out = []
    for r in rows:
        k = key.get(r["row_id"])
        if k is None or r["status"] != "ok":
            continue
        out.append(RankRow(str(r["row_id"]), r["source_id"], k, r["measured_step_time_s"],
                           r["predicted_step_time_s"], r.get("verdict") == "fits", r.get("measured_fits")))
    return out


def to_lines(result: dict[str, Any], title: str) -> list[str]:
    """The per-sweep table and the summary line."""
    sw, s = result["sweeps"], result["summary"]
    pw = (f"pairs of runs of a sweep (any size) ordered as measured: {s['pairs_ordered_right']} of {s['pairs']}"
          + (f" ({100 * s['pairwise_accuracy']:.0f}%)" if s.get("pairwise_accuracy") is not None else ""))
    if not sw:
        return [f"{title}: no sweep has {MIN_RUNS}+ timed runs; {pw}", ""]

    def f(x: Any, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)
    w = max(len(x["sweep"]) for x in sw)
    lines = [f"{title} ({s['sweeps']} sweeps of {MIN_RUNS}+ timed runs: same source, model, GPUs, batch, "
             "sequence length)", "",
             f"{'sweep':{w}s} {'runs':>4s} {'OOM':>4s} {'Spearman':>8s} {'quality':>7s}  pick (best)"]
    for x in sw:
        name = x["sweep"]
        pick = "none recommended" if x["no_pick"] else (
            f"row {x['pick']}" + (" RAN OUT OF MEMORY" if x["pick_ran_oom"] else "") + f" (row {x['best']})")
        lines.append(f"{name:{w}s} {x['runs']:4d} {x['oom_runs']:4d} {f(x['spearman']):>8s} "
                     f"{f(x['plan_quality'], '.3f'):>7s}  {pick}")
    lines += ["", f"ranking: mean Spearman {f(s['mean_spearman'])} (min {f(s['min_spearman'])}); plan quality mean "
              f"{f(s['mean_plan_quality'], '.3f')} (min {f(s['min_plan_quality'], '.3f')}, "
              f"{s['sweeps_below_0_95']} sweeps below 0.95); recommended picks that ran out of memory: "
              f"{s['picks_ran_oom']}; sweeps with no plan recommended: {s['sweeps_without_a_pick']}", pw, ""]
    return lines
