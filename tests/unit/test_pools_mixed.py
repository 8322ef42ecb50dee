"""Mixed-type groups (issue 26, "What to build" 4): a plan over several pools in device order (neither
pool_dp nor pool_pp, cost.pools.device_order) lays its ranks over the pools' GPUs in turn, so that a
pipeline stage or a data-parallel group may take GPUs of two types. GPU types are emulated by the cost
model and the simulator; nothing here runs on a GPU."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost import estimate
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.pools import device_layout, device_order, pool_cluster
from meshplan.errors import MeshplanError
from meshplan.search import search
from meshplan.search.pools import MIXED
from meshplan.sim.pools import simulate_pooled
from meshplan.spec.io import cluster_from_dict, load_model
from meshplan.spec.plan import Workload, parse_plan

W = Workload(global_batch=64, seq_len=2048)


def a100_v100(inter: float | None = None):
    d = {"name": "a100-v100", "pools": [
        {"name": "a100", "gpu": "a100-sxm-80gb", "num_nodes": 3, "gpus_per_node": 4},
        {"name": "v100", "gpu": "v100-sxm-32gb", "num_nodes": 1, "gpus_per_node": 4}]}
    if inter is not None:
        d["inter_pool"] = {"bandwidth_gbps": inter}
    return cluster_from_dict(d)


@pytest.fixture(scope="module")
def gpt13():
    return load_model("gpt3-1.3b")


def test_plan_without_pool_dp_or_pool_pp_is_device_order():
    plan = parse_plan("pp=2,dp=8,pools=a100:v100")
    assert device_order(plan) and not device_order(parse_plan("pp=2,dp=8,pools=a100:v100,pool_pp=1:1"))
    lay = device_layout(list(a100_v100().pools), plan)
    assert lay.gpus == (12, 4) and sum(lay.gpus) == plan.num_gpus
    assert lay.touched == ((0,), (0, 1)) and lay.dp_counts == ((8,), (4, 4)) and lay.crossing == (True,)


def test_stage_spanning_types_runs_at_its_slowest_member(gpt13):
    c = a100_v100()
    mixed = estimate(gpt13, c, parse_plan("tp=1,pp=2,dp=8,zero=1,pools=a100:v100"), W)
    assert mixed.fits and sum(p.gpus for p in mixed.parts) == 16
    assert [p.gpus for p in mixed.parts] == [12, 4]
    allfast = estimate(gpt13, pool_cluster(c.pool("a100"), 16), parse_plan("tp=1,pp=2,dp=8,zero=1"), W)
    allslow = estimate(gpt13, pool_cluster(c.pool("v100"), 16), parse_plan("tp=1,pp=2,dp=8,zero=1"), W)
    assert mixed.step_time_s > allfast.step_time_s  # the V100s slow stage 1 down
    assert mixed.step_time_s < allslow.step_time_s + mixed.cross_pool_s  # stage 0 runs on A100 only
    assert "stages timed on: 1: v100" in " ".join(mixed.notes)
    # the data-parallel group of stage 1 spans the pools: its exchange across them is priced
    assert mixed.cross_pool_s > 0
    slow = estimate(gpt13, a100_v100(inter=0.5), parse_plan("tp=1,pp=2,dp=8,zero=1,pools=a100:v100"), W)
    assert slow.step_time_s > mixed.step_time_s


def test_device_order_with_stages_aligned_to_pools_is_the_pool_pp_plan(gpt13):
    """Stages whose GPUs each lie in one pool: device order is the pool_pp plan (estimate and simulator)."""
    c = a100_v100()
    a = estimate(gpt13, c, parse_plan("tp=1,pp=4,dp=4,zero=1,stage_layers=8:8:6:2,pools=a100:v100"), W)
    b = estimate(gpt13, c, parse_plan("tp=1,pp=4,dp=4,zero=1,stage_layers=8:8:6:2,pools=a100:v100,pool_pp=3:1"), W)
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    assert a.peak_memory_gib == pytest.approx(b.peak_memory_gib, rel=1e-12)


@pytest.mark.parametrize("plan", ["tp=1,pp=2,dp=8,zero=1,pools=a100:v100", "tp=1,pp=1,dp=16,pools=a100:v100",
                                  "tp=2,pp=2,dp=4,zero=1,pools=v100:a100",
                                  # uneven shares: one pipeline per class of replicas, the longest sets the step
                                  "tp=1,pp=2,dp=8,zero=1,dp_shares=3:1,pools=a100:v100",
                                  "tp=1,pp=2,dp=8,zero=3,dp_shares=5:3,pools=a100:v100",
                                  "tp=1,pp=1,dp=16,dp_shares=3:1,pools=a100:v100",
                                  # tensor-parallel groups across pools (stage 1's 8 GPUs: 4 A100 + 4 V100)
                                  "tp=8,pp=2,dp=1,pools=a100:v100", "tp=8,pp=2,dp=1,dp_shares=1,pools=v100:a100"])
def test_simulator_agrees_with_the_estimate_in_device_order(gpt13, plan):
    c = a100_v100()
    s = simulate_pooled(gpt13, c, parse_plan(plan), W)
    assert s.step_time_s == pytest.approx(s.analytic_step_time_s, rel=0.06)
    e = estimate(gpt13, c, parse_plan(plan), W)
    assert set(e.time) >= {"compute", "dp_comm", "pp_comm", "bubble", "cross_pool", "pool_idle"}
    assert sum(v for k, v in e.time.items() if not k.endswith("_overlapped") and k != "pool_idle") == \
        pytest.approx(e.step_time_s, rel=1e-9)


@pytest.mark.parametrize("plan, words", [
    ("tp=1,pp=2,dp=16,pools=a100:v100", "32 GPUs in device order over pools a100:v100, but they hold 16"),
    ("tp=1,pp=2,dp=4,pools=a100:v100", "fill the pools before v100"),
    ("tp=1,pp=2,dp=8,dp_shares=3:1,pools=a100:v100,micro_batch=3", "does not split"),
    ("tp=1,pp=2,dp=8,virtual_stages=2,schedule=interleaved-1f1b,pools=a100:v100", "one stage per rank"),
])
def test_what_device_order_does_not_support_is_a_clear_error(gpt13, plan, words):
    with pytest.raises(MeshplanError, match=words):
        estimate(gpt13, a100_v100(), parse_plan(plan), W)


def test_search_tries_mixed_stages_where_pools_alone_cannot_use_every_gpu(gpt13):
    """12 A100 + 4 V100: pp=2, dp=8 needs a stage of 4 A100 and 4 V100 (no pool_pp or pool_dp plan has it)."""
    r = search(gpt13, a100_v100(), W)
    e = r.best_by_kind.get(MIXED)
    assert e is not None and device_order(e.plan) and e.fits
    assert e.num_gpus == 16 and (e.plan.pp, e.plan.dp) == (2, 8)
    assert any(MIXED in line for line in r.explanation)


# ---- uneven shares in device order, and groups spanning pools (issue 26) ----------------------------------------
def test_dp_shares_in_device_order_give_the_replicas_with_a_v100_a_smaller_share(gpt13):
    """tp=1,pp=2,dp=8 on 12 A100 + 4 V100: replicas 4-7 run stage 1 on a V100. With dp_shares=3:1 (replicas 0-3 take 3
    shares each, 4-7 one) each class of replicas runs its own pipeline and the V100 no longer paces the whole step."""
    c = a100_v100()
    even = estimate(gpt13, c, parse_plan("tp=1,pp=2,dp=8,zero=1,pools=a100:v100"), W)
    shared = estimate(gpt13, c, parse_plan("tp=1,pp=2,dp=8,zero=1,dp_shares=3:1,pools=a100:v100"), W)
    assert shared.fits and shared.step_time_s < 0.8 * even.step_time_s
    assert any("replicas 0-3: 12 micro-batches" in n and "replicas 4-7: 4 micro-batches" in n for n in shared.notes)
    # each class priced alone: its step is the class's pipeline (cost.pools.class_step), the longest sets the step
    from meshplan.cost.pools import class_step
    plan = parse_plan("tp=1,pp=2,dp=8,zero=1,pools=a100:v100")
    fast, slow = (class_step(gpt13, c, plan, W, DEFAULT_PARAMS, r, m)
                  for r, m in (((0, 1, 2, 3), 12), ((4, 5, 6, 7), 4)))
    assert shared.step_time_s == pytest.approx(max(fast, slow), rel=1e-12)
    assert slow > fast  # the V100 class still sets the step at 3:1
    # the throughput counts the whole batch
    assert shared.tokens_per_s == pytest.approx(W.tokens / shared.step_time_s)


def test_search_deals_device_order_micro_batches_by_speed(gpt13):
    """The search's device-order plans get shares by the rule of replicas on pools (search.pools._split_by_speed):
    the replicas with a V100 take fewer micro-batches, and the plan beats the same plan with even shares."""
    from meshplan.cost.pools import replica_samples
    r = search(gpt13, a100_v100(), W)
    e = r.best_by_kind[MIXED]
    assert e.plan.dp_shares is not None
    samples = replica_samples(e.plan, W.global_batch)
    assert sum(samples) == W.global_batch
    lay = device_layout(list(a100_v100().pools), e.plan)
    slow = [d for d in range(e.plan.dp) if any(1 in g[d] for g in lay.groups)]
    fast = [d for d in range(e.plan.dp) if d not in slow]
    assert slow and fast and max(samples[d] for d in slow) < min(samples[d] for d in fast)
    even = estimate(gpt13, a100_v100(), e.plan.replace(dp_shares=None), W)
    assert e.step_time_s < even.step_time_s


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2), st.floats(0.0, 1.0), st.floats(0.01, 1.0), st.floats(0.0, 1.0),
       st.floats(0.001, 1.0), st.integers(8, 64))
def test_split_by_speed_sums_to_the_batch_and_never_gives_a_slower_class_more(n_slow, k, a_extra, b_fast, a_fast,
                                                                             b_extra, M):
    """The rule that deals micro-batches by speed (replicas on pools and device order alike): the classes' micro-batches
    add up to the step's, and a class that is slower (no smaller fixed time, a larger time per micro-batch) never gets
    more per replica wherever some split allows that, when the slower class's replica count divides the faster's (whole
    micro-batches otherwise can force it: 10 slow replicas and 1 fast one with 21 micro-batches)."""
    from meshplan.search.pools import _split_by_speed
    n = [n_slow, n_slow * (k + 1)]
    lines = [(a_fast + a_extra, b_fast + b_extra), (a_fast, b_fast)]
    split = _split_by_speed(n, M, lambda i, m: lines[i][0] + lines[i][1] * m)
    if split is None:
        assert sum(n) > M or all((M - n[0] * m0) % n[1] or M - n[0] * m0 < n[1] for m0 in range(1, M // n[0] + 1))
        return
    assert sum(a * b for a, b in zip(n, split)) == M and min(split) >= 1
    feasible = [(m0, (M - n[0] * m0) // n[1]) for m0 in range(1, M // n[0] + 1)
                if (M - n[0] * m0) % n[1] == 0 and M - n[0] * m0 >= n[1]]
    if any(m0 <= m1 for m0, m1 in feasible):  # (else whole micro-batches leave no choice)
        assert split[0] <= split[1]


def test_block_shares_are_the_fewest_equal_blocks():
    from meshplan.search.pools import block_shares
    assert block_shares([6, 6, 6, 6, 2, 2, 2, 2]) == (3, 1)
    assert block_shares([4, 4, 4, 4]) == (1,)
    assert block_shares([3, 1, 3, 1]) == (3, 1, 3, 1)
    assert parse_plan("dp=8,dp_shares=3:1").replica_shares == (3, 3, 3, 3, 1, 1, 1, 1)


def test_tensor_parallel_group_across_pools_is_priced(gpt13):
    """tp=8,pp=2,dp=1 on 12 A100 + 4 V100: stage 1's tensor-parallel group has 4 A100 and 4 V100 (was refused). It is
    timed on the V100 with its collectives on inter_pool: slower than with the group on fast links, and the slower
    the inter-pool link the slower the step."""
    c = a100_v100()
    e = estimate(gpt13, c, parse_plan("tp=8,pp=2,dp=1,pools=a100:v100"), W)
    assert e.fits and [p.gpus for p in e.parts] == [12, 4]
    assert any("v100 across a100+v100" in n for n in e.notes)
    assert any("tensor/context-parallel groups across pools in stage 1" in p.role for p in e.parts)
    slower = estimate(gpt13, a100_v100(inter=1.0), parse_plan("tp=8,pp=2,dp=1,pools=a100:v100"), W)
    assert slower.step_time_s > e.step_time_s
    # memory on the smallest GPU: the V100 pool's part is checked against its 32 GB
    assert e.parts[1].usable_memory_gib < e.parts[0].usable_memory_gib


def _two_by_two(inter_gbps: float, latency_us: float):
    """6 A100 (3 nodes of 2) + 2 V100 (1 node of 2): tp=4,dp=2 in device order puts 2 A100 and 2 V100 in replica 1."""
    return cluster_from_dict({"name": "a100-v100-small", "pools": [
        {"name": "a100", "gpu": "a100-sxm-80gb", "num_nodes": 3, "gpus_per_node": 2},
        {"name": "v100", "gpu": "v100-sxm-32gb", "num_nodes": 1, "gpus_per_node": 2}],
        "inter_pool": {"bandwidth_gbps": inter_gbps, "latency_us": latency_us}})


@settings(max_examples=12, deadline=None)
@given(st.floats(0.2, 400.0), st.floats(0.0, 50.0), st.sampled_from(["tp=4,dp=2", "tp=2,cp=2,dp=2"]))
def test_group_across_pools_is_never_faster_than_its_slowest_member_and_link(gpt13, gbps, lat, shape):
    """A tensor- (or context-) parallel group spanning pools is never faster than its slowest GPU on its own links, nor
    than its slowest GPU with every collective on the inter-pool link (the slowest link it crosses)."""
    from meshplan.cost import estimate as est_
    c = _two_by_two(gbps, lat)
    plan = parse_plan(f"{shape},zero=1,pools=a100:v100")
    lay = device_layout(list(c.pools), plan)
    assert any(len(g) > 1 for g in lay.groups[0])
    e = est_(gpt13, c, plan, W)
    flat = parse_plan(f"{shape},zero=1")
    v100 = pool_cluster(c.pool("v100"), 8)
    own = est_(gpt13, v100, flat, W).step_time_s
    link = c.inter_pool
    on_link = est_(gpt13, v100.replace(intra_node=dataclasses.replace(link, name="intra_node"),
                                        inter_node=dataclasses.replace(link, name="inter_node")), flat, W).step_time_s
    assert e.step_time_s >= own * (1 - 1e-9)
    assert e.step_time_s >= on_link * (1 - 1e-9)


def test_the_docs_a100_v100_example_prices_shares_and_a_group_across_pools():
    """docs/examples/a100-v100-pools.toml (docs/heterogeneous-hardware.md, Measured): tp=16,pp=2 puts stage 1's
    tensor-parallel group on 8 A100 and 8 V100; dp_shares=3:1 beats even shares for pp=2,dp=16."""
    from pathlib import Path

    from meshplan.spec.io import load_cluster
    c = load_cluster(str(Path(__file__).resolve().parents[2] / "docs" / "examples" / "a100-v100-pools.toml"))
    m, w = load_model("gpt3-2.7b"), Workload(global_batch=256, seq_len=2048)
    lay = device_layout(list(c.pools), parse_plan("tp=16,pp=2,dp=1,pools=a100:v100"))
    assert lay.groups == (((0,),), ((0, 1),))
    tp = simulate_pooled(m, c, parse_plan("tp=16,pp=2,dp=1,micro_batch=2,pools=a100:v100"), w)
    assert tp.step_time_s == pytest.approx(tp.analytic_step_time_s, rel=0.02)
    even = estimate(m, c, parse_plan("tp=1,pp=2,dp=16,zero=1,micro_batch=2,pools=a100:v100"), w)
    shared = simulate_pooled(m, c, parse_plan("tp=1,pp=2,dp=16,zero=1,micro_batch=2,dp_shares=3:1,pools=a100:v100"), w)
    assert shared.step_time_s == pytest.approx(shared.analytic_step_time_s, rel=0.02)
    assert shared.analytic_step_time_s < 0.6 * even.step_time_s
