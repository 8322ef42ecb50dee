"""Small, deterministic inline-SVG drawing: scales with nice ticks, axes, marks.

No dependency beyond the standard library. Every data mark carries ``data-mark`` so a page
(and its browser test) can count what was drawn; coordinates are rounded to 0.1 unit so the
output is small and the same on every run.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape

# Tableau-10: distinct, readable on white, colour-blind tolerable.
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2",
           "#ff9da6", "#9d755d", "#bab0ac")
# Viridis at five stops (a sequential scale for a third dimension).
VIRIDIS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


def esc(text: object) -> str:
    return escape(str(text), quote=True)


def f1(x: float) -> str:
    """A coordinate, to 0.1 unit (no trailing .0)."""
    s = f"{x:.1f}"
    return s[:-2] if s.endswith(".0") else ("0" if s == "-0" else s)


def fixed3(v: float) -> str:
    """Seconds or dollars: 3 decimals from 0.1 up (as before), 3 significant digits below (a
    small ingested model's step takes microseconds)."""
    return f"{v:.3f}" if abs(v) >= 0.1 or v == 0 or not math.isfinite(v) else f"{v:.3g}"


def num(v: float) -> str:
    """A tick label or value: 3 significant digits, thousands separated, no exponent for
    everyday magnitudes."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    a = abs(v)
    if a >= 1e6:
        return f"{v:.3g}".replace("e+0", "e").replace("e+", "e")
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.3g}"
    if a >= 1e-3:
        return f"{v:.3g}"
    return f"{v:.2g}"


def viridis(t: float) -> str:
    """Colour at ``t`` in [0, 1] on the viridis scale (linear between five stops)."""
    t = min(1.0, max(0.0, t if math.isfinite(t) else 0.0)) * (len(VIRIDIS) - 1)
    i = min(int(t), len(VIRIDIS) - 2)
    u = t - i
    a, b = VIRIDIS[i], VIRIDIS[i + 1]
    return "#" + "".join(f"{round(x + (y - x) * u):02x}" for x, y in zip(a, b))


# ---- scales --------------------------------------------------------------------------------

def nice_step(span: float, n: int) -> float:
    raw = span / max(n, 1)
    if raw <= 0 or not math.isfinite(raw):
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag * (1 + 1e-9):
            return m * mag
    return 10 * mag  # pragma: no cover - the loop always returns


@dataclass(frozen=True)
class Scale:
    """Maps data [lo, hi] onto pixels [a, b] (b < a for a y axis), linear or log10."""

    lo: float
    hi: float
    a: float
    b: float
    log: bool = False

    def __call__(self, v: float) -> float:
        if self.log:
            v = max(v, self.lo)
            t = (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            t = (v - self.lo) / (self.hi - self.lo)
        return self.a + t * (self.b - self.a)

    def ticks(self, n: int = 5) -> list[float]:
        if self.log:
            k0, k1 = math.floor(math.log10(self.lo)), math.ceil(math.log10(self.hi))
            mults = (1, 2, 5) if k1 - k0 <= 3 else (1,)
            out = [m * 10.0 ** k for k in range(k0, k1 + 1) for m in mults]
            return [t for t in out if self.lo * (1 - 1e-9) <= t <= self.hi * (1 + 1e-9)]
        step = nice_step(self.hi - self.lo, n)
        first = math.ceil(self.lo / step - 1e-9) * step
        out, k = [], 0
        while first + k * step <= self.hi + 1e-9 * step and k < 50:
            out.append(round(first + k * step, 12))
            k += 1
        return out


def make_scale(values: Iterable[float], a: float, b: float, *, zero: bool = False,
               log: bool | None = None, pad: float = 0.04) -> Scale:
    """A scale covering ``values`` (finite ones), padded a little, snapped to nice ticks
    (linear); ``log=None`` picks log10 when all values are positive and span more than 20x."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return Scale(0.0, 1.0, a, b)
    lo, hi = min(vals), max(vals)
    if log is None:
        log = lo > 0 and hi / lo > 20
    if log and lo > 0:
        f = (hi / lo) ** pad if hi > lo else 2.0
        return Scale(lo / f, hi * f, a, b, log=True)
    if zero:
        lo = min(lo, 0.0)
    if hi == lo:
        d = abs(hi) * 0.1 or 1.0
        lo, hi = (lo - d if not (zero and lo == 0) else lo), hi + d
    span = hi - lo
    if not (zero and lo == 0):
        lo -= pad * span
    hi += pad * span
    step = nice_step(hi - lo, 5)
    lo = 0.0 if zero and lo >= 0 else math.floor(lo / step) * step
    hi = math.ceil(hi / step) * step
    return Scale(lo, hi, a, b)


# ---- building blocks -----------------------------------------------------------------------

def tag(name: str, attrs: dict[str, object] | None = None, body: str | None = None) -> str:
    parts = [name] + [f'{k.replace("_", "-")}="{esc(v)}"' for k, v in (attrs or {}).items() if v is not None]
    head = " ".join(parts)
    return f"<{head}/>" if body is None else f"<{head}>{body}</{name}>"


def title(text: str) -> str:
    """A native tooltip (a <title> child)."""
    return f"<title>{esc(text)}</title>"


def svg(plot: str, width: float, height: float, body: Sequence[str], label: str,
        attrs: dict[str, str] | None = None) -> str:
    """The <svg> element of one figure: ``data-plot`` names it, ``data-marks`` counts its marks."""
    content = "".join(body)
    marks = content.count("data-mark=")
    more = "".join(f' {k}="{esc(v)}"' for k, v in (attrs or {}).items())
    return (f'<svg class="plot" data-plot="{esc(plot)}" data-marks="{marks}"{more} viewBox="0 0 {f1(width)} '
            f'{f1(height)}" width="{f1(width)}" height="{f1(height)}" role="img" aria-label="{esc(label)}">'
            f"{content}</svg>")


def axes(sx: Scale, sy: Scale, xlabel: str, ylabel: str, *, grid: bool = True,
         xfmt=num, yfmt=num) -> list[str]:
    """Frame, ticks, grid lines and axis labels of a plot area given by the two scales."""
    x0, x1 = sorted((sx.a, sx.b))
    y0, y1 = sorted((sy.a, sy.b))
    out = []
    for t in sx.ticks():
        x = f1(sx(t))
        if grid:
            out.append(f'<line class="grid" x1="{x}" x2="{x}" y1="{f1(y0)}" y2="{f1(y1)}"/>')
        out.append(f'<text class="tick" x="{x}" y="{f1(y1 + 14)}" text-anchor="middle">{esc(xfmt(t))}</text>')
    for t in sy.ticks():
        y = f1(sy(t))
        if grid:
            out.append(f'<line class="grid" x1="{f1(x0)}" x2="{f1(x1)}" y1="{y}" y2="{y}"/>')
        out.append(f'<text class="tick" x="{f1(x0 - 5)}" y="{y}" dy="0.32em" text-anchor="end">'
                   f"{esc(yfmt(t))}</text>")
    out.append(f'<rect class="frame" x="{f1(x0)}" y="{f1(y0)}" width="{f1(x1 - x0)}" height="{f1(y1 - y0)}"/>')
    out.append(f'<text class="label" x="{f1((x0 + x1) / 2)}" y="{f1(y1 + 32)}" text-anchor="middle">'
               f"{esc(xlabel)}</text>")
    if ylabel:
        out.append(f'<text class="label" transform="translate({f1(x0 - 44)},{f1((y0 + y1) / 2)}) rotate(-90)" '
                   f'text-anchor="middle">{esc(ylabel)}</text>')
    return out


def star(x: float, y: float, r: float = 9.0) -> str:
    """Points of a five-pointed star centred on (x, y)."""
    pts = []
    for k in range(10):
        rr = r if k % 2 == 0 else r * 0.45
        ang = -math.pi / 2 + k * math.pi / 5
        pts.append(f"{f1(x + rr * math.cos(ang))},{f1(y + rr * math.sin(ang))}")
    return " ".join(pts)


def legend(items: Sequence[tuple[str, str]], x: float, y: float, width: float, *, box: int = 10,
           gap: int = 14) -> tuple[list[str], float]:
    """Colour keys laid out left to right, wrapping at ``width``; returns (elements, height)."""
    out, cx, cy = [], x, y
    for color, label in items:
        w = box + 5 + 6.2 * len(label) + gap
        if cx > x and cx + w > x + width:
            cx, cy = x, cy + box + 8
        out.append(f'<rect x="{f1(cx)}" y="{f1(cy)}" width="{box}" height="{box}" fill="{color}"/>')
        out.append(f'<text class="tick" x="{f1(cx + box + 5)}" y="{f1(cy + box - 1)}">{esc(label)}</text>')
        cx += w
    return out, cy - y + box + 8


def color_bar(x: float, y: float, w: float, h: float, lo: str, hi: str, label: str, gid: str) -> list[str]:
    """A horizontal viridis gradient with its end labels."""
    stops = "".join(f'<stop offset="{k / (len(VIRIDIS) - 1):.2f}" stop-color="{viridis(k / (len(VIRIDIS) - 1))}"/>'
                    for k in range(len(VIRIDIS)))
    return [f'<defs><linearGradient id="{gid}">{stops}</linearGradient></defs>',
            f'<rect x="{f1(x)}" y="{f1(y)}" width="{f1(w)}" height="{f1(h)}" fill="url(#{gid})"/>',
            f'<text class="tick" x="{f1(x)}" y="{f1(y + h + 11)}">{esc(lo)}</text>',
            f'<text class="tick" x="{f1(x + w)}" y="{f1(y + h + 11)}" text-anchor="end">{esc(hi)}</text>',
            f'<text class="tick" x="{f1(x + w / 2)}" y="{f1(y - 3)}" text-anchor="middle">{esc(label)}</text>']
