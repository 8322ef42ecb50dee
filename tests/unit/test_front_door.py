"""cost.estimate and sim.simulate: one entry point each, for any cluster (one pool or several), any
workload (one length or a distribution) and any plan, and the combinations they price and simulate
(pools under a length distribution, a pipeline over pools under one, a bucket plan on pools)."""
from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.cost import PooledEstimate, estimate, estimate_batch
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.pools import pool_cluster
from meshplan.errors import MeshplanError
from meshplan.sim import simulate
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.lengths import parse_lengths
from meshplan.spec.plan import Workload, parse_plan
from tests.unit.clirun import run

POOLS = str(Path(__file__).resolve().parents[2] / "docs/examples/a100-h100-pools.toml")
DIST = "2048:0.6,8192:0.3,32768:0.1"
VARIABLE = DEFAULT_PARAMS.replace(pipeline_variable_shapes=True)


@pytest.fixture(scope="module")
def model():
    return load_model("llama3-8b")


@pytest.fixture(scope="module")
def pooled():
    return load_cluster(POOLS)


def test_a_cluster_of_one_gpu_type_is_one_pool():
    c = load_cluster("h100-sxm-80gb:16")
    assert c.pools == (c,) and c.names == (c.name,) and c.inter_pool is None and c.pool("anything") is c
    assert len(load_cluster(POOLS).pools) == 2


def test_a_plan_on_one_pool_of_several_prices_as_that_pool_alone(model, pooled):
    """pools=h100 on the pooled cluster: its one part is the plain estimate on the GPUs it uses."""
    plan = parse_plan("tp=2,dp=8,zero=1,micro_batch=1,pools=h100")
    for work in (Workload(global_batch=64, seq_len=4096), Workload.of(64, parse_lengths(DIST))):
        e = estimate(model, pooled, plan, work)
        assert isinstance(e, PooledEstimate) and len(e.parts) == 1
        alone = estimate(model, pool_cluster(pooled.pool("h100"), 16), plan.replace(pools=None), work)
        assert e.step_time_s == alone.step_time_s and e.parts[0].peak_memory_gib == alone.peak_memory_gib


def test_estimate_batch_is_estimate_row_by_row(model):
    """The vectorised entry takes one length, a distribution or bucket plans, and agrees with estimate."""
    c = load_cluster("h100-sxm-80gb:16")
    plans = [parse_plan(p) for p in ("dp=16,zero=3,micro_batch=1", "tp=2,dp=8,zero=1,micro_batch=2",
                                     "tp=2,pp=2,dp=4,micro_batch=1")]
    buckets = [parse_plan(p) for p in ("dp=4,cp=4,zero=1,buckets=2048x8cp1:8192x2cp1:32768x1cp4",
                                       "dp=8,cp=2,zero=1,buckets=8192x2cp1:32768x1cp2")]
    for work, rows in ((Workload(global_batch=256, seq_len=8192), plans),
                       (Workload.of(256, parse_lengths(DIST)), plans),
                       (Workload.of(256, parse_lengths(DIST)), buckets)):
        r = estimate_batch(model, c, work, rows)
        for i, p in enumerate(rows):
            assert r["step_time_s"][i] == pytest.approx(estimate(model, c, p, work).step_time_s, rel=1e-9)
    with pytest.raises(MeshplanError, match="mixes bucket plans"):
        estimate_batch(model, c, Workload.of(256, parse_lengths(DIST)), [plans[0], buckets[0]])


# ---- a pipeline over pools under a length distribution --------------------------------------------

PIPE = "tp=4,pp=4,dp=4,micro_batch=1,pools=h100:a100,pool_pp=2:2"


def test_pipeline_over_pools_under_a_distribution_pads_to_the_longest(model, pooled):
    """A pipeline runs one micro-batch shape (the runtime's schedules): the expected step is the step
    at the longest length; throughput and MFU count the real tokens."""
    plan = parse_plan(PIPE)
    work = Workload.of(256, parse_lengths(DIST))
    e = estimate(model, pooled, plan, work)
    longest = estimate(model, pooled, plan, Workload(global_batch=256, seq_len=32768))
    assert e.step_time_s == pytest.approx(longest.step_time_s, rel=1e-9)
    assert e.tokens_per_s == pytest.approx(work.tokens / e.step_time_s)
    assert e.mfu < longest.mfu  # padding is not useful work
    assert [p.peak_memory_gib for p in e.parts] == pytest.approx([p.peak_memory_gib for p in longest.parts])


def test_pipeline_over_pools_of_variable_shapes_is_between_the_mean_and_the_longest(model, pooled):
    plan = parse_plan(PIPE)
    work = Workload.of(256, parse_lengths(DIST))
    e = estimate(model, pooled, plan, work, VARIABLE)
    longest = estimate(model, pooled, plan, Workload(global_batch=256, seq_len=32768), VARIABLE)
    short = estimate(model, pooled, plan, Workload(global_batch=256, seq_len=2048), VARIABLE)
    assert short.step_time_s < e.step_time_s < longest.step_time_s
    assert all(0 < p.busy_fraction <= 1 + 1e-9 for p in e.parts)


def test_pipeline_over_pools_simulated_under_a_distribution(model, pooled):
    plan = parse_plan(PIPE)
    work = Workload.of(256, parse_lengths(DIST))
    res, s = simulate(model, pooled, plan, work, batches=5)
    e = estimate(model, pooled, plan, work)
    assert s["analytic_step_time_s"] == e.step_time_s
    assert s["step_time_s"] == pytest.approx(e.step_time_s, rel=0.05)
    assert [p["pool"] for p in s["pools"]] == ["h100", "a100"] and res.pp == 4


# ---- replicas on pools under a length distribution, simulated ----------------------------------------

def test_replicas_on_pools_simulated_under_a_distribution(model, pooled):
    plan = parse_plan("tp=2,dp=8,zero=1,micro_batch=1,pools=h100:a100,pool_dp=4:4")
    work = Workload.of(256, parse_lengths(DIST))
    res, s = simulate(model, pooled, plan, work, batches=40, seed=1)
    e = estimate(model, pooled, plan, work)
    assert s["analytic_step_time_s"] == e.step_time_s and s["cross_pool_s"] == e.cross_pool_s
    assert s["step_time_s"] == pytest.approx(e.step_time_s, rel=0.05)  # the varlen tolerance (40 draws)
    assert all(0 < p["utilisation"] <= 1 for p in s["pools"])
    slowest = max(p.step_s for p in e.parts)
    assert e.step_time_s == pytest.approx(slowest + e.cross_pool_s)


def test_uneven_shares_on_one_gpu_type_simulated_under_a_distribution(model):
    c = load_cluster("h100-sxm-80gb:8")
    plan = parse_plan("dp=8,zero=1,micro_batch=2,dp_shares=3:1")
    work = Workload.of(64, parse_lengths(DIST))
    _, s = simulate(model, c, plan, work, batches=40, seed=1)
    e = estimate(model, c, plan, work)
    assert s["analytic_step_time_s"] == pytest.approx(e.step_time_s, rel=1e-9)
    assert s["step_time_s"] == pytest.approx(e.step_time_s, rel=0.1)


def test_a_one_pool_plan_under_a_distribution_simulates_on_that_pool(model, pooled):
    plan = parse_plan("tp=2,dp=32,zero=1,micro_batch=1,pools=h100")
    work = Workload.of(64, parse_lengths(DIST))
    _, s = simulate(model, pooled, plan, work, batches=5)
    _, alone = simulate(model, pooled.pool("h100"), plan.replace(pools=None), work, batches=5)
    assert "pools" not in s and s["step_time_s"] == alone["step_time_s"]


# ---- a bucket plan on pools ------------------------------------------------------------------------

BUCKETS = "dp=8,cp=4,zero=1,pools=h100:a100,pool_dp=4:4,buckets=2048x8cp1:8192x2cp1:32768x1cp4"


def test_a_bucket_plan_per_pool(model, pooled):
    """pool_dp with buckets: each pool's replicas run the bucket plan on that pool's share of the batch."""
    plan = parse_plan(BUCKETS)
    work = Workload.of(256, parse_lengths(DIST))
    e = estimate(model, pooled, plan, work)
    for part, name in zip(e.parts, ("h100", "a100")):
        alone = estimate(model, pool_cluster(pooled.pool(name), 16),
                         plan.replace(pools=None, pool_dp=None, dp=4), Workload.of(128, parse_lengths(DIST)))
        assert part.step_s == alone.step_time_s and "data-aware plan" in part.role
    assert e.parts[0].step_s < e.parts[1].step_s  # the H100 pool is faster
    _, s = simulate(model, pooled, plan, work, batches=20, seed=2)
    assert s["step_time_s"] == pytest.approx(e.step_time_s, rel=0.05)


def test_buckets_refuse_fixed_shares_with_the_reason():
    with pytest.raises(MeshplanError, match="deals each step's samples to its ranks by length"):
        parse_plan("dp=8,cp=4,dp_shares=3:1,buckets=2048x8cp1:32768x1cp4")
    with pytest.raises(MeshplanError, match="a pipeline needs one micro-batch shape"):
        parse_plan("pp=2,dp=4,pools=h100:a100,pool_pp=1:1,buckets=2048x8cp1:32768x1cp1")


def test_cli_estimates_and_simulates_the_new_combinations(capsys):
    base = ["--model", "llama3-8b", "--cluster", POOLS, "--global-batch", "256", "--seq-len", DIST]
    rc, out, _ = run(capsys, "estimate", *base, "--plan", PIPE)
    assert rc == 0 and "pool h100" in out and "pool a100" in out
    rc, out, _ = run(capsys, "simulate", *base, "--plan", BUCKETS, "--batches", "3")
    assert rc == 0 and "simulated step" in out and "a100" in out
