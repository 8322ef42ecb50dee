"""The plans meshplan picks on weak links, against plain synchronous training (docs/weak-links.md).

    PYTHONPATH=src python3 benchmarks/weak_links_plans.py [--out FILE]

For each scenario: the search with the weak-link sync methods (objective time-to-target), its
soonest plan that still syncs every step (compression allowed), and the same search with the
methods off (synchronous, uncompressed gradients every step). Writes each winner's
step time, token-efficiency factor, time to target, bytes across the sites per step, and the
search time to benchmarks/results/weak_links_plans.json. Predictions only (no cluster of this
kind was measured): what they rest on is in docs/weak-links.md.
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

from meshplan.search import SearchSpace, search  # noqa: E402
from meshplan.spec.io import load_cluster, load_model  # noqa: E402
from meshplan.spec.plan import Workload  # noqa: E402

SCENARIOS = [  # name, model, cluster, global batch, seq len
    ("done-when: llama3-8b on two sites of 16x8 H100, 2 GB/s", "llama3-8b", "two-dc-h100", 1024, 4096),
    ("llama3-8b on two sites of 32x8 H100, 4 GB/s", "llama3-8b", str(ROOT / "docs/examples/two-dc-64x8-h100.toml"),
     2048, 4096),
    ("llama3-70b on two sites of 32x8 H100, 4 GB/s", "llama3-70b",
     str(ROOT / "docs/examples/two-dc-64x8-h100.toml"), 1024, 4096),
    ("llama3-8b on a cloud cluster, 8x8 H100, 100 Gb/s Ethernet", "llama3-8b", "cloud-h100-100gbe", 256, 4096),
]


def row(p) -> dict:
    r = p.report
    return {"plan": p.plan.short(), "step_time_s": r.step_time_s, "token_factor": r.token_factor,
            "time_to_target_s": r.time_to_target_s, "cross_site_gb": r.cross_site_gb,
            "peak_memory_gib": r.peak_memory_gib, "mfu": r.mfu,
            "dp_comm_s": r.time["dp_comm"], "outer_sync_s": r.time["outer_sync"], "straggler_s": r.time["straggler"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/weak_links_plans.json"))
    args = ap.parse_args()
    out = {"benchmark": "weak_links_plans", "command": "PYTHONPATH=src python3 benchmarks/weak_links_plans.py",
           "platform": platform.platform(), "scenarios": []}
    for name, model, cluster, batch, seq in SCENARIOS:
        m, c, w = load_model(model), load_cluster(cluster), Workload(global_batch=batch, seq_len=seq)
        t0 = time.perf_counter()
        weak = search(m, [c], w, SearchSpace(), objective="time-to-target", top=3)
        t1 = time.perf_counter()
        sync = search(m, [c], w, SearchSpace(sync_methods=False), objective="time", top=1)
        t2 = time.perf_counter()
        best, base = row(weak.best), row(sync.best)
        comp = row(weak.best_per_step) if weak.best_per_step is not None else None
        doc = {"name": name, "model": model, "cluster": Path(cluster).name, "gpus": c.num_gpus,
               "global_batch": batch, "seq_len": seq, "weak_links": best, "synchronous": base,
               "per_step_compressed": comp,
               "speedup_vs_compressed": (comp["time_to_target_s"] / best["time_to_target_s"]) if comp else None,
               "speedup_to_target": base["time_to_target_s"] / best["time_to_target_s"],
               "cross_site_reduction": (base["cross_site_gb"] / best["cross_site_gb"]
                                        if best["cross_site_gb"] > 0 else None),
               "search_s": {"with_sync_methods": t1 - t0, "synchronous_only": t2 - t1},
               "considered": weak.considered}
        out["scenarios"].append(doc)
        red = doc["cross_site_reduction"]
        print(f"{name}\n  weak links:  {best['plan']}\n    {best['step_time_s']:.3f} s/step x{best['token_factor']:.2f}"
              f" = {best['time_to_target_s']:.3f} s to target, {best['cross_site_gb']:.2f} GB across sites\n"
              f"  synchronous: {base['plan']}\n    {base['step_time_s']:.3f} s/step, {base['cross_site_gb']:.1f} GB "
              f"across sites\n  -> {doc['speedup_to_target']:.2f}x sooner to target"
              + (f", {red:,.0f}x less cross-site traffic" if red else "")
              + f" (searched {weak.considered:,} plans in {t1 - t0:.1f} s)"
              + (f"\n  soonest per-step sync (compression allowed): {comp['plan']}\n    "
                 f"{comp['step_time_s']:.3f} s/step x{comp['token_factor']:.2f}, "
                 f"{comp['cross_site_gb']:.2f} GB across sites -> "
                 f"{doc['speedup_vs_compressed']:.2f}x" if comp else ""))
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
