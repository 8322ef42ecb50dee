"""Compare cost-model predictions with published runs, and render the comparison.

``validate(cases, estimate_fn)`` calls ``estimate_fn(model, cluster, plan, work)`` on every
supported case; without ``estimate_fn`` it runs ``meshplan.cost.estimate`` with each case's own
CostParams (its codebase's profile and its cells, meshplan.cases.case_params) under the
built-in calibration or the one given. The result must have attributes
``step_time_s``, ``peak_memory_gib`` and ``fits``. A :class:`MeshplanError` from the estimate
turns that row unsupported with the error's message; any other exception is a bug and is
raised.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from meshplan.cases import RunCase, case_params, memory_measure, predicted_memory
from meshplan.cost.uncertainty import verdict as verdict_of
from meshplan.errors import MeshplanError

DEV_CSV = "published_runs_dev.csv"


def default_runs_path() -> Path:
    """The development set of published runs shipped in the package (meshplan/data/)."""
    try:
        p = Path(str(resources.files("meshplan") / "data" / DEV_CSV))
        if p.is_file():
            return p
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - unusual loaders
        pass
    # A source checkout without the packaged copy: look for shared/data next to the repo.
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent / "shared" / "data" / DEV_CSV
        if cand.is_file():
            return cand
    raise MeshplanError(f"{DEV_CSV} is not installed with meshplan",
                        hint="reinstall meshplan, or pass the runs CSV path explicitly")


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _finite(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _err_pct(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or meas == 0:
        return None
    return (pred - meas) / meas * 100.0


def _mean_abs(xs: list[float]) -> float | None:
    return sum(abs(x) for x in xs) / len(xs) if xs else None


def _max_abs(xs: list[float]) -> float | None:
    return max(abs(x) for x in xs) if xs else None


def case_estimate(calibration: Any = None) -> Callable[[RunCase], Any]:
    """case -> CostReport with the case's own profile and cells, under ``calibration`` (a
    calibration.store.Calibration; None: the built-in one)."""
    from meshplan.cost import estimate

    def one(c: RunCase) -> Any:  # as calibration.fit.predict: the case's profile, then the calibration
        if calibration is None:
            return estimate(c.model, c.cluster, c.plan, c.work, case_params(c))
        return estimate(c.model, calibration.apply_cluster(c.cluster), c.plan, c.work,
                        calibration.apply_params(case_params(c)))
    return one


def validate(cases: Iterable[RunCase],
             estimate_fn: Callable[..., Any] | None = None, *, calibration: Any = None) -> dict[str, Any]:
    """Predict every supported case and compare with its measurements.

    Returns {"rows": [...], "summary": {...}}; errors are signed, (pred - meas)/meas*100.
    """
    per_case = case_estimate(calibration) if estimate_fn is None else (
        lambda c: estimate_fn(c.model, c.cluster, c.plan, c.work))
    rows: list[dict[str, Any]] = []
    for c in cases:
        status, reason = c.status, c.reason
        pred_t = pred_m = None
        fits = verdict = None
        band: dict[str, Any] = {}
        if status == "ok":
            try:
                est = per_case(c)
            except MeshplanError as e:
                status, reason = "unsupported", str(e)
            else:
                pred_t = _finite(_get(est, "step_time_s"))
                pred_m = _finite(predicted_memory(c, est))
                f = _get(est, "fits")
                fits = None if f is None else bool(f)
                band = {k: _finite(_get(est, k)) for k in ("step_time_s_low", "step_time_s_high",
                                                          "peak_memory_gib_high", "oom_probability")}
                verdict = None if f is None else verdict_of(bool(f), bool(_get(est, "at_risk")))
        meas_t = _finite(c.measured_step_time_s)
        meas_m = _finite(c.measured_peak_mem_gib)
        rows.append({
            "row_id": c.row_id,
            "source_id": c.source_id,
            "model": c.model_name,
            "status": status,
            "reason": reason,
            "assumptions": list(c.assumptions),
            "measured_step_time_s": meas_t,
            "predicted_step_time_s": pred_t,
            "step_time_error_pct": _err_pct(pred_t, meas_t) if status == "ok" else None,
            "measured_peak_memory_gib": meas_m,
            "predicted_peak_memory_gib": pred_m,
            "memory_error_pct": _err_pct(pred_m, meas_m) if status == "ok" else None,
            "memory_measure": memory_measure(c) if meas_m is not None else None,
            "predicted_fits": fits,
            "verdict": verdict,
            "oom_probability": band.get("oom_probability"),
            "predicted_step_time_s_low": band.get("step_time_s_low"),
            "predicted_step_time_s_high": band.get("step_time_s_high"),
            "predicted_peak_memory_gib_high": band.get("peak_memory_gib_high"),
            "measured_fits": c.measured_fits,
            "measured_from": c.measured_from,
        })
    return {"rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary block of :func:`validate` from its rows."""
    t_err = [r["step_time_error_pct"] for r in rows if r["step_time_error_pct"] is not None]
    m_err = [r["memory_error_pct"] for r in rows if r["memory_error_pct"] is not None]
    by_source: dict[str, dict[str, Any]] = {}
    for src in dict.fromkeys(r["source_id"] for r in rows):
        sr = [r for r in rows if r["source_id"] == src]
        te = [r["step_time_error_pct"] for r in sr if r["step_time_error_pct"] is not None]
        me = [r["memory_error_pct"] for r in sr if r["memory_error_pct"] is not None]
        by_source[src] = {"rows": len(sr), "mape_pct": _mean_abs(te), "max_abs_pct": _max_abs(te),
                          "memory_mape_pct": _mean_abs(me)}
    ok = sum(1 for r in rows if r["status"] == "ok")
    judged = [r for r in rows if r.get("measured_fits") is not None and r["predicted_fits"] is not None]
    ran = [r for r in judged if r["measured_fits"]]
    oom = [r for r in judged if not r["measured_fits"]]
    fit_verdicts = {
        "runs_that_fit": len(ran),
        "runs_that_fit_predicted_oom": [r["row_id"] for r in ran if not r["predicted_fits"]],
        "oom_runs": len(oom),
        "oom_runs_predicted_to_fit": [r["row_id"] for r in oom if r["predicted_fits"]],
        "accuracy": (sum(r["measured_fits"] == r["predicted_fits"] for r in judged) / len(judged)
                     if judged else None),
    }
    return {
        "rows": len(rows),
        "ok": ok,
        "unsupported": len(rows) - ok,
        "step_time_mape_pct": _mean_abs(t_err),
        "step_time_max_abs_pct": _max_abs(t_err),
        "memory_mape_pct": _mean_abs(m_err),
        "memory_rows": len(m_err),
        "memory_mape_pct_by_measure": {
            k: _mean_abs([r["memory_error_pct"] for r in rows
                          if r["memory_error_pct"] is not None and r.get("memory_measure") == k])
            for k in dict.fromkeys(r.get("memory_measure") for r in rows if r["memory_error_pct"] is not None)},
        "memory_rows_by_measure": {
            k: sum(1 for r in rows if r["memory_error_pct"] is not None and r.get("memory_measure") == k)
            for k in dict.fromkeys(r.get("memory_measure") for r in rows if r["memory_error_pct"] is not None)},
        "fit_verdicts": fit_verdicts,
        "by_source": by_source,
    }


# ======================================================================================
# Rendering
# ======================================================================================
def _f(x: float | None, fmt: str = ".2f", signed: bool = False) -> str:
    if x is None:
        return "-"
    return format(x, ("+" if signed else "") + fmt)


def _fits(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "no")


def _verdict(r: dict[str, Any]) -> str:
    """The three-level verdict with the chance of running out of memory ('at-risk (40%)')."""
    v = r.get("verdict")
    if v is None:
        return _fits(r.get("predicted_fits"))
    p = r.get("oom_probability")
    return v if p is None else f"{v} ({100 * p:.0f}%)"


def _src_table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["source", "rows", "step-time MAPE %", "max abs err %", "memory MAPE %"]
    body = [[src, str(s["rows"]), _f(s["mape_pct"], ".1f"), _f(s["max_abs_pct"], ".1f"),
             _f(s["memory_mape_pct"], ".1f")]
            for src, s in result["summary"]["by_source"].items()]
    return head, body


def _row_table(result: dict[str, Any], width: int | None) -> tuple[list[str], list[list[str]]]:
    head = ["row", "source", "model", "status", "meas s", "pred s", "err %", "meas GiB",
            "pred GiB", "mem err %", "verdict (P(OOM))", "note"]
    body = []
    for r in result["rows"]:
        note = r["reason"] if r["status"] != "ok" else r["measured_from"]
        if width and len(note) > width:
            note = note[: width - 3] + "..."
        status = r["status"] + (" (ran OOM)" if r["status"] == "ok" and r.get("measured_fits") is False else "")
        body.append([str(r["row_id"]), r["source_id"], r["model"], status,
                     _f(r["measured_step_time_s"], ".3g"), _f(r["predicted_step_time_s"], ".3g"),
                     _f(r["step_time_error_pct"], ".1f", True),
                     _f(r["measured_peak_memory_gib"], ".1f"),
                     _f(r["predicted_peak_memory_gib"], ".1f"),
                     _f(r["memory_error_pct"], ".1f", True), _verdict(r), note])
    return head, body


def _summary_lines(result: dict[str, Any]) -> list[str]:
    s = result["summary"]
    return [
        f"rows: {s['rows']} ({s['ok']} ok, {s['unsupported']} unsupported)",
        f"step time: MAPE {_f(s['step_time_mape_pct'], '.1f')}%, "
        f"max abs error {_f(s['step_time_max_abs_pct'], '.1f')}%",
        f"peak memory: MAPE {_f(s['memory_mape_pct'], '.1f')}% over {s['memory_rows']} rows"
        + "".join(f"; {k} rows {_f(v, '.1f')}%" + (f" ({n} rows)" if (n := (s.get("memory_rows_by_measure") or {})
                                                                     .get(k)) is not None else "")
                  for k, v in (s.get("memory_mape_pct_by_measure") or {}).items())
        + (" (what each row measured: reserved = torch.cuda.max_memory_reserved, nvidia-smi = the process's whole "
           "GPU memory, allocated = max_memory_allocated)" if s.get("memory_mape_pct_by_measure") else ""),
        *_verdict_lines(s.get("fit_verdicts")),
    ]


def _verdict_lines(v: dict[str, Any] | None) -> list[str]:
    """Fits / out-of-memory: the model's verdict against what the runs did."""
    if not v or not (v["runs_that_fit"] or v["oom_runs"]):
        return []

    def ids(xs: list[str], wrong: str) -> str:
        if not xs:
            return ""
        shown = ", ".join(map(str, xs[:8])) + (", ..." if len(xs) > 8 else "")
        return f" ({wrong}: {'row' if len(xs) == 1 else 'rows'} {shown})"

    ran = (f"{v['runs_that_fit'] - len(v['runs_that_fit_predicted_oom'])}/{v['runs_that_fit']} runs "
           f"that trained predicted to fit{ids(v['runs_that_fit_predicted_oom'], 'predicted out of memory')}")
    oom = (f"{v['oom_runs'] - len(v['oom_runs_predicted_to_fit'])}/{v['oom_runs']} out-of-memory runs "
           f"predicted not to fit{ids(v['oom_runs_predicted_to_fit'], 'predicted to fit')}" if v["oom_runs"]
           else "no out-of-memory runs in the file")
    return [f"fits: {ran}; {oom}"]


def _md_cell(x: str) -> str:
    return x.replace("|", "\\|").replace("\n", " ")


def _md_table(head: list[str], body: list[list[str]], numeric_from: int = 1) -> list[str]:
    align = ["---" if i < numeric_from else "---:" for i in range(len(head))]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in body]
    return out


def to_markdown(result: dict[str, Any]) -> str:
    """A per-source summary table and a per-row table, in Markdown."""
    lines = ["# Validation against published runs", ""]
    if result.get("cross_validation"):
        lines += _cv_markdown(result)
    lines += [f"- {x}" for x in _summary_lines(result)]
    lines += _ranking_markdown(result)
    lines += ["", "## By source" + (" (in sample)" if result.get("cross_validation") else ""), ""]
    lines += _md_table(*_src_table(result))
    lines += ["", "## Rows", "",
              "Errors are signed: (predicted - measured) / measured. The note is how the measured "
              "step time was obtained, or why the row is unsupported.", ""]
    head, body = _row_table(result, None)
    align = ["---"] * 4 + ["---:"] * 6 + ["---", "---"]
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in body]
    lines += ["", *_constants_section()]
    return "\n".join(lines) + "\n"


def _ranking_markdown(result: dict[str, Any]) -> list[str]:
    """Ranking within sweeps (validate.ranking), out of sample first where there is one."""
    from meshplan.validate.ranking import to_lines
    out: list[str] = []
    from meshplan.validate import coverage
    for key, title in (("ranking_out_of_sample", "out of sample"), ("ranking", "in sample")):
        if result.get(key):
            out += ["", f"## Ranking within sweeps, {title}", "", "```",
                    *to_lines(result[key], f"Ranking within sweeps, {title}"), "```"]
    for key, title in (("band_coverage_out_of_sample", "out of sample"), ("band_coverage", "in sample")):
        if result.get(key):
            out += ["", f"## Band coverage, {title}", "", "```",
                    *coverage.to_lines(result[key], f"Band coverage, {title}"), "```"]
    return out


def _cv_markdown(result: dict[str, Any]) -> list[str]:
    """The leave-one-source-out table (validate --cross-validate), first: the headline."""
    def f(x: Any, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)
    out = ["## Out of sample (leave one source out)", "",
           "Each source predicted by a calibration fitted to the other sources only.", "",
           "| source | runs | step MAPE % | max abs error % | bias % | memory MAPE % | OOM accuracy % |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for e in result["cross_validation"]:
        out.append(f"| {e['source_id']} | {e['n']} | {f(e['step_mape_pct'])} | {f(e['max_abs_error_pct'])} | "
                   f"{f(e['step_bias_pct'], '+.1f')} | {f(e['memory_mape_pct'])} | {f(e.get('oom_accuracy_pct'))} |")
    t = result.get("cross_validation_summary") or {}
    out += ["", f"Pooled over {t.get('runs')} runs: step MAPE {f(t.get('step_mape_pct'))}%, mean of the sources "
            f"{f(t.get('mean_source_mape_pct'))}%, worst source {f(t.get('worst_source_mape_pct'))}%; OOM verdicts "
            f"right {f(t.get('oom_accuracy_pct'))}%."]
    by = t.get("memory_mape_pct_by_measure") or {}
    if by:
        out += ["", "Peak memory error out of sample, by what the rows measured: "
                + ", ".join(f"{k} {f(v)}%" for k, v in by.items()) + "."]
    out += ["", "## In sample", ""]
    return out


def _constants_section() -> list[str]:
    """Which numbers of the cost model are fitted, measured elsewhere, or derived."""
    import dataclasses

    from meshplan.cost.params import DEFAULT_PARAMS, GPU_FITTED_FIELDS, PARAM_KINDS
    from meshplan.spec.io import load_gpu, preset_names
    lines = ["## Cost-model constants", "",
             "`fitted`: fitted to the published runs by `meshplan calibrate` (the built-in calibration, "
             "meshplan/data/calibration.json); "
             "`measured`: a constant measured or published elsewhere; `derived`: first "
             "principles or framework defaults. Descriptions and sources: "
             "src/meshplan/cost/params.py and docs/cost-model.md.", ""]
    def val(v: object) -> str:
        return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
    body = [[f.name, val(getattr(DEFAULT_PARAMS, f.name)), PARAM_KINDS.get(f.name, "?")]
            for f in dataclasses.fields(DEFAULT_PARAMS)]
    lines += _md_table(["constant", "value", "kind"], body, numeric_from=1)
    lines += ["", "Per-GPU fitted values (the calibration's family value x the part's clock_ratio; "
              "other GPU fields are datasheet numbers):", ""]
    rows = []
    for name in preset_names("gpus"):
        g = load_gpu(name)
        vals = [getattr(g, f) for f in GPU_FITTED_FIELDS]
        rows.append([name] + ["-" if v is None else f"{v:g}" for v in vals])
    lines += _md_table(["gpu", *GPU_FITTED_FIELDS], rows)
    return lines


def _aligned(head: list[str], body: list[list[str]], left: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def fmt(row: list[str]) -> str:
        cells = [c.ljust(w) if i in left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(head), "  ".join("-" * w for w in widths), *(fmt(r) for r in body)]


def to_text(result: dict[str, Any], *, note_width: int = 60) -> str:
    """Aligned plain-text tables for the terminal."""
    head, body = _row_table(result, note_width)
    for row in body:
        if len(row[2]) > 24:
            row[2] = row[2][:21] + "..."
    lines = _aligned(head, body, left={0, 1, 2, 3, 10, 11}) + [""]
    lines += _aligned(*_src_table(result), left={0})
    lines += [""] + _summary_lines(result)
    return "\n".join(lines) + "\n"
