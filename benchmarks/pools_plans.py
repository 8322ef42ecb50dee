"""The plans meshplan picks on clusters of mixed GPU pools (docs/heterogeneous-hardware.md).

    PYTHONPATH=src python3 benchmarks/pools_plans.py [--out FILE]

For each scenario: the pooled search (search.pools), its winner, the best plan on each pool
alone, the best plan of each kind over several pools (replicas on pools, stages on pools), the
simulated step of the winner against the cost model, and the search time. Writes
benchmarks/results/pools_plans.json. Predictions only (no mixed cluster was measured): the
per-GPU cost model is the one validated on published runs of each GPU type (docs/cost-model.md).
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

from meshplan.search import search  # noqa: E402
from meshplan.sim.pools import simulate_pooled  # noqa: E402
from meshplan.spec.cluster import LinkTier, PooledCluster  # noqa: E402
from meshplan.spec.io import load_cluster, load_model  # noqa: E402
from meshplan.spec.lengths import parse_lengths  # noqa: E402
from meshplan.spec.plan import Workload  # noqa: E402

EXAMPLE = str(ROOT / "docs/examples/a100-h100-pools.toml")


def _slow(bw: float, lat: float) -> PooledCluster:
    c = load_cluster(EXAMPLE)
    return PooledCluster(name=f"a100-h100, {bw:g} GB/s between pools", pools=c.pools,  # type: ignore[attr-defined]
                         inter_pool=LinkTier(name="inter_pool", bandwidth_gbps=bw, latency_us=lat))


def _uneven() -> PooledCluster:
    from meshplan.spec.io import cluster_from_dict
    return cluster_from_dict({"name": "2x8 h100 + 1x8 a100", "pools": [  # type: ignore[return-value]
        {"name": "h100", "gpu": "h100-sxm-80gb", "num_nodes": 2},
        {"name": "a100", "gpu": "a100-sxm-80gb", "num_nodes": 1}]})


SCENARIOS = [  # name, model, cluster, global batch, seq len
    ("done-when: llama3-70b on 8x8 H100 + 8x8 A100-80GB", "llama3-70b", EXAMPLE, 512, 4096),
    ("llama3-70b, global batch 128", "llama3-70b", EXAMPLE, 128, 4096),
    ("llama3-8b, global batch 512", "llama3-8b", EXAMPLE, 512, 4096),
    ("llama3-8b on pools of different sizes: 2x8 H100 + 1x8 A100, global batch 128", "llama3-8b", "uneven", 128,
     4096),
    ("llama3-70b, pools joined by 1 GB/s per GPU", "llama3-70b", "slow1", 512, 4096),
    ("llama3-70b, pools joined by 0.05 GB/s per GPU, 20 ms", "llama3-70b", "slow005", 512, 4096),
    ("llama3-8b, global batch 256, lengths 2048:0.6,8192:0.3,32768:0.1 (a bucket plan runs on one pool)",
     "llama3-8b", EXAMPLE, 256, "2048:0.6,8192:0.3,32768:0.1"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/pools_plans.json"))
    args = ap.parse_args()
    rows = []
    for name, model, cluster, gb, seq in SCENARIOS:
        c = {"slow1": lambda: _slow(1.0, 8.0), "slow005": lambda: _slow(0.05, 20000.0),
             "uneven": _uneven}.get(cluster, lambda: None)() or load_cluster(cluster)
        w = (Workload(global_batch=gb, seq_len=seq) if isinstance(seq, int)
             else Workload.of(gb, parse_lengths(seq)))
        t0 = time.perf_counter()
        r = search(load_model(model), c, w)
        took = time.perf_counter() - t0
        best = r.best_pooled
        sim = simulate_pooled(load_model(model), c, best.plan, w) if best else None
        alone = {k: (v.step_time_s if v else None) for k, v in r.alone.items()}
        fastest_alone = min(v for v in alone.values() if v)
        row = {"scenario": name, "model": model, "cluster": c.name, "global_batch": gb, "seq_len": seq,
               "best_multi_pool_step_s": r.best_multi.step_time_s if r.best_multi else None,
               "search_s": took, "considered": r.considered,
               "best": best.to_dict() if best else None,
               "uses_pools": list(best.plan.pools or ()) if best else [],
               "alone_step_s": alone,
               "speedup_vs_best_single_pool": fastest_alone / best.step_time_s if best else None,
               "best_by_kind": {k: (v.step_time_s if v else None) for k, v in r.best_by_kind.items()},
               "sim_step_s": sim.step_time_s if sim else None,
               "sim_vs_estimate_pct": 100 * (sim.step_time_s / best.step_time_s - 1) if sim else None,
               "explanation": r.explanation}
        rows.append(row)
        print(f"{name}: {best.step_time_s:.2f} s ({', '.join(row['uses_pools'])}), best single pool "
              f"{fastest_alone:.2f} s -> x{row['speedup_vs_best_single_pool']:.2f}; kinds "
              + ", ".join(f"{k} {v:.2f} s" if v else f"{k} -" for k, v in row["best_by_kind"].items())
              + f"; sim {row['sim_vs_estimate_pct']:+.2f}%; search {took:.1f} s")
    doc = {"benchmark": "pools_plans", "python": platform.python_version(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
