"""Profile inference (calibration.infer): candidates scored by their fit, ties, the suggested run."""
from __future__ import annotations

import csv
import json

import pytest

from meshplan.calibration.fit import runs_from_cases
from meshplan.calibration.infer import Candidate, lines, neighbours, profile_toml, score, summary
from meshplan.spec.plan import Plan
from clirun import run


@pytest.fixture(scope="module")
def tt_runs():
    from meshplan.cli.calibrate_cmd import _cases
    from meshplan.validate.report import default_runs_path
    cs = [c for c in _cases(str(default_runs_path())) if c.source_id == "TT_2412_H100" and c.ok
          and c.measured_step_time_s][:3]
    return runs_from_cases(cs)


def test_the_codebase_that_ran_them_explains_them_better(tt_runs):
    """torchtitan's runs (SDPA, FlashAttention backend) against Megatron-DeepSpeed's fused softmax
    that materialises the s x s scores: the runs' own profile has the higher posterior, by far."""
    own = score(tt_runs, "torchtitan", {})
    other = score(tt_runs, "megatron-deepspeed", {})
    assert own.score > other.score + 5
    assert "codebase_speed@all" in own.values


def test_neighbours_are_one_step_away():
    p = Plan(tp=2, pp=2, dp=4, zero=1, micro_batch=2, recompute="selective")
    ns = neighbours(p)
    assert ns and all(n.tp * n.pp * n.dp * n.cp == 16 for n in ns)
    for n in ns:
        diff = [k for k in ("tp", "pp", "dp", "cp", "zero", "micro_batch", "recompute") if getattr(n, k) != getattr(p, k)]
        assert 1 <= len(diff) <= 2 and (len(diff) == 1 or "dp" in diff)


def test_summary_ties_and_ratio():
    a = Candidate("torchtitan", {}, -1.0, {})
    b = Candidate("meshplan", {}, -1.001, {})
    c = Candidate("megatron", {"dp_overlap": True}, -4.0, {})
    info = summary([a, b, c], {"gap": 0.1, "row_id": "1", "model": "m", "plan": "tp=1,pp=1,dp=8", "gpus": 8,
                               "gpu": "h100", "global_batch": 8, "seq_len": 4096,
                               "step_s": {a.label: 1.0, c.label: 1.105}})
    assert info["tied"] == ["meshplan"] and info["next_best"][0]["likelihood_ratio"] == "20.1x"
    text = "\n".join(lines(info))
    assert "cannot tell it from: meshplan" in text and "weak evidence" in text and "megatron with dp_overlap=true" in text and "11% apart" in text
    toml = profile_toml(info | {"settings": {"dp_overlap": False, "attention_kernel": "flash2"}})
    assert 'base = "torchtitan"' in toml and "dp_overlap = false" in toml and 'attention_kernel = "flash2"' in toml


@pytest.mark.slow  # a whole inference (every profile, then the settings) on 3 runs through the CLI
def test_calibrate_infers_a_profile_it_can_plan_with(tmp_path, capsys):
    from meshplan.validate.report import default_runs_path
    rows = [r for r in csv.DictReader(open(default_runs_path())) if r["source_id"] == "TT_2412_H100"][:3]
    for r in rows:  # a user's own fork: no framework named anywhere
        r.update(source_id="MYFORK", source="my fork", source_locator="", notes="", other_settings="")
    f = tmp_path / "fork.csv"
    with open(f, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "cal.json"
    rc, text, err = run(capsys, "calibrate", "--runs", str(f), "--out", str(out))
    assert rc == 0, err
    assert "inferred codebase profile:" in text
    info = json.loads(out.read_text())["inferred_profile"]
    assert not info.get("fitted_under") and info["profile_file"].endswith("cal.profile.toml")
    rc, est, err = run(capsys, "estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--plan",
                       "dp=8,zero=3", "--global-batch", "16", "--profile", info["profile_file"],
                       "--calibration", str(out))
    assert rc == 0, err
    rc, text, err = run(capsys, "calibrate", "--runs", str(f), "--out", str(out), "--infer-profile", "no")
    assert rc == 0 and "inferred codebase profile" not in text
