"""Small, deterministic SVG drawing: scales with nice ticks, axes, marks; the figures of the HTML
report and of `meshplan simulate --plot`.

No dependency beyond the standard library. Every data mark carries ``data-mark`` so a page
(and its browser test) can count what was drawn; coordinates are rounded to 0.1 unit so the
output is small and the same on every run. The look of the classes (``grid``, ``tick``, ...) is
``CLASS_STYLES``, written as CSS by ``plot_css`` (the report page, a standalone .svg file).

Files: ``document`` stacks figures into one standalone .svg; ``save_image`` paints the same
figures with matplotlib (imported only then) for any other format it writes (png, pdf, ...),
reading back the small SVG subset drawn here (rect, line, polyline, polygon, circle, path of
straight segments, text).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

# Tableau-10: distinct, readable on white, colour-blind tolerable.
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2",
           "#ff9da6", "#9d755d", "#bab0ac")
# Viridis at five stops (a sequential scale for a third dimension).
VIRIDIS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
BAD = "#b3261e"
"""Limits (usable memory) and errors."""

CLASS_STYLES: dict[str, dict[str, str]] = {
    "grid": {"stroke": "#e8eaef", "stroke-width": "1"},
    "frame": {"fill": "none", "stroke": "#9aa1ad", "stroke-width": "1"},
    "tick": {"font-size": "11px", "fill": "#444"},
    "label": {"font-size": "12px", "fill": "#222"},
    "lane": {"font-size": "10px", "fill": "#444"},
    "rank": {"font-size": "10px", "fill": "#222", "font-weight": "600"},
    "limit": {"stroke": BAD, "stroke-width": "1", "stroke-dasharray": "5 3"},
    "front": {"fill": "none", "stroke": "#c0392b", "stroke-width": "1.2", "opacity": ".7"},
    "series": {"fill": "none", "stroke-width": "1.4"},
    "cursor": {"stroke": "#222", "stroke-width": "1"},
    "cursor-label": {"font-size": "11px", "fill": "#222"},
    "heading": {"font-size": "13px", "fill": "#1d2330", "font-weight": "600"},
}
"""The look of each ``class`` the figures use (CSS properties); one definition for the page, a
standalone .svg and the painted images."""


def plot_css(scope: str = "svg") -> str:
    """``CLASS_STYLES`` as CSS rules, each selector under ``scope``."""
    return "".join(f"{scope} .{name}{{{';'.join(f'{k}:{v}' for k, v in style.items())}}}"
                   for name, style in CLASS_STYLES.items())


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


def tint(color: str, toward_white: float = 0.45) -> str:
    """A lighter ``#rrggbb``: each channel moved ``toward_white`` of the way to white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * toward_white):02x}" for c in rgb)


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


COLOR_BAR_STEPS = 24
"""Cells of a colour bar (viridis, evenly spaced)."""


def color_bar(x: float, y: float, w: float, h: float, lo: str, hi: str, label: str, gid: str) -> list[str]:
    """A horizontal viridis scale with its end labels: COLOR_BAR_STEPS solid cells (not an SVG gradient, which the
    matplotlib painter of .png/.pdf files cannot fill and drew grey); ``gid`` names the group."""
    n = COLOR_BAR_STEPS
    cell = w / n
    cells = "".join(f'<rect x="{f1(x + k * cell)}" y="{f1(y)}" width="{f1(cell + 0.5 if k < n - 1 else cell)}" '
                    f'height="{f1(h)}" fill="{viridis(k / (n - 1))}"/>' for k in range(n))
    return [f'<g id="{gid}">{cells}</g>',
            f'<text class="tick" x="{f1(x)}" y="{f1(y + h + 11)}">{esc(lo)}</text>',
            f'<text class="tick" x="{f1(x + w)}" y="{f1(y + h + 11)}" text-anchor="end">{esc(hi)}</text>',
            f'<text class="tick" x="{f1(x + w / 2)}" y="{f1(y - 3)}" text-anchor="middle">{esc(label)}</text>']


# ---- files: one standalone .svg, or the same figures painted with matplotlib ---------------

HEADING = 26.0
"""Pixels above the figures of a file for its heading line."""
FONT = "system-ui,-apple-system,'Segoe UI',Roboto,'Helvetica Neue',Arial,sans-serif"


def size(figure: str) -> tuple[float, float]:
    """(width, height) of a figure made by ``svg``."""
    m = re.match(r'<svg\b[^>]*?\swidth="([\d.]+)" height="([\d.]+)"', figure)
    if not m:
        raise ValueError("not a figure made by meshplan.svg.svg")
    return float(m.group(1)), float(m.group(2))


TICK_PX = float(CLASS_STYLES["tick"]["font-size"].removesuffix("px"))
"""The tick labels' font size, px."""


def text_width(text: str, px: float) -> float:
    """An upper estimate of ``text``'s width in pixels at font size ``px`` in the sans-serif FONT,
    bold: 0.62 em per character (wide letters and digits; narrow ones take less)."""
    return 0.62 * px * len(text)


HEADING_LINE = 17.0
"""Height of each further line of a heading that wraps."""


def heading_lines(heading: str, width: float) -> list[str]:
    """The heading broken into lines that fit ``width`` pixels (8 px margins), at its font's width
    (text_width): at word boundaries, a word longer than a line on its own line."""
    if not heading:
        return []
    px = _px(CLASS_STYLES["heading"]["font-size"])
    room = max(1.0, width - 16.0)
    lines: list[str] = []
    for word in heading.split(" "):
        if lines and text_width(lines[-1] + " " + word, px) <= room:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _heading_top(lines: list[str]) -> float:
    return 0.0 if not lines else HEADING + HEADING_LINE * (len(lines) - 1)


def document(figures: Sequence[str], heading: str = "") -> str:
    """A standalone SVG file: the heading (wrapped to the figures' width), then the figures one
    under the other, with the classes' look (``plot_css``) in its own <style>."""
    sizes = [size(f) for f in figures]
    W = max((w for w, _ in sizes), default=1.0)
    lines = heading_lines(heading, W)
    top = _heading_top(lines)
    H = top + sum(h for _, h in sizes)
    parts = [f'<rect width="{f1(W)}" height="{f1(H)}" fill="#fff"/>']
    for i, line in enumerate(lines):
        parts.append(f'<text class="heading" x="8" y="{f1(HEADING - 9 + HEADING_LINE * i)}">{esc(line)}</text>')
    y = top
    for fig, (_, h) in zip(figures, sizes):
        parts.append(f'<g transform="translate(0,{f1(y)})">{fig}</g>')
        y += h
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {f1(W)} {f1(H)}" width="{f1(W)}" '
            f'height="{f1(H)}"><style>svg{{font-family:{FONT}}}{plot_css()}</style>{"".join(parts)}</svg>\n')


PX_PT = 0.75
"""Points per pixel (CSS pixels: 96 per inch)."""


def save_image(figures: Sequence[str], file: Any, fmt: str, heading: str = "", dpi: float = 144) -> None:
    """Paint ``figures`` (one under the other, as ``document`` lays them out) with matplotlib and
    save them to ``file`` (a path or binary file object) in ``fmt`` (png, pdf, ...). One axes per
    figure, in pixel units; each figure's filled paths (its data marks) are one collection."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [size(f) for f in figures]
    W = max(w for w, _ in sizes)
    lines = heading_lines(heading, W)
    top = _heading_top(lines)
    H = top + sum(h for _, h in sizes)
    fig, axes = plt.subplots(len(figures), 1, figsize=(W / 96, H / 96), dpi=96,
                             gridspec_kw={"height_ratios": [h for _, h in sizes]})
    try:
        fig.subplots_adjust(left=0, right=1, bottom=0, top=1 - top / H, hspace=0)
        style = CLASS_STYLES["heading"]
        for i, line in enumerate(lines):
            fig.text(8 / W, 1 - (HEADING - 9 + HEADING_LINE * i) / H, line, color=style["fill"], fontweight="bold",
                     fontsize=_px(style["font-size"]) * PX_PT, va="baseline")
        for ax, figure, (_, h) in zip(axes if len(figures) > 1 else [axes], figures, sizes):
            ax.set_xlim(0, W)
            ax.set_ylim(h, 0)
            ax.set_axis_off()
            paint(figure, ax)
        fig.savefig(file, format=fmt, dpi=dpi, facecolor="white")
    finally:
        plt.close(fig)


def paint(figure: str, ax: Any) -> list[str]:
    """Draw one figure made here onto a matplotlib axes whose data units are the figure's pixels
    (y down). Returns the tags it could not draw (none for the figures of this package)."""
    import xml.etree.ElementTree as ET

    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Circle, Polygon, Rectangle

    root = ET.fromstring(figure)
    elements = list(root.iter())
    n = len(elements)
    polys: list[list[tuple[float, float]]] = []
    faces: list[tuple[float, ...]] = []
    first_path_z = None
    skipped: list[str] = []
    hidden: set[int] = set()
    for i, el in enumerate(elements):
        tag = el.tag.rsplit("}", 1)[-1]
        if id(el) in hidden or el.get("visibility") == "hidden":
            hidden.update(id(c) for c in el.iter())
            continue
        if tag in ("defs", "title", "desc", "style"):  # nothing to draw (a gradient is read as grey)
            hidden.update(id(c) for c in el.iter())
            continue
        if tag in ("svg", "g"):
            if el is not root and el.get("transform"):
                skipped.append(f"{tag} transform")  # figures made here have none
            continue
        st = _style(el)
        z = 1 + i / n
        fill, stroke = _color(st.get("fill", "#000")), _color(st.get("stroke", "none"))
        alpha = float(st.get("opacity", 1)) * float(st.get("fill-opacity", 1))
        lw = _px(st.get("stroke-width", "1")) * PX_PT
        dash = st.get("stroke-dasharray")
        line_kw: dict[str, Any] = {"linewidth": lw, "zorder": z}
        if dash:
            line_kw["dashes"] = [float(v) * PX_PT / max(lw, 1e-9) for v in re.split(r"[\s,]+", dash.strip())]
        a = {k: float(v) for k, v in el.attrib.items() if k in ("x", "y", "width", "height", "x1", "x2", "y1", "y2",
                                                                "cx", "cy", "r")}
        if tag == "rect":
            if fill is None and stroke is None:
                continue
            ax.add_patch(Rectangle((a.get("x", 0), a.get("y", 0)), a["width"], a["height"], zorder=z,
                                   facecolor=fill or "none", edgecolor=stroke or "none",
                                   linewidth=lw if stroke else 0, alpha=alpha))
        elif tag == "line":
            if stroke is not None:
                ax.plot([a["x1"], a["x2"]], [a["y1"], a["y2"]], color=stroke, alpha=alpha, **line_kw)
        elif tag in ("polyline", "polygon"):
            pts = _points(el.get("points", ""))
            if tag == "polygon":
                ax.add_patch(Polygon(pts, closed=True, zorder=z, facecolor=fill or "none",
                                     edgecolor=stroke or "none", linewidth=lw if stroke else 0, alpha=alpha))
            elif stroke is not None and pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=stroke, alpha=alpha, **line_kw)
        elif tag == "circle":
            ax.add_patch(Circle((a["cx"], a["cy"]), a["r"], zorder=z, facecolor=fill or "none",
                                edgecolor=stroke or "none", linewidth=lw if stroke else 0, alpha=alpha))
        elif tag == "path":
            shapes = _path_polygons(el.get("d", ""))
            if shapes is None or fill is None:
                skipped.append(tag)
                continue
            first_path_z = first_path_z if first_path_z is not None else z
            polys += shapes
            faces += [(*fill, alpha)] * len(shapes)
        elif tag == "text":
            _text(ax, el, st, z)
        else:
            skipped.append(tag)
    if polys:
        ax.add_collection(PolyCollection(polys, facecolors=faces, linewidths=0, antialiaseds=False,
                                         zorder=first_path_z), autolim=False)
    return skipped


def _style(el: Any) -> dict[str, str]:
    """The element's look: its classes' styles, then its own presentation attributes."""
    out: dict[str, str] = {}
    for c in (el.get("class") or "").split():
        out.update(CLASS_STYLES.get(c, {}))
    for k in ("fill", "stroke", "stroke-width", "stroke-dasharray", "opacity", "fill-opacity", "font-size",
              "font-weight", "text-anchor"):
        if el.get(k) is not None:
            out[k] = el.get(k)
    return out


def _color(value: str) -> tuple[float, float, float] | None:
    """An SVG colour as RGB in [0, 1]; None for 'none' (a gradient reads as mid-grey)."""
    v = value.strip().lower()
    if v in ("none", "transparent"):
        return None
    if v.startswith("url("):
        return (0.5, 0.5, 0.5)
    from matplotlib.colors import to_rgb
    return to_rgb(v)


def _px(value: str) -> float:
    return float(value.strip().removesuffix("px"))


def _points(text: str) -> list[tuple[float, float]]:
    vals = [float(v) for v in re.split(r"[\s,]+", text.strip()) if v]
    return list(zip(vals[0::2], vals[1::2]))


_PATH_TOKEN = re.compile(r"[MmLlHhVvZz]|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _path_polygons(d: str) -> list[list[tuple[float, float]]] | None:
    """The closed shapes of a path of straight segments (M L H V Z, absolute or relative);
    None for curves and arcs (not drawn by this package)."""
    tokens = _PATH_TOKEN.findall(d)
    if re.search(r"[CcSsQqTtAa]", re.sub(r"[eE][-+]?\d", "", d)):
        return None
    shapes: list[list[tuple[float, float]]] = []
    cur: list[tuple[float, float]] = []
    x = y = 0.0
    cmd = ""
    k = 0

    def take() -> float:
        nonlocal k
        v = float(tokens[k])
        k += 1
        return v
    while k < len(tokens):
        if tokens[k].isalpha():
            cmd = tokens[k]
            k += 1
            if cmd in "Zz":
                if cur:
                    shapes.append(cur)
                    x, y = cur[0]
                cur = []
                continue
        if cmd in "Mm":
            if cur:
                shapes.append(cur)
            dx, dy = take(), take()
            x, y = (x + dx, y + dy) if cmd == "m" else (dx, dy)
            cur = [(x, y)]
            cmd = "l" if cmd == "m" else "L"  # further pairs are line-tos
        elif cmd in "Ll":
            dx, dy = take(), take()
            x, y = (x + dx, y + dy) if cmd == "l" else (dx, dy)
            cur.append((x, y))
        elif cmd in "Hh":
            v = take()
            x = x + v if cmd == "h" else v
            cur.append((x, y))
        elif cmd in "Vv":
            v = take()
            y = y + v if cmd == "v" else v
            cur.append((x, y))
        else:
            return None
    if cur:
        shapes.append(cur)
    return shapes


def _text(ax: Any, el: Any, st: dict[str, str], z: float) -> None:
    """A <text>: baseline at y (plus dy in em), anchored start/middle/end, optionally
    translate(x,y) rotate(a)."""
    content = "".join(el.itertext())
    if not content.strip():
        return
    size_px = _px(st.get("font-size", "11px"))
    x, y = float(el.get("x", 0)), float(el.get("y", 0))
    rot = 0.0
    m = re.search(r"translate\(\s*([-\d.]+)[\s,]+([-\d.]+)\s*\)", el.get("transform", ""))
    if m:
        x, y = x + float(m.group(1)), y + float(m.group(2))
    m = re.search(r"rotate\(\s*([-\d.]+)", el.get("transform", ""))
    if m:
        rot = -float(m.group(1))  # SVG turns clockwise on screen, matplotlib counter-clockwise
    dy = el.get("dy", "")
    if dy.endswith("em"):
        y += float(dy[:-2]) * size_px
    elif dy:
        y += _px(dy)
    ha = {"middle": "center", "end": "right"}.get(st.get("text-anchor", "start"), "left")
    weight = "bold" if st.get("font-weight", "400") in ("bold", "600", "700", "800", "900") else "normal"
    ax.text(x, y, content, fontsize=size_px * PX_PT, color=_color(st.get("fill", "#000")) or "none",
            ha=ha, va="baseline", rotation=rot, rotation_mode="anchor", fontweight=weight, zorder=z,
            clip_on=False)
