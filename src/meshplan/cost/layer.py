"""Time, FLOPs and bytes of one layer for one micro-batch on one GPU, from its LayerOps.

The one set of per-layer formulas of the cost model, for every model (a generated transformer,
a traced Hugging Face model, a CNN, a GNN). For a micro-batch of b samples of s tokens, T = b s / cp
tokens per GPU, tensor-parallel degree t:

  GEMMs      each Gemm(n, k, m, split) runs as an (m T) x k @ k x n GEMM with n / t (column) or
             k / t (row), at the GPU's peak for the plan's precision times gemm_efficiency of
             the shape; a MoE layer's expert GEMMs run per local expert (E / ep of them) on the
             T top_k / (E / ep) token-expert pairs each receives, times the busiest ep rank's
             load over the mean (cost.moe.load_factor; model FLOPs stay the mean's); under fp8 each
             local expert casts its own rows and weight. Backward: input gradients and
             weight gradients, each the forward's GEMMs again (Narayanan et al. 2021).
  permutation  a MoE layer's token permute / per-expert sort / unpermute copies (cost.moe.permute_bytes)
             at the achieved HBM bandwidth, forward and again backward.
  attention  4 b s^2 q / (t cp) FLOPs forward, halved for causal masks with FlashAttention's
             block skipping; FlashAttention's efficiency from the head width and keys per call,
             times the kernel's published speed relative to FA2 (compute.FLASH_SPEED); unfused
             (eager, fused-softmax): batched GEMMs at full s x s plus softmax/dropout bytes.
  memory-bound  the fused or eager bytes per token (plan.compile or the profile's hand-fused
             kernels: compute.elementwise_fused), replicated ones divided by t
             only with sequence parallelism, at the achieved HBM bandwidth; backward x ew_bwd_input.
  loss       cross-entropy over the layer's logits: 14 B per logit forward and backward (6 without
             the fp32 upcast), 4 B and 0 fused or chunked (plan.fused_loss, compute.loss_kind).
  recompute  full: one more forward; op (torchtitan SAC): half the GEMMs + the memory-bound ops;
             selective (Megatron): the attention core.
  launches   only where the run launches synchronously (CostParams.launch_blocking:
             CUDA_LAUNCH_BLOCKING=1): launch_gap_s of host time per kernel of each pass
             (kernel_counts), in every micro-batch; it does not shrink with a larger micro-batch.
  saved      bytes per token kept for the backward, with the same TP/SP splits; the unfused
             attention's s x s scores (5 B per element) unless recomputed.
Activations are 2 bytes in the LayerOps; fp32 plans hold 4.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.cost.activations import attention_saved_bytes, fp8_saved_change
from meshplan.cost.compute import (
    FLASH_KERNELS,
    attention_kind,
    attention_seconds,
    elementwise_fused,
    gemm_time,
    loss_kind,
    mem_time,
)
from meshplan.cost.moe import load_factor, permute_bytes
from meshplan.cost.params import CostParams
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.graph import LayerOps

#: Bytes per logit read/written by the cross-entropy (forward, backward), by kernel
#: (compute.loss_kind): torch's on fp32-upcast logits (read bf16 2, write fp32 4, log-softmax
#: read 4 write 4; the backward the same), torch's on 16-bit logits (2 + 2 + 2 each way), a fused
#: in-place CE (read 2, write the gradient in place 2; nothing more in the backward), a chunked
#: fused linear + CE (Liger: the same bytes per chunk).
CE_BYTES = {"torch": (14.0, 14.0), "torch-bf16": (6.0, 6.0), "fused": (4.0, 0.0), "chunked": (4.0, 0.0),
            "inplace": (38.0, 14.0), "inplace-16": (14.0, 6.0)}
"""inplace: Megatron's _VocabParallelCrossEntropy, one kernel per step on the fp32 copy
(megatron/core/tensor_parallel/cross_entropy.py): forward .float() r2 w4, max r4, sub_ r4 w4,
exp r4 w4, sum r4, div_ r4 w4 = 38; backward mul_ r4 w4, the cast back r4 w2 = 14. inplace-16
(--fp16-lm-cross-entropy): the same steps on the 16-bit logits without the cast (2 B each)."""
#: Per-layer quantities, one column each (see LayerTable).
QUANTITIES = ("f", "bi", "bw", "rc", "flops", "rc_flops", "full", "inp", "op", "loss_f", "loss_b")


#: Kernels a layer launches per micro-batch, for the host time of synchronous launches
#: (CostParams.launch_blocking), counted from Megatron(-DeepSpeed)'s ParallelTransformerLayer
#: (bigscience-workshop/Megatron-DeepSpeed megatron/model/transformer.py@541b967): each GEMM runs with
#: its bias or a layout copy (2 forward kernels); the unfused attention core runs the scores' batched
#: GEMM, the scale-mask-softmax, the dropout, the weighted sum's batched GEMM and two layout copies (6;
#: a FlashAttention call: 1); a block's memory-bound ops are its 2 norms, 2 bias-dropout-adds,
#: the activation and 3 copies/casts (8; another layer with memory-bound bytes: 2). The input-gradient
#: pass mirrors the forward's kernels; the weight-gradient pass runs, per GEMM, the weight-gradient
#: GEMM, the bias-gradient reduction and the gradient-accumulation add (3). A GPT block: 22 forward,
#: 22 input-gradient, 12 weight-gradient, and 22 more recomputed under full recompute: 78.
KERNELS_PER_GEMM = 2
KERNELS_ATTENTION_UNFUSED = 6
KERNELS_ATTENTION_FLASH = 1
KERNELS_ELEMENTWISE_BLOCK = 8
KERNELS_ELEMENTWISE_OTHER = 2
KERNELS_WGRAD_PER_GEMM = 3


def kernel_counts(o: LayerOps, block: bool, flash_attention: bool, p: CostParams) -> tuple[int, int, int]:
    """(forward, input-gradient, weight-gradient) kernels one micro-batch of layer ``o`` launches
    (the KERNELS_* counts; a recomputed forward launches the forward's again)."""
    fwd = KERNELS_PER_GEMM * len(o.gemms)
    if o.attention is not None:
        fwd += KERNELS_ATTENTION_FLASH if attention_kind(flash_attention, p) in FLASH_KERNELS \
            else KERNELS_ATTENTION_UNFUSED
    if block:
        fwd += KERNELS_ELEMENTWISE_BLOCK
    elif any(o.ew_rep) or any(o.ew_split) or o.ew_whole or o.loss_vocab:
        fwd += KERNELS_ELEMENTWISE_OTHER
    return fwd, fwd, KERNELS_WGRAD_PER_GEMM * len(o.gemms)


@dataclass(frozen=True)
class Combo:
    """The plan fields a layer's per-micro-batch quantities depend on."""

    tp: int
    cp: int
    micro_batch: int
    precision: str
    recompute: str
    sequence_parallel: bool
    compile: bool
    flash_attention: bool
    ep: int
    fused_loss: bool


def act_scale(precision: Any) -> Any:
    """Activation bytes relative to the LayerOps' 2-byte ones (a precision, or an array of them).
    fp8 keeps 16-bit activations (1.0) except the GEMM inputs its fp8 GEMMs keep at 1 byte:
    cost.activations.fp8_saved_change, applied to the saved bytes by ``layer_quantities``."""
    return np.where(np.asarray(precision) == "fp32", 2.0, 1.0)


def layer_quantities(o: LayerOps, c: Combo, seq_len: int, gpu: GPUSpec, p: CostParams,
                     recomputable: bool) -> tuple[float, ...]:
    """QUANTITIES of one layer: seconds (forward, input-gradient, weight-gradient, recompute),
    FLOPs per GPU (forward model FLOPs, recomputed), saved bytes per token (no recompute, the
    input kept by full recompute, op-level SAC) and the loss's share of f and bi."""
    b, s, t = c.micro_batch, seq_len, c.tp
    tokens = b * s / c.cp
    sp = t if c.sequence_parallel else 1
    k = 0 if elementwise_fused(c.compile, p) else 1
    scale = act_scale(c.precision)
    fp8 = c.precision == "fp8" and o.fp8
    lin_peak = gpu.peak("fp8" if fp8 else ("bf16" if c.precision == "fp8" else c.precision))
    peak = gpu.peak("bf16" if c.precision == "fp8" else c.precision)

    lin_fwd = lin_flops = cast = 0.0
    local = max(1, o.experts // c.ep) if o.experts else 1
    # the busiest expert-parallel rank's load over the mean (cost.moe): its experts' GEMMs set the pace
    busiest = float(load_factor(tokens, o.experts, o.top_k, c.ep, p)) if o.experts else 1.0
    cast_seen: set[int] = set()
    for i, g in enumerate(o.gemms):
        n = g.n / t if g.split == "column" else g.n
        kk = g.k / t if g.split == "row" else g.k
        if g.expert:
            m, count = tokens * o.top_k / local, local
        else:
            m, count = tokens * g.m, 1
        one = gemm_time(m * busiest if g.expert else m, n, kk, lin_peak, gpu, p)
        lin_fwd += count * one
        fl = 2.0 * m * n * kk * count
        lin_flops += fl if g.split != "none" else fl / t  # replicated work counts once per TP group
        if fp8 and g.split != "none" and (not g.expert or i not in cast_seen):
            # every local expert casts its own rows and its own weight (count of them; 1 for a dense GEMM)
            cast += count * (m * kk + kk * n)
            cast_seen.add(i)
    att_f = att_b = att_flops = 0.0
    if o.attention is not None:
        att_f, att_b, att_flops = attention_seconds(o.attention, c, b, s, gpu, p, peak)
    ew = tokens * (o.ew_rep[k] / sp + o.ew_split[k] / t + o.ew_whole) * scale
    if fp8:
        ew += p.fp8_cast_bytes_per_elem * cast
    ew_f = mem_time(ew, gpu, p)
    # a MoE layer's token permutation (cost.moe.permute_bytes): forward, and the same bytes backward
    perm_f = mem_time(tokens / sp * scale * permute_bytes(o.hidden, o.top_k, local, busiest), gpu, p) \
        if o.experts else 0.0
    loss_f = loss_b = 0.0
    if o.loss_vocab:
        logits = tokens * o.loss_vocab / (t if o.loss_split else 1)
        kind = loss_kind(c.fused_loss, p)
        fb, bb = CE_BYTES[{"torch": "torch-bf16", "inplace": "inplace-16"}.get(kind, kind) if not p.logits_fp32
                          else kind]
        loss_f, loss_b = mem_time(logits * fb, gpu, p), mem_time(logits * bb, gpu, p)
    fwd = lin_fwd + att_f + ew_f + loss_f + perm_f
    bwd_w = lin_fwd + o.ew_bwd_weight * ew_f
    bwd_in = lin_fwd + att_b + o.ew_bwd_input * ew_f + loss_b + perm_f
    if p.launch_blocking:  # every kernel waits for the host's gap before it (CostParams.launch_blocking)
        k_f, k_bi, k_bw = kernel_counts(o, recomputable, c.flash_attention, p)
        fwd, bwd_in, bwd_w = fwd + k_f * p.launch_gap_s, bwd_in + k_bi * p.launch_gap_s, bwd_w + k_bw * p.launch_gap_s
    rc = rc_flops = 0.0
    if recomputable:
        rc = {"full": fwd, "op": 0.5 * lin_fwd + ew_f, "selective": att_f}.get(c.recompute, 0.0)
        rc_flops = {"full": lin_flops + att_flops, "op": lin_flops / 2,
                    "selective": att_flops}.get(c.recompute, 0.0)
    split = o.saved_split[k]
    split += attention_saved_bytes(o.attention, c.flash_attention, p, s, c.recompute)  # unfused: s x s scores
    rep = o.saved_rep - (o.saved_combine_rep if p.moe_probs_in_activation else 0.0)  # cost.params
    if c.precision == "fp8" and o.fp8:  # GEMM inputs kept fp8-cast (Transformer Engine)
        d_rep, d_split = fp8_saved_change(o, c.flash_attention, p, c.recompute)
        rep, split = rep + d_rep, split + d_split
    full = (rep / sp + split / t + o.saved_whole) * scale
    inp = o.saved_input / sp * scale
    op = (o.saved_op[0] / sp + o.saved_op[1] / t) * scale
    return (fwd, bwd_in, bwd_w, rc, lin_flops + att_flops, rc_flops, full, inp, op, loss_f, loss_b)


def quantities(o: LayerOps, plan: object, seq_len: int, gpu: GPUSpec, p: CostParams,
               recomputable: bool = True) -> dict[str, float]:
    """layer_quantities by name, for any object with the Combo fields (a Plan)."""
    c = Combo(**{f: getattr(plan, f) for f in Combo.__dataclass_fields__})
    return dict(zip(QUANTITIES, layer_quantities(o, c, seq_len, gpu, p, recomputable)))


def table(ops: list[LayerOps], recomputable: list[bool], combos: list[dict], seq_len: int, gpu: GPUSpec,
          p: CostParams) -> np.ndarray:
    """(combos, layers, QUANTITIES) for the distinct layers ``ops`` under each combo."""
    out = np.empty((len(combos), len(ops), len(QUANTITIES)))
    for i, combo in enumerate(combos):
        c = Combo(**{f: combo[f] for f in Combo.__dataclass_fields__})
        for j, (o, r) in enumerate(zip(ops, recomputable)):
            out[i, j] = layer_quantities(o, c, seq_len, gpu, p, r)
    return out
