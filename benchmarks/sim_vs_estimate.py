"""Simulated (meshplan.sim) vs analytical (meshplan.cost.estimate) step time.

1. Every published run of the shipped dev set -> benchmarks/results/sim_vs_estimate.json.
2. A synthetic sweep of the split-backward schedules (zbv, zero-bubble) over a few models,
   clusters and micro-batch counts -> benchmarks/results/sim_vs_estimate_synthetic.json, each
   row with the difference split term by term (docs/simulation.md):
   - order: the cost model's own per-pass times (each virtual stage's forward, input-gradient
     and weight-gradient seconds with its exposed communication and the sends the cost model
     charges) run in the schedule's real order (torch.distributed.pipelining's), minus the
     cost model's m max T + closed-form bubble: the error of the closed form;
   - rest: what remains (sends the cost model charges that do not happen: the ZB-H1
     pipeline's ends; per-rank end of step; communication streams).

    .venv/bin/python benchmarks/sim_vs_estimate.py [--only published|synthetic]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _evaluators import commit  # noqa: E402

from meshplan.cases import case_params  # noqa: E402
from meshplan.cost import check, estimate  # noqa: E402
from meshplan.cost.durations import stage_totals  # noqa: E402
from meshplan.sim import Pass, RankStep, SimSpec, VStage, run, simulate  # noqa: E402
from meshplan.sim.build import spec_from_plan  # noqa: E402
from meshplan.sim.schedules import rank_chunk  # noqa: E402
from meshplan.spec.io import load_cluster, load_model, load_plan  # noqa: E402
from meshplan.spec.plan import Workload  # noqa: E402
from meshplan.validate.report import default_runs_path  # noqa: E402
from meshplan.validate.runs import load_runs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "sim_vs_estimate.json"
OUT_SYNTHETIC = RESULTS / "sim_vs_estimate_synthetic.json"

# (model, cluster, plan without schedule, seq_len); micro-batches per step: pp x MULTIPLES
SWEEP = [("llama3-8b", "h100-sxm-80gb:8", "tp=2,pp=4", 8192),
         ("llama3-8b", "h100-sxm-80gb:16", "tp=2,pp=8", 8192),
         ("llama3-8b", "h100-sxm-80gb:16", "tp=4,pp=4,recompute=full", 8192),
         ("llama3-70b", "h100-sxm-80gb:64", "tp=8,pp=8", 8192),
         ("llama3-70b", "h100-sxm-80gb:32", "tp=8,pp=4,recompute=full", 4096),
         ("gpt3-13b", "a100-sxm-80gb:16", "tp=4,pp=4", 2048),
         ("mixtral-8x7b", "h100-sxm-80gb:32", "tp=4,pp=4,dp=2,ep=2", 4096)]
SCHEDULES = {"zbv": ",schedule=zbv,virtual_stages=2", "zero-bubble": ",schedule=zero-bubble"}
MULTIPLES = (1, 2, 4, 8)


def published() -> dict:
    rows = []
    t0 = time.perf_counter()
    for c in load_runs(default_runs_path()):
        if not c.ok:
            continue
        t = time.perf_counter()
        # each run with its codebase's profile and cells, as `meshplan validate` prices it
        _, s = simulate(c.model, c.cluster, c.plan, c.work, case_params(c))
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
    print("published runs:", json.dumps(summary, indent=2))
    for r in sorted(rows, key=lambda r: -abs(r["diff_pct"]))[:5]:
        print(f"row {r['row_id']:>5} {r['source']:<18} sim {r['simulated_s']:9.3f} s  analytic "
              f"{r['analytic_s']:9.3f} s  {r['diff_pct']:+6.2f}%  {r['plan']}")
    return summary


def order_only_pipeline_s(spec: SimSpec) -> float:
    """The cost model's per-pass exposed times run in the schedule's order, no other effect:
    each virtual stage's forward, input-gradient and weight-gradient compute plus its exposed
    communication, and the sends the cost model charges (ZBV: those that cross ranks, as the
    simulator sends them; other schedules: one with every forward and every backward), with
    no streams, no end of step: the pipeline part of the step, to set against m max T + the
    closed-form bubble."""
    pp, nvs = spec.pp, spec.pp * spec.v
    send = spec.send_s * spec.send_exposed
    stages = []
    for s, vs in enumerate(spec.stages):
        r = rank_chunk(spec.schedule, pp, s)[0]
        if spec.schedule == "zbv":
            sf = send if s + 1 < nvs and rank_chunk(spec.schedule, pp, s + 1)[0] != r else 0.0
            sb = send if s > 0 and rank_chunk(spec.schedule, pp, s - 1)[0] != r else 0.0
        else:
            sf = sb = send if pp > 1 else 0.0
        stages.append(VStage(Pass(vs.fwd.compute + vs.fwd.tp_exposed + vs.fwd.dp_exposed + sf),
                             Pass(vs.bwd.compute + vs.bwd.tp_exposed + vs.bwd.dp_exposed + sb),
                             Pass(vs.wgt.compute)))
    pure = SimSpec(pp=pp, v=spec.v, microbatches=spec.microbatches, schedule=spec.schedule, stages=stages,
                   ranks=[RankStep()] * pp)
    return run(pure).step_time_s


def synthetic() -> dict:
    rows = []
    t0 = time.perf_counter()
    for model_name, cluster_name, base, seq in SWEEP:
        model, cluster = load_model(model_name), load_cluster(cluster_name)
        for sched, extra in SCHEDULES.items():
            plan = load_plan(base + extra)
            for k in MULTIPLES:
                work = Workload(global_batch=plan.pp * k * plan.dp * plan.micro_batch, seq_len=seq)
                check(model, cluster, plan, work)
                spec, d = spec_from_plan(model, cluster, plan, work)
                res = run(spec)
                a = d.analytic
                sim, ana = res.step_time_s, a["step_time_s"]
                m, tmax = d.microbatches, max(stage_totals(d))
                order = order_only_pipeline_s(spec) - (m * tmax + a["bubble"])
                peaks = [r["peak_memory_gib"] for r in res.summary()["ranks"]]
                mem = estimate(model, cluster, plan, work).memory_per_stage
                f, b, w = (d.fwd_s[1], d.bwd_input_s[1] + d.recompute_s[1], d.bwd_weight_s[1])
                rows.append({"model": model_name, "cluster": cluster_name, "plan": plan.short(), "seq_len": seq,
                             "schedule": sched, "microbatches": m, "pp": plan.pp,
                             "f_b_w_per_block": [1.0, b / f, w / f],
                             "simulated_s": sim, "analytic_s": ana, "diff_pct": 100 * (sim / ana - 1),
                             "order_pct": 100 * order / ana, "rest_pct": 100 * (sim - ana - order) / ana,
                             "analytic_bubble_s": a["bubble"],
                             "peak_gib_sim": peaks, "peak_gib_analytic": mem,
                             "peak_max_diff_gib": max(peaks) - max(mem)})
    summary: dict = {"rows": len(rows), "wall_s": time.perf_counter() - t0, "commit": commit()}
    for sched in SCHEDULES:
        for label, sel in (("", lambda r: True), ("_m_ge_2pp", lambda r: r["microbatches"] >= 2 * r["pp"])):
            rs = [r for r in rows if r["schedule"] == sched and sel(r)]
            diffs = [abs(r["diff_pct"]) for r in rs]
            summary[sched + label] = {
                "rows": len(rs), "mean_abs_diff_pct": sum(diffs) / len(diffs), "max_abs_diff_pct": max(diffs),
                "within_3pct": sum(x <= 3 for x in diffs),
                "mean_abs_order_pct": sum(abs(r["order_pct"]) for r in rs) / len(rs),
                "max_abs_order_pct": max(abs(r["order_pct"]) for r in rs),
                "mean_abs_rest_pct": sum(abs(r["rest_pct"]) for r in rs) / len(rs)}
    OUT_SYNTHETIC.parent.mkdir(parents=True, exist_ok=True)
    OUT_SYNTHETIC.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print("synthetic sweep:", json.dumps(summary, indent=2))
    print(f"{'model':<13}{'plan':<44}{'m':>4} {'sim s':>8} {'analytic':>9} {'diff':>7} = {'order':>7} "
          f"{'rest':>7}  {'peak GiB sim/analytic':>22}")
    for r in rows:
        print(f"{r['model']:<13}{r['plan'][:43]:<44}{r['microbatches']:>4} {r['simulated_s']:8.3f} "
              f"{r['analytic_s']:9.3f} {r['diff_pct']:+6.2f}% = {r['order_pct']:+6.2f}% "
              f"{r['rest_pct']:+6.2f}%  {max(r['peak_gib_sim']):9.1f} / {max(r['peak_gib_analytic']):5.1f}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("published", "synthetic"))
    args = p.parse_args(argv)
    if args.only != "synthetic":
        published()
    if args.only != "published":
        synthetic()
    return 0


if __name__ == "__main__":
    sys.exit(main())
