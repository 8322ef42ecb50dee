"""Uncertainty bands, the chance of running out of memory and the three-level verdict
(cost.uncertainty, calibration.bands), and the plan policy flags."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.calibration.store import Calibration
from meshplan.cost import estimate
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.uncertainty import (
    POOLED,
    Bands,
    builtin_bands,
    memory_high,
    normal_cdf,
    normal_quantile,
    oom_probability,
    safe_peak_gib,
    step_band,
    verdicts,
)
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload
from tests.unit.clirun import error_line, run

BANDS = Bands({POOLED: (-0.1, 0.12), "pipeline": (-0.15, 0.17), "no-pipeline": (-0.1, 0.12)},
              {POOLED: (0.06, 0.14), "torchtitan": (0.03, 0.04)})


def test_normal_cdf_and_quantile():
    assert float(normal_cdf(0.0)) == pytest.approx(0.5, abs=1e-7)
    assert float(normal_cdf(1.6448536)) == pytest.approx(0.95, abs=1e-6)
    for q in (0.01, 0.05, 0.5, 0.9, 0.999):
        assert float(normal_cdf(normal_quantile(q))) == pytest.approx(q, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(peak=st.floats(1.0, 200.0), usable=st.floats(10.0, 150.0), risk=st.floats(0.001, 0.49),
       headroom=st.floats(0.0, 10.0), profile=st.sampled_from(["meshplan", "torchtitan", "nemo", "x"]),
       scale=st.floats(0.5, 1.0))
def test_verdicts_are_consistent(peak, usable, risk, headroom, profile, scale):
    p = DEFAULT_PARAMS.replace(max_oom_risk=risk, headroom_gib=headroom, profile=profile, band_scale=scale)
    fits, at_risk, prob = (np.asarray(x).item() for x in verdicts(peak, usable, p, BANDS))
    assert 0.0 <= prob <= 1.0
    assert fits == (prob < 0.5)
    assert at_risk == (fits and (prob > risk or usable - peak < headroom))
    # more memory never lowers the chance of running out
    assert float(oom_probability(peak * 1.1, usable, p, BANDS)) >= prob - 1e-12
    # the safe peak is recommended, a little more is not
    safe = safe_peak_gib(usable, p, BANDS)
    if safe > 1e-9 * usable:  # (a safe peak within rounding of 0: 1% more of it is still within rounding)
        f2, r2, _ = verdicts(safe * 0.999, usable, p, BANDS)
        assert bool(f2) and not bool(r2)
        f3, r3, _ = verdicts(safe * 1.01, usable, p, BANDS)
        assert (not bool(f3)) or bool(r3)


@settings(max_examples=40, deadline=None)
@given(step=st.floats(0.01, 1e4), pp=st.integers(1, 64), scale=st.floats(0.9, 1.0))
def test_step_band_brackets_the_estimate_and_shrinks(step, pp, scale):
    p = DEFAULT_PARAMS.replace(band_scale=scale)
    lo, hi = (float(x) for x in step_band(step, pp, p, BANDS))
    assert lo <= step <= hi
    lo1, hi1 = (float(x) for x in step_band(step, pp, DEFAULT_PARAMS, BANDS))
    assert lo1 <= lo + 1e-9 * step and hi <= hi1 + 1e-9 * step
    wide = BANDS.step["pipeline"] if pp > 1 else BANDS.step["no-pipeline"]
    assert hi1 == pytest.approx(step * math.exp(wide[1]))


def test_memory_band_uses_the_profile_then_the_alias_then_all_codebases():
    assert BANDS.memory_log("torchtitan") == (0.03, 0.04)
    assert BANDS.memory_log("meshplan") == (0.03, 0.04)  # same stack as torchtitan
    assert BANDS.memory_log("unknown") == (0.06, 0.14)
    hi = float(memory_high(50.0, DEFAULT_PARAMS.replace(profile="torchtitan"), BANDS))
    assert hi == pytest.approx(50.0 * math.exp(0.03 + 1.6448536 * 0.04), rel=1e-6)


def test_builtin_bands_come_from_the_shipped_calibration():
    from meshplan.builtin_calibration import builtin_calibration
    unc = builtin_calibration()["uncertainty"]
    b = builtin_bands()
    assert set(b.step) >= {"pipeline", "no-pipeline", POOLED}
    assert b.memory_log("torchtitan") == (unc["memory"]["torchtitan"]["mu"], unc["memory"]["torchtitan"]["sigma"])
    assert "leave-one-source-out" in unc["derived_from"]


def test_estimate_carries_bands_and_verdict():
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    r = estimate(model, cluster, Plan(dp=8, zero=3), Workload(global_batch=16, seq_len=8192))
    assert r.step_time_s_low < r.step_time_s < r.step_time_s_high
    assert r.peak_memory_gib_high > r.peak_memory_gib
    assert r.verdict in ("fits", "at-risk", "does-not-fit")
    d = r.to_dict()
    assert d["verdict"] == r.verdict and d["oom_probability"] == r.oom_probability


def test_calibration_shrinks_bands_by_what_it_earned():
    def cal(before, after, prior="builtin"):
        return Calibration({}, "c.json", {"fitted_from": {"prior": prior},
                                          "fit": {"step_mape_pct_before": before, "step_mape_pct_after": after}})
    assert cal(10.0, 4.0).band_scale == pytest.approx(0.9)   # at most by what few runs earn out of sample
    assert cal(10.0, 9.5).band_scale == pytest.approx(0.95)
    assert cal(10.0, 12.0).band_scale == 1.0                  # a fit that did not help keeps the bands
    assert cal(10.0, 8.0, prior="physics").band_scale == 1.0  # from the priors: nothing earned over built-in
    assert Calibration({}, "c.json", {}).band_scale == 1.0
    assert cal(10.0, 9.5).apply_params(DEFAULT_PARAMS).band_scale == pytest.approx(0.95)


def _plan_json(capsys, *extra: str) -> dict:
    rc, out, err = run(capsys, *BASE, *extra)
    assert rc == 0, err
    return json.loads(out)


BASE = ("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16", "--seq-len", "8192", "--json")


def test_plan_policy_flags(capsys):
    strict = _plan_json(capsys, "--max-oom-risk", "0.01")
    loose = _plan_json(capsys, "--max-oom-risk", "0.49")
    assert strict["memory_policy"]["max_oom_risk"] == 0.01
    for p in strict["plans"]:
        assert p["cost"]["oom_probability"] <= 0.01 and p["cost"]["verdict"] == "fits"
    assert loose["plans"][0]["cost"]["step_time_s"] <= strict["plans"][0]["cost"]["step_time_s"]
    roomy = _plan_json(capsys, "--headroom", "30")
    for p in roomy["plans"]:
        assert p["cost"]["usable_memory_gib"] - p["cost"]["peak_memory_gib"] >= 30
    if strict["passed_over_for_memory_risk"]:
        po = strict["passed_over_for_memory_risk"]
        assert po["step_time_s"] < strict["plans"][0]["cost"]["step_time_s"] and po["oom_probability"] > 0.01
        assert any("passed over for its memory risk" in line for line in strict["explanation"])


@pytest.mark.parametrize("flag,value", [("--max-oom-risk", "0"), ("--max-oom-risk", "1.5"),
                                        ("--max-oom-risk", "lots"), ("--headroom", "-2"), ("--headroom", "nan")])
def test_policy_flags_refuse_bad_values(capsys, flag, value):
    line = error_line(capsys, ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", flag, value])
    assert flag in line


def test_bands_recover_a_known_spread():
    """Synthetic out-of-sample residuals with known mu/sigma: the fit gets them back."""
    from meshplan.calibration.bands import _best, _loglik
    rng = np.random.default_rng(0)
    n = 400
    e = rng.normal(0.08, 0.05, n)

    class R:
        pass
    runs = R()
    runs.mem = np.exp(e) * 50.0
    runs.mem_reported = None
    runs.fits = np.zeros(n, dtype=int)
    r = R()
    r.runs, r.pred_mem, r.usable = runs, np.full(n, 50.0), np.full(n, 70.0)
    r.mem_log = np.log(runs.mem / r.pred_mem)
    mu, sigma = _best(_loglik(r, np.ones(n)))
    assert mu == pytest.approx(0.08, abs=0.01) and sigma == pytest.approx(0.05, abs=0.01)


def test_policy_conflicts_and_impossible_headroom(capsys):
    base = ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "16"]
    assert "no plan can leave that much free" in error_line(capsys, base + ["--headroom", "100"])
    assert "--no-headroom accepts every plan" in error_line(capsys, base + ["--headroom", "5", "--no-headroom"])


def test_headroom_is_named_as_the_reason(capsys):
    rc, out, err = run(capsys, "estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch",
                       "16", "--seq-len", "8192", "--plan", "tp=2,dp=4,zero=3", "--headroom", "70")
    assert rc == 0, err
    assert "AT RISK" in out and "under the 70 GiB asked (--headroom)" in out
    assert "chance of running out of memory, over" not in out


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\xff", b'{"values": {}, "fit": [1]}'])
def test_broken_calibration_files_are_one_line_errors(capsys, tmp_path, content):
    bad = tmp_path / "c.json"
    bad.write_bytes(content)
    line = error_line(capsys, ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch",
                               "16", "--plan", "dp=8", "--calibration", str(bad)])
    assert "--calibration" in line
