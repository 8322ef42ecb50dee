"""Step-time and FLOPs formulas of the published sources, one small function each, with its source.

A row gives throughput (tokens/s, samples/s), achieved TFLOP/s or a utilisation; these turn it into
a step time with the source's own FLOPs count.

Notation: B global batch (sequences), s sequence length, l layers, h hidden size, V vocabulary,
N parameters, n GPUs, t step time (s).
"""
from __future__ import annotations


def step_time_from_tokens_per_gpu(B: float, s: float, n: float, tps_per_gpu: float) -> float:
    """t = B*s / (n * tokens/s/GPU). torchtitan 'WPS' (tokens/s per GPU rank, see
    torchtitan train.py: ntokens / (time * non_data_parallel_size) summed over dp = B*s/(t*n))
    and llm-foundry 'tokens/s/GPU' (scripts/train/benchmarking/README.md)."""
    return B * s / (n * tps_per_gpu)


def step_time_from_tokens_total(B: float, s: float, tps_total: float) -> float:
    """t = B*s / (tokens/s of the whole job)."""
    return B * s / tps_total


def step_time_from_samples(B: float, samples_per_s: float) -> float:
    """t = B / (sequences/s of the whole job)."""
    return B / samples_per_s


def step_time_from_flops(flops_per_step: float, n: float, tflops_per_gpu: float) -> float:
    """t = F / (n * achieved TFLOP/s per GPU * 1e12)."""
    return flops_per_step / (n * tflops_per_gpu * 1e12)


def step_time_from_utilization(flops_per_step: float, n: float, peak_tflops: float,
                               util_pct: float) -> float:
    """t = F / (n * peak * utilization): inverts MFU = F/(t n peak) (or HFU with hardware F)."""
    return flops_per_step / (n * peak_tflops * 1e12 * util_pct / 100.0)


def flops_meg21(B: float, s: float, l: float, h: float, V: float) -> float:
    """F_MEG21: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC'21 (arXiv 2104.04473), Eq. 3:
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)). The 96 includes the extra forward pass of
    full activation recomputation, so utilisation against it is hardware-FLOP utilisation."""
    return 96.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h))


def flops_megatron_no_recompute(B: float, s: float, l: float, h: float, V: float) -> float:
    """Eq. 3 without the recomputed forward: 72 B s l h^2 (1 + s/(6h) + V/(16 l h))
    (Megatron-LM/Megatron-DeepSpeed throughput code with checkpoint_activations_factor=3)."""
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h))


def flops_kor22_model(B: float, s: float, l: float, h: float, V: float) -> float:
    """F_KOR22 model FLOPs: Korthikanti et al., "Reducing Activation Recomputation in Large
    Transformer Models" (arXiv 2205.05198), Sec. 6.3:
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)); MFU = F / (t n 312e12)."""
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (12.0 * l * h))


def flops_kor22_hardware(B: float, s: float, l: float, h: float, V: float, recompute: str) -> float:
    """F_KOR22 hardware FLOPs (Korthikanti et al. 2022, Sec. 6.3): the model FLOPs plus what
    is recomputed. Selective: 72 B s l h^2 (1 + s/(3h) + V/(12 l h)) (reproduces the paper's
    HFU/MFU ratios); full: Eq. 3 of SC'21, 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    if recompute == "full":
        return flops_meg21(B, s, l, h, V)
    if recompute == "selective":
        return 72.0 * B * s * l * h * h * (1.0 + s / (3.0 * h) + V / (12.0 * l * h))
    return flops_kor22_model(B, s, l, h, V)


def flops_bloom(B: float, s: float, l: float, h: float, V: float, recompute: bool = True) -> float:
    """F_BLOOM: Megatron-DeepSpeed (bigscience-workshop/Megatron-DeepSpeed, megatron/training.py
    throughput calculation): 24 * f * B s l h^2 (1 + s/(6h) + V/(16 l h)) with
    f = 4 when activations are checkpointed (the "4*2 coefficient"), else 3."""
    f = 4.0 if recompute else 3.0
    return 24.0 * f * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h))


def flops_tt(B: float, s: float, l: float, h_attn: float, n_params: float) -> float:
    """F_TT: torchtitan (pytorch/torchtitan, utils.get_num_flop_per_token):
    6 N + 12 l h s FLOPs per token, times B*s tokens. The data README says N is the
    non-embedding count; the 2024 docs/performance.md MFUs are reproduced with N = all
    parameters, so the caller decides which N it passes."""
    return B * s * (6.0 * n_params + 12.0 * l * h_attn * s)


def flops_mosaic(B: float, s: float, l: float, h: float, n_params: float,
                 hardware: bool = False) -> float:
    """F_MOSAIC: llm-foundry (mosaicml/llm-foundry, MPT flops_per_batch and
    scripts/train/benchmarking/README.md): per sequence 6 N s + 12 l h s^2 with N including
    embeddings; HFU uses 8 N s + 16 l h s^2 when activation checkpointing is on."""
    if hardware:
        return B * (8.0 * n_params * s + 16.0 * l * h * s * s)
    return B * (6.0 * n_params * s + 12.0 * l * h * s * s)


def flops_palm(B: float, s: float, l: float, h: float, n_params: float) -> float:
    """Generic model FLOPs (Chowdhery et al., PaLM, arXiv 2204.02311, App. B):
    6 N + 12 l h s per token. Used when a row names no formula we know."""
    return B * s * (6.0 * n_params + 12.0 * l * h * s)
