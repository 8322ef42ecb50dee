"""Plain-text tables for the terminal."""
from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TextIO

from meshplan.spec.base import json_safe


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """Aligned columns; ``align`` is a string of 'l'/'r' per column (default: text left, numbers right)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if align is None:
        align = "".join("r" if rows and isinstance(rows[0][i], (int, float)) else "l"
                        for i in range(len(headers)))
    lines = []
    for j, r in enumerate(cells):
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(r, widths, align)]
        lines.append("  ".join(parts).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(x: object) -> str:
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"
    return str(x)


def seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


JSON_SCHEMA_VERSION = 1
"""Version of the --json documents the commands print (their keys: docs/json.md of each command's
section; a key is only ever added within a version)."""


def json_doc(command: str, obj: dict) -> str:
    """A command's --json document: ``schema_version`` and ``command`` first, then ``obj``'s keys."""
    return json_text({"schema_version": JSON_SCHEMA_VERSION, "command": command, **obj})


def json_text(obj: object) -> str:
    """Strict JSON (RFC 8259): a non-finite number (an overflow) is written as null, never as
    NaN or Infinity; numpy scalars and arrays as plain numbers and lists."""
    return json.dumps(json_safe(obj), indent=2, allow_nan=False)


@contextlib.contextmanager
def slow_step(what: str, *, after_s: float = 2.0, stream: TextIO | None = None) -> Iterator[None]:
    """Progress on stderr for a step that runs longer than ``after_s``: one line
    ``meshplan: WHAT ...`` (on a terminal with the seconds so far, updated), finished with the
    time it took. Quick steps print nothing."""
    out = sys.stderr if stream is None else stream
    tty = hasattr(out, "isatty") and out.isatty()
    t0 = time.perf_counter()
    done = threading.Event()
    shown = threading.Event()
    lock = threading.Lock()

    def show() -> None:
        if done.wait(after_s):
            return
        while True:
            with lock:
                if done.is_set():
                    return
                if tty:
                    out.write(f"\rmeshplan: {what} ... {time.perf_counter() - t0:.0f} s")
                elif not shown.is_set():
                    out.write(f"meshplan: {what} ...")
                out.flush()
                shown.set()
            if not tty or done.wait(0.5):
                return

    thread = threading.Thread(target=show, name="meshplan-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with lock:
            done.set()
            if shown.is_set():
                took = time.perf_counter() - t0
                out.write((f"\rmeshplan: {what} ... " if tty else " ") + f"done in {took:.1f} s\n")
                out.flush()
        thread.join()
