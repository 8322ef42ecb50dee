"""The `meshplan report` page in a real browser: it loads with no JavaScript error and no
network, its figures are drawn and non-empty, its screenshot is not blank, its script works
(table sorting, the timeline cursor), and a broken page is caught by the same checks."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from chromium_check import load_page, page_problems, screenshot, screenshot_problems

from meshplan.cli.main import main

FEASIBLE = ["--model", "gpt3-1.3b", "--cluster", "a100-sxm-80gb:16", "--global-batch", "64", "--fix", "pp=4"]
INFEASIBLE = ["--model", "llama3.1-405b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "16"]
PLOTS = ["pareto-memory", "pareto-dollars", "time-breakdown", "memory-breakdown", "gantt", "sim-memory",
         "rejections"]


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("report")
    out = {}
    for name, argv in (("feasible", FEASIBLE), ("infeasible", INFEASIBLE)):
        out[name] = d / f"{name}.html"
        assert main(["report", *argv, "--out", str(out[name])]) == 0
    return out


def test_feasible_page_loads_and_draws(chromium: str, pages: dict[str, Path]) -> None:
    page = load_page(chromium, pages["feasible"])
    assert page_problems(page, PLOTS) == []
    assert set(PLOTS) <= set(page.plots)
    assert int(page.plots["gantt"]["data-rendered-marks"]) >= 4  # pp=4: at least one lane per rank
    assert int(page.plots["pareto-memory"]["data-rendered-marks"]) >= 3  # cloud, front, winner


def test_infeasible_page_loads_and_explains(chromium: str, pages: dict[str, Path]) -> None:
    page = load_page(chromium, pages["infeasible"])
    assert page_problems(page, ["rejections"]) == []
    assert "gantt" not in page.plots and "pareto-memory" not in page.plots
    assert "What would make it feasible" in page.dom and "needs at least" in page.dom


@pytest.mark.parametrize("name", ["feasible", "infeasible"])
def test_screenshot_is_not_blank(chromium: str, pages: dict[str, Path], tmp_path: Path, name: str) -> None:
    png = tmp_path / f"{name}.png"
    screenshot(chromium, pages[name], png)
    assert screenshot_problems(png) == []


def test_page_script_sorts_tables_and_moves_the_cursor(chromium: str, pages: dict[str, Path],
                                                       tmp_path: Path) -> None:
    probe = """<script>(function(){var d=document.documentElement;try{
var t=document.getElementById('top-plans');
var th=Array.prototype.filter.call(t.querySelectorAll('th'),
 function(h){return h.textContent.indexOf('step time')===0;})[0];
th.click();d.setAttribute('data-asc',t.tBodies[0].rows[0].cells[0].textContent);
th.click();d.setAttribute('data-desc',t.tBodies[0].rows[0].cells[0].textContent);
var g=document.querySelector('svg[data-plot="gantt"]'),r=g.getBoundingClientRect();
g.dispatchEvent(new MouseEvent('mousemove',{clientX:r.left+r.width/2,clientY:r.top+r.height/2,bubbles:true}));
d.setAttribute('data-cursor',g.querySelector('.cursor-label').textContent);
}catch(e){d.setAttribute('data-probe-error',String(e));}})();</script></body>"""
    html = pages["feasible"].read_text()
    rows = len(re.findall(r"<tr[ >]", html.split('id="top-plans"', 1)[1].split("</table>", 1)[0])) - 1
    probed = tmp_path / "probed.html"
    probed.write_text(html.replace("</body>", probe, 1))
    page = load_page(chromium, probed)
    assert page_problems(page) == []
    assert "data-probe-error" not in page.html_attrs
    assert page.html_attrs["data-asc"] == "1" and page.html_attrs["data-desc"] == str(rows)
    t = page.html_attrs["data-cursor"]
    assert t.endswith(" s") and 0 < float(t[:-2]) < 10


def test_a_broken_page_is_caught(chromium: str, pages: dict[str, Path], tmp_path: Path) -> None:
    html = pages["feasible"].read_text()
    # A script error, a figure emptied of its marks, a resource from the network.
    broken = html.replace("</body>", "<script>notDefinedAnywhere();</script>"
                          '<img src="https://cdn.example.invalid/x.png"></body>', 1)
    start = broken.index('<svg class="plot" data-plot="time-breakdown"')
    end = broken.index("</svg>", start)
    head = broken[start:broken.index(">", start) + 1]
    broken = broken[:start] + head + broken[end:]
    path = tmp_path / "broken.html"
    path.write_text(broken)
    problems = page_problems(load_page(chromium, path), PLOTS)
    text = "\n".join(problems)
    assert "notDefinedAnywhere" in text
    assert "'time-breakdown' is empty" in text
    assert "failed to load https://cdn.example.invalid/x.png" in text


def test_a_page_whose_script_never_ran_is_caught(chromium: str, tmp_path: Path) -> None:
    path = tmp_path / "noscript.html"
    path.write_text('<!DOCTYPE html><html><body><svg data-plot="x" data-marks="1"><rect data-mark="a" '
                    'width="10" height="10"/></svg></body></html>')
    problems = page_problems(load_page(chromium, path), ["x", "y"])
    assert any("error recorder did not run" in p for p in problems)
    assert any("data-ready" in p for p in problems)
    assert any("'y' missing" in p for p in problems)
    assert any("marks were not counted" in p for p in problems)


def test_a_blank_screenshot_is_caught(chromium: str, tmp_path: Path) -> None:
    path, png = tmp_path / "blank.html", tmp_path / "blank.png"
    path.write_text("<!DOCTYPE html><html><body style='background:#fff'></body></html>")
    screenshot(chromium, path, png, size=(800, 600))
    assert screenshot_problems(png) != []
