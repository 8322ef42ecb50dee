"""meshplan calibrate, --calibration and validate --cross-validate.

The fit is checked on synthetic measurements (the cost model's own predictions under known
values): it must recover the values it was given, keep what the runs cannot inform at its prior,
and write a file every planning command reads back."""
from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from clirun import one_line_error, run
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.builtin_calibration import builtin_values, gpu_key, link_key
from meshplan.calibration.fit import (
    NOISE,
    cross_validate,
    fit,
    pooled,
    predict,
    refinement,
    refinement_of,
    runs_from_cases,
)
from meshplan.calibration.space import GLOBAL, by_name
from meshplan.calibration.store import Calibration, builtin, calibration_from_dict, load_calibration
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.errors import MeshplanError
from meshplan.spec.io import load_cluster, load_gpu
from meshplan.validate.report import default_runs_path
from meshplan.validate.runs import load_runs

SOURCES = ("TT_2412_H100", "KOR22_T5", "TT_2024_A100")


@pytest.fixture(scope="module")
def dev_rows() -> list[dict[str, str]]:
    with open(default_runs_path(), newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def small_runs():
    cases = [c for c in load_runs(str(default_runs_path())) if c.source_id in SOURCES]
    return runs_from_cases(cases)


def _write(path, rows) -> str:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


# ---- the built-in calibration is where the fitted constants come from ---------------------------

def test_builtin_calibration_sets_the_defaults():
    vals = builtin_values()
    assert vals, "meshplan/data/calibration.json is shipped"
    for f in GLOBAL:
        if f.name in vals:
            assert getattr(DEFAULT_PARAMS, f.name) == pytest.approx(vals[f.name], rel=1e-12)
    g = load_gpu("h100-sxm-96gb-500w")
    assert g.clock_ratio == pytest.approx((500 / 700) ** (1 / 3), abs=1e-3)
    assert g.gemm_efficiency == pytest.approx(vals[gpu_key("gemm_efficiency", "hopper")] * g.clock_ratio)
    assert load_gpu("a100-sxm-80gb").gemm_efficiency == pytest.approx(vals[gpu_key("gemm_efficiency", "ampere")])
    c = load_cluster("h100-sxm-80gb:64")
    assert c.inter_node.efficiency == pytest.approx(vals[link_key("inter_node", "infiniband")])
    jz = load_cluster("jean-zay-a100")  # links given by the file, efficiency by their kind
    assert jz.inter_node.efficiency == pytest.approx(vals[link_key("inter_node", "omnipath")])


def test_builtin_values_are_inside_their_physical_ranges():
    for name, v in builtin_values().items():
        f = by_name(name)
        assert f.low <= v <= f.high, name


def test_applying_the_builtin_calibration_changes_nothing(small_runs):
    t0, m0, _ = predict(small_runs, {})
    t1, m1, _ = predict(small_runs, builtin().values)
    assert np.allclose(t0, t1, rtol=1e-12) and np.allclose(m0, m1, rtol=1e-12)


# ---- the fit ---------------------------------------------------------------------------------

def test_fit_recovers_known_values(small_runs):
    """Measurements made by the model itself under known values: the fit finds them again."""
    truth = {**builtin().values, gpu_key("gemm_efficiency", "hopper"): 0.62,
             gpu_key("attention_efficiency", "ampere"): 0.45, "overlap_slowdown": 0.2}
    t, m, _ = predict(small_runs, truth)
    synthetic = small_runs.subset(range(len(small_runs)))
    synthetic.step = t.copy()
    names = [gpu_key("gemm_efficiency", "hopper"), gpu_key("attention_efficiency", "ampere"), "overlap_slowdown"]
    vals, res = fit(synthetic, names)
    assert res[0].cost < 0.15 * res[0].history[0]  # little is left but the prior terms
    t_fit, _, _ = predict(synthetic, vals)
    assert np.abs(np.log(t_fit / t)).max() < 0.02  # the runs are explained
    # what the runs pin down is found (the rest is a compromise with its prior: MAP, not ML)
    assert vals[names[0]] == pytest.approx(truth[names[0]], rel=0.02)
    for n in names[1:]:
        assert abs(math.log(vals[n] + 0.05) - math.log(truth[n] + 0.05)) < abs(
            math.log(by_name(n).prior + 0.05) - math.log(truth[n] + 0.05)), n  # moved from the prior towards it


def test_what_the_runs_cannot_inform_stays_at_its_prior(small_runs):
    ampere = small_runs.subset(np.nonzero(small_runs.family == "ampere")[0])
    name = gpu_key("gemm_efficiency", "hopper")
    vals, _ = fit(ampere, [name, gpu_key("gemm_efficiency", "ampere")])
    assert vals[name] == pytest.approx(by_name(name).prior, rel=1e-6)


@pytest.mark.slow  # one fit per source
def test_cross_validation_reports_every_source(small_runs):
    folds = cross_validate(small_runs, [gpu_key("gemm_efficiency", "hopper"), gpu_key("gemm_efficiency", "ampere"),
                                        "hbm_efficiency"], max_iter=3)
    assert [f.source_id for f in folds] == list(dict.fromkeys(small_runs.source.tolist()))
    for f in folds:
        s = f.summary()
        assert {"source_id", "n", "step_mape_pct", "max_abs_error_pct"} <= set(s)
        assert "oom_accuracy_pct" not in s  # these sources have no out-of-memory runs
        assert s["max_abs_error_pct"] >= s["step_mape_pct"] >= 0
    assert pooled(folds)["runs"] == int((~np.isnan(small_runs.step)).sum())


# ---- refining a calibrated centre on a few runs -----------------------------------------------

def _transformed(name: str, v: float) -> float:
    return math.log(v) if by_name(name).log else v


@pytest.mark.slow  # three fits
def test_a_refinement_takes_the_posterior_as_its_prior_and_moves_less_on_one_run(small_runs):
    """The fit's posterior is narrower than the physics prior where the runs inform a parameter, and
    one run moves a calibration refined with that posterior as its prior less than with the physics
    prior widths (the run's error is not all the cluster's)."""
    hopper = gpu_key("gemm_efficiency", "hopper")
    names = [hopper, gpu_key("gemm_efficiency", "ampere"), gpu_key("attention_efficiency", "hopper"),
             "gemm_half_dim", "overlap_slowdown"]
    vals, res = fit(small_runs, names, max_iter=8)
    post = res[0].posterior_sd
    assert set(post) == set(names)
    for n, sd in post.items():
        assert 0 < sd <= by_name(n).sigma, n
    assert post[hopper] < 0.5 * by_name(hopper).sigma  # 18 hopper runs pin it down
    one = small_runs.subset([int(np.nonzero((small_runs.family == "hopper") & ~np.isnan(small_runs.step))[0][0])])

    def moved(**kw) -> float:
        v, r = fit(one, names, start=vals, prior=vals, max_iter=8, **kw)
        return sum(abs(_transformed(n, v[n]) - _transformed(n, vals[n])) / by_name(n).sigma for n in r[0].names)
    wide, narrow = moved(), moved(**refinement(post, None, "posterior"))
    assert narrow < wide
    assert narrow > 0  # it still learns from the run


def test_refinement_options():
    post = {"gemm_half_dim": 0.25}
    assert refinement(post, (-0.1, 0.15), "physics") == {}
    assert refinement(post, (-0.1, 0.15), "posterior") == {"prior_sd": post}
    assert refinement(post, (-0.1, 0.15), "scatter")["noise"] == pytest.approx(0.25 / (2 * 1.6448536269514722))
    assert refinement(post, (-0.01, 0.01), "both") == {"prior_sd": post, "noise": NOISE}  # never below NOISE
    with pytest.raises(ValueError):
        refinement(post, None, "wide")


def test_the_builtin_calibration_carries_its_posterior():
    """`meshplan calibrate` writes each fitted parameter's posterior sd; the built-in file has them,
    and refining the built-in calibration uses them."""
    cal = builtin()
    sd = cal.info.get("posterior_sd")
    assert sd and set(sd) == set(cal.values)
    for n, v in sd.items():
        assert 0 < v <= by_name(n).sigma, n
    assert refinement_of(cal, "posterior")["prior_sd"] == sd


# ---- files -----------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from([f.name for f in GLOBAL] + [gpu_key("gemm_efficiency", "hopper"),
                                                                   link_key("inter_node", "infiniband")]),
                       st.floats(0, 1), min_size=1))
def test_calibration_round_trips_and_stays_physical(fractions):
    vals = {}
    for k, q in fractions.items():
        f = by_name(k)
        vals[k] = f.low + q * (f.high - f.low)
    cal = Calibration(vals, "x", {"changes": {}})
    back = calibration_from_dict(json.loads(json.dumps(cal.to_dict())), "file")
    assert back.values == pytest.approx(vals, rel=1e-12)
    p = back.apply_params(DEFAULT_PARAMS)
    c = back.apply_cluster(load_cluster("h100-sxm-96gb-500w:16"))
    assert 0 < c.gpu.gemm_efficiency <= 1 and 0 < c.inter_node.efficiency <= 1
    for k, v in vals.items():
        if "@" not in k:
            assert getattr(p, k) == pytest.approx(v)


@pytest.mark.parametrize("content, needle", [
    ("not json", "not valid JSON"),
    ('{"values": {"gemm_half_dim": 1e9}}', "outside its physical range"),
    ('{"values": {"warp_speed": 2}}', "unknown parameter 'warp_speed'"),
    ('{"values": {"hbm_efficiency": "fast"}}', "must be a number"),
    ('{"kind": "plan", "tp": 2}', "not a calibration"),
    ('{"values": {"gemm_efficiency@hoper": 0.7}}', "unknown parameter 'gemm_efficiency@hoper'"),
    ('{"values": {"link_efficiency@inter_node:carrierpigeon": 0.5}}', "unknown parameter"),
    ('{"schema_version": 99, "values": {}}', "schema_version 99"),
])
def test_bad_calibration_files_are_one_line_errors(tmp_path, capsys, content, needle):
    f = tmp_path / "cal.json"
    f.write_text(content)
    with pytest.raises(MeshplanError, match=needle.replace("(", r"\(")):
        load_calibration(str(f))
    rc, _, err = run(capsys, "estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--plan",
                     "dp=8,zero=3", "--global-batch", "16", "--calibration", str(f))
    one_line_error(rc, err, needle.split("'")[0])


def test_missing_calibration_file(capsys, tmp_path):
    rc, _, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8",
                     "--global-batch", "16", "--calibration", str(tmp_path / "nope.json"))
    one_line_error(rc, err, "cannot read --calibration")


# ---- the commands ------------------------------------------------------------------------------

def test_calibrate_then_every_planning_command_reads_it(tmp_path, capsys, dev_rows):
    rows = [r for r in dev_rows if r["source_id"] == "TT_2412_H100"]
    path = _write(tmp_path / "runs.csv", rows)
    out = str(tmp_path / "cal.json")
    rc, text, err = run(capsys, "calibrate", "--runs", path, "--out", out,
                        "--fit", "gemm_efficiency@hopper,attention_efficiency@hopper")
    assert rc == 0, err
    assert "gemm_efficiency@hopper" in text and f"--calibration {out}" in text
    cal = json.loads((tmp_path / "cal.json").read_text())
    assert set(cal["values"]) == {"gemm_efficiency@hopper", "attention_efficiency@hopper"}
    assert cal["fitted_from"]["rows"] == len(rows) and cal["changes"]["gemm_efficiency@hopper"]["from"] > 0
    hop = cal["values"]["gemm_efficiency@hopper"]
    common = ["--model", "llama3-8b", "--cluster", "h100-sxm-96gb-500w:8", "--global-batch", "32"]
    rc, text, _ = run(capsys, "estimate", *common, "--plan", "dp=8,zero=3", "--calibration", out, "--json")
    doc = json.loads(text)
    assert doc["calibration"]["values"]["gemm_efficiency@hopper"] == pytest.approx(hop)
    rc, text, _ = run(capsys, "estimate", *common, "--plan", "dp=8,zero=3", "--calibration", out)
    assert f"calibration  {out}: 2 fitted values" in text and "gemm_efficiency@hopper" in text
    rc, text, _ = run(capsys, "plan", *common, "--calibration", out, "--json")
    assert rc == 0 and json.loads(text)["calibration"]["file"] == out
    rc, text, _ = run(capsys, "simulate", *common, "--plan", "dp=8,zero=3", "--calibration", out, "--json")
    assert rc == 0 and json.loads(text)["calibration"]["file"] == out
    rc, text, _ = run(capsys, "validate", "--runs", path, "--calibration", out, "--json")
    assert rc == 0 and json.loads(text)["calibration"]["values"]["gemm_efficiency@hopper"] == pytest.approx(hop)


def test_a_calibration_changes_the_estimate_the_way_its_values_say(tmp_path, capsys):
    """A slower GEMM calibration makes a compute-bound plan slower, by about the ratio."""
    out = tmp_path / "slow.json"
    base = builtin().values[gpu_key("gemm_efficiency", "hopper")]
    out.write_text(json.dumps({"values": {"gemm_efficiency@hopper": base / 2}}))
    common = ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--plan", "dp=8,zero=1",
              "--global-batch", "64", "--json"]
    t0 = json.loads(run(capsys, *common)[1])["step_time_s"]
    t1 = json.loads(run(capsys, *common, "--calibration", str(out))[1])["step_time_s"]
    assert 1.3 < t1 / t0 < 2.0


@pytest.mark.slow  # leave-one-source-out fits through the CLI
def test_cross_validate_json(tmp_path, capsys, dev_rows):
    rows = [r for r in dev_rows if r["source_id"] in ("KOR22_T5", "BLOOM176B")]
    path = _write(tmp_path / "runs.csv", rows)
    report = tmp_path / "v.md"
    rc, text, err = run(capsys, "validate", "--runs", path, "--cross-validate", "--json", "--report", str(report))
    assert rc == 0, err
    md = report.read_text()
    assert md.index("## Out of sample") < md.index("## By source")  # the headline first
    assert "| KOR22_T5 | 8 |" in md
    doc = json.loads(text)
    cv = {e["source_id"]: e for e in doc["cross_validation"]}
    assert set(cv) == {"KOR22_T5", "BLOOM176B"}
    assert cv["KOR22_T5"]["n"] == 8 and math.isfinite(cv["KOR22_T5"]["step_mape_pct"])
    assert doc["cross_validation_summary"]["runs"] == 11
    oos = doc["ranking_out_of_sample"]["summary"]  # within-sweep ranking, out of sample (BLOOM176B: 3 runs)
    assert oos["pairs"] >= 3 and 0 <= oos["pairs_ordered_right"] <= oos["pairs"]
    assert "## Ranking within sweeps, out of sample" in md
    cov = {e["source_id"]: e for e in doc["band_coverage_out_of_sample"]["by_source"]}
    assert cov["KOR22_T5"]["step_runs"] == 8 and 0 <= cov["KOR22_T5"]["step_coverage_pct"] <= 100


@pytest.mark.slow  # leave-one-source-out fits, then a few-shot calibration per source and K
def test_cross_validate_blind_few_shot(tmp_path, capsys, dev_rows):
    rows = [r for r in dev_rows if r["source_id"] in ("KOR22_T5", "MEG_SC21_T1")]
    path = _write(tmp_path / "runs.csv", rows)
    rc, text, err = run(capsys, "validate", "--runs", path, "--cross-validate", "--shots", "0,3", "--blind", "--json")
    assert rc == 0, err
    fs = json.loads(text)["few_shot"]
    assert fs["blind"] and fs["shots"] == [0, 3]
    by = {e["source_id"]: e for e in fs["by_source"]}
    assert by["KOR22_T5"]["timed_runs"] == 8 and by["MEG_SC21_T1"]["timed_runs"] == 10
    assert fs["summary"]["k3"]["runs"] == 5 + 7 and fs["summary"]["k0"]["runs"] == 18
    for k in ("k0", "k3"):
        assert 0 < fs["summary"][k]["pooled_mape_pct"] < 60
    # issue 28, item 4: the band of an unknown codebase (K = 0 blind) and of one calibrated on 3 runs,
    # each source's coverage judged against the other sources' band (MEG_SC21_T1's 10 runs give KOR22_T5 one;
    # KOR22_T5's 8 are too few for a band)
    kb = fs["knowledge_bands"]
    assert set(kb) == {"unknown", "k3"} and all(lo <= 0 <= hi for lo, hi in kb.values())
    assert 0 <= by["KOR22_T5"]["coverage"]["k0"] <= 100 and by["MEG_SC21_T1"]["coverage"]["k0"] is None


def test_calibrate_errors(tmp_path, capsys, dev_rows):
    path = _write(tmp_path / "runs.csv", dev_rows[:3])
    rc, _, err = run(capsys, "calibrate", "--runs", path, "--out", str(tmp_path / "c.json"), "--fit", "warp")
    one_line_error(rc, err, "unknown parameter 'warp'")
    # the first rows are A100 runs: nothing informs a Hopper efficiency
    rc, _, err = run(capsys, "calibrate", "--runs", path, "--out", str(tmp_path / "c.json"),
                     "--fit", "gemm_efficiency@hopper")
    one_line_error(rc, err, "no run in", "informs gemm_efficiency@hopper")
    rc, _, err = run(capsys, "calibrate", "--runs", path, "--out", str(tmp_path / "c.json"), "--fit", ",")
    one_line_error(rc, err, "names no parameter")
    blank = [dict(r, reported_step_time_s="", reported_tflops_per_gpu="", reported_mfu_pct="", reported_hfu_pct="",
                  reported_tokens_per_s_per_gpu="", reported_tokens_per_s_total="", reported_samples_per_s="",
                  reported_aggregate_pflops="", reported_peak_mem_gib="") for r in dev_rows[:3]]
    rc, out, err = run(capsys, "calibrate", "--runs", _write(tmp_path / "blank.csv", blank), "--out",
                       str(tmp_path / "c.json"))
    # no step time: no time parameter is fitted (only what the runs' fit outcomes inform)
    assert rc == 0, err
    fitted = json.loads((tmp_path / "c.json").read_text())["values"]
    assert all(by_name(n).target == "memory" for n in fitted), fitted
    rc, _, err = run(capsys, "calibrate", "--runs", str(tmp_path / "none.csv"), "--out", str(tmp_path / "c.json"))
    assert rc == 2 and "Traceback" not in err


def test_a_plan_file_records_its_profile_and_calibration(tmp_path, capsys):
    """`plan --out` records --profile and --calibration; `estimate --plan FILE` prices with them
    (and says so), so the file's prediction is reproduced."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"values": {"gemm_efficiency@hopper": 0.6}}))
    out = str(tmp_path / "p.json")
    rc, _, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "64",
                     "--profile", "megatron", "--calibration", str(cal), "--out", out)
    assert rc == 0, err
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["profile"] == "megatron" and doc["calibration"] == str(cal)
    rc, text, err = run(capsys, "estimate", "--plan", out, "--json")
    assert rc == 0 and "as the plan file records" in err
    got = json.loads(text)
    assert got["profile"] == "megatron" and got["step_time_s"] == pytest.approx(doc["predicted"]["step_time_s"])
