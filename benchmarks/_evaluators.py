"""Evaluators the benchmarks compare: the library's vectorised `evaluate` and the per-plan
reference `evaluate_loop` (one estimate() per plan). Both return the same columns."""
from __future__ import annotations

from meshplan.search.evaluate import evaluate, evaluate_loop

EVALUATORS = {"vectorised": (evaluate, 32768), "loop": (evaluate_loop, 2048)}
"""name -> (evaluator, rows per call)."""
