"""Simulated (meshplan.sim) vs analytical (meshplan.cost.estimate) step time on every
published run of the shipped dev set. Writes benchmarks/results/sim_vs_estimate.json.

    .venv/bin/python benchmarks/sim_vs_estimate.py
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _evaluators import commit  # noqa: E402

from meshplan.sim import simulate_plan  # noqa: E402
from meshplan.validate.report import default_runs_path  # noqa: E402
from meshplan.validate.runs import load_runs  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "sim_vs_estimate.json"


def main() -> int:
    rows = []
    t0 = time.perf_counter()
    for c in load_runs(default_runs_path()):
        if not c.ok:
            continue
        t = time.perf_counter()
        _, s = simulate_plan(c.model, c.cluster, c.plan, c.work)
        rows.append({"row_id": c.row_id, "source": c.source_id, "plan": c.plan.short(),
                     "microbatches": s["microbatches"], "schedule": s["schedule"],
                     "simulated_s": s["step_time_s"], "analytic_s": s["analytic_step_time_s"],
                     "diff_pct": s["sim_vs_analytic_pct"], "bubble_fraction": s["bubble_fraction"],
                     "sim_wall_s": time.perf_counter() - t})
    diffs = [abs(r["diff_pct"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["diff_pct"]))
    summary = {"rows": len(rows), "mean_abs_diff_pct": sum(diffs) / len(diffs), "max_abs_diff_pct": max(diffs),
               "within_3pct": sum(d <= 3 for d in diffs), "worst_row": worst["row_id"],
               "wall_s": time.perf_counter() - t0, "commit": commit()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=2))
    for r in sorted(rows, key=lambda r: -abs(r["diff_pct"]))[:5]:
        print(f"row {r['row_id']:>5} {r['source']:<18} sim {r['simulated_s']:9.3f} s  analytic "
              f"{r['analytic_s']:9.3f} s  {r['diff_pct']:+6.2f}%  {r['plan']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
