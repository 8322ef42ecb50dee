"""Plain-text tables for the terminal."""
from __future__ import annotations

import json
from collections.abc import Sequence

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


def json_text(obj: object) -> str:
    """Strict JSON (RFC 8259): a non-finite number (an overflow) is written as null, never as
    NaN or Infinity; numpy scalars and arrays as plain numbers and lists."""
    return json.dumps(json_safe(obj), indent=2, allow_nan=False)
