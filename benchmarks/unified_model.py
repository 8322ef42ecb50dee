"""One model representation, one cost path (issue 12): the figures its "done when" asks for.

    PYTHONPATH=src python3 benchmarks/unified_model.py [--out FILE]

1. The same model described two ways: Llama-2-7B from a Hugging Face config.json (ingested on
   the meta device) and the ``llama2-7b`` preset (generated analytically), 64 H100, global batch
   512, sequence 4,096: the estimate of several plans both ways (step time and peak memory, %
   difference) and the best plan of each search.
2. ``meshplan plan`` on the ingested graph (a .json from ``meshplan ingest --out``) for 1,024
   H100: plans considered and the wall time of the whole process (a subprocess, as a user runs it).
3. Pricing throughput of the one vectorised cost path (``cost.batch.estimate_batch``) on the same
   random feasible plans' columns for a preset and for ingested models (the Llama graph, ResNet-50,
   a ViT, a GNN from tests/data/modules): plans per second, and the ratio to the preset's in the
   same run (absolute rates vary with the machine's load; the ratio does not).

Writes benchmarks/results/unified_model.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "data" / "modules"))

from meshplan.cost import estimate  # noqa: E402
from meshplan.cost.batch import estimate_batch  # noqa: E402
from meshplan.cost.params import DEFAULT_PARAMS  # noqa: E402
from meshplan.search import SearchSpace, search  # noqa: E402
from meshplan.search.constraints import first_violation, violation_masks  # noqa: E402
from meshplan.search.space import enumerate_space  # noqa: E402
from meshplan.spec.io import dump_json, load_cluster, load_model  # noqa: E402
from meshplan.spec.plan import Workload, parse_plan  # noqa: E402

LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0}
PLANS = ["dp=64,zero=1", "dp=64,zero=3", "tp=2,dp=32,zero=3", "tp=4,pp=2,dp=8,zero=1,sequence_parallel=1",
         "pp=4,dp=16,zero=1", "tp=2,pp=2,dp=16,zero=1,recompute=full", "tp=8,dp=8,zero=1,recompute=selective",
         "tp=2,cp=2,dp=16,zero=1,sequence_parallel=1", "pp=4,dp=16,virtual_stages=2,schedule=interleaved-1f1b"]
MODULES = {"resnet50": ("module:resnet50:make_resnet50", None), "vit": ("module:vit:make_vit", None),
           "gnn": ("module:gnn:make_gnn", None)}


def two_ways(tmp: Path) -> dict:
    from meshplan.ingest import ingest
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps(LLAMA2_7B))
    t0 = time.perf_counter()
    graph = ingest(f"hf:{cfg}", seq_len=4096)
    traced_s = time.perf_counter() - t0
    (tmp / "llama2-7b.json").write_text(dump_json(graph) + "\n")
    preset, cluster = load_model("llama2-7b"), load_cluster("h100-sxm-80gb:64")
    work = Workload(global_batch=512, seq_len=4096)
    rows = []
    for text in PLANS + [p + ",compile=1" for p in PLANS]:
        plan = parse_plan(text)
        a, b = estimate(preset, cluster, plan, work), estimate(graph, cluster, plan, work)
        rows.append({"plan": text, "preset_step_s": a.step_time_s, "ingested_step_s": b.step_time_s,
                     "step_diff_pct": 100 * (b.step_time_s / a.step_time_s - 1),
                     "preset_peak_gib": a.peak_memory_gib, "ingested_peak_gib": b.peak_memory_gib,
                     "memory_diff_pct": 100 * (b.peak_memory_gib / a.peak_memory_gib - 1)})
    best = {}
    for name, model in (("preset", preset), ("ingested", graph)):
        r = search(model, cluster, work)
        best[name] = {"plan": r.best.plan.short(), "step_time_s": r.best.report.step_time_s,
                      "peak_memory_gib": r.best.report.peak_memory_gib, "considered": r.considered}
    eager = [r for r in rows if "compile" not in r["plan"]]
    fused = [r for r in rows if "compile" in r["plan"]]
    return {"traced_s": traced_s, "plans": rows, "best": best,
            "same_best_plan": best["preset"]["plan"] == best["ingested"]["plan"],
            "max_abs_step_diff_pct": max(abs(r["step_diff_pct"]) for r in rows),
            "max_abs_memory_diff_pct_eager": max(abs(r["memory_diff_pct"]) for r in eager),
            "max_abs_memory_diff_pct_compiled": max(abs(r["memory_diff_pct"]) for r in fused)}


def plan_1024(tmp: Path) -> dict:
    graph = tmp / "llama2-7b.json"
    cmd = [sys.executable, "-m", "meshplan.cli.main", "plan", "--model", str(graph), "--cluster",
           "h100-sxm-80gb:1024", "--global-batch", "2048", "--json", "--top", "3"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        walls.append(time.perf_counter() - t0)
    doc = json.loads(out.stdout)
    return {"command": "meshplan plan --model llama2-7b.json --cluster h100-sxm-80gb:1024 --global-batch 2048",
            "considered": doc["considered"], "search_time_s": doc["search_time_s"], "process_wall_s": walls,
            "process_wall_min_s": min(walls), "best": doc["plans"][0]["short"]}


def _feasible_columns(model, cluster, work, n: int) -> dict:
    cols = enumerate_space(model, cluster, work, SearchSpace(), DEFAULT_PARAMS)
    ok = np.nonzero(first_violation(violation_masks(model, cluster, work, cols), cols.num_rows) < 0)[0]
    idx = np.random.default_rng(0).choice(ok, size=n, replace=len(ok) < n)
    return cols.take(idx).plain()


def rate(model, cluster, work, n: int = 100_000, chunk: int = 32768) -> dict:
    cols = _feasible_columns(model, cluster, work, n)
    estimate_batch(model, cluster, work, {k: v[:64] for k, v in cols.items()})  # warm caches
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        estimate_batch(model, cluster, work, {k: v[start:start + chunk] for k, v in cols.items()})
    dt = time.perf_counter() - t0
    return {"plans": n, "seconds": dt, "plans_per_s": n / dt}


def throughput(tmp: Path) -> dict:
    from meshplan.ingest import ingest
    from meshplan.spec.base import from_dict
    from meshplan.spec.graph import LayerGraph
    cluster = load_cluster("h100-sxm-80gb:1024")
    out = {"preset llama2-7b": rate(load_model("llama2-7b"), cluster, Workload(global_batch=2048, seq_len=4096))}
    g = from_dict(LayerGraph, {k: v for k, v in json.loads((tmp / "llama2-7b.json").read_text()).items()
                               if k != "schema_version"})
    out["ingested llama2-7b"] = rate(g, cluster, Workload(global_batch=2048, seq_len=g.sample_tokens))
    for name, (src, seq) in MODULES.items():
        try:
            g = ingest(src, seq_len=seq)
        except Exception as e:  # noqa: BLE001 - reported, the others still measured
            out[name] = {"error": str(e)}
            continue
        out[name] = rate(g, cluster, Workload(global_batch=4096, seq_len=g.sample_tokens))
    base = out["preset llama2-7b"]["plans_per_s"]
    for v in out.values():
        if "plans_per_s" in v:
            v["ratio_to_preset"] = v["plans_per_s"] / base
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "unified_model.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        res = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "load_avg": os.getloadavg()},
               "two_ways": two_ways(tmp), "plan_1024": plan_1024(tmp), "throughput": throughput(tmp)}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    md = ["# One model representation, one cost path (benchmarks/unified_model.py)", "",
          "## Llama-2-7B two ways (64 x H100, global batch 512 x 4,096)", "",
          "| plan | preset step s | ingested step s | diff | preset GiB | ingested GiB | diff |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["two_ways"]["plans"]:
        md.append(f"| `{r['plan']}` | {r['preset_step_s']:.3f} | {r['ingested_step_s']:.3f} | "
                  f"{r['step_diff_pct']:+.2f}% | {r['preset_peak_gib']:.1f} | {r['ingested_peak_gib']:.1f} | "
                  f"{r['memory_diff_pct']:+.2f}% |")
    b = res["two_ways"]["best"]
    t = res["two_ways"]
    md += ["", f"largest difference: step time {t['max_abs_step_diff_pct']:.2f}%; peak memory "
           f"{t['max_abs_memory_diff_pct_compiled']:.2f}% compiled (fused elementwise kernels), "
           f"{t['max_abs_memory_diff_pct_eager']:.2f}% eager. The compiled step times differ by the fused "
           "kernels' bytes, which the trace estimates (it runs eager ops) and the preset takes from its table."]
    md += ["", f"best plan, preset: `{b['preset']['plan']}` ({b['preset']['step_time_s']:.3f} s); "
           f"ingested: `{b['ingested']['plan']}` ({b['ingested']['step_time_s']:.3f} s); "
           f"same: {res['two_ways']['same_best_plan']}", "",
           "## `meshplan plan` on the ingested graph, 1,024 x H100", "",
           f"{res['plan_1024']['considered']:,} plans considered; search {res['plan_1024']['search_time_s']:.2f} s; "
           f"whole process {res['plan_1024']['process_wall_min_s']:.2f} s (best of 3)", "",
           "## Pricing throughput (estimate_batch, 100,000 feasible plans)", "",
           "| model | plans/s | ratio to the preset |", "|---|---:|---:|"]
    for k, v in res["throughput"].items():
        md.append(f"| {k} | error: {v['error']} | |" if "error" in v else
                  f"| {k} | {v['plans_per_s']:,.0f} | {v['ratio_to_preset']:.2f} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
