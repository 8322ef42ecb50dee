"""Data-aware bucket plans (spec/buckets.py, cost/buckets.py, sim/buckets.py, search/buckets.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost import estimate, estimate_batch
from meshplan.errors import MeshplanError
from meshplan.sim.buckets import simulate_buckets
from meshplan.spec.buckets import Bucket, bucket_layout, describe, model_knee, parse_bucket
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.lengths import parse_lengths
from meshplan.spec.plan import Plan, Workload, parse_plan

TAIL = "2048:0.6,8192:0.3,32768:0.1"


@pytest.fixture(scope="module")
def problem():
    return (load_model("llama3-8b"), load_cluster("h100-sxm-80gb:64"),
            Workload.of(256, parse_lengths(TAIL, "bucketed")))


# ---- the plan field --------------------------------------------------------------------------

def test_parse_round_trip_and_micro_batch_filled():
    p = parse_plan("dp=2,cp=4,buckets=4096x4:16384x2cp2:32768x1cp4")
    assert p.buckets == ("4096x4cp1", "16384x2cp2", "32768x1cp4")
    assert p.micro_batch == 1  # the longest bucket's
    assert parse_plan(p.short()) == p
    assert p.bucket_specs[1] == Bucket(16384, 2, 2)
    assert "over 4 context-parallel ranks" in describe(p.bucket_specs)


@pytest.mark.parametrize("text, needle", [
    ("cp=2,buckets=4096x4cp1:2048x1cp2", "ascend"),
    ("cp=4,buckets=4096x4cp1:32768x1cp2", "largest bucket cp is 2"),
    ("cp=6,buckets=4096x4cp4:32768x1cp6", "does not divide"),
    ("cp=2,micro_batch=2,buckets=4096x4cp1:32768x1cp2", "micro_batch=2"),
    ("pp=2,cp=2,buckets=4096x4cp1:32768x1cp2", "pipeline"),
    ("cp=2,buckets=4096by4", "MAX_LENxMICRO_BATCH"),
    ("cp=2,buckets=4096x0cp2", "micro-batch must be >= 1"),
])
def test_bad_buckets_say_what_is_wrong(text, needle):
    with pytest.raises(MeshplanError, match=needle):
        parse_plan(text)


def test_bucket_plan_refuses_one_length_and_short_limits(problem):
    model, cluster, work = problem
    plan = parse_plan("tp=2,dp=16,cp=2,zero=1,buckets=8192x2cp1:32768x1cp2")
    with pytest.raises(MeshplanError, match="several lengths"):
        estimate(model, cluster, plan, Workload(global_batch=256, seq_len=32768))
    short = parse_plan("tp=2,dp=16,cp=2,zero=1,buckets=2048x2cp1:16384x1cp2")
    with pytest.raises(MeshplanError, match="raise it to 32768"):
        estimate(model, cluster, short, work)


# ---- the layout ------------------------------------------------------------------------------

@st.composite
def layouts(draw):
    cps = draw(st.sampled_from([(1,), (1, 2), (1, 4), (2, 4), (1, 2, 4), (4,)]))
    limits = sorted(draw(st.sets(st.integers(8, 200), min_size=len(cps), max_size=len(cps))))
    buckets = tuple(Bucket(n, draw(st.integers(1, 4)), c) for n, c in zip(limits, cps))
    dp = draw(st.integers(1, 3))
    n = draw(st.integers(1, 60))
    lengths = np.asarray(draw(st.lists(st.integers(1, limits[-1]), min_size=n, max_size=n)))
    return buckets, dp, cps[-1], lengths


@settings(max_examples=80, deadline=None)
@given(layouts())
def test_layout_invariants(case):
    buckets, dp, C, lengths = case
    lay = bucket_layout(lengths, buckets, dp, C, knee=64.0)
    # every sample in exactly one micro-batch, in its own bucket, at most the bucket's micro-batch
    seen = sorted(i for mb in lay.micro_batches for i in mb.samples)
    assert seen == list(range(len(lengths)))
    limits = [b.max_len for b in buckets]
    for mb in lay.micro_batches:
        b = buckets[mb.bucket]
        assert 1 <= len(mb.samples) <= b.micro_batch and mb.cp == b.cp
        assert mb.width == max(lengths[list(mb.samples)])
        lo = limits[mb.bucket - 1] if mb.bucket else 0
        assert all(lo < lengths[i] <= b.max_len for i in mb.samples)
        assert 0 <= mb.unit < dp * C // mb.cp
    # the ranks of a unit run its micro-batches in the same order; run order = largest cp first
    for r, run in enumerate(lay.ranks):
        cps = [lay.micro_batches[j].cp for j in run]
        assert cps == sorted(cps, reverse=True)
        for j in run:
            mb = lay.micro_batches[j]
            assert mb.unit * mb.cp <= r < (mb.unit + 1) * mb.cp
    for mb in lay.micro_batches:
        members = range(mb.unit * mb.cp, (mb.unit + 1) * mb.cp)
        positions = {tuple(k for k in lay.ranks[r] if lay.micro_batches[k].cp >= mb.cp) for r in members}
        assert len(positions) == 1  # the same shared sequence on every member
    # greedy dealing: no rank ends later than the even share plus the heaviest micro-batch plus waits
    assert lay.loads().max() <= sum(m.weight * m.cp for m in lay.micro_batches) / (dp * C) \
        + max(m.weight for m in lay.micro_batches) * len({m.cp for m in lay.micro_batches}) + 1e-9


def test_layout_refuses_a_sample_beyond_the_last_limit():
    with pytest.raises(MeshplanError, match="longer than the last bucket"):
        bucket_layout(np.asarray([5, 500]), (Bucket(100, 1, 1),), 1, 1, knee=10.0)


def test_knee_is_about_twelve_hidden_for_a_dense_transformer():
    m = load_model("llama3-8b")
    assert 8 * m.hidden_size < model_knee(m) < 16 * m.hidden_size


# ---- cost model and simulator --------------------------------------------------------------------

@pytest.mark.parametrize("text", ["tp=2,dp=8,cp=4,zero=1,buckets=2048x8cp1:8192x2cp1:32768x1cp4",
                                  "tp=2,dp=16,cp=2,zero=3,recompute=full,buckets=8192x2cp1:32768x1cp2"])
def test_estimate_matches_the_simulator(problem, text):
    """The expected step against 400 simulated steps drawn with another seed (the simulator's
    micro-batch times from its own engine at each exact width and sample count). A step's spread is
    about 11% here, so the simulated mean carries about 0.5% (one sd) of sampling noise."""
    model, cluster, work = problem
    plan = parse_plan(text)
    est = estimate(model, cluster, plan, work)
    sim = simulate_buckets(model, cluster, plan, work, batches=400, seed=3)
    assert est.step_time_s == pytest.approx(sim.steps.mean(), rel=0.03)
    assert est.time["imbalance"] == pytest.approx(sim.steps.mean() - sim.even.mean(), rel=0.35, abs=0.05)


def test_terms_are_non_negative_and_add_up(problem):
    model, cluster, work = problem
    plans = [parse_plan(t) for t in ("tp=2,dp=8,cp=4,zero=1,buckets=8192x1cp1:32768x1cp4",
                                     "tp=4,dp=16,cp=1,buckets=2048x16cp1:32768x1cp1",
                                     "tp=2,dp=4,cp=8,zero=1,micro_batch=2,buckets=8192x1cp1:32768x2cp8")]
    r = estimate_batch(model, cluster, work, plans)
    for i in range(len(plans)):
        terms = {k: float(v[i]) for k, v in r.items() if k.startswith("time.")}
        assert all(v >= 0 for v in terms.values()), terms
        exposed = sum(v for k, v in terms.items() if not k.endswith("_overlapped"))
        assert exposed == pytest.approx(float(r["step_time_s"][i]), rel=1e-6)
        assert r["step_time_even_s"][i] <= r["step_time_s"][i]


def test_sync_is_exposed_and_memory_is_the_heaviest_bucket(problem):
    """A single-bucket plan that holds every sample over cp=4 is the one-shape plan's micro-batch
    memory; it pays the gradient sync the one-shape step hides under its last backward."""
    model, cluster, work = problem
    one = estimate(model, cluster, parse_plan("tp=2,dp=8,cp=4,micro_batch=1"), work)
    bucket = estimate(model, cluster, parse_plan("tp=2,dp=8,cp=4,buckets=32768x1cp4"), work)
    assert bucket.peak_memory_gib == pytest.approx(one.peak_memory_gib, rel=1e-9)
    assert bucket.time["dp_comm"] > one.time["dp_comm"]
    big = estimate(model, cluster, parse_plan("tp=2,dp=8,cp=4,buckets=8192x4cp1:32768x1cp4"), work)
    assert big.peak_memory_gib > bucket.peak_memory_gib  # 4 x 8192 tokens on one rank > 32768 / 4


# ---- search --------------------------------------------------------------------------------------

@pytest.mark.slow  # the full bucket search on 64 GPUs
def test_search_adds_bucket_plans_that_beat_one_shape(problem):
    from meshplan.search import search
    from meshplan.search.space import SearchSpace
    model, cluster, work = problem
    res = search(model, cluster, work, SearchSpace(base=Plan()), top=5)
    info = res.data_aware
    assert info is not None and info["candidates"] > 0 and info["fitting"] > 0
    assert info["best"]["step_time_s"] < info["best_one_shape"]["step_time_s"]
    assert res.plans[0].plan.buckets is not None
    assert [p.rank for p in res.plans] == list(range(1, len(res.plans) + 1))
    times = [p.report.step_time_s for p in res.plans]
    assert times == sorted(times)
    off = search(model, cluster, work, SearchSpace(base=Plan(), buckets=False), top=5)
    assert off.data_aware is None and all(p.plan.buckets is None for p in off.plans)


def test_parse_bucket_accepts_underscores_and_default_cp():
    assert parse_bucket("32_768x2") == Bucket(32768, 2, 1)


@st.composite
def bucket_plans(draw):
    cps = draw(st.sampled_from([(1,), (2,), (1, 2), (1, 4), (2, 4), (1, 2, 8), (1, 1, 4)]))
    limits = sorted(draw(st.sets(st.integers(1, 10**6), min_size=len(cps), max_size=len(cps))))
    bs = [Bucket(n, draw(st.integers(1, 64)), c) for n, c in zip(limits, cps)]
    return Plan(tp=draw(st.sampled_from([1, 2, 8])), dp=draw(st.integers(1, 512)), cp=cps[-1],
                zero=draw(st.integers(0, 3)), micro_batch=bs[-1].micro_batch,
                buckets=tuple(b.text() for b in bs))


@settings(max_examples=150, deadline=None)
@given(bucket_plans())
def test_bucket_plan_round_trips(plan):
    """The plan string, JSON (to_dict/from_dict), plan files (load_plan) all give the plan back."""
    import json

    from meshplan.spec.base import from_dict, to_dict
    from meshplan.spec.io import load_plan
    assert from_dict(Plan, json.loads(json.dumps(to_dict(plan)))) == plan
    assert parse_plan(plan.short()) == plan
    assert load_plan(plan.short()) == plan
    assert tuple(b.text() for b in plan.bucket_specs) == plan.buckets


def test_bucket_plan_file_round_trip(tmp_path, problem):
    """meshplan plan --out then the file back (its plan and lengths) for a bucket winner."""
    import json

    from meshplan.cli.main import main
    out = tmp_path / "p.json"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:64", "--global-batch", "256",
                 "--seq-len", TAIL, "--top", "2", "--fix", "tp=2,pp=1,cp=4,zero=1,recompute=none,micro_batch=1",
                 "--out", str(out)]) == 0  # --fix: the searched winner's shape (the plan file is the point)
    from meshplan.spec.io import load_plan
    doc = json.loads(out.read_text())
    plan = load_plan(str(out))
    assert plan.buckets is not None and parse_plan(doc["plan"] if isinstance(doc["plan"], str) else
                                                   plan.short()) == plan
    assert main(["estimate", "--plan", str(out)]) == 0


def test_simulate_trace_of_a_bucket_plan(tmp_path, problem):
    """`meshplan simulate --trace` of a bucket plan: one row per dp x cp rank, a micro-batch's
    passes on every rank of its unit at the same time, the step = the simulator's first batch."""
    import json

    from meshplan.cli.main import main
    from meshplan.sim.buckets import bucket_timeline
    model, cluster, work = problem
    text = "tp=2,dp=8,cp=4,zero=1,buckets=8192x1cp1:32768x1cp4"
    out = tmp_path / "t.json"
    assert main(["simulate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:64", "--global-batch", "256",
                 "--seq-len", TAIL, "--plan", text, "--batches", "5", "--trace", str(out)]) == 0
    names = {e["args"]["name"] for e in json.loads(out.read_text())["traceEvents"] if e["name"] == "process_name"}
    assert names == {f"dp x cp rank {r}" for r in range(32)}
    plan = parse_plan(text)
    res = bucket_timeline(model, cluster, plan, work, seed=0)
    assert res.step_time_s == pytest.approx(simulate_buckets(model, cluster, plan, work, batches=1).steps[0])
    wide = [e for e in res.events if e.args.get("cp") == 4 and e.name.startswith("F")]
    by_mb: dict[str, set[float]] = {}
    for e in wide:
        by_mb.setdefault(e.name, set()).add(e.start)
    assert by_mb and all(len(v) == 1 for v in by_mb.values())  # the unit's ranks start it together


def test_without_the_bucket_stage_cp_without_a_pipeline_is_rejected(problem):
    """Where no bucket plans are searched (one search per GPU pool), one-shape plans with cp > 1 and
    no pipeline are rejected under a length distribution, with the reason: the runtime runs them
    only as bucket plans."""
    from meshplan.search import search
    from meshplan.search.constraints import VARIED_CP
    from meshplan.search.space import SearchSpace
    model, cluster, work = problem
    res = search(model, cluster, work, SearchSpace(base=Plan(), buckets=False), top=5)
    assert res.rejected.get(VARIED_CP, 0) > 0 and "bucket plan" in res.reject_examples[VARIED_CP]
    assert all(not (p.plan.cp > 1 and p.plan.pp == 1) for p in res.plans)


@pytest.mark.slow  # a full report (search + sampled simulation) on 64 GPUs
def test_report_simulates_the_bucket_winner_on_sampled_batches(problem):
    """The report's timeline of a bucket winner is the sampled-batch simulation (its mean against the
    expected step), not one step of the plan at the longest length."""
    from meshplan.report import build_report
    from meshplan.report.page import render
    model, cluster, work = problem
    rep = build_report(model, cluster, work, top=3)
    best = rep.result.best
    assert best.plan.buckets is not None
    s = rep.sim_summary
    assert s["sampled"]["batches"] == 100 and s["analytic_step_time_s"] == pytest.approx(best.report.step_time_s)
    assert abs(s["sim_vs_analytic_pct"]) < 5
    assert {e.rank for e in rep.sim.events} == set(range(best.plan.dp * best.plan.cp))
    html = render(rep.result, usable_gib=rep.usable_gib, sim=rep.sim, sim_summary=s)
    assert "100 sampled steps" in html and "every data-parallel x context-parallel rank" in html


def test_zero3_bucket_plan_says_it_is_priced_as_zero1(problem):
    """The runtime keeps a bucket plan's parameters gathered: zero=3 costs what zero=1 does, and the
    estimate says so; the search writes such candidates as zero=1."""
    from meshplan.search.buckets import candidates
    model, cluster, work = problem
    z3 = estimate(model, cluster, parse_plan("tp=2,dp=8,cp=4,zero=3,buckets=8192x1cp1:32768x1cp4"), work)
    z1 = estimate(model, cluster, parse_plan("tp=2,dp=8,cp=4,zero=1,buckets=8192x1cp1:32768x1cp4"), work)
    assert z3.step_time_s == pytest.approx(z1.step_time_s) and z3.peak_memory_gib == pytest.approx(z1.peak_memory_gib)
    assert any("priced, in time and memory, as zero=1" in n for n in z3.notes) and not z1.notes
    assert all(c.zero == 1 for c in candidates(parse_plan("tp=2,dp=8,cp=4,zero=3"), work))
