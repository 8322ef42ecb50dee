"""Discrete-event step simulator (meshplan.sim): closed forms on uniform stages, the trace
format, the CLI, and agreement with the analytical cost model on published runs."""
from __future__ import annotations

import argparse
import json

import pytest

from meshplan.cost import estimate
from meshplan.cost.durations import stage_durations, stage_totals
from meshplan.sim import Pass, RankStep, SimSpec, VStage, simulate, simulate_plan, trace_dict
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
    res = simulate(uniform(schedule, pp, m))
    assert res.step_time_s == pytest.approx(m * T + (pp - 1) * T, rel=1e-12)
    assert res.summary()["bubble_fraction"] == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-9)


def test_sends_count_once_per_pass():
    # Blocking sends: each pass on a stage with a neighbour carries the send; the closed form
    # holds with T' = T + 2 send for the interior stages.
    res = simulate(uniform("1f1b", 4, 8, send=0.1))
    assert (8 + 3) * T < res.step_time_s <= (8 + 3) * (T + 0.2) + 1e-9


@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_divides_bubble_by_v(v):
    pp, m = 4, 8
    res = simulate(uniform("interleaved-1f1b", pp, m, v))
    assert res.step_time_s == pytest.approx(m * T + (pp - 1) * T / v, rel=1e-9)


def test_zero_bubble_fills_the_bubble():
    pp, m = 4, 8
    zb = simulate(uniform("zero-bubble", pp, m)).step_time_s
    one = simulate(uniform("1f1b", pp, m)).step_time_s
    assert zb < one
    assert zb == pytest.approx(m * T + (pp - 1) * (F + (B - W) - W), rel=1e-9)  # ZB-H1 closed form


def test_memory_rises_with_forwards_and_falls_with_backwards():
    res = simulate(uniform("1f1b", 4, 8))
    peaks = [max(b for _, b in series) for series in res.memory]
    assert peaks == [4.0, 3.0, 2.0, 1.0]  # 1F1B: pp - rank micro-batches in flight
    assert all(series[-1][1] == 0.0 for series in res.memory)


def test_trace_is_valid_chrome_json(tmp_path):
    res = simulate(uniform("1f1b", 4, 4))
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
    _, s = simulate_plan(c.model, c.cluster, c.plan, c.work)
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
    _, s = simulate_plan(c.model, c.cluster, c.plan, c.work)
    est = estimate(c.model, c.cluster, c.plan, c.work)
    assert [r["peak_memory_gib"] for r in s["ranks"]] == pytest.approx(est.memory_per_stage, rel=1e-9)
