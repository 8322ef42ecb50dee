"""Issue 28, item 4: step bands that know what they do not know.

A built-in profile takes the bands fitted on the named codebases; a codebase meshplan has no evidence
for takes the blind band (the spread across codebases); a codebase calibrated on K of its runs the
blind few-shot band at K. The coverage of each is judged out of sample: a source against the band of
the other sources' errors."""
from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.calibration.few_shot import band_of, knowledge_coverage
from meshplan.calibration.store import Calibration
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.profile import get_profile, load_profile
from meshplan.cost.uncertainty import Bands, bands_from_dict, knowledge_for_runs, step_band
from meshplan.validate.runs import case_from_row

BANDS = Bands(step={"*": (-0.1, 0.1), "pipeline": (-0.12, 0.1), "no-pipeline": (-0.1, 0.1)},
              memory={"*": (0.0, 0.1)},
              knowledge={"unknown": (-0.4, 0.3), "k1": (-0.25, 0.2), "k3": (-0.15, 0.12), "k5": (-0.12, 0.1)})


def test_an_unknown_codebase_gets_the_wide_band_and_a_calibrated_one_the_band_of_its_k() -> None:
    p = DEFAULT_PARAMS
    lo, hi = step_band(100.0, 1, p, BANDS)
    assert (round(float(lo), 6), round(float(hi), 6)) == (round(100 * math.exp(-0.1), 6), round(100 * math.exp(0.1), 6))
    lo, hi = step_band(100.0, 1, p.replace(band_basis="unknown"), BANDS)
    assert math.isclose(float(lo), 100 * math.exp(-0.4)) and math.isclose(float(hi), 100 * math.exp(0.3))
    lo3, hi3 = step_band(100.0, 4, p.replace(band_basis="k3"), BANDS)
    assert math.isclose(float(lo3), 100 * math.exp(-0.15)) and math.isclose(float(hi3), 100 * math.exp(0.12))
    # a calibration without knowledge bands: the per-kind band (with its band_scale)
    plain = Bands(BANDS.step, BANDS.memory)
    lo, hi = step_band(100.0, 1, p.replace(band_basis="unknown"), plain)
    assert math.isclose(float(lo), 100 * math.exp(-0.1))


def test_knowledge_bands_round_trip_and_bad_ones_are_refused() -> None:
    d = BANDS.to_dict()
    assert bands_from_dict(d) == BANDS
    d["knowledge"]["k3"] = {"log_q05": 0.2, "log_q95": 0.1}
    assert bands_from_dict(d) is None


def test_runs_of_a_calibration_pick_the_band_of_the_largest_measured_k_not_above_them() -> None:
    assert [knowledge_for_runs(k) for k in (0, 1, 2, 3, 4, 5, 18)] == ["unknown", "k1", "k1", "k3", "k3", "k5", "k5"]


def test_a_calibration_of_one_codebase_s_runs_sets_the_band_basis_and_one_of_many_sources_does_not() -> None:
    one = Calibration({"hbm_efficiency": 0.8}, "c.json",
                      {"fitted_from": {"runs": "mine.csv", "rows": 6, "timed_runs": 3, "sources": {"mine": 6}}})
    assert one.band_basis == "k3"
    assert one.apply_params(DEFAULT_PARAMS).band_basis == "k3"
    many = Calibration({"hbm_efficiency": 0.8}, "c.json",
                       {"fitted_from": {"runs": "dev.csv", "rows": 60, "timed_runs": 50, "sources": {"a": 30, "b": 30}}})
    assert many.band_basis is None and many.apply_params(DEFAULT_PARAMS).band_basis == "profile"
    bench = Calibration({"hbm_efficiency": 0.8}, "c.json", {"fitted_from": {"bench": {}}})
    assert bench.band_basis is None


def test_a_profile_file_is_an_unknown_codebase_and_a_builtin_profile_is_not(tmp_path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text('name = "mine"\nbase = "megatron"\n[settings]\ndp_overlap = false\n')
    assert load_profile(f).apply(DEFAULT_PARAMS).band_basis == "unknown"
    assert get_profile("megatron").apply(DEFAULT_PARAMS).band_basis == "profile"
    assert get_profile(None).apply(DEFAULT_PARAMS).band_basis == "profile"


def test_a_run_whose_framework_is_not_recognised_takes_the_unknown_band() -> None:
    row = {"row_id": "u1", "source_id": "MINE", "model": "gpt", "num_layers": "24", "hidden_size": "2048",
           "num_attention_heads": "16", "vocab_size": "50257", "seq_len": "2048", "gpu_type": "A100-SXM",
           "gpu_memory_gb": "80", "num_gpus": "8", "tp": "1", "pp": "1", "dp": "8", "micro_batch": "4",
           "global_batch_seqs": "32", "precision": "bf16", "status": "ok", "reported_step_time_s": "1.0"}
    case = case_from_row(row)
    assert case.overrides.get("band_basis") == "unknown"


def test_coverage_is_judged_against_the_other_sources_band() -> None:
    rng = np.random.default_rng(0)
    resid = {0: {"a": rng.normal(0, 0.05, 40).tolist(), "b": rng.normal(0, 0.05, 40).tolist(),
                 "odd": rng.normal(0.5, 0.01, 40).tolist()}}
    bands, cover, hits = knowledge_coverage(resid)
    assert cover[0]["odd"] == 0.0  # far from the others: outside the others' band, though inside the pooled one
    assert bands[0][1] > 0.45
    assert cover[0]["a"] > 50 and len(hits[0]["a"]) == 40


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1, 1, allow_nan=False), min_size=10, max_size=60))
def test_a_band_always_holds_the_point_estimate_and_its_quantiles(xs: list[float]) -> None:
    b = band_of(xs)
    assert b is not None and b[0] <= 0 <= b[1]
    inside = np.mean([(b[0] - 1e-9) <= x <= (b[1] + 1e-9) for x in xs])
    assert inside >= 0.9 - 2 / len(xs)  # 5th to 95th percentile (interpolated: one error each side may fall out)


def test_the_builtin_calibration_carries_the_knowledge_bands_and_estimate_says_which_it_uses(tmp_path, capsys) -> None:
    """Review 2026-12-08: the bands existed in code only; the built-in calibration had none, so a profile file
    got the named codebases' band. Now it carries them (benchmarks/blind_bands.py --write) and the output says so."""
    from meshplan.cli.main import main
    from meshplan.cost.uncertainty import KNOWLEDGE, builtin_bands
    b = builtin_bands()
    assert set(b.knowledge) == set(KNOWLEDGE)
    f = tmp_path / "mine.toml"
    f.write_text('name = "mine"\nbase = "megatron"\n[settings]\ndp_overlap = true\n')
    args = ["estimate", "--model", "gpt3-2.7b", "--cluster", "h100-sxm-80gb:16", "--global-batch", "64",
            "--seq-len", "2048", "--plan", "tp=2,dp=8", "--json"]
    assert main(args + ["--profile", str(f)]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert main(args + ["--profile", "megatron"]) == 0
    named = json.loads(capsys.readouterr().out)
    assert mine["band_basis"] == "unknown" and named["band_basis"] == "profile"
    lo, hi = b.knowledge["unknown"]
    assert math.isclose(mine["step_time_s_low"], mine["step_time_s"] * math.exp(lo), rel_tol=1e-6)
    assert math.isclose(mine["step_time_s_high"], mine["step_time_s"] * math.exp(hi), rel_tol=1e-6)
    assert main(args[:-1] + ["--profile", str(f)]) == 0
    assert "step band" in capsys.readouterr().out
