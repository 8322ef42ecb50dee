"""The report's figures as inline SVG strings (numpy for binning; no plotting library)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from meshplan.report.svg import (
    PALETTE,
    Scale,
    axes,
    color_bar,
    esc,
    f1,
    fixed3,
    legend,
    make_scale,
    num,
    star,
    svg,
    title,
    viridis,
)
from meshplan.search.explain import TERM_LABELS
from meshplan.search.result import SearchResult
from meshplan.sim.engine import STREAMS, SimResult
from meshplan.sim.output import COLORS as SIM_COLORS
from meshplan.sim.output import STREAM_NAMES

TIME_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm", "offload",
              "bubble", "optimizer", "overhead", "memory_pressure")
MEMORY_TERMS = ("weights", "grads", "optimizer", "activations", "transient", "overhead")
MEMORY_LABELS = {"weights": "weights", "grads": "gradients", "optimizer": "optimizer states",
                 "activations": "activations", "transient": "transient buffers", "overhead": "runtime overhead"}
GANTT_WIDTH = 1000.0
"""Pixels of the timeline's time axis; events are merged to this resolution."""
GANTT_LEFT = 108.0


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
    near = [p.step_time_s for p in front] + [p.report.step_time_s for p in result.plans]
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
        tip = (f"{p.plan.short()}\n{fixed3(p.step_time_s)} s, {p.peak_memory_gib:.1f} GiB, "
               f"${fixed3(p.usd_per_mtok)}/M tokens" + ("" if single else f", {p.plan.num_gpus} GPUs"))
        body.append(f'<circle data-mark="front" cx="{f1(sx(p.step_time_s))}" cy="{f1(sy(getattr(p, ykey)))}" '
                    f'r="4" fill="{viridis(t)}" stroke="#222" stroke-width="0.5">{title(tip)}</circle>')
    body += _ranked_marks(result, sx, sy, ykey)
    if hidden:
        body.append(f'<text class="tick" x="{f1(sx.b - 4)}" y="{f1(sy.a - 5)}" text-anchor="end">'
                    f"{hidden:,} slower plans not shown</text>")
    body += color_bar(W - right - 150, 16, 150, 8, num(clo), num(chi), f"front colour: {ctitle}",
                      f"cbar-{y}")
    key, _ = legend([("#bbb", "all feasible plans"), ("#f5c518", "winner")], left, 8, 260)
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


def _ranked_marks(result: SearchResult, sx, sy, ykey: str) -> list[str]:
    """The top plans (circles, labelled #k where the label overlaps no other) and the winner
    (a star, drawn last so it stays on top)."""
    placed = []
    for p in result.plans:
        yv = p.report.peak_memory_gib if ykey == "peak_memory_gib" else p.usd_per_mtok
        if math.isfinite(yv) and math.isfinite(p.report.step_time_s):
            placed.append((p, sx(p.report.step_time_s), sy(yv)))
    marks, labels, star_mark = [], [], []
    taken: list[tuple[float, float]] = []
    for p, x, yy in placed:
        r = p.report
        tip = (f"#{p.rank} {p.plan.short()}\n{fixed3(r.step_time_s)} s, {r.peak_memory_gib:.1f} GiB, "
               f"${fixed3(p.usd_per_mtok)}/M")
        if p.rank == 1:
            star_mark.append(f'<polygon data-mark="winner" points="{star(x, yy)}" fill="#f5c518" stroke="#222" '
                             f'stroke-width="0.8">{title("winner " + tip)}</polygon>')
        else:
            marks.append(f'<circle data-mark="ranked" cx="{f1(x)}" cy="{f1(yy)}" r="6" fill="none" stroke="#222" '
                         f'stroke-width="1">{title(tip)}</circle>')
            if not all(abs(x - a) > 22 or abs(yy - b) > 12 for a, b in taken):
                continue
            labels.append(f'<text class="rank" x="{f1(x + 7)}" y="{f1(yy - 6)}">#{p.rank}</text>')
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
        body.append(f'<text class="tick" x="{f1(left + max(w, 1.0) + 5)}" y="{f1(y + 26)}">{n:,} '
                    f"({share:.1f}%)</text>")
    return svg("rejections", W, H, body, "candidate plans by outcome")


# ---- simulated timeline --------------------------------------------------------------------

def event_kind(stream: str, name: str) -> str:
    """Colour key of a simulated event (as in meshplan.sim.output.write_plot)."""
    if stream == "compute":
        return name[0] if name[:1] in ("F", "B", "W") else "optimizer"
    return stream


KIND_LABELS = {"F": "forward", "B": "backward", "W": "weight gradients", "optimizer": "optimizer step",
               "tp": STREAM_NAMES["tp"], "dp": STREAM_NAMES["dp"], "pp": STREAM_NAMES["pp"]}


def _runs(events: list, sx, min_w: float = 0.5, gap: float = 1.0) -> list[tuple[str, float, float]]:
    """Events of one lane merged at the pixel resolution: (kind, x0, x1). Events closer than
    ``gap`` pixels join when they are of one kind, or when either is narrower than ``min_w``
    (the run then takes the kind covering most of its width)."""
    runs: list[list] = []
    for e in sorted(events, key=lambda e: (e.start, e.end)):
        k = event_kind(e.stream, e.name)
        a, b = sx(e.start), sx(e.end)
        if runs and a - runs[-1][2] < gap and (runs[-1][0] == k or b - a < min_w or runs[-1][2] - runs[-1][1] < min_w):
            r = runs[-1]
            r[2] = max(r[2], b)
            r[3][k] = r[3].get(k, 0.0) + (b - a)
            r[0] = max(r[3], key=lambda kk: (r[3][kk], kk))
        else:
            runs.append([k, a, b, {k: b - a}])
    return [(r[0], r[1], r[2]) for r in runs]


def time_scale(res: SimResult, left: float) -> Scale:
    """Seconds [0, step time] onto the timeline's pixels (shared by the Gantt and memory plots)."""
    return Scale(0.0, res.step_time_s if res.step_time_s > 0 else 1.0, left, left + GANTT_WIDTH)


def gantt(res: SimResult) -> str:
    """Per pipeline rank, one lane per stream (compute, TP/CP/EP, DP/FSDP, pipeline send). One
    <path> per rank, stream and kind of work, its events merged at the pixel resolution (the
    Perfetto trace of `meshplan simulate --trace` has every event)."""
    left, right, top = GANTT_LEFT, 14.0, 30.0
    W = left + GANTT_WIDTH + right
    lanes = len(STREAMS)
    lane = max(3.0, min(12.0, 640.0 / (res.pp * (lanes + 1))))
    group = lane * (lanes + 1)
    H = top + res.pp * group + 40
    sx = time_scale(res, left)
    kinds = [k for k in ("F", "B", "W", "optimizer", "tp", "dp", "pp")
             if any(event_kind(e.stream, e.name) == k for e in res.events)]
    key, _ = legend([(SIM_COLORS[k], KIND_LABELS[k]) for k in kinds], left, 6, GANTT_WIDTH)
    body = list(key)
    y_end = top + res.pp * group
    for t in sx.ticks(8):
        x = f1(sx(t))
        body.append(f'<line class="grid" x1="{x}" x2="{x}" y1="{f1(top)}" y2="{f1(y_end)}"/>'
                    f'<text class="tick" x="{x}" y="{f1(y_end + 14)}" text-anchor="middle">{esc(num(t))}</text>')
    body.append(f'<text class="label" x="{f1(left + GANTT_WIDTH / 2)}" y="{f1(y_end + 32)}" '
                f'text-anchor="middle">seconds into the step</text>')
    by_lane: dict[tuple[int, str], list] = {}
    for e in res.events:
        by_lane.setdefault((e.rank, e.stream), []).append(e)
    for r in range(res.pp):
        y0 = top + r * group
        if lane >= 7:
            for i, s in enumerate(STREAMS):
                body.append(f'<text class="lane" x="{f1(left - 6)}" y="{f1(y0 + i * lane + lane / 2)}" dy="0.32em" '
                            f'text-anchor="end">r{r} {esc(STREAM_NAMES[s])}</text>')
        else:
            body.append(f'<text class="lane" x="{f1(left - 6)}" y="{f1(y0 + lanes * lane / 2)}" dy="0.32em" '
                        f'text-anchor="end">pp rank {r}</text>')
        for i, s in enumerate(STREAMS):
            events = by_lane.get((r, s), [])
            busy: dict[str, list[float]] = {}
            for e in events:
                b = busy.setdefault(event_kind(e.stream, e.name), [0, 0.0])
                b[0] += 1
                b[1] += e.end - e.start
            paths: dict[str, list[str]] = {}
            y, h = f1(y0 + i * lane + 0.5), f1(lane - 1)
            for kind, a, b in _runs(events, sx):
                w = f1(max(b - a, 0.4))
                paths.setdefault(kind, []).append(f"M{f1(a)} {y}h{w}v{h}h-{w}z")
            for kind in sorted(paths, key=lambda k: kinds.index(k)):
                n, sec = busy.get(kind, [0, 0.0])
                tip = f"rank {r} {KIND_LABELS[kind]}: {n:,} events, {sec:.4f} s busy"
                body.append(f'<path data-mark="{kind}" fill="{SIM_COLORS[kind]}" d="{"".join(paths[kind])}">'
                            f"{title(tip)}</path>")
    body.append(f'<line class="cursor" x1="0" x2="0" y1="{f1(top)}" y2="{f1(y_end)}" visibility="hidden"/>'
                f'<text class="cursor-label" x="0" y="{f1(top - 4)}" visibility="hidden"></text>')
    return svg("gantt", W, H, body, "simulated timeline per pipeline rank",
               {"data-x0": f1(sx.a), "data-x1": f1(sx.b), "data-t1": repr(float(sx.hi))})


def sim_memory(res: SimResult, usable_gib: float | None = None) -> str:
    """Memory per GPU over the step, one line per pipeline rank (max over each pixel column)."""
    left, right, top, bottom = GANTT_LEFT, 14.0, 8.0, 46.0
    W = left + GANTT_WIDTH + right
    series = [[(t, b / 2**30) for t, b in s] for s in res.memory]
    peak = max((v for s in series for _, v in s), default=0.0)
    keyh = 0.0
    names = [(PALETTE[r % len(PALETTE)], f"rank {r}") for r in range(res.pp)] if res.pp <= 16 else []
    if names:
        key, keyh = legend(names, left, top, GANTT_WIDTH)
    H = top + keyh + 170 + bottom
    sx = time_scale(res, left)
    sy = make_scale([0.0, peak] + ([usable_gib] if usable_gib else []), H - bottom, top + keyh + 6, zero=True)
    body = axes(sx, sy, "seconds into the step", "GiB per GPU")
    if names:
        body += key
    if usable_gib:
        yy = f1(sy(usable_gib))
        body.append(f'<line class="limit" x1="{f1(sx.a)}" x2="{f1(sx.b)}" y1="{yy}" y2="{yy}"/>')
    for r, s in enumerate(series):
        cols = _column_max(s, res.step_time_s, int(GANTT_WIDTH))
        pts, last = [], None
        for c, v in enumerate(cols):
            if v != last:
                if last is not None:
                    pts.append(f"{f1(left + c)},{f1(sy(last))}")
                pts.append(f"{f1(left + c)},{f1(sy(v))}")
                last = v
        pts.append(f"{f1(left + len(cols))},{f1(sy(last if last is not None else 0.0))}")
        body.append(f'<polyline data-mark="memory" class="series" points="{" ".join(pts)}" '
                    f'stroke="{PALETTE[r % len(PALETTE)]}">'
                    f"{title(f'rank {r}: peak {max(v for _, v in s):.1f} GiB')}</polyline>")
    return svg("sim-memory", W, H, body, "simulated memory per GPU over the step")


def _column_max(series: list[tuple[float, float]], end: float, n: int) -> list[float]:
    """A step function (time, level) sampled as the max level in each of ``n`` columns."""
    out = [-math.inf] * n
    scale = n / end if end > 0 else 0.0
    pts = list(series)  # in time order; equal times: the later entry is the level that holds
    for k, (t, v) in enumerate(pts):
        t_next = pts[k + 1][0] if k + 1 < len(pts) else end
        if t_next <= t and k + 1 < len(pts):
            continue  # a level held for no time
        c0 = min(n - 1, max(0, int(t * scale)))
        c1 = min(n - 1, max(c0, int(math.ceil(t_next * scale)) - 1))
        for c in range(c0, c1 + 1):
            if v > out[c]:
                out[c] = v
    fill = pts[0][1] if pts else 0.0
    for c in range(n):  # columns no segment reached (cannot happen for a series from 0 to end)
        if out[c] == -math.inf:
            out[c] = fill
        fill = out[c]
    return [round(v, 2) for v in out]
