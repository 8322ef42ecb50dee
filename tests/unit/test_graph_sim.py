"""Simulation of plans on layer graphs (issue 5 + 6): cost.graph_durations recombines into
estimate_graph exactly, sim.simulate_graph_plan agrees with it, `meshplan simulate` takes
hf:/module:/graph .json models. Most tests use hand-built graphs (pure, fast); the ingested
tiny HF configs need torch and transformers (skipped without them)."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from meshplan.cli.main import main
from meshplan.cost.comm import exposed_under
from meshplan.cost.durations import stage_totals
from meshplan.cost.graph import (
    estimate_graph,
    graph_arrays,
    graph_violations,
    graph_workload,
    layer_costs,
    make_layout,
)
from meshplan.cost.graph_durations import graph_analytic_step_time, graph_stage_durations, graph_stage_totals
from meshplan.errors import MeshplanError
from meshplan.sim import RankStep, simulate, simulate_graph_plan, spec_from_graph
from meshplan.spec.base import to_dict
from meshplan.spec.graph import LayerGraph, LayerSpec
from meshplan.spec.io import dump_json, load_cluster, load_plan
from meshplan.spec.plan import Plan
from meshplan.units import GiB

HF = Path(__file__).resolve().parents[1] / "data" / "hf"
CLUSTER = load_cluster("h100-sxm-80gb:16")


def transformer(blocks: int = 8, h: int = 2048, s: int = 2048, vocab: int = 32000, tied: bool = False) -> LayerGraph:
    """A decoder as ingestion would measure it: embedding, blocks (GEMMs, causal attention,
    two TP pairs), output projection whose output (the logits) feeds the loss."""
    att, lin = 4.0 * s * s * h, 12 * h * h
    extra = {"gemm_dim": 1.6 * h, "attention_flops": att, "attention_causal": 1.0, "head_dim": 128.0,
             "mem_bytes": 24.0 * s * h}
    emb = LayerSpec(name="embed", kind="embedding", block="embed", params=vocab * h, fwd_flops=0.0, bwd_flops=0.0,
                    saved_bytes=0.0, output_bytes=2.0 * s * h, tp_style="megatron", tp_fraction=1.0, tp_max=16,
                    tp_allreduces=1, extra={"mem_bytes": 4.0 * s * h})
    body = [LayerSpec(name=f"layers.{i}", block="block", params=lin + 2 * h, fwd_flops=2.0 * s * lin + att,
                      bwd_flops=4.0 * s * lin + 2 * att, saved_bytes=34.0 * s * h, output_bytes=2.0 * s * h,
                      tp_style="megatron", tp_fraction=lin / (lin + 2 * h), tp_max=16, tp_allreduces=2, extra=extra)
            for i in range(blocks)]
    head = LayerSpec(name="lm_head", kind="head", block="head", params=0 if tied else vocab * h,
                     fwd_flops=2.0 * s * vocab * h, bwd_flops=4.0 * s * vocab * h, saved_bytes=2.0 * s * h,
                     output_bytes=2.0 * s * vocab, tp_style="megatron", tp_fraction=1.0, tp_max=16, tp_allreduces=0,
                     extra={"gemm_dim": (vocab * h) ** 0.5, "mem_bytes": 0.0})
    return LayerGraph(name="toy-tied" if tied else "toy", source="module:toy:decoder", sample_tokens=s,
                      trace_dtype="bfloat16", layers=(emb, *body, head), tied_params=vocab * h if tied else 0)


def cnn() -> LayerGraph:
    """Unequal stages, no TP, boundaries of different sizes, fp32 trace, one token per sample."""
    layers, ch, hw = [], 64, 112
    for i in range(8):
        p = 18 * ch * ch
        fl = 2.0 * p * hw * hw
        layers.append(LayerSpec(name=f"stage{i}", block=f"s{i}", params=p, fwd_flops=fl, bwd_flops=2 * fl,
                                saved_bytes=12.0 * ch * hw * hw, output_bytes=4.0 * ch * hw * hw * (1 + i % 2)))
        if i % 2:
            ch, hw = ch * 2, hw // 2
    layers.append(LayerSpec(name="fc", kind="head", block="fc", params=ch * 1000, fwd_flops=2.0 * ch * 1000,
                            bwd_flops=4.0 * ch * 1000, saved_bytes=4.0 * ch, output_bytes=4000.0))
    return LayerGraph(name="cnn", source="module:toy:cnn", sample_tokens=1, layers=tuple(layers))


def unequal(s: int = 512) -> LayerGraph:
    """An embedding, seven blocks of unequal size and a heavy head (search tests' graph)."""
    def layer(name: str, params: float, kind: str = "block", tp: bool = True) -> LayerSpec:
        return LayerSpec(name=name, kind=kind, block=name, params=params, fwd_flops=2.0 * s * params,
                         bwd_flops=4.0 * s * params, saved_bytes=12.0 * s * 1024, output_bytes=2.0 * s * 1024,
                         tp_style="megatron" if tp else "none", tp_fraction=0.98 if tp else 0.0, tp_max=8 if tp else 1,
                         tp_allreduces=2 if tp else 0, extra={"gemm_dim": 2048.0, "mem_bytes": 8.0 * s * 1024})
    body = [layer(f"b{i}", m * 1e6) for i, m in enumerate((30, 10, 50, 20, 20, 70, 10))]
    return LayerGraph(name="unequal", source="test", sample_tokens=s, trace_dtype="bfloat16",
                      layers=(layer("emb", 5e6, "embedding", tp=False), *body, layer("head", 60e6, "head")))


def blocks(head: float, n: int = 15, s: int = 2048, h: int = 2048) -> LayerGraph:
    """n identical blocks and a last layer of ``head`` blocks (no embedding): under ZB-H1 the
    last rank is the heavier one, under ZBV rank 0 (the V's last chunk), as in a transformer."""
    def layer(i: int, scale: float) -> LayerSpec:
        lin = 12 * h * h * scale
        return LayerSpec(name=f"l{i}", kind="head" if i == n else "block", block="head" if i == n else "block",
                         params=lin, fwd_flops=2.0 * s * lin, bwd_flops=4.0 * s * lin, saved_bytes=34.0 * s * h,
                         output_bytes=2.0 * s * h, extra={"gemm_dim": 1.6 * h, "mem_bytes": 24.0 * s * h})
    return LayerGraph(name="blocks", source="test", sample_tokens=s, trace_dtype="bfloat16",
                      layers=tuple(layer(i, head if i == n else 1.0) for i in range(n + 1)))


TOY, TIED, CNN, UNEQUAL = transformer(), transformer(tied=True), cnn(), unequal()

PLANS = [
    "dp=16", "dp=16,zero=1", "dp=16,zero=3", "dp=16,zero=3,shard_group=4,offload_params=1",
    "tp=2,dp=8,async_tp=1", "tp=4,dp=4,zero=2,recompute=full", "pp=2,dp=8", "pp=2,dp=8,schedule=gpipe",
    "pp=2,dp=8,schedule=interleaved-1f1b,virtual_stages=2", "pp=2,dp=8,schedule=zero-bubble",
    "pp=2,dp=8,schedule=zbv,virtual_stages=2", "tp=2,pp=2,dp=4,zero=3", "pp=4,dp=4,recompute=full,recompute_layers=1",
    "pp=4,dp=4,zero=1,offload_optimizer=1,stage_layers=2:3:3:2", "tp=2,pp=4,dp=2,p2p_sharded=0,fused_loss=1",
    "pp=4,dp=4,schedule=interleaved-1f1b,virtual_stages=2,precision=fp32",
]


def batch(plan: Plan, per_rank: int = 2) -> int:
    """A global batch with at least 2 pp micro-batches per pipeline (a full pipeline)."""
    return plan.dp * plan.micro_batch * max(1, 2 * plan.pp) * per_rank


# ---- durations -----------------------------------------------------------------------------

@pytest.mark.parametrize("graph", [TOY, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("text", PLANS)
def test_durations_recombine_to_estimate_graph(graph, text):
    plan = load_plan(text)
    w = graph_workload(graph, batch(plan))
    d = graph_stage_durations(graph, CLUSTER, plan, w)
    ref = estimate_graph(graph, CLUSTER, plan, w)
    assert d.analytic["step_time_s"] == ref.step_time_s
    assert graph_analytic_step_time(d) == pytest.approx(ref.step_time_s, rel=1e-12)
    assert d.microbatches == ref.microbatches and d.pp == plan.pp
    if plan.pp == 1:  # no sends: the transformer path's per-rank sum is the same
        assert stage_totals(d) == pytest.approx(graph_stage_totals(d), rel=1e-12)


def random_plans(graph: LayerGraph, n: int, seed: int) -> list[tuple[Plan, int]]:
    rng, out = random.Random(seed), []
    tps = graph.tp_degrees(8)
    while len(out) < n:
        tp = rng.choice(tps)
        pp = rng.choice([p for p in (1, 2, 4) if 16 % (tp * p) == 0])
        dp = 16 // (tp * pp)
        sched = rng.choice(["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv"]) if pp > 1 else "1f1b"
        v = 2 if sched == "zbv" or (sched == "interleaved-1f1b" and rng.random() < 0.7) else 1
        zero = rng.choice([0, 1, 2, 3])
        kw = dict(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=rng.choice([1, 2]), virtual_stages=v, schedule=sched,
                  recompute=rng.choice(["none", "full"]), precision=rng.choice(["bf16", "fp32"]),
                  fused_loss=rng.random() < 0.3, async_tp=rng.random() < 0.3, p2p_sharded=rng.random() < 0.7,
                  offload_params=zero == 3 and rng.random() < 0.2,
                  offload_optimizer=zero >= 1 and rng.random() < 0.2,
                  grad_sync=rng.choice(["auto", "all-reduce", "reduce-scatter"]))
        if kw["recompute"] == "full" and rng.random() < 0.3:
            kw["recompute_layers"] = rng.choice([0, 1, 3])
        if zero and dp >= 4 and rng.random() < 0.3:
            kw["shard_group"] = 2
        if pp > 1 and v == 1 and rng.random() < 0.5:
            cuts = sorted(rng.sample(range(1, graph.num_layers), pp - 1))
            kw["stage_layers"] = tuple(b - a for a, b in zip([0, *cuts], [*cuts, graph.num_layers]))
        plan = Plan(**kw)
        gb = dp * plan.micro_batch * rng.choice([1, 2, 8])
        if not graph_violations(graph, CLUSTER, plan, graph_workload(graph, gb)):
            out.append((plan, gb))
    return out


@pytest.mark.parametrize("graph", [TIED, CNN], ids=["tied", "cnn"])
def test_random_plans_recombine_exactly(graph):
    for plan, gb in random_plans(graph, 120, seed=5):
        w = graph_workload(graph, gb)
        d = graph_stage_durations(graph, CLUSTER, plan, w)
        assert graph_analytic_step_time(d) == pytest.approx(estimate_graph(graph, CLUSTER, plan, w).step_time_s,
                                                            rel=1e-9), plan.short()


@pytest.mark.parametrize("text, ranks", [("pp=2,dp=8,schedule=interleaved-1f1b,virtual_stages=2", [0, 1, 0, 1]),
                                         ("pp=2,dp=8,schedule=zbv,virtual_stages=2", [0, 1, 1, 0])])
def test_chunks_are_the_graphs_own_and_sum_to_the_ranks(text, ranks):
    plan = load_plan(text)
    d = graph_stage_durations(TOY, CLUSTER, plan, graph_workload(TOY, batch(plan)))
    lay = make_layout(TOY.num_layers, 2, 2, plan.schedule, None)
    assert [c.rank for c in d.chunks] == ranks == lay.chunk_rank.tolist()
    assert [c.end_layer - c.first_layer for c in d.chunks] == list(lay.stage_layers) == [3, 3, 2, 2]
    for field in ("fwd_s", "bwd_input_s", "bwd_weight_s", "tp_fwd_exposed_s", "dp_bwd_overlapped_s"):
        for r in range(2):
            assert sum(getattr(c, field) for c in d.chunks if c.rank == r) == pytest.approx(getattr(d, field)[r])
    # Each chunk is its own layers' sum (not a rank's total / v); the loss sits with the last
    # layer (rank 0 under the V).
    lc = layer_costs(TOY, graph_arrays(TOY), CLUSTER, plan.tp, plan.micro_batch, plan.precision, plan.fused_loss)
    loss = [0.0, 0.0, 0.0, d.loss_fwd_s[ranks[3]]]
    assert [c.fwd_s for c in d.chunks] == pytest.approx(
        [lc.f[c.first_layer:c.end_layer].sum() + x for c, x in zip(d.chunks, loss)], rel=1e-12)
    assert d.chunks[0].fwd_s != d.chunks[2].fwd_s  # the embedding's chunk and a plain one on rank 0
    assert d.loss_fwd_s[ranks[3]] > 0 and d.loss_fwd_s[1 - ranks[3]] == 0
    spec, _ = spec_from_graph(TOY, CLUSTER, plan, graph_workload(TOY, batch(plan)))
    assert [st.fwd.compute for st in spec.stages] == [c.fwd_s for c in d.chunks]


def test_refused_plans_are_one_line_errors():
    w = graph_workload(TOY, 32)
    for text, words in (("dp=8,cp=2", "cp=2"), ("tp=2,dp=8,sequence_parallel=1", "sequence_parallel")):
        with pytest.raises(MeshplanError) as e:
            simulate_graph_plan(TOY, CLUSTER, load_plan(text), w)
        assert words in str(e.value) and "\n" not in str(e.value)


# ---- simulation ----------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["dp=16", "dp=16,zero=3", "dp=16,zero=3,shard_group=4,offload_params=1",
                                  "tp=2,dp=8", "tp=4,dp=4,zero=2,recompute=full,async_tp=1"])
def test_without_a_pipeline_the_simulation_is_the_estimate(text):
    plan = load_plan(text)
    w = graph_workload(TIED, batch(plan))
    res, s = simulate_graph_plan(TIED, CLUSTER, plan, w)
    ref = estimate_graph(TIED, CLUSTER, plan, w)
    assert res.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9)
    assert s["ranks"][0]["peak_memory_gib"] == pytest.approx(ref.peak_memory_gib, rel=1e-9)


@pytest.mark.parametrize("graph", [TOY, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("text", ["dp=16", "dp=16,zero=3", "tp=2,dp=8", "pp=2,dp=8", "pp=2,dp=8,schedule=gpipe",
                                  "pp=2,dp=8,schedule=interleaved-1f1b,virtual_stages=2",
                                  "pp=2,dp=8,schedule=zero-bubble", "pp=2,dp=8,schedule=zbv,virtual_stages=2",
                                  "tp=2,pp=4,dp=2,zero=1", "pp=4,dp=4,schedule=interleaved-1f1b,virtual_stages=2"])
def test_simulation_agrees_with_estimate_graph(graph, text):
    """Within 3% with 4 pp micro-batches per pipeline. The differences are the simulator's timing
    structure (docs/simulation.md): the closed-form bubble (sum - max of the ranks' times) is high
    for the unequal ranks of an even layer split (the embedding's rank, the head's rank), and each
    rank's end-of-step sync runs after its own last pass."""
    plan = load_plan(text)
    w = graph_workload(graph, batch(plan, 4))
    _, s = simulate_graph_plan(graph, CLUSTER, plan, w)
    assert abs(s["sim_vs_analytic_pct"]) < 3.0, s["sim_vs_analytic_pct"]
    assert s["analytic_step_time_s"] == estimate_graph(graph, CLUSTER, plan, w).step_time_s


SPLIT_BASES = ["pp=2,dp=8", "pp=4,dp=4", "tp=2,pp=4,dp=2", "pp=4,dp=4,recompute=full", "pp=4,dp=4,zero=3",
               "tp=2,pp=2,dp=4,zero=1", "pp=8,dp=2", "pp=4,dp=4,zero=1,offload_optimizer=1",
               "tp=2,pp=4,dp=2,async_tp=1,fused_loss=1"]


@pytest.mark.parametrize("graph", [TOY, TIED, UNEQUAL], ids=["untied", "tied", "unequal"])
@pytest.mark.parametrize("schedule, per_rank", [("zero-bubble", 1), ("zero-bubble", 2), ("zero-bubble", 4),
                                                ("zbv", 2), ("zbv", 4)])
@pytest.mark.parametrize("base", SPLIT_BASES)
def test_split_backward_plans_simulate_within_three_percent(graph, schedule, per_rank, base):
    """zero-bubble and ZBV with pp, 2 pp, 4 pp micro-batches (ZBV: 2 pp and 4 pp): estimate_graph
    takes its bubble from each rank's F, B, W passes (ZBV: each rank's two chunks) in torch's
    order and hides pipelined FSDP's reduce-scatter under the last W pass. Seen: mean |sim -
    est| 0.21% (zero-bubble) and 0.46% (zbv), worst 1.54% and 1.72%; with the paper's uniform
    forms (before) 2.81% / 2.02%, worst -12.4% (tied, pp=8, m = pp) / +6.2%, 29 of 129 beyond 3%.
    ZBV with pp <= m < 2 pp - 1 is left out: see the next test and docs/graph-cost.md."""
    plan = load_plan(base + (",schedule=zbv,virtual_stages=2" if schedule == "zbv" else ",schedule=zero-bubble"))
    w = graph_workload(graph, plan.dp * plan.pp * per_rank)
    if graph_violations(graph, CLUSTER, plan, w):
        pytest.skip("the layers do not split into pp x v chunks")
    d = graph_stage_durations(graph, CLUSTER, plan, w)
    assert graph_analytic_step_time(d) == pytest.approx(d.analytic["step_time_s"], rel=1e-12)
    _, s = simulate_graph_plan(graph, CLUSTER, plan, w)
    assert abs(s["sim_vs_analytic_pct"]) < 3.0, s["sim_vs_analytic_pct"]


@pytest.mark.parametrize("head", [1.0, 2.5])
@pytest.mark.parametrize("schedule", ["zero-bubble", "zbv"])
def test_split_backward_bubble_is_torchs_order_for_every_microbatch_count(head, schedule):
    """The cost model's m max T + bubble against the simulated pipeline alone (the same passes
    and sends, no end-of-step work), pp = 4, m = 1 .. 16, uniform blocks and one heavier rank
    (the head's): within 1% (seen 0.6%). With the paper's forms it was up to 95% low (ZBV,
    m = 1: every pass waits for the round trip) and 43% (ZB-H1)."""
    g = blocks(head)
    plan = load_plan("pp=4,dp=4" + (",schedule=zbv,virtual_stages=2" if schedule == "zbv" else
                                     ",schedule=zero-bubble"))
    for m in range(1, 17):
        spec, d = spec_from_graph(g, CLUSTER, plan, graph_workload(g, 4 * m))
        alone = dataclasses.replace(spec, ranks=[RankStep() for _ in spec.ranks], overhead_s=0.0)
        closed = d.microbatches * max(graph_stage_totals(d)) + d.analytic["bubble"]
        assert simulate(alone).step_time_s == pytest.approx(closed, rel=0.01), m


def test_pipelined_fsdp_reduce_scatter_hides_under_the_last_w_pass():
    """ZeRO-3 under a split-backward pipeline: the reduce-scatter of the critical rank's
    gradients starts with its last W pass (ZB-H1: the rank's weight gradients; ZBV: its first
    chunk's, the last W of torch's order on every rank), so only that pass hides it. Here the
    reduce-scatter is longer than that W and shorter than the rank's whole backward (which hid it
    before, and still does under 1F1B)."""
    g = transformer(s=1024, tied=True)
    for sched in ("zero-bubble", "zbv"):
        plan = load_plan("pp=4,dp=4,zero=3,schedule=" + sched + (",virtual_stages=2" if sched == "zbv" else ""))
        w = graph_workload(g, plan.dp * plan.pp * 4)
        d = graph_stage_durations(g, CLUSTER, plan, w)
        ref = estimate_graph(g, CLUSTER, plan, w)
        crit = int(np.argmax(graph_stage_totals(d)))
        last_w = d.chunks[crit].bwd_weight_s if sched == "zbv" else d.bwd_weight_s[crit]
        backward = d.bwd_input_s[crit] + d.bwd_weight_s[crit] + d.recompute_s[crit] - d.loss_bwd_s[crit]
        assert last_w < d.staged_reduce_s[crit] < backward
        a = d.overlap_slowdown  # compute slowed while the collective runs under it
        gather = float(exposed_under(d.staged_gather_s[crit], d.fwd_s[crit] - d.loss_fwd_s[crit], a))
        end = max(e - (d.tied_sync_s if r in d.tied_ranks else 0.0) for r, e in enumerate(d.end_dp_exposed_s))
        reduce = float(exposed_under(d.staged_reduce_s[crit], last_w, a))
        assert reduce == max(d.staged_reduce_s[crit] - last_w, a * last_w)
        exposed = end + d.tied_sync_s + gather + reduce
        assert ref.time["dp_comm"] == pytest.approx(exposed, rel=1e-9)
        _, sim = simulate_graph_plan(g, CLUSTER, plan, w)
        assert abs(sim["sim_vs_analytic_pct"]) < 3.0, sim["sim_vs_analytic_pct"]


@pytest.mark.parametrize("text", ["pp=2,dp=8", "pp=4,dp=4,stage_layers=2:3:3:2", "pp=2,dp=8,schedule=gpipe"])
def test_simulated_memory_peaks_are_the_cost_models_stage_memory(text):
    plan = load_plan(text)
    w = graph_workload(TIED, batch(plan))
    _, s = simulate_graph_plan(TIED, CLUSTER, plan, w)
    ref = estimate_graph(TIED, CLUSTER, plan, w)
    assert [r["peak_memory_gib"] for r in s["ranks"]] == pytest.approx(ref.memory_per_stage, rel=1e-9)


@pytest.mark.parametrize("graph, cluster, gb, pct", [(TIED, "h100-sxm-80gb:16", 128, 3.0),
                                                     (CNN, "h100-sxm-80gb:8", 256, 4.0)], ids=["decoder", "cnn"])
def test_the_searchs_pipelined_winners_simulate_close_to_their_estimate(graph, cluster, gb, pct):
    """The CNN's activations are large for its FLOPs (a send is ~17% of a stage's forward):
    under GPipe the forward sends of rank 0 and the backward sends of rank 1 both lie on the
    critical path, where the cost model charges each rank its own one (+3.4% for its #2)."""
    from meshplan.search.graph import GraphSpace, search_graph
    res = search_graph(graph, load_cluster(cluster), graph_workload(graph, gb), GraphSpace(pp=(2, 4)), top=5)
    assert len(res.plans) == 5
    for p in res.plans:
        _, s = simulate_graph_plan(graph, p.cluster, p.plan, res.work)
        assert abs(s["sim_vs_analytic_pct"]) < (pct if p.plan.schedule == "gpipe" else 3.0), \
            (p.plan.short(), s["sim_vs_analytic_pct"])


def test_sends_per_rank_are_the_cost_models():
    """Uniform boundaries: every rank sends what the cost model charges it (first and last
    rank one send per micro-batch, the others two)."""
    plan = load_plan("pp=4,dp=4")
    res, _ = simulate_graph_plan(TOY, CLUSTER, plan, graph_workload(TOY, batch(plan)))
    d = graph_stage_durations(TOY, CLUSTER, plan, graph_workload(TOY, batch(plan)))
    sent = [res.busy(r, "pp") for r in range(4)]
    assert sent == pytest.approx([d.microbatches * t / d.p2p_exposed for t in d.p2p_rank_s], rel=1e-9)
    assert sent[1] == pytest.approx(2 * sent[0], rel=1e-9)


def test_unequal_boundaries_send_their_mean():
    plan = load_plan("pp=4,dp=4")
    d = graph_stage_durations(CNN, CLUSTER, plan, graph_workload(CNN, 64))
    sends = [c.send_s for c in d.chunks[:-1]]
    assert len(set(sends)) > 1 and d.p2p_send_s == pytest.approx(np.mean(sends))


def test_pipeline_of_one_rank_with_virtual_stages_runs_one_stage():
    plan = Plan(dp=16, virtual_stages=2, schedule="interleaved-1f1b")
    w = graph_workload(TOY, 32)
    if graph_violations(TOY, CLUSTER, plan, w):
        pytest.skip("pp=1 with virtual stages is refused")
    spec, d = spec_from_graph(TOY, CLUSTER, plan, w)
    assert len(spec.stages) == 1 and spec.stages[0].fwd.compute == pytest.approx(d.fwd_s[0])


# ---- the command line ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("g") / "toy.json"
    path.write_text(dump_json(TIED) + "\n")
    return path


def test_cli_simulates_a_graph_file(graph_file, tmp_path, capsys):
    trace = tmp_path / "t.json"
    argv = ["simulate", "--model", str(graph_file), "--cluster", "h100-sxm-80gb:16", "--plan",
            "pp=2,dp=8,schedule=interleaved-1f1b,virtual_stages=2", "--global-batch", "64", "--trace", str(trace)]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "toy-tied" and out["seq_len"] == TIED.sample_tokens and len(out["ranks"]) == 2
    assert abs(out["sim_vs_analytic_pct"]) < 3 and out["virtual_stages"] == 2
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "simulated step:" in text and "analytical estimate:" in text


def test_cli_plots_a_graph_simulation(graph_file, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "s.png"
    assert main(["simulate", "--model", str(graph_file), "--cluster", "h100-sxm-80gb:16", "--plan", "pp=2,dp=8",
                 "--global-batch", "32", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, words", [
    (["--plan", "dp=8,cp=2"], "cp=2"),
    (["--plan", "dp=16", "--seq-len", "7"], "traced at"),
    (["--plan", "pp=2,dp=8,stage_layers=9:1,virtual_stages=2,schedule=interleaved-1f1b"], "ambiguous"),
])
def test_cli_graph_errors_are_one_line(graph_file, capsys, argv, words):
    assert main(["simulate", "--model", str(graph_file), "--cluster", "h100-sxm-80gb:16", "--global-batch", "32",
                 *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshplan: error: ") and words in err and err.count("\n") == 1


# ---- ingested tiny Hugging Face configs (torch + transformers) -----------------------------

@pytest.fixture(scope="module")
def ingested() -> dict[str, LayerGraph]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from meshplan.ingest import ingest
    return {name: ingest(f"hf:{HF / f'{name}.json'}") for name in ("llama-tiny", "t5-tiny")}


@pytest.mark.parametrize("name, text", [
    ("llama-tiny", "dp=16"), ("llama-tiny", "dp=16,zero=3"), ("llama-tiny", "tp=2,dp=8"),
    ("llama-tiny", "pp=2,dp=8"), ("t5-tiny", "pp=2,dp=8"), ("t5-tiny", "tp=2,dp=8,zero=3"),
    ("t5-tiny", "pp=2,dp=8,schedule=interleaved-1f1b,virtual_stages=2"),
])
def test_ingested_models_simulate_within_three_percent(ingested, name, text):
    graph, plan = ingested[name], load_plan(text)
    w = graph_workload(graph, batch(plan, 4))
    d = graph_stage_durations(graph, CLUSTER, plan, w)
    assert graph_analytic_step_time(d) == pytest.approx(estimate_graph(graph, CLUSTER, plan, w).step_time_s,
                                                        rel=1e-9)
    _, s = simulate_graph_plan(graph, CLUSTER, plan, w)
    assert abs(s["sim_vs_analytic_pct"]) < 3.0, s["sim_vs_analytic_pct"]


def test_cli_simulates_an_hf_source(ingested, capsys):
    assert main(["simulate", "--model", f"hf:{HF / 'llama-tiny.json'}", "--cluster", "h100-sxm-80gb:8",
                 "--plan", "pp=2,dp=4", "--global-batch", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == ingested["llama-tiny"].name and out["step_time_s"] > 0
    assert out["analytic_step_time_s"] > 0 and len(out["ranks"]) == 2


def test_graph_json_round_trip_keeps_the_simulation(graph_file):
    from meshplan.cli.model_arg import load_model_arg
    g = load_model_arg(str(graph_file))
    assert to_dict(g) == to_dict(TIED)
    plan = load_plan("pp=2,dp=8")
    a = simulate_graph_plan(g, CLUSTER, plan, graph_workload(g, 32))[0].step_time_s
    b = simulate_graph_plan(TIED, CLUSTER, plan, graph_workload(TIED, 32))[0].step_time_s
    assert a == b and a > 0 and GiB > 0
