"""Search speed on the issue's four reference problems: plans considered, evaluated (priced by
the full cost model), feasible, and wall time, for the uniform space and with uneven stages.

    PYTHONPATH=src python3 benchmarks/search_speed.py [--only NAME] [--out FILE]

Writes benchmarks/results/search_speed.json, for the vectorised evaluate and for the per-plan
reference loop; the phase timings show where the time goes.
Targets (issue 3, 2-core machine): <= 1 s uniform (>= 1e5 plans considered), <= 10 s uneven;
the default space (uneven splits where the layers do not divide, issue 11): <= 2 s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _evaluators import EVALUATORS, best_fields, commit  # noqa: E402

from meshplan.search import SearchSpace, search  # noqa: E402
from meshplan.spec.io import load_cluster, load_model  # noqa: E402
from meshplan.spec.plan import Workload  # noqa: E402

CASES = [  # name, model, cluster, global batch, seq len
    ("gpt3-175b/1024xA100", "gpt3-175b", "a100-sxm-80gb:1024", 1536, 2048),
    ("llama3.1-405b/16384xH100", "llama3.1-405b", "h100-sxm-80gb:16384", 2048, 8192),
    ("megatron-1t/3072xA100", "megatron-1t", "a100-sxm-80gb:3072", 3072, 2048),
    ("llama3-8b/8xH100", "llama3-8b", "h100-sxm-80gb:8", 64, 8192),
]
TARGET_S = {"uniform": 1.0, "default": 2.0, "uneven": 10.0}
MODES = {"uniform": False, "default": None, "uneven": True}
"""SearchSpace.uneven_stages per space: even splits only; the default (uneven splits where the
layers do not divide into the stages); uneven splits everywhere."""


def run_case(name: str, model: str, cluster: str, batch: int, seq: int, mode: str,
             evaluator: str = "vectorised") -> dict:
    m, c = load_model(model), load_cluster(cluster)
    w = Workload(global_batch=batch, seq_len=seq)
    t0, c0 = time.perf_counter(), time.process_time()
    fn, chunk = EVALUATORS[evaluator]
    r = search(m, c, w, SearchSpace(uneven_stages=MODES[mode]), top=3, evaluator=fn, chunk=chunk)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "case": name, "space": mode, "evaluator": evaluator, "model": model, "cluster": cluster, "global_batch": batch,
        "seq_len": seq, "considered": r.considered, "evaluated": r.evaluated, "feasible": r.feasible,
        "rejected": r.rejected, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "timings_s": {k: round(v, 3) for k, v in r.timings.items()},
        "evaluated_per_s": round(r.evaluated / max(r.timings.get("evaluate_s", wall), 1e-9), 1),
        "target_s": TARGET_S[mode], "meets_target": wall <= TARGET_S[mode],
        **best_fields(r),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run only cases whose name contains this")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "search_speed.json"))
    ap.add_argument("--evaluator", choices=["vectorised", "loop", "both"], default="both",
                    help="vectorised: meshplan.search.evaluate (cost.batch.estimate_batch); loop: "
                         "the reference, one estimate() per plan")
    args = ap.parse_args()
    evaluators = ["vectorised", "loop"] if args.evaluator == "both" else [args.evaluator]
    rows = []
    for case in CASES:
        if args.only and args.only not in case[0]:
            continue
        for mode, ev in ((u, e) for e in evaluators for u in MODES):  # noqa: B007
            row = run_case(*case, mode=mode, evaluator=ev)
            rows.append(row)
            print(f"{row['case']:<26} {row['space']:<8} {ev:<10} considered {row['considered']:>9,}  evaluated "
                  f"{row['evaluated']:>7,}  feasible {row['feasible']:>7,}  {row['wall_s']:8.2f} s "
                  f"(cpu {row['cpu_s']:.2f} s)  "
                  f"best {row['best_step_time_s'] or float('nan'):.3f} s  {row['best_plan']}", flush=True)
    doc = {
        "note": ("evaluator 'vectorised' is meshplan.search.evaluate (cost.batch.estimate_batch "
                 "on PlanColumns.plain()); 'loop' is the reference evaluate_loop (one "
                 "cost.estimate() per plan). Enumeration, constraints and bounds are vectorised "
                 "in both. wall_s includes everything; cpu_s is this process's CPU time (less "
                 "sensitive to other load: see load_avg_1min)."),
        "commit": commit(), "python": platform.python_version(), "machine": platform.platform(),
        "cpus": os.cpu_count(), "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
