"""Tensor parallelism across nodes is priced, not refused: tp a whole number of nodes is legal
(its all-reduce on the inter-node link), tp that neither divides a node nor tiles whole nodes is
refused with the reason; the search's twin of the check agrees with the scalar one."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost.comm import Group
from meshplan.cost.step import estimate
from meshplan.search.columns import PlanColumns
from meshplan.search.constraints import violation_masks
from meshplan.spec.constraints import violations
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload

CHECK = "tp larger than a node"
MODEL = load_model("llama2-7b")
WORK = Workload(global_batch=8, seq_len=4096)


def _names(cluster: str, plan: Plan) -> set[str]:
    return {n for n, _ in violations(MODEL, load_cluster(cluster), plan, WORK)}


def test_tp_across_two_gpu_nodes_is_legal_and_priced_on_the_inter_node_link() -> None:
    cloud, dense = load_cluster("a100-sxm-80gb:2x2"), load_cluster("a100-sxm-80gb:1x4")
    across = Plan(tp=4, dp=1, zero=1, micro_batch=1)
    assert violations(MODEL, cloud, across, WORK) == []
    # the TP group of 4 spans both 2-GPU nodes: its per-GPU bandwidth is the inter-node link's,
    # below the 2-GPU group's within a node
    g4, g2 = Group.of(cloud, 4, 1), Group.of(cloud, 2, 1)
    assert bool(g4.across_nodes) and not bool(g2.across_nodes)
    assert float(g4.bytes_per_s) < float(g2.bytes_per_s)
    assert float(g4.bytes_per_s) <= cloud.inter_node.bytes_per_s * cloud.gpus_per_node
    assert float(g4.latency_s) > float(g2.latency_s)
    a, b = estimate(MODEL, cloud, across, WORK), estimate(MODEL, dense, across, WORK)
    assert a.time["tp_comm"] > b.time["tp_comm"] > 0
    assert a.step_time_s > b.step_time_s
    assert a.time["compute"] == b.time["compute"]  # the link changes communication only
    # per byte: the 4-way all-reduce moves 2*3/4 of the bytes per GPU, the 2-way 2*1/2
    within = estimate(MODEL, cloud, Plan(tp=2, dp=2, zero=1, micro_batch=1), WORK)
    bytes4, bytes2 = 2 * 3 / 4 / 4, 2 * 1 / 2 / 2  # ring factor x a rank's 1/tp share of the activations
    assert a.time["tp_comm"] / bytes4 > within.time["tp_comm"] / bytes2


def test_tp_that_does_not_tile_nodes_is_refused_with_the_reason() -> None:
    bad = violations(MODEL, load_cluster("a100-sxm-80gb:3x4"), Plan(tp=6, dp=2), Workload(global_batch=8,
                                                                                             seq_len=4096))
    reasons = dict(bad)
    # tp=6 divides no layer width of llama2-7b either; the node rule says its own words
    assert "not a whole number of nodes" in reasons[CHECK] and "multiple of 4" in reasons[CHECK]
    assert CHECK in _names("a100-sxm-80gb:1x6", Plan(tp=4, dp=1, micro_batch=1))
    assert CHECK not in _names("a100-sxm-80gb:2x8", Plan(tp=16, dp=1, micro_batch=1))
    assert CHECK not in _names("a100-sxm-80gb:4x2", Plan(tp=8, dp=1, micro_batch=1))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 6, 8]), st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]))
def test_search_twin_equals_the_scalar_check(per_node: int, tp: int) -> None:
    nodes = max(1, -(-tp // per_node)) * 2
    cluster = load_cluster(f"a100-sxm-80gb:{nodes}x{per_node}")
    n = cluster.num_gpus
    plan = Plan(tp=tp, dp=max(1, n // tp), micro_batch=1)
    work = Workload(global_batch=max(1, n // tp) * 2, seq_len=4096)
    scalar = CHECK in {k for k, _ in violations(MODEL, cluster, plan, work)}
    vec = bool(violation_masks(MODEL, cluster, work, PlanColumns.from_plans([plan]))[CHECK][0])
    assert scalar == vec == (per_node % tp != 0 and tp % per_node != 0)
