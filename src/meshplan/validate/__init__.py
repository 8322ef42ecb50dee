"""Validation of the cost model against published training runs.

``load_runs(path)`` turns a CSV of published runs into :class:`meshplan.cases.RunCase` records;
``validate(cases, estimate_fn)`` compares predictions with the measurements;
``to_markdown``/``to_text`` render the result; ``default_runs_path()`` is the shipped dev set.
"""
from meshplan.validate.report import default_runs_path, to_markdown, to_text, validate
from meshplan.validate.runs import case_from_row, load_runs

__all__ = ["case_from_row", "default_runs_path", "load_runs", "to_markdown", "to_text",
           "validate"]
