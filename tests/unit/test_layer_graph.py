"""One model representation, one cost path (issue 12): every model is a LayerGraph; a transformer
description is generated into one (spec.transformer), and the cost model, the search and the
simulator take only LayerGraphs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from meshplan.cost import estimate
from meshplan.cost.batch import estimate_batch
from meshplan.errors import MeshplanError
from meshplan.search.driver import search
from meshplan.search.space import SearchSpace
from meshplan.sim import simulate
from meshplan.spec.base import from_dict, to_dict
from meshplan.spec.capabilities import PIPELINE_NOTE, capabilities
from meshplan.spec.constraints import violations
from meshplan.spec.graph import Attention, Gemm, LayerGraph, LayerOps, LayerSpec
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload
from meshplan.spec.transformer import as_graph, transformer_graph

GRAPH_ONLY_CHECKS = ("no layer for tensor parallel", "model cannot be pipelined",
                     "no replicated activations for sequence parallel", "no attention for context parallel")


def _layer(name: str, kind: str, block: str, ops: LayerOps, s: int) -> LayerSpec:
    lin = sum(2.0 * g.m * g.n * g.k for g in ops.gemms) * s
    return LayerSpec(name=name, kind=kind, block=block, params=int(ops.params), fwd_flops=lin, bwd_flops=2 * lin,
                     saved_bytes=s * (ops.saved_rep + ops.saved_split[0] + ops.saved_whole),
                     output_bytes=s * ops.hidden)


def cnn_like(widths: tuple[int, ...] = (64, 64, 128, 128, 256, 256, 512, 512),
             notes: tuple[str, ...] = ()) -> LayerGraph:
    """Blocks of unequal cost, no attention, no TP pairs: what a CNN looks like (one sample = one token)."""
    ops = {"stem": LayerOps(params=9408, gemms=(Gemm(n=64, k=147, m=12544),), saved_whole=64 * 12544 * 2,
                            hidden=64 * 3136 * 2, send=64 * 3136 * 2)}
    layers = [_layer("stem", "embedding", "stem", ops["stem"], 1)]
    for i, w in enumerate(widths):
        pixels = 3136 * 64 // w
        bid = f"stage{w}"
        conv = Gemm(n=w, k=9 * w, m=pixels)
        ops[bid] = LayerOps(params=9 * w * w * 2, gemms=(conv, conv),
                            saved_rep=6 * w * pixels, saved_input=2 * w * pixels, hidden=2 * w * pixels,
                            send=2 * w * pixels, ew_rep=(8.0 * w * pixels, 8.0 * w * pixels))
        layers.append(_layer(f"layers.{i}", "block", bid, ops[bid], 1))
    ops["head"] = LayerOps(params=512 * 1000, gemms=(Gemm(n=1000, k=512),), hidden=2000, loss_vocab=1000,
                           loss_split=False, fp8=False)
    layers.append(_layer("fc", "head", "head", ops["head"], 1))
    return LayerGraph(name="cnn", source="module:tests:cnn", task="classification", sample_tokens=1,
                      trace_dtype="bfloat16", layers=tuple(layers), ops=ops, notes=notes)


@pytest.fixture(scope="module")
def llama():
    return load_model("llama2-7b")


@pytest.fixture(scope="module")
def h100x64():
    return load_cluster("h100-sxm-80gb:64")


WORK = Workload(global_batch=512, seq_len=4096)


def test_a_description_and_its_generated_graph_are_one_model(llama, h100x64):
    g = transformer_graph(llama, WORK.seq_len)
    assert g.model == llama and g.num_blocks == llama.num_layers and g.num_params() == llama.num_params()
    assert len(g.ops) == 3  # the 32 blocks are stored once
    for plan in (Plan(dp=64, zero=1), Plan(tp=4, pp=2, dp=8, sequence_parallel=True, zero=1),
                 Plan(tp=2, pp=4, dp=8, virtual_stages=2, schedule="interleaved-1f1b", recompute="full")):
        a, b = estimate(llama, h100x64, plan, WORK), estimate(g, h100x64, plan, WORK)
        assert a.step_time_s == b.step_time_s and a.peak_memory_gib == b.peak_memory_gib


def test_a_graph_file_round_trips_with_its_ops(llama, h100x64):
    g = transformer_graph(llama, WORK.seq_len)
    back = from_dict(LayerGraph, json.loads(json.dumps(to_dict(g))))
    assert back.ops == g.ops and back.layers == g.layers
    plan = Plan(tp=2, pp=2, dp=16, zero=1, sequence_parallel=True)
    assert estimate(back, h100x64, plan, WORK).step_time_s == estimate(g, h100x64, plan, WORK).step_time_s


def test_a_graph_without_ops_plans_from_its_totals(h100x64):
    """Graph files written before ingestion recorded ops: the totals give derived LayerOps."""
    g = cnn_like()
    legacy = LayerGraph(name=g.name, source=g.source, sample_tokens=1, trace_dtype="bfloat16", layers=g.layers)
    r = estimate(legacy, h100x64, Plan(dp=64), Workload(global_batch=512, seq_len=1))
    assert r.step_time_s > 0 and r.fits


@pytest.mark.parametrize("plan, name", [
    (Plan(tp=2, dp=32), "no layer for tensor parallel"),
    (Plan(dp=32, cp=2), "no attention for context parallel"),
])
def test_what_a_cnn_cannot_do_is_refused_with_the_reason(h100x64, plan, name):
    found = violations(cnn_like(), h100x64, plan, Workload(global_batch=512, seq_len=1))
    assert found[0][0] == name and "use" in found[0][1], found


def test_sequence_parallel_needs_a_replicated_hidden_state(h100x64):
    ops = LayerOps(params=1e6, params_split=1e6, gemms=(Gemm(n=1024, k=1024, split="column"),
                                                         Gemm(n=1024, k=1024, split="row")),
                   saved_split=(4096.0, 4096.0), hidden=2048, send=2048, tp_allreduces=1)
    g = LayerGraph(name="nosp", source="module:x:y", sample_tokens=128, layers=tuple(
        _layer(f"l{i}", "block", "b", ops, 128) for i in range(4)), ops={"b": ops})
    work = Workload(global_batch=64, seq_len=128)
    found = violations(g, h100x64, Plan(tp=2, dp=32, sequence_parallel=True), work)
    assert [n for n, _ in found] == ["no replicated activations for sequence parallel"]
    assert not violations(g, h100x64, Plan(tp=2, dp=32), work)


def test_a_model_that_cannot_be_cut_is_not_pipelined(h100x64):
    g = cnn_like(notes=(f"{PIPELINE_NOTE} the decoder reads the encoder output at every block",))
    found = violations(g, h100x64, Plan(pp=2, dp=32), Workload(global_batch=512, seq_len=1))
    assert [n for n, _ in found] == ["model cannot be pipelined"] and "encoder output" in found[0][1]
    res = search(g, h100x64, Workload(global_batch=512, seq_len=1), SearchSpace(offload=False))
    assert res.plans and all(p.plan.pp == 1 for p in res.plans)


def test_every_graph_only_rule_is_exercised():
    from meshplan.spec.constraints import CHECKS
    assert set(GRAPH_ONLY_CHECKS) <= set(CHECKS)


def test_stages_balance_blocks_of_unequal_cost(h100x64):
    """Pipeline stages balanced by the layers' cost: the search's split beats the even one."""
    g = cnn_like()
    work = Workload(global_batch=512, seq_len=1)
    res = search(g, load_cluster("h100-sxm-80gb:8"), work, SearchSpace(pp=(2,), tp=(1,), zero=(1,), offload=False,
                                                                       recompute=("none",), schedules=("1f1b",)))
    uneven = [p for p in res.plans if p.plan.stage_layers is not None]
    assert uneven, [p.plan.short() for p in res.plans]
    best = uneven[0].plan
    even = best.replace(stage_layers=None)
    c = load_cluster("h100-sxm-80gb:8")
    assert estimate(g, c, best, work).step_time_s < estimate(g, c, even, work).step_time_s
    caps = capabilities(g)
    assert caps.blocks == 8 and not caps.attention and not caps.tp_layers


@pytest.mark.parametrize("plan", [
    Plan(dp=8, zero=3), Plan(pp=2, dp=4, zero=1), Plan(pp=4, dp=2, zero=1, schedule="gpipe"),
    Plan(pp=2, dp=4, zero=1, stage_layers=(3, 5)),
])
def test_the_simulator_runs_any_graph_as_the_estimate_prices_it(plan):
    g, c = cnn_like(), load_cluster("h100-sxm-80gb:8")
    work = Workload(global_batch=64, seq_len=1)
    _, s = simulate(g, c, plan, work)
    assert abs(s["sim_vs_analytic_pct"]) < 3.0, s["sim_vs_analytic_pct"]


def test_ingested_attention_gets_context_and_sequence_parallel(h100x64):
    """A graph with attention and a replicated hidden state plans with cp and sp like a preset."""
    g = transformer_graph(load_model("llama3-8b"), 8192)
    legacy = LayerGraph(name="x", source="module:x:y", sample_tokens=8192, trace_dtype="bfloat16",
                        layers=g.layers, ops=g.ops)  # the same ops, without the description
    work = Workload(global_batch=64, seq_len=8192)
    plan = Plan(tp=4, cp=2, dp=8, sequence_parallel=True, zero=1)
    assert not violations(legacy, h100x64, plan, work)
    a, b = estimate(g, h100x64, plan, work), estimate(legacy, h100x64, plan, work)
    assert a.step_time_s == b.step_time_s and a.time["cp_comm"] == b.time["cp_comm"]


def test_batch_prices_many_rows_of_any_graph_like_one(h100x64):
    g = cnn_like()
    work = Workload(global_batch=512, seq_len=1)
    plans = [Plan(dp=64, zero=z, micro_batch=m) for z in (0, 1, 3) for m in (1, 2, 4, 8)]
    plans += [Plan(pp=p, dp=64 // p, zero=1, micro_batch=m) for p in (2, 4, 8) for m in (1, 2)]
    out = estimate_batch(g, h100x64, work, plans)
    one = np.array([estimate(g, h100x64, p, work).step_time_s for p in plans])
    assert np.allclose(out["step_time_s"], one, rtol=1e-12)


def test_as_graph_is_the_identity_on_graphs(llama):
    g = transformer_graph(llama, 2048)
    assert as_graph(g, 4096) is g and as_graph(llama, 2048) is g  # memoised
    with pytest.raises(MeshplanError):
        LayerOps(params=1.0, params_split=2.0)
    assert Attention(heads=8, kv_heads=2, head_dim=64).kv_dim == 128


def test_exports_take_the_graph_and_refuse_a_traced_one():
    from meshplan.export import export
    from meshplan.export.common import ExportInput
    g = transformer_graph(load_model("llama3-8b"), 8192)
    a = export("megatron", ExportInput(plan=Plan(tp=2, dp=4), model=g, global_batch=64))
    b = export("megatron", ExportInput(plan=Plan(tp=2, dp=4), model=load_model("llama3-8b"), global_batch=64,
                                       seq_len=8192))
    assert a.config == b.config
    with pytest.raises(MeshplanError, match="traced layer graph"):
        ExportInput(plan=Plan(dp=8), model=cnn_like(), global_batch=64)


def test_the_runtime_table_keeps_the_search_to_what_the_runtime_runs(h100x64):
    """spec.support on the graph: kv heads are not replicated under TP, and sequence parallelism
    runs on the transformers the runtime builds, not on traced models; the search enumerates
    what it runs (and the runtime refuses the rest with the same reason)."""
    from meshplan.spec.support import runtime_violations, sequence_parallel_runs
    gqa = transformer_graph(load_model("llama3-8b"), 8192)  # 8 kv heads
    traced = LayerGraph(name="t", source="module:x:y", sample_tokens=8192, trace_dtype="bfloat16",
                        layers=gqa.layers, ops=gqa.ops)
    assert sequence_parallel_runs(gqa) and not sequence_parallel_runs(traced)
    sp = Plan(tp=4, dp=16, sequence_parallel=True)
    assert not runtime_violations(sp, 8, gqa)
    assert [r.name for r, _ in runtime_violations(sp, 8, traced)] == ["sequence parallel on a traced model"]
    mqa = transformer_graph(load_model("llama3-8b").replace(num_kv_heads=2), 8192)
    assert [r.name for r, _ in runtime_violations(Plan(tp=4, dp=16), 8, mqa)] == [
        "kv heads replicated under tensor parallel"]
    work = Workload(global_batch=64, seq_len=8192)
    res = search(traced, load_cluster("h100-sxm-80gb:16"), work, SearchSpace(tp=(2,), offload=False))
    assert res.plans and all(not p.plan.sequence_parallel for p in res.plans)
    # priced and rejected under the runtime's rules, never recommended
    assert all(p.plan.cp == 1 and p.plan.recompute in ("none", "full") for p in res.plans)
    assert res.rejected["context parallel on a traced model"] > 0
    assert res.rejected["selective recompute on a traced model"] > 0


@pytest.mark.parametrize("factory, tp_ok", [("resnet50:make_resnet50", True), ("vit:make_vit", True),
                                            ("gnn:make_gnn", True)])
def test_example_modules_plan_like_any_model(factory, tp_ok, monkeypatch):
    """The CNN, the ViT and the GNN of tests/data/modules (trained on CPU in tests/dist/test_examples.py)
    go through the same search: plans for 16 H100s, tensor parallelism only where the layers split."""
    pytest.importorskip("torch")
    from pathlib import Path

    from meshplan.ingest import ingest
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "data" / "modules"))
    g = ingest(f"module:{factory}")
    work = Workload(global_batch=256, seq_len=g.sample_tokens)
    cluster = load_cluster("h100-sxm-80gb:16")
    res = search(g, cluster, work, SearchSpace(offload=False))
    assert res.plans and res.best.report.fits
    assert all(p.plan.cp == 1 and p.plan.ep == 1 for p in res.plans)
    caps = capabilities(g)
    assert caps.tp_layers == tp_ok and not caps.experts and caps.blocks >= 4
    tp2 = violations(g, cluster, Plan(tp=2, dp=8), work)
    assert (not tp2) == tp_ok, tp2
    assert not violations(g, cluster, Plan(pp=2, dp=8), work)  # a pipeline of blocks
