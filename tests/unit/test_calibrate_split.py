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
        assert v == pytest.approx(shipped[n], rel=1e-9, abs=1e-12), n


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
