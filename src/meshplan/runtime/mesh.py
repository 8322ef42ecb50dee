"""Plan -> torch DeviceMesh.

The planner's axes, outermost to innermost: pp, dp, cp, tp by default. TP groups are then
consecutive ranks, so on GPUs they share a node's fastest links. A plan's placement
(``mesh_order``, spec.axes.ParallelDims.rank_grid) lays the axes onto the ranks in another order:
the root mesh is built from that rank grid (DeviceMesh from an explicit mesh tensor, whose
dimensions are still (pp, dp_cp, tp)), so every group below holds the ranks the plan names, and
every coordinate (pp_rank, dp_rank, ...) is read from the mesh, never computed from the global
rank. All meshes here come from that one root by unflattening dp_cp, so that FSDP can combine any
of them with the TP mesh:

    world   (pp, dp, cp, tp)                          coordinates; cp groups
    fsdp    (pp, dp_replicate, dp_shard, tp)          dp x cp split for FSDP/HSDP (ZeRO shards over dp x cp)
    experts (pp, edp_replicate, edp_shard, ep, tp)    ep > 1: the ep group = innermost ep ranks of dp x cp;
                                                      expert replicas = the rest, split for FSDP/HSDP
Every axis is created, size 1 included, so that code never branches on which axes exist.

Periodic plans (grad_sync=local-sgd/diloco, runtime/periodic.py): dp x cp is split into
(dp_replicate = workers, dp_shard = inner dp x cp): the inner groups (``sync_mesh``: DDP's group,
the manual all-reduce's, FSDP2's shard mesh, never replicated across groups) and the outer groups
(``outer``: one rank of each inner group, at the same coordinate).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshplan.errors import MeshplanError
from meshplan.runtime.local import cpu_cluster
from meshplan.runtime.preflight import refuse
from meshplan.spec.axes import AX, ParallelDims
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan
from meshplan.spec.support import runtime_violations


def dp_split(plan: Plan) -> tuple[int, int]:
    """(replicate, shard) sizes of the dp x cp ranks: DDP replicates over all of them; FSDP
    shards over all; HSDP shards within groups of shard_group and replicates across."""
    n = plan.dp * plan.cp
    if plan.zero == 0:
        return n, 1
    shard = plan.effective_shard
    return n // shard, shard


def expert_split(plan: Plan) -> tuple[int, int]:
    """(replicate, shard) sizes of an expert's replicas (dp x cp / ep ranks). Experts are sharded
    within the dense shard group when ep divides it (HSDP keeps its groups), else replicated."""
    n = plan.dp * plan.cp // plan.ep
    if plan.zero == 0:
        return n, 1
    _, shard = dp_split(plan)
    eshard = shard // plan.ep if shard % plan.ep == 0 else 1
    return n // eshard, eshard


def check_supported(model: ModelSpec, plan: Plan, world_size: int, seq_len: int | None = None,
                    micro: int | None = None) -> None:
    """Raise a one-line MeshplanError for a plan this runtime cannot execute: the process count,
    the planner's rules on the model (spec.capabilities.MODEL_CHECKS of spec.constraints, one table
    with the search's: heads, widths, experts, what the layers allow) and, with ``micro``, the
    "refused" rules of spec.support (shared with the search)."""
    if plan.num_gpus != world_size:
        raise MeshplanError(
            f"plan needs {plan.num_gpus} processes (tp={plan.tp} x pp={plan.pp} x dp={plan.dp} x "
            f"cp={plan.cp}) but {world_size} were started",
            hint=f"use --nproc-per-node {plan.num_gpus} (x --nnodes) or change the plan")
    from meshplan.spec.capabilities import MODEL_CHECKS
    from meshplan.spec.constraints import CHECKS, violations
    from meshplan.spec.plan import Workload
    # the model's rules of the planner's table (the launcher's preflight.check_plan runs the rest)
    work = Workload(global_batch=plan.dp * plan.micro_batch * (micro or plan.pp), seq_len=seq_len or model.seq_len)
    skip = tuple(name for name in CHECKS if name not in MODEL_CHECKS)
    refuse(violations(model, cpu_cluster(plan.num_gpus, memory_gib=1.0), plan, work, skip=skip))
    refused = [why for rule, why in runtime_violations(plan, micro, model) if rule.kind == "refused"] \
        if micro is not None else []
    if refused:  # the runtime's rules, shared with the search (spec.support)
        raise MeshplanError("plan: " + "; ".join(refused))


@dataclass(frozen=True)
class RuntimeMesh:
    """The meshes of a run and the coordinates of this rank."""

    world: DeviceMesh
    """(pp, dp, cp, tp)."""
    fsdp: DeviceMesh
    """(pp, dp_replicate, dp_shard, tp): how FSDP/HSDP split dp x cp."""
    dp_mesh: DeviceMesh
    """All of dp x cp as one axis: the ranks that average the loss (and gradients, when synchronous)."""
    experts: DeviceMesh | None
    """(pp, edp_replicate, edp_shard, ep, tp) when ep > 1."""
    expert_dp: DeviceMesh | None
    """An expert's replicas (dp x cp / ep ranks) as one axis, when ep > 1 (a manual all-reduce)."""
    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    pp_rank: int
    dp_rank: int
    """Index on the dp axis: which rows of the global batch this rank reads."""
    cp_rank: int
    tp_rank: int
    ep_rank: int
    sync_mesh: DeviceMesh | None = None
    """The ranks that average gradients every step, as one axis: dp x cp (``dp_mesh``), or a
    periodic plan's inner group (inner dp x cp); None: ``dp_mesh``."""
    outer: DeviceMesh | None = None
    """Periodic plans: this rank's outer group (one rank per inner group), else None."""
    workers: int = 1
    """Inner groups (1: a synchronous plan)."""
    worker: int = 0
    """This rank's inner group."""

    @property
    def ndp(self) -> int:
        """Ranks averaging the loss: dp * cp."""
        return self.dp * self.cp

    @property
    def sync_ndp(self) -> int:
        """Ranks averaging gradients every step: dp * cp, or a periodic plan's inner dp * cp."""
        return self.ndp // self.workers

    @property
    def sync_group(self) -> dist.ProcessGroup:
        """The group of ``sync_mesh``: gradient averaging every step (DDP's group)."""
        return (self.sync_mesh or self.dp_mesh).get_group()

    @property
    def outer_group(self) -> dist.ProcessGroup:
        assert self.outer is not None
        return self.outer.get_group()

    def sub(self, *axes: str) -> DeviceMesh:
        return self.world[axes] if len(axes) > 1 else self.world[axes[0]]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.world.get_group(AX.PP)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """dp x cp (gradient and loss averaging)."""
        return self.dp_mesh.get_group()

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.world.get_group(AX.CP)

    @property
    def ep_group(self) -> dist.ProcessGroup:
        assert self.experts is not None
        return self.experts.get_group(AX.EP)

    def end_stage_group(self) -> dist.ProcessGroup | None:
        """The group of pipeline ranks 0 and pp-1 at this rank's (dp, cp, tp) coordinate, where the
        two copies of tied embeddings live; None on the ranks in between. Collective: every rank
        creates every pair's group (dp*cp*tp of them), in the same order; cached."""
        cache = self.__dict__.setdefault("_end_stage_groups", {})
        if "group" not in cache:
            ranks = self.world.mesh  # (pp, dp, cp, tp)
            first, last = ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()
            me, mine = dist.get_rank(), None
            for a, b in zip(first, last):
                group = dist.new_group([a, b])
                if me in (a, b):
                    mine = group
            cache["group"] = mine
        return cache["group"]

    def unit_groups(self, cps: list[int]) -> dict[int, dist.ProcessGroup]:
        """Bucket plans (pp = 1): this rank's unit group for each bucket cp degree in ``cps`` above 1.
        A unit of cp c is c consecutive ranks of dp x cp (rank d x C + c', C = the plan's cp) at this
        rank's tp coordinate; for c = C that is the cp group. Collective: every rank creates every
        unit's group of every c < C (in the same order, the smaller c first)."""
        ranks = self.world.mesh[self.pp_rank].reshape(self.dp * self.cp, self.tp)  # (dp x cp, tp)
        me = dist.get_rank()
        out: dict[int, dist.ProcessGroup] = {}
        for c in sorted(set(cps)):
            if c <= 1:
                continue
            if c == self.cp:
                out[c] = self.cp_group
                continue
            for u in range(self.dp * self.cp // c):
                for t in range(self.tp):
                    members = ranks[u * c:(u + 1) * c, t].tolist()
                    group = dist.new_group(members)
                    if me in members:
                        out[c] = group
        return out

    def fsdp_mesh(self) -> DeviceMesh:
        if self.workers > 1:  # periodic: sharded within the inner group, never replicated across
            return self.fsdp["dp_shard"]
        rep = self.fsdp.size(self.fsdp.mesh_dim_names.index("dp_replicate"))
        return self.fsdp["dp_replicate", "dp_shard"] if rep > 1 else self.fsdp["dp_shard"]

    def expert_fsdp_mesh(self) -> DeviceMesh:
        assert self.experts is not None
        rep = self.experts.size(self.experts.mesh_dim_names.index("edp_replicate"))
        return self.experts["edp_replicate", "edp_shard"] if rep > 1 else self.experts["edp_shard"]


def root_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The root (pp, dp_cp, tp) mesh of ``plan``: the global rank at each coordinate is the
    placement's (ParallelDims.rank_grid; the default placement gives torch.arange, the mesh
    init_device_mesh builds).

    A site order (Plan.site_order) is not in this grid: it moves whole blocks of ranks (one
    site's), which would leave the pp dimension out of rank order, and torch orders a process
    group's members by global rank (its group rank, which torch.distributed.pipelining takes
    for the stage's position). It is realised at launch instead: the nodes of site
    site_order[k] take the node ranks of block k (k x nodes per site onwards), so that global
    rank r runs on the device ParallelDims.rank_grid (with the site order) names for it."""
    dims = dataclasses.replace(ParallelDims.of(plan), sites=None)
    grid = torch.tensor(dims.rank_grid(), dtype=torch.int).reshape(dims.root_shape)
    return DeviceMesh(device_type, grid, mesh_dim_names=dims.root_dims)


def build_mesh(plan: Plan, device_type: str, inner_dp: int | None = None) -> RuntimeMesh:
    """The meshes for ``plan`` (the process group must already exist); ``inner_dp``: the dp ranks of
    an inner group of a periodic plan (periodic.inner_dp_of; None: synchronous)."""
    dims = ParallelDims.of(plan)
    n = dims.dp_cp
    base = root_mesh(plan, device_type)
    world = base._unflatten(AX.DP_CP, (plan.dp, plan.cp), (AX.DP, AX.CP))
    workers = plan.dp // inner_dp if plan.periodic and inner_dp else 1
    split = (workers, n // workers) if workers > 1 else dp_split(plan)
    fsdp = base._unflatten(AX.DP_CP, split, ("dp_replicate", "dp_shard"))
    experts = expert_dp = None
    if plan.ep > 1:
        experts = base._unflatten(AX.DP_CP, (*expert_split(plan), plan.ep), ("edp_replicate", "edp_shard", AX.EP))
        expert_dp = experts["edp_replicate", "edp_shard"]._flatten("edp")
    return RuntimeMesh(world=world, fsdp=fsdp, dp_mesh=base[AX.DP_CP], experts=experts, expert_dp=expert_dp,
                       pp=plan.pp, dp=plan.dp,
                       cp=plan.cp, tp=plan.tp, ep=plan.ep, pp_rank=world.get_local_rank(AX.PP),
                       dp_rank=world.get_local_rank(AX.DP), cp_rank=world.get_local_rank(AX.CP),
                       tp_rank=world.get_local_rank(AX.TP),
                       ep_rank=experts.get_local_rank(AX.EP) if experts is not None else 0,
                       sync_mesh=fsdp["dp_shard"] if workers > 1 else None,
                       outer=fsdp["dp_replicate"] if workers > 1 else None, workers=workers,
                       worker=fsdp.get_local_rank("dp_replicate") if workers > 1 else 0)


GROUPS_ENV = "MESHPLAN_MESH_GROUPS"
"""A folder: with it set, every rank of `meshplan train` writes ``rank<R>.json`` there, the global
ranks of each of its process groups (``mesh_groups``), for tests that check the placement."""


def mesh_groups(mesh: RuntimeMesh) -> dict[str, list[int]]:
    """The global ranks of this rank's process group on every axis of the run's meshes (read back
    from the process groups themselves: dist.get_process_group_ranks), keyed by mesh and axis:
    ``world.pp`` ... ``fsdp.dp_shard``, ``dp_cp`` (all of dp x cp: AX.DP_CP), ``sync``; ``experts.ep`` with ep > 1."""
    out: dict[str, list[int]] = {}
    named = {"world": mesh.world, "fsdp": mesh.fsdp, **({"experts": mesh.experts} if mesh.experts is not None else {})}
    for key, m in named.items():
        for dim in m.mesh_dim_names or ():
            out[f"{key}.{dim}"] = sorted(dist.get_process_group_ranks(m.get_group(dim)))
    out[AX.DP_CP] = sorted(dist.get_process_group_ranks(mesh.dp_group))
    out["sync"] = sorted(dist.get_process_group_ranks(mesh.sync_group))
    return out


def write_groups(mesh: RuntimeMesh | None) -> None:
    """With GROUPS_ENV set, this rank's ``mesh_groups`` and mesh coordinates to ``rank<R>.json`` there."""
    folder = os.environ.get(GROUPS_ENV)
    if not folder or mesh is None or not dist.is_initialized():
        return
    rank = dist.get_rank()
    doc = {"rank": rank, "groups": mesh_groups(mesh),
           "coords": {AX.PP: mesh.pp_rank, AX.DP: mesh.dp_rank, AX.CP: mesh.cp_rank, AX.TP: mesh.tp_rank}}
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(doc))
