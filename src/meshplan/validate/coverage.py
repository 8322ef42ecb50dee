"""Band coverage: do the uncertainty bands contain what the runs measured?

A 90% step-time band (cost.uncertainty.step_band) should contain the measured step of about 90%
of the runs, per source, and an out-of-memory run should have a memory band that crosses the
usable memory (its 95th-percentile peak above the limit: P(OOM) >= 5%). ``validate`` reports both
per source in sample (each row's own band, from the built-in bands, which saw every source) and,
with ``--cross-validate``, out of sample (calibration.out_of_sample.coverage): each source's runs predicted by the calibration fitted
without it and banded by the bands fitted without it (calibration.bands.bands_without). A band
right only where meshplan is already right does not tell the user what they need to know.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TARGET = (85.0, 95.0)
"""The share of runs a 90% band should cover, % (issue 28's done-when)."""


def entry(source: str, inside: list[bool], crossed: list[bool]) -> dict[str, Any]:
    return {"source_id": source, "step_runs": len(inside),
            "step_coverage_pct": round(100 * sum(inside) / len(inside), 1) if inside else None,
            "oom_runs": len(crossed),
            "oom_band_crosses_pct": round(100 * sum(crossed) / len(crossed), 1) if crossed else None}


def pooled(per: list[dict[str, Any]], inside: list[bool], crossed: list[bool]) -> dict[str, Any]:
    covs = [e["step_coverage_pct"] for e in per if e["step_coverage_pct"] is not None and e["step_runs"] >= 3]
    return {"step_runs": len(inside),
            "step_coverage_pct": round(100 * sum(inside) / len(inside), 1) if inside else None,
            "sources_in_target": sum(TARGET[0] <= c <= TARGET[1] for c in covs), "sources": len(covs),
            "min_source_coverage_pct": min(covs) if covs else None,
            "oom_runs": len(crossed),
            "oom_band_crosses_pct": round(100 * sum(crossed) / len(crossed), 1) if crossed else None}


def in_sample(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Coverage of ``validate``'s rows (their own bands)."""
    per, all_in, all_cross = [], [], []
    for src in dict.fromkeys(r["source_id"] for r in rows):
        inside, crossed = [], []
        for r in rows:
            if r["source_id"] != src or r["status"] != "ok":
                continue
            meas, lo, hi = r["measured_step_time_s"], r.get("predicted_step_time_s_low"), \
                r.get("predicted_step_time_s_high")
            if r.get("measured_fits") is not False and None not in (meas, lo, hi):
                inside.append(lo <= meas <= hi)
            if r.get("measured_fits") is False and r.get("oom_probability") is not None:
                crossed.append(r["oom_probability"] >= 0.05)
        per.append(entry(src, inside, crossed))
        all_in += inside
        all_cross += crossed
    return {"by_source": per, "pooled": pooled(per, all_in, all_cross)}


def to_lines(result: dict[str, Any], title: str) -> list[str]:
    """Per source, then pooled."""
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.0f}"
    out = [f"{title}: share of runs inside the 90% step band (target {TARGET[0]:.0f}-{TARGET[1]:.0f}%), and of "
           "out-of-memory runs whose memory band crosses the limit", "",
           f"{'source':22s} {'step runs':>9s} {'in band %':>9s} {'OOM runs':>8s} {'crossed %':>9s}"]
    for e in result["by_source"]:
        out.append(f"{e['source_id']:22s} {e['step_runs']:9d} {f(e['step_coverage_pct']):>9s} {e['oom_runs']:8d} "
                   f"{f(e['oom_band_crosses_pct']):>9s}")
    p = result["pooled"]
    out += ["", f"band coverage: {f(p['step_coverage_pct'])}% of {p['step_runs']} runs inside their 90% step band; "
            f"{p['sources_in_target']} of {p['sources']} sources (3+ runs) within {TARGET[0]:.0f}-{TARGET[1]:.0f}% "
            f"(lowest {f(p['min_source_coverage_pct'])}%); "
            + (f"{f(p['oom_band_crosses_pct'])}% of {p['oom_runs']} out-of-memory runs with a memory band over the "
               "limit" if p["oom_runs"] else "no out-of-memory runs"), ""]
    return out
