"""The plan search on a general layer graph (search/graph.py): the dynamic-programming stage split
against brute force, TP only at the degrees the layers allow, every row priced as estimate_graph
prices it, the infeasible case's messages, and the plan views printing the result."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from meshplan.cli.plan_cmd import _text
from meshplan.cost.graph import estimate_graph, graph_arrays, graph_violations, graph_workload, layer_costs
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.errors import MeshplanError
from meshplan.search.constraints import AT_RISK, OUT_OF_MEMORY
from meshplan.search.explain import explain
from meshplan.search.graph import REASONS, GraphSpace, _scan, balanced_split, row_plan, search_graph
from meshplan.search.stages import stage_cost_max
from meshplan.spec.cluster import ClusterSpec, LinkTier
from meshplan.spec.graph import LayerGraph, LayerSpec
from meshplan.spec.io import load_cluster, load_gpu
from meshplan.spec.plan import Plan, Workload
from meshplan.spec.support import RULES, microbatches, runtime_violations

S = 512


def cluster(gpn: int = 8, nodes: int = 1, gpu: str = "h100-sxm-80gb") -> ClusterSpec:
    return ClusterSpec(
        name="hand", gpu=load_gpu(gpu), num_nodes=nodes, gpus_per_node=gpn,
        intra_node=LinkTier(name="intra_node", bandwidth_gbps=400.0, latency_us=2.0, efficiency=0.75),
        inter_node=LinkTier(name="inter_node", bandwidth_gbps=25.0, latency_us=10.0, efficiency=1.0))


def layer(name: str, params: int, *, kind: str = "block", tp_max: int = 8, tp: bool = True,
          out: float = 2.0 * S * 1024) -> LayerSpec:
    return LayerSpec(name=name, kind=kind, block=name, params=params, fwd_flops=2.0 * S * params,
                     bwd_flops=4.0 * S * params, saved_bytes=12.0 * S * 1024, output_bytes=out,
                     tp_style="megatron" if tp else "none", tp_fraction=0.98 if tp else 0.0,
                     tp_max=tp_max if tp else 1, tp_allreduces=2 if tp else 0,
                     extra={"gemm_dim": 2048.0, "mem_bytes": 8.0 * S * 1024})


def unequal_graph(tp_max: int = 8, sizes: tuple[int, ...] = (30, 10, 50, 20, 20, 70, 10)) -> LayerGraph:
    """Embedding, seven blocks of unequal size (millions of parameters) and a heavy head."""
    layers = [layer("emb", 5_000_000, kind="embedding", tp=False)]
    layers += [layer(f"b{i}", m * 1_000_000, tp_max=tp_max) for i, m in enumerate(sizes)]
    layers.append(layer("head", 60_000_000, kind="head", tp_max=tp_max))
    return LayerGraph(name="unequal", source="test", sample_tokens=S, trace_dtype="bfloat16", layers=tuple(layers))


def fixed_space(**kw: object) -> GraphSpace:
    d: dict[str, object] = {"tp": (1,), "zero": (0,), "micro_batch": (1,), "schedules": ("1f1b",),
                            "recompute": ("none",), "hybrid_nodes": (), "offload": False}
    return GraphSpace(**(d | kw))  # type: ignore[arg-type]


# ======================================================================================
# stage split

def compositions(n: int, k: int) -> list[tuple[int, ...]]:
    return [tuple(b - a for a, b in zip((0, *cuts), (*cuts, n))) for cuts in itertools.combinations(range(1, n), k - 1)]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_dp_split_equals_brute_force_on_unequal_layers(pp):
    g = unequal_graph()
    c = cluster(gpn=pp)
    w = graph_workload(g, 8)
    # The stage-cost minimiser: the split with the least slowest stage, embeddings first, head last.
    ga = graph_arrays(g)
    lc = layer_costs(g, ga, c, 1, 1, "bf16", False)
    t = lc.f + lc.b
    split = balanced_split(ga, t, pp, lc.loss_s)
    best = min(stage_cost_max(t, s, 0.0, lc.loss_s) for s in compositions(g.num_layers, pp))
    assert stage_cost_max(t, split, 0.0, lc.loss_s) == pytest.approx(best, rel=1e-12)
    # The search's plan (DP split) is the fastest of every split estimate_graph accepts: all
    # boundaries send the same bytes, so the step time orders splits like their slowest stage.
    res = search_graph(g, c, w, fixed_space(pp=(pp,)), top=1)
    times = []
    for s in compositions(g.num_layers, pp):
        plan = Plan(pp=pp, dp=1, stage_layers=s)
        if not graph_violations(g, c, plan, w):
            times.append(estimate_graph(g, c, plan, w).step_time_s)
    assert res.best is not None and res.best.plan.stage_layers == split
    assert res.best.report.step_time_s == pytest.approx(min(times), rel=1e-12)
    assert len(set(split)) > 1  # unequal layers: an uneven split


def test_split_keeps_embeddings_first_and_heads_last():
    g = unequal_graph()
    ga = graph_arrays(g)
    costs = np.ones(g.num_layers)
    costs[0] = 100.0  # a heavy embedding still cannot leave the first stage ...
    split = balanced_split(ga, costs, 3)
    assert split[0] >= 1 and split[-1] >= 1 and sum(split) == g.num_layers
    assert balanced_split(ga, costs, 8) is None  # ... and each stage needs a free layer: 7 blocks < 8


# ======================================================================================
# tensor parallel only where the layers allow it

def test_tp_limited_to_the_degrees_the_layers_allow():
    g = unequal_graph(tp_max=2)
    c = cluster(gpn=8)
    w = graph_workload(g, 16)
    res = search_graph(g, c, w, GraphSpace(schedules=("1f1b",), max_virtual_stages=1), top=50)
    assert res.feasible > 0
    assert {p.plan.tp for p in res.plans} <= {1, 2} and {p.plan.tp for p in res.pareto} <= {1, 2}
    assert any(p.plan.tp == 2 for p in res.pareto) or any(p.plan.tp == 2 for p in res.plans)
    scan = _scan(g, graph_arrays(g), c, w, GraphSpace(), DEFAULT_PARAMS)
    assert {r[0] for r in scan.rows} == {1, 2}
    forced = search_graph(g, c, w, GraphSpace(tp=(1, 2, 4), schedules=("1f1b",)), top=3)
    assert forced.rejected["tp not allowed by the layers"] > 0
    assert "use tp in 1, 2" in forced.reject_examples["tp not allowed by the layers"]


def test_no_tp_able_layer_means_tp_1():
    layers = tuple(layer(f"b{i}", 10_000_000, tp=False) for i in range(4))
    g = LayerGraph(name="cnn", source="test", sample_tokens=S, layers=layers)
    res = search_graph(g, cluster(gpn=4), graph_workload(g, 8), GraphSpace(schedules=("1f1b",)))
    assert res.feasible > 0 and {p.plan.tp for p in res.plans} == {1}


# ======================================================================================
# the search prices rows as estimate_graph does, and counts every rejection

def test_rows_are_priced_and_rejected_as_estimate_graph_says():
    g = unequal_graph(sizes=(600, 200, 1000, 400, 400, 1400, 200))  # 4.3B parameters: ZeRO-0 does not fit
    c = cluster(gpn=8, gpu="a100-sxm-40gb")
    w = graph_workload(g, 32)
    scan = _scan(g, graph_arrays(g), c, w, GraphSpace(max_virtual_stages=2), DEFAULT_PARAMS)
    reason, step, peak = scan.arrays()
    assert (reason == -1).any() and (reason == REASONS.index(OUT_OF_MEMORY)).any()
    for i in np.random.default_rng(0).choice(len(scan.rows), size=150, replace=False):
        plan = row_plan(GraphSpace().base, scan.rows[i])
        name = REASONS[reason[i]] if reason[i] >= 0 else None
        bad = graph_violations(g, c, plan, w)
        if bad:
            assert name == bad[0][0]
        elif name in RULES:  # the runtime's rules (spec.support), the first one the plan violates
            assert runtime_violations(plan, microbatches(plan, w.global_batch))[0][0].name == name
        else:
            assert not runtime_violations(plan, microbatches(plan, w.global_batch))
            r = estimate_graph(g, c, plan, w)
            assert r.step_time_s == pytest.approx(step[i], rel=1e-12)
            assert r.peak_memory_gib == pytest.approx(peak[i], rel=1e-12)
            assert (r.fits and not r.at_risk) == (name is None)
            assert r.at_risk == (name == AT_RISK)
    res = search_graph(g, c, w, GraphSpace(max_virtual_stages=2), top=5)
    assert sum(res.rejected.values()) == res.considered - res.feasible
    assert [p.report.step_time_s for p in res.plans] == sorted(p.report.step_time_s for p in res.plans)
    assert res.plans[0].report.step_time_s == pytest.approx(float(np.min(res.points["step_time_s"])), rel=1e-12)


def test_result_prints_with_the_plan_views_and_as_json():
    g = unequal_graph()
    res = search_graph(g, cluster(), graph_workload(g, 16), GraphSpace(max_virtual_stages=2), top=3)
    text = _text(res, None)
    assert "model unequal on 8 x h100-sxm-80gb" in text and "winner" in text and "Pareto front" in text
    doc = json.loads(json.dumps(res.to_json(), default=lambda o: o.tolist()))
    assert doc["model"] == "unequal" and doc["plans"][0]["cost"]["step_time_s"] > 0
    assert any("rejected" in line for line in explain(res))


# ======================================================================================
# nothing fits: a useful message

def test_infeasible_names_the_nearest_options():
    big = LayerGraph(name="big", source="test", sample_tokens=S, layers=tuple(
        layer(f"b{i}", 2_000_000_000) for i in range(6)))  # 12B parameters
    c = cluster(gpn=2, gpu="a100-sxm-40gb")
    res = search_graph(big, c, graph_workload(big, 64), GraphSpace(schedules=("1f1b",), offload=False))
    assert res.feasible == 0 and not res.plans
    assert "out of memory" in res.rejected
    assert "needs" in res.reject_examples["out of memory"] and "usable" in res.reject_examples["out of memory"]
    text = " ".join(res.nearest)
    assert "most memory-saving plan" in text
    assert "needs at least 8 x a100-sxm-40gb: e.g. tp=2" in text
    assert "without the restrictions it fits on 2 GPUs" in text  # offload=False was a restriction
    assert "or 2 x h200-sxm-141gb" in text


def test_bad_requests_are_one_line_errors():
    g = unequal_graph()
    c = cluster()
    with pytest.raises(MeshplanError, match="traced at 512"):
        search_graph(g, c, Workload(global_batch=8, seq_len=1024))
    with pytest.raises(MeshplanError, match="recompute='selective' is not modelled"):
        GraphSpace(recompute=("selective",))
    with pytest.raises(MeshplanError, match="fp8"):
        search_graph(g, c, graph_workload(g, 8), GraphSpace(base=Plan(precision="fp8")))


def test_realistic_size_is_fast():
    """80 blocks + embedding + head on 64 GPUs: seconds (benchmarks/graph_search_speed.py measures it)."""
    blocks = [layer(f"b{i}", 200_000_000) for i in range(80)]
    g = LayerGraph(name="80L", source="test", sample_tokens=S, layers=(
        layer("emb", 500_000_000, kind="embedding", tp=False), *blocks, layer("head", 500_000_000, kind="head")))
    c = load_cluster("h100-sxm-80gb:64")
    res = search_graph(g, c, graph_workload(g, 128), GraphSpace(max_virtual_stages=2, hybrid_nodes=()))
    assert res.feasible > 0 and res.search_time_s < 20
