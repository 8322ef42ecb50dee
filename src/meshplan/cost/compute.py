"""Compute time of one transformer block, and of the embedding/output layers, for one
micro-batch on one GPU: forward, input-gradient and weight-gradient passes kept apart.

FLOPs (multiply-add = 2 FLOP), per micro-batch of b sequences of s tokens, T = b s / cp
tokens per GPU, tensor-parallel degree t (Narayanan et al. 2021, Korthikanti et al. 2022):
  QKV   2 T h (q + 2 kv) / t        attention out   2 T q h / t
  MLP   2 T h f m / t  (m = 2 matrices, 3 for SwiGLU)
  attention core  4 b s^2 q / (t cp) x c   (c = 1/2 causal with FlashAttention block skipping)
Backward = input gradients (same FLOPs as forward) + weight gradients (same again).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.cost.params import CostParams
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.graph import Attention
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan

ACT_BYTES = 2.0  # bf16/fp16 activations


@dataclass(frozen=True)
class PassTimes:
    """Seconds and FLOPs of one block (or layer) for one micro-batch on one GPU."""

    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    recompute_s: float
    fwd_flops: float
    """Model FLOPs of the forward pass (no recompute)."""
    recompute_flops: float

    @property
    def bwd_s(self) -> float:
        return self.bwd_input_s + self.bwd_weight_s

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.recompute_s


def gemm_efficiency(m: float, n: float, k: float, gpu: GPUSpec, p: CostParams) -> float:
    """Achieved fraction of peak for an (m x k) @ (k x n) GEMM."""
    half, half_m = p.gemm_half_dim, p.gemm_half_tokens
    shape = (m / (m + half_m)) * (n / (n + half)) * (k / (k + half))
    return gpu.gemm_efficiency * shape


def gemm_time(m: float, n: float, k: float, peak: float, gpu: GPUSpec, p: CostParams) -> float:
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return 2.0 * m * n * k / (peak * gemm_efficiency(m, n, k, gpu, p))


def mem_time(nbytes: float, gpu: GPUSpec, p: CostParams) -> float:
    """Seconds to move ``nbytes`` through HBM at the achieved bandwidth."""
    return nbytes / (gpu.hbm_bandwidth_gbps * 1e9 * p.hbm_efficiency)


_mem_time = mem_time


def attention_seconds(att: Attention, plan: Any, b: int, s: int, gpu: GPUSpec, p: CostParams,
                      peak: float) -> tuple[float, float, float]:
    """(fwd seconds, bwd seconds, fwd model FLOPs) of an attention core (QK^T, softmax, AV) for
    b samples of s tokens on one GPU (``plan``: tp, cp, flash_attention)."""
    heads_q = att.q_dim / plan.tp
    causal = 0.5 if (att.causal and plan.flash_attention) else 1.0
    flops = 4.0 * b * s * s * heads_q * causal / plan.cp
    # Model FLOPs follow the PaLM/Megatron convention (12 l h s per token: no causal halving).
    model_flops = 4.0 * b * s * s * heads_q / plan.cp
    if plan.flash_attention:
        d, d0 = att.head_dim, p.attn_headdim_half
        kv = s / plan.cp  # keys per kernel call (a ring step of context parallel sees s/cp)
        shape = (d / (d + d0)) / (128 / (128 + d0)) * kv / (kv + p.attn_half_seq)
        eff = shape * (gpu.attention_efficiency or gpu.gemm_efficiency * p.flash_fwd_efficiency)
        fwd = flops / (peak * eff)
        bwd = p.flash_bwd_flop_ratio * flops / (peak * eff * p.flash_bwd_efficiency)
        return fwd, bwd, model_flops
    # Unfused: batched GEMMs at full s x s, plus softmax/dropout over b*heads*s^2 elements.
    eff = gemm_efficiency(s, s, att.head_dim, gpu, p)
    elems = b * (att.heads / plan.tp) * s * s / plan.cp
    fwd = flops / (peak * eff) + mem_time(elems * (2 + 2 + 2 + 2 + 1), gpu, p)
    bwd = 2 * flops / (peak * eff) + mem_time(elems * (2 + 2 + 2 + 2 + 1 + 2), gpu, p)
    return fwd, bwd, model_flops


def _linear_shapes(model: ModelSpec, plan: Plan, tokens: float) -> list[tuple[float, float, float]]:
    """(m, n, k) of every linear layer of one block on one GPU (experts: per GPU in total)."""
    t, h = plan.tp, model.hidden_size
    shapes = [(tokens, (model.q_dim + 2 * model.kv_dim) / t, h), (tokens, h, model.q_dim / t)]
    mats_in = model.mlp_matrices - 1
    if model.is_moe:
        f = model.expert_ffn
        routed = tokens * model.experts_per_token  # token-expert pairs per GPU after dispatch
        local_experts = max(1, model.num_experts // plan.ep)
        m_e = routed / local_experts
        for _ in range(local_experts):
            shapes += [(m_e, mats_in * f / t, h), (m_e, h, f / t)]
        shapes.append((tokens, model.num_experts, h))  # router
    else:
        f = model.ffn_hidden_size
        shapes += [(tokens, mats_in * f / t, h), (tokens, h, f / t)]
    return shapes


#: Forward HBM bytes per element of each elementwise op, (fused, eager). Fused: compiled or
#: hand-fused kernels (torch.compile, apex/Megatron fused LayerNorm and bias-GeLU, native
#: LayerNorm/GeLU). Eager: the op written as separate PyTorch calls (torchtitan's RMSNorm:
#: fp32 upcast, pow, mean, rsqrt-mul, downcast, weight-mul ~ 36 B; rotary via complex fp32
#: multiply ~ 24 B; SiLU then multiply 10 B per element of f). bf16 activations.
ELEMENTWISE_BYTES: dict[str, tuple[float, float]] = {
    "layernorm": (4.0, 4.0), "rmsnorm": (4.0, 36.0), "residual": (2.0, 6.0),
    "gelu_4h": (4.0, 4.0), "relu_4h": (4.0, 4.0), "squared_relu": (4.0, 8.0),
    "swiglu": (6.0, 10.0), "rotary": (4.0, 24.0), "dropout": (1.0, 1.0),
}
ELEMENTWISE_BWD_RATIO = 2.0  # backward reads input and output-grad, writes input-grad


def elementwise_bytes(model: ModelSpec, plan: Plan, tokens: float) -> float:
    """Forward HBM bytes of the elementwise ops of one block (2 norms, 2 residual adds, the MLP
    activation, rotary, dropout masks) for ``tokens`` tokens on one GPU."""
    h, t = model.hidden_size, plan.tp
    sp = t if plan.sequence_parallel else 1
    k = 0 if plan.compile else 1
    f = (model.expert_ffn * model.experts_per_token) if model.is_moe else model.ffn_hidden_size
    rep = 2 * h * ELEMENTWISE_BYTES[model.norm][k] + 2 * h * ELEMENTWISE_BYTES["residual"][k]
    if model.dropout:
        rep += 2 * h * ELEMENTWISE_BYTES["dropout"][k]
    split = f * ELEMENTWISE_BYTES[model.mlp_type][k]
    if model.position == "rotary":
        split += (model.q_dim + model.kv_dim) * ELEMENTWISE_BYTES["rotary"][k]
    return tokens * (rep / sp + split / t)


def attention_core(model: ModelSpec, plan: Plan, b: int, s: int, gpu: GPUSpec, p: CostParams,
                   peak: float) -> tuple[float, float, float]:
    """(fwd seconds, bwd seconds, fwd FLOPs) of the attention core (QK^T, softmax, AV)."""
    heads_q = model.q_dim / plan.tp
    causal = 0.5 if (model.causal and plan.flash_attention) else 1.0
    flops = 4.0 * b * s * s * heads_q * causal / plan.cp
    # Model FLOPs follow the PaLM/Megatron convention (12 l h s per token: no causal halving).
    model_flops = 4.0 * b * s * s * heads_q / plan.cp
    if plan.flash_attention:
        d, d0 = model.dhead, p.attn_headdim_half
        kv = s / plan.cp  # keys per kernel call (a ring step of context parallel sees s/cp)
        shape = (d / (d + d0)) / (128 / (128 + d0)) * kv / (kv + p.attn_half_seq)
        eff = shape * (gpu.attention_efficiency or gpu.gemm_efficiency * p.flash_fwd_efficiency)
        fwd = flops / (peak * eff)
        bwd = p.flash_bwd_flop_ratio * flops / (peak * eff * p.flash_bwd_efficiency)
        return fwd, bwd, model_flops
    # Unfused: batched GEMMs at full s x s, plus softmax/dropout over b*heads*s^2 elements.
    eff = gemm_efficiency(s, s, model.dhead, gpu, p)
    elems = b * (model.num_attention_heads / plan.tp) * s * s / plan.cp
    fwd = flops / (peak * eff) + _mem_time(elems * (2 + 2 + 2 + 2 + 1), gpu, p)
    bwd = 2 * flops / (peak * eff) + _mem_time(elems * (2 + 2 + 2 + 2 + 1 + 2), gpu, p)
    return fwd, bwd, model_flops


def block_times(model: ModelSpec, plan: Plan, seq_len: int, gpu: GPUSpec, p: CostParams,
                *, recompute_fraction: float = 1.0) -> PassTimes:
    """One transformer block, one micro-batch, one GPU."""
    b, s = plan.micro_batch, seq_len
    tokens = b * s / plan.cp
    lin_peak = gpu.peak("fp8" if plan.precision == "fp8" else plan.precision)
    peak = gpu.peak("bf16" if plan.precision == "fp8" else plan.precision)
    shapes = _linear_shapes(model, plan, tokens)
    lin_fwd = sum(gemm_time(m, n, k, lin_peak, gpu, p) for m, n, k in shapes)
    lin_flops = sum(2.0 * m * n * k for m, n, k in shapes)
    if model.is_moe:  # the router (last shape) runs replicated on every TP rank: count it once
        m_, n_, k_ = shapes[-1]
        lin_flops -= 2.0 * m_ * n_ * k_ * (1 - 1 / plan.tp)
    att_fwd, att_bwd, att_flops = attention_core(model, plan, b, s, gpu, p, peak)
    ew = elementwise_bytes(model, plan, tokens)
    if plan.precision == "fp8":  # casts of inputs+weights (fwd) and output grads (bwd)
        ew += p.fp8_cast_bytes_per_elem * sum(m * k + k * n for m, n, k in shapes[:4])
    ew_fwd = _mem_time(ew, gpu, p)
    fwd = lin_fwd + att_fwd + ew_fwd
    bwd_in = lin_fwd + att_bwd + ELEMENTWISE_BWD_RATIO * ew_fwd
    bwd_w = lin_fwd
    rc = recompute_time(plan.recompute, lin_fwd, att_fwd, ew_fwd, fwd) * recompute_fraction
    rc_flops = {"full": lin_flops + att_flops, "op": lin_flops / 2,
                "selective": att_flops}.get(plan.recompute, 0.0) * recompute_fraction
    return PassTimes(fwd_s=fwd, bwd_input_s=bwd_in, bwd_weight_s=bwd_w, recompute_s=rc,
                     fwd_flops=lin_flops + att_flops, recompute_flops=rc_flops)


def recompute_time(mode: str, lin_fwd: float, att_fwd: float, ew_fwd: float, fwd: float) -> float:
    """Extra forward work in the backward pass for each recompute mode."""
    if mode == "full":
        return fwd
    if mode == "op":  # torchtitan op-level SAC: every other matmul + all elementwise ops
        return 0.5 * lin_fwd + ew_fwd
    if mode == "selective":  # Megatron: attention core only
        return att_fwd
    return 0.0


def output_layer_times(model: ModelSpec, plan: Plan, seq_len: int, gpu: GPUSpec,
                       p: CostParams) -> PassTimes:
    """Final norm + logits GEMM (vocab split over TP) + cross-entropy, one micro-batch."""
    tokens = plan.micro_batch * seq_len / plan.cp
    peak = gpu.peak("bf16" if plan.precision == "fp8" else plan.precision)
    v = model.vocab_size / plan.tp
    g = gemm_time(tokens, v, model.hidden_size, peak, gpu, p)
    # Unfused: logits bf16 write, fp32 upcast, log-softmax read+write (14 B/elem), backward
    # the same again. Fused (one kernel computes loss and gradient in place): read 2 + write 2.
    per_elem = (4.0, 0.0) if plan.fused_loss else (14.0, 14.0)
    ce_f, ce_b = (_mem_time(tokens * v * b, gpu, p) for b in per_elem)
    flops = 2.0 * tokens * v * model.hidden_size
    return PassTimes(fwd_s=g + ce_f, bwd_input_s=g + ce_b, bwd_weight_s=g, recompute_s=0.0,
                     fwd_flops=flops, recompute_flops=0.0)


def embedding_times(model: ModelSpec, plan: Plan, seq_len: int, gpu: GPUSpec,
                    p: CostParams) -> PassTimes:
    """Token (and position) embedding lookup and its gradient scatter, one micro-batch."""
    tokens = plan.micro_batch * seq_len / plan.cp
    t = _mem_time(tokens * model.hidden_size * ACT_BYTES * 2, gpu, p)
    return PassTimes(fwd_s=t, bwd_input_s=0.0, bwd_weight_s=2 * t, recompute_s=0.0,
                     fwd_flops=0.0, recompute_flops=0.0)
