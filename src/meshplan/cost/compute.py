"""Kernel times on one GPU: a GEMM at its shape's efficiency, memory-bound bytes at the achieved
HBM bandwidth, and an attention core (a FlashAttention-style kernel or an unfused one). cost.layer builds every
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

FLASH_KERNELS = ("flash1", "flash2", "flash3", "sdpa", "cudnn", "triton")
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


#: Throughput of each FlashAttention-style kernel relative to FlashAttention-2 (the kernel the
#: GPU files' fitted attention_efficiency describes), forward and backward alike, as published
#: (nothing fitted). (ratio, only on the families listed; elsewhere 1.0)
#: - flash1: Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
#:   Partitioning" (arXiv:2307.08691), abstract and Sec. 4.1: "around 2x speedup compared to
#:   FlashAttention" (FA1 reaches 25-40% of the A100 peak, FA2 50-73%). 1 / 2.
#: - flash2, sdpa: PyTorch's scaled_dot_product_attention dispatches to the FlashAttention-2
#:   kernels on CUDA (PyTorch 2.2 release notes: "FlashAttention-v2 ... SDPA"). 1.
#: - flash3: Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention with Asynchrony
#:   and Low-precision" (arXiv:2407.08608), abstract: "speedup on H100 GPUs by 1.5-2.0x" over
#:   FlashAttention-2 in FP16; the lower end, 1.5, is used (backward: 1.5-1.75x, Sec. 4.1).
#:   Hopper only (wgmma/TMA): FlashAttention-3 does not run elsewhere, so FA2's rate there.
#: - triton: the Triton FlashAttention kernel (flash_attn_triton; llm-foundry's attn_impl='triton'):
#:   Dao 2023 (FlashAttention-2 paper), Sec. 4.1: FlashAttention-2 is "1.3-2.5x faster than
#:   FlashAttention in Triton"; the lower end, 1 / 1.3.
#: - cudnn: PyTorch 2.5 release notes ("cuDNN backend for SDPA ... up to 75% speedup over
#:   FlashAttentionV2" on H100): 1.75, the stated best case; enabled by default on H100 and
#:   newer only, so FA2's rate elsewhere (no published ratio).
FLASH_SPEED: dict[str, tuple[float, tuple[str, ...]]] = {
    "flash1": (0.5, ()), "flash2": (1.0, ()), "sdpa": (1.0, ()),
    "flash3": (1.5, ("hopper",)), "cudnn": (1.75, ("hopper",)), "triton": (1 / 1.3, ()),
}
#: HBM bytes per element of the b x heads x s x s scores outside the two batched GEMMs, (forward,
#: backward), of the unfused kernels.
#: - fused-softmax (Megatron's FusedScaleMaskSoftmax, then dropout): the byte counts the cost
#:   model has used since its first version (validated on the MEG_SC21 and KOR22 rows): scores
#:   written 2, the fused scale+mask+softmax reads 2 and writes 2, dropout reads 2 and writes
#:   its 1-byte mask (forward 9); backward: dropout's gradient (read 2, mask 1, write 2) and
#:   the softmax backward (read the gradient and the probabilities 2 + 2, write 2): 11.
#: - eager (PyTorch math / Hugging Face eager_attention_forward: matmul, * scaling, + mask,
#:   softmax(dtype=float32), .to(bf16), dropout): the same plus the separate scale (read 2,
#:   write 2) and mask add (2 + 2), the fp32 softmax output (+2) and its cast back (read 4,
#:   write 2): forward 9 + 16 = 25; backward: the scale's gradient (2 + 2), the cast's (read 2,
#:   write 4), the softmax backward in fp32 (+6 over 16-bit) and the cast back (read 4, write
#:   2): 11 + 22 = 33.
UNFUSED_BYTES: dict[str, tuple[float, float]] = {"fused-softmax": (9.0, 11.0), "eager": (25.0, 33.0)}


def flash_speed(kind: str, gpu: GPUSpec) -> float:
    """Throughput of a FlashAttention-style ``kind`` relative to FlashAttention-2 on ``gpu``."""
    ratio, families = FLASH_SPEED.get(kind, (1.0, ()))
    return ratio if not families or gpu.family in families else 1.0


def attention_seconds(att: Attention, plan: Any, b: int, s: int, gpu: GPUSpec, p: CostParams,
                      peak: float) -> tuple[float, float, float]:
    """(fwd seconds, bwd seconds, fwd model FLOPs) of an attention core (QK^T, softmax, AV) for
    b samples of s tokens on one GPU (``plan``: tp, cp, flash_attention), run by the kernel
    attention_kind(plan.flash_attention, p)."""
    kind = attention_kind(plan.flash_attention, p)
    flash = kind in FLASH_KERNELS
    heads_q = att.q_dim / plan.tp
    causal = 0.5 if (att.causal and flash) else 1.0
    flops = 4.0 * b * s * s * heads_q * causal / plan.cp
    # Model FLOPs follow the PaLM/Megatron convention (12 l h s per token: no causal halving).
    model_flops = 4.0 * b * s * s * heads_q / plan.cp
    if flash:
        d, d0 = att.head_dim, p.attn_headdim_half
        kv = s / plan.cp  # keys per kernel call (a ring step of context parallel sees s/cp)
        shape = (d / (d + d0)) / (128 / (128 + d0)) * kv / (kv + p.attn_half_seq)
        eff = shape * (gpu.attention_efficiency or gpu.gemm_efficiency * p.flash_fwd_efficiency)
        eff *= flash_speed(kind, gpu)
        fwd = flops / (peak * eff)
        bwd = p.flash_bwd_flop_ratio * flops / (peak * eff * p.flash_bwd_efficiency)
        return fwd, bwd, model_flops
    # Unfused: batched GEMMs at full s x s, plus the softmax/mask/dropout bytes over b*heads*s^2.
    eff = gemm_efficiency(s, s, att.head_dim, gpu, p)
    elems = b * (att.heads / plan.tp) * s * s / plan.cp
    fb, bb = UNFUSED_BYTES[kind]
    fwd = flops / (peak * eff) + mem_time(elems * fb, gpu, p)
    bwd = 2 * flops / (peak * eff) + mem_time(elems * bb, gpu, p)
    return fwd, bwd, model_flops


ELEMENTWISE_KERNELS = ("eager", "hand-fused", "compiled")
LOSS_KERNELS = ("torch", "inplace", "fused", "chunked")


def elementwise_fused(compile_: bool, p: CostParams) -> bool:
    """Whether a plan's elementwise ops run fused: torch.compile (the plan), or the profile's
    hand-fused / compiled kernels."""
    return bool(compile_) or p.elementwise_kernels != "eager"


def loss_kind(fused_loss: bool, p: CostParams) -> str:
    """The cross-entropy a plan runs: the profile's chunked or fused kernel, else fused when the
    plan asks for it (``fused_loss``), else torch's."""
    if p.loss_kernel in ("fused", "chunked"):
        return p.loss_kernel
    return "fused" if fused_loss else p.loss_kernel
