"""Simulation outputs: the Chrome/Perfetto trace, and the step as two figures (a Gantt chart per
pipeline rank, memory over the step).

The figures are drawn once, as SVG (meshplan.svg), for both the HTML report (report.charts) and
`meshplan simulate --plot`: a .svg/.svgz plot is that SVG; any other format matplotlib writes (png,
pdf, ...) is the same figures painted by ``svg.save_image``.
"""
from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.sim.engine import STREAMS, Event, SimResult
from meshplan.spec.axes import AX
from meshplan.svg import (
    PALETTE,
    Scale,
    axes,
    document,
    esc,
    f1,
    fixed3,
    legend,
    make_scale,
    num,
    save_image,
    svg,
    tint,
    title,
)

#: Thread ids of the streams in the trace (one process per pipeline rank).
TIDS = {s: i for i, s in enumerate(STREAMS)}
STREAM_NAMES = {"compute": "compute", AX.TP: "TP/CP/EP comm", AX.DP: "DP/FSDP comm", AX.PP: "pipeline send"}


def trace_dict(res: SimResult) -> dict[str, Any]:
    """Chrome trace-event format: ph=X events, pid = pipeline rank, tid = stream, microseconds."""
    ev: list[dict[str, Any]] = []
    for r in range(res.pp):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"{res.rank_label} {r}"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for s, tid in TIDS.items():
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": STREAM_NAMES[s]}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid, "args": {"sort_index": tid}})
    for e in res.events:
        ev.append({"ph": "X", "name": e.name, "cat": e.stream, "pid": e.rank, "tid": TIDS[e.stream],
                   "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": e.args})
    for r, series in enumerate(res.memory):
        for t, b in series:
            ev.append({"ph": "C", "name": "memory GiB", "pid": r, "tid": 0, "ts": t * 1e6,
                       "args": {"GiB": b / 2**30}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": res.step_time_s, "generator": "meshplan simulate"}}


def write_trace(res: SimResult, path: str | Path) -> None:
    try:
        with open(path, "w") as f:
            json.dump(trace_dict(res), f)
    except OSError as e:
        raise MeshplanError(f"cannot write --trace {path}: {e.strerror}") from None


# ---- the timeline figures ----------------------------------------------------------------------

COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", "optimizer": "#b279a2", "straggler": "#bab0ac",
          AX.TP: "#e45756", AX.DP: "#72b7b2", AX.PP: "#9d755d", "outer": "#ff9da6", "poolwait": "#d9a400"}
"""Colour of each kind of work (``event_kind``)."""
KIND_LABELS = {"F": "forward", "B": "backward", "W": "weight gradients", "optimizer": "optimizer step",
               "straggler": "straggler wait (expected)", AX.TP: STREAM_NAMES[AX.TP], AX.DP: STREAM_NAMES[AX.DP],
               AX.PP: STREAM_NAMES[AX.PP], "outer": "outer sync (amortised)",
               "poolwait": "waits for the slowest pool"}
KINDS = tuple(KIND_LABELS)
"""Kinds of work in legend order."""
LATER_CHUNK = "lighter: a rank's 2nd (4th, ...) model chunk"
GANTT_WIDTH = 1000.0
"""Pixels of the timeline's time axis; events are merged to this resolution."""
GANTT_LEFT = 108.0


def event_kind(stream: str, name: str) -> str:
    """Colour key of a simulated event: F, B, W or optimizer on the compute stream, else the stream."""
    if name.startswith("straggler"):
        return "straggler"
    if name.startswith("outer sync"):
        return "outer"
    if name.startswith("waits for the slowest pool"):
        return "poolwait"
    if stream == "compute":
        return name[0] if name[:1] in ("F", "B", "W") else "optimizer"
    return stream


def _key(e: Event) -> tuple[str, bool]:
    """(kind, on an odd model chunk): passes of a rank's 2nd, 4th, ... chunk are drawn lighter, so
    the interleaved and V-shaped (ZBV) placements show."""
    return event_kind(e.stream, e.name), bool(e.args.get("chunk", 0) % 2)


def _runs(events: list, sx, min_w: float = 0.5, gap: float = 1.0) -> list[tuple[str, float, float, bool]]:
    """Events of one lane merged at the pixel resolution: (kind, x0, x1, odd chunk). Events closer
    than ``gap`` pixels join when they are of one kind and chunk parity, or when either is narrower
    than ``min_w`` (the run then takes the kind covering most of its width)."""
    runs: list[list] = []
    for e in sorted(events, key=lambda e: (e.start, e.end)):
        k = _key(e)
        a, b = sx(e.start), sx(e.end)
        if runs and a - runs[-1][2] < gap and (runs[-1][0] == k or b - a < min_w or runs[-1][2] - runs[-1][1] < min_w):
            r = runs[-1]
            r[2] = max(r[2], b)
            r[3][k] = r[3].get(k, 0.0) + (b - a)
            r[0] = max(r[3], key=lambda kk: (r[3][kk], kk))
        else:
            runs.append([k, a, b, {k: b - a}])
    return [(r[0][0], r[1], r[2], r[0][1]) for r in runs]


def time_scale(res: SimResult, left: float) -> Scale:
    """Seconds [0, step time] onto the timeline's pixels (shared by the Gantt and memory plots)."""
    return Scale(0.0, res.step_time_s if res.step_time_s > 0 else 1.0, left, left + GANTT_WIDTH)


def gantt(res: SimResult) -> str:
    """Per pipeline rank, one lane per stream (compute, TP/CP/EP, DP/FSDP, pipeline send). One
    <path> per rank, stream, kind of work and chunk parity, its events merged at the pixel
    resolution (the Perfetto trace of `meshplan simulate --trace` has every event)."""
    left, right, top = GANTT_LEFT, 14.0, 30.0
    W = left + GANTT_WIDTH + right
    lanes = len(STREAMS)
    lane = max(3.0, min(12.0, 640.0 / (res.pp * (lanes + 1))))
    group = lane * (lanes + 1)
    H = top + res.pp * group + 40
    sx = time_scale(res, left)
    keys = {_key(e) for e in res.events}
    kinds = [k for k in KINDS if (k, False) in keys or (k, True) in keys]
    items = [(COLORS[k], KIND_LABELS[k]) for k in kinds]
    if any(odd for _, odd in keys):
        items.append((tint("#777777"), LATER_CHUNK))
    key, _ = legend(items, left, 6, GANTT_WIDTH)
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
                        f'text-anchor="end">{res.rank_label} {r}</text>')
        for i, s in enumerate(STREAMS):
            events = by_lane.get((r, s), [])
            busy: dict[tuple[str, bool], list[float]] = {}
            for e in events:
                b = busy.setdefault(_key(e), [0, 0.0])
                b[0] += 1
                b[1] += e.end - e.start
            paths: dict[tuple[str, bool], list[str]] = {}
            y, h = f1(y0 + i * lane + 0.5), f1(lane - 1)
            for kind, a, b, odd in _runs(events, sx):
                w = f1(max(b - a, 0.4))
                paths.setdefault((kind, odd), []).append(f"M{f1(a)} {y}h{w}v{h}h-{w}z")
            for kind, odd in sorted(paths, key=lambda k: (kinds.index(k[0]), k[1])):
                n, sec = busy.get((kind, odd), [0, 0.0])
                chunks = ", 2nd (4th, ...) chunk" if odd else ""
                tip = f"rank {r} {KIND_LABELS[kind]}{chunks}: {n:,} events, {sec:.4f} s busy"
                color = tint(COLORS[kind]) if odd else COLORS[kind]
                body.append(f'<path data-mark="{kind}" fill="{color}" d="{"".join(paths[kind, odd])}">'
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
    reserved = [[(t, b / 2**30) for t, b in res.reserved(r)] for r in range(len(series))]
    peak = max((v for s in series + reserved for _, v in s), default=0.0)
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
                    f"{title(f'rank {r}: allocated, peak {max(v for _, v in s):.1f} GiB')}</polyline>")
        level = reserved[r][0][1]
        body.append(f'<line data-mark="reserved" class="series" x1="{f1(sx.a)}" x2="{f1(sx.b)}" y1="{f1(sy(level))}" '
                    f'y2="{f1(sy(level))}" stroke="{PALETTE[r % len(PALETTE)]}" stroke-dasharray="4 3">'
                    + title(f"rank {r}: reserved + CUDA context and NCCL (nvidia-smi) {level:.1f} GiB") + "</line>")
    return svg("sim-memory", W, H, body, "simulated memory per GPU over the step: allocated (solid), "
               "reserved + CUDA context and NCCL, what nvidia-smi shows (dashed)")


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


# ---- --plot ------------------------------------------------------------------------------------

OWN_FORMATS = ("svg", "svgz")
"""Plot formats written without matplotlib (the figures' own SVG)."""


def check_plot_path(path: str | Path) -> str:
    """The image format of ``--plot PATH`` (from its extension; png without one), checked before
    any work: .svg and .svgz are written directly; any other format needs matplotlib, which must
    be installed and able to write it; the directory must exist."""
    text = str(path)
    if not text.strip():
        raise MeshplanError("--plot is empty", hint="give an image file name, e.g. --plot step.png")
    ext = os.path.splitext(text)[1][1:].lower()
    if ext not in OWN_FORMATS:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            raise MeshplanError(f"--plot {text}: a .{ext or 'png'} image needs matplotlib, which is not installed",
                                hint="pip install matplotlib, or give a .svg file") from None
        formats = FigureCanvasBase.get_supported_filetypes()
        if ext and ext not in formats:
            raise MeshplanError(f"--plot {text}: cannot draw a .{ext} image",
                                hint="use one of " + ", ".join(f".{f}" for f in sorted(formats)))
        if ext == "pgf":
            import shutil

            import matplotlib
            tex = matplotlib.rcParams["pgf.texsystem"]
            if shutil.which(tex) is None:
                raise MeshplanError(f"--plot {text}: a .pgf image needs {tex}, which is not installed",
                                    hint="use .pdf or .svg for a vector image")
    from meshplan.paths import check_output_file
    check_output_file("--plot", text, "step.png")
    return ext or "png"


def write_plot(res: SimResult, path: str | Path, title: str = "") -> None:
    """The step's Gantt chart and memory over time (the report's timeline figures, ``gantt`` and
    ``sim_memory``) under a heading, written to exactly ``path`` in the format of its extension."""
    step = f"simulated step {fixed3(res.step_time_s)} s"
    timed_memory = any(b for series in res.memory for _, b in series)  # (a bucket plan's ranks: no memory timeline)
    figures = [gantt(res), sim_memory(res)] if timed_memory else [gantt(res)]
    write_figures(figures, path, f"{title}: {step}" if title else step)


def write_figures(figures: list[str], path: str | Path, heading: str = "") -> None:
    """SVG figures of this package (the report's) under a heading, written to exactly ``path``:
    .svg/.svgz directly, any other format painted by matplotlib (``svg.save_image``)."""
    fmt = check_plot_path(path)
    try:
        with open(path, "wb") as f:  # a file object: matplotlib adds no extension to the name
            if fmt in OWN_FORMATS:
                data = document(figures, heading).encode()
                f.write(gzip.compress(data, mtime=0) if fmt == "svgz" else data)
            else:
                save_image(figures, f, fmt, heading)
    except OSError as e:
        raise MeshplanError(f"cannot write --plot {path}: {e.strerror or e}") from None
    except (RuntimeError, ValueError) as e:  # a format whose writer is missing (Pillow plugin, TeX)
        raise MeshplanError(f"cannot write --plot {path}: {str(e).splitlines()[0] if str(e) else e!r}",
                            hint="use .png, .svg or .pdf") from None
