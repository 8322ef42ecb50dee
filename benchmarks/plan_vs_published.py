"""meshplan's plan vs the hand-tuned published plans (Megatron SC'21, Korthikanti et al. 2022,
BLOOM-176B, torchtitan), judged by meshplan's own cost model.

For every such row of the published runs: search the same model, GPUs and global batch, with the
row's fixed settings (precision, compile, FlashAttention, fused loss, async TP, pipeline p2p,
gradient collective: everything the search does not choose), uneven stages allowed. Report the
predicted step time of the published plan and of meshplan's winner (speed-up = published /
winner), whether each fits, and why they differ (the time terms and settings).

    PYTHONPATH=src python3 benchmarks/plan_vs_published.py [--only SOURCE] [--out FILE]

Writes benchmarks/results/plan_vs_published.json and .md.
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

from _evaluators import EVALUATORS, commit  # noqa: E402

from meshplan.cost import estimate  # noqa: E402
from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.search import SearchSpace, search  # noqa: E402
from meshplan.search.explain import compare_line  # noqa: E402
from meshplan.spec.plan import Plan  # noqa: E402
from meshplan.validate.report import default_runs_path  # noqa: E402
from meshplan.validate.runs import load_runs  # noqa: E402

SOURCES = ("MEG_SC21_T1", "KOR22_T5", "BLOOM176B")
SOURCE_PREFIXES = ("TT_",)
LARGE_SPACE = 1_500_000
"""Rows whose full space (with uneven stages) has more candidates than this are searched in a
capped space (listed in the output): interleaving up to 4 virtual stages, hybrid sharding
within one node only."""


def hand_tuned(case) -> bool:
    return case.status == "ok" and (case.source_id in SOURCES or case.source_id.startswith(SOURCE_PREFIXES))


def space_for(case) -> tuple[SearchSpace, str]:
    """The row's fixed settings as the base plan (the searched fields are overwritten)."""
    base = Plan(**{f: getattr(case.plan, f) for f in ("precision", "compile", "flash_attention",
                                                      "fused_loss", "p2p_sharded", "async_tp")
                   if hasattr(case.plan, f)})
    if hasattr(case.plan, "grad_sync"):  # newer Plan field: the framework's gradient collective
        base = base.replace(grad_sync=case.plan.grad_sync)
    # The row's framework settings (e.g. Megatron's unfused attention or scatter-gather sends)
    # may be ones meshplan's own runtime does not run: plans are compared in the framework's
    # space (export-only plans allowed, marked), with meshplan's memory headroom.
    space = SearchSpace(base=base, uneven_stages=True, allow_export_only=True)
    from meshplan.search.space import enumerate_space
    n = enumerate_space(case.model, case.cluster, case.work, space).num_rows
    if n <= LARGE_SPACE:
        return space, ""
    capped = space.replace(max_virtual_stages=4, hybrid_nodes=(1,))
    m = enumerate_space(case.model, case.cluster, case.work, capped).num_rows
    return capped, f"capped space: {n:,} -> {m:,} candidates (virtual stages <= 4, hybrid within a node)"


def run_row(case, evaluator: str = "vectorised") -> dict:
    space, cap = space_for(case)
    pub = estimate(case.model, case.cluster, case.plan, case.work)
    t0, c0 = time.perf_counter(), time.process_time()
    fn, chunk = EVALUATORS[evaluator]
    r = search(case.model, case.cluster, case.work, space, top=3, evaluator=fn, chunk=chunk)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    row = {
        "row_id": case.row_id, "source": case.source_id, "model": case.model_name,
        "gpus": case.cluster.num_gpus, "gpu": case.cluster.gpu.name,
        "global_batch": case.work.global_batch, "seq_len": case.work.seq_len,
        "published_plan": case.plan.short(), "published_pred_s": pub.step_time_s,
        "published_fits": pub.fits, "published_peak_gib": pub.peak_memory_gib,
        "measured_s": case.measured_step_time_s,
        "considered": r.considered, "evaluated": r.evaluated, "feasible": r.feasible,
        "search_s": round(wall, 2), "search_cpu_s": round(cpu, 2), "space": cap or "full (uneven stages)",
    }
    if r.best is None:
        row |= {"meshplan_plan": None, "meshplan_pred_s": None, "meshplan_fits": False,
                "speedup": None, "why": "; ".join(r.nearest)}
        return row
    b = r.best
    row |= {"meshplan_plan": b.plan.short(), "meshplan_pred_s": b.report.step_time_s,
            "meshplan_fits": b.report.fits, "meshplan_peak_gib": b.report.peak_memory_gib,
            "meshplan_mfu": b.report.mfu, "speedup": pub.step_time_s / b.report.step_time_s,
            "meshplan_export_only": None if b.export_only is None else list(b.export_only),
            "published_at_risk": pub.at_risk,
            "same_plan": b.plan == case.plan,
            "why": _why(b, case.plan, pub)}
    return row


def _why(best, plan, pub) -> str:
    if best.plan == plan:
        return "meshplan picks the published plan"
    text = compare_line(best, (plan, pub), "the published plan")
    if not pub.fits:
        text += (f" [published plan predicted not to fit: {pub.peak_memory_gib:.1f} GiB of "
                 f"{pub.usable_memory_gib:.1f} usable]")
    return text


def to_markdown(rows: list[dict]) -> str:
    head = ("| row | source | model | GPUs | B x s | published plan | pred. s | meshplan plan | pred. s "
            "| speed-up | fits | search s |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "n/a"
        mp = f"{r['meshplan_pred_s']:.2f}" if r.get("meshplan_pred_s") else "n/a"
        pub_fit = "" if r["published_fits"] else " (OOM)"
        pub_fit += " (at risk)" if r.get("published_at_risk") else ""
        lines.append(f"| {r['row_id']} | {r['source']} | {r['model']} | {r['gpus']} | "
                     f"{r['global_batch']} x {r['seq_len']} | `{r['published_plan']}` | "
                     f"{r['published_pred_s']:.2f}{pub_fit} | `{r['meshplan_plan']}` | {mp} | {sp} | "
                     f"{'yes' if r['meshplan_fits'] else 'NO'} | {r['search_s']} |")
    sps = [r["speedup"] for r in rows if r.get("speedup")]
    lines += ["", f"{len(rows)} hand-tuned rows; meshplan's plan fits in "
                  f"{sum(bool(r['meshplan_fits']) for r in rows)}; predicted at least as fast as the "
                  f"published plan in {sum(s >= 1 - 1e-9 for s in sps)}; speed-up min {min(sps):.2f}x, "
                  f"median {sorted(sps)[len(sps) // 2]:.2f}x, max {max(sps):.2f}x." if sps else ""]
    capped = [r for r in rows if not r["space"].startswith("full")]
    if capped:
        lines += ["", "Capped spaces (search too slow with the per-plan estimate loop for now):"]
        lines += [f"- row {r['row_id']}: {r['space']}" for r in capped]
    lines += ["", "Why meshplan differs from the published plan (time terms: winner vs published):", ""]
    lines += [f"- row {r['row_id']} ({r['model']}, {r['gpus']} GPUs): {r['why']}" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="only rows whose source id starts with this")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_vs_published.json"))
    ap.add_argument("--evaluator", choices=["vectorised", "loop"], default="vectorised",
                    help="vectorised: meshplan.search.evaluate; loop: the per-plan reference "
                         "(same plans and predictions, ~50x slower)")
    args = ap.parse_args()
    cases = [c for c in load_runs(default_runs_path()) if hand_tuned(c)]
    if args.only:
        cases = [c for c in cases if c.source_id.startswith(args.only)]
    rows = []
    t0 = time.perf_counter()
    for case in cases:
        try:
            row = run_row(case, args.evaluator)
        except MeshplanError as e:
            row = {"row_id": case.row_id, "source": case.source_id, "error": str(e)}
            print(f"row {case.row_id}: error: {e}", flush=True)
            continue
        rows.append(row)
        sp = f"{row['speedup']:.2f}x" if row.get("speedup") else "n/a"
        mine = row.get("meshplan_pred_s") or float("nan")
        print(f"row {row['row_id']:>5} {row['source']:<12} {row['model']:<14} {row['gpus']:>5} GPUs  "
              f"published {row['published_pred_s']:8.3f} s  meshplan {mine:8.3f} s  "
              f"{sp:>7}  fits={row['meshplan_fits']}  {row['search_s']:6.1f} s  {row['meshplan_plan']}",
              flush=True)
    doc = {"note": "predicted step times, both from meshplan's cost model; speedup = published / meshplan",
           "evaluator": args.evaluator, "commit": commit(), "python": platform.python_version(),
           "machine": platform.platform(), "cpus": os.cpu_count(),
           "total_s": round(time.perf_counter() - t0, 1), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(rows))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
