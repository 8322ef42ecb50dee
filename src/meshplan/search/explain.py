"""Why the winner wins: the time terms that differ most from each runner-up, the settings
that differ, and why the other candidates were rejected.

With ``objective="cost"`` every comparison is in dollars (for the whole training run when
the result has ``train_tokens``, else per million tokens), with time second: the runners-up
may run on other cluster sizes, where step times do not compare, dollars do.
"""
from __future__ import annotations

import re
from typing import Any

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.report import CostReport
from meshplan.search.constraints import AT_RISK, COST_MODEL_REFUSED, HOST_OOM, LIKELY_OOM, OUT_OF_MEMORY
from meshplan.search.result import OVER_DEADLINE, RankedPlan, SearchResult, token_count, train_days
from meshplan.spec.axes import AX
from meshplan.spec.plan import PLAN_FIELDS, Plan, format_stage_layers

TERM_LABELS = {
    "compute": "compute", "recompute": "recompute", "tp_comm": "TP communication",
    "cp_comm": "CP communication", "ep_comm": "EP all-to-all", "dp_comm": "DP/FSDP communication",
    "pp_comm": "pipeline send/recv", "bubble": "pipeline bubble", "optimizer": "optimizer step",
    "overhead": "fixed overhead", "memory_pressure": "allocator pressure",
    "outer_sync": "outer sync (amortised)", "straggler": "straggler wait",
}


AT_RISK_MARK = "!"
"""Marks a plan at risk of running out of memory (listed only with --no-headroom)."""


def at_risk_words(params: CostParams = DEFAULT_PARAMS) -> str:
    from meshplan.cost.uncertainty import risk_words
    return f"at risk: {risk_words(params)}"


def usd(x: float, signed: bool = False) -> str:
    """Dollars: whole dollars from $100, else cents ($0.81); '+' or '-' with ``signed``."""
    sign = ("+" if x >= 0 else "-") if signed else ("-" if x < 0 else "")
    a = abs(x)
    return f"{sign}${a:,.0f}" if a >= 100 else f"{sign}${a:,.2f}" if a >= 0.01 or a == 0 else f"{sign}${a:.2g}"


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
    for name in PLAN_FIELDS:
        va, vb = getattr(a, name), getattr(b, name)
        if va != vb:
            out.append(f"{name} {_show(va, name)}->{_show(vb, name)}")
    return out


NONE_WORDS = {"stage_layers": "even", "recompute_layers": "all"}
"""How a field's None reads in an explanation (an even split; every block of the stage)."""


def _show(v: object, name: str = "") -> str:
    if v is None:
        return NONE_WORDS.get(name, "none")
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, tuple):
        return format_stage_layers(v) if name == "stage_layers" else ":".join(map(str, v))
    return str(v)


def zero_memory_note(a: Plan, ra: CostReport, b: Plan, rb: CostReport) -> str:
    """Why the plan with zero=3 needs more memory than the one with zero 0/1 under the same
    pipeline (docs/cost-model.md, "One accounting per plan field"): FSDP2 under
    torch.distributed.pipelining keeps the stage gathered and accumulates unsharded fp32
    gradients for the whole step, beside its sharded ones. '' where that is not the case."""
    if a.zero == b.zero or a.pp <= 1 or b.pp <= 1:
        return ""
    (hi, rhi), (lo, rlo) = ((a, ra), (b, rb)) if a.zero > b.zero else ((b, rb), (a, ra))
    more = rhi.peak_memory_gib - rlo.peak_memory_gib
    if hi.zero != 3 or more <= 0.05:
        return ""
    return (f"zero=3 needs {more:.1f} GiB more than zero={lo.zero} here: under a pipeline FSDP keeps the stage "
            "gathered and accumulates unsharded fp32 gradients for the whole step, beside its sharded ones")


def _pct(x: float, ref: float) -> str:
    return f"{100 * x / ref:+.1f}%" if ref else "n/a"


def compare_line(win: RankedPlan | tuple[Plan, CostReport], other: RankedPlan | tuple[Plan, CostReport],
                 label: str) -> str:
    """One sentence: how ``other`` compares with ``win`` and which terms make the difference."""
    wp, wr = (win.plan, win.report) if isinstance(win, RankedPlan) else win
    op, orp = (other.plan, other.report) if isinstance(other, RankedPlan) else other
    dt = orp.step_time_s - wr.step_time_s
    diffs = plan_differences(wp, op)
    settings = (", ".join(diffs[:5]) + (f" and {len(diffs) - 5} more" if len(diffs) > 5 else "")) or "same settings"
    if orp.token_factor != 1 or wr.token_factor != 1:  # ranked by time to target: say so first
        dtt = orp.time_to_target_s - wr.time_to_target_s
        head = (f"{label} is {_pct(dtt, wr.time_to_target_s)} to the target loss (tokens x{orp.token_factor:.2f} "
                f"vs x{wr.token_factor:.2f}) and {_pct(dt, wr.step_time_s)} per step ({_secs(dt, signed=True)})")
    elif dt == 0:
        head = (f"{label} ties on predicted step time (ranked by the tie-break: fewer GPUs, less memory, "
                "fewer parallel dimensions, plan string)")
    else:
        head = f"{label} is {_pct(dt, wr.step_time_s)} ({_secs(dt, signed=True)} per step)"
    terms = "; ".join(f"{TERM_LABELS.get(k, k)} {_secs(d, signed=True)}" for k, d in term_differences(wr, orp))
    mem = orp.peak_memory_gib - wr.peak_memory_gib
    why = zero_memory_note(wp, wr, op, orp)
    return (f"{head}: {terms or 'no term differs'}; memory {mem:+.1f} GiB; differs in {settings}"
            + (f"; {why}" if why else ""))


def term_cost_differences(a: RankedPlan, b: RankedPlan, scale: float, n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` exposed time terms whose dollars differ most between ``a`` and ``b``: a term of
    t seconds per step costs usd_per_mtok * t / step_time per million tokens (GPUs x price x
    t / 3600 per step), times ``scale`` (millions of tokens; 1: per million tokens)."""
    def dollars(p: RankedPlan) -> dict[str, float]:
        r = p.report
        per_s = p.usd_per_mtok * scale / r.step_time_s if r.step_time_s > 0 else 0.0
        return {k: v * per_s for k, v in r.time.items() if not k.endswith("_overlapped")}
    da, db = dollars(a), dollars(b)
    diffs = [(k, db.get(k, 0.0) - da.get(k, 0.0)) for k in sorted({*da, *db})]
    eps = 1e-6 * max(a.usd_per_mtok, b.usd_per_mtok) * scale
    diffs = [d for d in diffs if abs(d[1]) > eps]
    diffs.sort(key=lambda d: (-abs(d[1]), d[0]))
    return diffs[:n]


def _per_m(x: float) -> str:
    return f"${x:.3f}" if abs(x) >= 0.001 or x == 0 else f"${x:.2g}"


def cost_compare_line(win: RankedPlan, other: RankedPlan, label: str, train_tokens: float | None = None) -> str:
    """One sentence in dollars: how much more ``other`` costs than ``win`` (for the whole run
    of ``train_tokens`` tokens, else per million tokens), how long it takes, and which time
    terms' dollars make the difference."""
    wu, ou = win.usd_per_mtok, other.usd_per_mtok
    if train_tokens is not None:
        scale = train_tokens / 1e6
        money = (f"{usd(ou * scale)} vs {usd(wu * scale)} to train {token_count(train_tokens)} tokens "
                 f"({usd((ou - wu) * scale, signed=True)}; {_per_m(ou)} vs {_per_m(wu)} per million tokens)")
        same = f"{usd(ou * scale)} to train {token_count(train_tokens)} tokens ({_per_m(ou)} per million tokens)"
    else:
        scale = 1.0
        money = f"{_per_m(ou)} vs {_per_m(wu)} per million tokens"
        same = f"{_per_m(ou)} per million tokens"
    wt, ot = win.report.step_time_s, other.report.step_time_s
    if train_tokens is not None:
        wd, od = (float(train_days(t, _tokens_per_step(p), train_tokens)) for t, p in ((wt, win), (ot, other)))
        when = f"in {od:,.1f} days vs {wd:,.1f} ({_pct(od - wd, wd)})"
    else:
        when = f"at {_secs(ot)} per step vs {_secs(wt)} ({_pct(ot - wt, wt)})"
    wn, on = win.plan.num_gpus, other.plan.num_gpus
    where = f" on {_gpus(on)} vs {wn:,}" if on != wn else f" on the same {_gpus(on)}"
    if ou == wu:
        head = (f"{label} ties on predicted cost, {same} (ranked by the tie-break: fewer GPUs, less "
                f"memory, plan string), {when}{where}")
    else:
        head = f"{label} costs {_pct(ou - wu, wu)}: {money}, {when}{where}"
    terms = "; ".join(f"{TERM_LABELS.get(k, k)} {usd(d, signed=True) if scale > 1 else _signed_per_m(d)}"
                      for k, d in term_cost_differences(win, other, scale))
    mem = other.report.peak_memory_gib - win.report.peak_memory_gib
    settings = ", ".join(plan_differences(win.plan, other.plan)[:5]) or "same settings"
    why = zero_memory_note(win.plan, win.report, other.plan, other.report)
    return (f"{head}: {terms or 'no term differs'}; memory {mem:+.1f} GiB; differs in {settings}"
            + (f"; {why}" if why else ""))


def _gpus(n: int) -> str:
    return f"{n:,} GPU" + ("" if n == 1 else "s")


def _signed_per_m(x: float) -> str:
    return ("+" if x >= 0 else "-") + _per_m(abs(x)) + "/M"


def _tokens_per_step(p: RankedPlan) -> float:
    """Tokens per optimizer step of a ranked plan (tokens/s x step time)."""
    return p.report.tokens_per_s * p.report.step_time_s


def winner_line(result: SearchResult) -> str:
    """The winner in one sentence: dollars first in cost mode, step time first otherwise."""
    b = result.best
    assert b is not None
    r = b.report
    risk = f" ({at_risk_words()})" if r.at_risk else ""
    perf = (f"MFU {100 * r.mfu:.1f}%, peak {r.peak_memory_gib:.1f} of {r.usable_memory_gib:.1f} GiB usable{risk}; "
            f"largest term: {TERM_LABELS.get(r.dominant, r.dominant)}")
    head = f"winner {b.plan.short()} on {_gpus(b.plan.num_gpus)}"
    tokens = result.train_tokens
    days = float(train_days(r.step_time_s, _tokens_per_step(b), tokens)) if tokens is not None else None
    within = (f" (deadline {result.deadline_days:g} days)" if result.deadline_days is not None else "")
    if result.objective == "cost":
        if tokens is not None:
            money = (f"{usd(b.usd_per_mtok * tokens / 1e6)} to train {token_count(tokens)} tokens "
                     f"({_per_m(b.usd_per_mtok)} per million) in {days:,.1f} days{within}")
        else:
            money = f"{_per_m(b.usd_per_mtok)} per million tokens"
        return f"{head}: {money}; {_secs(r.step_time_s)} per step, {perf}"
    train = f" ({days:,.1f} days to train {token_count(tokens)} tokens{within})" if days is not None else ""
    return f"{head}: {_secs(r.step_time_s)} per step{train}, {perf}"


def explain(result: SearchResult, runners_up: int = 3) -> list[str]:
    """Sentences: the winner, how it beats the next plans (in dollars with the cost objective),
    and the rejection histogram (always last)."""
    lines: list[str] = []
    if result.best is not None:
        b = result.best
        lines.append(winner_line(result))
        for other in result.plans[1:1 + runners_up]:
            label = f"#{other.rank} ({other.plan.short()})"
            if result.objective == "cost":
                lines.append(cost_compare_line(b, other, label, result.train_tokens))
            else:
                lines.append(compare_line(b, other, label))
        lines += passed_over_lines(result)
        lines += placement_lines(result)
        lines += weak_link_lines(result)
    lines += rejection_lines(result)
    return lines


AXIS_WORDS = {AX.PP: "the pipeline", AX.DP: "data parallelism", AX.CP: "context parallelism",
              AX.TP: "tensor parallelism"}
"""Each mesh axis in words (keys: spec.axes.AXES)."""


def axis_tiers(cluster: Any, plan: Plan) -> dict[str, str]:
    """Axis -> the slowest tier its groups cross under the plan's placement: 'inside a node',
    'across nodes' or 'across sites' (axes of degree 1 left out)."""
    import numpy as np

    from meshplan.spec.axes import AXES
    dims = plan.dims
    grid = dims.rank_grid()
    out = {}
    for i, axis in enumerate(AXES):
        n = dims.degree(axis)
        if n < 2:
            continue
        groups = np.moveaxis(grid, i, -1).reshape(-1, n)  # every group of the axis, by its ranks

        def inside(size: int) -> bool:  # every group of the axis within one block of ``size`` ranks
            blocks = groups // size
            return bool((blocks == blocks[:, :1]).all())
        if inside(cluster.gpus_per_node):
            out[axis] = "inside a node"
        elif cluster.num_dcs < 2 or inside(cluster.gpus_per_dc):
            out[axis] = "across nodes"
        else:
            out[axis] = "across sites"
    return out


def pipeline_site_crossings(cluster: Any, plan: Plan, wrap: bool) -> list[tuple[int, int, int]]:
    """(boundary, site, site) of every pipeline boundary whose peers cross between two sites under
    the plan's placement and site order (spec.axes.ParallelDims.rank_grid): boundary j joins stage
    j and j + 1, the last (pp - 1 -> 0) only with ``wrap`` (interleaved schedules)."""
    if getattr(cluster, "num_dcs", 1) < 2 or plan.pp < 2:
        return []
    grid = plan.dims.rank_grid().reshape(plan.pp, -1) // cluster.gpus_per_dc
    out = []
    for j in range(plan.pp if wrap else plan.pp - 1):
        a, b = grid[j], grid[(j + 1) % plan.pp]
        out += sorted({(j, int(x), int(y)) for x, y in zip(a[a != b], b[a != b])})
    return out


def pipeline_site_line(cluster: Any, plan: Plan) -> str | None:
    """Which site pairs the pipeline's boundaries cross, each with its link (site_links, else
    inter_dc), the slowest named; None where the pipeline crosses no site."""
    wrap = plan.virtual_stages > 1 and plan.schedule != "zbv"
    cross = pipeline_site_crossings(cluster, plan, wrap)
    if not cross:
        return None

    def link(a: int, b: int) -> str:
        t = cluster.site_link(a, b)
        return f"{a}->{b} {t.bandwidth_gbps:g} GB/s {t.latency_us / 1000:g} ms"

    pairs = list(dict.fromkeys((a, b) for j, a, b in cross if j < plan.pp - 1))
    wraps = list(dict.fromkeys((a, b) for j, a, b in cross if j == plan.pp - 1))
    slow = min(dict.fromkeys((min(a, b), max(a, b)) for _, a, b in cross),
               key=lambda k: cluster.site_link(*k).bytes_per_s)
    order = ("site_order=" + ":".join(map(str, plan.site_order)) if plan.site_order is not None
             else "the sites in their own order")
    return (f"pipeline across sites ({order}): boundaries on " + ", ".join(link(a, b) for a, b in pairs)
            + (f"; the interleaved wrap on {', '.join(link(a, b) for a, b in wraps)}" if wraps else "")
            + f" (slowest {slow[0]}-{slow[1]})")


def placement_lines(result: SearchResult) -> list[str]:
    """On a cluster of several sites (or for a winner with a placement of its own): which axis
    crosses which link, and what the other placements the search tried would cost (the bytes
    they put on the link between sites and their step time)."""
    from meshplan.cost import estimate
    from meshplan.search.space import SearchSpace, placement_options
    from meshplan.spec.axes import AXES, DEFAULT_ORDER
    b = result.best
    if b is None or (b.cluster.num_dcs < 2 and b.plan.mesh_order is None):
        return []
    plan, c = b.plan, b.cluster
    order = plan.mesh_order or DEFAULT_ORDER
    tiers = axis_tiers(c, plan)
    where = ", ".join(f"{a}={plan.dims.degree(a)} {tiers[a]}" for a in order if a in tiers)
    own = "the default order" if plan.mesh_order is None else "its own order"
    out = [f"placement {':'.join(order)} ({own}, outermost first): {where}"]
    sites = pipeline_site_line(c, plan)
    if sites:
        out.append("  " + sites)
    if plan.site_order is not None:  # the winner's mesh with the sites in their own order
        try:
            r0 = estimate(result.model, c, plan.replace(site_order=None), result.work, result.params or DEFAULT_PARAMS)
            out.append(f"  vs the sites in their own order (0 to {c.num_dcs - 1}): {_secs(r0.step_time_s)} per "
                       f"step, {r0.step_time_s / b.report.step_time_s:.2f}x the winner's")
        except Exception:  # noqa: BLE001 - an alternative the cost model refuses is simply not compared
            pass
    rb = b.report
    sizes = {a: plan.dims.degree(a) for a in AXES}
    crossing = [AXIS_WORDS[a] for a in order if tiers.get(a) == "across sites"]
    def versus(head: str, p_o: Plan, r_o: CostReport) -> str:
        """``head``: another placement's plan ``p_o`` with its report: which axes cross the sites,
        its bytes on the link between them and its step time, against the winner's."""
        t_o = axis_tiers(c, p_o)
        cross_o = [AXIS_WORDS[a] for a in (p_o.mesh_order or DEFAULT_ORDER) if t_o.get(a) == "across sites"]
        ratio = r_o.step_time_s / rb.step_time_s if rb.step_time_s > 0 else 1.0
        return (f"{head}: {' and '.join(cross_o) or 'nothing'} across the sites, {r_o.cross_site_gb:,.2f} GB per "
                f"step on the link between them (the winner: {rb.cross_site_gb:,.2f} GB, "
                f"{' and '.join(crossing) or 'nothing'} across them); {_secs(r_o.step_time_s)} per step, "
                f"{ratio:.2f}x the winner's")

    def name(o: tuple[str, ...] | None) -> str:
        return ":".join(o or DEFAULT_ORDER) + (" (the default)" if not o else "")

    if result.best_by_placement:  # each placement's own best plan (the fair comparison)
        mine = ":".join(plan.mesh_order) if plan.mesh_order else ""
        for o, other in result.best_by_placement.items():
            if o == mine and other.plan.short() == plan.short():
                continue
            out.append(versus(f"  best with {name(other.plan.mesh_order)}: {other.plan.short()}", other.plan,
                              other.report))
        return out
    for o in placement_options(c, SearchSpace(), sizes):  # the winner's own mesh in the other orders
        if (o or DEFAULT_ORDER) == order:
            continue
        alt = plan.replace(mesh_order=o)
        try:
            ra = estimate(result.model, c, alt, result.work, result.params or DEFAULT_PARAMS)
        except Exception:  # noqa: BLE001 - an alternative the cost model refuses is simply not compared
            continue
        out.append(versus(f"  vs {name(o)} (the same mesh)", alt, ra))
    return out


def sync_words(plan: Any) -> str:
    """How a plan synchronises its data-parallel ranks, in a few words."""
    comp = {"none": "", "bf16": " in bf16", "fp8": " in fp8",
            "powersgd": f" with PowerSGD rank {plan.compression_rank}"}[plan.grad_compression]
    if plan.periodic:
        what = "DiLoCo (outer Nesterov step)" if plan.grad_sync == "diloco" else "local SGD (model averaging)"
        scope = {"dc": "datacenters", "node": "nodes", "all": "data-parallel ranks"}[plan.sync_scope]
        lag = f", overlapped with {plan.sync_overlap} inner step" if plan.sync_overlap else ""
        return f"{what} across {scope} every {plan.sync_every} steps{comp}{lag}"
    return f"a gradient sync every step{comp}" if comp else "a gradient sync every step"


def weak_link_lines(result: SearchResult) -> list[str]:
    """Where sync methods were searched: why the winner's synchronisation wins (or why plain
    synchronous training does), against the fastest uncompressed plan that syncs every step, and
    the soonest compressed one: cross-site traffic, the data-parallel time per step, stragglers,
    the token-efficiency factor (and where it comes from), time to target."""
    b, s, c = result.best, result.best_synchronous, result.best_per_step
    if b is None or (s is None and c is None):
        return []
    first = "the fastest plan that syncs every step uncompressed"
    if s is None:  # (--fix left no uncompressed plan in the space: the compressed one is the baseline)
        s, c = c, None
        first = "the soonest plan that syncs every step (compressed, as --fix asks)"
    rb = b.report
    if b.plan.short() == s.plan.short():
        alt = next((p.plan.short() for p in result.other_plans if p.plan.short() != b.plan.short()), None)
        return ["weak links: plain synchronous training wins here: the methods that save traffic cost more in "
                "tokens, memory or time than they save" + (f" (next by the other ranking: {alt})" if alt else "")]
    from meshplan.cost.convergence import token_efficiency
    params = result.params or DEFAULT_PARAMS
    basis = token_efficiency(params.token_efficiency_file).basis(
        b.plan.grad_sync, b.plan.sync_every, rb.outer_workers, b.plan.grad_compression, b.plan.compression_rank)

    def against(o: RankedPlan, what: str) -> str:
        ro = o.report
        head = (f"against {what} ({o.plan.short()}: {ro.step_time_s:.3f} s per step"
                + (f", tokens x{ro.token_factor:.2f}" if ro.token_factor != 1 else "") + "): ")
        bits = []
        if ro.cross_site_gb > 0:
            bits.append(f"{rb.cross_site_gb:,.2f} GB per step cross the link between sites instead of "
                        f"{ro.cross_site_gb:,.2f} GB ({ro.cross_site_gb / max(rb.cross_site_gb, 1e-12):,.0f}x less)")
        dp_b = rb.time.get("dp_comm", 0) + rb.time.get("outer_sync", 0)
        bits.append(f"data-parallel sync exposed {dp_b:.3f} s per step instead of {ro.time.get('dp_comm', 0):.3f} s")
        big = [(k, d) for k, d in term_differences(rb, ro) if k not in ("dp_comm", "outer_sync", "straggler")]
        if big and abs(big[0][1]) > 0.05 * max(rb.step_time_s, 1e-12):
            k, d = big[0]
            bits.append(f"{TERM_LABELS.get(k, k)} {_secs(-d, signed=True)} per step (the baseline's "
                        f"{ro.time.get(k, 0):.3f} s)")
        if ro.time.get("straggler", 0) > 0:
            bits.append(f"stragglers {rb.time.get('straggler', 0):.3f} s instead of "
                        f"{ro.time.get('straggler', 0):.3f} s")
        ratio = ro.time_to_target_s / rb.time_to_target_s if rb.time_to_target_s > 0 else 1.0
        bits.append(f"to the target loss {ratio:.2f}x " + ("sooner" if ratio >= 1 else "later")
                    + f" ({rb.time_to_target_s:.3f} vs {ro.time_to_target_s:.3f} s per synchronous-equivalent step)")
        return head + "; ".join(bits)

    out = [f"weak links: the winner uses {sync_words(b.plan)}, needing {rb.token_factor:.2f}x the tokens "
           f"of synchronous training ({basis})",
           "  " + against(s, first)]
    if c is not None and c.plan.short() not in (s.plan.short(), b.plan.short()):
        out.append("  " + against(c, "the soonest plan that syncs every step compressed"))
    return out


def passed_over_lines(result: SearchResult) -> list[str]:
    """When the fastest plan that fits was passed over for its risk of running out of memory:
    which, its risk, and what the safer winner costs in time."""
    po, b = result.passed_over, result.best
    if not po or b is None:
        return []
    params = result.params or DEFAULT_PARAMS
    from meshplan.cost.uncertainty import policy_flag, risk_reason
    cost = b.report.step_time_s / po["step_time_s"] - 1
    usable = b.report.usable_memory_gib
    why = risk_reason(po["peak_memory_gib"], usable, po["oom_probability"], params)
    return [f"passed over for its memory risk: {po['plan']} would take {po['step_time_s']:.3f} s per step, but "
            f"needs {po['peak_memory_gib']:.1f} GiB of {usable:.1f} usable: {why}; "
            f"the winner is {100 * cost:.1f}% slower ({b.report.step_time_s - po['step_time_s']:+.3f} s per step) "
            f"(`{policy_flag(po['peak_memory_gib'], usable, po['oom_probability'], params)}` accepts the faster plan)"]


NEED = r"needs ([\d.]+ GiB per GPU of [\d.]+ usable(?: \(over by [^)]*\))?)"
"""The memory part of a rejection example (units.gib_need)."""


def size_reason(result: SearchResult) -> str:
    """Why a result of one cluster size has no feasible plan, in a few words: the deadline
    when plans fit but are too slow, the memory headroom when plans fit but too tightly,
    memory when plans pass the constraints but none fits, else the constraint that rejects
    the most candidates (with its example)."""
    rej = result.rejected
    if rej.get(OVER_DEADLINE):
        f = result.fastest
        if f is not None and result.train_tokens is not None:
            d = float(train_days(f.step_time_s, result.work.tokens, result.train_tokens))
            return f"no plan meets the {result.deadline_days:g}-day deadline (the fastest takes {d:,.1f} days)"
        return f"no plan meets the {result.deadline_days:g}-day deadline"
    if rej.get(HOST_OOM):
        m = re.search(r"needs (\d+) GiB of host memory per GPU, over the (\d+) GiB",
                      result.reject_examples.get(HOST_OOM, ""))
        return ("the plans that fit the GPU need more host memory for their offload than a GPU has"
                + (f" (e.g. {m[1]} GiB per GPU of {m[2]})" if m else ""))
    if rej.get(AT_RISK):
        ex = result.reject_examples.get(AT_RISK, "")
        m = re.search(NEED, ex)
        return ("no plan fits with the memory model's headroom" + (f" (closest needs {m[1]}; --no-headroom "
                "accepts it)" if m else " (--no-headroom accepts such plans)"))
    if rej.get(LIKELY_OOM):
        ex = result.reject_examples.get(LIKELY_OOM, "")
        m = re.search(NEED, ex)
        odds = re.search(r"(a \d+% chance of running out of memory)", ex)
        return ("no plan fits in memory with this codebase's measured bias" + (
            f" (closest needs {m[1]} by the estimate, with {odds[1]})" if m and odds else ""))
    if rej.get(OUT_OF_MEMORY):
        ex = result.reject_examples.get(OUT_OF_MEMORY, "")
        m = re.search(NEED, ex)
        if m:
            return f"no plan fits in memory (closest needs {m[1]})"
        m = re.search(r"alone need ([\d.]+) GiB per GPU of ([\d.]+) usable", ex)
        if m:
            return (f"no plan fits in memory (model states alone need at least {m[1]} GiB per GPU "
                    f"of {m[2]} usable)")
        return "no plan fits in memory" + (f" ({ex})" if ex else "")
    if not rej:
        return "no candidate plan"
    name, count = min(rej.items(), key=lambda kv: (-kv[1], kv[0]))
    ex = result.reject_examples.get(name)
    what = "no plan passes the constraints" if name != COST_MODEL_REFUSED else "the cost model refused every plan"
    return f"{what}; most often: {name} ({count:,} of {result.considered:,}" + (f"; e.g. {ex})" if ex else ")")


def rejection_lines(result: SearchResult) -> list[str]:
    total = result.considered - result.feasible
    if total == 0:
        return [f"all {result.considered:,} candidates are feasible"]
    out = [f"rejected {total:,} of {result.considered:,} candidates:"]
    for name, count in sorted(result.rejected.items(), key=lambda kv: (-kv[1], kv[0])):
        ex = result.reject_examples.get(name)
        out.append(f"  {name}: {count:,}" + (f"  (e.g. {ex})" if ex else ""))
    return out
