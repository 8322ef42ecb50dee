"""Memory per GPU for each pipeline stage: model states, activations, transients.

Model states per parameter (mixed-precision training, Rajbhandari et al. 2020), for the
workload's optimizer (``OptimizerCost``: its own state bytes per parameter, ``S``; AdamW's two
fp32 moments S = 8):
  ZeRO 0-2 (Megatron/DeepSpeed style): 16-bit weights 2 B, grads 2 B (fp32 4 B with a
  distributed optimizer; the profile's CostParams.main_grads: Megatron's fp32 main grads also
  under DDP), fp32 master 4 B + the optimizer's states S (AdamW: 12 B); ZeRO-1 shards master +
  states, ZeRO-2 also the grads. ZeRO-3/FSDP: fp32 sharded params 4 B + fp32 grads 4 B + S, all
  sharded, plus the 16-bit unsharded copies of the layers being computed.
  precision=fp32: weights and grads are 4 B each and there is no separate master copy (the
  fp32 weights are what the optimizer updates): ZeRO-0 AdamW is 4 + 4 + 8 = 16 B/param.
  Nothing to shard across (dp x cp within the shard group = 1): every ZeRO level is ZeRO-0's
  memory (issue 27 cause 5: one runtime measured the same peak for ZeRO 0/2/3 on one GPU).
Activations per token of each layer come from its LayerOps (cost.layer; a transformer block's
follow Korthikanti et al. 2022 Eq. 2, 34 s b h for GPT with TP/SP splits, generalised to GQA,
SwiGLU, rotary and FlashAttention: spec.transformer).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph, derived, layer_ops
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import OPTIMIZERS, Plan

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
INPLACE_LOGITS_BYTES_PER_ELEM = 6.0
"""The same for Megatron's vocabulary-parallel cross-entropy (megatron/core/tensor_parallel/
cross_entropy.py, _VocabParallelCrossEntropy; the same in place in Megatron-DeepSpeed's mpu):
the 16-bit logits 2 + their fp32 copy 4, on which max-subtract, exp and the division by the sum
run in place and which is saved as the softmax; the backward writes the gradient into it in place
and casts it back to 16 bit (4 + 2). The same with tp > 1 (only the max and the sum are
all-reduced). With --fp16-lm-cross-entropy (logits_fp32 False) the steps run on the 16-bit
logits themselves: INPLACE_16_LOGITS_BYTES_PER_ELEM."""
INPLACE_16_LOGITS_BYTES_PER_ELEM = 2.0
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


FP32_MASTER_BYTES = 4.0
"""The fp32 master copy of 16-bit (or fp8) weights that mixed-precision training updates
(Micikevicius et al. 2018; Rajbhandari et al. 2020's K = 12 = master 4 + Adam's m, v 8)."""

BNB_BLOCK = 256
"""Elements per quantisation block of bitsandbytes' blockwise 8-bit optimizers: each state keeps
one fp32 absmax per block (bitsandbytes/optim/optimizer.py, Optimizer2State.init_state:
``blocks = n // 256``, ``absmax1``/``absmax2`` float32; Dettmers et al. 2022, 8-bit Optimizers
via Block-wise Quantization)."""

OPTIMIZER_STATE_BYTES: dict[str, float | None] = {
    "adamw": 8.0, "adam": 8.0, "sgd": 4.0, "lion": 4.0,
    "adam8bit": 2.0 * (1.0 + 4.0 / BNB_BLOCK), "adafactor": None}
"""The optimizer's own state bytes per parameter (beside the master copy, which master_bytes
counts): adamw / adam two fp32 moments m, v (8); sgd one fp32 momentum buffer (torch.optim.SGD
with momentum > 0: 4); lion one momentum (Chen et al. 2023, lion-pytorch: 4); adam8bit two
8-bit moments plus one fp32 absmax per BNB_BLOCK elements each (2.03); adafactor from the
parameters' shapes (adafactor_state_bytes: None here). A 0-dimensional per-tensor ``step``
counter (torch's Adam, AdamW, Adafactor) is 4 B per parameter tensor, not per parameter, and is
left out."""

OPTIMIZER_STEP_BYTES = {"adamw": 32.0, "adam": 32.0, "sgd": 24.0, "lion": 24.0, "adam8bit": 20.0,
                        "adafactor": 64.0}
"""HBM bytes an optimizer step moves per parameter (memory-bound: read and written once per
pass), each with the bf16 copy written (2) and the gradient-norm pass (~2) of AdamW's 32
(CostParams.optimizer_bytes_per_param, which these are priced relative to): adamw / adam read
fp32 param, grad, m, v (16), write param, m, v (12): 32 (a fused kernel: apex/TE FusedAdam,
torch fused=True); sgd (momentum) read param, grad, buffer (12), write param, buffer (8): 24;
lion the same with its one momentum: 24; adam8bit read param, grad (8) and 8-bit m, v (2),
write param (4) and m, v (2): 20 (bitsandbytes' fused blockwise kernel); adafactor the passes
of torch.optim.Adafactor's step (no fused kernel exists), each a full fp32 tensor: the param
norm (4), the gradient's row and column norms (4 + 4), the variance estimate row_var @ col_var
written (4), divided (8), clamped and rsqrt-ed (8), times the gradient (12), the update's norm
(4), the parameter update (12): 60 + 4 = 64."""

ADAFACTOR_FACTORED_MIN_DIM = 2
"""torch.optim.Adafactor factors the second moment of a tensor with dim >= 2 (row_var of shape
[..., rows, 1], col_var [..., 1, cols]: rows x ... + cols x ... elements, in the gradient's
dtype) and keeps the full variance of a vector (torch/optim/_adafactor.py, torch 2.13: no first
moment, beta1 does not exist; lr 1e-2, beta2_decay -0.8, eps (None, 1e-3), d 1, no weight
decay by default)."""


@dataclass(frozen=True)
class OptimizerCost:
    """What the cost model needs of the workload's optimizer (Workload.optimizer)."""

    name: str
    state_bytes: float
    """Its own state bytes per parameter (no master copy; ZeRO-1+ shards them all)."""
    step_bytes: float
    """HBM bytes per parameter of its step (OPTIMIZER_STEP_BYTES)."""

    @property
    def step_ratio(self) -> float:
        """Its step's bytes relative to AdamW's (the host step under optimizer offload scales so)."""
        return self.step_bytes / OPTIMIZER_STEP_BYTES["adamw"]


ADAMW = OptimizerCost("adamw", 8.0, OPTIMIZER_STEP_BYTES["adamw"])


def adafactor_state_elements(shapes: Iterable[Sequence[int]]) -> int:
    """State elements torch.optim.Adafactor keeps for parameters of ``shapes`` (step counters
    left out): a tensor of dim >= 2 its row and column factors, a vector its full variance."""
    n = 0
    for shape in shapes:
        if len(shape) >= ADAFACTOR_FACTORED_MIN_DIM:
            lead = math.prod(shape[:-2])
            n += lead * (shape[-2] + shape[-1])
        else:
            n += math.prod(shape)
    return n


def transformer_param_shapes(m: ModelSpec) -> list[tuple[int, ...]]:
    """The parameter shapes of ``m`` as meshplan's runtime builds it (runtime/models.py: token and
    learned-position embeddings, per block the norms, wq/wk/wv/wo, w1/w2/w3 or the router and the
    experts', the final norm and the output projection unless tied), numel summing to
    ``m.num_params()``."""
    h = m.hidden_size
    norm = [(h,), (h,)] if (m.norm == "layernorm" and m.bias) else [(h,)]

    def linear(i: int, o: int) -> list[tuple[int, ...]]:
        return [(o, i)] + ([(o,)] if m.bias else [])

    def mlp(ffn: int) -> list[tuple[int, ...]]:
        return linear(h, ffn) + linear(ffn, h) + (linear(h, ffn) if m.mlp_type == "swiglu" else [])

    out: list[tuple[int, ...]] = [(m.vocab_size, h)]
    if m.position == "learned":
        out.append((m.max_position_embeddings or m.seq_len, h))
    if m.embedding_norm:
        out += norm
    attn = linear(h, m.q_dim) + linear(h, m.kv_dim) + linear(h, m.kv_dim) + linear(m.q_dim, h)
    ffn = ([(m.num_experts, h)] + mlp(m.expert_ffn) * m.num_experts) if m.is_moe else mlp(m.ffn_hidden_size)
    out += (norm + attn + norm + ffn) * m.num_layers
    out += norm + ([] if m.tied_embeddings else [(m.vocab_size, h)])
    return out


def _graph_state_elements(graph: LayerGraph) -> float:
    """Adafactor's state elements of a traced graph (no ModelSpec): each layer's linear GEMMs
    (m = 1) as weight matrices n x k (per expert), factored: k + n each; the rest of an embedding
    layer's parameters as one table of width hidden (LayerOps.hidden / 2 bytes), factored; every
    other parameter (norms, biases, convolutions' kernels) at one element each. An approximation:
    a fused q/k/v GEMM counts one matrix where a model may hold three (a few elements of width
    per matrix, against its width^2 parameters)."""
    ops = layer_ops(graph)
    n = 0.0
    for layer in graph.layers:
        o, left = ops[layer.block], float(layer.params)
        for g in o.gemms:
            count = o.experts if (g.expert and o.experts) else 1
            if g.m == 1.0 and g.k * g.n * count <= left:
                left -= g.k * g.n * count
                n += (g.k + g.n) * count
        width = o.hidden / 2.0
        if layer.kind == "embedding" and width >= 1 and left >= width:
            n += left / width + width
        else:
            n += left
    return n


def adafactor_state_bytes(graph: LayerGraph) -> float:
    """Adafactor's state bytes per parameter of ``graph`` (fp32 states; memoised on the graph):
    from the exact parameter shapes when the graph was generated from a ModelSpec
    (transformer_param_shapes), else _graph_state_elements. About 4 (rows + cols) / (rows x cols)
    per matrix: ~8 / hidden for a transformer, plus 4 for each norm or bias element."""
    def make(g: LayerGraph) -> float:
        if g.model is not None:
            shapes = transformer_param_shapes(g.model)
            return 4.0 * adafactor_state_elements(shapes) / max(1, sum(math.prod(s) for s in shapes))
        return 4.0 * _graph_state_elements(g) / max(1, g.params)
    return float(derived(graph, "adafactor_state", make))


def optimizer_cost(name: str, graph: LayerGraph | None = None) -> OptimizerCost:
    """The OptimizerCost of optimizer ``name`` (OPTIMIZERS) for ``graph`` (Adafactor's factored
    state depends on the parameters' shapes; without a graph, 0 B: a lower bound)."""
    if name not in OPTIMIZERS:
        from meshplan.errors import MeshplanError
        raise MeshplanError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {name!r}")
    if name == "adamw":
        return ADAMW
    state = OPTIMIZER_STATE_BYTES[name]
    if state is None:
        state = adafactor_state_bytes(graph) if graph is not None else 0.0
    return OptimizerCost(name, state, OPTIMIZER_STEP_BYTES[name])


def grad_bytes(zero: Num, p: CostParams, precision: Num = None) -> Num:
    """Gradient bytes per parameter for ZeRO 0-2 (before ZeRO-2's sharding): auto: 16-bit for
    ZeRO-0, fp32 with a distributed optimizer (ZeRO-1/2); or the profile's main_grads: bf16
    (16-bit), fp32 (Megatron: fp32 main grads, but fp16 runs keep 16-bit ones, as Megatron turns
    accumulate_allreduce_grads_in_fp32 on for bf16 only). precision=fp32: 4 B whatever the
    profile (the gradients are the weights' dtype; no 16-bit copy). ``precision`` None (not
    known: the search's bounds) gives the smaller."""
    auto = np.where(np.asarray(zero) >= 1, 4.0, 2.0)
    if p.main_grads == "bf16":
        out = np.where(np.asarray(zero) >= 0, 2.0, 0.0)
    elif p.main_grads == "bf16+fp32":
        out = np.where(np.asarray(zero) >= 0, 6.0, 0.0)
    elif p.main_grads == "fp32":
        out = auto if precision is None else np.where(np.asarray(precision) == "fp16", auto, 4.0)
    else:
        out = auto
    if precision is None:
        return out
    return np.where(np.asarray(precision) == "fp32", 4.0, out)


def usable_gib(cluster: ClusterSpec, p: CostParams = DEFAULT_PARAMS) -> float:
    """Memory a plan may use to 'fit' (the cost model's definition): HBM less the margin."""
    return cluster.gpu.memory_gib * (1 - p.memory_margin)


def master_bytes(precision: Num) -> Num:
    """Bytes per parameter of the fp32 master copy the optimizer updates beside 16-bit (or fp8)
    weights: 4 for bf16/fp16/fp8, 0 for fp32 (the weights are fp32 themselves). ``precision`` None
    (not known: the search's bounds) gives the smaller, 0."""
    if precision is None:
        return 0.0
    return np.where(np.asarray(precision) == "fp32", 0.0, FP32_MASTER_BYTES)


def effective_zero(zero: Num, shard: Num, offload_params: Num = False) -> Num:
    """The ZeRO level memory sees: ZeRO-0 where nothing is sharded (``shard`` = 1: dp x cp within
    the shard group is 1), unless the parameters are offloaded (FSDP's CPU offload moves them to
    the host even on one rank). Issue 27 cause 5: torch's allocator measured the same peak for
    ZeRO 0/2/3 of one GPT on one GPU."""
    return np.where((np.asarray(shard) > 1) | np.asarray(offload_params, dtype=bool), zero, 0)


def model_state_arrays(params: Num, layer_params: Num, zero: Num, shard: Num, offload_params: Num,
                       offload_optimizer: Num, dp_cp: Num, p: CostParams,
                       precision: Num = None, *, opt: OptimizerCost,
                       level_shard: Num = None) -> tuple[Num, Num, Num, Num]:
    """(weights, grads, optimizer, transient) bytes for ``params`` parameters held by one GPU
    before ZeRO sharding over ``shard`` ranks; ``layer_params`` for FSDP's gathered copies
    (``precision``: the plan's, for the master copy, the 16- or 32-bit weights and the profile's
    main_grads; None: a lower bound over precisions); ``opt``: the workload's optimizer.

    ZeRO-1+ shards all the optimizer's states (and the master copy) over ``shard`` ranks, ZeRO-2
    the grads, ZeRO-3 the weights; with ``shard`` = 1 there is nothing to shard and every ZeRO
    level gives ZeRO-0's bytes (effective_zero; no profile charges extra flat buffers for a ZeRO
    stage: docs/profiles.md). ``level_shard`` (default ``shard``): the group whose size decides
    whether anything shards (the plan's), where ``shard`` divides a part held by fewer ranks (the
    experts over their own replicas)."""
    # a part held by one rank of its group (experts whose replicas are 1) shards nothing either: ZeRO-0's bytes
    zero = effective_zero(zero, shard if level_shard is None else np.minimum(shard, level_shard), offload_params)
    z3 = zero == 3
    wb = 2.0 if precision is None else np.where(np.asarray(precision) == "fp32", 4.0, 2.0)  # unsharded weights
    w = np.where(z3, np.where(offload_params, 0, 4 * params / shard), wb * params)
    # FSDP2's CPUOffloadPolicy keeps the sharded gradients on the host too (the host part, cost.batch)
    g = np.where(z3, np.where(offload_params, 0, 4 * params / shard),
                 grad_bytes(zero, p, precision) * params / np.where(zero >= 2, shard, 1))
    # ZeRO-3 keeps fp32 sharded weights (the master, counted in w): the optimizer holds its states only
    per = np.where(z3, opt.state_bytes, master_bytes(precision) + opt.state_bytes)
    o = np.where(offload_optimizer, 0, per * params / np.where(zero >= 1, shard, 1))
    gathered = (1 + p.fsdp_prefetch_layers) * layer_params * wb + layer_params * 4.0
    buckets = np.where(dp_cp > 1, p.dp_bucket_buffers * p.dp_bucket_mib * 2**20, 0.0)
    return w, g, o, np.where(z3, gathered, buckets)


def model_state_bytes(params: float, layer_params: float, plan: Plan, p: CostParams,
                      opt: OptimizerCost | None = None) -> tuple[float, float, float, float]:
    """model_state_arrays for one plan (``opt`` default: AdamW)."""
    out = model_state_arrays(params, layer_params, plan.zero, plan.effective_shard, plan.offload_params,
                             plan.offload_optimizer, plan.dp * plan.cp, p, plan.precision,
                             opt=opt or ADAMW)
    return tuple(float(x) for x in out)  # type: ignore[return-value]
