"""Mixed-type groups (issue 26, "What to build" 4): a plan over several pools in device order (neither
pool_dp nor pool_pp, cost.pools.device_order) lays its ranks over the pools' GPUs in turn, so that a
pipeline stage or a data-parallel group may take GPUs of two types. GPU types are emulated by the cost
model and the simulator; nothing here runs on a GPU."""
from __future__ import annotations

import pytest

from meshplan.cost import estimate
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
                                  "tp=2,pp=2,dp=4,zero=1,pools=v100:a100"])
def test_simulator_agrees_with_the_estimate_in_device_order(gpt13, plan):
    c = a100_v100()
    s = simulate_pooled(gpt13, c, parse_plan(plan), W)
    assert s.step_time_s == pytest.approx(s.analytic_step_time_s, rel=0.06)
    e = estimate(gpt13, c, parse_plan(plan), W)
    assert set(e.time) >= {"compute", "dp_comm", "pp_comm", "bubble", "cross_pool", "pool_idle"}
    assert sum(v for k, v in e.time.items() if not k.endswith("_overlapped") and k != "pool_idle") == \
        pytest.approx(e.step_time_s, rel=1e-9)


@pytest.mark.parametrize("plan, words", [
    ("tp=8,pp=2,dp=1,pools=a100:v100", "tensor-parallel group of 8 GPUs spans pools a100 and v100"),
    ("tp=1,pp=2,dp=16,pools=a100:v100", "32 GPUs in device order over pools a100:v100, but they hold 16"),
    ("tp=1,pp=2,dp=4,pools=a100:v100", "fill the pools before v100"),
    ("tp=1,pp=2,dp=8,dp_shares=1:1,pools=a100:v100", "dp_shares with a plan in device order"),
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
