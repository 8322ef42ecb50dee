"""Memory per GPU for each pipeline stage: model states, activations, transients.

Model states per parameter (mixed-precision Adam, Rajbhandari et al. 2020):
  ZeRO 0-2 (Megatron/DeepSpeed style): bf16 weights 2 B, grads 2 B (fp32 4 B with a
  distributed optimizer; the profile's CostParams.main_grads: Megatron's fp32 main grads also
  under DDP, 18 B/param in all), fp32 master + Adam m, v 12 B; ZeRO-1 shards the 12 B, ZeRO-2 also
  the grads. ZeRO-3/FSDP: fp32 sharded params 4 B + fp32 grads 4 B + Adam 8 B, all sharded,
  plus the bf16 unsharded copies of the layers being computed.
Activations per token of each layer come from its LayerOps (cost.layer; a transformer block's
follow Korthikanti et al. 2022 Eq. 2, 34 s b h for GPT with TP/SP splits, generalised to GQA,
SwiGLU, rotary and FlashAttention: spec.transformer).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.plan import Plan

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
BF16_LOGITS_BYTES_PER_ELEM = 6.0
"""The same for torch's cross-entropy on 16-bit logits (CostParams.logits_fp32 = False): bf16
logits 2 + bf16 log-softmax 2 + its bf16 gradient 2."""
#: Bytes per parameter of the gradients held without ZeRO-3 (CostParams.main_grads).
MAIN_GRAD_BYTES = {"fp32": 4.0, "bf16": 2.0, "bf16+fp32": 6.0}
"""bf16+fp32: DeepSpeed's BF16_Optimizer keeps each parameter's bf16 .grad and an unsharded fp32
gradient-accumulation buffer ('The additional memory usage is 4bytes x params and it's not
sharded', bigscience tr11 chronicles); the fp32 buffer is what is reduced."""


def grad_bytes(zero: Num, p: CostParams, precision: Num = None) -> Num:
    """Gradient bytes per parameter for ZeRO 0-2 (before ZeRO-2's sharding): auto: 16-bit for
    ZeRO-0, fp32 with a distributed optimizer (ZeRO-1/2); or the profile's main_grads: bf16
    (16-bit), fp32 (Megatron: fp32 main grads, but fp16 runs keep 16-bit ones, as Megatron turns
    accumulate_allreduce_grads_in_fp32 on for bf16 only). ``precision`` None (not known: the
    search's bounds) gives the smaller."""
    auto = np.where(np.asarray(zero) >= 1, 4.0, 2.0)
    if p.main_grads == "bf16":
        return np.where(np.asarray(zero) >= 0, 2.0, 0.0)
    if p.main_grads == "bf16+fp32":
        return np.where(np.asarray(zero) >= 0, 6.0, 0.0)
    if p.main_grads == "fp32":
        return auto if precision is None else np.where(np.asarray(precision) == "fp16", auto, 4.0)
    return auto


def usable_gib(cluster: ClusterSpec, p: CostParams = DEFAULT_PARAMS) -> float:
    """Memory a plan may use to 'fit' (the cost model's definition): HBM less the margin."""
    return cluster.gpu.memory_gib * (1 - p.memory_margin)


def model_state_arrays(params: Num, layer_params: Num, zero: Num, shard: Num, offload_params: Num,
                       offload_optimizer: Num, dp_cp: Num, p: CostParams,
                       precision: Num = None) -> tuple[Num, Num, Num, Num]:
    """(weights, grads, optimizer, transient) bytes for ``params`` parameters held by one GPU
    before ZeRO sharding over ``shard`` ranks; ``layer_params`` for FSDP's gathered copies
    (``precision``: the plan's, for the profile's main_grads; None: a lower bound)."""
    z3 = zero == 3
    w = np.where(z3, np.where(offload_params, 0, 4 * params / shard), 2 * params)
    # FSDP2's CPUOffloadPolicy keeps the sharded gradients on the host too (the host part, cost.batch)
    g = np.where(z3, np.where(offload_params, 0, 4 * params / shard),
                 grad_bytes(zero, p, precision) * params / np.where(zero >= 2, shard, 1))
    o = np.where(offload_optimizer, 0, np.where(z3, 8 * params / shard, 12 * params / np.where(zero >= 1, shard, 1)))
    gathered = (1 + p.fsdp_prefetch_layers) * layer_params * 2.0 + layer_params * 4.0
    buckets = np.where(dp_cp > 1, p.dp_bucket_buffers * p.dp_bucket_mib * 2**20, 0.0)
    return w, g, o, np.where(z3, gathered, buckets)


def model_state_bytes(params: float, layer_params: float, plan: Plan,
                      p: CostParams) -> tuple[float, float, float, float]:
    """model_state_arrays for one plan."""
    out = model_state_arrays(params, layer_params, plan.zero, plan.effective_shard, plan.offload_params,
                             plan.offload_optimizer, plan.dp * plan.cp, p, plan.precision)
    return tuple(float(x) for x in out)  # type: ignore[return-value]
