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
