"""Memory per GPU for each pipeline stage: model states, activations, transients.

Model states per parameter (mixed-precision Adam, Rajbhandari et al. 2020):
  ZeRO 0-2 (Megatron/DeepSpeed style): bf16 weights 2 B, grads 2 B (fp32 4 B with a
  distributed optimizer), fp32 master + Adam m, v 12 B; ZeRO-1 shards the 12 B, ZeRO-2 also
  the grads. ZeRO-3/FSDP: fp32 sharded params 4 B + fp32 grads 4 B + Adam 8 B, all sharded,
  plus the bf16 unsharded copies of the layers being computed.
Activations per token per block follow Korthikanti et al. 2022 Eq. 2 (34 s b h for GPT
with TP/SP splits), generalised to GQA, SwiGLU, rotary and FlashAttention (no s x s terms).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

Num = Any  # a float, or a numpy array of one value per plan (and per stage)

LOGITS_BYTES_PER_ELEM = 14.0
"""Bytes per logit element alive at the start of the loss backward: bf16 logits 2 + fp32
upcast 4 + fp32 log-softmax kept for backward 4 + its fp32 gradient 4 (PyTorch cross_entropy
on upcast logits, as torchtitan; Megatron's vocab-parallel CE alike). Checked against
torchtitan's measured peaks (shared/data rows 77-86)."""
VOCAB_PARALLEL_LOGITS_BYTES_PER_ELEM = 20.0
"""FITTED (torchtitan rows 87-88, TP=8). The same when the loss runs on vocabulary-sharded
logits (tp > 1: torchtitan's loss_parallel, Megatron's vocab-parallel cross-entropy): the
log-softmax is decomposed into separate ops (max-subtract, exp, sum, log), each holding a
full-size fp32 tensor for a while (~1.5 more than the single-kernel path)."""
FUSED_LOGITS_BYTES_PER_ELEM = 4.0
"""The same with a fused cross-entropy: bf16 logits 2 + their gradient written in place 2."""


def usable_gib(cluster: ClusterSpec, p: CostParams = DEFAULT_PARAMS) -> float:
    """Memory a plan may use to 'fit' (the cost model's definition): HBM less the margin."""
    return cluster.gpu.memory_gib * (1 - p.memory_margin)


def fit_verdicts(peak_gib: Num, usable: float, p: CostParams) -> tuple[Num, Num]:
    """(fits, at_risk): the peak fits the usable memory; it fits, but within the memory model's
    demonstrated error (CostParams.memory_error) of it."""
    fits = peak_gib <= usable
    return fits, fits & (peak_gib * (1 + p.memory_error) > usable)


def activation_bytes_per_token(model: ModelSpec, plan: Plan, seq_len: int) -> tuple[float, float]:
    """(saved bytes per token of one block with no recompute, bytes of the block input).

    Replicated parts (norm inputs/outputs, dropout masks) are split by TP only with sequence
    parallel; the rest is split by TP."""
    h, t = model.hidden_size, plan.tp
    sp = t if plan.sequence_parallel else 1
    dropout = 1 if model.dropout else 0  # 1-byte dropout masks
    rep = 2 * h + 2 * h + dropout * h + 2 * h + 2 * h + dropout * h
    f = (model.expert_ffn * model.experts_per_token) if model.is_moe else model.ffn_hidden_size
    split = 2 * (model.q_dim + 2 * model.kv_dim) + 2 * model.q_dim
    if model.position == "rotary" and not plan.compile:
        split += 2 * (model.q_dim + model.kv_dim)
    if model.mlp_type == "swiglu":
        split += (6 if plan.compile else 8) * f
    else:
        split += 4 * f
    if not plan.flash_attention and plan.recompute not in ("selective", "full"):
        split += 5 * model.num_attention_heads * seq_len  # scores over all s keys: softmax, mask, dropout
    layer_input = 2 * h / sp
    return rep / sp + split / t, layer_input


def op_sac_bytes_per_token(model: ModelSpec, plan: Plan) -> float:
    """Saved bytes per token under torchtitan op-level SAC: block input, every other matmul
    output (wq, wv, w1, w2 for Llama order wq wk wv wo w1 w3 w2) and the attention output."""
    h, t = model.hidden_size, plan.tp
    sp = t if plan.sequence_parallel else 1
    f = (model.expert_ffn * model.experts_per_token) if model.is_moe else model.ffn_hidden_size
    return 2 * h / sp + (2 * model.q_dim + 2 * model.kv_dim + 2 * f + 2 * h + 2 * model.q_dim) / t


def kept_activation_bytes(tokens: Num, layers: Num, recompute: Num, recompute_layers: Num,
                          full: Num, inp: Num, op: Num) -> tuple[Num, Num]:
    """(bytes kept per micro-batch for ``layers`` blocks, transient bytes of one block being
    recomputed/back-propagated). Per-token block bytes ``full`` (no recompute), ``inp`` (the
    block input) and ``op`` (op-level SAC); recompute_layers < 0 means all blocks."""
    rec, opm = recompute == "full", recompute == "op"
    r = np.where(recompute_layers >= 0, np.minimum(layers, recompute_layers), layers)
    kept = tokens * np.where(rec, r * inp + (layers - r) * full, layers * np.where(opm, op, full))
    return kept, np.where(rec | opm, tokens * full, 0.0)


def block_activation_bytes(model: ModelSpec, plan: Plan, seq_len: int, layers: int) -> tuple[float, float]:
    """kept_activation_bytes for one plan."""
    full, inp = activation_bytes_per_token(model, plan, seq_len)
    rl = -1 if plan.recompute_layers is None else plan.recompute_layers
    kept, transient = kept_activation_bytes(plan.micro_batch * seq_len / plan.cp, layers,
                                            np.asarray(plan.recompute), rl, full, inp,
                                            op_sac_bytes_per_token(model, plan))
    return float(kept), float(transient)


def model_state_arrays(params: Num, layer_params: Num, zero: Num, shard: Num, offload_params: Num,
                       offload_optimizer: Num, dp_cp: Num, p: CostParams) -> tuple[Num, Num, Num, Num]:
    """(weights, grads, optimizer, transient) bytes for ``params`` parameters held by one GPU
    before ZeRO sharding over ``shard`` ranks; ``layer_params`` for FSDP's gathered copies."""
    z3 = zero == 3
    w = np.where(z3, np.where(offload_params, 0, 4 * params / shard), 2 * params)
    g = np.where(z3, 4 * params / shard, np.where(zero >= 1, 4, 2) * params / np.where(zero >= 2, shard, 1))
    o = np.where(offload_optimizer, 0, np.where(z3, 8 * params / shard, 12 * params / np.where(zero >= 1, shard, 1)))
    gathered = (1 + p.fsdp_prefetch_layers) * layer_params * 2.0 + layer_params * 4.0
    buckets = np.where(dp_cp > 1, 2 * p.dp_bucket_mib * 2**20, 0.0)
    return w, g, o, np.where(z3, gathered, buckets)


def output_layer_static_bytes(model: ModelSpec, plan: Plan, work: Workload, p: CostParams) -> float:
    """Bytes a pipeline stage's memory carries for holding the final norm and the output
    projection (pp > 1): their model states (a separate copy when embeddings are tied), and
    the logits' transient at the loss beyond a block's, times (1 + fragmentation). The same
    pieces as cost.batch._memory; sim.build has the same function (a test checks they agree)."""
    n = (model.norm_params() + model.vocab_size * model.hidden_size) / plan.tp
    w, g, o, _ = model_state_bytes(n, 0.0, plan, p)
    states = w + g + o + (6.0 * n if plan.zero == 3 and plan.pp > 1 else 0.0)  # pipelined FSDP's copies
    tokens = plan.micro_batch * work.seq_len / plan.cp
    _, block = block_activation_bytes(model, plan, work.seq_len, 1)
    per = (FUSED_LOGITS_BYTES_PER_ELEM if plan.fused_loss else
           VOCAB_PARALLEL_LOGITS_BYTES_PER_ELEM if plan.tp > 1 else LOGITS_BYTES_PER_ELEM)
    logits = tokens * model.vocab_size / plan.tp * per
    return states + (1 + p.allocator_fragmentation) * max(0.0, logits - block)


def model_state_bytes(params: float, layer_params: float, plan: Plan,
                      p: CostParams) -> tuple[float, float, float, float]:
    """model_state_arrays for one plan."""
    out = model_state_arrays(params, layer_params, plan.zero, plan.effective_shard, plan.offload_params,
                             plan.offload_optimizer, plan.dp * plan.cp, p)
    return tuple(float(x) for x in out)  # type: ignore[return-value]
