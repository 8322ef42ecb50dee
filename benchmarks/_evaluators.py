"""Evaluators the benchmarks compare: the library's vectorised `evaluate` and the per-plan
reference `evaluate_loop` (one estimate() per plan). Both return the same columns."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from meshplan.search.evaluate import evaluate, evaluate_loop

ROOT = Path(__file__).resolve().parents[1]

EVALUATORS = {"vectorised": (evaluate, 32768), "loop": (evaluate_loop, 2048)}
"""name -> (evaluator, rows per call)."""


def best_fields(result: Any) -> dict[str, Any]:
    """A search result's winner (plan, step time, MFU, peak memory) and Pareto size, as the
    search benchmarks record them."""
    best = result.best
    return {
        "best_plan": best.plan.short() if best else None,
        "best_step_time_s": best.report.step_time_s if best else None,
        "best_mfu": best.report.mfu if best else None,
        "best_peak_memory_gib": best.report.peak_memory_gib if best else None,
        "pareto_size": len(result.pareto),
    }


def commit() -> str:
    """The code measured: HEAD, marked '+dirty' when the working tree has changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=ROOT,  # our own outputs
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
