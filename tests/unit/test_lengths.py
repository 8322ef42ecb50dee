"""The expected step of a length distribution (cost.lengths): exactness on small cases against
brute force, the fixed-length limit, invariants, and the CLI (--seq-len DIST, --packing)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost import batch as B
from meshplan.cost import estimate
from meshplan.cost import lengths as LL
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.errors import MeshplanError
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.lengths import LengthDist, parse_lengths
from meshplan.spec.plan import Workload, parse_plan
from tests.unit.clirun import one_line_error, run

DIST = "2048:0.6,8192:0.3,32768:0.1"
PLANS = ["tp=2,pp=1,dp=16,cp=2,zero=3,micro_batch=1,sequence_parallel=1",
         "tp=1,pp=1,dp=64,zero=3,micro_batch=1,recompute=full",
         "tp=2,pp=4,dp=8,zero=1,micro_batch=1,sequence_parallel=1",
         "tp=2,pp=4,dp=8,zero=1,micro_batch=2,sequence_parallel=1,schedule=gpipe",
         "tp=8,pp=2,dp=1,cp=4,micro_batch=1,schedule=zbv,virtual_stages=2,sequence_parallel=1",
         "tp=2,pp=4,dp=8,zero=1,micro_batch=1,virtual_stages=2,schedule=interleaved-1f1b,sequence_parallel=1"]


@pytest.fixture(scope="module")
def problem():
    return load_model("llama3-8b"), load_cluster("h100-sxm-80gb:64")


def _plans():
    return [parse_plan(p) for p in PLANS]


# ---- exact pieces against brute force ------------------------------------------------------------

def _brute_emax(values, probs, n):
    out = 0.0
    for idx in itertools.product(range(len(values)), repeat=n):
        out += math.prod(probs[i] for i in idx) * max(values[i] for i in idx)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.floats(0.01, 1.0)), min_size=1, max_size=5), st.integers(1, 4))
def test_emax_discrete_is_exact(pairs, n):
    values = [float(v) for v, _ in pairs]
    w = np.array([p for _, p in pairs])
    w = w / w.sum()
    got = LL.emax_discrete(np.array([values]), w, n)[0]
    assert got == pytest.approx(_brute_emax(values, list(w), n), rel=1e-9, abs=1e-12)


def _brute_replica(t, bub, q, m, n):
    """E[max over n replicas] of sum t + bub at the longest, every micro-batch sequence enumerated."""
    K = len(q)
    vals, probs = [], []
    for seq in itertools.product(range(K), repeat=m):
        vals.append(sum(t[j] for j in seq) + bub[max(seq)])
        probs.append(math.prod(q[j] for j in seq))
    return _brute_emax(vals, probs, n) if n <= 2 else None, float(np.dot(vals, probs))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 2), st.randoms(use_true_random=False))
def test_replica_padded_exact_vs_enumeration(k, m, n, rnd):
    t = sorted(rnd.uniform(0.1, 5.0) for _ in range(k))
    bub = sorted(rnd.uniform(0.0, 2.0) for _ in range(k))
    q = np.array([rnd.uniform(0.05, 1.0) for _ in range(k)])
    q = q / q.sum()
    emax, mean = LL.replica_padded(np.array([t]), np.array([bub]), q, m, n)
    b_emax, b_mean = _brute_replica(t, bub, list(q), m, n)
    assert mean[0] == pytest.approx(b_mean, rel=1e-9)
    assert emax[0] == pytest.approx(b_emax, rel=1e-9)


def test_mixture_fallback_close_to_exact():
    """Beyond MAX_COMPOSITIONS the normal mixture over the longest micro-batch: within 1% of the
    exact enumeration where both run (m = 40, three lengths)."""
    t = np.array([[0.2, 0.35, 2.2]])
    bub = np.array([[0.1, 0.4, 3.0]])
    q = np.array([0.6, 0.3, 0.1])
    for n in (2, 8, 64):
        exact = LL.replica_padded(t, bub, q, 40, n)[0][0]
        approx = LL.replica_padded(t, bub, q, 40, n, exact_limit=0)[0][0]
        assert approx == pytest.approx(exact, rel=0.01)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.randoms(use_true_random=False))
def test_order_statistics_vs_enumeration(k, n, rnd):
    p = np.array([rnd.uniform(0.05, 1.0) for _ in range(k)])
    p = p / p.sum()
    got = LL.order_stat_pmf(p, n, list(range(1, n + 1)))
    want = np.zeros((n, k))
    for seq in itertools.product(range(k), repeat=n):
        pr = math.prod(p[j] for j in seq)
        for r, j in enumerate(sorted(seq)):
            want[r, j] += pr
    assert np.allclose(got, want, atol=1e-12)


@pytest.mark.slow  # enumerates up to 3^12 sampled batches per example
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 2), st.booleans(), st.randoms(use_true_random=False))
def test_bucketed_vs_enumeration(dp, m, b, with_drain, rnd):
    """The bucketed expected step = the slowest replica's, every sampled batch enumerated (sorted,
    cut into micro-batches of b, micro-batch j to replica j mod dp, ascending within a replica):
    sum t + max(bub, drain) of its last + rest of its last."""
    k = 3
    p = np.array([0.5, 0.3, 0.2])
    t = sorted(rnd.uniform(0.1, 5.0) for _ in range(k))
    bub = sorted(rnd.uniform(0.0, 2.0) for _ in range(k))
    drain = sorted(x + rnd.uniform(0.0, 1.0) for x in bub) if with_drain else None
    z = drain if drain is not None else bub
    rest = sorted(rnd.uniform(0.0, 1.0) for _ in range(k))  # every term grows with the length
    G = dp * m * b
    want = 0.0
    for seq in itertools.product(range(k), repeat=G):
        pr = math.prod(p[j] for j in seq)
        pads = sorted(seq)[b - 1::b]
        reps = [pads[r::dp] for r in range(dp)]
        want += pr * max(sum(t[j] for j in r) + z[r[-1]] + rest[r[-1]] for r in reps)
    got = LL.replica_bucketed(np.array([t]), np.array([bub]), np.array([rest]), p, dp, m, b,
                              None if drain is None else np.array([drain]))[0][0]
    assert got == pytest.approx(want, rel=1e-9)


def test_microbatch_probs_is_the_max_of_b_draws():
    p = [0.6, 0.3, 0.1]
    q = LL.microbatch_probs(p, 2)
    want = np.zeros(3)
    for i, j in itertools.product(range(3), repeat=2):
        want[max(i, j)] += p[i] * p[j]
    assert np.allclose(q, want)


def test_interpolation_exact_at_anchors_and_on_quadratics():
    lengths = list(range(512, 65536 + 1, 1024))
    anchors = LL.anchor_lengths(lengths)
    assert len(anchors) == LL.EXACT_LENGTHS and anchors[0] == lengths[0] and anchors[-1] == lengths[-1]
    W = LL.interpolation(lengths, anchors)
    f = lambda x: 3.0 + 2e-3 * x + 1e-8 * x * x  # noqa: E731
    assert np.allclose(W @ np.array([f(a) for a in anchors]), [f(x) for x in lengths], rtol=1e-9)


VARIABLE = dataclasses.replace(DEFAULT_PARAMS, pipeline_variable_shapes=True)
"""A profile whose pipelines run each micro-batch at its own length (what the stall model prices)."""


# ---- the cost model ------------------------------------------------------------------------------

def test_one_length_equals_the_fixed_length_estimate(problem):
    model, cluster = problem
    plans = _plans()
    fixed = B.estimate_batch(model, cluster, Workload(global_batch=256, seq_len=8192), plans)
    for packing in ("padded", "bucketed", "packed"):
        work = Workload.of(256, LengthDist((8192,), (1.0,), packing))
        got = LL.expected_batch(model, cluster, work, plans)
        for k, v in fixed.items():
            assert np.array_equal(np.asarray(got[k]), np.asarray(v), equal_nan=True), k
        assert not got["imbalance_s"].any()


def test_packed_has_no_imbalance(problem):
    model, cluster = problem
    work = Workload.of(256, parse_lengths(DIST, "packed"))
    got = LL.expected_batch(model, cluster, work, _plans())
    fixed = B.estimate_batch(model, cluster, Workload(global_batch=256, seq_len=32768), _plans())
    assert not got["imbalance_s"].any()
    assert np.array_equal(got["step_time_s"], fixed["step_time_s"])
    assert work.tokens == 256 * 32768


@pytest.mark.parametrize("packing", ["padded", "bucketed"])
def test_expected_at_least_even_load_and_memory_at_the_longest(problem, packing):
    model, cluster = problem
    work = Workload.of(256, parse_lengths(DIST, packing))
    got = LL.expected_batch(model, cluster, work, _plans(), VARIABLE)
    assert (got["step_time_s"] >= got["step_time_even_s"] - 1e-12).all()
    assert (got["imbalance_s"] > 0).all()
    terms = sum(got[f"time.{k}"] for k in B.TIME_KEYS if not k.endswith("_overlapped")) + got["time.imbalance"]
    assert np.allclose(terms, got["step_time_s"])
    longest = B.estimate_batch(model, cluster, Workload(global_batch=256, seq_len=32768), _plans(), VARIABLE)
    assert np.array_equal(got["peak_memory_gib"], longest["peak_memory_gib"])
    assert np.allclose(got["tokens_per_s"], work.tokens / got["step_time_s"])


@pytest.mark.parametrize("packing", ["padded", "bucketed"])
def test_expected_step_grows_with_the_tail(problem, packing):
    model, cluster = problem
    steps = []
    for tail in (0.01, 0.05, 0.1, 0.2, 0.4):
        d = parse_lengths(f"2048:{0.7 * (1 - tail)},8192:{0.3 * (1 - tail)},32768:{tail}", packing)
        steps.append(LL.expected_batch(model, cluster, Workload.of(256, d), _plans(), VARIABLE)["step_time_s"])
    assert (np.diff(np.stack(steps), axis=0) > 0).all()


@pytest.mark.parametrize("packing", ["padded", "bucketed"])
def test_a_pipeline_of_one_shape_is_priced_at_the_longest_length(problem, packing):
    """meshplan's runtime (and the built-in profiles) pad a pipeline's micro-batches to the longest
    length: those rows are the fixed-length estimate there (no imbalance), with real-token
    throughput; without a pipeline nothing changes."""
    model, cluster = problem
    work = Workload.of(256, parse_lengths(DIST, packing))
    plans = _plans()
    got = LL.expected_batch(model, cluster, work, plans)
    var = LL.expected_batch(model, cluster, work, plans, VARIABLE)
    longest = B.estimate_batch(model, cluster, Workload(global_batch=256, seq_len=32768), plans)
    piped = np.asarray([p.pp > 1 for p in plans])
    assert piped.any() and (~piped).any()
    assert np.array_equal(got["step_time_s"][piped], longest["step_time_s"][piped])
    assert not got["imbalance_s"][piped].any()
    assert np.allclose(got["tokens_per_s"], work.tokens / got["step_time_s"])
    assert (got["step_time_s"][piped] > var["step_time_s"][piped]).all()
    assert np.array_equal(got["step_time_s"][~piped], var["step_time_s"][~piped])


def test_bucketing_beats_padding_at_larger_micro_batches(problem):
    model, cluster = problem
    plan = [parse_plan("tp=2,pp=1,dp=32,zero=3,micro_batch=2,sequence_parallel=1,recompute=full")]
    pad, buck = (LL.expected_batch(model, cluster, Workload.of(256, parse_lengths(DIST, k)), plan)
                 for k in ("padded", "bucketed"))
    assert buck["step_time_s"][0] < pad["step_time_s"][0]
    assert buck["padding_fraction"][0] < pad["padding_fraction"][0]


def test_many_lengths_interpolated_close_to_exact(problem, monkeypatch):
    model, cluster = problem
    rng = np.random.default_rng(0)
    lengths = sorted({int(x) for x in rng.lognormal(8.0, 1.0, 400).clip(256, 32768)} | {32768})
    d = LengthDist(tuple(lengths), tuple(float(x) for x in np.full(len(lengths), 1 / len(lengths))), "bucketed")
    plans = _plans()[:2]
    work = Workload.of(256, d)
    approx = LL.expected_batch(model, cluster, work, plans)["step_time_s"]
    monkeypatch.setattr(LL, "EXACT_LENGTHS", 64)
    exact = LL.expected_batch(model, cluster, work, plans)["step_time_s"]
    assert np.allclose(approx, exact, rtol=0.01)


def test_traced_graph_refuses_a_distribution():
    from meshplan.spec.transformer import as_graph
    g = as_graph(load_model("tiny-llama"), 256)
    traced = type(g)(**{**{f: getattr(g, f) for f in g.__dataclass_fields__}, "model": None})
    with pytest.raises(MeshplanError, match="traced"):
        LL.check_model(traced, Workload.of(8, parse_lengths("128:0.5,256:0.5")))
    LL.check_model(traced, Workload.of(8, parse_lengths("128:0.5,256:0.5", "packed")))  # one window length


def test_search_ranks_by_the_expected_step(problem):
    from meshplan.search.driver import search
    from meshplan.search.space import SearchSpace
    model, _ = problem
    cluster = load_cluster("h100-sxm-80gb:8")
    space = SearchSpace()
    work = Workload.of(32, parse_lengths("2048:0.6,8192:0.3,16384:0.1"))
    r = search(model, [cluster], work, space, top=3)
    best = r.plans[0].report
    assert "imbalance" in best.time and best.time["imbalance"] >= 0
    assert [p.report.step_time_s for p in r.plans] == sorted(p.report.step_time_s for p in r.plans)
    again = estimate(model, cluster, r.plans[0].plan, work)
    assert again.step_time_s == pytest.approx(best.step_time_s)


# ---- the CLI -------------------------------------------------------------------------------------

BASE = ["--model", "llama3-8b", "--cluster", "h100-sxm-80gb:64", "--global-batch", "256"]
# The searched winner's shape: a small search, where the plan file is the point.
WINNER = ["--fix", "tp=2,pp=1,cp=4,zero=1,recompute=none,micro_batch=1"]
EST = ["estimate", *BASE, "--plan", PLANS[0]]


def test_cli_estimate_json_and_text(capsys):
    rc, out, _ = run(capsys, *EST, "--seq-len", DIST, "--packing", "bucketed", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["lengths"]["packing"] == "bucketed"
    assert d["time"]["imbalance"] == pytest.approx(d["lengths"]["imbalance_s"])
    assert d["step_time_s"] == pytest.approx(d["lengths"]["expected_step_s"])
    rc, out, _ = run(capsys, *EST, "--seq-len", DIST)
    assert rc == 0 and "lost to imbalance" in out and "length imbalance" in out


def test_cli_histogram_file(tmp_path, capsys):
    f = tmp_path / "lengths.csv"
    f.write_text("length,count\n2048,600\n8192,300\n32768,100\n")
    rc, out, _ = run(capsys, *EST, "--seq-len", str(f), "--json")
    rc2, out2, _ = run(capsys, *EST, "--seq-len", DIST, "--json")
    assert rc == rc2 == 0
    assert json.loads(out)["step_time_s"] == pytest.approx(json.loads(out2)["step_time_s"])


@pytest.mark.parametrize("value,needle", [
    ("2048:abc", "not a number"), ("2048:0,4096:0", "every weight is 0"), ("nope.csv", "no such histogram"),
    ("2048:0.5,x:0.5", "not a whole number"), ("2048", None),
    ("2048:0.6,8192:0.6", "sum to 1.2, not 1"), ("2048:0.5,,8192:0.5", "empty item")])
def test_cli_bad_lengths_one_line(capsys, value, needle):
    if needle is None:  # one length with --packing: a note saying it has no effect (as train says), then the estimate
        rc, out, err = run(capsys, *EST, "--seq-len", value, "--packing", "bucketed")
        assert rc == 0 and "--packing bucketed has no effect with one --seq-len" in err and "step time" in out
        return
    rc, _, err = run(capsys, *EST, "--seq-len", value)
    one_line_error(rc, err, needle)


def test_cli_bad_packing_and_batches(capsys):
    rc, _, err = run(capsys, *EST, "--seq-len", DIST, "--packing", "sorted")
    one_line_error(rc, err, "--packing")
    rc, _, err = run(capsys, "simulate", *BASE, "--plan", PLANS[0], "--seq-len", DIST, "--batches", "0")
    one_line_error(rc, err, "--batches")


def test_cli_plan_out_records_the_distribution(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc, text, _ = run(capsys, "plan", *BASE, "--seq-len", DIST, "--packing", "bucketed", "--top", "2", *WINNER,
                      "--out", str(out))
    assert rc == 0 and "samples of lengths" in text and "lost to imbalance" in text
    doc = json.loads(out.read_text())
    assert doc["seq_len"] == 32768 and doc["lengths"] == parse_lengths(DIST).text() and doc["packing"] == "bucketed"
    rc, est, _ = run(capsys, "estimate", "--plan", str(out), "--json")
    assert rc == 0
    assert json.loads(est)["step_time_s"] == pytest.approx(doc["predicted"]["step_time_s"])


def test_counts_are_normalised_and_rounded_probabilities_pass():
    a = parse_lengths("2048:600,8192:300,32768:100")
    assert a.probs == pytest.approx((0.6, 0.3, 0.1))
    assert sum(parse_lengths("2048:0.333,4096:0.333,8192:0.333").probs) == pytest.approx(1.0)


def test_plan_file_distribution_is_replaced_only_with_override(tmp_path, capsys):
    """A plan file records its length distribution and packing: a different --seq-len DIST or
    --packing is an error unless --override, which says what replaces what."""
    f = tmp_path / "p.json"
    rc, _, _ = run(capsys, "plan", *BASE, "--seq-len", DIST, "--top", "1", *WINNER, "--out", str(f))
    assert rc == 0 and f.exists()
    same = run(capsys, "estimate", "--plan", str(f), "--seq-len", DIST)
    assert same[0] == 0
    rc, _, err = run(capsys, "estimate", "--plan", str(f), "--seq-len", "2048:0.5,32768:0.5")
    one_line_error(rc, err, "disagrees with the plan file's", "--override")
    rc, _, err = run(capsys, "estimate", "--plan", str(f), "--packing", "bucketed")
    one_line_error(rc, err, "--packing bucketed disagrees")
    rc, out, err = run(capsys, "estimate", "--plan", str(f), "--seq-len", "2048:0.5,32768:0.5", "--override")
    assert rc == 0 and "replaces the plan file's" in err and "2048:0.5,32768:0.5" in out


def test_histogram_file_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "h.csv"
    bad.write_text("length,count\n2048,600\n4096,-3\n")
    rc, _, err = run(capsys, *EST, "--seq-len", str(bad))
    one_line_error(rc, err, str(bad), "-3", "fix that row")
    rc, _, err = run(capsys, *EST, "--seq-len", str(tmp_path))
    one_line_error(rc, err, "a directory")


def test_cp_communication_is_shown_when_hidden():
    """Ring attention's all-gathers hidden under attention still appear, as overlapped time."""
    from meshplan.cost import estimate
    r = estimate(load_model("llama3-8b"), load_cluster("h100-sxm-80gb:64"), parse_plan("tp=2,dp=8,cp=4,zero=1"),
                 Workload(global_batch=64, seq_len=32768))
    assert r.time["cp_comm_overlapped"] > 0 and r.time["cp_comm"] >= 0


def test_one_length_does_not_silently_replace_a_plan_files_distribution(tmp_path, capsys):
    f = tmp_path / "p.json"
    assert run(capsys, "plan", *BASE, "--seq-len", DIST, "--top", "1", *WINNER, "--out", str(f))[0] == 0
    rc, _, err = run(capsys, "estimate", "--plan", str(f), "--seq-len", "32768")
    one_line_error(rc, err, "disagrees with the plan file's length distribution", DIST)
