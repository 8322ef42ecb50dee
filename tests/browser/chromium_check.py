"""Check an HTML page in a real headless browser (Debian's chromium), no extra dependencies.

    page = load_page(chromium, "report.html")    # --dump-dom after the page's scripts ran
    page_problems(page, expect_plots=[...])       # [] when the page is fine
    screenshot(chromium, "report.html", "shot.png")
    screenshot_problems("shot.png")               # [] when the screenshot is not blank

The report page records every JavaScript error (and console.error) into
``<html data-js-errors>`` and, when its last script has run, sets ``data-ready="1"`` and
``data-rendered-marks`` on each figure (marks with a non-empty bounding box). Chromium's own
console log (stderr) is read too: uncaught errors and failed resource loads (the network is
blocked, so a page that needs it fails here) count as problems.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0"]


def find_chromium() -> str | None:
    path = os.environ.get("MESHPLAN_CHROMIUM", CHROMIUM)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def run_chromium(chromium: str, args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    """One headless run with a fresh profile (deleted afterwards)."""
    profile = tempfile.mkdtemp(prefix="meshplan-chromium-")
    try:
        return subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=timeout, check=False)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@dataclass
class Page:
    html_attrs: dict[str, str]
    plots: dict[str, dict[str, str]]
    """data-plot name -> attributes of its <svg>."""
    console: list[str] = field(default_factory=list)
    """Chromium's console lines from stderr."""
    dom: str = ""


class _Scan(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.html_attrs: dict[str, str] = {}
        self.plots: dict[str, dict[str, str]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "html":
            self.html_attrs = a
        elif tag == "svg" and "data-plot" in a:
            self.plots[a["data-plot"]] = a


def load_page(chromium: str, path: str | Path, timeout: float = 60.0) -> Page:
    """Open ``path`` (file://), run its scripts, return the DOM's markers and console lines."""
    url = Path(path).resolve().as_uri()
    cp = run_chromium(chromium, ["--dump-dom", url], timeout)
    if cp.returncode != 0 or "<html" not in cp.stdout:
        raise RuntimeError(f"chromium --dump-dom failed (exit {cp.returncode}): {cp.stderr[-800:]}")
    scan = _Scan()
    scan.feed(cp.stdout)
    console = [line for line in cp.stderr.splitlines() if ":CONSOLE" in line]
    return Page(scan.html_attrs, scan.plots, console, cp.stdout)


def page_problems(page: Page, expect_plots: list[str] = ()) -> list[str]:
    """Everything wrong with a loaded page; [] when it is fine."""
    out = []
    raw = page.html_attrs.get("data-js-errors")
    if raw is None:
        out.append("no data-js-errors attribute: the page's error recorder did not run")
    else:
        try:
            errors = json.loads(raw)
        except ValueError:
            errors = [f"unreadable data-js-errors {raw!r}"]
        out += [f"JavaScript error: {e}" for e in errors]
    if page.html_attrs.get("data-ready") != "1":
        out.append("data-ready is not 1: the page's main script did not finish")
    for line in page.console:
        if "Uncaught" in line or "Failed to load resource" in line or "net::ERR" in line:
            out.append(f"console: {line.split(']', 1)[-1].strip()}")
    for name in expect_plots:
        if name not in page.plots:
            out.append(f"plot {name!r} missing")
    for name, a in sorted(page.plots.items()):
        declared, rendered = a.get("data-marks", ""), a.get("data-rendered-marks")
        if rendered is None:
            out.append(f"plot {name!r}: marks were not counted in the browser")
            continue
        if int(rendered) == 0:
            out.append(f"plot {name!r} is empty (no mark with a non-zero size)")
        elif declared.isdigit() and int(rendered) < int(declared):
            out.append(f"plot {name!r}: only {rendered} of {declared} marks have a size")
    return out


def screenshot(chromium: str, path: str | Path, png: str | Path, size: tuple[int, int] = (1280, 2200),
               timeout: float = 60.0) -> None:
    url = Path(path).resolve().as_uri()
    cp = run_chromium(chromium, [f"--screenshot={Path(png).resolve()}", f"--window-size={size[0]},{size[1]}", url],
                      timeout)
    if cp.returncode != 0 or not Path(png).exists():
        raise RuntimeError(f"chromium --screenshot failed (exit {cp.returncode}): {cp.stderr[-800:]}")


def png_pixels(png: str | Path):
    """RGB pixels (numpy array h x w x 3, uint8) of a PNG (Pillow decodes it)."""
    import numpy as np
    from PIL import Image
    with Image.open(png) as im:
        return np.asarray(im.convert("RGB"))


def screenshot_problems(png: str | Path, min_colours: int = 64, min_ink: float = 0.03) -> list[str]:
    """[] when the screenshot has variety: at least ``min_colours`` distinct colours and at
    least ``min_ink`` of its pixels away from the background (the most common colour)."""
    import numpy as np
    px = png_pixels(png)
    flat = px.reshape(-1, 3).astype(np.int64)
    codes = flat[:, 0] << 16 | flat[:, 1] << 8 | flat[:, 2]
    values, counts = np.unique(codes, return_counts=True)
    ink = 1.0 - counts.max() / len(codes)
    out = []
    if len(values) < min_colours:
        out.append(f"screenshot has only {len(values)} distinct colours (blank or nearly)")
    if ink < min_ink:
        out.append(f"screenshot is {100 * (1 - ink):.1f}% one colour (blank or nearly)")
    return out
