"""What each export target cannot run as planned: the plan settings its exporter writes as
``unsupported`` (exported as something else, or not at all).

`spec.support.export_targets` marks a plan "[export only: X]" only when X runs every runtime rule
the plan breaks (the rules' ``targets``) *and* X has none of the limits below: a plan that
Megatron would run with 1F1B instead of GPipe, or cannot run at all (context parallelism with
unfused attention: Megatron-core's CP runs inside Transformer Engine's flash/fused attention
kernels, which the unfused backend bypasses), is not one Megatron runs as planned.

Each limit is one condition of one exporter (export/megatron.py, torchtitan.py, deepspeed.py),
read from a Plan and the fields it names; `masks` evaluates it over plan columns once per
distinct value of those fields, so the search and the scalar check share one definition.
tests/unit/test_rough_edges2.py checks, on random plans, that a target is offered exactly when
its exporter lists no unsupported setting of the plan (lines about the model's shape or the
optimizer are the model's and the workload's, not the plan's), and that the masks agree with
the scalar check. Pure Python + numpy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.spec.axes import AX
from meshplan.spec.plan import Plan
from meshplan.spec.stages import stage_layer_counts

PLACEMENT = ("mesh_order", AX.TP, AX.PP, AX.DP, AX.CP)
PERIODIC = ("grad_sync", "sync_scope", "sync_overlap", "grad_compression")


# ---- what the exporters share with these limits (export/common.py, megatron.py, torchtitan.py) ----

MEGATRON_ORDER = (AX.PP, AX.DP, AX.CP, AX.TP)
"""Megatron-LM's default rank order 'tp-cp-ep-dp-pp' (innermost first; megatron/training/initialize.py
passes it to initialize_model_parallel) as a mesh_order (outermost first): meshplan's default."""
MEGATRON_TP_PP_DP_ORDER = (AX.DP, AX.PP, AX.CP, AX.TP)
"""``--use-tp-pp-dp-mapping``: 'tp-cp-ep-pp-dp' (NVIDIA/Megatron-LM megatron/training/initialize.py,
2025; older releases passed 'tp-pp-dp', without context parallelism) as a mesh_order."""


def placement_axes(plan: Plan, order: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The axes of degree > 1 of ``order`` (default: the plan's placement, spec.axes.ParallelDims.order),
    outermost first: two orders that differ only in where axes of degree 1 sit lay the ranks out alike."""
    dims = plan.dims
    return tuple(a for a in (order or dims.order) if dims.degree(a) > 1)


def placement_is(plan: Plan, order: tuple[str, ...]) -> bool:
    """Whether the plan's placement lays out the ranks as ``order`` does (outermost first)."""
    return placement_axes(plan) == placement_axes(plan, order)


def recompute_layers_per_chunk(plan: Plan, counts: list[int]) -> int | None:
    """With recompute=full: blocks recomputed per model chunk (the runtime recomputes the first
    ``recompute_layers`` blocks of each chunk). None: every block."""
    k = plan.recompute_layers
    if k is None or k >= max(counts):
        return None
    return k


def plan_sync_groups(p: Plan, cluster: Any = None) -> tuple[int, int] | None:
    """(data-parallel ranks per inner group, inner groups) of a local-sgd/diloco plan
    (spec.sync.inner_dp); None when its sync_scope (node, dc) needs the cluster and there is none."""
    if p.sync_scope == "all":
        return 1, p.dp
    if cluster is None:
        return None
    from meshplan.spec.sync import inner_dp
    n = int(inner_dp(p.dp, p.tp, p.cp, p.sync_scope, cluster))
    return n, p.dp // n


def torchtitan_dp_split(p: Plan, uns: list[str]) -> tuple[int, int]:
    """(data_parallel_replicate_degree, data_parallel_shard_degree) for the plan."""
    if p.dp * p.cp == 1:
        return 1, 1
    if p.zero == 0:
        if p.dp == 1:  # cp > 1: torchtitan's FSDP group always includes cp
            uns.append("zero=0 with cp>1: torchtitan FSDP-shards parameters over the context-parallel group "
                       "(its FSDP mesh is dp_shard x cp)")
            return 1, 1
        if p.tp > 1 or p.pp > 1 or p.cp > 1:
            uns.append("zero=0 (DDP) with TP/PP/CP: torchtitan's DDP is 1-D only; exported as FSDP over the "
                       "data-parallel ranks without resharding after forward (ZeRO-2-like)")
            return 1, p.dp
        return p.dp, 1
    if p.zero == 1:
        uns.append("zero=1: torchtitan (FSDP2) has no optimizer-only sharding; exported as FSDP without "
                   "resharding after forward, which also shards gradients (ZeRO-2-like)")
    s = p.effective_shard  # ranks over dp*cp
    if s % p.cp:
        uns.append(f"shard_group={p.shard_group} is not a multiple of cp={p.cp}: torchtitan's FSDP group always "
                   "spans the whole cp group; exported as FSDP over all data-parallel ranks")
        return 1, p.dp
    shard = s // p.cp
    return p.dp // shard, shard


@dataclass(frozen=True)
class Ctx:
    """What a limit may read besides the plan: the model's blocks (pipeline stage counts) and the
    cluster (the inner groups of a periodic sync scoped to nodes or datacenters)."""

    num_layers: int | None = None
    cluster: Any = None


@dataclass(frozen=True)
class Limit:
    target: str
    name: str
    fields: tuple[str, ...]
    """The plan fields ``fails`` reads (the masks group rows by them)."""
    fails: Callable[[Plan, Ctx], bool]


def _placement(order: tuple[str, ...]) -> Callable[[Plan, Ctx], bool]:
    def f(p: Plan, c: Ctx) -> bool:
        return not placement_is(p, order)
    return f


def _megatron_placement(p: Plan, c: Ctx) -> bool:
    return not placement_is(p, MEGATRON_ORDER) and not placement_is(p, MEGATRON_TP_PP_DP_ORDER)


def _default_placement(p: Plan, c: Ctx) -> bool:
    from meshplan.spec.axes import DEFAULT_ORDER
    return not placement_is(p, DEFAULT_ORDER)


def _compression_not_exported(p: Plan, c: Ctx, bf16_ok: bool) -> bool:
    """Megatron and DeepSpeed: a synchronous plan's compression neither maps (fp8, PowerSGD; bf16 only
    where ``bf16_ok``)."""
    if p.periodic:
        return False
    if p.grad_compression == "bf16":
        return not bf16_ok
    return p.grad_compression in ("fp8", "powersgd")


# ---- torchtitan: the FSDP/DDP split and torchft's replica groups --------------------------------

def _groups(p: Plan, c: Ctx) -> int | None:
    """torchft replica groups of a periodic plan (1 when synchronous; None: needs the cluster)."""
    if not p.periodic:
        return 1
    split = plan_sync_groups(p, c.cluster)
    return None if split is None else split[1]


def _tt_split(p: Plan, c: Ctx) -> tuple[int, int, bool]:
    """(replicate, shard, some line unsupported) of torchtitan's _dp_split on the plan of one group."""
    g = _groups(p, c) or 1
    uns: list[str] = []
    rep, shard = torchtitan_dp_split(p.replace(dp=p.dp // g) if g > 1 else p, uns)
    return rep, shard, bool(uns)


def _tt_fsdp(p: Plan, c: Ctx) -> bool:
    return _tt_split(p, c)[1] > 1 or p.cp > 1


def _tt_periodic(p: Plan, c: Ctx) -> bool:
    if not p.periodic:
        return False
    g = _groups(p, c)
    if g is None:  # replica groups by node/datacenter, on an unknown cluster
        return True
    if p.ep > 1 and g > 1 and ((p.dp // g) * p.cp) % p.ep:
        return True
    if int(getattr(p, "sync_overlap", 0)) and p.grad_sync != "diloco":
        return True
    return p.grad_compression != "none" and not (p.grad_compression == "fp8" and p.grad_sync == "diloco")


def _tt_recompute_layers(p: Plan, c: Ctx) -> bool:
    if p.recompute != "full" or c.num_layers is None:
        return False
    chunks = [n for n in stage_layer_counts(c.num_layers, p) if n > 0] or [0]
    k = recompute_layers_per_chunk(p, chunks)
    return k is not None and k > 0 and not (len(set(chunks)) == 1 and chunks[0] % k == 0)


def _ds_uneven(p: Plan, c: Ctx) -> bool:
    if p.pp == 1 or p.stage_layers is None or c.num_layers is None:
        return False
    return len(set(stage_layer_counts(c.num_layers, p))) > 1


LIMITS: tuple[Limit, ...] = (
    # Megatron-LM (export/megatron.py)
    Limit("megatron", "context parallel with unfused attention (Megatron's CP runs in Transformer Engine's "
          "flash/fused attention only)", (AX.CP, "flash_attention"), lambda p, c: p.cp > 1 and not p.flash_attention),
    Limit("megatron", "sharded pipeline sends without sequence parallel",
          (AX.PP, AX.TP, "p2p_sharded", "sequence_parallel"),
          lambda p, c: p.pp > 1 and p.tp > 1 and p.p2p_sharded and not p.sequence_parallel),
    Limit("megatron", "placement", PLACEMENT, _megatron_placement),
    Limit("megatron", "schedule (1F1B or interleaved 1F1B only)", (AX.PP, "schedule"),
          lambda p, c: p.pp > 1 and p.schedule in ("zbv", "zero-bubble", "gpipe")),
    Limit("megatron", "fp16 with expert parallel", ("precision", AX.EP), lambda p, c: p.precision == "fp16" and p.ep > 1),
    Limit("megatron", "parameter offload", ("offload_params",), lambda p, c: p.offload_params),
    Limit("megatron", "all-reduce with sharding", ("grad_sync", "zero"),
          lambda p, c: p.grad_sync == "all-reduce" and p.zero >= 1),
    Limit("megatron", "periodic sync", ("grad_sync",), lambda p, c: p.periodic),
    Limit("megatron", "gradient compression", ("grad_sync", "grad_compression", "precision"),
          lambda p, c: _compression_not_exported(p, c, p.precision in ("bf16", "fp8"))),
    Limit("megatron", "op-level recompute", ("recompute",), lambda p, c: p.recompute == "op"),
    Limit("megatron", "async TP without sequence parallel", ("async_tp", AX.TP, "sequence_parallel"),
          lambda p, c: p.async_tp and p.tp > 1 and not p.sequence_parallel),
    # torchtitan 0.2.x (export/torchtitan.py)
    Limit("torchtitan", "periodic sync", (AX.DP, AX.TP, AX.CP, AX.EP, *PERIODIC), _tt_periodic),
    Limit("torchtitan", "data-parallel sharding", (AX.DP, AX.CP, AX.TP, AX.PP, "zero", "shard_group", *PERIODIC),
          lambda p, c: _tt_split(p, c)[2]),
    Limit("torchtitan", "placement", PLACEMENT, _default_placement),
    Limit("torchtitan", "tensor parallel without sequence parallel", (AX.TP, "sequence_parallel"),
          lambda p, c: p.tp > 1 and not p.sequence_parallel),
    Limit("torchtitan", "async TP without compile", (AX.TP, "async_tp", "compile"),
          lambda p, c: p.tp > 1 and p.async_tp and not p.compile),
    Limit("torchtitan", "unsharded pipeline sends", (AX.PP, AX.TP, "p2p_sharded"),
          lambda p, c: p.pp > 1 and p.tp > 1 and not p.p2p_sharded),
    Limit("torchtitan", "zero-bubble with one stage per rank", (AX.PP, "schedule", "virtual_stages"),
          lambda p, c: p.pp > 1 and p.schedule == "zero-bubble" and p.virtual_stages == 1),
    Limit("torchtitan", "fp16", ("precision",), lambda p, c: p.precision == "fp16"),
    Limit("torchtitan", "mixed precision without FSDP", (AX.DP, AX.CP, AX.TP, AX.PP, "zero", "shard_group", "precision",
                                                           *PERIODIC),
          lambda p, c: not _tt_fsdp(p, c) and p.precision != "fp32" and (p.tp > 1 or p.pp > 1)),
    Limit("torchtitan", "optimizer offload alone", ("offload_optimizer", "offload_params"),
          lambda p, c: p.offload_optimizer and not p.offload_params),
    Limit("torchtitan", "all-reduce under FSDP", (AX.DP, AX.CP, AX.TP, AX.PP, "zero", "shard_group", *PERIODIC),
          lambda p, c: p.grad_sync == "all-reduce" and _tt_fsdp(p, c)),
    Limit("torchtitan", "gradient compression", ("grad_sync", "grad_compression"),
          lambda p, c: (not p.periodic and p.grad_compression in ("bf16", "fp8")) or p.grad_compression == "powersgd"),
    Limit("torchtitan", "selective recompute (Megatron's)", ("recompute",), lambda p, c: p.recompute == "selective"),
    Limit("torchtitan", "recompute of the first k blocks", ("recompute", "recompute_layers", AX.PP, "virtual_stages",
                                                            "stage_layers"), _tt_recompute_layers),
    Limit("torchtitan", "fused loss", ("fused_loss",), lambda p, c: p.fused_loss),
    Limit("torchtitan", "unfused attention", ("flash_attention",), lambda p, c: not p.flash_attention),
    # DeepSpeed (export/deepspeed.py)
    Limit("deepspeed", "placement", PLACEMENT, _default_placement),
    Limit("deepspeed", "fp8", ("precision",), lambda p, c: p.precision == "fp8"),
    Limit("deepspeed", "optimizer offload without ZeRO", ("offload_optimizer", "zero"),
          lambda p, c: p.offload_optimizer and p.zero == 0),
    Limit("deepspeed", "hybrid sharding", ("zero", "shard_group", AX.DP, AX.CP),
          lambda p, c: p.zero >= 1 and 0 < p.shard_group < p.dp * p.cp),
    Limit("deepspeed", "periodic sync", ("grad_sync",), lambda p, c: p.periodic),
    Limit("deepspeed", "gradient compression", ("grad_sync", "grad_compression", "precision"),
          lambda p, c: _compression_not_exported(p, c, True)),
    Limit("deepspeed", "sequence parallel (AutoTP)", (AX.TP, "sequence_parallel"),
          lambda p, c: p.tp > 1 and p.sequence_parallel),
    Limit("deepspeed", "context parallel (ring attention; DeepSpeed's is Ulysses)", (AX.CP,), lambda p, c: p.cp > 1),
    Limit("deepspeed", "ZeRO-2/3 under a pipeline", (AX.PP, "zero"), lambda p, c: p.pp > 1 and p.zero >= 2),
    Limit("deepspeed", "pipeline schedule (1F1B only)", (AX.PP, "schedule", "virtual_stages"),
          lambda p, c: p.pp > 1 and (p.virtual_stages > 1 or not (
              p.schedule == "1f1b" or (p.schedule == "interleaved-1f1b" and p.virtual_stages == 1)))),
    Limit("deepspeed", "uneven pipeline stages", (AX.PP, "stage_layers", "virtual_stages"), _ds_uneven),
    Limit("deepspeed", "recompute of the first k blocks under a pipeline", (AX.PP, "recompute", "recompute_layers"),
          lambda p, c: p.pp > 1 and p.recompute == "full" and p.recompute_layers is not None
          and p.recompute_layers > 0),
    Limit("deepspeed", "selective recompute", ("recompute",), lambda p, c: p.recompute in ("selective", "op")),
    Limit("deepspeed", "compile", ("compile",), lambda p, c: p.compile),
    Limit("deepspeed", "unfused attention", ("flash_attention",), lambda p, c: not p.flash_attention),
    Limit("deepspeed", "fused loss", ("fused_loss",), lambda p, c: p.fused_loss),
)


def limits(target: str, plan: Plan, ctx: Ctx = Ctx()) -> list[str]:
    """The names of ``target``'s limits ``plan`` hits ([]: the target runs these settings as planned)."""
    return [lim.name for lim in LIMITS if lim.target == target and lim.fails(plan, ctx)]


def masks(cols: Any, ctx: Ctx, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """{target: mask of the rows (of search.columns.PlanColumns ``cols``) that hit any of its
    limits}; each limit is evaluated once per distinct value of its fields (on a real row's plan).
    ``rows``: only these rows are evaluated (the others read False)."""
    n = cols.num_rows
    idx = np.arange(n) if rows is None else np.asarray(rows, dtype=np.int64)
    out = {t: np.zeros(n, dtype=bool) for t in dict.fromkeys(lim.target for lim in LIMITS)}
    if len(idx) == 0:
        return out
    for lim in LIMITS:
        keys = []
        for f in lim.fields:
            col = np.asarray(cols[f])[idx]
            if col.dtype.kind in "USO":
                col = np.unique(col, return_inverse=True)[1].reshape(-1)
            keys.append(col.astype(np.int64))
        _, first, inv = np.unique(np.stack(keys, axis=1), axis=0, return_index=True, return_inverse=True)
        fails = np.asarray([lim.fails(cols.plan(int(idx[j])), ctx) for j in first], dtype=bool)
        out[lim.target][idx] |= fails[inv.reshape(-1)]
    return out
