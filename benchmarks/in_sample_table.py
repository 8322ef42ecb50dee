"""Print docs/cost-model.md's in-sample table ("Accuracy in sample") from `meshplan validate --json`.

    PYTHONPATH=src python benchmarks/in_sample_table.py [validate.json]

Without a file it runs `meshplan validate --json` itself. tests/unit/test_rough_edges3.py checks the
docs' table against validate's summary, so regenerate it whenever the data or the cost model moves.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys


def main(argv: list[str]) -> int:
    if argv:
        doc = json.loads(open(argv[0]).read())
    else:
        from meshplan.cli.main import main as cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli(["validate", "--json"])
        doc = json.loads(out.getvalue())
    s, rows = doc["summary"], doc["rows"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}%"
    print("| source | rows | step-time MAPE | max abs error | memory MAPE (what the rows measured, rows with a peak) |")
    print("|---|---:|---:|---:|---:|")
    for src, v in s["by_source"].items():
        measured = [r for r in rows if r["source_id"] == src and r["memory_error_pct"] is not None]
        mem = "-" if not measured else (f"{v['memory_mape_pct']:.1f}% ("
                                        f"{'/'.join(sorted({r['memory_measure'] for r in measured}))}, {len(measured)} rows)")
        print(f"| {src} | {v['rows']} | {pct(v['mape_pct'])} | {pct(v['max_abs_pct'])} | {mem} |")
    timed = sum(1 for r in rows if r.get("measured_step_time_s") is not None and r["status"] == "ok")
    print(f"| all ({timed} runs with a step time) | {s['rows']} | {s['step_time_mape_pct']:.1f}% | "
          f"{s['step_time_max_abs_pct']:.1f}% | {s['memory_mape_pct']:.1f}% over all {s['memory_rows']} rows |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
