"""Plan -> torch DeviceMesh.

Axes, outermost to innermost: pp, dp_replicate, dp_shard, tp (the planner's pp, dp, cp, tp
with dp split for hybrid sharding; cp is not run, see ``check_supported``). TP groups are
consecutive ranks, so on GPUs they share a node's fastest links. Every axis is created, size 1
included, so that code never branches on which axes exist.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshplan.errors import MeshplanError
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan

AXES = ("pp", "dp_replicate", "dp_shard", "tp")


def dp_split(plan: Plan) -> tuple[int, int]:
    """(replicate, shard) sizes of the data-parallel axis: DDP replicates over all of dp;
    FSDP shards over all of dp; HSDP shards within groups of shard_group and replicates across."""
    if plan.zero == 0:
        return plan.dp, 1
    shard = plan.effective_shard
    return plan.dp // shard, shard


def check_supported(model: ModelSpec, plan: Plan, world_size: int) -> None:
    """Raise a one-line MeshplanError for a plan this runtime cannot execute."""
    if plan.num_gpus != world_size:
        raise MeshplanError(
            f"plan needs {plan.num_gpus} processes (tp={plan.tp} x pp={plan.pp} x dp={plan.dp} x "
            f"cp={plan.cp}) but {world_size} were started",
            hint=f"use --nproc-per-node {plan.num_gpus} (x --nnodes) or change the plan")
    if plan.cp > 1:
        raise MeshplanError("plan: cp>1 is not supported by the runtime yet (PyTorch's context "
                            "parallel needs CUDA SDPA kernels)", hint="use cp=1")
    if plan.ep > 1:
        raise MeshplanError("plan: ep>1 is not supported by the runtime yet (experts are "
                            "replicated or tensor-parallel)", hint="use ep=1")
    if plan.zero and plan.shard_group and plan.dp % plan.effective_shard:
        raise MeshplanError(f"plan: shard_group={plan.shard_group} does not divide dp={plan.dp}")
    if plan.tp > 1:
        for name, n in (("num_attention_heads", model.num_attention_heads), ("num_kv_heads", model.kv_heads),
                        ("ffn_hidden_size", model.ffn_hidden_size), ("vocab_size", model.vocab_size)):
            if n % plan.tp:
                raise MeshplanError(f"plan: tp={plan.tp} does not divide the model's {name}={n}")
    if plan.pp > 1 and model.tied_embeddings:
        raise MeshplanError(f"model {model.name}: tied embeddings with pp>1 are not supported yet "
                            "(the embedding and the output projection live on different stages)",
                            hint="use pp=1 or a model with tied_embeddings=false")
    if plan.schedule in ("zero-bubble", "zbv") and plan.pp > 1 and plan.dp > 1:
        raise MeshplanError(f"plan: schedule={plan.schedule} with dp>1 gives wrong gradients on "
                            "torch 2.13 (zero-bubble + FSDP/DDP)", hint="use interleaved-1f1b or dp=1")
    if plan.schedule == "zbv" and plan.pp > 1 and plan.virtual_stages != 2:
        raise MeshplanError("plan: schedule=zbv needs virtual_stages=2")
    if plan.stage_layers is not None and sum(plan.stage_layers) != model.num_layers:
        raise MeshplanError(f"plan: stage_layers sum to {sum(plan.stage_layers)} but the model has "
                            f"{model.num_layers} layers")


@dataclass(frozen=True)
class RuntimeMesh:
    """The world mesh and the coordinates of this rank."""

    world: DeviceMesh
    dp_mesh: DeviceMesh
    """All data-parallel ranks as one axis (for data, loss averaging and DDP)."""
    pp: int
    dp: int
    tp: int
    pp_rank: int
    dp_rank: int
    tp_rank: int

    def sub(self, *axes: str) -> DeviceMesh:
        return self.world[axes] if len(axes) > 1 else self.world[axes[0]]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.world.get_group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()


def build_mesh(plan: Plan, device_type: str) -> RuntimeMesh:
    """A DeviceMesh with the four axes for ``plan`` (process group must already exist)."""
    rep, shard = dp_split(plan)
    world = init_device_mesh(device_type, (plan.pp, rep, shard, plan.tp), mesh_dim_names=AXES)
    dp_mesh = world["dp_replicate", "dp_shard"]._flatten("dp")
    return RuntimeMesh(world=world, dp_mesh=dp_mesh, pp=plan.pp, dp=plan.dp, tp=plan.tp,
                       pp_rank=world.get_local_rank("pp"), dp_rank=dp_mesh.get_local_rank(),
                       tp_rank=world.get_local_rank("tp"))

