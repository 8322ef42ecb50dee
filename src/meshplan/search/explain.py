"""Why the winner wins: the time terms that differ most from each runner-up, the settings
that differ, and why the other candidates were rejected."""
from __future__ import annotations

import dataclasses

from meshplan.cost.report import CostReport
from meshplan.search.result import RankedPlan, SearchResult
from meshplan.spec.plan import Plan

TERM_LABELS = {
    "compute": "compute", "recompute": "recompute", "tp_comm": "TP communication",
    "cp_comm": "CP communication", "ep_comm": "EP all-to-all", "dp_comm": "DP/FSDP communication",
    "pp_comm": "pipeline send/recv", "bubble": "pipeline bubble", "optimizer": "optimizer step",
    "overhead": "fixed overhead", "memory_pressure": "allocator pressure",
}



def _secs(t: float, signed: bool = False) -> str:
    """Seconds for explanations: 3 decimals from 1 s, else ms or us (tiny models are not 0.000 s)."""
    sign = "+" if signed and t >= 0 else ""
    a = abs(t)
    if a >= 1 or a == 0:
        return f"{sign}{t:.3f} s"
    if a >= 1e-3:
        return f"{sign}{t * 1e3:.2f} ms"
    return f"{sign}{t * 1e6:.1f} us"

def term_differences(a: CostReport, b: CostReport, n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` exposed time terms with the largest |b - a| (seconds; positive: b spends more)."""
    keys = sorted({k for k in (*a.time, *b.time) if not k.endswith("_overlapped")})
    diffs = [(k, b.time.get(k, 0.0) - a.time.get(k, 0.0)) for k in keys]
    eps = 1e-6 * max(a.step_time_s, b.step_time_s)
    diffs = [d for d in diffs if abs(d[1]) > eps]
    diffs.sort(key=lambda d: (-abs(d[1]), d[0]))
    return diffs[:n]


def plan_differences(a: Plan, b: Plan) -> list[str]:
    """'field a->b' for every field that differs."""
    out = []
    for f in dataclasses.fields(Plan):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if va != vb:
            out.append(f"{f.name} {_show(va)}->{_show(vb)}")
    return out


def _show(v: object) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, tuple):
        return ":".join(map(str, v))
    return str(v)


def _pct(x: float, ref: float) -> str:
    return f"{100 * x / ref:+.1f}%" if ref else "n/a"


def compare_line(win: RankedPlan | tuple[Plan, CostReport], other: RankedPlan | tuple[Plan, CostReport],
                 label: str) -> str:
    """One sentence: how ``other`` compares with ``win`` and which terms make the difference."""
    wp, wr = (win.plan, win.report) if isinstance(win, RankedPlan) else win
    op, orp = (other.plan, other.report) if isinstance(other, RankedPlan) else other
    dt = orp.step_time_s - wr.step_time_s
    settings = ", ".join(plan_differences(wp, op)[:5]) or "same settings"
    if dt == 0:
        head = f"{label} ties on predicted step time (ranked by the tie-break: fewer GPUs, less memory, plan string)"
    else:
        head = f"{label} is {_pct(dt, wr.step_time_s)} ({_secs(dt, signed=True)} per step)"
    terms = "; ".join(f"{TERM_LABELS.get(k, k)} {_secs(d, signed=True)}" for k, d in term_differences(wr, orp))
    mem = orp.peak_memory_gib - wr.peak_memory_gib
    return (f"{head}: {terms or 'no term differs'}; memory {mem:+.1f} GiB; differs in {settings}")


def explain(result: SearchResult, runners_up: int = 3) -> list[str]:
    """Sentences: the winner, how it beats the next plans, and the rejection histogram."""
    lines: list[str] = []
    if result.best is not None:
        b = result.best
        r = b.report
        lines.append(f"winner {b.plan.short()} on {b.plan.num_gpus} GPUs: {_secs(r.step_time_s)} per step, "
                     f"MFU {100 * r.mfu:.1f}%, peak {r.peak_memory_gib:.1f} of {r.usable_memory_gib:.1f} "
                     f"GiB usable; largest term: {TERM_LABELS.get(r.dominant, r.dominant)}")
        for other in result.plans[1:1 + runners_up]:
            lines.append(compare_line(b, other, f"#{other.rank} ({other.plan.short()})"))
    lines += rejection_lines(result)
    return lines


def rejection_lines(result: SearchResult) -> list[str]:
    total = result.considered - result.feasible
    if total == 0:
        return [f"all {result.considered:,} candidates are feasible"]
    out = [f"rejected {total:,} of {result.considered:,} candidates:"]
    for name, count in sorted(result.rejected.items(), key=lambda kv: (-kv[1], kv[0])):
        ex = result.reject_examples.get(name)
        out.append(f"  {name}: {count:,}" + (f"  (e.g. {ex})" if ex else ""))
    return out
