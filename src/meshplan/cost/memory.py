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

from dataclasses import dataclass

from meshplan.cost.params import CostParams
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan
from meshplan.units import GiB

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


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of one pipeline stage, by kind."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient + self.overhead

    def as_gib(self) -> dict[str, float]:
        return {k: getattr(self, k) / GiB for k in
                ("weights", "grads", "optimizer", "activations", "transient", "overhead")} | {
                "total": self.total / GiB}


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


def block_activation_bytes(model: ModelSpec, plan: Plan, seq_len: int, layers: int) -> tuple[float, float]:
    """(bytes kept per micro-batch for ``layers`` blocks, transient bytes of one block being
    recomputed/back-propagated)."""
    tokens = plan.micro_batch * seq_len / plan.cp
    full, inp = activation_bytes_per_token(model, plan, seq_len)
    if plan.recompute == "full":
        r = layers if plan.recompute_layers is None else min(layers, plan.recompute_layers)
        kept = r * inp + (layers - r) * full
        return tokens * kept, tokens * full
    if plan.recompute == "op":
        return tokens * layers * op_sac_bytes_per_token(model, plan), tokens * full
    return tokens * layers * full, 0.0


def model_state_bytes(params: float, layer_params: float, plan: Plan,
                      p: CostParams) -> tuple[float, float, float, float]:
    """(weights, grads, optimizer, transient) bytes for ``params`` parameters held by one GPU
    before ZeRO sharding; ``layer_params`` for FSDP's gathered working copies."""
    shard = plan.effective_shard
    if plan.zero == 3:
        w = 0.0 if plan.offload_params else 4.0 * params / shard
        g = 4.0 * params / shard
        o = 0.0 if plan.offload_optimizer else 8.0 * params / shard
        gathered = (1 + p.fsdp_prefetch_layers) * layer_params * 2.0 + layer_params * 4.0
        return w, g, o, gathered
    w = 2.0 * params
    g = (4.0 if plan.zero >= 1 else 2.0) * params / (shard if plan.zero >= 2 else 1)
    o = 0.0 if plan.offload_optimizer else 12.0 * params / (shard if plan.zero >= 1 else 1)
    buckets = 2 * p.dp_bucket_mib * 2**20 if plan.dp * plan.cp > 1 else 0.0
    return w, g, o, buckets
