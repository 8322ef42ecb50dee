"""Discrete-event step simulator (meshplan.sim): closed forms on uniform stages, the trace
format, the CLI, and agreement with the analytical cost model on published runs."""
from __future__ import annotations

import argparse
import json

import pytest

from meshplan.cost import estimate
from meshplan.cost.durations import stage_durations, stage_totals
from meshplan.sim import Pass, RankStep, SimSpec, VStage, run, simulate, trace_dict
from meshplan.validate.report import default_runs_path
from meshplan.validate.runs import load_runs

F, B, W = 1.0, 1.5, 0.5  # B includes W (the weight-gradient part)
T = F + B


def uniform(schedule: str, pp: int, m: int, v: int = 1, send: float = 0.0) -> SimSpec:
    st = [VStage(Pass(F / v), Pass((B - W) / v), Pass(W / v), act_bytes=1.0) for _ in range(pp * v)]
    return SimSpec(pp=pp, v=v, microbatches=m, schedule=schedule, stages=st, ranks=[RankStep()] * pp,
                   send_s=send)


@pytest.mark.parametrize("pp,m", [(1, 4), (2, 2), (4, 8), (8, 16), (4, 3)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_uniform_closed_form(schedule, pp, m):
    res = run(uniform(schedule, pp, m))
    assert res.step_time_s == pytest.approx(m * T + (pp - 1) * T, rel=1e-12)
    assert res.summary()["bubble_fraction"] == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-9)


def test_sends_count_once_per_pass():
    # Blocking sends: each pass on a stage with a neighbour carries the send; the closed form
    # holds with T' = T + 2 send for the interior stages.
    res = run(uniform("1f1b", 4, 8, send=0.1))
    assert (8 + 3) * T < res.step_time_s <= (8 + 3) * (T + 0.2) + 1e-9


@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_divides_bubble_by_v(v):
    pp, m = 4, 8
    res = run(uniform("interleaved-1f1b", pp, m, v))
    assert res.step_time_s == pytest.approx(m * T + (pp - 1) * T / v, rel=1e-9)


def test_zero_bubble_fills_the_bubble():
    pp, m = 4, 8
    zb = run(uniform("zero-bubble", pp, m)).step_time_s
    one = run(uniform("1f1b", pp, m)).step_time_s
    assert zb < one
    assert zb == pytest.approx(m * T + (pp - 1) * (F + (B - W) - W), rel=1e-9)  # ZB-H1 closed form


def test_memory_rises_with_forwards_and_falls_with_backwards():
    res = run(uniform("1f1b", 4, 8))
    peaks = [max(b for _, b in series) for series in res.memory]
    assert peaks == [4.0, 3.0, 2.0, 1.0]  # 1F1B: pp - rank micro-batches in flight
    assert all(series[-1][1] == 0.0 for series in res.memory)


def test_trace_is_valid_chrome_json(tmp_path):
    res = run(uniform("1f1b", 4, 4))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace_dict(res)))
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1, 2, 3}
    assert {e["tid"] for e in xs} <= {0, 1, 2, 3}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert names == {(r, f"pp rank {r}") for r in range(4)}
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(res.step_time_s * 1e6)


@pytest.fixture(scope="module")
def cases():
    return {c.row_id: c for c in load_runs(default_runs_path()) if c.ok}


def test_durations_recombine_to_the_estimate(cases):
    for rid in ("5", "14", "1314", "66", "247"):
        c = cases[rid]
        d = stage_durations(c.model, c.cluster, c.plan, c.work)
        t = stage_totals(d)
        a = d.analytic
        bubble = (sum(t) - max(t)) / (d.virtual_stages if d.schedule == "interleaved-1f1b" else 1)
        assert a["bubble"] == pytest.approx(bubble if d.pp > 1 else 0.0, rel=1e-9, abs=1e-12)
        rest = a["step_time_s"] - a["bubble"] - a["optimizer"] - a["overhead"] - d.microbatches * max(t)
        assert rest >= -1e-9 and rest == pytest.approx(max(d.end_dp_exposed_s), rel=1e-6, abs=1e-9)
        assert a["step_time_s"] == pytest.approx(estimate(c.model, c.cluster, c.plan, c.work).step_time_s)


# Published rows: pp=1 FSDP (Mosaic, torchtitan), Megatron 1F1B and interleaved, BLOOM ZeRO-1.
ROWS = ("1", "66", "77", "247", "5", "13", "14", "91", "1314")


@pytest.mark.parametrize("rid", ROWS)
def test_simulation_agrees_with_estimate(cases, rid):
    c = cases[rid]
    _, s = simulate(c.model, c.cluster, c.plan, c.work)
    assert abs(s["sim_vs_analytic_pct"]) < 3.0, s


def test_cli_json_trace_plot(tmp_path, capsys):
    from meshplan.cli import simulate_cmd
    p = argparse.ArgumentParser()
    simulate_cmd.add_parser(p.add_subparsers(dest="command"))
    trace = tmp_path / "step.json"
    args = p.parse_args(["simulate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--plan",
                         "tp=2,pp=4,dp=2,micro_batch=1,schedule=interleaved-1f1b,virtual_stages=2",
                         "--global-batch", "32", "--seq-len", "2048", "--trace", str(trace), "--json"])
    assert simulate_cmd.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] > 0 and len(out["ranks"]) == 4
    assert set(out["ranks"][0]["busy_s"]) == {"compute", "tp", "dp", "pp"}
    assert abs(out["sim_vs_analytic_pct"]) < 3
    assert {e["pid"] for e in json.loads(trace.read_text())["traceEvents"]} == {0, 1, 2, 3}


@pytest.mark.parametrize("rid", ["66", "5", "14", "91"])
def test_peak_memory_over_time_matches_the_cost_model(cases, rid):
    c = cases[rid]
    _, s = simulate(c.model, c.cluster, c.plan, c.work)
    est = estimate(c.model, c.cluster, c.plan, c.work)
    assert [r["peak_memory_gib"] for r in s["ranks"]] == pytest.approx(est.memory_per_stage, rel=1e-9)


# ---- --plot: the report's timeline figures, as .svg or painted by matplotlib ---------------------

def _interleaved_step():
    from meshplan.spec.io import load_cluster, load_model, load_plan
    from meshplan.spec.plan import Workload
    plan = load_plan("tp=2,pp=4,dp=2,micro_batch=1,schedule=interleaved-1f1b,virtual_stages=2")
    return simulate(load_model("llama3-8b"), load_cluster("h100-sxm-80gb:16"), plan,
                         Workload(global_batch=32, seq_len=2048))[0]


@pytest.fixture(scope="module")
def step():
    return _interleaved_step()


def test_plot_svg_is_the_reports_figures_without_matplotlib(step, tmp_path, monkeypatch):
    import gzip
    import sys
    import xml.etree.ElementTree as ET

    from meshplan.errors import MeshplanError
    from meshplan.sim.output import check_plot_path, gantt, sim_memory, write_plot
    for name in ("matplotlib", "matplotlib.backend_bases", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    write_plot(step, tmp_path / "s.svg", title="a <title> & more")
    text = (tmp_path / "s.svg").read_text()
    assert text.startswith("<?xml")
    root = ET.fromstring(text.split("\n", 1)[1])
    plots = [e.get("data-plot") for e in root.iter("{http://www.w3.org/2000/svg}svg") if e.get("data-plot")]
    assert plots == ["gantt", "sim-memory"]
    assert gantt(step) in text and sim_memory(step) in text  # the very figures of the report
    assert "a &lt;title&gt; &amp; more: simulated step" in text and "svg .grid{" in text
    write_plot(step, tmp_path / "s.svgz")
    assert gzip.decompress((tmp_path / "s.svgz").read_bytes()).decode().startswith("<?xml")
    with pytest.raises(MeshplanError, match="needs matplotlib"):
        check_plot_path(tmp_path / "s.png")


def test_plot_image_paints_every_mark_of_the_figures(step):
    pytest.importorskip("matplotlib")
    import re

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from meshplan.sim.output import gantt, sim_memory
    from meshplan.svg import paint
    for figure in (gantt(step), sim_memory(step, 75.0)):
        fig, ax = plt.subplots()
        try:
            assert paint(figure, ax) == []  # every element drawn
            rects = sum(len(re.findall(r"M[\d.]+ [\d.]+h", d)) for d in re.findall(r' d="([^"]*)"', figure))
            assert sum(len(c.get_paths()) for c in ax.collections) == rects
            assert len(ax.collections) == (1 if rects else 0)
            assert len(ax.lines) >= figure.count("<polyline")
        finally:
            plt.close(fig)


def test_gantt_draws_a_ranks_later_chunks_lighter(step):
    from meshplan.sim.output import COLORS, LATER_CHUNK, gantt
    from meshplan.svg import esc, tint
    g = gantt(step)
    assert esc(LATER_CHUNK) in g
    for kind in ("F", "B"):
        assert f'data-mark="{kind}" fill="{COLORS[kind]}"' in g
        assert f'data-mark="{kind}" fill="{tint(COLORS[kind])}"' in g
    one_chunk = run(uniform("1f1b", 2, 4))
    assert esc(LATER_CHUNK) not in gantt(one_chunk)
