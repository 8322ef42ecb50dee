"""Activation bytes an attention kernel keeps for the backward beyond the flash baseline.

The block's LayerOps count what every kernel keeps: the core's inputs q, k, v and its output (the
o-projection's input). A flash kernel (flash1/2/3, sdpa's fused backends, cuDNN) adds only its
float32 log-sum-exp (4 B per head per token, under 0.1% of a block: not counted). An unfused core
materialises the b x heads x s x s scores, and autograd keeps, per score element (what
``torch.autograd.graph.saved_tensors_hooks`` sees, tests/unit/test_autograd_memory.py):

  eager          (PyTorch ops; Hugging Face's eager_attention_forward) the softmax's output, 4 B
                 when the softmax runs in fp32 (Llama, Mistral, Qwen2, Mixtral: ``dtype=float32``)
                 or 2 B in the activations' dtype (GPT-2); the probabilities the AV matmul keeps:
                 the bf16 cast of an fp32 softmax (2 B) or, with dropout, the dropout's 1-byte mask
                 and its 2-byte output (the softmax output itself without dropout at 2 B: shared).
                 fp32 softmax: 6 B, 7 B with dropout; bf16: 2 B, 5 B with dropout.
  fused-softmax  Megatron's scaled-masked-softmax kernel keeps its 2-byte output; with dropout the
                 mask (1 B) and the dropped probabilities the AV matmul keeps (2 B): 2 B, 5 B with
                 dropout (Korthikanti et al. 2022: 5 a s^2 b).

The scores QK^T themselves are not kept (the scale and the mask add save nothing). Selective
recomputation (Megatron's: the attention core) keeps none of it; full recomputation keeps none
between blocks, but the block being recomputed holds its scores again (cost.layer's ``full``, the
memory model's one-block transient). No torch: the planning side.
"""
from __future__ import annotations

from typing import Any

from meshplan.cost.compute import FLASH_KERNELS, attention_kind


def score_bytes(kind: str, *, dropout: bool, softmax_fp32: bool) -> float:
    """Bytes autograd keeps per element of the s x s scores for attention kernel ``kind``."""
    if kind in FLASH_KERNELS:
        return 0.0
    if kind == "fused-softmax":
        return 5.0 if dropout else 2.0
    if kind == "eager":
        soft = 4.0 if softmax_fp32 else 2.0
        if dropout:
            return soft + 1.0 + 2.0
        return soft + (2.0 if softmax_fp32 else 0.0)
    raise ValueError(f"unknown attention kernel {kind!r}")


def attention_saved_bytes(attention: Any, flash_attention: bool, p: Any, seq_len: int, recompute: str) -> float:
    """Bytes per token (per micro-batch sample's token, before TP) the attention core keeps beyond
    the flash baseline: heads x seq_len scores per token at ``score_bytes`` of the kernel the plan
    runs (cost.compute.attention_kind of ``flash_attention`` and the CostParams ``p``), none when
    the core is recomputed (selective). LayerOps' Attention does not say whether the probabilities
    see dropout or the softmax runs in fp32 (a follow-up: two fields of spec.graph.Attention); an
    ``attention`` carrying ``dropout`` / ``softmax_fp32`` attributes is read, otherwise eager is
    taken as Hugging Face's Llama-family code (fp32 softmax, no dropout: 6 B) and fused-softmax
    as Megatron's GPT runs (dropout: 5 B, Korthikanti's count)."""
    if attention is None or recompute == "selective":
        return 0.0
    kind = attention_kind(flash_attention, p)
    per = score_bytes(kind, dropout=bool(getattr(attention, "dropout", kind == "fused-softmax")),
                      softmax_fp32=bool(getattr(attention, "softmax_fp32", True)))
    return per * attention.heads * seq_len
