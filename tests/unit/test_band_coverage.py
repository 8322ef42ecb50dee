"""Band coverage (validate.coverage): share of runs inside their step band, OOM runs whose band crosses."""
from __future__ import annotations

from meshplan.validate.coverage import in_sample, to_lines


def r(src, meas, lo, hi, fits=True, p=None, status="ok"):
    return {"source_id": src, "status": status, "measured_step_time_s": meas, "predicted_step_time_s_low": lo,
            "predicted_step_time_s_high": hi, "measured_fits": fits, "oom_probability": p}


def test_in_sample_coverage_counts_what_it_says():
    rows = [r("A", 1.0, 0.9, 1.1), r("A", 1.2, 0.9, 1.1), r("A", 0.95, 0.9, 1.1), r("A", 1.0, 0.95, 1.05),
            r("B", None, None, None, fits=False, p=0.02), r("B", None, None, None, fits=False, p=0.5),
            r("B", 1.0, 0.5, 2.0, status="unsupported")]
    out = in_sample(rows)
    a, b = out["by_source"]
    assert a["step_runs"] == 4 and a["step_coverage_pct"] == 75.0
    assert b["step_runs"] == 0 and b["oom_runs"] == 2 and b["oom_band_crosses_pct"] == 50.0
    p = out["pooled"]
    assert p["step_coverage_pct"] == 75.0 and p["sources"] == 1 and p["sources_in_target"] == 0
    text = "\n".join(to_lines(out, "Band coverage, in sample"))
    assert "75" in text and "lowest 75%" in text


def test_validate_reports_coverage(capsys):
    import json

    from clirun import run
    from meshplan.validate.report import default_runs_path
    rc, out, _ = run(capsys, "validate", "--runs", str(default_runs_path()), "--json")
    d = json.loads(out)
    p = d["band_coverage"]["pooled"]
    assert rc == 0 and p["step_runs"] > 200 and 50 <= p["step_coverage_pct"] <= 100
