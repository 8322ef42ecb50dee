"""The cost model over many plans at once: numpy arrays, one row per plan.

``estimate_batch`` is the single implementation of the step assembly: ``estimate`` (one
plan, a CostReport) calls it with one row, and the search calls it with 10^5 rows. Per-block
quantities (compute times, FLOPs, activation bytes) depend on a few plan fields only; they
are computed once per distinct combination with the scalar functions of compute.py and
memory.py, then broadcast. Pipeline stages are a second axis: arrays of shape (rows, stages).

Mesh axes, outermost to innermost: pp, dp, cp, tp. A TP group is `tp` consecutive ranks
(stride 1), CP has stride tp, DP/FSDP (merged with CP for sharding) stride tp, PP stride
tp*cp*dp.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.cost.comm import Group, exposed_under, staged_fsdp_exposed, staged_fsdp_overlapped
from meshplan.cost.compute import ACT_BYTES, block_times, embedding_times, output_layer_times
from meshplan.cost.memory import (
    FUSED_LOGITS_BYTES_PER_ELEM,
    LOGITS_BYTES_PER_ELEM,
    VOCAB_PARALLEL_LOGITS_BYTES_PER_ELEM,
    activation_bytes_per_token,
    fit_verdicts,
    kept_activation_bytes,
    model_state_arrays,
    op_sac_bytes_per_token,
    usable_gib,
)
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.schedule import RankPasses, bubble_array, in_flight_array, rank_passes
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload, microbatches
from meshplan.units import GiB

#: Plan fields that determine the per-block quantities.
BLOCK_KEY = ("tp", "cp", "micro_batch", "precision", "recompute", "sequence_parallel",
             "compile", "flash_attention", "ep", "fused_loss")
#: Exposed time terms (they sum to the step time) and overlapped ones, in report order.
TIME_KEYS = ("compute", "recompute", "tp_comm", "tp_comm_overlapped", "cp_comm", "ep_comm",
             "dp_comm", "dp_comm_overlapped", "pp_comm", "offload", "bubble", "optimizer", "overhead")
MEMORY_KEYS = ("weights", "grads", "optimizer", "activations", "transient", "overhead")


def plans_to_columns(plans: Sequence[Plan]) -> dict[str, np.ndarray]:
    """Plans -> one array per Plan field (str fields as str arrays, None as -1 / object)."""
    cols: dict[str, Any] = {}
    for f in dataclasses.fields(Plan):
        vals = [getattr(p, f.name) for p in plans]
        if f.name == "stage_layers":
            arr = np.empty(len(vals), dtype=object)
            arr[:] = vals
            cols[f.name] = arr
        elif f.name == "recompute_layers":
            cols[f.name] = np.array([-1 if v is None else v for v in vals], dtype=np.int64)
        else:
            cols[f.name] = np.array(vals)
    return cols


@dataclass(frozen=True)
class _Block:
    """Per-row arrays of the per-block quantities (one micro-batch, one GPU)."""

    f: np.ndarray       # forward seconds
    b: np.ndarray       # backward seconds (input + weight gradients)
    bw: np.ndarray      # weight-gradient seconds
    rc: np.ndarray      # recompute seconds
    flops: np.ndarray   # forward model FLOPs
    rc_flops: np.ndarray
    emb: np.ndarray     # embedding fwd+bwd seconds
    out: np.ndarray     # output layer + loss fwd+bwd seconds
    out_flops: np.ndarray
    full_bytes: np.ndarray  # activation bytes per token of one block, no recompute
    inp_bytes: np.ndarray   # bytes per token of the block input (what full recompute keeps)
    op_bytes: np.ndarray    # bytes per token kept by op-level SAC
    emb_f: np.ndarray       # the embedding's and the output layer's (+ loss) passes apart:
    emb_bi: np.ndarray      # forward, input gradients, weight gradients (the split-backward
    emb_w: np.ndarray       # schedules' bubble needs them)
    out_f: np.ndarray
    out_bi: np.ndarray
    out_w: np.ndarray


def _group_rows(cols: Mapping[str, np.ndarray], keys: Sequence[str]) -> tuple[list[dict], np.ndarray]:
    """Distinct combinations of ``keys`` (as dicts of Python values) and each row's index."""
    arrays = [np.asarray(cols[k]) for k in keys]
    if len(arrays[0]) <= 64:  # small batches: a dict is faster than sorting record arrays
        index: dict[tuple, int] = {}
        inv = np.array([index.setdefault(t, len(index)) for t in zip(*(a.tolist() for a in arrays))])
        return [dict(zip(keys, t)) for t in index], inv
    rec = np.rec.fromarrays(arrays, names=list(keys))  # type: ignore[call-overload]
    uniq, inv = np.unique(rec, return_inverse=True)
    return [{k: u[k].item() for k in keys} for u in uniq], inv.ravel()


def _blocks(model: ModelSpec, cluster: ClusterSpec, work: Workload, cols: Mapping[str, np.ndarray],
            p: CostParams) -> _Block:
    combos, inv = _group_rows(cols, BLOCK_KEY)
    vals = []
    gpu, s = cluster.gpu, work.seq_len
    for combo in combos:
        plan = Plan(**combo)
        blk = block_times(model, plan, s, gpu, p)
        emb, out = embedding_times(model, plan, s, gpu, p), output_layer_times(model, plan, s, gpu, p)
        full, inp = activation_bytes_per_token(model, plan, s)
        vals.append((blk.fwd_s, blk.bwd_s, blk.bwd_weight_s, blk.recompute_s, blk.fwd_flops,
                     blk.recompute_flops, emb.fwd_s + emb.bwd_s, out.fwd_s + out.bwd_s,
                     out.fwd_flops, full, inp, op_sac_bytes_per_token(model, plan),
                     emb.fwd_s, emb.bwd_input_s, emb.bwd_weight_s, out.fwd_s, out.bwd_input_s, out.bwd_weight_s))
    table = np.array(vals, dtype=float).reshape(len(combos), -1)[inv]
    return _Block(*(table[:, i] for i in range(table.shape[1])))


def _stage_layers(model: ModelSpec, cols: Mapping[str, np.ndarray]) -> np.ndarray:
    """(rows, max pp) blocks per stage; 0 beyond each row's pp."""
    pp = np.asarray(cols["pp"])
    n, width = len(pp), int(pp.max())
    j = np.arange(width)[None, :]
    base, extra = np.divmod(model.num_layers, pp)
    layers = np.where(j < pp[:, None], base[:, None] + (j < extra[:, None]), 0).astype(float)
    explicit = cols["stage_layers"]
    for i in range(n):
        if explicit[i] is not None:
            layers[i, :] = 0
            layers[i, :len(explicit[i])] = explicit[i]
    return layers


def _layer_params_local(model: ModelSpec, tp: np.ndarray, ep: np.ndarray) -> np.ndarray:
    """Parameters of one block held by one GPU before ZeRO sharding (TP and EP splits)."""
    if model.is_moe:
        experts = model.num_experts * model.mlp_params(model.expert_ffn)
        return (model.layer_params() - experts + experts / ep) / tp
    return model.layer_params() / tp + 0.0 * ep


@dataclass(frozen=True)
class _Comm:
    """Per-row communication seconds of one block for one micro-batch (see estimate_batch)."""

    tp_one: np.ndarray   # one TP all-reduce (= RS + AG with SP) of the block's activations
    cp: np.ndarray       # CP K/V gathers and gradient scatter of one block
    cp_exposed: np.ndarray  # of which not hidden under half of the block's compute
    ep: np.ndarray       # EP all-to-alls of one block (0 for dense models)
    lp: np.ndarray       # parameters of one block on one GPU before ZeRO sharding
    ag: np.ndarray       # FSDP all-gather of one block's bf16 parameters
    rs: np.ndarray       # FSDP reduce-scatter of one block's gradients
    fsdp: np.ndarray     # FSDP shards over more than one rank
    per_step: np.ndarray  # FSDP under a pipeline: gathered/reduced once per step
    fwd_exposed: np.ndarray  # per-micro-batch FSDP time not hidden by the forward
    bwd_exposed: np.ndarray  # ... nor by the backward (+ recompute)
    send: np.ndarray     # one pipeline send of a micro-batch's activations


def _comm(model: ModelSpec, cluster: ClusterSpec, cols: Mapping[str, np.ndarray], p: CostParams,
          blk: _Block, tokens: np.ndarray, shard: np.ndarray) -> _Comm:
    tp, dp, cp, ep = (cols[k].astype(float) for k in ("tp", "dp", "cp", "ep"))
    zero, pp = cols["zero"], cols["pp"]
    tp_one = Group.of(cluster, tp, 1).all_reduce(tokens * model.hidden_size * ACT_BYTES)
    kv = tokens * 2 * model.kv_dim / tp * ACT_BYTES
    cp_t = 3 * Group.of(cluster, cp, tp).all_gather(kv * cp)
    ep_t = 4 * Group.of(cluster, ep, tp).all_to_all(tokens * model.experts_per_token * model.hidden_size * ACT_BYTES)
    lp = _layer_params_local(model, tp, ep)
    shard_g = Group.of(cluster, shard, tp)
    ag, rs = shard_g.all_gather(2.0 * lp), shard_g.reduce_scatter(p.fsdp_reduce_bytes * lp)
    fsdp = (zero == 3) & (shard > 1)
    per_step = (zero == 3) & (pp > 1)
    blocked = fsdp & ~per_step
    act = tokens * model.hidden_size * ACT_BYTES / np.where(cols["p2p_sharded"], tp, 1)
    return _Comm(tp_one=tp_one, cp=cp_t, cp_exposed=np.maximum(0.0, cp_t - 0.5 * (blk.f + blk.b)),
                 ep=ep_t if model.is_moe else 0.0 * ep_t, lp=lp, ag=ag, rs=rs, fsdp=fsdp, per_step=per_step,
                 fwd_exposed=np.where(blocked, exposed_under(ag, blk.f, p.overlap_slowdown), 0),
                 bwd_exposed=np.where(blocked, exposed_under(ag + rs, blk.b + blk.rc, p.overlap_slowdown), 0),
                 send=Group.of(cluster, 2, tp * cp * dp).send_recv(act))


def _shard(cols: Mapping[str, np.ndarray]) -> np.ndarray:
    """Ranks ZeRO/FSDP state is sharded over (Plan.effective_shard, per row)."""
    dp, cp = cols["dp"].astype(float), cols["cp"].astype(float)
    sg = cols["shard_group"]
    return np.where(cols["zero"] == 0, 1.0, np.where((sg > 0) & (sg < dp * cp), sg, dp * cp))


def _stage_params(model: ModelSpec, layers: np.ndarray, valid: np.ndarray, first: np.ndarray,
                  last: np.ndarray, tp: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """(rows, stages) parameters per GPU before sharding: blocks, embedding on the first stage,
    final norm + output projection on the last (a tied copy included when pp > 1, also under
    ZBV, where rank 0 holds both ends as two model parts, as the runtime does)."""
    vh = model.vocab_size * model.hidden_size
    single = valid.sum(axis=1, keepdims=True) == 1  # pp = 1: one module, one shared matrix
    return np.where(valid, layers * lp[:, None] + first * (model.embedding_params() / tp)[:, None]
                    + last * ((model.norm_params() + vh) / tp)[:, None]
                    - (first & last & single) * (model.tied_embeddings * vh / tp)[:, None], 0)


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


def _stage_forward(cols: Mapping[str, np.ndarray], p: CostParams, blk: _Block, c: _Comm, layers: np.ndarray,
                   first: np.ndarray, last: np.ndarray, p2p: np.ndarray, offload: np.ndarray) -> np.ndarray:
    """(rows, stages) forward seconds per micro-batch of each rank as the simulator runs them
    (cost.durations): the blocks, the embedding / output layer, the exposed TP/CP/EP and FSDP
    communication of the forward, half the offload copies and half the sends."""
    def col(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=float)[:, None]

    async_f = col(np.where(cols["async_tp"], p.tp_exposed_async, 1.0))
    share_f = blk.f / np.maximum(1e-30, blk.f + blk.b)
    fwd_x = first * col(blk.emb_f) + last * col(blk.out_f)
    comm_f = layers * (col(2 * c.tp_one) * async_f + col(c.cp_exposed * share_f + c.ep / 2 + c.fwd_exposed)) \
        + offload / 2
    return layers * col(blk.f) + fwd_x + comm_f + p2p / 2


def _drain(cols: Mapping[str, np.ndarray], p: CostParams, blk: _Block, c: _Comm, layers: np.ndarray,
           valid: np.ndarray, first: np.ndarray, last: np.ndarray, totals: np.ndarray, p2p: np.ndarray,
           offload: np.ndarray, split: np.ndarray) -> np.ndarray:
    """(rows, stages) seconds between each rank's last backward and the end of the pipeline
    (rank 0's). The last backward passes drain from the last rank down to rank 0, one (chunk of
    a) rank's backward and one send each, so rank r ends sum_{j<r} (b_j + send) - send earlier
    (GPipe, 1F1B, interleaved 1F1B with b_j per chunk). A rank's end-of-step gradient sync and
    optimizer start there (the simulator runs the same). Split-backward schedules end with W
    passes that do not chain: 0 (the step's end is then every rank's)."""
    pp, v = np.asarray(cols["pp"]), np.asarray(cols["virtual_stages"]).astype(float)
    fwd = _stage_forward(cols, p, blk, c, layers, first, last, p2p, offload)
    per = np.where(valid, np.where(np.isfinite(totals), totals, 0.0) - fwd, 0.0) / v[:, None]
    before = np.cumsum(per, axis=1) - per  # sum over j < r
    send = np.where(pp > 1, c.send * p.pp_p2p_exposed, 0.0)[:, None]
    j = np.arange(per.shape[1])[None, :]
    out = np.maximum(0.0, before - np.where(j >= 1, send, 0.0))
    return np.where(split[:, None] | ~valid, 0.0, out)


def _rank_passes(cols: Mapping[str, np.ndarray], p: CostParams, blk: _Block, c: _Comm, layers: np.ndarray,
                 valid: np.ndarray, first: np.ndarray, last: np.ndarray, zbv: np.ndarray, totals: np.ndarray,
                 p2p: np.ndarray, offload: np.ndarray, j: np.ndarray) -> RankPasses:
    """Per-micro-batch forward / input-gradient / weight-gradient seconds of each rank, split
    as the simulator runs them (cost.durations): exposed TP/CP/EP and FSDP communication with
    the pass that carries it, half the sends with the forward. For ZBV also each rank's
    second chunk (virtual stage 2 pp - 1 - r): half its blocks and communication, the output
    layer on rank 0, and that chunk's own sends."""
    def col(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=float)[:, None]

    fwd_x, bin_x, w_x = (first * col(e) + last * col(o) for e, o in
                         ((blk.emb_f, blk.out_f), (blk.emb_bi, blk.out_bi), (blk.emb_w, blk.out_w)))
    fwd = _stage_forward(cols, p, blk, c, layers, first, last, p2p, offload)
    wgt = layers * col(blk.bw) + w_x
    bwd = np.where(valid, totals, 0.0) - fwd - wgt
    chunk1 = None
    if zbv.any():
        pp = col(cols["pp"])
        one = col(np.where(cols["pp"] > 1, c.send * p.pp_p2p_exposed, 0))
        out_f, out_b, out_w = (last * col(o) for o in (blk.out_f, blk.out_bi, blk.out_w))
        f1 = (fwd - fwd_x - p2p / 2) / 2 + out_f + one * (j > 0)
        b1 = (bwd - bin_x - p2p / 2) / 2 + out_b + one * (j < pp - 1)
        w1 = (wgt - w_x) / 2 + out_w
        chunk1 = (f1, b1, w1)
    return rank_passes(fwd, bwd, wgt, valid, chunk1)


def _offload(cols: Mapping[str, np.ndarray], plocal: np.ndarray, shard: np.ndarray, p: CostParams) -> np.ndarray:
    """Parameter offload (FSDP CPU offload): each micro-batch copies the fp32 shard host->device
    for the forward and again for the backward, over PCIe, not overlapped."""
    offloaded = np.asarray(cols["offload_params"], dtype=bool)[:, None]
    return np.where(offloaded, 8.0 * plocal / shard[:, None] / (p.pcie_gbps * 1e9), 0.0)


def estimate_batch(model: ModelSpec, cluster: ClusterSpec, work: Workload,
                   plans: Sequence[Plan] | Mapping[str, np.ndarray],
                   params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """Step time, throughput and memory of many plans. Plans must already satisfy
    meshplan.spec.constraints (estimate() checks; the search masks).

    Returns arrays: step_time_s, tokens_per_s, tflops_per_gpu, mfu, hfu, peak_memory_gib, fits,
    microbatches, time.<term> for every TIME_KEYS term, memory.<part> of the fullest stage,
    stage_memory_gib (rows, stages; NaN beyond pp).
    """
    cols = plans if isinstance(plans, Mapping) else plans_to_columns(plans)
    cols = {k: np.asarray(v) if k != "stage_layers" else v for k, v in cols.items()}
    pp = cols["pp"]
    degrees = np.unique(pp)
    if len(pp) <= 64 or len(degrees) == 1:
        return _estimate(model, cluster, work, cols, params)
    # Rows of one pipeline depth at a time: the stage axis is then no wider than needed.
    parts = [(np.nonzero(pp == d)[0], d) for d in degrees]
    outs = [_estimate(model, cluster, work, {k: v[idx] for k, v in cols.items()}, params)
            for idx, _ in parts]
    width = int(degrees.max())
    merged: dict[str, np.ndarray] = {}
    for key, first in outs[0].items():
        shape = (len(pp), width) if key == "stage_memory_gib" else (len(pp),)
        merged[key] = np.full(shape, np.nan) if key == "stage_memory_gib" else np.empty(shape, first.dtype)
    for (idx, d), out in zip(parts, outs):
        for key, val in out.items():
            if key == "stage_memory_gib":
                merged[key][idx, :int(d)] = val
            else:
                merged[key][idx] = val
    return merged


def _estimate(model: ModelSpec, cluster: ClusterSpec, work: Workload, cols: dict[str, Any],
              params: CostParams) -> dict[str, np.ndarray]:
    p, m_ = params, model
    tp, pp, dp, cp, ep = (cols[k].astype(float) for k in ("tp", "pp", "dp", "cp", "ep"))
    zero, mb, v = cols["zero"], cols["micro_batch"].astype(float), cols["virtual_stages"].astype(float)
    shard = _shard(cols)
    micro = microbatches(work.global_batch, cols["dp"], cols["micro_batch"])
    tokens = mb * work.seq_len / cp
    blk = _blocks(model, cluster, work, cols, p)
    layers = _stage_layers(model, cols)
    width = layers.shape[1]
    j = np.arange(width)[None, :]
    zbv = np.asarray(cols["schedule"]) == "zbv"
    valid, first, last = j < pp[:, None], j == 0, output_stage(pp, zbv, j)

    def col(x: Any) -> np.ndarray:  # per-row array -> (rows, 1) for stage broadcasting
        return np.asarray(x, dtype=float)[:, None]

    full_rc = cols["recompute"] == "full"
    rl = cols["recompute_layers"]
    rc_layers = np.where(full_rc[:, None] & (rl[:, None] >= 0), np.minimum(layers, rl[:, None]), layers)
    compute = layers * col(blk.f + blk.b) + first * col(blk.emb) + last * col(blk.out)
    recompute = rc_layers * col(blk.rc)

    c = _comm(m_, cluster, cols, p, blk, tokens, shard)
    tp_t = (layers - rc_layers) * col(4 * c.tp_one) + rc_layers * col(np.where(full_rc, 6, 4) * c.tp_one)
    tp_exp = tp_t * col(np.where(cols["async_tp"], p.tp_exposed_async, 1.0))
    cp_exp = layers * col(c.cp_exposed)
    ep_exp = layers * col(c.ep)
    lp, ag, rs, fsdp, per_step = c.lp, c.ag, c.rs, c.fsdp, c.per_step
    blk_exp = c.fwd_exposed + c.bwd_exposed
    blk_ovl = np.where(fsdp & ~per_step, 2 * ag + rs - blk_exp, 0)
    p2p = stage_sends(np.where(pp > 1, 2 * v * c.send * p.pp_p2p_exposed, 0), pp, zbv, j,
                      np.where(pp > 1, c.send * p.pp_p2p_exposed, 0))
    plocal = _stage_params(m_, layers, valid, first, last, tp, lp)
    offload = _offload(cols, plocal, shard, p)
    terms = {"compute": compute, "recompute": recompute, "tp_comm": tp_exp,
             "tp_comm_overlapped": tp_t - tp_exp, "cp_comm": cp_exp, "ep_comm": ep_exp,
             "dp_comm": layers * col(blk_exp), "dp_comm_overlapped": layers * col(blk_ovl),
             "pp_comm": p2p, "offload": offload}
    exposed = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm", "offload")
    totals = np.where(valid, sum(terms[k] for k in exposed), -np.inf)
    crit = np.argmax(totals, axis=1)
    rows = np.arange(len(crit))
    tmax, tsum = totals[rows, crit], np.where(valid, totals, 0).sum(axis=1)
    busy = micro * tmax
    w_frac = blk.bw / np.maximum(1e-30, blk.f + blk.b + blk.rc)
    sched = cols["schedule"]
    split = ((sched == "zero-bubble") | zbv) & (pp > 1)
    passes = _rank_passes(cols, p, blk, c, layers, valid, first, last, zbv, totals, p2p, offload, j) \
        if split.any() else None
    bubble = bubble_array(tsum, tmax, pp, v, sched, w_frac, micro, passes)

    # End of step, per rank: gradient sync / ZeRO gathers of the rank's own parameters (+ the tied
    # weights' all-reduce on the first and last ranks; zbv: both on rank 0), then the optimizer,
    # from the rank's last backward on (the drain ends the ranks one after another).
    c2 = {k: np.asarray(cols[k])[:, None] for k in ("zero", "pp", "grad_sync", "precision")}
    e_r, o_r = _dp_end_of_step(cluster, c2, p, tp[:, None], dp[:, None], cp[:, None], shard[:, None], lp[:, None],
                               plocal, (compute[:, 0] / 2)[:, None], micro[:, None])
    tied = tied_sync(cluster, m_, tp, cp, dp, shard, p)
    ends = first | (j == (pp[:, None] - 1))
    tie = ((pp > 1) & m_.tied_embeddings & ~zbv)[:, None]
    e_r = e_r + np.where(ends & tie, col(tied), 0)
    drain = _drain(cols, p, blk, c, layers, valid, first, last, totals, p2p, offload, split)
    fullest = np.argmax(np.where(valid, plocal, -1.0), axis=1)
    dp_exp, dp_ovl = np.zeros(len(rows)), o_r[rows, fullest]
    # FSDP under a pipeline gathers the stage's parameters once, during the first micro-batch's
    # forward, and reduce-scatters the gradients once, during the last one's backward: only that
    # one micro-batch's compute can hide each (torch.distributed.pipelining, torchtitan PP+FSDP).
    n_blk = layers[rows, crit]
    ag_s, rs_s = n_blk * ag, n_blk * rs
    # (split backward: the last weight gradients come with the last W, which hides it alone)
    hide_rs = np.where(split, n_blk * blk.bw / np.where(zbv, 2, 1), n_blk * (blk.b + blk.rc))
    exp_s = staged_fsdp_exposed(ag_s, n_blk * blk.f, rs_s, hide_rs, pp, split, p.overlap_slowdown)
    staged = fsdp & per_step
    dp_exp = dp_exp + np.where(staged, exp_s, 0)
    dp_ovl = dp_ovl + np.where(staged, staged_fsdp_overlapped(ag_s, n_blk * blk.f, rs_s, hide_rs), 0)
    # FSDP's root unit (embedding, final norm, output layer) is gathered and reduce-scattered too:
    # per micro-batch without a pipeline (FSDP2 reshards it after each backward), once per step
    # under one, under the blocks' compute (only a step's first gather is exposed, in
    # _dp_end_of_step), which it slows like any collective (exposed_under), so that the memory
    # ZeRO-3 saves on it carries its time.
    root_x, root_o = root_fsdp(cluster, p, plocal[rows, crit] - n_blk * lp, shard, tp, tmax, micro, fsdp, per_step)
    dp_exp, dp_ovl = dp_exp + root_x, dp_ovl + root_o
    opt_t = optimizer_seconds(cluster, plocal, zero, shard, np.asarray(cols["offload_optimizer"], dtype=bool), p)
    end = np.where(valid, e_r + opt_t - drain, -np.inf).max(axis=1)
    opt = np.minimum(np.where(valid, opt_t, 0).max(axis=1), end)  # >= 0: rank 0 has no drain
    dp_exp = dp_exp + end - opt
    step = busy + bubble + dp_exp + opt + p.step_overhead_s

    out: dict[str, np.ndarray] = {f"time.{k}": micro * t[rows, crit] for k, t in terms.items()}
    out["time.dp_comm"] = out["time.dp_comm"] + dp_exp
    out["time.dp_comm_overlapped"] = out["time.dp_comm_overlapped"] + dp_ovl
    out |= {"time.bubble": bubble, "time.optimizer": opt,
            "time.overhead": np.full(len(rows), p.step_overhead_s)}
    mem = _memory(model, work, cols, p, layers, valid, first, last, plocal, lp, shard, tokens, blk, micro)
    out |= _summary(model, cluster, work, cols, p, step, blk, mem, micro)
    return out


def optimizer_seconds(cluster: ClusterSpec, plocal: np.ndarray, zero: np.ndarray, shard: np.ndarray,
                      offload_optimizer: np.ndarray, params: CostParams = DEFAULT_PARAMS) -> np.ndarray:
    """(rows, pp) seconds of each rank's optimizer step (on the host with optimizer offload)."""
    p = params
    n_opt = plocal / np.where(zero >= 1, shard, 1.0)[:, None]
    host = n_opt / p.host_adam_params_per_s + n_opt * 6 / (p.pcie_gbps * 1e9)
    hbm = n_opt * p.optimizer_bytes_per_param / (cluster.gpu.hbm_bandwidth_gbps * 1e9 * p.hbm_efficiency)
    return np.where(offload_optimizer[:, None], host, hbm)


def tied_sync(cluster: ClusterSpec, model: ModelSpec, tp: Any, cp: Any, dp: Any, shard: Any,
              p: CostParams) -> Any:
    """Seconds of the all-reduce that sums a tied embedding's gradient between the first and
    the last pipeline rank (fp32 gradients; under ZeRO/FSDP only the local shard, as the runtime
    sums them after the data-parallel reduction)."""
    size = p.fsdp_reduce_bytes * model.vocab_size * model.hidden_size / tp / shard
    return Group.of(cluster, 2, tp * cp * dp).all_reduce(size)


def root_fsdp(cluster: ClusterSpec, p: CostParams, root: np.ndarray, shard: np.ndarray, tp: np.ndarray,
              hide: np.ndarray, micro: Any, fsdp: np.ndarray, per_step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, overlapped) seconds per step of FSDP's root unit (``root`` parameters on the GPU
    before sharding: embedding, final norm, output layer): gathered and reduce-scattered per
    micro-batch without a pipeline (FSDP2 reshards it after each backward), once per step under
    one, under ``hide`` seconds of compute, which it slows like any collective (exposed_under)."""
    root = np.maximum(0.0, root)
    g = Group.of(cluster, shard, tp)
    t = g.all_gather(2.0 * root) + g.reduce_scatter(p.fsdp_reduce_bytes * root)
    times = np.where(per_step, 1.0, np.asarray(micro, dtype=float))
    x = exposed_under(t, hide, p.overlap_slowdown)
    return np.where(fsdp, times * x, 0.0), np.where(fsdp, times * (t - np.minimum(t, x)), 0.0)


def _dp_end_of_step(cluster: ClusterSpec, cols: Mapping[str, np.ndarray], p: CostParams,
                    tp: np.ndarray, dp: np.ndarray, cp: np.ndarray, shard: np.ndarray,
                    lp: np.ndarray, params_local: np.ndarray,
                    last_bwd: np.ndarray, micro: Any = 1) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, overlapped) seconds of gradient sync / parameter gather ending a step.

    ZeRO-0/1 accumulate unsharded gradients over the ``micro`` micro-batches and reduce them
    once, under the last backward. ZeRO-2 keeps gradients sharded, which it can only do by
    reduce-scattering every micro-batch's gradients under that micro-batch's backward
    (DeepSpeed ZeRO-2; FSDP2 with gradient sync on): ``micro`` times the sync. (Under a
    pipeline nothing keeps gradients sharded: spec.constraints refuses zero=2 with pp > 1.)"""
    zero, pp = cols["zero"], cols["pp"]
    n_dp = dp * cp
    # ZeRO-3/FSDP: the first block's gather once, plus HSDP's all-reduce across replicas.
    z3 = Group.of(cluster, shard, tp).all_gather(2.0 * lp)
    rep = Group.of(cluster, np.maximum(1, n_dp // shard), tp * shard)
    z3 = z3 + np.where(shard < n_dp, rep.all_reduce(p.fsdp_reduce_bytes * params_local / shard), 0)
    # DDP / ZeRO-1/2: gradients are reduced in fp32: Megatron accumulates and all-reduces fp32
    # main grads with bf16 (accumulate_allreduce_grads_in_fp32) and with its distributed
    # optimizer; torch DDP under autocast (meshplan's runtime) holds fp32 parameters, so fp32
    # gradients. Megatron's DDP with --fp16 reduces fp16 main grads (2 bytes).
    g = Group.of(cluster, n_dp, tp)
    fp16_ddp = (zero == 0) & (np.asarray(cols.get("precision", "bf16")) == "fp16")
    grads = np.where(fp16_ddp, 2.0, 4.0) * params_local
    gs = cols["grad_sync"]
    allreduce = (gs == "all-reduce") | ((gs == "auto") & (zero == 0))
    sync = np.where(allreduce, g.all_reduce(grads), g.reduce_scatter(grads))
    last = np.minimum(grads, p.dp_bucket_mib * 2**20)  # the last bucket, by the same collective
    bucket = np.where(allreduce, g.all_reduce(last), g.reduce_scatter(last))
    # With a pipeline the sync starts after the stage's last backward: nothing to overlap.
    exposed = np.where(pp > 1, sync, np.maximum(bucket, exposed_under(sync, last_bwd, p.overlap_slowdown)))
    syncs = np.where(zero == 2, np.asarray(micro, dtype=float), 1.0)  # ZeRO-2: one per micro-batch
    overlapped = syncs * (sync - np.minimum(sync, exposed))
    exposed = syncs * exposed + np.where(zero >= 1, g.all_gather(2.0 * params_local), 0)
    none = n_dp == 1
    return (np.where(none, 0, np.where(zero == 3, z3, exposed)),
            np.where(none | (zero == 3), 0, overlapped))


def _memory(model: ModelSpec, work: Workload, cols: Mapping[str, np.ndarray], p: CostParams,
            layers: np.ndarray, valid: np.ndarray, first: np.ndarray, last: np.ndarray,
            plocal: np.ndarray, lp: np.ndarray, shard: np.ndarray, tokens: np.ndarray,
            blk: _Block, micro: np.ndarray) -> dict[str, np.ndarray]:
    """(rows, stages) bytes per part; see memory.py for the per-parameter byte counts."""
    def col(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=float)[:, None]

    def flag(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=bool)[:, None]

    zero, pp = col(cols["zero"]), col(cols["pp"])
    w, g, o, buffers = model_state_arrays(plocal, col(lp), zero, col(shard), flag(cols["offload_params"]),
                                          flag(cols["offload_optimizer"]), col(cols["dp"] * cols["cp"]), p)
    per_step = (zero == 3) & (pp > 1)  # pipelined FSDP keeps unsharded bf16 params + fp32 grads
    w, g = w + per_step * 2 * plocal, g + per_step * 4 * plocal

    t = col(tokens)
    kept, transient = kept_activation_bytes(t, layers, cols["recompute"][:, None], col(cols["recompute_layers"]),
                                            col(blk.full_bytes), col(blk.inp_bytes), col(blk.op_bytes))
    width = layers.shape[1]
    inflight = in_flight_array(col(cols["pp"]), col(cols["virtual_stages"]), cols["schedule"][:, None],
                               np.arange(width)[None, :], micro[:, None])
    acts = (kept + first * t * model.hidden_size * ACT_BYTES) * inflight
    unfused = np.where(col(cols["tp"]) > 1, VOCAB_PARALLEL_LOGITS_BYTES_PER_ELEM, LOGITS_BYTES_PER_ELEM)
    per = np.where(flag(cols["fused_loss"]), FUSED_LOGITS_BYTES_PER_ELEM, unfused)
    logits = t * model.vocab_size / col(cols["tp"]) * per
    transient = np.where(last, np.maximum(transient, logits), transient) + buffers
    transient = transient + p.allocator_fragmentation * (acts + transient)
    parts = {"weights": w, "grads": g, "optimizer": o, "activations": acts, "transient": transient,
             "overhead": np.broadcast_to(p.framework_overhead_gib * GiB, layers.shape)}
    # Host memory the offload takes per GPU: the optimizer states it moves (Adam's fp32 m, v, and
    # the master copy but with ZeRO-3), and with parameter offload FSDP's fp32 parameter and
    # gradient shards (FSDP2's CPUOffloadPolicy keeps both on the host).
    offo, offp = flag(cols["offload_optimizer"]), flag(cols["offload_params"])
    opt_host = np.where(zero == 3, 8.0, 12.0) * plocal / np.where(zero >= 1, col(shard), 1.0)
    parts["host"] = np.where(offo, opt_host, 0.0) + np.where(offp & (zero == 3), 8.0 * plocal / col(shard), 0.0)
    return {k: np.where(valid, v, np.nan) for k, v in parts.items()}


def _summary(model: ModelSpec, cluster: ClusterSpec, work: Workload, cols: Mapping[str, np.ndarray],
             p: CostParams, step: np.ndarray, blk: _Block, mem: dict[str, np.ndarray],
             micro: np.ndarray) -> dict[str, np.ndarray]:
    gpu = cluster.gpu
    tp, cp, mb = (cols[k].astype(float) for k in ("tp", "cp", "micro_batch"))
    n = cols["tp"] * cols["pp"] * cols["dp"] * cols["cp"]
    scale = tp * cp / mb * work.global_batch
    model_flops = 3.0 * (model.num_layers * blk.flops + blk.out_flops) * scale
    rc_flops = model.num_layers * blk.rc_flops * scale
    prec = cols["precision"]
    peak = np.empty(len(prec))
    for name in np.unique(prec):  # MFU basis: the 16-bit peak for bf16/fp8, else the dtype's own
        peak[prec == name] = gpu.peak("bf16" if name in ("bf16", "fp8") else str(name))
    total = np.sum([mem[k] for k in MEMORY_KEYS], axis=0)
    worst = np.nanargmax(total, axis=1)
    rows = np.arange(len(worst))
    peak_gib = total[rows, worst] / GiB
    fits, at_risk = fit_verdicts(peak_gib, usable_gib(cluster, p), p)
    out = {"step_time_s": step, "tokens_per_s": work.tokens / step,
           "tflops_per_gpu": model_flops / step / n / 1e12, "mfu": model_flops / step / n / peak,
           "hfu": (model_flops + rc_flops) / step / n / peak, "peak_memory_gib": peak_gib,
           "fits": fits, "at_risk": at_risk, "microbatches": micro,
           "num_gpus": n, "stage_memory_gib": total / GiB}
    out |= {f"memory.{k}": mem[k][rows, worst] / GiB for k in MEMORY_KEYS}
    host = np.nanmax(mem["host"], axis=1) / GiB
    out |= {"host_memory_gib": host, "host_fits": host <= p.host_memory_per_gpu_gib}
    return out
