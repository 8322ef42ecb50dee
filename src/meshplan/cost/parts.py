"""Pieces of the step assembly shared by cost.batch (step time and memory of many plans) and
cost.durations (the same terms kept apart for the simulator): ZeRO sharding, data-parallel
gradient sync, FSDP's root unit, tied-weight sync, parameter offload, optimizer step, the
placement of the output layer and the pipeline sends. numpy arrays, one row per plan (and a
second axis per pipeline rank where stated).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshplan.cost.comm import (Group, dpcp_group, exposed_under, mesh_keys, mesh_placement, pair_link,
                                pipeline_links)
from meshplan.cost.memory import ADAMW, MAIN_GRAD_BYTES, OptimizerCost
from meshplan.cost.params import CostParams, flat_collectives
from meshplan.spec.axes import AX, AXES
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.plan import COLON_LISTS, PLAN_FIELDS, Plan


def plans_to_columns(plans: Sequence[Plan]) -> dict[str, np.ndarray]:
    """Plans -> one array per Plan field (str fields as str arrays, None as -1 / object)."""
    cols: dict[str, Any] = {}
    for name in PLAN_FIELDS:
        vals = [getattr(p, name) for p in plans]
        if name == "stage_layers":
            arr = np.empty(len(vals), dtype=object)
            arr[:] = vals
            cols[name] = arr
        elif name == "recompute_layers":
            cols[name] = np.array([-1 if v is None else v for v in vals], dtype=np.int64)
        elif name in COLON_LISTS:  # dp_shares, pools, ...: their plan-string form, '' = None
            cols[name] = np.array(["" if v is None else ":".join(str(x) for x in v) for v in vals])
        else:
            cols[name] = np.array(vals)
    return cols


def boundary_sends(cluster: ClusterSpec, cols: Mapping[str, Any], send_bytes: np.ndarray, width: int,
                   meshes: tuple[list[tuple[Any, ...]], np.ndarray] | None = None) -> np.ndarray:
    """(rows, width) seconds of one send across each pipeline boundary (cost.comm.pipeline_links:
    boundary j between stage j and j + 1; the last, pp - 1 -> 0, only under an interleaved
    schedule), each on the link it crosses under the row's placement; 0 beyond pp."""
    pp = np.asarray(cols[AX.PP]).astype(int)
    wrap = (np.asarray(cols["virtual_stages"]) > 1) & (np.asarray(cols["schedule"]) != "zbv")
    bw, lat = np.full((len(pp), width), np.inf), np.zeros((len(pp), width))
    keys, inv = mesh_keys(cols, wrap) if meshes is None else meshes
    for k, (sz, order, wr) in enumerate(keys):
        if sz[0] < 2:  # AXES[0] is pp: no pipeline, no sends
            continue
        rows = inv == k
        o, sites = mesh_placement(order)
        b, l = pipeline_links(cluster, dict(zip(AXES, sz)), o, bool(wr), sites)
        bw[rows, :len(b)], lat[rows, :len(b)] = b, l
    size = np.asarray(send_bytes, dtype=float)[:, None]
    return np.where((size <= 0) | ~np.isfinite(bw), 0.0, size / bw + lat)


def rank_sends(sends: np.ndarray, pp: np.ndarray, v: np.ndarray, zbv: np.ndarray, j: np.ndarray) -> np.ndarray:
    """(rows, stages) seconds of pipeline sends per micro-batch on each rank from the per-boundary
    sends (boundary_sends): rank j sends each chunk's activations across boundary j (v times, one
    less on rank pp - 1, whose last chunk ends the model) and its gradients across boundary j - 1
    (mod pp; v times, one less on rank 0); under ZBV two each way across boundaries j and j - 1
    within the V (none at its turns)."""
    pp_, v_ = np.asarray(pp)[:, None], np.asarray(v, dtype=float)[:, None]
    prev = np.roll(sends, 1, axis=1)
    prev[:, 0] = sends[np.arange(len(sends)), np.maximum(np.asarray(pp).astype(int) - 1, 0)]
    plain = (v_ - (j == pp_ - 1)) * sends + (v_ - (j == 0)) * prev
    vee = 2.0 * (np.where(j < pp_ - 1, sends, 0.0) + np.where(j > 0, prev, 0.0))
    return np.where(np.asarray(zbv)[:, None], vee, plain)


def shard_degree(cols: Mapping[str, np.ndarray], cluster: ClusterSpec | None = None) -> np.ndarray:
    """Ranks ZeRO/FSDP state is sharded over (Plan.effective_shard, per row). Given the
    cluster, a local-sgd/diloco row shards within its inner group (spec.sync.inner_dp x cp);
    without it, over all of dp x cp (fewer bytes per GPU: a lower bound for those rows)."""
    dp, cp = cols[AX.DP].astype(float), cols[AX.CP].astype(float)
    sg = cols["shard_group"]
    full = dp * cp
    if cluster is not None and "grad_sync" in cols:
        from meshplan.spec.sync import inner_dp, is_periodic
        periodic = is_periodic(cols["grad_sync"])
        if periodic.any():
            n_in = inner_dp(cols[AX.DP], cols[AX.TP], cols[AX.CP], np.asarray(cols["sync_scope"]), cluster, periodic)
            full = np.where(periodic, n_in * cp, full)
    return np.where(cols["zero"] == 0, 1.0, np.where((sg > 0) & (sg < full), sg, full))


def output_stage(pp: np.ndarray, zbv: np.ndarray, j: np.ndarray) -> np.ndarray:
    """(rows, stages) mask of the pipeline rank holding the final norm, output layer and loss:
    the last rank, or rank 0 under ZBV (its V puts the last virtual stage there, as
    torch.distributed.pipelining and spec.stages.stage_ids_for_rank do)."""
    pp, zbv = np.asarray(pp)[:, None], np.asarray(zbv)[:, None]
    return np.where(zbv & (pp > 1), j == 0, j == (pp - 1))


def stage_sends(two_v: np.ndarray, pp: np.ndarray, zbv: np.ndarray, j: np.ndarray, one: np.ndarray) -> np.ndarray:
    """(rows, stages) seconds of pipeline sends per micro-batch: ``two_v`` (2 v sends: each chunk's
    activations forward and gradients backward) on every stage, less one (``one``) on ranks 0
    and pp - 1, whose first and last virtual stage have no neighbour outside (rank 0 sends no
    gradient from its first chunk, rank pp - 1 no activation from its last); under ZBV ranks 0
    and pp - 1 send 2 (the V also turns on rank pp - 1, without a send)."""
    pp_, one_ = np.asarray(pp)[:, None], np.asarray(one)[:, None]
    ends = (j == 0) | (j == pp_ - 1)
    zbv_ends = np.asarray(zbv)[:, None] & ends
    return np.where(zbv_ends, 2 * one_, np.asarray(two_v)[:, None] - np.where(ends, one_, 0.0) + 0 * j)


def offload_seconds(cols: Mapping[str, np.ndarray], plocal: np.ndarray, shard: np.ndarray,
                    p: CostParams) -> np.ndarray:
    """Parameter offload (FSDP CPU offload): each micro-batch copies the fp32 shard host->device
    for the forward and again for the backward, over PCIe, not overlapped."""
    offloaded = np.asarray(cols["offload_params"], dtype=bool)[:, None]
    return np.where(offloaded, 8.0 * plocal / shard[:, None] / (p.pcie_gbps * 1e9), 0.0)


def optimizer_seconds(cluster: ClusterSpec, plocal: np.ndarray, zero: np.ndarray, shard: np.ndarray,
                      offload_optimizer: np.ndarray, params: CostParams, opt: OptimizerCost) -> np.ndarray:
    """(rows, pp) seconds of each rank's optimizer step (on the host with optimizer offload) for
    the workload's optimizer ``opt``: memory-bound, its bytes per parameter (cost.memory.
    OPTIMIZER_STEP_BYTES, AdamW's being CostParams.optimizer_bytes_per_param) over the HBM; on the
    host the vectorised CPU Adam's rate scaled by its bytes relative to AdamW's."""
    p = params
    n_opt = plocal / np.where(zero >= 1, shard, 1.0)[:, None]
    per_s = p.host_adam_params_per_s if opt.step_ratio == 1.0 else p.host_adam_params_per_s / opt.step_ratio
    host = n_opt / per_s + n_opt * 6 / (p.pcie_gbps * 1e9)
    step_bytes = p.optimizer_bytes_per_param + (opt.step_bytes - ADAMW.step_bytes)
    hbm = n_opt * step_bytes / (cluster.gpu.hbm_bandwidth_gbps * 1e9 * p.hbm_efficiency)
    return np.where(offload_optimizer[:, None], host, hbm)


def tied_sync(cluster: ClusterSpec, tied_local: Any, cp: Any, dp: Any, shard: Any, tp: Any,
              p: CostParams, cols: Mapping[str, Any] | None = None,
              meshes: tuple[list[tuple[Any, ...]], np.ndarray] | None = None) -> Any:
    """Seconds of the all-reduce that sums a tied weight's gradient between the first and the
    last pipeline rank (``tied_local`` elements on one GPU after TP; fp32 gradients; under
    ZeRO/FSDP only the local shard, as the runtime sums them after the data-parallel reduction),
    on the link between those two stages' peers (cost.comm.pair_link; given the plan table
    ``cols``, under each row's placement)."""
    size = p.fsdp_reduce_bytes * tied_local / shard
    old = Group.of(cluster, 2, tp * cp * dp).all_reduce(size)
    if cols is None or (np.asarray(cols[AX.PP]) < 2).all() or not np.any(size):
        return old
    pp = np.asarray(cols[AX.PP]).astype(int)
    bw, lat = np.full(pp.shape, np.inf), np.zeros(pp.shape)
    keys, inv = mesh_keys(cols) if meshes is None else meshes
    for k, (sz, order, _) in enumerate(keys):
        if sz[0] > 1:  # AXES[0] is pp
            bw[inv == k], lat[inv == k] = pair_link(cluster, dict(zip(AXES, sz)), *mesh_placement(order))
    pair = Group(np.full(pp.shape, 2.0), bw, lat, np.ones(pp.shape, dtype=bool)).all_reduce(
        np.broadcast_to(np.asarray(size, dtype=float), pp.shape))
    return np.where(pp > 1, pair, old)


def root_fsdp(cluster: ClusterSpec, p: CostParams, root: np.ndarray, shard: np.ndarray, tp: np.ndarray,
              hide: np.ndarray, micro: Any, fsdp: np.ndarray, per_step: np.ndarray,
              reduce_bytes: Any = None, st: Mapping[str, Any] | None = None,
              cp: Any = 1) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, overlapped) seconds per step of FSDP's root unit (``root`` parameters on the GPU
    before sharding: the layers that are not blocks: embedding, final norm, output layer):
    gathered and reduce-scattered per micro-batch without a pipeline (FSDP2 reshards it after
    each backward), once per step under one, under ``hide`` seconds of compute, which it slows
    like any collective (exposed_under)."""
    root = np.maximum(0.0, root)
    fl = flat_collectives(p)
    g = Group.of(cluster, shard, tp, flat=fl) if st is None else dpcp_group(cluster, st, cp, shard, flat=fl)
    rb = p.fsdp_reduce_bytes if reduce_bytes is None else reduce_bytes  # (per row: the plan's compression)
    t = g.all_gather(2.0 * root) + g.reduce_scatter(rb * root)
    times = np.where(per_step, 1.0, np.asarray(micro, dtype=float))
    x = exposed_under(t, hide, p.overlap_slowdown)
    return np.where(fsdp, times * x, 0.0), np.where(fsdp, times * (t - np.minimum(t, x)), 0.0)


def dp_end_of_step(cluster: ClusterSpec, cols: Mapping[str, np.ndarray], p: CostParams,
                   tp: np.ndarray, dp: np.ndarray, cp: np.ndarray, shard: np.ndarray,
                   lp: np.ndarray, params_local: np.ndarray,
                   last_bwd: np.ndarray, micro: Any = 1, psgd: np.ndarray | None = None,
                   psgd_compute: Any = 0.0, st: Mapping[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, overlapped) seconds of gradient sync / parameter gather ending a step.

    ZeRO-0/1 accumulate unsharded gradients over the ``micro`` micro-batches and reduce them
    once, under the last backward. ZeRO-2 keeps gradients sharded, which it can only do by
    reduce-scattering every micro-batch's gradients under that micro-batch's backward
    (DeepSpeed ZeRO-2; FSDP2 with gradient sync on): ``micro`` times the sync. (Under a
    pipeline nothing keeps gradients sharded: spec.constraints refuses zero=2 with pp > 1.)
    ``lp``: parameters of the first FSDP unit (its gather starts the step under ZeRO-3).
    ``dp``: the data-parallel ranks that sync every step (a local-sgd/diloco row's inner group).
    grad_compression shrinks the gradient collective (cost.sync.compressed_sync_bytes; ``psgd``:
    PowerSGD's bytes, whose two extra all-reduces add their latency and whose compression,
    ``psgd_compute`` seconds, runs after the backward)."""
    zero, pp = cols["zero"], cols[AX.PP]
    n_dp = dp * cp
    # ZeRO-3/FSDP: the first block's gather once, plus HSDP's all-reduce across replicas.
    fl = flat_collectives(p)

    def group(n: Any, skip: Any = 1) -> Group:  # n ranks skip apart along dp x cp, under the placement
        return Group.of(cluster, n, tp * skip, flat=fl) if st is None else dpcp_group(cluster, st, cp, n, skip, fl)

    z3 = group(shard).all_gather(2.0 * lp)
    rep = group(np.maximum(1, n_dp // shard), shard)
    rb = p.fsdp_reduce_bytes
    if "grad_compression" in cols:  # FSDP2 reduces in the compressed dtype (cost.sync.reduce_bytes)
        from meshplan.cost.sync import reduce_bytes
        rb = reduce_bytes(cols, p)
    z3 = z3 + np.where(shard < n_dp, rep.all_reduce(rb * params_local / shard), 0)
    # DDP / ZeRO-1/2: gradients are reduced in fp32: Megatron accumulates and all-reduces fp32
    # main grads with bf16 (accumulate_allreduce_grads_in_fp32) and with its distributed
    # optimizer; torch DDP under autocast (meshplan's runtime) holds fp32 parameters, so fp32
    # gradients. Megatron's DDP with --fp16 reduces fp16 main grads (2 bytes).
    g = group(n_dp)
    fp16_ddp = (zero == 0) & (np.asarray(cols.get("precision", "bf16")) == "fp16")
    grads = np.where(fp16_ddp, 2.0, 4.0) * params_local
    if p.main_grads == "bf16":  # the profile's 16-bit gradient buffers are what is reduced
        grads = np.where(zero == 3, grads, MAIN_GRAD_BYTES["bf16"] * params_local)
    gs = cols["grad_sync"]
    allreduce = (gs == "all-reduce") | ((gs != "reduce-scatter") & (zero == 0))
    comp = np.asarray(cols.get("grad_compression", "none"))
    if (comp != "none").any():
        from meshplan.cost.sync import compressed_sync_bytes
        periodic = (gs == "local-sgd") | (gs == "diloco")  # their compression is the outer sync's
        grads = np.where(periodic, grads, compressed_sync_bytes(grads, params_local, comp, psgd))
    sync = np.where(allreduce, g.all_reduce(grads), g.reduce_scatter(grads))
    powersgd = (comp == "powersgd") & allreduce
    sync = sync + np.where(powersgd, 2 * g.all_reduce(1.0) + psgd_compute, 0.0)
    last = np.minimum(grads, p.dp_bucket_mib * 2**20)  # the last bucket, by the same collective
    bucket = np.where(allreduce, g.all_reduce(last), g.reduce_scatter(last))
    # With a pipeline the sync starts after the stage's last backward: nothing to overlap; nor
    # without the profile's overlap (CostParams.dp_overlap).
    overlapped_sync = np.maximum(bucket, exposed_under(sync, last_bwd, p.overlap_slowdown))
    # Under an interleaved pipeline (megatron-core with overlap_grad_reduce) each model chunk's
    # gradients are reduced once its last backward is done, under the other chunks' backward:
    # only the last chunk's share, 1/v, is left after the stage's last backward.
    v = np.maximum(1.0, np.asarray(cols.get("virtual_stages", 1), dtype=float))
    piped = np.maximum(bucket, sync / v)
    exposed = np.where(not p.dp_overlap, sync, np.where(pp > 1, piped, overlapped_sync))
    syncs = np.where(zero == 2, np.asarray(micro, dtype=float), 1.0)  # ZeRO-2: one per micro-batch
    overlapped = syncs * (sync - np.minimum(sync, exposed))
    # ZeRO-1/2 gather the updated parameters after the optimizer; megatron-core's
    # overlap_param_gather (CostParams.param_gather_overlap) runs it bucket by bucket under the
    # next step's forwards instead (each bucket is gathered before its first use: the step's
    # forwards, last_bwd / 2 per micro-batch, hide all but the first).
    gather = np.where(zero >= 1, g.all_gather(2.0 * params_local), 0)
    fwd = last_bwd / 2 * np.asarray(micro, dtype=float)
    gather_x = exposed_under(gather, fwd, p.overlap_slowdown) if p.param_gather_overlap else gather
    overlapped = overlapped + (gather - gather_x)
    exposed = syncs * exposed + gather_x
    none = n_dp == 1
    return (np.where(none, 0, np.where(zero == 3, z3, exposed)),
            np.where(none | (zero == 3), 0, overlapped))
