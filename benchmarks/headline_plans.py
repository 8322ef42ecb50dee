"""The two headline cases of issue 11: meshplan's recommended plans against the published
configurations, judged by meshplan's own (corrected) cost model.

- GPT-3 175B on 1,024 A100-80GB, global batch 1,536 x 2,048 tokens: Megatron's PTD-P
  configuration (Narayanan et al., SC'21: tp=8, pp=8, interleaved, full recomputation) and
  Korthikanti et al. 2022's (tp=8, pp=8, 3 virtual stages, sequence parallel + selective
  recomputation), both at dp=16.
- Llama 3 70B on 256 H100-80GB, global batch 512 x 8,192 tokens: NeMo's Llama 3 70B recipe
  (tp=4, pp=4, cp=2, 5 virtual stages, sequence parallel, distributed optimizer) and
  torchtitan's (tp=8 with sequence parallel, FSDP over the rest, full activation checkpointing,
  local batch 8).

For each: meshplan's top plans (default search: only plans its runtime runs as planned, with
memory headroom), and each published plan's predicted step time, memory, headroom and whether
meshplan's runtime runs it (spec.support).

    PYTHONPATH=src python3 benchmarks/headline_plans.py [--out FILE]

Writes benchmarks/results/headline_plans.json and .md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _evaluators import commit  # noqa: E402

from meshplan.cost import estimate  # noqa: E402
from meshplan.search import search  # noqa: E402
from meshplan.spec.io import load_cluster, load_model  # noqa: E402
from meshplan.spec.plan import Workload, parse_plan  # noqa: E402
from meshplan.spec.plan import microbatches  # noqa: E402
from meshplan.spec.support import export_targets, runtime_violations  # noqa: E402

CASES = [
    {"name": "GPT-3 175B / 1024 x A100-80GB", "model": "gpt3-175b", "cluster": "a100-sxm-80gb:1024",
     "global_batch": 1536, "seq_len": 2048, "published": {
         "Megatron SC'21 (PTD-P)": "tp=8,pp=8,dp=16,micro_batch=1,virtual_stages=2,schedule=interleaved-1f1b,"
                                   "recompute=full",
         "Korthikanti et al. 2022": "tp=8,pp=8,dp=16,micro_batch=1,virtual_stages=3,schedule=interleaved-1f1b,"
                                    "recompute=selective,sequence_parallel=1",
         "Korthikanti et al. 2022 + distributed optimizer": "tp=8,pp=8,dp=16,zero=1,micro_batch=1,virtual_stages=3,"
                                                            "schedule=interleaved-1f1b,recompute=selective,"
                                                            "sequence_parallel=1"}},
    {"name": "Llama 3 70B / 256 x H100-80GB", "model": "llama3-70b", "cluster": "h100-sxm-80gb:256",
     "global_batch": 512, "seq_len": 8192, "published": {
         "NeMo Llama 3 70B recipe": "tp=4,pp=4,dp=8,cp=2,zero=1,micro_batch=1,virtual_stages=5,"
                                    "schedule=interleaved-1f1b,sequence_parallel=1",
         "torchtitan Llama 3 70B": "tp=8,dp=32,zero=3,micro_batch=8,recompute=full,sequence_parallel=1"}},
]


def describe(model, cluster, plan, work) -> dict:
    r = estimate(model, cluster, plan, work)
    micro = microbatches(work.global_batch, plan.dp, plan.micro_batch)
    bad = runtime_violations(plan, micro, model)
    return {"plan": plan.short(), "step_time_s": r.step_time_s, "mfu": r.mfu, "peak_gib": r.peak_memory_gib,
            "usable_gib": r.usable_memory_gib, "fits": r.fits, "at_risk": r.at_risk,
            "runtime_runs_it": not bad, "runtime_issues": [why for _, why in bad],
            "export_targets": export_targets(plan, micro, model)}


def run_case(case: dict) -> dict:
    model, cluster = load_model(case["model"]), load_cluster(case["cluster"])
    work = Workload(global_batch=case["global_batch"], seq_len=case["seq_len"])
    t0 = time.perf_counter()
    res = search(model, cluster, work, top=3)
    wall = time.perf_counter() - t0
    top = [describe(model, cluster, p.plan, work) for p in res.plans]
    pub = {name: describe(model, cluster, parse_plan(text), work) for name, text in case["published"].items()}
    best = top[0]["step_time_s"] if top else None
    for d in pub.values():
        d["speedup_of_meshplan"] = d["step_time_s"] / best if best else None
    return {"case": case["name"], "search_s": round(wall, 2), "considered": res.considered, "feasible": res.feasible,
            "meshplan_top": top, "published": pub}


def to_markdown(rows: list[dict]) -> str:
    out = []
    for r in rows:
        out += [f"### {r['case']}", "", f"searched {r['considered']:,} plans in {r['search_s']} s, "
                f"{r['feasible']:,} feasible (runtime-runnable, with headroom)", "",
                "| plan | source | step s | MFU | peak GiB (usable) | fits with headroom | meshplan's runtime |",
                "|---|---|---:|---:|---|---|---|"]
        rows_ = [(f"meshplan #{i + 1}", d) for i, d in enumerate(r["meshplan_top"])] + list(r["published"].items())
        for who, d in rows_:
            fit = "yes" if d["fits"] and not d["at_risk"] else ("at risk" if d["fits"] else "NO")
            rt = "runs it" if d["runtime_runs_it"] else "; ".join(d["runtime_issues"])
            out.append(f"| `{d['plan']}` | {who} | {d['step_time_s']:.2f} | {100 * d['mfu']:.1f}% | "
                       f"{d['peak_gib']:.1f} ({d['usable_gib']:.1f}) | {fit} | {rt} |")
        out.append("")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "headline_plans.json"))
    args = ap.parse_args()
    rows = [run_case(c) for c in CASES]
    doc = {"commit": commit(), "cases": rows}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    md = to_markdown(rows)
    Path(args.out).with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
