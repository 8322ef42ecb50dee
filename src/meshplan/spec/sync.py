"""Periodic data-parallel synchronisation (local SGD, DiLoCo): which ranks form an inner group.

A plan with grad_sync=local-sgd or diloco splits its data-parallel ranks into inner groups that
sync every step as usual (all-reduce, or ZeRO/FSDP sharding within the group) and an outer
synchronisation across the groups every ``sync_every`` steps. ``sync_scope`` names the tier
that the outer synchronisation crosses:

  all   every data-parallel rank is its own inner group (classic local SGD / DiLoCo workers);
  node  the data-parallel ranks on one node form an inner group;
  dc    the data-parallel ranks in one datacenter form an inner group.

Mesh order is pp, dp, cp, tp (outermost first): data-parallel ranks are tp*cp ranks apart, so a
scope unit of U GPUs holds U / (tp*cp) of them (at least one). Scalars or numpy arrays (one row
per plan): the cost model, the search and the constraints share these functions.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.plan import PERIODIC_SYNC

Num = Any


def scope_gpus(scope: Num, cluster: ClusterSpec) -> Num:
    """GPUs in one unit of ``scope``: 0 for all (each rank its own group), a node's, or a
    datacenter's (the whole cluster when it has one datacenter)."""
    scope = np.asarray(scope)
    return np.where(scope == "node", cluster.gpus_per_node, np.where(scope == "dc", cluster.gpus_per_dc, 0))


def inner_dp(dp: Num, tp: Num, cp: Num, scope: Num, cluster: ClusterSpec, periodic: Num = True) -> Num:
    """Data-parallel ranks in one inner group: ``dp`` for synchronous plans; for periodic ones
    the data-parallel ranks that one scope unit holds (at least 1, at most dp)."""
    dp = np.asarray(dp, dtype=np.int64)
    width = np.asarray(tp, dtype=np.int64) * np.asarray(cp, dtype=np.int64)
    unit = np.asarray(scope_gpus(scope, cluster), dtype=np.int64)
    n = np.clip(unit // np.maximum(width, 1), 1, np.maximum(dp, 1))
    return np.where(np.asarray(periodic, dtype=bool), n, dp)


def is_periodic(grad_sync: Num) -> Num:
    """Rows whose grad_sync is local-sgd or diloco."""
    return np.isin(np.asarray(grad_sync), PERIODIC_SYNC)


def periodic_reason(plan: Any, cluster: ClusterSpec) -> str | None:
    """Why a local-sgd/diloco plan is not well formed on ``cluster`` (None: it is, or it is
    not periodic)."""
    p = plan
    if p.grad_compression == "powersgd" and (p.zero != 0 or p.periodic or p.grad_sync == "reduce-scatter"):
        what = (f"grad_sync={p.grad_sync}" if p.periodic or p.grad_sync == "reduce-scatter" else f"zero={p.zero}")
        return (f"grad_compression=powersgd with {what}: PowerSGD compresses each step's all-reduced gradient "
                "matrices (DDP's communication hook), which sharded gradients and periodic syncs do not have; "
                "use zero=0 with all-reduce, or grad_compression=bf16/fp8")
    if not p.periodic:
        return None
    if p.dp < 2:
        return f"grad_sync={p.grad_sync} needs dp >= 2 (workers to average); got dp={p.dp}"
    if p.shard_group:
        return (f"shard_group with grad_sync={p.grad_sync}: ZeRO/FSDP shards within each inner group "
                f"(sync_scope={p.sync_scope}); drop shard_group")
    if p.sync_scope == "dc" and cluster.num_dcs < 2:
        return ("sync_scope=dc but the cluster has one datacenter; use sync_scope=node or all, or a cluster "
                "with inter_dc")
    if p.sync_overlap >= p.sync_every:
        return (f"sync_overlap={p.sync_overlap} must be less than sync_every={p.sync_every} (the outer sync is "
                "applied before the next one starts)")
    n_in = int(inner_dp(p.dp, p.tp, p.cp, p.sync_scope, cluster))
    if p.dp % n_in:
        return (f"sync_scope={p.sync_scope}: {n_in} data-parallel ranks per {p.sync_scope} do not divide dp={p.dp}")
    if p.dp // n_in < 2:
        narrower = "node or all" if p.sync_scope == "dc" else "all"
        return (f"sync_scope={p.sync_scope}: all {p.dp} data-parallel ranks lie in one {p.sync_scope}, so there is "
                f"nothing to sync across it; use sync_scope={narrower}")
    return None
