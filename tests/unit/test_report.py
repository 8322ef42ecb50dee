"""`meshplan report`: the page's content, self-containment, determinism, the figures, the CLI."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from meshplan.cli.main import build_parser, main
from meshplan.errors import MeshplanError
from meshplan.report import Report, build_report, simulate_winner
from meshplan.search.space import SearchSpace
from meshplan.sim import simulate
from meshplan.sim.engine import Event
from meshplan.sim.output import _column_max, _runs, gantt, sim_memory
from meshplan.spec.graph import LayerGraph
from meshplan.spec.io import load_cluster, load_model, load_plan
from meshplan.spec.plan import Plan, Workload
from meshplan.svg import Scale, make_scale, nice_step, num, plot_css, viridis

FEASIBLE = ["--model", "llama2-7b", "--cluster", "a100-sxm-80gb:16", "--global-batch", "64", "--fix", "pp=4"]
INFEASIBLE = ["--model", "llama3.1-405b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "16"]
PLOTS = {"pareto-memory", "pareto-dollars", "time-breakdown", "memory-breakdown", "gantt", "sim-memory",
         "rejections"}


class _Svgs(HTMLParser):
    """The <svg data-plot> elements (attributes) and whether the document is well nested."""

    VOID = {"meta", "br", "wbr", "img", "input", "link", "hr"}

    def __init__(self) -> None:
        super().__init__()
        self.plots: dict[str, dict[str, str]] = {}
        self.stack: list[str] = []
        self.bad: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "svg" and "data-plot" in a:
            self.plots[a["data-plot"]] = a
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "svg" and "data-plot" in a:  # pragma: no cover - figures always have content
            self.plots[a["data-plot"]] = a

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.bad.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
        else:
            self.stack.pop()


def parse(html: str) -> _Svgs:
    p = _Svgs()
    p.feed(html)
    return p


def data_block(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="meshplan-data">(.*?)</script>', html, re.S)
    assert m is not None
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def feasible(tmp_path_factory) -> tuple[str, str]:
    out = tmp_path_factory.mktemp("r") / "report.html"
    assert main(["report", *FEASIBLE, "--top", "4", "--train-tokens", "100B", "--out", str(out)]) == 0
    return out.read_text(), str(out)


@pytest.fixture(scope="module")
def infeasible(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("r") / "report.html"
    assert main(["report", *INFEASIBLE, "--out", str(out)]) == 0
    return out.read_text()


# ---- the page ------------------------------------------------------------------------------

def test_feasible_page_has_every_section_and_figure(feasible):
    html, _ = feasible
    p = parse(html)
    assert p.bad == [] and p.stack == []
    assert set(p.plots) == PLOTS
    assert "layers / hidden / heads" in html and "layer graph of" not in html  # a preset's own shape
    for name, a in p.plots.items():
        assert int(a["data-marks"]) > 0, name
    for anchor in ("verdict", "problem", "top-plans", "pareto", "breakdown", "timeline", "explanation"):
        assert f'id="{anchor}"' in html
    assert "Best plan:" in html and "tokens/s" in html and "MFU" in html and "$ / M tokens" in html
    assert "days" in html and "$ to train" in html  # --train-tokens
    assert "Discrete-event simulation" in html and "analytical estimate" in html
    assert "winner " in html and "rejected " in html  # the search's explanation


def test_page_figures_use_the_one_set_of_styles_and_paint_as_images(feasible):
    """The page's figure CSS is svg.plot_css(), and every figure is within the SVG subset
    svg.paint draws (what `simulate --plot` relies on for png, pdf, ...)."""
    html, _ = feasible
    assert plot_css() in html
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from meshplan.svg import paint
    figures = re.findall(r'<svg class="plot".*?</svg>', html, flags=re.S)
    assert len(figures) == len(PLOTS)
    for figure in figures:
        fig, ax = plt.subplots()
        try:
            assert paint(figure, ax) == [], figure[:80]
        finally:
            plt.close(fig)


def test_page_data_block_matches_the_search(feasible):
    html, _ = feasible
    doc = data_block(html)
    assert doc["model"] == "llama2-7b" and doc["global_batch"] == 64
    assert len(doc["plans"]) == 4 and doc["plans"][0]["rank"] == 1
    assert doc["plans"][0]["plan"]["pp"] == 4
    assert doc["considered"] == doc["feasible"] + sum(doc["rejected"].values())
    assert doc["simulation"]["step_time_s"] > 0 and len(doc["simulation"]["ranks"]) == 4
    assert doc["train"][0]["days"] > 0
    assert doc["plans"][0]["short"] in html  # the table shows it


def test_page_is_self_contained(feasible, infeasible):
    for html in (feasible[0], infeasible):
        assert "http://" not in html and "https://" not in html
        assert not re.search(r"<(script|img|link|iframe)[^>]*\s(src|href)=", html)
        assert "@import" not in html and not re.search(r"url\((?!#)", html)
        assert html.startswith("<!DOCTYPE html>") and '<meta charset="utf-8">' in html


def test_infeasible_page_says_what_would_make_it_feasible(infeasible):
    p = parse(infeasible)
    assert p.bad == []
    assert set(p.plots) == {"rejections"}
    assert "No plan fits" in infeasible and "What would make it feasible" in infeasible
    assert "needs at least 32 x h100-sxm-80gb" in infeasible  # fewer: offloads need more than a DGX H100's host memory
    assert "out of memory" in infeasible and "Why no plan fits" in infeasible
    doc = data_block(infeasible)
    assert doc["plans"] == [] and doc["nearest"] and doc["simulation"] is None


def test_render_is_deterministic_and_escapes_names():
    model = load_model("gpt3-125m").replace(name="<b>x</b>&y")
    cluster = load_cluster("a100-sxm-80gb:8")
    rep = build_report(model, cluster, Workload(global_batch=16, seq_len=512), SearchSpace(pp=(1, 2)), top=3)
    a, b = rep.html(), rep.html()
    assert a == b
    assert "<b>x</b>" not in a and "&lt;b&gt;x&lt;/b&gt;&amp;y" in a
    assert parse(a).bad == []
    assert "\\u003cb\\u003ex" in a  # in the JSON block too, escaped so it cannot end the script


def test_report_without_simulation_says_why():
    model, cluster = load_model("llama2-7b"), load_cluster("a100-sxm-80gb:8")
    rep = build_report(model, cluster, Workload(global_batch=16, seq_len=512), SearchSpace(pp=(1,)), top=2,
                       simulate=False)
    html = Report(rep.result, rep.usable_gib, sim_error="the simulator does not model schedule 'x' yet").html()
    assert "Not simulated: the simulator does not model schedule" in html
    assert set(parse(html).plots) == PLOTS - {"gantt", "sim-memory"}


def test_simulate_winner_reports_simulator_errors(monkeypatch):
    model, cluster = load_model("gpt3-125m"), load_cluster("a100-sxm-80gb:8")
    rep = build_report(model, cluster, Workload(global_batch=16, seq_len=512), SearchSpace(pp=(1,)), top=1,
                       simulate=False)

    def refuse(*a, **k):
        raise MeshplanError("the simulator does not model schedule 'zbv' yet")
    monkeypatch.setattr("meshplan.sim.simulate", refuse)
    sim, summary, err = simulate_winner(rep.result)
    assert sim is None and summary is None and "zbv" in err


def test_a_long_step_is_not_simulated_but_the_page_says_how():
    model, cluster = load_model("llama2-7b"), load_cluster("a100-sxm-80gb:8")
    rep = build_report(model, cluster, Workload(global_batch=16, seq_len=512), SearchSpace(pp=(2,)), top=1,
                       simulate=False)
    sim, _, err = simulate_winner(rep.result, max_passes=1)
    assert sim is None and "over the report's limit of 1" in err
    assert f"meshplan simulate --model llama2-7b --cluster {cluster.name}" in err
    assert f"--plan {rep.result.best.plan.short()}" in err


# ---- figures -------------------------------------------------------------------------------

def test_scales_and_ticks():
    assert nice_step(10, 5) == 2 and nice_step(0.7, 5) == 0.2 and nice_step(3, 5) == 1
    s = make_scale([3.2, 47.0], 0, 100)
    assert not s.log and s.lo <= 3.2 and s.hi >= 47.0 and s(s.lo) == 0 and s(s.hi) == 100
    assert all(s.lo - 1e-9 <= t <= s.hi + 1e-9 for t in s.ticks()) and len(s.ticks()) >= 3
    lg = make_scale([1.0, 1000.0], 0, 100)
    assert lg.log and 1 in lg.ticks() and 100 in lg.ticks()
    flat = make_scale([5.0, 5.0], 0, 100)
    assert flat.lo < 5 < flat.hi
    assert make_scale([], 0, 1).hi == 1.0
    assert Scale(0, 10, 100, 0)(5) == 50  # y axes run downwards
    assert num(1234.5) == "1,234" or num(1234.5) == "1,235"
    assert num(0.0957) == "0.0957" and num(2.0) == "2" and num(0) == "0"
    assert viridis(0) == "#440154" and viridis(1) == "#fde725"


def test_gantt_merges_events_to_the_pixel():
    def ev(s, e, name="F0"):
        return Event(0, "compute", name, s, e)
    sx = Scale(0.0, 1.0, 0.0, 1000.0)
    # Touching events of one kind make one run; a gap of several pixels splits them.
    assert len(_runs([ev(0, 0.1), ev(0.1, 0.2), ev(0.3, 0.4)], sx)) == 2
    # A sliver of another kind joins its neighbour; the run keeps the kind covering most of it.
    runs = _runs([ev(0, 0.1, "B0"), ev(0.1, 0.1002, "F1"), ev(0.1002, 0.2, "B1")], sx)
    assert [r[0] for r in runs] == ["B"]
    # 10,000 back-to-back alternating events in 1,000 pixels: bounded by the resolution.
    many = [ev(i / 1e4, (i + 1) / 1e4, "F" if i % 2 else "B") for i in range(10_000)]
    assert len(_runs(many, sx)) <= 1000


def test_gantt_of_a_pipeline_and_memory_columns():
    model, cluster = load_model("gpt3-1.3b"), load_cluster("a100-sxm-80gb:16")
    plan = load_plan("tp=1,pp=4,dp=4,zero=1,micro_batch=1")
    res, _ = simulate(model, cluster, plan, Workload(global_batch=64, seq_len=2048))
    g = gantt(res)
    assert all(f"r{r} compute" in g for r in range(4))
    assert g.count('data-mark="F"') == 4 and g.count('data-mark="B"') == 4
    assert len(g) < 200_000
    m = sim_memory(res, 75.0)
    assert m.count('data-mark="memory"') == 4
    # Column maxima of a step function: a level held for no time does not count.
    cols = _column_max([(0.0, 1.0), (0.5, 5.0), (0.5, 2.0), (0.75, 3.0)], 1.0, 4)
    assert cols == [1.0, 1.0, 2.0, 3.0]


def test_a_large_timeline_stays_small():
    model, cluster = load_model("gpt3-175b"), load_cluster("a100-sxm-80gb:512")
    plan = load_plan("tp=2,pp=8,dp=32,zero=2,micro_batch=1,virtual_stages=6,schedule=interleaved-1f1b,"
                     "sequence_parallel=1")
    res, _ = simulate(model, cluster, plan, Workload(global_batch=1536, seq_len=2048))
    assert len(res.events) > 10_000
    assert len(gantt(res)) < 400_000


# ---- command line --------------------------------------------------------------------------

def test_cli_writes_the_page_and_says_so(feasible, capsys):
    _, path = feasible
    assert main(["report", *FEASIBLE, "--out", path]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"wrote {path} (") and "best plan tp=" in out and err == ""


def test_cli_infeasible_is_not_an_error(tmp_path, capsys):
    out_path = tmp_path / "r.html"
    assert main(["report", *INFEASIBLE, "--out", str(out_path)]) == 0
    out, _ = capsys.readouterr()
    assert "no plan fits; the page says what would make it feasible" in out and out_path.exists()


def test_cli_takes_the_search_options_of_plan():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    opts = {name: {s for a in sub.choices[name]._actions for s in a.option_strings} for name in ("plan", "report")}
    assert opts["report"] - {"--plan", "--override"} == opts["plan"] - {"--json", "--plot"}  # + a plan file's problem
    args = parser.parse_args(["report", *FEASIBLE, "--gpus", "8..16", "--objective", "cost", "--uneven-stages",
                              "--out", "x.html"])
    assert args.fix == "pp=4" and args.objective == "cost" and args.uneven_stages and args.top == 5


@pytest.mark.parametrize("argv,message", [
    (["--out", "/nonexistent-dir/r.html"], "the directory /nonexistent-dir does not exist"),
    (["--out", "."], "is a directory"),
    (["--out", ""], "--out is empty"),
    (["--out", "r.html", "--fix", "bogus=1"], "unknown key 'bogus'"),
    (["--out", "r.html", "--json"], "unrecognized arguments: --json"),
    (["--out", "r.html", "--top", "0"], "argument --top: must be a positive integer"),
])
def test_cli_errors_are_one_line(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["report", *FEASIBLE[:6], *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("meshplan: error: ") and message in err and err.count("\n") == 1
    assert "Traceback" not in err and not (tmp_path / "r.html").exists()


def assert_report_imports_neither_torch_nor_matplotlib(argv: list[str]) -> None:
    """`meshplan report ARGV` in a fresh interpreter succeeds without importing torch or matplotlib."""
    code = ("import sys\nfrom meshplan.cli.main import main\n"
            f"rc = main({['report', *argv]!r})\n"
            "bad = [m for m in ('torch', 'matplotlib') if m in sys.modules]\n"
            "print(rc, bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []"


def test_report_imports_neither_torch_nor_matplotlib(tmp_path):
    assert_report_imports_neither_torch_nor_matplotlib([*FEASIBLE, "--out", str(tmp_path / "r.html")])


def test_space_from_plan_options_reaches_the_search(tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", *FEASIBLE[:6], "--fix", "pp=2,tp=2", "--top", "2", "--out", str(out)]) == 0
    doc = data_block(out.read_text())
    assert all(p["plan"]["pp"] == 2 and p["plan"]["tp"] == 2 for p in doc["plans"])
    assert isinstance(Plan(**{k: v for k, v in doc["plans"][0]["plan"].items()}), Plan)


# ---- layer graphs (any model through ingestion) --------------------------------------------

def toy_graph(blocks: int = 6, h: int = 1024, s: int = 1024, vocab: int = 32000) -> LayerGraph:
    """A small decoder as a layer graph: embedding, blocks with two TP pairs, output projection."""
    from meshplan.spec.graph import LayerSpec
    lin = 12 * h * h
    emb = LayerSpec(name="embed", kind="embedding", block="embed", params=vocab * h, fwd_flops=0.0, bwd_flops=0.0,
                    saved_bytes=0.0, output_bytes=2.0 * s * h, tp_style="megatron", tp_fraction=1.0, tp_max=8,
                    tp_allreduces=1)
    body = [LayerSpec(name=f"layers.{i}", block="block", params=lin, fwd_flops=2.0 * s * lin + 4.0 * s * s * h,
                      bwd_flops=4.0 * s * lin + 8.0 * s * s * h, saved_bytes=34.0 * s * h, output_bytes=2.0 * s * h,
                      tp_style="megatron", tp_fraction=1.0, tp_max=8, tp_allreduces=2,
                      extra={"attention_flops": 4.0 * s * s * h, "attention_causal": 1.0, "gemm_dim": 1.6 * h})
            for i in range(blocks)]
    head = LayerSpec(name="lm_head", kind="head", block="head", params=vocab * h, fwd_flops=2.0 * s * vocab * h,
                     bwd_flops=4.0 * s * vocab * h, saved_bytes=2.0 * s * h, output_bytes=2.0 * s * vocab,
                     tp_style="megatron", tp_fraction=1.0, tp_max=8)
    return LayerGraph(name="toy<graph>", source="module:toy:decoder", sample_tokens=s, trace_dtype="bfloat16",
                      layers=(emb, *body, head))


@pytest.fixture(scope="module")
def graph_page(tmp_path_factory) -> tuple[str, str]:
    from meshplan.spec.io import dump_json
    d = tmp_path_factory.mktemp("g")
    graph = d / "toy.json"
    graph.write_text(dump_json(toy_graph()) + "\n")
    out = d / "report.html"
    assert main(["report", "--model", str(graph), "--cluster", "h100-sxm-80gb:16", "--global-batch", "64",
                 "--fix", "pp=2", "--top", "3", "--out", str(out)]) == 0
    return out.read_text(), str(graph)


def test_graph_report_has_every_section_and_the_graphs_timeline(graph_page):
    html, _ = graph_page
    p = parse(html)
    assert p.bad == [] and p.stack == [] and set(p.plots) == PLOTS
    for name, a in p.plots.items():
        assert int(a["data-marks"]) > 0, name
    assert "layer graph of" in html and "module:toy:decoder" in html and "64 samples x 1,024 tokens" in html
    assert "toy&lt;graph&gt;" in html and "<graph>" not in html  # the name is escaped
    assert "Discrete-event simulation" in html and "Best plan:" in html
    doc = data_block(html)
    assert doc["model"] == "toy<graph>" and doc["seq_len"] == 1024 and len(doc["plans"]) == 3
    assert all(x["plan"]["pp"] == 2 for x in doc["plans"])
    sim = doc["simulation"]
    assert len(sim["ranks"]) == 2 and abs(sim["sim_vs_analytic_pct"]) < 3
    assert sim["analytic_step_time_s"] == pytest.approx(doc["plans"][0]["cost"]["step_time_s"], rel=1e-12)


def test_graph_report_matches_its_search_and_simulation():
    from meshplan.sim import simulate
    g, cluster = toy_graph(), load_cluster("h100-sxm-80gb:8")
    work = Workload(global_batch=32, seq_len=g.sample_tokens)
    rep = build_report(g, cluster, work, SearchSpace(pp=(2,)), top=2)
    best = rep.result.best
    assert rep.result.model is g and best.plan.pp == 2 and rep.sim_error is None
    _, s = simulate(g, best.cluster, best.plan, work)
    assert rep.sim_summary == s
    assert rep.html() == rep.html()  # deterministic
    sim, _, err = simulate_winner(rep.result, max_passes=1)
    assert sim is None and "meshplan simulate --model module:toy:decoder" in err
    _, _, err = simulate_winner(rep.result, max_passes=1, model="g.json")
    assert "--model g.json" in err


def test_graph_report_imports_neither_torch_nor_matplotlib(graph_page, tmp_path):
    _, graph = graph_page
    assert_report_imports_neither_torch_nor_matplotlib(["--model", graph, "--cluster", "h100-sxm-80gb:8",
                                                        "--global-batch", "16", "--out", str(tmp_path / "r.html")])


def test_report_on_an_hf_source(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pathlib import Path
    src = f"hf:{Path(__file__).resolve().parents[1] / 'data' / 'hf' / 'llama-tiny.json'}"
    out = tmp_path / "r.html"
    assert main(["report", "--model", src, "--cluster", "h100-sxm-80gb:8", "--global-batch", "32", "--top", "2",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out} (")
    html = out.read_text()
    assert set(parse(html).plots) == PLOTS and "layer graph of" in html
    doc = data_block(html)
    assert doc["simulation"]["step_time_s"] > 0 and f"--model {src}" in html  # the command line
