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


def write_plot(res: SimResult, path: str | Path, title: str = "") -> None:
    """Gantt chart: one row group per pipeline rank (its four streams), memory underneath.
    Passes of a rank's second (fourth, ...) model chunk are drawn lighter, so the interleaved
    and V-shaped (ZBV) placements show."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import to_rgb
        from matplotlib.patches import Patch
    except ImportError:
        raise MeshplanError("--plot needs matplotlib", hint="pip install matplotlib") from None
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(14, 2 + 1.1 * res.pp + 2.5), sharex=True,
                                  gridspec_kw={"height_ratios": [max(2, res.pp), 1.5]})
    n = len(STREAMS)
    for e in res.events:
        y = e.rank * (n + 1) + TIDS[e.stream]
        color = to_rgb(COLORS.get(e.name[0] if e.stream == "compute" and e.name[0] in "FBW" else
                                   ("optimizer" if e.stream == "compute" else e.stream), "#888"))
        if e.args.get("chunk", 0) % 2:
            color = tuple(0.55 * x + 0.45 for x in color)
        ax.broken_barh([(e.start, e.end - e.start)], (y - 0.4, 0.8), facecolors=[color], linewidth=0)
    labels = {"F": "forward", "B": "backward (input grads)" if any(e.name[0] == "W" for e in res.events)
              else "backward", "W": "weight grads", "optimizer": "optimizer", "tp": "TP/CP/EP comm",
              "dp": "DP/FSDP comm", "pp": "pipeline send"}
    used = {k for k in labels if any((e.stream == "compute" and e.name.startswith(k)) or
                                     (e.stream == k) for e in res.events)}
    handles = [Patch(color=COLORS[k], label=labels[k]) for k in labels if k in used]
    if any(e.args.get("chunk", 0) % 2 for e in res.events):
        handles.append(Patch(color="#bbbbbb", label="lighter: the rank's 2nd (4th, ...) chunk"))
    fig.legend(handles=handles, fontsize=7, ncol=len(handles), loc="lower center", frameon=False)
    ticks = [r * (n + 1) + TIDS[s] for r in range(res.pp) for s in STREAMS]
    ax.set_yticks(ticks, [f"r{r} {s}" for r in range(res.pp) for s in STREAMS], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title or f"simulated step: {res.step_time_s:.3f} s", loc="left", fontsize=9)
    for r, series in enumerate(res.memory):
        ts, bs = zip(*series)
        axm.step(ts, [b / 2**30 for b in bs], where="post", label=f"rank {r}")
    axm.set_ylabel("GiB")
    axm.set_xlabel("seconds")
    if res.pp <= 16:
        axm.legend(fontsize=6, ncol=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise MeshplanError(f"cannot write --plot {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
