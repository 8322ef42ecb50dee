"""The report's figures as inline SVG strings (numpy for binning; no plotting library).

The simulated timeline (``gantt``, ``sim_memory``) is meshplan.sim.output's, the one drawing that
`meshplan simulate --plot` writes too.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from meshplan.search.explain import TERM_LABELS
from meshplan.search.result import SearchResult
from meshplan.sim.output import gantt, sim_memory
from meshplan.svg import (
    PALETTE,
    TICK_PX,
    axes,
    color_bar,
    esc,
    f1,
    legend,
    make_scale,
    num,
    star,
    svg,
    text_width,
    title,
    viridis,
)
from meshplan.svg import fixed3 as seconds3  # three significant figures, for tooltips

__all__ = ["gantt", "memory_breakdown", "pareto_plot", "rejection_chart", "sim_memory", "stacked_bars",
           "time_breakdown"]

TIME_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm", "offload",
              "bubble", "optimizer", "overhead", "memory_pressure")
MEMORY_TERMS = ("weights", "grads", "optimizer", "activations", "transient", "overhead")
MEMORY_LABELS = {"weights": "weights", "grads": "gradients", "optimizer": "optimizer states",
                 "activations": "activations", "transient": "transient buffers", "overhead": "runtime overhead"}


# ---- Pareto front --------------------------------------------------------------------------

def pareto_plot(result: SearchResult, y: str, usable_gib: float | None = None) -> str:
    """Every feasible plan (a density cloud), the Pareto front (coloured by the third
    objective), the top plans (#k) and the winner (star): step time against ``y``
    (``"memory"`` or ``"dollars"``)."""
    ykey, ylabel, ctitle = (("peak_memory_gib", "peak memory per GPU (GiB)", "$ / M tokens") if y == "memory"
                            else ("usd_per_mtok", "$ per million tokens", "peak GiB per GPU"))
    ckey = "usd_per_mtok" if y == "memory" else "peak_memory_gib"
    W, H, left, right, top, bottom = 540.0, 380.0, 64.0, 16.0, 44.0, 46.0
    pts = result.points
    xs, ys = np.asarray(pts.get("step_time_s", []), float), np.asarray(pts.get(ykey, []), float)
    ok = np.isfinite(xs) & np.isfinite(ys)
    xs, ys = xs[ok], ys[ok]
    front = [p for p in result.pareto if math.isfinite(getattr(p, ykey)) and math.isfinite(p.step_time_s)]
    extra_y = [usable_gib] if (y == "memory" and usable_gib) else []
    hidden = 0
    near = [p.step_time_s for p in front] + [t for _, t, _, _ in _ranked(result, ykey)]
    if near and len(xs):  # the time axis covers the front (and the top plans), not the slowest plans
        lo, hi = min(min(near), float(xs.min())), max(near)
        cut = hi + 0.3 * (hi - lo) if hi > lo else 1.3 * hi
        keep = xs <= cut
        hidden = int((~keep).sum())
        xs, ys = xs[keep], ys[keep]
    def ends(v):
        return ([float(v.min()), float(v.max())] if len(v) else [])
    sx = make_scale(ends(xs) + [p.step_time_s for p in front], left, W - right)
    sy = make_scale(ends(ys) + [getattr(p, ykey) for p in front] + extra_y, H - bottom, top, zero=y == "memory")
    body = axes(sx, sy, "step time (s)", ylabel)
    body += _cloud(xs, ys, sx, sy)
    if extra_y:
        yy = f1(sy(usable_gib))
        body.append(f'<line class="limit" x1="{f1(sx.a)}" x2="{f1(sx.b)}" y1="{yy}" y2="{yy}"/>'
                    f'<text class="tick" x="{f1(sx.b - 4)}" y="{f1(sy(usable_gib) - 4)}" text-anchor="end">'
                    f"usable {usable_gib:.1f} GiB</text>")
    single = len(result.clusters) == 1
    if front and single and y == "memory":
        line = []
        for k, p in enumerate(front):  # staircase: memory falls as time grows
            if k:
                line.append(f"{f1(sx(p.step_time_s))},{f1(sy(front[k - 1].peak_memory_gib))}")
            line.append(f"{f1(sx(p.step_time_s))},{f1(sy(p.peak_memory_gib))}")
        body.append(f'<polyline class="front" points="{" ".join(line)}"/>')
    cvals = [getattr(p, ckey) for p in front if math.isfinite(getattr(p, ckey))]
    clo, chi = (min(cvals), max(cvals)) if cvals else (0.0, 1.0)
    for p in front:
        c = getattr(p, ckey)
        t = (c - clo) / (chi - clo) if chi > clo else 0.5
        tip = (f"{p.plan.short()}\n{seconds3(p.step_time_s)} s, {p.peak_memory_gib:.1f} GiB, "
               f"${seconds3(p.usd_per_mtok)}/M tokens" + ("" if single else f", {p.plan.num_gpus} GPUs"))
        body.append(f'<circle data-mark="front" cx="{f1(sx(p.step_time_s))}" cy="{f1(sy(getattr(p, ykey)))}" '
                    f'r="4" fill="{viridis(t)}" stroke="#222" stroke-width="0.5">{title(tip)}</circle>')
    body += _ranked_marks(result, sx, sy, ykey)
    if hidden:
        body.append(f'<text class="tick" x="{f1(sx.b - 4)}" y="{f1(sy.a - 5)}" text-anchor="end">'
                    f"{hidden:,} slower plans not shown</text>")
    body += color_bar(W - right - 150, 16, 150, 8, num(clo), num(chi), f"front colour: {ctitle}",
                      f"cbar-{y}")
    key, _ = legend([("#bbb", "all feasible plans"), (WINNER_COLOR, "winner (star)")], left, 8, 260)
    body += key
    return svg(f"pareto-{y}", W, H, body, f"step time against {ylabel}: feasible plans and Pareto front")


def _cloud(xs: np.ndarray, ys: np.ndarray, sx, sy, nx: int = 64, ny: int = 40, levels: int = 6) -> list[str]:
    """Every feasible plan as a 2-D histogram on the plot's own (possibly log) axes: grey
    cells, darker where more plans fall."""
    if len(xs) == 0:
        return []
    px = np.array([sx(v) for v in xs]) if len(xs) < 2000 else _vscale(sx, xs)
    py = np.array([sy(v) for v in ys]) if len(ys) < 2000 else _vscale(sy, ys)
    x0, x1, y0, y1 = min(sx.a, sx.b), max(sx.a, sx.b), min(sy.a, sy.b), max(sy.a, sy.b)
    cw, ch = (x1 - x0) / nx, (y1 - y0) / ny
    ix = np.clip(((px - x0) / cw).astype(int), 0, nx - 1)
    iy = np.clip(((py - y0) / ch).astype(int), 0, ny - 1)
    counts = np.bincount(iy * nx + ix, minlength=nx * ny)
    cells = np.nonzero(counts)[0]
    level = np.ceil(levels * np.log1p(counts[cells]) / math.log1p(counts.max())).astype(int)  # 1..levels
    w, h = f1(cw + 0.3), f1(ch + 0.3)
    out = []
    for k in range(1, levels + 1):  # one path per shade
        sel = cells[level == k]
        if len(sel) == 0:
            continue
        d = "".join(f"M{f1(x0 + (c % nx) * cw)} {f1(y0 + (c // nx) * ch)}h{w}v{h}h-{w}z" for c in sel)
        lo, hi = int(counts[sel].min()), int(counts[sel].max())
        out.append(f'<path data-mark="cloud" fill="#888" fill-opacity="{0.12 + 0.63 * k / levels:.2f}" d="{d}">'
                   f"{title(f'{lo:,}-{hi:,} plans per cell' if hi > lo else f'{lo:,} plans per cell')}</path>")
    return out


def _vscale(s, v: np.ndarray) -> np.ndarray:
    if s.log:
        t = (np.log10(np.maximum(v, s.lo)) - math.log10(s.lo)) / (math.log10(s.hi) - math.log10(s.lo))
    else:
        t = (v - s.lo) / (s.hi - s.lo)
    return s.a + t * (s.b - s.a)


WINNER_COLOR = "#e8112d"
"""The winner's star: red, a colour the front's viridis scale (purple to yellow) never takes."""


def _ranked(result: SearchResult, ykey: str) -> list[tuple[int, float, float, str]]:
    """(rank, step time, ``ykey`` value, tooltip) of the top plans, best first: the ranked plans
    of one GPU type, or on a cluster of several pools its ranked plans over them (``pooled_plans``)."""
    out = []
    if result.pooled:
        for k, e in enumerate(result.pooled_plans or (), 1):
            yv = e.peak_memory_gib if ykey == "peak_memory_gib" else e.usd_per_m_tokens
            out.append((k, e.step_time_s, yv, f"#{k} {e.plan.short()}\n{seconds3(e.step_time_s)} s, "
                        f"{e.peak_memory_gib:.1f} GiB, ${seconds3(e.usd_per_m_tokens)}/M, {e.num_gpus} GPUs"))
        return out
    for p in result.plans:
        r = p.report
        yv = r.peak_memory_gib if ykey == "peak_memory_gib" else p.usd_per_mtok
        out.append((p.rank, r.step_time_s, yv, f"#{p.rank} {p.plan.short()}\n{seconds3(r.step_time_s)} s, "
                    f"{r.peak_memory_gib:.1f} GiB, ${seconds3(p.usd_per_mtok)}/M"))
    return out


def _ranked_marks(result: SearchResult, sx, sy, ykey: str) -> list[str]:
    """The top plans (circles, labelled #k where the label overlaps no other) and the winner
    (a large red star, drawn last so it stays on top)."""
    placed = [(rank, sx(t), sy(yv), tip) for rank, t, yv, tip in _ranked(result, ykey)
              if math.isfinite(yv) and math.isfinite(t)]
    marks, labels, star_mark = [], [], []
    taken: list[tuple[float, float]] = []
    for rank, x, yy, tip in placed:
        if rank == 1:
            star_mark.append(f'<polygon data-mark="winner" points="{star(x, yy, 11.0)}" fill="{WINNER_COLOR}" '
                             f'stroke="#222" stroke-width="1">{title("winner " + tip)}</polygon>')
        else:
            marks.append(f'<circle data-mark="ranked" cx="{f1(x)}" cy="{f1(yy)}" r="6" fill="none" stroke="#222" '
                         f'stroke-width="1">{title(tip)}</circle>')
            if not all(abs(x - a) > 22 or abs(yy - b) > 12 for a, b in taken):
                continue
            labels.append(f'<text class="rank" x="{f1(x + 7)}" y="{f1(yy - 6)}">#{rank}</text>')
        taken.append((x, yy))
    return marks[::-1] + labels + star_mark


# ---- stacked bars --------------------------------------------------------------------------

def stacked_bars(plot: str, rows: Sequence[tuple[str, str, dict[str, float]]], keys: Sequence[str],
                 labels: dict[str, str], unit: str, xlabel: str,
                 marks: Sequence[tuple[float, str]] = ()) -> str:
    """One horizontal bar per row (label, tooltip prefix, {key: value}), segments in ``keys``
    order (zero segments skipped), a shared legend of the keys that occur, and vertical
    reference lines ``marks`` (value, label)."""
    used = [k for k in keys if any(v.get(k, 0.0) > 0 for _, _, v in rows)]
    colors = {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(keys)}
    W, left, right = 980.0, 56.0, 20.0
    key_items = [(colors[k], labels.get(k, k)) for k in used]
    key, kh = legend(key_items, left, 6, W - left - right)
    top, bar, gap = 6 + kh + (18 if marks else 4), 20.0, 8.0
    H = top + len(rows) * (bar + gap) + 40
    totals = [sum(v.get(k, 0.0) for k in used) for _, _, v in rows]
    sx = make_scale(totals + [m for m, _ in marks] + [0.0], left, W - right, zero=True, log=False)
    sy_bottom = top + len(rows) * (bar + gap)
    body = list(key)
    for t in sx.ticks():
        x = f1(sx(t))
        body.append(f'<line class="grid" x1="{x}" x2="{x}" y1="{f1(top - 2)}" y2="{f1(sy_bottom)}"/>'
                    f'<text class="tick" x="{x}" y="{f1(sy_bottom + 14)}" text-anchor="middle">{esc(num(t))}</text>')
    body.append(f'<text class="label" x="{f1((left + W - right) / 2)}" y="{f1(sy_bottom + 32)}" '
                f'text-anchor="middle">{esc(xlabel)}</text>')
    for i, ((label, tip, vals), total) in enumerate(zip(rows, totals)):
        y = top + i * (bar + gap)
        body.append(f'<text class="tick" x="{f1(left - 6)}" y="{f1(y + bar / 2)}" dy="0.32em" '
                    f'text-anchor="end">{esc(label)}</text>')
        x = 0.0
        for k in used:
            v = vals.get(k, 0.0)
            if v <= 0:
                continue
            share = 100 * v / total if total else 0.0
            body.append(f'<rect data-mark="{esc(k)}" x="{f1(sx(x))}" y="{f1(y)}" width="{f1(sx(x + v) - sx(x))}" '
                        f'height="{f1(bar)}" fill="{colors[k]}">'
                        f"{title(f'{tip}: {labels.get(k, k)} {v:.3g} {unit} ({share:.0f}%)')}</rect>")
            x += v
        body.append(f'<text class="tick" x="{f1(sx(total) + 4)}" y="{f1(y + bar / 2)}" dy="0.32em">'
                    f"{esc(num(total))} {esc(unit)}</text>")
    for k, (value, text) in enumerate(marks):  # labels alternate left and right of their lines
        x = f1(sx(value))
        tx, anchor = (sx(value) - 3, "end") if k % 2 == 0 else (sx(value) + 3, "start")
        body.append(f'<line class="limit" x1="{x}" x2="{x}" y1="{f1(top - 14)}" y2="{f1(sy_bottom)}"/>'
                    f'<text class="tick" x="{f1(tx)}" y="{f1(top - 5)}" text-anchor="{anchor}">'
                    f"{esc(text)}</text>")
    return svg(plot, W, H, body, xlabel)


def time_breakdown(result: SearchResult) -> str:
    rows = [(f"#{p.rank}", f"#{p.rank} {p.plan.short()}",
             {k: v for k, v in p.report.time.items() if not k.endswith("_overlapped")}) for p in result.plans]
    extra = sorted({k for _, _, v in rows for k in v} - set(TIME_TERMS))
    return stacked_bars("time-breakdown", rows, TIME_TERMS + tuple(extra), TERM_LABELS, "s",
                        "exposed seconds per step (communication hidden under compute not shown)")


def memory_breakdown(result: SearchResult) -> str:
    rows = [(f"#{p.rank}", f"#{p.rank} {p.plan.short()}", dict(p.report.memory)) for p in result.plans]
    extra = sorted({k for _, _, v in rows for k in v} - set(MEMORY_TERMS) - {"total"})
    marks: list[tuple[float, str]] = []
    if result.plans:
        b = result.plans[0]
        marks = [(b.report.usable_memory_gib, f"usable {b.report.usable_memory_gib:.1f}"),
                 (b.cluster.gpu.memory_gib, f"HBM {b.cluster.gpu.memory_gib:g}")]
    return stacked_bars("memory-breakdown", rows, MEMORY_TERMS + tuple(extra), MEMORY_LABELS, "GiB",
                        "GiB per GPU on the fullest pipeline stage", marks)


# ---- rejections ----------------------------------------------------------------------------

def rejection_chart(result: SearchResult) -> str:
    """Candidates by outcome: feasible, then each rejection reason (most frequent first)."""
    items = [("feasible", result.feasible, "#54a24b")] + [
        (name, n, "#e45756") for name, n in sorted(result.rejected.items(), key=lambda kv: (-kv[1], kv[0]))]
    W, left, right, row = 980.0, 8.0, 90.0, 38.0
    H = 8 + len(items) * row + 6
    hi = max((n for _, n, _ in items), default=1) or 1
    body = []
    for i, (name, n, color) in enumerate(items):
        y = 8 + i * row
        w = (W - left - right) * n / hi
        share = 100 * n / result.considered if result.considered else 0.0
        body.append(f'<text class="tick" x="{f1(left)}" y="{f1(y + 10)}">{esc(name)}</text>')
        ex = result.reject_examples.get(name, "")
        tip = f"{name}: {n:,} of {result.considered:,} ({share:.1f}%)" + (f"\ne.g. {ex}" if ex else "")
        body.append(f'<rect data-mark="{"feasible" if name == "feasible" else "rejected"}" x="{f1(left)}" '
                    f'y="{f1(y + 14)}" width="{f1(max(w, 1.0 if n else 0.0))}" height="16" fill="{color}">'
                    f"{title(tip)}</rect>")
        label = f"{n:,} ({share:.1f}%)"
        if left + max(w, 1.0) + 5 + text_width(label, TICK_PX) <= W - 2:  # after the bar
            body.append(f'<text class="tick" x="{f1(left + max(w, 1.0) + 5)}" y="{f1(y + 26)}">{esc(label)}</text>')
        else:  # inside the bar's end, so that the figure never clips it
            body.append(f'<text class="tick" x="{f1(left + w - 5)}" y="{f1(y + 26)}" text-anchor="end" '
                        f'fill="#fff">{esc(label)}</text>')
    return svg("rejections", W, H, body, "candidate plans by outcome")
