"""Placement on clusters of several sites (issue 26): which axis the search puts across the slow link
between sites, what each placement puts on it, and what searching placements costs in search time.

    PYTHONPATH=src python3 benchmarks/placement_plans.py [--out FILE]

For each scenario (synchronous training: the weak-link sync methods off, so that the placement is
the only lever on the link between sites): the search with placements (the default: the pipeline
or data parallelism across the sites) and without (the default order only, SearchSpace(placements=
(None,))), timed in the same run; the winner's plan, placement, step time and bytes across the
sites; and the winner's mesh under each placement (its step time, bytes across the sites and
which axis crosses them). Writes benchmarks/results/placement_plans.json. Predictions only: no
development run trains across sites.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _evaluators import commit  # noqa: E402

from meshplan.cost import estimate  # noqa: E402
from meshplan.search import SearchSpace, search  # noqa: E402
from meshplan.search.explain import axis_tiers, placement_lines  # noqa: E402
from meshplan.spec.axes import AX  # noqa: E402
from meshplan.spec.io import load_cluster, load_model  # noqa: E402
from meshplan.spec.plan import Workload  # noqa: E402

SCENARIOS = [  # name, model, cluster, global batch, seq len
    ("done-when: llama3-8b on two sites of 16x8 H100, 2 GB/s shared", "llama3-8b", "two-dc-h100", 1024, 4096),
    ("llama3-70b on two sites of 16x8 H100, 2 GB/s shared", "llama3-70b", "two-dc-h100", 1024, 4096),
    ("llama3-8b on three regions of 4x8 H100 (per-pair links)", "llama3-8b", "three-region-h100", 512, 4096),
    ("llama3-70b on two sites of 32x8 H100, 4 GB/s", "llama3-70b",
     str(ROOT / "docs/examples/two-dc-64x8-h100.toml"), 1024, 4096),
]
DP_OUTER = (AX.DP, AX.PP, AX.CP, AX.TP)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/placement_plans.json"))
    args = ap.parse_args()
    out = {"benchmark": "placement_plans", "command": "PYTHONPATH=src python3 benchmarks/placement_plans.py",
           "commit": commit(), "platform": platform.platform(), "scenarios": []}
    for name, model, cluster, batch, seq in SCENARIOS:
        m, c, w = load_model(model), load_cluster(cluster), Workload(global_batch=batch, seq_len=seq)
        t0 = time.perf_counter()
        res = search(m, [c], w, SearchSpace(sync_methods=False), top=3)
        t1 = time.perf_counter()
        fixed = search(m, [c], w, SearchSpace(sync_methods=False, placements=(None,)), top=1)
        t2 = time.perf_counter()
        b = res.best
        orders = {}
        for o in (None, DP_OUTER):
            p = b.plan.replace(mesh_order=o)
            r = estimate(m, c, p, w)
            orders[":".join(o) if o else "default (pp:dp:cp:tp)"] = {
                "step_time_s": r.step_time_s, "cross_site_gb": r.cross_site_gb,
                "tiers": axis_tiers(c, p)}
        row = {"scenario": name, "model": model, "cluster": c.name, "gpus": c.num_gpus,
               "winner": b.plan.short(), "placement": ":".join(b.plan.mesh_order) if b.plan.mesh_order else "default",
               "step_time_s": b.report.step_time_s, "cross_site_gb": b.report.cross_site_gb,
               "default_order_only_winner": fixed.best.plan.short() if fixed.best else None,
               "default_order_only_step_s": fixed.best.report.step_time_s if fixed.best else None,
               "speedup_from_placement": (fixed.best.report.step_time_s / b.report.step_time_s
                                          if fixed.best else None),
               "winner_mesh_under_each_placement": orders,
               "best_by_placement": {k or "default": {"plan": v.plan.short(), "step_time_s": v.report.step_time_s,
                                                      "cross_site_gb": v.report.cross_site_gb}
                                     for k, v in res.best_by_placement.items()},
               "explanation": placement_lines(res),
               "search_s": t1 - t0, "search_default_order_only_s": t2 - t1,
               "considered": res.considered, "considered_default_order_only": fixed.considered}
        out["scenarios"].append(row)
        print(f"{name}: {row['winner']} [{row['placement']}] {row['step_time_s']:.3f} s, "
              f"{row['cross_site_gb']:.1f} GB across sites; default order only: {row['default_order_only_winner']} "
              f"{row['default_order_only_step_s']:.3f} s; search {row['search_s']:.1f} s vs "
              f"{row['search_default_order_only_s']:.1f} s")
        for line in row["explanation"]:
            print("   ", line)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
