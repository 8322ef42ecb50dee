"""The simulator's split-backward schedules: ZBV (V placement, torch's order) and ZB-H1 (torch's
order): orders, dependencies, bubbles against the cost model's closed forms, memory over time,
placement of the output layer, and the CLI trace/plot. (tests/unit/test_schedule_bubble.py
checks the closed forms on random stages.)"""
from __future__ import annotations

import argparse
import importlib.util
import json
import types
from collections import defaultdict

import numpy as np
import pytest

from meshplan.cost import estimate
from meshplan.cost.durations import stage_durations
from meshplan.cost.schedule import bubble_array, in_flight_array, rank_passes
from meshplan.sim import Pass, RankStep, SimSpec, VStage, run, simulate
from meshplan.sim.build import spec_from_plan
from meshplan.sim.schedules import SIMULATED, rank_chunk, rank_orders, stage_of
from meshplan.spec.io import load_cluster, load_model, load_plan
from meshplan.spec.plan import SCHEDULES, Workload


def uniform(schedule: str, pp: int, m: int, f: float, b: float, w: float, send: float = 0.0) -> SimSpec:
    """Uniform stages; f, b, w are the forward, input-gradient and weight-gradient seconds of
    one micro-batch on one chunk (ZBV has two chunks per rank, the others one)."""
    v = 2 if schedule == "zbv" else 1
    st = [VStage(Pass(f), Pass(b), Pass(w), act_bytes=1.0) for _ in range(pp * v)]
    return SimSpec(pp=pp, v=v, microbatches=m, schedule=schedule, stages=st, ranks=[RankStep()] * pp, send_s=send)


def bubble(res, m: int, per_mb: float) -> float:
    return res.step_time_s - m * per_mb


def test_every_plan_schedule_is_simulated():
    assert set(SIMULATED) == set(SCHEDULES)


# ---- orders -------------------------------------------------------------------------------------
def _torch_orders(cls_name: str, pp: int, m: int, local: int) -> list[list[tuple[str, int, int]]]:
    sch = pytest.importorskip("torch.distributed.pipelining.schedules")
    kind = {sch._ComputationType.FORWARD: "F", sch._ComputationType.BACKWARD_INPUT: "B",
            sch._ComputationType.BACKWARD_WEIGHT: "W"}
    cls = getattr(sch, cls_name)
    out = []
    for r in range(pp):
        fake = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=local * pp, n_local_stages=local,
                                     microbatches_per_round=m // max(1, m // pp))
        ops = cls._calculate_single_rank_operations(fake, r)
        out.append([(kind[a.computation_type], a.microbatch_index, a.stage_index) for a in ops if a is not None])
    return out


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_zbv_order_is_torchs(pp):
    for m in range(1, 4 * pp + 2):
        orders = rank_orders("zbv", pp, m, 2)
        ours = [[(k, i, stage_of("zbv", pp, r, c)) for k, i, c in o] for r, o in enumerate(orders)]
        assert ours == _torch_orders("ScheduleZBVZeroBubble", pp, m, 2), (pp, m)


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_zero_bubble_order_is_torchs(pp):
    for m in range(1, 4 * pp + 2):
        if m % max(1, m // pp):  # torch refuses these micro-batch counts
            continue
        ours = [[(k, i, r) for k, i, _ in o] for r, o in enumerate(rank_orders("zero-bubble", pp, m))]
        assert ours == _torch_orders("ScheduleInterleavedZeroBubble", pp, m, 1), (pp, m)


def test_v_placement():
    pp = 4
    assert [rank_chunk("zbv", pp, s) for s in range(2 * pp)] == [(0, 0), (1, 0), (2, 0), (3, 0),
                                                                  (3, 1), (2, 1), (1, 1), (0, 1)]
    assert all(stage_of("zbv", pp, *rank_chunk("zbv", pp, s)) == s for s in range(2 * pp))
    assert all(stage_of("interleaved-1f1b", pp, *rank_chunk("interleaved-1f1b", pp, s)) == s for s in range(3 * pp))


# ---- dependencies and V-shaped chunk order --------------------------------------------------------
@pytest.mark.parametrize("pp,m", [(2, 3), (4, 4), (4, 8), (4, 13), (6, 24)])
def test_zbv_respects_dependencies_and_runs_the_v(pp, m):
    res = run(uniform("zbv", pp, m, 1.0, 1.3, 0.8, send=0.05))
    t: dict[tuple[str, int, int], tuple[float, float, int]] = {}
    for e in res.events:
        if e.stream == "compute" and e.name[0] in "FBW":
            key = (e.args["pass"], e.args["mb"], e.args["stage"])
            assert key not in t
            t[key] = (e.start, e.end, e.rank)
    assert len(t) == 3 * m * 2 * pp  # every F, B and W once
    for i in range(m):
        for s in range(2 * pp):
            f0, f1, fr = t[("F", i, s)]
            b0, b1, br = t[("B", i, s)]
            w0, _, wr = t[("W", i, s)]
            assert fr == br == wr == rank_chunk("zbv", pp, s)[0]
            assert b0 >= f1 - 1e-12 and w0 >= b1 - 1e-12  # no backward before its forward, W after B
            if s + 1 < 2 * pp:
                assert t[("F", i, s + 1)][0] >= f1 - 1e-12   # forward goes down the V ...
                assert b0 >= t[("B", i, s + 1)][1] - 1e-12   # ... backward comes back up
        ranks = [t[("F", i, s)][2] for s in range(2 * pp)]
        assert ranks == list(range(pp)) + list(range(pp - 1, -1, -1))


def test_zbv_sends_only_between_ranks():
    pp, m = 4, 8
    res = run(uniform("zbv", pp, m, 1.0, 1.0, 1.0, send=0.01))
    sends = defaultdict(int)
    for e in res.events:
        if e.stream == "pp":
            sends[e.rank] += 1
    # rank 0: F of chunk 0, B of chunk 1 (the last stage); rank pp-1 turns the V locally
    assert dict(sends) == {0: 2 * m, 1: 4 * m, 2: 4 * m, 3: 2 * m}


# ---- bubbles ------------------------------------------------------------------------------------
def _cost_model_bubble(schedule: str, pp: int, f: float, b: float, w: float, m: int) -> float:
    """cost.schedule's closed form on uniform stages (f, b, w: one micro-batch on one chunk)."""
    v = 2 if schedule == "zbv" else 1
    total = v * (f + b + w)
    ones = np.ones((1, pp))
    passes = rank_passes(v * f * ones, v * b * ones, v * w * ones, ones.astype(bool))
    return float(bubble_array(np.array([pp * total]), np.array([total]), np.array([pp]), v, np.array([schedule]),
                              v * w / total, np.array([m]), passes)[0])


@pytest.mark.parametrize("pp,m", [(2, 3), (2, 8), (4, 7), (4, 16), (8, 15), (8, 64)])
@pytest.mark.parametrize("x", [0.5, 1.0])
def test_zbv_bubble_matches_the_cost_model_with_equal_passes(pp, m, x):
    """F = B = W (the case ZB-V is designed for): the bubble is the start-up skew (pp-1) f,
    which is cost.schedule's ZBV closed form; m >= 2 pp - 1 (the warm-up's micro-batches)."""
    res = run(uniform("zbv", pp, m, x, x, x))
    assert bubble(res, m, 6 * x) == pytest.approx(_cost_model_bubble("zbv", pp, x, x, x, m), rel=1e-9)
    assert bubble(res, m, 6 * x) == pytest.approx((pp - 1) * x, rel=1e-9)


@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 0.5), (1.0, 1.66, 0.55), (1.0, 2.7, 0.5), (0.5, 1.0, 1.0),
                                   (1.0, 1.24, 0.83), (0.3, 1.5, 1.5)])
@pytest.mark.parametrize("pp,m", [(2, 3), (4, 8), (4, 31), (8, 15), (8, 40)])
def test_zbv_bubble_closed_form_of_torchs_order(f, b, w, pp, m):
    """torch's ZBV order is fixed (built for F = B = W). With f <= b and w <= b per chunk and
    m >= 2 pp - 1 its bubble on uniform stages is exactly (pp - 1) max(b, 2 (b - w)): the cost
    model's closed form (before: ZB-H1's halved, (pp - 1)(f + b - w), right only for f = b = w)."""
    res = run(uniform("zbv", pp, m, f, b, w))
    assert bubble(res, m, 2 * (f + b + w)) == pytest.approx((pp - 1) * max(b, 2 * (b - w)), rel=1e-9)
    assert bubble(res, m, 2 * (f + b + w)) == pytest.approx(_cost_model_bubble("zbv", pp, f, b, w, m), rel=1e-9)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zbv_needs_2pp_minus_1_microbatches_to_fill(pp):
    f, b, w = 1.0, 1.66, 0.55
    bubbles = [bubble(run(uniform("zbv", pp, m, f, b, w)), m, 2 * (f + b + w)) for m in range(1, 2 * pp + 3)]
    assert all(x > y + 1e-9 for x, y in zip(bubbles[:2 * pp - 2], bubbles[1:2 * pp - 1]))  # shrinks up to 2pp-1
    assert bubbles[2 * pp - 2:] == pytest.approx([(pp - 1) * 2 * (b - w)] * 4, rel=1e-9)
    assert bubbles == pytest.approx([_cost_model_bubble("zbv", pp, f, b, w, m) for m in range(1, 2 * pp + 3)],
                                    rel=1e-9)  # the cost model's m term


@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 0.5), (1.0, 1.66, 0.55), (1.0, 2.7, 0.5), (1.0, 1.0, 1.0),
                                   (1.0, 1.24, 0.83)])
@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 16), (8, 8), (8, 64)])
def test_zero_bubble_matches_the_cost_model(f, b, w, pp, m):
    """ZB-H1 in torch's order: (pp - 1)(F + B - W) when W <= min(F, B) and m >= pp, cost.schedule's form."""
    res = run(uniform("zero-bubble", pp, m, f, b, w))
    assert bubble(res, m, f + b + w) == pytest.approx(_cost_model_bubble("zero-bubble", pp, f, b, w, m), rel=1e-9)


# ---- memory -------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,m", [(2, 3), (4, 7), (4, 16), (8, 32)])
def test_zbv_memory_peaks_at_pp_microbatches_on_every_rank(pp, m):
    """Each chunk holds half a rank's activations per micro-batch (act_bytes 1 per chunk here):
    with m >= 2 pp - 1 every rank peaks at 2 pp chunks = pp micro-batches, the cost model's
    ZBV in-flight count; activations are freed by W and all gone at the end."""
    res = run(uniform("zbv", pp, m, 1.0, 1.2, 0.9))
    peaks = [max(b for _, b in series) for series in res.memory]
    expect = [2 * float(in_flight_array(pp, 2, np.asarray("zbv"), r, m)) for r in range(pp)]
    assert peaks == expect == [2.0 * pp] * pp
    assert all(series[-1][1] == 0.0 for series in res.memory)


def test_zbv_memory_with_few_microbatches_is_the_cost_models():
    pp, m = 4, 4
    res = run(uniform("zbv", pp, m, 1.0, 1.2, 0.9))
    peaks = [max(b for _, b in series) for series in res.memory]
    assert peaks == [5.0, 6.0, 7.0, 8.0]  # rank r: min(2m, m + r + 1, 2pp) chunks (before: pp mbs everywhere)
    assert peaks == [2 * float(in_flight_array(pp, 2, np.asarray("zbv"), r, m)) for r in range(pp)]


def test_zero_bubble_memory_peaks_at_pp_microbatches_on_every_rank():
    """torch's ZB-H1 delays rank r's W by r steps: pp micro-batches whose W has not run on every
    rank, the cost model's count (before: 1F1B's pp - r)."""
    pp, m = 4, 12
    res = run(uniform("zero-bubble", pp, m, 1.0, 1.2, 0.9))
    assert [max(b for _, b in series) for series in res.memory] == [4.0] * pp
    assert [float(in_flight_array(pp, 1, np.asarray("zero-bubble"), r, m)) for r in range(pp)] == [4.0] * pp


# ---- real plans ---------------------------------------------------------------------------------
MODEL, CLUSTER = "llama3-8b", "h100-sxm-80gb:16"


@pytest.fixture(scope="module")
def mc():
    return load_model(MODEL), load_cluster(CLUSTER)


@pytest.mark.parametrize("plan,gb", [("tp=4,pp=4,schedule=zbv,virtual_stages=2", 32),
                                     ("tp=2,pp=8,schedule=zbv,virtual_stages=2,recompute=full", 64),
                                     ("tp=4,pp=4,schedule=zbv,virtual_stages=2,zero=3,fused_loss=true", 16)])
def test_zbv_plan_memory_and_output_layer_on_rank_0(mc, plan, gb):
    model, cluster = mc
    p, w = load_plan(plan), Workload(global_batch=gb, seq_len=4096)
    spec, d = spec_from_plan(model, cluster, p, w)
    pp = p.pp
    # the last stage (the output layer and the loss) is rank 0's second chunk, the heaviest
    assert rank_chunk("zbv", pp, 2 * pp - 1) == (0, 1)
    heavy = spec.stages[2 * pp - 1].fwd.compute
    assert heavy > max(st.fwd.compute for s, st in enumerate(spec.stages) if s != 2 * pp - 1)
    assert sum(st.fwd.compute for st in spec.stages) == pytest.approx(sum(d.fwd_s), rel=1e-12)
    # memory: the cost model's per-stage peaks, which hold the output layer on rank 0 like the
    # simulation (durations list its static bytes at rank pp - 1, where sim.build takes them from)
    x = d.output_static_bytes
    assert d.static_bytes[pp - 1] - d.static_bytes[1] == pytest.approx(x, rel=1e-9)
    _, s = simulate(model, cluster, p, w)
    est = estimate(model, cluster, p, w).memory_per_stage
    assert est[0] > max(est[1:])
    assert [r["peak_memory_gib"] for r in s["ranks"]] == pytest.approx(est, rel=1e-9)


def test_zbv_plan_durations_recombine(mc):
    """Every pass of the plan runs once, with the cost model's per-rank work (compute summed
    over passes and chunks equals m x the cost model's per-micro-batch compute)."""
    model, cluster = mc
    p, w = load_plan("tp=4,pp=4,schedule=zbv,virtual_stages=2"), Workload(global_batch=16, seq_len=4096)
    d = stage_durations(model, cluster, p, w)
    res, _ = simulate(model, cluster, p, w)
    busy = sum(e.end - e.start for e in res.events if e.stream == "compute" and e.name[0] in "FBW")
    assert busy == pytest.approx(d.microbatches * sum(d.fwd_s[r] + d.bwd_input_s[r] + d.bwd_weight_s[r]
                                                      + d.recompute_s[r] for r in range(p.pp)), rel=1e-9)


def test_cli_zbv_trace_and_plot(tmp_path, capsys):
    from meshplan.cli import simulate_cmd
    parser = argparse.ArgumentParser()
    simulate_cmd.add_parser(parser.add_subparsers(dest="command"))
    trace, plot = tmp_path / "t.json", tmp_path / "t.png"
    argv = ["simulate", "--model", MODEL, "--cluster", CLUSTER, "--plan",
            "tp=4,pp=4,micro_batch=1,schedule=zbv,virtual_stages=2", "--global-batch", "16", "--seq-len", "4096",
            "--trace", str(trace), "--json"]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if has_mpl:
        argv += ["--plot", str(plot)]
    assert simulate_cmd.run(parser.parse_args(argv)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "zbv" and out["virtual_stages"] == 2 and len(out["ranks"]) == 4
    xs = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert {e["name"][0] for e in xs} >= {"F", "B", "W"}
    assert {e["args"].get("chunk") for e in xs if e["name"][0] in "FBW"} == {0, 1}
    if has_mpl:
        assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
