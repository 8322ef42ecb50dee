"""Cost model against closed forms: ring collectives, block FLOPs, Megatron/PaLM model FLOPs,
pipeline bubbles, Korthikanti activation memory, ZeRO model states, and estimate() invariants.

Every expectation is written from the formula in the paper or docstring it cites, not from
the implementation; each test is small (the whole file runs in well under a second or two).
"""
from __future__ import annotations

import math

import pytest

from meshplan.cost import DEFAULT_PARAMS, estimate
from meshplan.cost.comm import NCCL_BASE_US, Group
from meshplan.cost.compute import gemm_time
from meshplan.cost.layer import quantities
from meshplan.cost.memory import model_state_bytes
from meshplan.cost.schedule import in_flight, pipeline_time
from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec, LinkTier
from meshplan.spec.io import load_cluster, load_gpu, load_model
from meshplan.spec.plan import Plan, Workload, parse_plan
from meshplan.spec.transformer import block_ops
from meshplan.units import GiB

REL = 1e-12  # float-summation-order tolerance for identities that are exact on paper

_MODELS: dict[str, object] = {}
_CLUSTERS: dict[str, object] = {}


def model(name: str):
    if name not in _MODELS:
        _MODELS[name] = load_model(name)
    return _MODELS[name]


def cluster(name: str):
    if name not in _CLUSTERS:
        _CLUSTERS[name] = load_cluster(name)
    return _CLUSTERS[name]


def hand_cluster(*, nic_gbps: float = 25.0, nodes: int = 4) -> ClusterSpec:
    """8 GPUs per node, intra 400 GB/s at 75 % (300e9 B/s, 2 us), NIC ``nic_gbps`` at 100 % (10 us)."""
    return ClusterSpec(
        name="hand", gpu=load_gpu("h100-sxm-80gb"), num_nodes=nodes, gpus_per_node=8,
        intra_node=LinkTier(name="intra_node", bandwidth_gbps=400.0, latency_us=2.0, efficiency=0.75),
        inter_node=LinkTier(name="inter_node", bandwidth_gbps=nic_gbps, latency_us=10.0, efficiency=1.0))


# ======================================================================================
# comm.Group: ring collectives and placement


@pytest.mark.parametrize("n", [2, 4, 8, 64])
@pytest.mark.parametrize("size", [1.0, 3e6, 1.5e9])
def test_ring_all_reduce_closed_form(n, size):
    bw, alpha = 123e9, 7e-6
    g = Group(n, bw, alpha)
    ar = 2 * (n - 1) / n * size / bw + 2 * (n - 1) * alpha
    base = NCCL_BASE_US[("ring", "simple")] * 1e-6  # NCCL's base latency, once per collective
    assert g.all_reduce(size) == pytest.approx(ar + base, rel=REL)
    assert g.all_gather(size) == pytest.approx(ar / 2 + base, rel=REL)
    assert g.reduce_scatter(size) == pytest.approx(ar / 2 + base, rel=REL)
    assert g.send_recv(size) == pytest.approx(size / bw + alpha, rel=REL)


def test_trivial_group_and_empty_message_cost_nothing():
    assert Group(1, 1e9, 1e-5).all_reduce(1e9) == 0.0
    assert Group(8, 1e9, 1e-5).all_reduce(0.0) == 0.0
    assert Group(8, 1e9, 1e-5).send_recv(0.0) == 0.0


def test_group_within_a_node_uses_intra_tier():
    c = hand_cluster()
    for n, stride in [(8, 1), (4, 2), (2, 4), (2, 1)]:
        g = Group.of(c, n, stride)
        assert g.n == n
        assert g.bytes_per_s == pytest.approx(300e9, rel=REL)
        assert g.latency_s == pytest.approx(2e-6, rel=REL)


def test_group_one_member_per_node_uses_nic():
    c = hand_cluster(nic_gbps=25.0)
    g = Group.of(c, 16, 8)
    assert g.bytes_per_s == pytest.approx(25e9, rel=REL)
    assert g.latency_s == pytest.approx(10e-6, rel=REL)
    assert Group.of(c, 4, 8).bytes_per_s == pytest.approx(25e9, rel=REL)


@pytest.mark.parametrize("nic, expected", [(25.0, 8 * 25e9), (50.0, 300e9)])
def test_group_eight_per_node_gets_min_of_intra_and_eight_nics(nic, expected):
    """16 consecutive ranks: 8 per node, 8 parallel rings -> min(intra, 8 x NIC)."""
    g = Group.of(hand_cluster(nic_gbps=nic), 16, 1)
    assert g.bytes_per_s == pytest.approx(expected, rel=REL)
    assert g.latency_s == pytest.approx(10e-6, rel=REL)


def test_group_partial_members_per_node():
    """Stride 2 over 16 ranks x 2 = 32: 4 members per node -> min(intra, 4 x NIC)."""
    g = Group.of(hand_cluster(nic_gbps=25.0), 16, 2)
    assert g.bytes_per_s == pytest.approx(4 * 25e9, rel=REL)


def test_preset_cluster_tiers():
    """h100-sxm-80gb: NVSwitch 450 GB/s and NDR 50 GB/s, each x its link kind's calibrated efficiency."""
    from meshplan.builtin_calibration import builtin_link_value
    nvl = builtin_link_value("intra_node", "nvswitch")
    nic = builtin_link_value("inter_node", "infiniband")
    c = cluster("h100-sxm-80gb:64")
    assert Group.of(c, 8, 1).bytes_per_s == pytest.approx(450e9 * nvl, rel=REL)
    assert Group.of(c, 8, 8).bytes_per_s == pytest.approx(50e9 * nic, rel=REL)
    assert Group.of(c, 16, 1).bytes_per_s == pytest.approx(min(450e9 * nvl, 8 * 50e9 * nic), rel=REL)


# ======================================================================================
# compute: per-block FLOPs and backward split


def _linear_weights(m) -> int:
    """Weights of one block's linear layers (no biases, no norms): QKV, out, MLP."""
    h = m.hidden_size
    return h * m.q_dim + 2 * h * m.kv_dim + m.q_dim * h + m.mlp_matrices * h * m.ffn_hidden_size


def block_q(m, plan: Plan, s: int, gpu) -> dict[str, float]:
    """One transformer block's per-micro-batch quantities (cost.layer on spec.transformer's ops)."""
    return quantities(block_ops(m), plan, s, gpu, DEFAULT_PARAMS)


def acts_per_token(m, plan: Plan, s: int) -> tuple[float, float]:
    """(saved bytes per token of one block without recompute, of its input). Without
    FlashAttention the attention is Megatron's fused softmax, as in Korthikanti et al. (the
    megatron profile's kernel: softmax output 2 B + dropout mask 1 B + the scores 2 B)."""
    p = DEFAULT_PARAMS.replace(attention_kernel="fused-softmax")
    q = quantities(block_ops(m), plan, s, load_gpu("h100-sxm-80gb"), p)
    return q["full"], q["inp"]


def _hand_linear_shapes(m, tp: int, tokens: float):
    h, f, mats_in = m.hidden_size, m.ffn_hidden_size, m.mlp_matrices - 1
    return [(tokens, (m.q_dim + 2 * m.kv_dim) / tp, h), (tokens, h, m.q_dim / tp),
            (tokens, mats_in * f / tp, h), (tokens, h, f / tp)]


BLOCK_CASES = [("gpt3-1.3b", tp, cp) for tp in (1, 2, 8) for cp in (1,)] + \
              [("llama3-8b", tp, cp) for tp in (1, 2, 8) for cp in (1,)] + \
              [("gpt3-1.3b", 2, 2), ("llama3-8b", 8, 2)]


@pytest.mark.parametrize("name, tp, cp", BLOCK_CASES)
@pytest.mark.parametrize("flash", [True, False])
def test_block_forward_flops(name, tp, cp, flash):
    m = model(name)
    b, s = 2, 2048
    plan = Plan(tp=tp, cp=cp, micro_batch=b, flash_attention=flash)
    blk = block_q(m, plan, s, load_gpu("h100-sxm-80gb"))
    T = b * s / cp
    expected = 2 * T * _linear_weights(m) / tp + 4 * b * s * s * m.q_dim / (tp * cp)
    assert blk["flops"] == pytest.approx(expected, rel=1e-12)
    if m.num_attention_heads == m.kv_heads and m.mlp_matrices == 2:  # GPT: 24 h^2 + 4 s h per token
        h = m.hidden_size
        assert blk["flops"] == pytest.approx(T * (24 * h * h + 4 * s * h) / tp, rel=1e-12)


@pytest.mark.parametrize("name, tp, cp", BLOCK_CASES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_backward_weight_pass_equals_linear_forward(name, tp, cp, precision):
    m, gpu = model(name), load_gpu("h100-sxm-80gb")
    b, s = 1, 4096
    plan = Plan(tp=tp, cp=cp, micro_batch=b, precision=precision)
    blk = block_q(m, plan, s, gpu)
    peak = gpu.peak(precision)
    lin = sum(gemm_time(mm, n, k, peak, gpu, DEFAULT_PARAMS)
              for mm, n, k in _hand_linear_shapes(m, tp, b * s / cp))
    assert blk["bw"] == pytest.approx(lin, rel=1e-12)
    # input gradients redo the linear FLOPs plus attention/elementwise backward: strictly more
    assert blk["bi"] > blk["bw"]
    assert blk["f"] > lin  # forward = linears + attention core + elementwise


def test_recompute_extra_work_per_mode():
    m, gpu = model("llama3-8b"), load_gpu("h100-sxm-80gb")
    base = Plan(tp=2, micro_batch=1)
    t = {r: block_q(m, base.replace(recompute=r), 8192, gpu) for r in ("none", "selective", "op", "full")}
    assert t["none"]["rc"] == 0.0 and t["none"]["rc_flops"] == 0.0
    assert t["full"]["rc"] == pytest.approx(t["full"]["f"], rel=REL)
    assert t["full"]["rc_flops"] == pytest.approx(t["full"]["flops"], rel=REL)
    assert 0 < t["selective"]["rc"] < t["op"]["rc"] < t["full"]["rc"]
    for r in t.values():  # recompute never changes model FLOPs
        assert r["flops"] == t["none"]["flops"]


# ======================================================================================
# whole-step model FLOPs (Megatron / PaLM convention)


def _report_model_flops(r) -> float:
    return r.tflops_per_gpu * 1e12 * r.step_time_s * r.num_gpus


def test_gpt3_175b_model_flops_match_narayanan():
    """F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per step (Narayanan et al. 2021, Eq. 3)."""
    m = model("gpt3-175b")
    B, s, l, h, V = 1536, 2048, m.num_layers, m.hidden_size, m.vocab_size
    plan = parse_plan("tp=8,pp=16,dp=8,schedule=interleaved-1f1b,virtual_stages=2,"
                      "recompute=selective,sequence_parallel=1")
    r = estimate(m, cluster("a100-sxm-80gb:1024"), plan, Workload(global_batch=B, seq_len=s))
    F = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert _report_model_flops(r) == pytest.approx(F, rel=0.01)
    assert _report_model_flops(r) == pytest.approx(F, rel=1e-9)  # exact for q = h, f = 4h
    assert r.mfu == pytest.approx(r.tflops_per_gpu * 1e12 / 312e12, rel=1e-12)


def test_llama3_8b_model_flops_6n_plus_12lhs():
    """tokens x (6 N_linear + 6 V h + 12 l q s): GQA and SwiGLU counted by their real weights."""
    m = model("llama3-8b")
    B, s = 32, 8192
    r = estimate(m, cluster("h100-sxm-80gb:8"), parse_plan("tp=1,dp=8,zero=3"),
                 Workload(global_batch=B, seq_len=s))
    n_lin = m.num_layers * _linear_weights(m)
    F = B * s * (6 * n_lin + 6 * m.vocab_size * m.hidden_size + 12 * m.num_layers * m.q_dim * s)
    assert _report_model_flops(r) == pytest.approx(F, rel=1e-9)


@pytest.mark.parametrize("plan", [
    "tp=1,dp=8,zero=3", "tp=1,dp=8,zero=3,micro_batch=4", "tp=2,pp=2,dp=2,sequence_parallel=1",
    "tp=8,dp=1,recompute=full", "tp=2,dp=2,cp=2,zero=3", "tp=1,pp=4,dp=2,schedule=gpipe",
])
def test_model_flops_do_not_depend_on_the_plan(plan):
    m, c, w = model("llama3-8b"), cluster("h100-sxm-80gb:8"), Workload(global_batch=32, seq_len=8192)
    ref = _report_model_flops(estimate(m, c, parse_plan("tp=1,dp=8,zero=3"), w))
    r = estimate(m, c, parse_plan(plan), w)
    assert _report_model_flops(r) == pytest.approx(ref, rel=1e-9)
    assert r.hfu >= r.mfu


def test_moe_model_flops_do_not_depend_on_tp():
    m, c = model("mixtral-8x7b"), cluster("h100-sxm-80gb:64")
    w = Workload(global_batch=256, seq_len=4096)
    ref = _report_model_flops(estimate(m, c, parse_plan("tp=1,dp=64,zero=3"), w))
    r = estimate(m, c, parse_plan("tp=8,dp=8,zero=3"), w)
    assert _report_model_flops(r) == pytest.approx(ref, rel=1e-9)


# ======================================================================================
# pipeline schedules


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (8, 32), (4, 3)])
def test_1f1b_bubble_is_pp_minus_1_over_m(pp, m):
    T = 0.37
    busy, bubble = pipeline_time([T] * pp, m, Plan(pp=pp, schedule="1f1b"), 1 / 3)
    assert busy == pytest.approx(m * T, rel=REL)
    assert bubble / busy == pytest.approx((pp - 1) / m, rel=1e-12)
    g_busy, g_bubble = pipeline_time([T] * pp, m, Plan(pp=pp, schedule="gpipe"), 1 / 3)
    assert (g_busy, g_bubble) == pytest.approx((busy, bubble), rel=REL)


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_divides_bubble_by_virtual_stages(v):
    pp, m, T = 4, 8, 0.25
    _, base = pipeline_time([T] * pp, m, Plan(pp=pp), 0.3)
    busy, bubble = pipeline_time([T] * pp, m,
                                 Plan(pp=pp, virtual_stages=v, schedule="interleaved-1f1b"), 0.3)
    assert busy == pytest.approx(m * T, rel=REL)
    assert bubble == pytest.approx(base / v, rel=1e-12)
    assert bubble / busy == pytest.approx((pp - 1) / (v * m), rel=1e-12)


def test_nonuniform_stages_bubble():
    """m max T + (sum T - max T) for 1F1B."""
    T = [1.0, 2.0, 1.5, 0.5]
    busy, bubble = pipeline_time(T, 6, Plan(pp=4), 0.3)
    assert busy == pytest.approx(12.0) and bubble == pytest.approx(3.0)


@pytest.mark.parametrize("f,w", [(0.3, 0.1), (1 / 3, 1 / 3), (0.25, 0.2), (0.2, 0.15)])
def test_zero_bubble_smaller_than_1f1b(f, w):
    """Uniform stages, F + B + W = T, W <= F <= B, m >= 2 pp - 1. ZB-H1: (pp - 1)(F + B - W)
    (Qi et al. 2024, and torch's order). ZBV, per chunk f, b, w (half a rank): (pp - 1) max(b,
    2 (b - w)) in torch's ScheduleZBVZeroBubble order; it is ZB-H1's halved only when F = B = W
    (the form the cost model used before, wrong otherwise)."""
    pp, m, T = 4, 8, 1.0
    F, W = f * T, w * T
    B = T - F - W
    passes = [(F, B, W)] * pp
    _, b1 = pipeline_time([T] * pp, m, Plan(pp=pp), w)
    _, bz = pipeline_time([T] * pp, m, Plan(pp=pp, schedule="zero-bubble"), w, passes)
    _, bv = pipeline_time([T] * pp, m, Plan(pp=pp, virtual_stages=2, schedule="zbv"), w, passes)
    assert bz < b1
    assert bz == pytest.approx((pp - 1) * (F + B - W), rel=1e-12)
    assert bv == pytest.approx((pp - 1) * max(B / 2, 2 * (B / 2 - W / 2)), rel=1e-12)
    if w == pytest.approx(1 / 3):  # F = B = W: one third of 1F1B, ZBV one sixth
        assert bz == pytest.approx(b1 / 3, rel=1e-12)
        assert bv == pytest.approx(bz / 2, rel=1e-12)
    # without the pass split: the uniform-stage forms of the paper (no m term)
    _, old_z = pipeline_time([T] * pp, m, Plan(pp=pp, schedule="zero-bubble"), w)
    assert old_z == pytest.approx(b1 * (1 - 2 * w), rel=1e-12)


@pytest.mark.parametrize("pp, m", [(4, 1), (4, 2), (4, 4), (4, 6), (8, 8)])
def test_split_backward_bubble_grows_when_few_microbatches(pp, m):
    """Fewer micro-batches than the warm-up: ZB-H1 (pp - 1)(F + B) - (min(m, pp) - 1) W; ZBV
    (m <= pp) 2 (pp - 1)(f + b) - 2 (m - 1) f per chunk: at m = 1 every pass waits for the
    whole round trip (twice the 1F1B bubble of one chunk)."""
    F, B, W = 0.25, 0.5, 0.2
    passes = [(F, B, W)] * pp
    T = F + B + W
    _, bz = pipeline_time([T] * pp, m, Plan(pp=pp, schedule="zero-bubble"), W / T, passes)
    _, bv = pipeline_time([T] * pp, m, Plan(pp=pp, virtual_stages=2, schedule="zbv"), W / T, passes)
    assert bz == pytest.approx((pp - 1) * (F + B) - (min(m, pp) - 1) * W, rel=1e-12)
    if m <= pp:
        assert bv == pytest.approx(2 * (pp - 1) * (F / 2 + B / 2) - 2 * (m - 1) * F / 2, rel=1e-12)


def test_no_bubble_without_pipeline():
    assert pipeline_time([2.0], 16, Plan(pp=1), 0.3) == (32.0, 0.0)


@pytest.mark.parametrize("pp, m", [(4, 8), (4, 2), (8, 8), (2, 16)])
def test_in_flight_microbatches(pp, m):
    p = Plan(pp=pp)
    assert in_flight(p, 0, m) == min(m, pp)
    assert in_flight(p, pp - 1, m) == 1
    for i in range(pp):
        assert in_flight(p, i, m) == min(m, pp - i)
        assert in_flight(Plan(pp=pp, schedule="gpipe"), i, m) == m
        # torch's orders: ZB-H1 keeps a micro-batch until its (late) W; ZBV chunks are half a rank
        assert in_flight(Plan(pp=pp, schedule="zero-bubble"), i, m) == min(m, pp)
        assert in_flight(Plan(pp=pp, virtual_stages=2, schedule="zbv"), i, m) == min(2 * m, m + i + 1, 2 * pp) / 2
    assert in_flight(Plan(pp=1), 0, m) == 1


def test_interleaved_in_flight_first_stage_korthikanti():
    """First stage of interleaved 1F1B holds pp (1 + (pp-1)/(pp v)) micro-batches' worth."""
    pp, v, m = 4, 2, 16
    got = in_flight(Plan(pp=pp, virtual_stages=v, schedule="interleaved-1f1b"), 0, m)
    assert got == pytest.approx(pp * (1 + (pp - 1) / (pp * v)), rel=1e-12)


# ======================================================================================
# memory: Korthikanti et al. 2022 activations, ZeRO model states


GPT_MODELS = ["gpt3-175b", "gpt3-1.3b"]


@pytest.mark.parametrize("name", GPT_MODELS)
@pytest.mark.parametrize("s", [1024, 2048])
def test_activation_no_parallelism_korthikanti_eq1(name, s):
    """s b h (34 + 5 a s / h) per layer -> 34 h + 5 a s bytes per token."""
    m = model(name)
    assert m.dropout
    full, inp = acts_per_token(m, Plan(flash_attention=False), s)
    h, a = m.hidden_size, m.num_attention_heads
    assert full == pytest.approx(34 * h + 5 * a * s, rel=1e-12)
    assert inp == pytest.approx(2 * h, rel=1e-12)


@pytest.mark.parametrize("name", GPT_MODELS)
@pytest.mark.parametrize("t", [2, 4, 8])
def test_activation_tensor_parallel_korthikanti(name, t):
    m, s = model(name), 2048
    h, a = m.hidden_size, m.num_attention_heads
    # TP only (Eq. 2): s b h (10 + 24/t + 5 a s/(h t))
    full, _ = acts_per_token(m, Plan(tp=t, flash_attention=False), s)
    assert full == pytest.approx(10 * h + 24 * h / t + 5 * a * s / t, rel=1e-12)
    # TP + SP (Eq. 4): s b h / t (34 + 5 a s / h)
    full, inp = acts_per_token(
        m, Plan(tp=t, sequence_parallel=True, flash_attention=False), s)
    assert full == pytest.approx(34 * h / t + 5 * a * s / t, rel=1e-12)
    assert inp == pytest.approx(2 * h / t, rel=1e-12)
    # TP + SP + selective recompute (Eq. 6): 34 s b h / t
    full, _ = acts_per_token(
        m, Plan(tp=t, sequence_parallel=True, flash_attention=False, recompute="selective"), s)
    assert full == pytest.approx(34 * h / t, rel=1e-12)


@pytest.mark.parametrize("name", GPT_MODELS)
def test_full_recompute_keeps_block_input(name):
    """The assembled activations of one rank (pp = 1: embedding output + every block): full
    recompute keeps each block's input, recompute_layers=r keeps r inputs and L - r whole blocks,
    SP shards the inputs; the recomputed block is the transient."""
    m, s, b = model(name).replace(num_layers=6), 2048, 2
    L, tokens, h = 6, b * s, m.hidden_size
    cluster = load_cluster("h100-sxm-80gb:8")
    work = Workload(global_batch=8 * b, seq_len=s)

    def acts(plan: Plan) -> float:
        p = DEFAULT_PARAMS.replace(attention_kernel="fused-softmax")  # as acts_per_token
        return estimate(m, cluster, plan, work, p).memory["activations"] * GiB

    emb = tokens * 2 * h  # the embedding's output, kept for its backward
    plan = Plan(dp=8, micro_batch=b, recompute="full", flash_attention=False)
    full, _ = acts_per_token(m, plan, s)
    assert acts(plan) == pytest.approx(emb + tokens * L * 2 * h, rel=1e-12)
    assert acts(plan.replace(recompute_layers=2)) == pytest.approx(emb + tokens * (2 * 2 * h + (L - 2) * full),
                                                                   rel=1e-12)
    sp = Plan(tp=8, micro_batch=b, recompute="full", flash_attention=False, sequence_parallel=True)
    assert acts(sp) == pytest.approx(emb + tokens * L * 2 * h / 8, rel=1e-12)
    none = plan.replace(recompute="none")
    full_none, _ = acts_per_token(m, none, s)
    assert acts(none) == pytest.approx(emb + tokens * L * full_none, rel=1e-12)


def test_activation_scores_with_context_parallel_span_full_sequence():
    m, s, cp = model("gpt3-1.3b"), 2048, 2
    h, a = m.hidden_size, m.num_attention_heads
    full, _ = acts_per_token(m, Plan(cp=cp, flash_attention=False), s)
    assert full == pytest.approx(34 * h + 5 * a * s, rel=1e-12)


@pytest.mark.parametrize("N", [1, 8, 64])
def test_zero_model_state_bytes_per_parameter(N):
    """Bytes/param, memory.py: ZeRO-0 2+2+12; -1 2+4+12/N; -2 2+(4+12)/N; -3 16/N + gathered
    (N = 1: all ZeRO-0's)."""
    P, lp, p = 1.0e9, 2.5e7, DEFAULT_PARAMS
    expected = {0: (2, 2, 12), 1: (2, 4, 12 / N), 2: (2, 4 / N, 12 / N), 3: (4 / N, 4 / N, 8 / N)}
    if N == 1:  # nothing to shard across: every ZeRO level is ZeRO-0's memory (issue 27 cause 5)
        expected = {z: (2, 2, 12) for z in expected}
    for z, (w_b, g_b, o_b) in expected.items():
        plan = Plan(dp=N, zero=z)
        w, g, o, tr = model_state_bytes(P, lp, plan, p)
        assert (w, g, o) == pytest.approx((w_b * P, g_b * P, o_b * P), rel=1e-12), z
        if z == 3 and N > 1:
            gathered = (1 + p.fsdp_prefetch_layers) * lp * 2 + lp * 4
            assert tr == pytest.approx(gathered, rel=1e-12)
            assert (w + g + o) / P == pytest.approx(16 / N, rel=1e-12)
        else:
            assert tr == (2 * p.dp_bucket_mib * 2**20 if N > 1 else 0.0)
    assert model_state_bytes(P, lp, Plan(dp=8, zero=1, offload_optimizer=True), p)[2] == 0.0


def test_zero_shards_over_hybrid_group():
    P, lp = 1.0e9, 2.5e7
    w, g, o, _ = model_state_bytes(P, lp, Plan(dp=64, zero=3, shard_group=8), DEFAULT_PARAMS)
    assert w + g + o == pytest.approx(16 * P / 8, rel=1e-12)


# ======================================================================================
# estimate(): monotonicity, accounting, fit, errors


W8B = Workload(global_batch=32, seq_len=8192)


def _est(plan: str, *, name: str = "llama3-8b", cl: str = "h100-sxm-80gb:8", work=W8B):
    return estimate(model(name), cluster(cl), parse_plan(plan), work)


def test_full_recompute_trades_time_for_memory():
    none, full = _est("tp=1,dp=8,zero=3"), _est("tp=1,dp=8,zero=3,recompute=full")
    assert full.memory["activations"] < none.memory["activations"]
    assert full.peak_memory_gib < none.peak_memory_gib
    assert full.step_time_s > none.step_time_s
    assert full.time["recompute"] > 0.0 == none.time["recompute"]
    assert full.hfu > full.mfu and none.hfu == pytest.approx(none.mfu, rel=1e-12)


def test_bigger_micro_batch_holds_more_activations():
    a = [_est(f"tp=1,dp=8,zero=3,micro_batch={b}").memory["activations"] for b in (1, 2, 4)]
    assert a[0] < a[1] < a[2]
    assert a[1] == pytest.approx(2 * a[0], rel=1e-9)  # activations are linear in tokens


def test_more_microbatches_shrink_bubble_share():
    shares = []
    for B in (8, 16, 32, 64):
        r = _est("tp=2,pp=2,dp=2,sequence_parallel=1", work=Workload(global_batch=B, seq_len=8192))
        assert r.microbatches == B // 2
        shares.append(r.time["bubble"] / r.step_time_s)
    assert all(x > y for x, y in zip(shares, shares[1:]))
    assert shares[-1] > 0.0


def test_does_not_fit_when_peak_exceeds_usable():
    r = _est("tp=1,dp=8,zero=0", name="llama3-70b")
    assert r.peak_memory_gib > r.usable_memory_gib
    assert r.fits is False
    assert r.usable_memory_gib == pytest.approx(79.6 * (1 - DEFAULT_PARAMS.memory_margin), rel=1e-12)
    ok = _est("tp=1,dp=8,zero=3,recompute=full")
    assert ok.fits is True and ok.peak_memory_gib <= ok.usable_memory_gib


@pytest.mark.parametrize("plan, name, cl", [
    ("tp=1,dp=8,zero=3", "llama3-8b", "h100-sxm-80gb:8"),
    ("tp=2,pp=2,dp=2,sequence_parallel=1,recompute=selective", "llama3-8b", "h100-sxm-80gb:8"),
    ("tp=2,pp=4,dp=1,virtual_stages=2,schedule=interleaved-1f1b", "llama3-8b", "h100-sxm-80gb:8"),
    ("tp=1,pp=2,dp=4,zero=1,schedule=zero-bubble,recompute=full", "llama3-8b", "h100-sxm-80gb:8"),
    ("tp=2,dp=2,cp=2,zero=3,async_tp=1", "llama3-8b", "h100-sxm-80gb:8"),
    ("tp=8,pp=8,dp=8,schedule=interleaved-1f1b,virtual_stages=5,sequence_parallel=1",
     "llama3-70b", "h100-sxm-80gb:512"),
    ("tp=8,pp=16,dp=8,recompute=full,zero=1", "gpt3-175b", "a100-sxm-80gb:1024"),
])
def test_exposed_time_terms_sum_to_step_time(plan, name, cl):
    w = Workload(global_batch=512, seq_len=2048) if name != "llama3-8b" else W8B
    r = _est(plan, name=name, cl=cl, work=w)
    exposed = sum(v for k, v in r.time.items() if not k.endswith("_overlapped"))
    assert math.isclose(exposed, r.step_time_s, rel_tol=1e-9)
    assert all(v >= 0.0 for v in r.time.values())
    assert r.dominant in r.time and not r.dominant.endswith("_overlapped")
    assert r.tokens_per_s == pytest.approx(w.tokens / r.step_time_s, rel=1e-12)
    assert r.memory["total"] == pytest.approx(r.peak_memory_gib, rel=1e-12)
    assert r.peak_memory_gib == pytest.approx(max(r.memory_per_stage), rel=1e-12)


def test_impossible_tp_raises_naming_tp():
    with pytest.raises(MeshplanError, match=r"tp=3"):
        _est("tp=3,dp=8", name="llama3-8b", cl="h100-sxm-80gb:24")
    with pytest.raises(MeshplanError, match=r"tp=3"):
        _est("tp=3,dp=8")  # and the GPU count is wrong as well: both named


@pytest.mark.parametrize("comm,compute,slowdown,expected", [
    (2.0, 5.0, 0.0, 0.0),   # hidden: nothing exposed
    (7.0, 5.0, 0.0, 2.0),   # the part the compute cannot hide
    (2.0, 5.0, 0.3, 0.6),   # hidden, but the compute slows while they share the GPU
    (7.0, 5.0, 0.3, 2.0),   # the uncovered part dominates the slowdown (0.3 x 5 = 1.5)
    (7.0, 5.0, 0.5, 2.5),   # ... unless the slowdown is larger
    (0.0, 5.0, 0.3, 0.0)])
def test_exposed_under_closed_form(comm, compute, slowdown, expected):
    from meshplan.cost.comm import exposed_under
    assert float(exposed_under(comm, compute, slowdown)) == pytest.approx(expected)


def test_overlap_slowdown_adds_exposed_fsdp_time():
    """With FSDP traffic under the compute, a positive slowdown lengthens the step by
    slowdown x the overlapped time (nothing at 0)."""
    m, c = model("llama3-8b"), hand_cluster(nodes=2)
    plan = Plan(tp=1, pp=1, dp=16, zero=3, micro_batch=1)
    w = Workload(global_batch=16, seq_len=4096)
    base = estimate(m, c, plan, w, params=DEFAULT_PARAMS.replace(overlap_slowdown=0.0))
    slow = estimate(m, c, plan, w, params=DEFAULT_PARAMS.replace(overlap_slowdown=0.2))
    assert base.time["dp_comm_overlapped"] > 0
    assert slow.step_time_s > base.step_time_s
    assert slow.step_time_s - base.step_time_s == pytest.approx(
        0.2 * base.time["dp_comm_overlapped"], rel=0.05)


def test_group_fast_path_matches_the_vectorised_path():
    """Group.of memoises one-plan groups; the result equals the array path bit for bit, and a
    cluster with other link efficiencies does not reuse another's entry."""
    import numpy as np
    a = hand_cluster(nodes=4)
    b = a.replace(inter_node=LinkTier(**{**a.inter_node.__dict__, "efficiency": a.inter_node.efficiency / 2}))
    ns, strides = np.array([1, 2, 4, 8, 16, 32]), np.array([1, 2, 8, 1, 4, 1])
    for cl in (a, b):
        vec = Group.of(cl, ns, strides)
        for i, (n, s) in enumerate(zip(ns, strides)):
            one = Group.of(cl, np.array([n]), np.array([s]))
            assert one.bytes_per_s[0] == vec.bytes_per_s[i] and one.latency_s[0] == vec.latency_s[i]
    assert Group.of(b, 32, 1).bytes_per_s < Group.of(a, 32, 1).bytes_per_s
