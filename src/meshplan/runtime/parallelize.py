"""Apply a Plan to a model from outside, in one fixed order (torchtitan's parallelize_llama):

1. pipeline split   the full model is built (same seed on every rank), then each pipeline
                    stage keeps its blocks (plan.stage_layers, virtual stages) and drops the rest;
2. TP / SP          DTensor parallelize_module: Megatron column/row split of attention and MLP,
                    sequence-sharded norms with sequence_parallel; needs the unsharded params;
3. CP               not run (cp>1 is rejected by mesh.check_supported);
4. recompute        checkpoint_wrapper per block (full, first recompute_layers of each stage),
                    around the core attention (selective), or op-level SAC (op); it wraps the
                    TP-annotated modules so recomputation replays their collectives;
5. data parallel    zero=0: DDP (a manual, flattened gradient all-reduce when params are
                    DTensors, which DDP cannot hold, or under PP); zero 1-3: FSDP2 fully_shard per block then per stage,
                    on a 2-D (replicate, shard) mesh for HSDP; last, because it shards whatever
                    the earlier steps produced;
6. precision        FSDP2 MixedPrecisionPolicy (bf16/fp16 params, fp32 reduce), else autocast.

FSDP2 has no ZeRO-1/2 switch: zero=3 reshards parameters after forward (not under PP, where it
would all-gather once per micro-batch), zero=1 and zero=2 keep them unsharded from forward to
backward. Gradients are reduce-scattered and optimizer states sharded in all three.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshplan.errors import MeshplanError
from meshplan.runtime.mesh import RuntimeMesh, dp_split
from meshplan.runtime.models import Transformer, loss_fn
from meshplan.spec.plan import Plan

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "fp32": torch.float32}
"""Compute dtype per plan precision (fp8 runs as bf16: no fp8 linears in this runtime)."""


@dataclass
class Parallelized:
    """This rank's share of the model and how to run it."""

    parts: list[nn.Module]
    """Model chunks held by this rank (one, or virtual_stages under interleaving); raw modules."""
    run_modules: list[nn.Module]
    """What forward runs: the parts, or their DDP wrappers."""
    stage_ids: list[int] = field(default_factory=lambda: [0])
    schedule: Any = None
    """A torch.distributed.pipelining schedule when pp > 1."""
    dp_mode: str = "none"
    """none | ddp | manual (all-reduce by hand) | fsdp."""
    autocast: torch.dtype | None = None

    @property
    def has_first(self) -> bool:
        return any(p.embed is not None for p in self.parts)  # type: ignore[union-attr]

    @property
    def has_last(self) -> bool:
        return any(p.output is not None for p in self.parts)  # type: ignore[union-attr]


# ---- 1. pipeline split -----------------------------------------------------------------------
def _even(n: int, k: int) -> list[int]:
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def stage_layer_counts(num_layers: int, plan: Plan) -> list[int]:
    """Blocks per global pipeline stage (pp * virtual_stages stages, in model order).
    stage_layers gives blocks per pipeline rank; a rank's blocks are split evenly over its chunks."""
    v = plan.virtual_stages
    if plan.stage_layers is None:
        return _even(num_layers, plan.pp * v)
    counts = [0] * (plan.pp * v)
    for r, n in enumerate(plan.stage_layers):
        for i, c in zip(stage_ids_for_rank(r, plan), _even(n, v)):
            counts[i] = c
    return counts


def stage_ids_for_rank(pp_rank: int, plan: Plan) -> list[int]:
    """Global stage indices on a pipeline rank: looped (r, r+pp, ...) or V-shaped for zbv."""
    pp, v = plan.pp, plan.virtual_stages
    if plan.schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(v)]


def split_stage(model: Transformer, stage: int, counts: list[int]) -> Transformer:
    """A copy of ``model`` keeping only what stage ``stage`` computes."""
    part = copy.deepcopy(model)
    start = sum(counts[:stage])
    keep = {str(i) for i in range(start, start + counts[stage])}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage > 0:
        part.embed = None
    if stage < len(counts) - 1:
        part.norm = None
        part.output = None
    return part


# ---- 2. tensor + sequence parallel -------------------------------------------------------------
def apply_tp(part: Transformer, tp_mesh: Any, sp: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    resid = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    top: dict[str, Any] = {}
    if part.embed is not None:
        top["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            top["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if part.output is not None:
        if sp:
            top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=resid, output_layouts=Replicate())
    tied = part.embed is not None and part.output is not None and part.output.weight is part.embed.tok.weight
    if tied:  # both shard the vocab dim of the one matrix: parallelize the output, then re-tie
        top.pop("output")
    parallelize_module(part, tp_mesh, top)
    if tied:
        parallelize_module(part.output, tp_mesh, ColwiseParallel(input_layouts=resid, output_layouts=Replicate()))
        part.output.weight = part.embed.tok.weight
    for block in part.layers.values():
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=resid)}
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                   desired_input_layouts=(Replicate(), None, None),
                                                   use_local_output=True)
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),),
                                                      use_local_output=True)
        ff = block.feed_forward
        mlps = [(f"feed_forward.experts.{e}", m) for e, m in enumerate(ff.experts)] if hasattr(ff, "experts") \
            else [("feed_forward", ff)]
        moe = hasattr(ff, "experts")
        for prefix, mlp in mlps:
            plan[f"{prefix}.w1"] = ColwiseParallel()
            plan[f"{prefix}.w2"] = RowwiseParallel(output_layouts=Replicate() if moe else resid)
            if mlp.w3 is not None:
                plan[f"{prefix}.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)
        if moe and sp:  # experts return the replicated sum; the residual stream is sequence-sharded
            parallelize_module(block.feed_forward, tp_mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)))


# ---- 4. activation recomputation ---------------------------------------------------------------
def _op_sac_context() -> Any:
    """torchtitan's op-level selective AC: keep matmul outputs every other time and attention
    outputs; recompute everything else (elementwise ops, norms)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    mm = {aten.mm.default, aten.addmm.default}
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in mm:
            counts[mode] += 1
        keep = func in save and not (func in mm and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(part: Transformer, plan: Plan) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    if plan.recompute == "none":
        return
    names = list(part.layers.keys())
    if plan.recompute == "full":
        n = len(names) if plan.recompute_layers is None else min(plan.recompute_layers, len(names))
        for name in names[:n]:
            part.layers[name] = checkpoint_wrapper(part.layers[name], preserve_rng_state=False)
    elif plan.recompute == "selective":
        for name in names:
            attn = part.layers[name].attention
            attn.core = checkpoint_wrapper(attn.core, preserve_rng_state=False)
    else:  # op
        for name in names:
            part.layers[name] = checkpoint_wrapper(part.layers[name], preserve_rng_state=False,
                                                   context_fn=_op_sac_context)


# ---- 5/6. data parallel and precision ----------------------------------------------------------
def apply_fsdp(parts: list[nn.Module], plan: Plan, mesh: RuntimeMesh) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rep, _ = dp_split(plan)
    dp_mesh = mesh.sub("dp_replicate", "dp_shard") if rep > 1 else mesh.sub("dp_shard")
    dtype = DTYPES[plan.precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
        else MixedPrecisionPolicy()  # fp32: no casts at all
    reshard = plan.zero == 3 and plan.pp == 1
    for part in parts:
        for block in part.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def _has_dtensor(parts: list[nn.Module]) -> bool:
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for part in parts for p in part.parameters())


def apply_data_parallel(parts: list[nn.Module], plan: Plan, mesh: RuntimeMesh) -> tuple[list[nn.Module], str]:
    if plan.zero > 0:
        apply_fsdp(parts, plan, mesh)
        return parts, "fsdp"
    if _has_dtensor(parts) or plan.pp > 1:  # DDP holds no DTensors; under PP its reducer
        return parts, "manual"                # asserts on stages with few parameters (torch 2.13)
    from torch.nn.parallel import DistributedDataParallel as DDP
    return [DDP(p, process_group=mesh.dp_group) for p in parts], "ddp"


# ---- the whole ---------------------------------------------------------------------------------
def parallelize(model: Transformer, plan: Plan, mesh: RuntimeMesh | None, device: torch.device,
                *, microbatches: int) -> Parallelized:
    """Apply ``plan`` to ``model`` (the full model, same weights on every rank) for this rank."""
    if mesh is None or plan.num_gpus == 1:
        model.to(device)
        apply_ac(model, plan)
        autocast = None if plan.precision == "fp32" else DTYPES[plan.precision]
        return Parallelized(parts=[model], run_modules=[model], autocast=autocast)
    counts = stage_layer_counts(model.spec.num_layers, plan)
    stage_ids = stage_ids_for_rank(mesh.pp_rank, plan) if plan.pp > 1 else [0]
    parts = [split_stage(model, s, counts) if plan.pp > 1 else model for s in stage_ids]
    for part in parts:
        part.to(device)
        if plan.tp > 1:
            apply_tp(part, mesh.sub("tp"), plan.sequence_parallel)
        apply_ac(part, plan)
    run_modules, dp_mode = (parts, "none") if plan.dp == 1 else apply_data_parallel(parts, plan, mesh)
    autocast = None if plan.precision == "fp32" or dp_mode == "fsdp" else DTYPES[plan.precision]
    out = Parallelized(parts=parts, run_modules=run_modules, stage_ids=stage_ids, dp_mode=dp_mode,
                       autocast=autocast)
    if plan.pp > 1:
        out.schedule = build_schedule(run_modules, stage_ids, plan, mesh, device, microbatches)
    return out


SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def build_schedule(modules: list[nn.Module], stage_ids: list[int], plan: Plan, mesh: RuntimeMesh,
                   device: torch.device, microbatches: int) -> Any:
    from torch.distributed import pipelining
    num_stages = plan.pp * plan.virtual_stages
    stages = [pipelining.PipelineStage(m, s, num_stages, device, group=mesh.pp_group)
              for m, s in zip(modules, stage_ids)]
    name = SCHEDULES[plan.schedule]
    if plan.schedule in ("gpipe", "1f1b") and len(stages) > 1:
        name = "ScheduleInterleaved1F1B" if plan.schedule == "1f1b" else "ScheduleLoopedBFS"
    cls = getattr(pipelining, name)
    single = name in ("ScheduleGPipe", "Schedule1F1B")
    if single:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    if microbatches < plan.pp and name != "ScheduleLoopedBFS":
        raise MeshplanError(f"plan: schedule={plan.schedule} needs at least pp={plan.pp} micro-batches "
                            f"per step, got {microbatches}", hint="raise --global-batch or lower micro_batch")
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
