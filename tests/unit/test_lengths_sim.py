"""The simulator over sampled length distributions (sim.varlen) and its agreement with the cost
model's expected step (cost.lengths); the pipeline stall constants measured on the schedules."""
from __future__ import annotations

import json

import numpy as np
import pytest

from meshplan.cost import lengths as LL
from meshplan.sim import simulate
from meshplan.sim.engine import Pass, RankStep, SimSpec, VStage
from meshplan.sim.engine import run as run_step
from meshplan.sim.varlen import form_microbatches, replica_spec, simulate_lengths
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.lengths import LengthDist, parse_lengths
from meshplan.spec.plan import Workload, parse_plan
from tests.unit.clirun import run

DIST = "2048:0.6,8192:0.3,32768:0.1"


@pytest.fixture(scope="module")
def problem():
    return load_model("llama3-8b"), load_cluster("h100-sxm-80gb:64")


@pytest.mark.parametrize("plan", ["tp=2,pp=1,dp=16,cp=2,zero=3,micro_batch=1,sequence_parallel=1",
                                  "tp=2,pp=4,dp=8,zero=1,micro_batch=2,sequence_parallel=1,schedule=interleaved-1f1b,"
                                  "virtual_stages=2"])
@pytest.mark.parametrize("packing", ["padded", "bucketed", "packed"])
def test_one_length_is_the_existing_simulator(problem, plan, packing):
    model, cluster = problem
    p = parse_plan(plan)
    work = Workload.of(256, LengthDist((8192,), (1.0,), packing))
    want = simulate(model, cluster, p, Workload(global_batch=256, seq_len=8192))[0].step_time_s
    res = simulate_lengths(model, cluster, p, work, batches=3)
    assert (res.steps == want).all()


def test_per_microbatch_stages_equal_to_the_stages_are_bit_identical():
    st = [VStage(Pass(1.0, 0.2, 0.1), Pass(2.0, 0.1, 0.3), Pass(0.5)) for _ in range(8)]
    base = SimSpec(pp=4, v=2, microbatches=8, schedule="interleaved-1f1b", stages=st,
                   ranks=[RankStep(0.0, 0.0, 0.4, 0.2, 0.1, 1e9) for _ in range(4)], send_s=0.05)
    a = run_step(base)
    b = run_step(SimSpec(**{**base.__dict__, "mb_stages": [st] * 8}))
    assert a.step_time_s == b.step_time_s and a.events == b.events and a.memory == b.memory


def test_microbatches_formed_as_the_runtime_does():
    lengths = np.array([5, 1, 3, 8, 2, 2, 7, 4])
    assert form_microbatches(lengths, 2, 2, "padded") == [[5, 8], [2, 7]]
    # sorted 1 2 2 3 4 5 7 8 -> micro-batches (1,2) (2,3) (4,5) (7,8), j to replica j mod 2
    assert form_microbatches(lengths, 2, 2, "bucketed") == [[2, 5], [3, 8]]


def test_replica_of_mixed_lengths_runs_each_microbatch_at_its_length(problem):
    """pp = 1: a replica's compute is the sum of its micro-batches' at their own lengths."""
    from meshplan.sim.varlen import _Lengths
    model, cluster = problem
    p = parse_plan("tp=8,pp=1,dp=8,zero=1,micro_batch=1,sequence_parallel=1")
    pieces = _Lengths(model, cluster, p, Workload(global_batch=64, seq_len=32768), LL.DEFAULT_PARAMS)
    res = run_step(replica_spec(pieces, [2048, 8192, 2048, 32768, 2048, 2048, 2048, 2048]))
    busy = sum(e.end - e.start for e in res.events if e.stream == "compute" and e.name[0] in "FB")
    want = sum(pieces.get(x)[0].fwd_s[0] + pieces.get(x)[0].bwd_input_s[0] + pieces.get(x)[0].bwd_weight_s[0]
               for x in (2048, 8192, 2048, 32768, 2048, 2048, 2048, 2048))
    assert busy == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("packing", ["padded", "bucketed"])
@pytest.mark.parametrize("plan", ["tp=2,pp=1,dp=16,cp=2,zero=3,micro_batch=1,sequence_parallel=1",
                                  "tp=2,pp=1,dp=32,zero=3,micro_batch=2,sequence_parallel=1,recompute=full",
                                  "tp=2,pp=4,dp=8,zero=1,micro_batch=1,sequence_parallel=1"])
def test_simulated_mean_agrees_with_the_cost_model(problem, packing, plan):
    model, cluster = problem
    p = parse_plan(plan)
    work = Workload.of(256, parse_lengths(DIST, packing))
    sim = simulate_lengths(model, cluster, p, work, batches=40, seed=1)
    est = LL.expected_batch(model, cluster, work, [p])
    assert est["step_time_s"][0] == pytest.approx(sim.mean_s, rel=0.05)
    assert est["step_time_even_s"][0] == pytest.approx(sim.even.mean(), rel=0.05)  # 40 draws: ~3% sd


def test_cli_simulate_distribution(tmp_path, capsys):
    base = ["simulate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:64", "--global-batch", "256",
            "--plan", "tp=2,pp=1,dp=16,cp=2,zero=3,micro_batch=1,sequence_parallel=1", "--seq-len", DIST]
    rc, out, _ = run(capsys, *base, "--batches", "10", "--json", "--trace", str(tmp_path / "t.json"))
    assert rc == 0
    d = json.loads(out)
    assert d["batches"] == 10 and d["p90_step_s"] >= d["p50_step_s"] and abs(d["analytic_vs_sim_pct"]) < 10
    assert json.loads((tmp_path / "t.json").read_text())
    rc, out, _ = run(capsys, *base, "--batches", "5", "--packing", "bucketed")
    assert rc == 0 and "lost to imbalance" in out and "cost model: expected step" in out


# ---- the stall constants, measured on the schedules' orders (uniform stages) ------------------------

def _uniform(xs, pp, sched, f=1.0, b=1.5, w=0.5):
    v = 2 if sched in ("zbv", "interleaved-1f1b") else 1
    split = sched in ("zero-bubble", "zbv")

    def st(x):
        return [VStage(Pass(f * x / v), Pass((b if split else b + w) * x / v), Pass((w if split else 0.0) * x / v))
                for _ in range(pp * v)]
    spec = SimSpec(pp=pp, v=v, microbatches=len(xs), schedule=sched, stages=st(1.0),
                   ranks=[RankStep() for _ in range(pp)], mb_stages=[st(x) for x in xs])
    return run_step(spec).step_time_s


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("sched", ["1f1b", "zero-bubble"])
def test_lone_heavy_microbatch_stall_and_its_window(pp, sched):
    """A lone micro-batch X times heavier adds (pp - 1)(F + B)(X - 1) beyond its own work (the
    stall of STALL_FRACTION 1), and two of them d apart share (1 - (d - 1)/(pp - 1)) of it:
    summed over d, pp / 2 (STALL_SHARE) within 0.25."""
    m, X, f, b = 8 * pp, 16.0, 1.0, 1.5
    work = 3.0 * (X - 1)
    base = _uniform([1.0] * m, pp, sched)
    one = [1.0] * m
    one[m // 4] = X
    e1 = _uniform(one, pp, sched) - base - work
    assert e1 == pytest.approx((pp - 1) * (f + b + (0.5 if sched == "1f1b" else 0.0)) * (X - 1), rel=0.035)
    shared = 0.0
    for d in range(1, 3 * pp):
        xs = [1.0] * m
        xs[m // 4] = xs[m // 4 + d] = X
        shared += 1 - (_uniform(xs, pp, sched) - base - 2 * work - e1) / e1
    assert shared == pytest.approx(pp / 2, abs=0.25)
    w = LL.stall_window({"pp": np.array([pp]), "schedule": np.array([sched])})[0]
    assert LL.overlap_counts(w, 4 * pp)[-1] == pytest.approx(pp / 2)


@pytest.mark.parametrize("sched", ["gpipe", "1f1b", "zero-bubble", "zbv", "interleaved-1f1b"])
def test_ascending_microbatches_pay_the_bubble_once_at_the_longest(sched):
    """Bucketed replicas run their micro-batches in ascending length: the bubble is paid once, at
    the longest (a step up from light to heavy costs the heavy bubble), within 3% of the step."""
    pp, m = 4, 16
    base_h = _uniform([16.0] * m, pp, sched) - 16.0 * 3 * m  # the bubble at the heavy length
    up = _uniform([1.0] * (m // 2) + [16.0] * (m // 2), pp, sched)
    assert up == pytest.approx(3 * (m // 2) * 17 + base_h, rel=0.03)
