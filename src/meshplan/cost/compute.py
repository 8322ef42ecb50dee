"""Kernel times on one GPU: a GEMM at its shape's efficiency, memory-bound bytes at the achieved
HBM bandwidth, and an attention core (FlashAttention or unfused). cost.layer builds every
layer's time from them (for a transformer block, T = b s / cp tokens per GPU and tensor-parallel
degree t: QKV 2 T h (q + 2 kv) / t, attention out 2 T q h / t, MLP 2 T h f m / t, attention
core 4 b s^2 q / (t cp) x c, c = 1/2 causal with FlashAttention block skipping; Narayanan et al.
2021, Korthikanti et al. 2022).
"""
from __future__ import annotations

from typing import Any

from meshplan.cost.params import CostParams
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.graph import Attention

FLASH_KERNELS = ("flash1", "flash2", "flash3", "sdpa", "cudnn")
UNFUSED_KERNELS = ("eager", "fused-softmax")
ATTENTION_KERNELS = FLASH_KERNELS + UNFUSED_KERNELS


def attention_kind(flash_attention: bool, p: CostParams) -> str:
    """The attention kernel a plan runs: the profile's (``p.attention_kernel``); a plan without
    ``flash_attention`` runs the eager one unless the profile's kernel is itself unfused."""
    k = p.attention_kernel
    if not flash_attention and k in FLASH_KERNELS:
        return "eager"
    return k


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
