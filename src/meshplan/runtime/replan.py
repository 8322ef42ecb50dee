"""`meshplan train --replan-after N [--switch]`: check the plan against what the first steps measured.

After N steps of a launch (the first one is warm-up: the measured step time is the median of steps
2..N, as in the run's summary; the peak memory the maximum over ranks and steps), rank 0 compares
the measurement with the cost model's band for the plan as run on this machine (``band_of``: the
CostReport's ``step_time_s_low``/``step_time_s_high`` and ``peak_memory_gib_high``):

1. **within the band**: nothing changes (a ``replan-check`` record says so);
2. **outside**: the measurement becomes a calibration case (``calibration.metrics.case_from_summary``
   of the summary the run would write for these steps: the same case `meshplan calibrate --metrics`
   reads back), the cost model's parameters are fitted to it (``calibration.fit``, prior centred on
   the built-in calibration) and the calibration is written beside --metrics (``RUN.calibration.json``
   for ``RUN.jsonl``), else into --checkpoint-dir (``replan-calibration.json``);
3. the plans are ranked again under that calibration (``search.search`` on the run's own cluster:
   the processes of this launch, so every plan has the current world size; the search space the
   runtime runs on the model: presets everything the search offers, ingested models
   ``generic.search_space``; on CPU without offload, a no-op there), and the fastest plan that passes
   the launcher's own pre-flight checks (``job.checked_job``: the runtime's support, the planner's
   constraints, memory) is compared with the current plan, both priced under the calibration;
4. **the rule**: a different plan is *better* when its predicted step time is at least ``MARGIN``
   (5%) shorter than the current plan's. Without --switch it is reported (stderr and a ``ranking``
   record); with --switch every rank checkpoints at step N and the launcher starts the run again
   under the better plan with ``--resume`` (the resharding resume of checkpoint.py: the checkpoint
   holds the single-process model's tensors, so any plan of the same model loads it), steps
   numbered on from N+1.

The decision is rank 0's (the calibration fit and the search run there only) and is broadcast to
every rank. At most one check per launch; the continued run does not check again.
"""
from __future__ import annotations

import dataclasses
import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.runtime.job import calibration_path, checked_job
from meshplan.runtime.local import local_cluster, run_model, run_plan

MARGIN = 0.05
"""Switch only to a plan whose predicted step time (under the fitted calibration) is at least 5%
shorter than the current plan's: less is within what one run's calibration can tell apart."""
CANDIDATES = 20
"""How many plans of the new ranking are checked against the runtime's pre-flight checks, fastest
first, for the best one that runs."""
SHOWN = 5
"""Plans of the new ranking written to the ``ranking`` record."""
PROFILE = "meshplan"
"""The implementation profile of meshplan's own runtime (cost.profile)."""


# ---- the band --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Band:
    """What the cost model says of one plan: its step time and peak memory, and how far off they
    may be."""

    step_time_s: float
    step_time_s_low: float
    step_time_s_high: float
    peak_memory_gib: float
    peak_memory_gib_high: float
    verdict: str
    oom_probability: float
    basis: str
    """Where the band comes from: the cost model's own (cost.uncertainty), or the fallback."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def band_of(report: Any) -> Band:
    """The band of a CostReport as the cost model gives it (cost.uncertainty: its out-of-sample
    errors): the 90% step-time band, the 95th percentile of the peak memory, the verdict and the
    chance of running out of memory."""
    return Band(step_time_s=float(report.step_time_s), step_time_s_low=float(report.step_time_s_low),
                step_time_s_high=float(report.step_time_s_high), peak_memory_gib=float(report.peak_memory_gib),
                peak_memory_gib_high=float(report.peak_memory_gib_high), verdict=str(report.verdict),
                oom_probability=float(report.oom_probability),
                basis="the cost model's band (cost.uncertainty: its out-of-sample errors)")


def outside(measured: dict[str, Any], band: Band) -> list[str]:
    """Why a measurement is outside the band (nothing when within): the step time below or above
    it, the peak memory above its high end."""
    out = []
    t, m = measured.get("step_time_s"), measured.get("peak_memory_gib")
    rng = f"{band.step_time_s_low:.4g}-{band.step_time_s_high:.4g} s"
    if t is not None and t > band.step_time_s_high:
        out.append(f"step time {t:.4g} s is above the band {rng} ({t / band.step_time_s:.2f}x the estimate)")
    elif t is not None and t < band.step_time_s_low:
        out.append(f"step time {t:.4g} s is below the band {rng} ({t / band.step_time_s:.2f}x the estimate)")
    if m is not None and m > band.peak_memory_gib_high:
        out.append(f"peak memory {m:.3f} GiB is above the band's high end {band.peak_memory_gib_high:.3f} GiB")
    return out


# ---- the problem as the cost model sees this run -----------------------------------------------
@dataclass(frozen=True)
class Problem:
    model: Any
    """ModelSpec (presets) or LayerGraph (ingested models)."""
    cluster: Any
    """The run's cluster (local.local_cluster: the estimate's, recorded in the summary)."""
    work: Any
    plan: Any
    """The plan as this hardware runs it."""
    params: Any
    """CostParams of meshplan's runtime (its profile on the defaults)."""


def problem_of(job: Any, device_type: str) -> Problem:
    from meshplan.cost.params import DEFAULT_PARAMS
    from meshplan.cost.profile import get_profile
    from meshplan.spec.plan import Workload
    model = run_model(job)
    if model is None:
        raise MeshplanError(f"{job.model_arg or job.model}: the model cannot be traced on the meta device, so the "
                            "cost model has no estimate to check against")
    seq = model.sample_tokens if job.ingested else job.seq_len
    return Problem(model=model, cluster=local_cluster(job.world_size, device_type),
                   work=Workload(global_batch=job.global_batch, seq_len=seq, optimizer=job.optimizer),
                   plan=run_plan(job.plan, device_type), params=get_profile(PROFILE).apply(DEFAULT_PARAMS))


# ---- calibration -----------------------------------------------------------------------------
def fit_calibration(cases: list[Any], path: str, *, label: str, extra: dict[str, Any] | None = None) -> Any:
    """Fit the cost model to ``cases`` (RunCases with measurements) as `meshplan calibrate
    --prior builtin` does (calibration.fit.fit_as_calibrate: every parameter the cases inform, the
    built-in calibration refined) and write the calibration file to ``path``. Returns the Calibration."""
    from meshplan.calibration.fit import fit_as_calibrate, fit_info, runs_from_cases, step_mape
    from meshplan.calibration.store import Calibration, builtin, save_calibration
    runs = runs_from_cases(cases)
    if not len(runs):
        reasons = "; ".join(c.reason for c in cases if getattr(c, "reason", "")) or "no measurement"
        raise MeshplanError(f"no calibration could be fitted: {reasons}")
    before = builtin().values
    t0 = time.perf_counter()
    values, results = fit_as_calibrate(runs)
    took = time.perf_counter() - t0
    fitted = list(values)
    m0, m1 = step_mape(runs, before), step_mape(runs, {**before, **values})
    info: dict[str, Any] = {
        "fitted_from": {"metrics": [label], "rows": len(runs),
                        "sources": {s: int((runs.source == s).sum()) for s in dict.fromkeys(runs.source.tolist())},
                        "prior": "builtin", "date": datetime.date.today().isoformat(), **(extra or {})},
        "changes": {n: {"from": before.get(n), "to": values[n], "measurements": [f"runs: {label}"]} for n in fitted},
        **fit_info(results, round(took, 2), m0, m1)}
    cal = Calibration({n: values[n] for n in fitted}, path, info)
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # --checkpoint-dir before its first save
    save_calibration(cal, path)
    return cal


# ---- ranking ---------------------------------------------------------------------------------
def search_space(job: Any, prob: Problem, device_type: str) -> Any:
    """The plans the runtime runs on this model, the plan's own fixed fields (precision, compile,
    ...) kept; on CPU no offload (a no-op there: the same run, priced otherwise)."""
    if job.ingested:
        from meshplan.runtime.generic import search_space as ingested_space
        space = ingested_space(job.model, seq_len=job.seq_len, base=prob.plan)
    else:
        from meshplan.search.space import SearchSpace
        space = SearchSpace(base=prob.plan)
    return space.replace(offload=False) if device_type != "cuda" else space


def refusal(job: Any, plan: Any) -> str | None:
    """Why the launcher would refuse to run ``plan`` in this job's place (its own pre-flight checks:
    the runtime's support, the planner's constraints, memory), None when it runs."""
    cand = dataclasses.replace(job, plan=plan, plan_arg=plan.short(), checkpoint_dir=None, checkpoint_every=0,
                               resume=False, overwrite=False, replan_after=None, switch=False)
    try:
        checked_job(cand)
    except MeshplanError as e:
        return str(e)
    return None


def rank_plans(job: Any, prob: Problem, cal: Any, device_type: str) -> dict[str, Any]:
    """The ``ranking`` record: the plans ranked under ``cal`` on this run's cluster, the current plan
    priced the same way, the best one the runtime runs, and the decision by the MARGIN rule
    (``switch_to``: the better plan's string, or None)."""
    from meshplan.cost import estimate
    from meshplan.search import search
    params = cal.apply_params(prob.params)
    cluster = cal.apply_cluster(prob.cluster)
    current = prob.plan.short()
    cur = estimate(prob.model, cluster, prob.plan, prob.work, params)
    result = search(prob.model, cluster, prob.work, search_space(job, prob, device_type), params=params,
                    top=CANDIDATES)
    shown = [{"rank": r.rank, "plan": r.plan.short(), "step_time_s": r.report.step_time_s,
              "peak_memory_gib": r.report.peak_memory_gib} for r in result.plans[:SHOWN]]
    skipped, best = [], None
    for r in result.plans:
        if r.plan.short() == current:
            best = r
            break
        why = refusal(job, r.plan)
        if why is None:
            best = r
            break
        skipped.append({"plan": r.plan.short(), "why": why})
    rule = (f"switch when the fastest plan the runtime runs on these {job.world_size} processes is predicted at least "
            f"{MARGIN:.0%} faster (step time) than the current plan, both priced with the new calibration")
    out: dict[str, Any] = {"kind": "ranking", "step": None, "calibration": cal.source, "rule": rule,
                           "current": {"plan": current, "step_time_s": cur.step_time_s,
                                       "peak_memory_gib": cur.peak_memory_gib},
                           "plans": shown, "considered": result.considered, "feasible": result.feasible,
                           "skipped": skipped, "best": None, "faster_pct": None, "switch_to": None}
    if best is None:
        out["decision"] = (f"keep {current}: none of the {len(result.plans)} fastest plans passes the runtime's "
                           "checks" if result.plans else f"keep {current}: the search found no plan that fits")
        return out
    t_best = best.report.step_time_s
    gain = 1 - t_best / cur.step_time_s
    out.update(best={"plan": best.plan.short(), "step_time_s": t_best, "peak_memory_gib": best.report.peak_memory_gib},
               faster_pct=round(100 * gain, 2))
    if best.plan.short() == current:
        out["decision"] = f"keep {current}: it is the fastest plan under the calibration"
    elif gain < MARGIN:
        out["decision"] = (f"keep {current}: the fastest plan, {best.plan.short()}, is predicted only "
                           f"{100 * gain:.1f}% faster (the rule asks for {MARGIN:.0%})")
    else:
        out["switch_to"] = best.plan.short()
        out["decision"] = (f"better: {best.plan.short()}, predicted {100 * gain:.0f}% faster ({t_best:.4g} s against "
                           f"{cur.step_time_s:.4g} s a step under the calibration)")
    return out


# ---- the check (rank 0) ----------------------------------------------------------------------
@dataclass
class Outcome:
    records: list[dict[str, Any]]
    """What goes into the metrics file (replan-check, calibration, ranking)."""
    notes: list[str]
    """What rank 0 says on stderr (``meshplan: note: ...``)."""
    switch_to: str | None = None
    """The better plan (by the MARGIN rule), or None."""
    calibration: str | None = None
    """The calibration file written, or None."""
    predicted: dict[str, Any] | None = None
    """With switch_to: {plan, step_time_s, calibration, step}, the plan's step time under the fitted
    calibration (what the switch is decided on; the closing summary of the switched run shows it)."""


def run_check(job: Any, summary: dict[str, Any], device_type: str) -> Outcome:
    """The check after ``job.replan_after`` steps, on rank 0. ``summary``: the summary record of
    the steps so far (launch.summary_record: measured step time and memory, the run's specs)."""
    from meshplan.calibration.metrics import case_from_summary
    from meshplan.cost import estimate
    step = summary.get("steps", [None, None])[-1]
    measured = summary.get("measured") or {}
    prob = problem_of(job, device_type)
    band = band_of(estimate(prob.model, prob.cluster, prob.plan, prob.work, prob.params))
    # On CPU the measured memory is each process's peak RSS (interpreter, libraries, allocator and
    # all), not the accelerator memory the band describes: only the step time is compared there.
    compared = measured if device_type == "cuda" else {k: v for k, v in measured.items() if k != "peak_memory_gib"}
    why = outside(compared, band)
    check = {"kind": "replan-check", "step": step, "plan": prob.plan.short(), "cluster": prob.cluster.name,
             "measured": {k: measured.get(k) for k in ("step_time_s", "peak_memory_gib")},
             "band": band.to_dict(), "within": not why, "outside": why,
             "memory_compared": device_type == "cuda"}
    out = Outcome(records=[check], notes=[])
    if not why:
        out.notes.append(f"replan after step {step}: measured {measured['step_time_s']:.4g} s a step and "
                         f"{measured['peak_memory_gib']:.3f} GiB, within the cost model's band "
                         f"({band.step_time_s_low:.4g}-{band.step_time_s_high:.4g} s, at most "
                         f"{band.peak_memory_gib_high:.3f} GiB): keeping {prob.plan.short()}")
        return out
    path = calibration_path(job)
    assert path is not None  # check_flags
    label = job.metrics or f"{job.model_arg or summary.get('model')} {prob.plan.short()} (this run)"
    case = case_from_summary(summary, source_id=str(label), row_id=f"step {step}")
    cal = fit_calibration([case], path, label=str(label),
                          extra={"replan": {"step": step, "plan": prob.plan.short(), "cluster": prob.cluster.name}})
    out.calibration = path
    fit = cal.info.get("fit", {})
    out.records.append({"kind": "calibration", "step": step, "path": path, "values": dict(cal.values),
                        "step_error_pct_before": fit.get("step_mape_pct_before"),
                        "step_error_pct_after": fit.get("step_mape_pct_after")})
    ranking = rank_plans(job, prob, cal, device_type)
    ranking["step"] = step
    out.records.append(ranking)
    out.switch_to = ranking["switch_to"]
    if out.switch_to is not None and ranking.get("best"):
        out.predicted = {"plan": out.switch_to, "step_time_s": ranking["best"]["step_time_s"],
                         "calibration": path, "step": step}
    out.notes.append(f"replan after step {step}: {'; '.join(why)}; calibration written to {path} (step-time error "
                     f"{fit.get('step_mape_pct_before')}% -> {fit.get('step_mape_pct_after')}%); {ranking['decision']}"
                     + ("" if out.switch_to is None or job.switch else "; pass --switch to switch to it"))
    return out


def say(notes: list[str]) -> None:
    for n in notes:
        print(f"meshplan: note: {n}", file=sys.stderr, flush=True)
