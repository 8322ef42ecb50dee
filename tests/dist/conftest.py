"""Multi-process runtime tests: torchrun with gloo on CPU, tiny models, fp32.

Every launch is wrapped in a timeout and every rank writes a result marker that the tests
check (an exit code alone does not show that each rank did its part). Skipped without torch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
LAUNCH_TIMEOUT_S = 240


def run_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MESHPLAN_PG_TIMEOUT="60", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def torchrun_worker(tmp: Path, nproc: int, cases: list[dict], worker: Path | None = None,
                    env: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """Run ``worker`` (default worker.py) on ``nproc`` processes; returns {case name: [result of
    each rank]} and, under "__log__", the launch's return code and the end of its stderr."""
    (tmp / "cases.json").write_text(json.dumps(cases))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(worker or WORKER), str(tmp), str(tmp / "cases.json")]
    proc = subprocess.run(cmd, env=env or run_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    out: dict[str, list[dict]] = {c["name"]: [] for c in cases}
    for f in sorted(tmp.glob("*.rank*.json")):
        res = json.loads(f.read_text())
        out.setdefault(res["name"], []).append(res)
    out["__log__"] = [{"rc": proc.returncode, "stderr": proc.stderr[-4000:]}]
    return out


def meshplan_train(*args: str, timeout: float = LAUNCH_TIMEOUT_S, env: dict[str, str] | None = None,
                   cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "meshplan.cli.train_cmd", *args]
    return subprocess.run(cmd, env=env or run_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)


def run_ok(p: subprocess.CompletedProcess) -> None:
    """A `meshplan train` run that exited 0 (else its stderr's tail)."""
    assert p.returncode == 0, p.stderr[-4000:]


def metric_losses(path: Path) -> list[float]:
    """The per-step losses of a --metrics JSONL file."""
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "step" in r]


def train_losses(base: list[str], tmp: Path, name: str, plan: str, *extra: str,
                 nproc: int) -> tuple[list[float], str]:
    """(per-step losses, stderr) of `meshplan train BASE --plan PLAN` on ``nproc`` processes."""
    m = tmp / f"{name}.jsonl"
    p = meshplan_train(*base, "--plan", plan, "--nproc-per-node", str(nproc), "--metrics", str(m), *extra)
    run_ok(p)
    return metric_losses(m), p.stderr


def losses_close(a: list[float], b: list[float], tol: float, steps: int) -> float:
    """The largest per-step difference of two runs of ``steps`` steps, asserted below ``tol``."""
    assert len(a) == len(b) == steps, (a, b)
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst < tol, (worst, a, b)
    return worst


def one_error_line(p: subprocess.CompletedProcess, *needles: str) -> None:
    """A run refused before any rank starts: exit 2, one 'meshplan: error:' line holding every needle."""
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [x for x in p.stderr.splitlines() if x.startswith("meshplan: error:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]
