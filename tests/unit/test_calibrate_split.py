"""`meshplan calibrate --runs few.csv --out c.json` then `meshplan validate --runs rest.csv
--calibration c.json --json` works on any split of a runs CSV (issue 14's done-when).

Splits of the development runs: a few rows (any, or of one source) calibrate, the rest are
validated with that calibration. Edge cases: a single out-of-memory row, a row with only a peak
memory, a row with no measurement at all (only its outcome: it trained), an empty file. Every
development row informs something (a step time, a peak memory or an outcome), so every split of
1-6 rows calibrates; a file with no row is a one-line error.
"""
from __future__ import annotations

import csv
import json
import math
import tempfile
from pathlib import Path

import pytest
from clirun import run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.calibration.space import by_name
from meshplan.calibration.store import builtin, load_calibration
from meshplan.validate.report import default_runs_path

with open(default_runs_path(), newline="") as _f:
    ROWS: list[dict[str, str]] = list(csv.DictReader(_f))
FIELDS = list(ROWS[0])
BY_SOURCE: dict[str, list[int]] = {}
for _i, _r in enumerate(ROWS):
    BY_SOURCE.setdefault(_r["source_id"], []).append(_i)
OOM = [i for i, r in enumerate(ROWS) if r["status"] == "oom"]
STEP_CELLS = [c for c in FIELDS if c.startswith("reported_") and c != "reported_peak_mem_gib"]
"""Every cell a step time is derived from (TFLOP/s, MFU, HFU, step time, tokens/s, samples/s, PFLOP/s)."""


def _write(path: Path, rows: list[dict[str, str]]) -> str:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    return str(path)


def _no_traceback(*texts: str) -> None:
    for t in texts:
        assert "Traceback" not in t, t


def calibrate_then_validate(capsys, d: Path, few: list[dict[str, str]], rest: list[dict[str, str]]) -> dict:
    """Run the two commands on the split; check what the done-when asks; return the calibration's values."""
    cal = d / "c.json"
    rc, out, err = run(capsys, "calibrate", "--runs", _write(d / "few.csv", few), "--out", str(cal))
    _no_traceback(out, err)
    assert rc == 0, err
    loaded = load_calibration(str(cal))
    for name, v in loaded.values.items():
        f = by_name(name)
        assert math.isfinite(v) and f.low <= v <= f.high, (name, v)
    rc, out, err = run(capsys, "validate", "--runs", _write(d / "rest.csv", rest), "--calibration", str(cal), "--json")
    _no_traceback(out, err)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["summary"]["rows"] == len(rest) == len(doc["rows"])
    assert sorted(r["row_id"] for r in doc["rows"]) == sorted(r["row_id"] for r in rest)
    assert "calibration" in doc
    return loaded.values


def _split(idx: list[int]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    chosen = set(idx)
    return [ROWS[i] for i in sorted(chosen)], [r for i, r in enumerate(ROWS) if i not in chosen]


any_rows = st.lists(st.integers(0, len(ROWS) - 1), min_size=1, max_size=6, unique=True)
one_source = st.sampled_from(sorted(BY_SOURCE)).flatmap(
    lambda s: st.lists(st.sampled_from(BY_SOURCE[s]), min_size=1, max_size=min(6, len(BY_SOURCE[s])), unique=True))


@pytest.mark.slow  # five calibrate + validate runs on random splits
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(idx=st.one_of(any_rows, one_source))
def test_any_split_calibrates_and_validates(capsys, idx):
    few, rest = _split(idx)
    with tempfile.TemporaryDirectory() as d:
        calibrate_then_validate(capsys, Path(d), few, rest)


def test_a_single_out_of_memory_row(tmp_path, capsys):
    few, rest = _split([OOM[0]])
    vals = calibrate_then_validate(capsys, tmp_path, few, rest)
    # an outcome informs only the memory parameters
    assert vals and all(by_name(n).target == "memory" for n in vals)


def test_a_row_with_only_memory(tmp_path, capsys):
    i = next(i for i, r in enumerate(ROWS) if r["reported_peak_mem_gib"] and r["source_id"] == "TT_2412_H100")
    row = dict(ROWS[i], **{c: "" for c in STEP_CELLS})
    vals = calibrate_then_validate(capsys, tmp_path, [row], [r for j, r in enumerate(ROWS) if j != i])
    assert vals and all(by_name(n).target == "memory" for n in vals)


def test_a_row_that_only_trained_changes_nothing(tmp_path, capsys):
    """No step time, no peak memory: only 'it ran', which the built-in calibration already predicts
    (it fits): the calibration it writes is the built-in one."""
    i = next(i for i, r in enumerate(ROWS) if r["source_id"] == "TT_2412_H100")
    row = dict(ROWS[i], **{c: "" for c in STEP_CELLS}, reported_peak_mem_gib="")
    vals = calibrate_then_validate(capsys, tmp_path, [row], [r for j, r in enumerate(ROWS) if j != i])
    shipped = builtin().values
    for n, v in vals.items():
        assert v == pytest.approx(shipped.get(n, by_name(n).prior), rel=1e-9, abs=1e-12), n


def test_every_row_of_one_source(tmp_path, capsys):
    few, rest = _split(BY_SOURCE["BLOOM176B"])
    calibrate_then_validate(capsys, tmp_path, few, rest)


def test_an_empty_few_is_a_one_line_error(tmp_path, capsys):
    rc, out, err = run(capsys, "calibrate", "--runs", _write(tmp_path / "few.csv", []), "--out",
                       str(tmp_path / "c.json"))
    _no_traceback(out, err)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("meshplan: error: ") and "no runs" in lines[0], err
    assert not (tmp_path / "c.json").exists()


# --- nothing dropped or reinterpreted silently (a user's CSV with mistakes in it) ---


def test_bad_rows_and_cells_are_reported_not_dropped_silently(capsys, tmp_path):
    few = [dict(ROWS[i]) for i in BY_SOURCE["BLOOM_PREQ_0225"][:4]]
    few[0]["num_layers"] = "abc"            # the row cannot be expressed: skipped, with its reason
    few[1]["reported_step_time_s"] = "fast"  # a measurement cell that is not a number: ignored, and said
    few[2]["precision"] = "fp7"              # not understood: assumed, and said
    out_file = tmp_path / "c.json"
    rc, out, err = run(capsys, "calibrate", "--runs", _write(tmp_path / "few.csv", few), "--out", str(out_file))
    _no_traceback(out, err)
    assert rc == 0, err
    assert f"skipped row {few[0]['row_id']}" in err and "num_layers='abc' is not a number" in err
    assert "reported_step_time_s='fast' is not a positive number" in err
    assert "precision 'fp7' not understood" in err
    info = json.loads(out_file.read_text())["fitted_from"]
    assert [x["row"] for x in info["skipped_rows"]] == [few[0]["row_id"]]
    notes = {x["row"]: x["note"] for x in info["cells_not_understood"]}
    assert "fast" in notes[few[1]["row_id"]] and "fp7" in notes[few[2]["row_id"]]
    assert info["command"].startswith("meshplan calibrate --runs ")


def test_out_of_memory_only_runs_warn_and_bounds_are_flagged(capsys, tmp_path):
    rc, out, err = run(capsys, "calibrate", "--runs", _write(tmp_path / "oom.csv", [ROWS[i] for i in OOM]),
                       "--out", str(tmp_path / "c.json"))
    _no_traceback(out, err)
    assert rc == 0, err
    assert "every run here ran out of memory" in out
    cal = load_calibration(str(tmp_path / "c.json"))
    for name, v in cal.values.items():  # a value at a bound of its range is said to be there
        f = by_name(name)
        if min(abs(v - f.low), abs(v - f.high)) <= 1e-3 * (f.high - f.low):
            assert f"warning: {name} ended at the" in out


def test_unchanged_parameters_are_marked_and_not_credited(capsys, tmp_path):
    few = [ROWS[i] for i in BY_SOURCE["BLOOM_PREQ_0225"][:3]]
    rc, out, err = run(capsys, "calibrate", "--runs", _write(tmp_path / "few.csv", few),
                       "--out", str(tmp_path / "c.json"))
    assert rc == 0, err
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.endswith("(unchanged)"):
            assert i + 1 == len(lines) or "from runs of" not in lines[i + 1], line


def test_missing_required_column_is_an_error(capsys, tmp_path):
    fields = [c for c in FIELDS if c != "num_layers"]
    p = tmp_path / "missing.csv"
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(ROWS[:3])
    for cmd in (["validate", "--runs", str(p)], ["calibrate", "--runs", str(p), "--out", str(tmp_path / "c.json")]):
        rc, out, err = run(capsys, *cmd)
        _no_traceback(out, err)
        assert rc == 2 and "missing column num_layers" in err, (cmd, err)


def test_describe_names_this_meshplans_built_in_values(tmp_path):
    from meshplan.calibration.store import Calibration
    base = builtin().values
    name = "hbm_efficiency"
    cal = Calibration({name: 0.7, "overlap_slowdown": base["overlap_slowdown"]}, "x.json",
                      {"changes": {name: {"from": 0.123, "to": 0.7}}})  # a stale 'from' in an old file
    lines = dict(line.split(" = ", 1) for line in cal.describe())
    assert lines[name] == f"0.7 (built-in {base[name]:.4g})"
    assert lines["overlap_slowdown"].endswith("(the built-in value)")


def test_validate_text_shows_the_verdict_and_the_outcome(capsys):
    rc, out, err = run(capsys, "validate")
    assert rc == 0, err
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0].isdigit()}
    oom = ROWS[OOM[0]]["row_id"]
    assert "ran OOM" in lines[oom]
    assert any(v in lines[oom] for v in ("fits (", "at-risk (", "does-not-fit ("))


def test_fit_names_a_family_or_link_when_it_is_missing_and_a_directory_is_not_a_csv(capsys, tmp_path):
    few = _write(tmp_path / "few.csv", [ROWS[i] for i in BY_SOURCE["BLOOM_PREQ_0225"][:3]])
    for name, needle in (("gemm_efficiency", "gemm_efficiency@ampere"),
                         ("attention_efficiency@hoper", "attention_efficiency@FAMILY"),
                         ("link_efficiency", "link_efficiency@TIER:KIND")):
        rc, out, err = run(capsys, "calibrate", "--runs", few, "--fit", name, "--out", str(tmp_path / "c.json"))
        _no_traceback(out, err)
        assert rc == 2 and needle in err, (name, err)
    rc, out, err = run(capsys, "validate", "--runs", str(tmp_path))
    assert rc == 2 and "is a directory, not a runs CSV" in err, err
