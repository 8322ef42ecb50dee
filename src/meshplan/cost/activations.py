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
    the core is recomputed (selective). spec.graph.Attention's ``dropout`` and ``softmax_fp32``
    say whether the probabilities see dropout and the softmax runs in fp32; ``dropout=None`` (not
    stated) takes eager as Hugging Face's Llama-family code (no dropout: 6 B with the fp32
    softmax) and fused-softmax as Megatron's GPT runs (dropout: 5 B, Korthikanti's count)."""
    if attention is None or recompute == "selective":
        return 0.0
    kind = attention_kind(flash_attention, p)
    dropout = getattr(attention, "dropout", None)
    per = score_bytes(kind, dropout=bool(kind == "fused-softmax" if dropout is None else dropout),
                      softmax_fp32=bool(getattr(attention, "softmax_fp32", True)))
    return per * attention.heads * seq_len


def fp8_saved_change(o: Any, flash_attention: bool, p: Any, recompute: str) -> tuple[float, float]:
    """(replicated, split) change of a layer's saved bytes per token when its GEMMs run in fp8.

    Transformer Engine's Linear / LayerNormLinear / LayerNormMLP / GroupedLinear cast each GEMM's
    input to fp8 for the forward GEMM and keep that fp8 tensor (1 B per element; with delayed
    scaling its transpose, the column-wise copy the weight-gradient GEMM reads) for the backward
    instead of the 16-bit input (transformer_engine/pytorch/module/linear.py, ``_Linear.forward``:
    ``saved_inputmat = inputmat``, the quantized input, row-wise data discarded; older releases
    ``saved_inputmat = inputmat`` when fp8 and not ``override_linear_precision.wgrad``, else
    ``inputmat_no_fp8``). LayerNormLinear's norm writes its output straight to fp8 and keeps it and
    the 16-bit norm input; LayerNormMLP's activation writes the fc2 input in fp8
    (``activation_func(fc1_out, fc2_input_quantizer)``) and keeps it with the 16-bit fc1 output its
    backward reads. So: GEMM inputs only their GEMM keeps (``saved_gemm_rep``, ``saved_gemm_split``)
    halve. The attention core's output (``saved_attn_out``, the o-projection's input) stays 16-bit
    where a flash kernel keeps it for its own backward, plus the o-projection's fp8 copy (+1 B per
    element); an unfused or recomputed (selective) core leaves the GEMM its only keeper (halved).
    Everything else (norm inputs, q/k/v, activation inputs, masks) stays 16-bit."""
    rep = -0.5 * o.saved_gemm_rep
    split = -0.5 * o.saved_gemm_split
    if o.saved_attn_out:
        shared = (o.attention is not None and recompute != "selective"
                  and attention_kind(flash_attention, p) in FLASH_KERNELS)
        split += (0.5 if shared else -0.5) * o.saved_attn_out
    return rep, split


SELECTIVE_NOTE = ("recompute=selective (Megatron's --recompute-granularity selective: the attention core) recomputes "
                  "the flash-attention forward in the backward ({cost}) and saves no memory: a flash kernel "
                  "keeps no s x s scores, only its inputs, output and log-sum-exp, which the layer keeps anyway "
                  "(Megatron does the same: its core attention, Transformer Engine's fused kernel too, runs under "
                  "tensor_parallel.checkpoint). recompute=none keeps the same memory for less time; torchtitan's "
                  "'selective' (op-level SAC) is recompute=op here")


def selective_saves_nothing(model: Any, plan: Any, p: Any, seq_len: int) -> bool:
    """Whether recompute=selective keeps exactly what recompute=none keeps for ``plan``: the model has an
    attention core, the plan's kernel for it is a flash kernel (attention_saved_bytes: no scores to free)
    and the GEMM inputs are not fp8-cast (fp8_saved_change: the one term where a recomputed core differs).
    Megatron runs selective this way too (it still recomputes the core: the time is paid, cost.layer)."""
    from meshplan.spec.transformer import as_graph
    if plan.precision == "fp8" or attention_kind(plan.flash_attention, p) not in FLASH_KERNELS:
        return False
    graph = as_graph(model, seq_len)
    return any(o.attention is not None for o in graph.ops.values())
