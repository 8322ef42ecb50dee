"""Simulation outputs: Chrome/Perfetto trace, Gantt plot per pipeline rank, memory over time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.sim.engine import STREAMS, SimResult

#: Thread ids of the streams in the trace (one process per pipeline rank).
TIDS = {s: i for i, s in enumerate(STREAMS)}
STREAM_NAMES = {"compute": "compute", "tp": "TP/CP/EP comm", "dp": "DP/FSDP comm", "pp": "pipeline send"}


def trace_dict(res: SimResult) -> dict[str, Any]:
    """Chrome trace-event format: ph=X events, pid = pipeline rank, tid = stream, microseconds."""
    ev: list[dict[str, Any]] = []
    for r in range(res.pp):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"pp rank {r}"}})
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


COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", "optimizer": "#b279a2",
           "tp": "#e45756", "dp": "#72b7b2", "pp": "#9d755d"}


def check_plot_path(path: str | Path) -> str:
    """The image format of ``--plot PATH`` (from its extension; png without one), checked before
    any work: matplotlib is installed, can write that format, and the directory exists."""
    import os
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise MeshplanError("--plot needs matplotlib, which is not installed", hint="pip install matplotlib") from None
    text = str(path)
    if not text.strip():
        raise MeshplanError("--plot is empty", hint="give an image file name, e.g. --plot step.png")
    ext = os.path.splitext(text)[1][1:].lower()
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


RASTER_ABOVE = 20_000
"""Events beyond which a vector image (svg, pdf, ...) draws the bars as one embedded raster."""


def _event_colors(res: SimResult) -> tuple[list[tuple[float, float, float]], set[str], bool]:
    """Face color per event, the legend keys used, and whether any pass is on an odd chunk."""
    from matplotlib.colors import to_rgb
    rgb = {k: to_rgb(v) for k, v in COLORS.items()}
    light = {k: tuple(0.55 * x + 0.45 for x in v) for k, v in rgb.items()}
    grey = to_rgb("#888")
    colors, used, odd = [], set(), False
    for e in res.events:
        key = e.stream if e.stream != "compute" else e.name[0] if e.name[:1] in ("F", "B", "W") else "optimizer"
        used.add(key)
        chunk_odd = bool(e.args.get("chunk", 0) % 2)
        odd = odd or chunk_odd
        colors.append((light if chunk_odd else rgb).get(key, grey))
    return colors, used, odd


def write_plot(res: SimResult, path: str | Path, title: str = "") -> None:
    """Gantt chart: one row group per pipeline rank (its four streams), memory underneath.
    Passes of a rank's second (fourth, ...) model chunk are drawn lighter, so the interleaved
    and V-shaped (ZBV) placements show. All bars are one PolyCollection (one artist, whatever
    the number of events), so a step of 100k events draws in seconds."""
    fmt = check_plot_path(path)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        from matplotlib.collections import PolyCollection
        from matplotlib.patches import Patch
    except ImportError:
        raise MeshplanError("--plot needs matplotlib", hint="pip install matplotlib") from None
    rows_in = min(1.1 * res.pp, 8 + 0.6 * res.pp)  # inches for the ranks: denser beyond 8 ranks
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(14, 2 + rows_in + 2.5), sharex=True,
                                  gridspec_kw={"height_ratios": [max(2, res.pp), 1.5]})
    n = len(STREAMS)
    events = res.events
    colors, used, odd = _event_colors(res)
    if events:
        start = np.fromiter((e.start for e in events), float, len(events))
        end = np.fromiter((e.end for e in events), float, len(events))
        y = np.fromiter((e.rank * (n + 1) + TIDS[e.stream] for e in events), float, len(events))
        verts = np.empty((len(events), 4, 2))
        verts[:, :, 0] = np.stack([start, start, end, end], axis=1)
        verts[:, :, 1] = np.stack([y - 0.4, y + 0.4, y + 0.4, y - 0.4], axis=1)
        bars = PolyCollection(verts, facecolors=colors, linewidths=0, antialiaseds=False)
        if fmt not in ("png", "jpg", "jpeg", "tif", "tiff", "webp", "raw", "rgba") and len(events) > RASTER_ABOVE:
            bars.set_rasterized(True)
        ax.add_collection(bars, autolim=False)
        ax.set_xlim(0, max(float(end.max()), res.step_time_s) * 1.005)
    else:
        ax.set_xlim(0, max(res.step_time_s, 1e-9))
    ax.set_ylim(-0.6, res.pp * (n + 1) - 1.4)
    has_w = "W" in used
    labels = {"F": "forward", "B": "backward (input grads)" if has_w else "backward", "W": "weight grads",
              "optimizer": "optimizer", "tp": "TP/CP/EP comm", "dp": "DP/FSDP comm", "pp": "pipeline send"}
    handles = [Patch(color=COLORS[k], label=labels[k]) for k in labels if k in used]
    if odd:
        handles.append(Patch(color="#bbbbbb", label="lighter: the rank's 2nd (4th, ...) chunk"))
    if handles:
        fig.legend(handles=handles, fontsize=7, ncol=len(handles), loc="lower center", frameon=False)
    ticks = [r * (n + 1) + TIDS[s] for r in range(res.pp) for s in STREAMS]
    ax.set_yticks(ticks, [f"r{r} {s}" for r in range(res.pp) for s in STREAMS], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title or f"simulated step: {res.step_time_s:.3f} s", loc="left", fontsize=9)
    for r, series in enumerate(res.memory):
        if not series:
            continue
        ts, bs = zip(*series)
        axm.step(ts, [b / 2**30 for b in bs], where="post", label=f"rank {r}")
    axm.set_ylabel("GiB")
    axm.set_xlabel("seconds")
    if res.pp <= 16 and any(res.memory):
        axm.legend(fontsize=6, ncol=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    try:
        with open(path, "wb") as f:  # a file object: matplotlib adds no extension to the name
            fig.savefig(f, format=fmt, dpi=110)
    except OSError as e:
        raise MeshplanError(f"cannot write --plot {path}: {e.strerror or e}") from None
    except (RuntimeError, ValueError) as e:  # a format whose writer is missing (Pillow plugin, TeX)
        raise MeshplanError(f"cannot write --plot {path}: {str(e).splitlines()[0] if str(e) else e!r}",
                            hint="use .png, .svg or .pdf") from None
    finally:
        plt.close(fig)
