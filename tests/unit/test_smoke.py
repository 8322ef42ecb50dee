"""End-to-end smoke runs of the installed command, each in a fresh process as a user runs it:
`meshplan plan --out`, then `estimate`, `simulate` and `report` on the plan file, and `python -m
meshplan --help`. The in-process command-line tests check the output; these check the entry points."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MESHPLAN = shutil.which("meshplan", path=str(Path(sys.executable).parent)) or shutil.which("meshplan")


def meshplan(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [MESHPLAN] if MESHPLAN else [sys.executable, "-m", "meshplan"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smoke") / "plan.json"
    r = meshplan("plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:4", "--global-batch", "8",
                 "--seq-len", "64", "--out", str(out))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(out.read_text())["predicted"]["step_time_s"] > 0
    return out


def test_python_dash_m_help() -> None:
    r = subprocess.run([sys.executable, "-m", "meshplan", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: meshplan") and "estimate" in r.stdout, r.stderr


def test_estimate_the_plan_file(plan_file: Path) -> None:
    r = meshplan("estimate", "--plan", str(plan_file), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step_time_s"] == pytest.approx(
        json.loads(plan_file.read_text())["predicted"]["step_time_s"])


def test_simulate_the_plan_file(plan_file: Path) -> None:
    r = meshplan("simulate", "--plan", str(plan_file), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step_time_s"] > 0


def test_report_the_plan_file(plan_file: Path, tmp_path: Path) -> None:
    r = meshplan("report", "--plan", str(plan_file), "--out", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


def test_a_bad_input_is_one_line_and_exit_2() -> None:
    r = meshplan("estimate", "--model", "no-such-model", "--cluster", "h100-sxm-80gb:8", "--plan", "dp=8",
                 "--global-batch", "8")
    assert r.returncode == 2 and r.stderr.startswith("meshplan: error:") and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1
