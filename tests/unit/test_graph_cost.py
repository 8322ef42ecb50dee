"""The cost model on a general layer graph (cost/graph.py) against closed forms, and against the
transformer cost model on a graph built by hand from the analytical transformer.

Expectations are written from the formulas of docs/graph-cost.md (GEMM time = FLOPs / (peak x
gemm_efficiency x shape factor), ring all-reduce, send/recv, ZeRO bytes per parameter, 1F1B
in-flight micro-batches), not from the implementation.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from meshplan.cost import DEFAULT_PARAMS, estimate
from meshplan.cost.compute import _linear_shapes, elementwise_bytes
from meshplan.cost.graph import estimate_graph, graph_violations, graph_workload
from meshplan.cost.memory import activation_bytes_per_token
from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec, LinkTier
from meshplan.spec.graph import LayerGraph, LayerSpec
from meshplan.spec.io import load_cluster, load_gpu, load_model
from meshplan.spec.plan import Plan, Workload
from meshplan.units import GiB

P = DEFAULT_PARAMS
REL = 1e-9


def hand_cluster(nodes: int = 1, gpn: int = 8) -> ClusterSpec:
    """H100s; intra 400 GB/s at 75 % (300e9 B/s, 2 us), NIC 25 GB/s at 100 % (10 us)."""
    return ClusterSpec(
        name="hand", gpu=load_gpu("h100-sxm-80gb"), num_nodes=nodes, gpus_per_node=gpn,
        intra_node=LinkTier(name="intra_node", bandwidth_gbps=400.0, latency_us=2.0, efficiency=0.75),
        inter_node=LinkTier(name="inter_node", bandwidth_gbps=25.0, latency_us=10.0, efficiency=1.0))


S = 1024          # tokens per sample
D = 2048.0        # gemm_dim of every layer


def linear_layer(name: str, params: int, *, kind: str = "block", saved: float = 0.0, out: float = 0.0,
                 tp: float = 0.0, ars: int = 0, tp_max: int = 8, mem: float = 0.0) -> LayerSpec:
    """A layer of pure weight GEMMs over S tokens: forward 2 S P FLOPs per sample, backward 4 S P."""
    return LayerSpec(name=name, kind=kind, block=name, params=params, fwd_flops=2.0 * S * params,
                     bwd_flops=4.0 * S * params, saved_bytes=saved, output_bytes=out,
                     tp_style="megatron" if tp else "none", tp_fraction=tp, tp_max=tp_max if tp else 1,
                     tp_allreduces=ars, extra={"gemm_dim": D, "mem_bytes": mem})


def graph_of(*layers: LayerSpec, trace: str = "bfloat16", tied: int = 0) -> LayerGraph:
    return LayerGraph(name="toy", source="test", sample_tokens=S, trace_dtype=trace, layers=tuple(layers),
                      tied_params=tied)


def gemm_seconds(flops: float, m: float, n: float, k: float, peak: float) -> float:
    """FLOPs at the GPU's gemm_efficiency times the shape factor of cost/compute.py's docstring."""
    shape = m / (m + P.gemm_half_tokens) * n / (n + P.gemm_half_dim) * k / (k + P.gemm_half_dim)
    return flops / (peak * load_gpu("h100-sxm-80gb").gemm_efficiency * shape)


def loss_seconds(out_bytes: float, micro_batch: int, trace_bytes: float = 2.0) -> float:
    """The loss on the last layer's output: 14 B per element forward and 14 backward (unfused)."""
    c = load_gpu("h100-sxm-80gb")
    return out_bytes / trace_bytes * micro_batch * 28.0 / (c.hbm_bandwidth_gbps * 1e9 * P.hbm_efficiency)


def ring_all_reduce(n: int, size: float, bw: float = 300e9, alpha: float = 2e-6) -> float:
    return 2 * (n - 1) / n * size / bw + 2 * (n - 1) * alpha


# ======================================================================================
# compute, TP, pipeline sends

def test_single_gpu_step_is_compute_plus_optimizer():
    prm = 50_000_000
    g = graph_of(linear_layer("a", prm, saved=1e6, out=2.0 * S * 1024))
    c = hand_cluster(gpn=1)
    w = graph_workload(g, 4)
    r = estimate_graph(g, c, Plan(micro_batch=2), w)
    peak = c.gpu.peak("bf16")
    m = 2 * S  # each weight is used once per token of the micro-batch
    fwd = gemm_seconds(2.0 * S * prm * 2, m, D, D, peak)
    micro = 2
    loss = loss_seconds(2.0 * S * 1024, 2)
    assert r.time["compute"] == pytest.approx(micro * (3 * fwd + loss), rel=REL)
    opt = prm * P.optimizer_bytes_per_param / (c.gpu.hbm_bandwidth_gbps * 1e9 * P.hbm_efficiency)
    assert r.time["optimizer"] == pytest.approx(opt, rel=REL)
    assert r.step_time_s == pytest.approx(micro * (3 * fwd + loss) + opt, rel=REL)
    assert sum(v for k, v in r.time.items() if not k.endswith("_overlapped")) == pytest.approx(r.step_time_s, rel=REL)
    assert r.tokens_per_s == pytest.approx(4 * S / r.step_time_s, rel=REL)
    flops = 6.0 * S * prm * 4
    assert r.mfu == pytest.approx(flops / r.step_time_s / peak, rel=REL)
    assert r.dominant == "compute"


def test_tp_splits_only_tp_layers_and_their_fraction():
    prm, out = 40_000_000, 2.0 * S * 2048
    tp_layer = linear_layer("t", prm, tp=0.75, ars=2, out=out)
    plain = linear_layer("p", prm, out=out)
    c = hand_cluster()
    g = graph_of(tp_layer, plain)
    w = graph_workload(g, 4)
    r = estimate_graph(g, c, Plan(tp=2, dp=4, micro_batch=1), w)
    peak = c.gpu.peak("bf16")
    m = S
    # TP layer: 1/4 of its FLOPs replicated (d x d), 3/4 split over 2 GPUs (d/2 x d).
    per_flop_t = 0.25 * gemm_seconds(1, m, D, D, peak) + 0.75 / 2 * gemm_seconds(1, m, D / 2, D, peak)
    f_t = 2.0 * S * prm * per_flop_t
    f_p = gemm_seconds(2.0 * S * prm, m, D, D, peak)
    # One micro-batch (4 samples / (dp 4 x 1)); the loss of the replicated last layer is not split.
    assert r.time["compute"] == pytest.approx(3 * (f_t + f_p) + loss_seconds(out, 1), rel=1e-9)
    # TP communication: 2 all-reduces of the output, forward and backward, on the TP layer only.
    assert r.time["tp_comm"] == pytest.approx(2 * 2 * ring_all_reduce(2, out), rel=1e-9)


def test_tp_degree_must_be_allowed_by_the_layers():
    g = graph_of(linear_layer("t", 1000, tp=1.0, ars=2, tp_max=6, out=8.0), linear_layer("p", 1000, out=8.0))
    c = hand_cluster(gpn=4)
    w = graph_workload(g, 8)
    bad = dict(graph_violations(g, c, Plan(tp=4, dp=1), w))
    assert "tp=4 does not divide layer t's tp_max=6" in bad["tp not allowed by the layers"]
    assert "use tp in 1, 2" in bad["tp not allowed by the layers"]
    assert not graph_violations(g, c, Plan(tp=2, dp=2), w)
    g_none = graph_of(linear_layer("p", 1000, out=8.0))
    with pytest.raises(MeshplanError, match="no layer of toy can be split by tensor parallel; use tp=1"):
        estimate_graph(g_none, c, Plan(tp=2, dp=2), w)


def test_pipeline_send_of_the_boundary_output_and_uneven_stages():
    prm = 20_000_000
    outs = [1e6, 3e6, 5e6, 7e6]
    layers = [linear_layer(f"l{i}", prm * (i + 1), out=o) for i, o in enumerate(outs)]
    g = graph_of(*layers)
    c = hand_cluster()
    w = graph_workload(g, 8)
    plan = Plan(pp=2, dp=4, micro_batch=1, stage_layers=(3, 1), p2p_sharded=False)
    r = estimate_graph(g, c, plan, w)
    send = outs[2] / 300e9 + 2e-6  # layer 2's output crosses the boundary: S / B + alpha
    peak = c.gpu.peak("bf16")
    t = [3 * gemm_seconds(2.0 * S * prm * (i + 1), S, D, D, peak) for i in range(4)]
    loss = loss_seconds(outs[3], 1)
    stage = [sum(t[:3]) + send, t[3] + loss + send]  # the activation out of stage 0, its gradient back
    micro = 8 // 4
    assert r.time["pp_comm"] == pytest.approx(micro * send, rel=1e-9)
    assert r.time["bubble"] == pytest.approx(sum(stage) - max(stage), rel=1e-9)
    assert r.time["compute"] == pytest.approx(micro * sum(t[:3]), rel=1e-9)  # stage 0 is critical
    assert r.step_time_s == pytest.approx(micro * max(stage) + sum(stage) - max(stage) + r.time["dp_comm"]
                                          + r.time["optimizer"], rel=1e-9)
    # The other split makes stage 1 critical: compute is then layers 2 and 3 and the loss.
    r2 = estimate_graph(g, c, plan.replace(stage_layers=(2, 2)), w)
    assert r2.time["compute"] == pytest.approx(micro * (t[2] + t[3] + loss), rel=1e-9)
    assert r2.memory_per_stage != r.memory_per_stage


# ======================================================================================
# memory

def test_zero_model_states_and_in_flight_activations():
    prm, saved = 10_000_000, 3e8
    g = graph_of(*(linear_layer(f"l{i}", prm, saved=saved, out=1e6) for i in range(4)))
    c = hand_cluster()
    w = graph_workload(g, 64)
    # Bytes per parameter of a stage (2 layers), sharded over dp = 4: ZeRO-0 2 + 2 + 12; ZeRO-1
    # fp32 main grads 4, Adam 12 / 4; ZeRO-2 grads / 4 too; ZeRO-3 16 / 4, plus (under a pipeline)
    # the unsharded bf16 weights 2 and fp32 grads 4.
    # ZeRO-2 under a pipeline is refused (gradients cannot stay sharded there): on 8-way dp, all
    # 4 layers per GPU, grads 4 / 8 and Adam 12 / 8.
    for zero, per_param, pp in ((0, 2 + 2 + 12, 2), (1, 2 + 4 + 3, 2), (2, 2 + 0.5 + 1.5, 1), (3, 4 + 2 + 4, 2)):
        r = estimate_graph(g, c, Plan(pp=pp, dp=8 // pp, zero=zero, micro_batch=2), w)
        states = (r.memory["weights"] + r.memory["grads"] + r.memory["optimizer"]) * GiB
        assert states == pytest.approx(4 / pp * prm * per_param, rel=1e-9)
    with pytest.raises(MeshplanError, match="zero=2 with pp > 1"):
        estimate_graph(g, c, Plan(pp=2, dp=4, zero=2, micro_batch=2), w)
    # 1F1B: stage 0 holds min(micro, pp - 0) = 2 micro-batches of its 2 layers' saved bytes x 2 samples.
    r = estimate_graph(g, c, Plan(pp=2, dp=4, micro_batch=2), w)
    assert r.memory["activations"] * GiB == pytest.approx(2 * 2 * saved * 2, rel=1e-9)
    # Full recompute keeps each layer's input only: the previous layer's output (layer 0: none).
    rf = estimate_graph(g, c, Plan(pp=2, dp=4, micro_batch=2, recompute="full"), w)
    assert rf.memory_per_stage[0] < r.memory_per_stage[0]
    # stage 0: inputs of layers 0 (none: the batch) and 1 (1e6 per sample) x 2 samples x 2 in flight;
    # stage 1: inputs of layers 2 and 3 x 2 samples x 1 in flight: 4e6 bytes either way.
    assert rf.memory["activations"] * GiB == pytest.approx(4e6, rel=1e-9)
    assert rf.time["recompute"] > 0
    assert rf.hfu > rf.mfu


def test_activation_bytes_follow_the_plan_precision_not_the_trace_dtype():
    def g(trace: str, k: float) -> LayerGraph:
        return graph_of(*(linear_layer(f"l{i}", 10_000_000, saved=1e8 * k, out=1e6 * k, mem=5e7 * k)
                          for i in range(3)), trace=trace)
    c = hand_cluster()
    w = graph_workload(g("float32", 2), 16)
    a = estimate_graph(g("float32", 2), c, Plan(dp=8, micro_batch=2), w)
    b = estimate_graph(g("bfloat16", 1), c, Plan(dp=8, micro_batch=2), w)
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    assert a.memory["activations"] == pytest.approx(b.memory["activations"], rel=1e-12)
    f32 = estimate_graph(g("bfloat16", 1), c, Plan(dp=8, micro_batch=2, precision="fp32"), w)
    assert f32.memory["activations"] == pytest.approx(2 * b.memory["activations"], rel=1e-12)


def test_fits_uses_the_memory_margin():
    g = graph_of(linear_layer("big", 6_000_000_000, out=1e6))
    c = hand_cluster(gpn=1)
    r = estimate_graph(g, c, Plan(), graph_workload(g, 1))
    assert r.peak_memory_gib > r.usable_memory_gib and not r.fits
    assert r.usable_memory_gib == pytest.approx(c.gpu.memory_gib * (1 - P.memory_margin))


# ======================================================================================
# what a layer graph cannot express

@pytest.mark.parametrize("change, words", [
    ({"cp": 2, "dp": 4}, "no attention sequence axis"),
    ({"ep": 2, "dp": 8}, "no experts"),
    ({"recompute": "selective", "dp": 8}, "recompute=full or none"),
    ({"recompute": "op", "dp": 8}, "recompute=full or none"),
    ({"precision": "fp8", "dp": 8}, "use bf16"),
    ({"tp": 2, "dp": 4, "sequence_parallel": True}, "sequence_parallel"),
    ({"pp": 2, "dp": 4, "virtual_stages": 2, "schedule": "interleaved-1f1b", "stage_layers": (2, 2)}, "ambiguous"),
])
def test_unsupported_plans_are_one_line_errors(change, words):
    g = graph_of(*(linear_layer(f"l{i}", 1000, tp=1.0, ars=2, out=8.0) for i in range(4)))
    with pytest.raises(MeshplanError) as e:
        estimate_graph(g, hand_cluster(), Plan(**change), graph_workload(g, 16))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_workload_must_match_the_traced_sample_and_embeddings_stay_first():
    emb = LayerSpec(name="emb", kind="embedding", block="emb", params=1000, fwd_flops=0, bwd_flops=0,
                    saved_bytes=0, output_bytes=8.0)
    head = LayerSpec(name="head", kind="head", block="head", params=1000, fwd_flops=1e6, bwd_flops=2e6,
                     saved_bytes=8.0, output_bytes=8.0)
    g = graph_of(emb, linear_layer("b", 1000, out=8.0), head)
    c = hand_cluster(gpn=2)
    with pytest.raises(MeshplanError, match="traced at 1024; use seq_len=1024"):
        estimate_graph(g, c, Plan(dp=2), Workload(global_batch=2, seq_len=2048))
    w = graph_workload(g, 2)
    why = dict(graph_violations(g, c, Plan(pp=2, stage_layers=(1, 2)), w))
    assert why == {}
    why = dict(graph_violations(g, c, Plan(pp=2, stage_layers=(2, 1)), w))
    assert why == {}
    g2 = graph_of(emb, dataclasses.replace(emb, name="pos"), linear_layer("b", 1000, out=8.0), head)
    why = dict(graph_violations(g2, c, Plan(pp=2, stage_layers=(1, 3)), graph_workload(g2, 2)))
    assert "does not hold embedding layer pos" in why["layers do not split into stages"]


# ======================================================================================
# the same model as a transformer ModelSpec and as a hand-built layer graph

def _gemm_dim(shapes: list[tuple[float, float, float]]) -> float:
    """FLOP-weighted geometric mean of sqrt(n k) over the linear layers (the gemm_dim extra)."""
    fl = np.array([m * n * k for m, n, k in shapes])
    return float(np.exp((fl * np.log([math.sqrt(n * k) for _, n, k in shapes])).sum() / fl.sum()))


def transformer_graph(name: str, s: int) -> LayerGraph:
    """A LayerGraph of a preset transformer with per-layer numbers from the analytical model
    (what ingestion would measure): embedding, blocks, final norm + output projection."""
    m = load_model(name)
    h, V = m.hidden_size, m.vocab_size
    plan1, plan2 = Plan(compile=True), Plan(compile=True, tp=2)
    full1, _ = activation_bytes_per_token(m, plan1, s)
    full2, _ = activation_bytes_per_token(m, plan2, s)
    lin = m.layer_params() - 2 * m.norm_params()
    att = 4.0 * s * s * m.q_dim  # QK^T and AV over the full s x s, as FlopCounterMode counts sdpa
    tp_max = math.gcd(math.gcd(m.num_attention_heads, m.kv_heads), m.ffn_hidden_size)
    extra = {"gemm_dim": _gemm_dim(_linear_shapes(m, plan1, s)), "attention_flops": att, "attention_causal": 1.0,
             "head_dim": float(m.dhead), "mem_bytes": elementwise_bytes(m, plan1, s),
             "tp_saved_fraction": 2 * (full1 - full2) / full1}
    emb = LayerSpec(name="embed", kind="embedding", block="embed", params=m.embedding_params(), fwd_flops=0.0,
                    bwd_flops=0.0, saved_bytes=0.0, output_bytes=2.0 * s * h, tp_style="megatron", tp_fraction=1.0,
                    tp_max=8, tp_allreduces=1, extra={"mem_bytes": 2.0 * s * h * 2})
    blocks = [LayerSpec(name=f"layers.{i}", block="block", params=m.layer_params(), fwd_flops=2.0 * s * lin + att,
                        bwd_flops=4.0 * s * lin + 2.0 * att, saved_bytes=full1 * s, output_bytes=2.0 * s * h,
                        tp_style="megatron", tp_fraction=lin / m.layer_params(), tp_max=tp_max, tp_allreduces=2,
                        extra=extra) for i in range(m.num_layers)]
    vh = V * h
    head = LayerSpec(name="lm_head", kind="head", block="head", params=m.output_params(), fwd_flops=2.0 * s * vh,
                     bwd_flops=4.0 * s * vh, saved_bytes=2.0 * s * h, output_bytes=2.0 * s * V, tp_style="megatron",
                     tp_fraction=min(1.0, vh / m.output_params()), tp_max=8, tp_allreduces=0,
                     extra={"gemm_dim": math.sqrt(vh), "mem_bytes": 0.0})
    return LayerGraph(name=name, source="test", sample_tokens=s, trace_dtype="bfloat16",
                      layers=(emb, *blocks, head), tied_params=vh if m.tied_embeddings else 0)


@pytest.mark.parametrize("name, cluster, batch", [("gpt3-1.3b", "a100-sxm-80gb:8", 32),
                                                  ("llama3-8b", "h100-sxm-80gb:16", 64)])
@pytest.mark.parametrize("plan", ["dp", "zero3", "tp2", "pp2"])
def test_graph_matches_the_transformer_model_within_ten_percent(name, cluster, batch, plan):
    """Where the two differ (all second-order, a few percent at most):
    - GEMM efficiency: the graph uses one representative dimension per layer (the FLOP-weighted
      geometric mean of sqrt(n k)) where estimate() shapes each matrix, and splits it by TP;
    - memory-bound bytes split by TP like the saved activations, not by their own replicated share;
    - the vocab-parallel embedding's all-reduce is counted (estimate() counts none); FSDP gathers
      the embedding and head too, and ZeRO-3's exposed first gather is the embedding's;
    - pipeline sends: one per boundary and direction (the first and last stage pay one, not two);
    - the embedding's output kept on the first stage is the first block's saved input here.
    """
    m, c = load_model(name), load_cluster(cluster)
    g = transformer_graph(name, m.seq_len)
    w = graph_workload(g, batch)
    n = c.num_gpus
    plans = {"dp": Plan(dp=n, compile=True), "zero3": Plan(dp=n, zero=3, compile=True),
             "tp2": Plan(tp=2, dp=n // 2, compile=True),
             "pp2": Plan(pp=2, dp=n // 2, schedule="1f1b", compile=True)}
    p = plans[plan]
    ref = estimate(m, c, p, w)
    half = m.num_layers // 2
    got = estimate_graph(g, c, p.replace(stage_layers=(half + 1, m.num_layers - half + 1)) if p.pp > 1 else p, w)
    assert got.step_time_s == pytest.approx(ref.step_time_s, rel=0.10)
    assert got.peak_memory_gib == pytest.approx(ref.peak_memory_gib, rel=0.10)
    assert got.params == ref.params
    assert got.mfu == pytest.approx(ref.mfu, rel=0.10)


@pytest.mark.parametrize("schedule, ranks, sends", [("interleaved-1f1b", [0, 1, 0, 1], 3), ("zbv", [0, 1, 1, 0], 2)])
def test_virtual_stages_place_chunks_and_send_across_ranks_only(schedule, ranks, sends):
    from meshplan.cost.graph import make_layout
    lay = make_layout(4, 2, 2, schedule, None)
    assert lay.rank.tolist() == ranks and lay.stage_layers == (1, 1, 1, 1)
    out = 4e6
    g = graph_of(*(linear_layer(f"l{i}", 10_000_000, out=out) for i in range(4)))
    r = estimate_graph(g, hand_cluster(gpn=2), Plan(pp=2, virtual_stages=2, schedule=schedule, p2p_sharded=False),
                       graph_workload(g, 4))
    # Every rank pays one send per boundary it touches (zbv's turn stays on rank 1): 4 micro-batches.
    assert r.time["pp_comm"] == pytest.approx(4 * sends * (out / 300e9 + 2e-6), rel=1e-9)


def test_zbv_runs_the_last_layer_and_the_loss_on_rank_0():
    g = graph_of(*(linear_layer(f"l{i}", 10_000_000, out=4e6 if i < 3 else 4e9) for i in range(4)))
    c = hand_cluster(gpn=2)
    w = graph_workload(g, 4)
    zbv = estimate_graph(g, c, Plan(pp=2, virtual_stages=2, schedule="zbv"), w)
    inter = estimate_graph(g, c, Plan(pp=2, virtual_stages=2, schedule="interleaved-1f1b"), w)
    # The 4e9-byte output's logits (14 B per element at the loss) sit with the last layer: rank 0
    # under the V, rank 1 interleaved.
    assert zbv.memory_per_stage[0] > zbv.memory_per_stage[1]
    assert inter.memory_per_stage[1] > inter.memory_per_stage[0]
