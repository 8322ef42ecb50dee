"""The cost model over many plans at once: numpy arrays, one row per plan, for any model.

A model is a LayerGraph (spec.graph): a sequence of layers, each an instance of a distinct
layer (its LayerOps, stored once). ``assemble`` prices the distinct layers once per distinct
combination of the plan fields they depend on (cost.layer), places the layers on pipeline
ranks (stages count the blocks; the other layers go with their neighbours:
spec.stages.stage_layer_ranges) as a (rows, ranks, distinct layers) count tensor, and sums
each term per rank. ``estimate_batch`` turns that into step time and memory; ``estimate``
(one plan, a CostReport) is a batch of one, and ``cost.durations`` keeps the same terms apart
by pass for the simulator.

Mesh axes, outermost to innermost: pp, dp, cp, tp. A TP group is `tp` consecutive ranks
(stride 1), CP has stride tp, DP/FSDP (merged with CP for sharding) stride tp, PP stride
tp*cp*dp.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.cost.comm import (
    Group,
    dpcp_group,
    exposed_under,
    column_st,
    dpcp_parts,
    mesh_keys,
    mesh_placement,
    mesh_strides,
    pipeline_site_pairs,
    staged_fsdp_exposed,
    staged_fsdp_overlapped,
)
from meshplan.cost.compute import elementwise_fused, loss_kind
from meshplan.cost.convergence import token_efficiency
from meshplan.cost.layer import QUANTITIES, act_scale, table
from meshplan.cost.memory import (
    BF16_LOGITS_BYTES_PER_ELEM,
    FUSED_LOGITS_BYTES_PER_ELEM,
    INPLACE_16_LOGITS_BYTES_PER_ELEM,
    INPLACE_LOGITS_BYTES_PER_ELEM,
    LOGITS_BYTES_PER_ELEM,
    VOCAB_PARALLEL_LOGITS_BYTES_PER_ELEM,
    OptimizerCost,
    effective_zero,
    master_bytes,
    model_state_arrays,
    optimizer_cost,
    usable_gib,
)
from meshplan.cost.moe import load_factor, memory_factor
from meshplan.cost.params import DEFAULT_PARAMS, CostParams, flat_collectives, p2p_exposed
from meshplan.cost.parts import (
    boundary_sends,
    dp_end_of_step,
    offload_seconds,
    optimizer_seconds,
    output_stage,
    plans_to_columns,
    rank_sends,
    root_fsdp,
    shard_degree,
    stage_sends,
    tied_sync,
)
from meshplan.cost.schedule import RankPasses, bubble_array, in_flight_array, rank_passes
from meshplan.cost.sync import (
    amortised_outer,
    compressed_sync_bytes,
    cross_bytes,
    matrix_elements,
    outer_bytes,
    outer_sync,
    powersgd_bytes,
    reduce_bytes,
    straggler_seconds,
)
from meshplan.cost.sync import groups as sync_groups
from meshplan.cost.reserved import allocator_bytes, deepspeed_init_reserved_bytes, outside_bytes
from meshplan.cost.uncertainty import memory_high, step_band, verdicts
from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX, AXES
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.constraints import violations
from meshplan.spec.graph import LayerGraph, derived, layer_ops
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload, microbatches
from meshplan.spec.stages import stage_ids_for_rank, stage_layer_ranges
from meshplan.spec.transformer import as_graph
from meshplan.units import GiB

#: Plan fields that determine the per-layer quantities (cost.layer.Combo).
BLOCK_KEY = (AX.TP, AX.CP, "micro_batch", "precision", "recompute", "sequence_parallel",
             "compile", "flash_attention", AX.EP, "fused_loss")
#: Exposed time terms (they sum to the step time) and overlapped ones, in report order.
TIME_KEYS = ("compute", "recompute", "tp_comm", "tp_comm_overlapped", "cp_comm", "cp_comm_overlapped", "ep_comm",
             "dp_comm", "dp_comm_overlapped", "pp_comm", "offload", "bubble", "optimizer", "outer_sync",
             "outer_sync_overlapped", "straggler", "overhead")
MEMORY_KEYS = ("weights", "grads", "optimizer", "activations", "transient", "overhead", "allocator", "outside")
"""The parts of a rank's peak: the allocated ones (ALLOCATED_KEYS), the caching allocator's extra
('allocator': reserved - allocated) and the memory outside it ('outside': CUDA context, NCCL);
cost.reserved."""
ALLOCATED_KEYS = MEMORY_KEYS[:6]
RESERVED_KEYS = MEMORY_KEYS[:7]

__all__ = ["ALLOCATED_KEYS", "BLOCK_KEY", "MEMORY_KEYS", "RESERVED_KEYS",
            "TIME_KEYS", "Assembly", "Layout", "assemble", "check", "estimate_batch",
           "layout", "plans_to_columns"]


# ---- the model's layers as arrays ----------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """A LayerGraph as arrays over its distinct layers (B of them, in order of first use)."""

    graph: LayerGraph
    ids: tuple[str, ...]
    ops: tuple
    kinds: tuple[str, ...]      # per layer of the graph
    layer_id: np.ndarray        # (L,) index into ids
    is_block: np.ndarray        # (B,) the distinct layer is a block (recomputed, an FSDP unit)
    prefix: np.ndarray          # (B,) counts of the layers before the first block (first rank)
    suffix: np.ndarray          # (B,) counts of the layers after the last block (the output rank)
    total: np.ndarray           # (B,) counts in the whole model
    loss: np.ndarray            # (B,) the layer computes the loss
    hidden: np.ndarray          # (B,) bytes per token (2-byte activations) of the layer's output
    send: float                 # the largest bytes per token a pipeline cut between blocks sends
    pairs: np.ndarray           # (B,) TP all-reduces per pass
    tp_size: np.ndarray         # (B,) bytes per token of each TP all-reduce (hidden, or LayerOps.tp_reduce / pairs)
    kv_dim: np.ndarray          # (B,) attention's key width (0: no attention)
    a2a: np.ndarray             # (B,) bytes per token of one EP all-to-all (0: no experts)
    experts: np.ndarray         # (B,) experts and top-k of a MoE layer (0: none)
    top_k: np.ndarray
    params: np.ndarray          # (B,) params, params_split, params_expert, params_ep
    params_split: np.ndarray
    params_expert: np.ndarray
    params_ep: np.ndarray
    vocab: np.ndarray           # (B,) logits per token at the loss
    loss_split: np.ndarray

    def ids_where(self, mask: np.ndarray) -> list[int]:
        """Indices of the distinct layers where ``mask`` (B,) holds."""
        return [int(i) for i in np.nonzero(mask)[0]]


def layout(graph: LayerGraph) -> Layout:
    """The graph's Layout, computed once per graph object."""
    return derived(graph, "layout", _layout)


def _layout(graph: LayerGraph) -> Layout:
    ops_by_id = layer_ops(graph)
    ids = tuple(dict.fromkeys(layer.block for layer in graph.layers))
    index = {b: i for i, b in enumerate(ids)}
    ops = tuple(ops_by_id[b] for b in ids)
    kinds = tuple(layer.kind for layer in graph.layers)
    lid = np.array([index[layer.block] for layer in graph.layers])
    is_block = np.array([any(k == "block" for k, i in zip(kinds, lid) if i == j) for j in range(len(ids))])
    blocks = [i for i, k in enumerate(kinds) if k == "block"]
    first, last = (blocks[0], blocks[-1]) if blocks else (len(kinds), len(kinds) - 1)

    def counts(sel: range | list[int]) -> np.ndarray:
        return np.bincount(lid[list(sel)], minlength=len(ids)).astype(float)

    body = [i for i in range(first, last + 1)]
    send = max((ops[lid[i]].send for i in body), default=0.0)

    def arr(f: Any) -> np.ndarray:
        return np.array([float(f(o)) for o in ops])

    return Layout(
        graph=graph, ids=ids, ops=ops, kinds=kinds, layer_id=lid, is_block=is_block,
        prefix=counts(range(first)), suffix=counts(range(last + 1, len(kinds))), total=counts(range(len(kinds))),
        loss=arr(lambda o: o.loss_vocab > 0) > 0, hidden=arr(lambda o: o.hidden), send=float(send),
        pairs=arr(lambda o: o.tp_allreduces),
        tp_size=arr(lambda o: o.tp_reduce / o.tp_allreduces if o.tp_reduce and o.tp_allreduces else o.hidden),
        kv_dim=arr(lambda o: o.attention.kv_dim if o.attention else 0),
        a2a=arr(lambda o: o.top_k * o.hidden if o.experts else 0), experts=arr(lambda o: o.experts),
        top_k=arr(lambda o: o.top_k if o.experts else 0), params=arr(lambda o: o.params),
        params_split=arr(lambda o: o.params_split), params_expert=arr(lambda o: o.params_expert),
        params_ep=arr(lambda o: o.params_ep),
        vocab=arr(lambda o: o.loss_vocab), loss_split=arr(lambda o: o.loss_split) > 0)


def _group_rows(cols: Mapping[str, np.ndarray], keys: Sequence[str]) -> tuple[list[dict], np.ndarray]:
    """Distinct combinations of ``keys`` (as dicts of Python values) and each row's index."""
    arrays = [np.asarray(cols[k]) for k in keys]
    n = len(arrays[0])
    if n <= 64 or any(a.dtype == object for a in arrays):
        index: dict[tuple, int] = {}
        inv = np.array([index.setdefault(t, len(index)) for t in zip(*(a.tolist() for a in arrays))])
        return [dict(zip(keys, t)) for t in index], inv
    # one int64 key per row from each column's codes (mixed radix), then one np.unique
    key = np.zeros(n, dtype=np.int64)
    uniques = []
    for a in arrays:
        u, code = np.unique(a, return_inverse=True)
        uniques.append(u)
        key = key * len(u) + code.ravel()
    ukey, inv = np.unique(key, return_inverse=True)
    combos = []
    for k in ukey.tolist():
        vals = []
        for u in reversed(uniques):
            k, c = divmod(k, len(u))
            vals.append(u[c].item())
        combos.append(dict(zip(keys, reversed(vals))))
    return combos, inv.ravel()


def _quantities(lay: Layout, cluster: ClusterSpec, work: Workload, cols: Mapping[str, np.ndarray],
                p: CostParams) -> np.ndarray:
    """(rows, B, QUANTITIES) per-micro-batch quantities of each distinct layer."""
    combos, inv = _group_rows(cols, BLOCK_KEY)
    t = table(list(lay.ops), [bool(b) for b in lay.is_block], combos, work.seq_len, cluster.gpu, p)
    return t[inv]


def _placement(lay: Layout, cols: Mapping[str, np.ndarray], width: int) -> np.ndarray:
    """(rows, width, B): how many of each distinct layer each pipeline rank holds."""
    sl = cols["stage_layers"]
    explicit = np.array([x is not None for x in sl], dtype=bool) if len(sl) else np.zeros(0, dtype=bool)
    pp, v = np.asarray(cols[AX.PP]).astype(np.int64), np.asarray(cols["virtual_stages"]).astype(np.int64)
    zbv = (np.asarray(cols["schedule"]) == "zbv").astype(np.int64)
    inter = (np.asarray(cols["schedule"]) == "interleaved-1f1b").astype(np.int64)
    key = (pp * 1024 + v) * 4 + zbv * 2 + inter  # the placement depends on pp, v and the V shape only
    index: dict[tuple, int] = {}
    inv = np.empty(len(pp), dtype=np.int64)
    even = np.nonzero(~explicit)[0]
    ukey, uinv = np.unique(key[even], return_inverse=True)
    for i, k in enumerate(ukey.tolist()):
        index[(k, None)] = i
    inv[even] = uinv.ravel()
    for r in np.nonzero(explicit)[0].tolist():
        inv[r] = index.setdefault((int(key[r]), tuple(sl[r])), len(index))
    mats = np.zeros((len(index), width, len(lay.ids)))
    for (k, stages), i in index.items():
        rest, inter_f = divmod(k, 2)
        rest, zbv_f = divmod(rest, 2)
        p_, v_ = divmod(rest, 1024)
        sched = "zbv" if zbv_f else ("interleaved-1f1b" if inter_f else "1f1b")
        plan = Plan(pp=p_, virtual_stages=v_, schedule=sched, stage_layers=stages)
        ranges = stage_layer_ranges(lay.kinds, plan)
        for r in range(p_):
            for sid in stage_ids_for_rank(r, plan):
                a, b = ranges[sid]
                mats[i, r] += np.bincount(lay.layer_id[a:b], minlength=len(lay.ids))
    return mats[inv]


# ---- the assembly --------------------------------------------------------------------------------

@dataclass
class Assembly:
    """Every per-plan (rows) and per-rank (rows, ranks) piece of the step, before it is summed
    into a step time: what estimate_batch reduces and cost.durations lists by pass."""

    lay: Layout
    cols: dict
    micro: np.ndarray
    tokens: np.ndarray
    shard: np.ndarray
    valid: np.ndarray
    first: np.ndarray
    last: np.ndarray            # the rank holding the output layer (rank 0 under ZBV)
    zbv: np.ndarray
    split: np.ndarray           # split-backward schedule with pp > 1
    counts: np.ndarray          # (rows, ranks, B)
    C: Counts                   # counts, one (rows, ranks) slice per distinct layer
    R: Counts                   # of which recomputed (blocks only)
    q: dict                     # QUANTITIES -> (rows, B)
    fwd: np.ndarray             # (rows, ranks) forward compute seconds per micro-batch
    b_in: np.ndarray            # input-gradient compute
    b_w: np.ndarray             # weight-gradient compute
    fwd_x: np.ndarray           # of which the layers before the first block / after the last
    bin_x: np.ndarray
    bw_x: np.ndarray
    terms: dict                 # TIME_KEYS (per-micro-batch parts) -> (rows, ranks)
    tp_f: np.ndarray            # TP + CP + EP exposed in the forward / backward, and overlapped
    tp_b: np.ndarray
    tp_f_ovl: np.ndarray
    tp_b_ovl: np.ndarray
    dp_f: np.ndarray            # per-block FSDP + offload exposed in the forward / backward
    dp_b: np.ndarray
    dp_f_ovl: np.ndarray
    dp_b_ovl: np.ndarray
    send: np.ndarray            # one pipeline send across the first boundary (rows)
    sends: np.ndarray           # (rows, ranks) one send across each boundary j -> j + 1 (parts.boundary_sends)
    st: Any                     # each axis's rank stride per row under the placement (comm.mesh_strides)
    p2p: np.ndarray             # (rows, ranks) sends per micro-batch
    totals: np.ndarray          # (rows, ranks) exposed seconds per micro-batch (-inf beyond pp)
    plocal: np.ndarray          # (rows, ranks) parameters per GPU before sharding
    lp_unit: np.ndarray         # (rows) parameters of the largest FSDP unit (block)
    blk_params: np.ndarray      # (rows, ranks) parameters in blocks (FSDP units)
    ag: np.ndarray              # (rows, B) FSDP gather / reduce-scatter of one layer
    rs: np.ndarray
    fsdp: np.ndarray
    per_step: np.ndarray
    tied: np.ndarray            # (rows) tied-weight gradient all-reduce
    tied_local: np.ndarray      # (rows) tied parameters on one GPU
    opt: OptimizerCost          # the workload's optimizer: its state bytes and step bytes (cost.memory)


class Counts:
    """A (rows, ranks, B) count tensor kept as one contiguous (rows, ranks) slice per distinct
    layer, summed over the layers a term concerns only (a transformer's TP all-reduces are its
    blocks': one slice, not three)."""

    def __init__(self, counts: np.ndarray) -> None:
        self.slices = [np.ascontiguousarray(counts[:, :, b]) for b in range(counts.shape[2])]
        self.shape = counts.shape[:2]

    def sum(self, x: np.ndarray, ids: Any = None) -> np.ndarray:
        """(rows, ranks) sum over ``ids`` (default all) of count x x[:, id]."""
        ids = range(len(self.slices)) if ids is None else ids
        out = np.zeros(self.shape)
        for b in ids:
            out += self.slices[b] * x[:, b:b + 1]
        return out


def assemble(graph: LayerGraph, cluster: ClusterSpec, work: Workload, cols: dict[str, Any],
             p: CostParams) -> Assembly:
    lay = layout(graph)
    tp, pp, dp, cp, ep = (cols[k].astype(float) for k in (AX.TP, AX.PP, AX.DP, AX.CP, AX.EP))
    zero, mb, v = cols["zero"], cols["micro_batch"].astype(float), cols["virtual_stages"].astype(float)
    n = len(tp)
    shard = shard_degree(cols, cluster)
    micro = microbatches(work.global_batch, cols[AX.DP], cols["micro_batch"])
    tokens = mb * work.seq_len / cp
    scale = act_scale(cols["precision"])
    qa = _quantities(lay, cluster, work, cols, p)
    q = {k: qa[:, :, i] for i, k in enumerate(QUANTITIES)}
    width = int(pp.max())
    counts = _placement(lay, cols, width)
    j = np.arange(width)[None, :]
    zbv = np.asarray(cols["schedule"]) == "zbv"
    valid, first, last = j < pp[:, None], j == 0, output_stage(pp, zbv, j)
    blk_ids = lay.ids_where(lay.is_block)

    def col(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=float)[:, None]

    # Recompute: blocks only; recompute_layers = the first N blocks of each rank.
    C = Counts(counts)
    nblk = sum((C.slices[b] for b in blk_ids), np.zeros(C.shape))
    full_rc = cols["recompute"] == "full"
    rl = cols["recompute_layers"]
    limited = full_rc[:, None] & (rl[:, None] >= 0)
    frac = np.where(limited, np.minimum(nblk, rl[:, None]) / np.maximum(nblk, 1), 1.0)
    R = Counts(counts * lay.is_block[None, None, :] * frac[:, :, None])

    f, bi, bw, rc = q["f"], q["bi"], q["bw"], q["rc"]
    fwd, b_in, b_w = C.sum(f), C.sum(bi), C.sum(bw)
    pre, suf = lay.prefix[None, :], lay.suffix[None, :]
    fwd_x = first * (f * pre).sum(1)[:, None] + last * (f * suf).sum(1)[:, None]
    bin_x = first * (bi * pre).sum(1)[:, None] + last * (bi * suf).sum(1)[:, None]
    bw_x = first * (bw * pre).sum(1)[:, None] + last * (bw * suf).sum(1)[:, None]
    compute = fwd + b_in + b_w
    recompute = R.sum(rc, blk_ids)

    # Tensor, context and expert parallel communication per layer (only the layers that have it).
    zeros = np.zeros(C.shape)
    tp_ids = lay.ids_where(lay.pairs > 0)
    st = mesh_strides(cols)  # the placement: each axis's rank distance, per row
    fl = flat_collectives(p)  # the profile's collectives: NCCL's forms, or one flat ring
    tp_one = Group.of(cluster, tp[:, None], st[AX.TP][:, None], flat=fl).all_reduce(
        (tokens * scale)[:, None] * lay.tp_size[None, :])
    per_pass = tp_one * lay.pairs[None, :]  # one direction (forward or backward)
    re = np.where(full_rc, 1.0, 0.0)[:, None]
    tp_fwd = C.sum(per_pass, tp_ids)
    tp_bwd = tp_fwd + R.sum(per_pass * re, tp_ids)
    att_ids = lay.ids_where(lay.kv_dim > 0) if (cp > 1).any() else []
    cp_f = cp_b = cp_fo = cp_bo = zeros
    if att_ids:
        kv = (tokens * scale)[:, None] * 2 * lay.kv_dim[None, :] / tp[:, None] * 2.0
        cp_g = Group.of(cluster, cp[:, None], st[AX.CP][:, None], flat=fl)
        cp_t = np.where(lay.kv_dim[None, :] > 0, 3 * cp_g.all_gather(kv * cp[:, None]), 0.0)
        cp_exp = np.maximum(0.0, cp_t - 0.5 * (f + bi + bw))
        share_f = f / np.maximum(1e-30, f + bi + bw)
        cp_f, cp_b = C.sum(cp_exp * share_f, att_ids), C.sum(cp_exp * (1 - share_f), att_ids)
        cp_fo, cp_bo = C.sum((cp_t - cp_exp) * share_f, att_ids), C.sum((cp_t - cp_exp) * (1 - share_f), att_ids)
    exp_ids = lay.ids_where(lay.a2a > 0) if (ep > 1).any() else []
    ep_s = zeros
    if exp_ids:
        ep_g = dpcp_group(cluster, column_st(st), cp[:, None], ep[:, None], flat=fl)
        # the busiest rank receives (and sends back) its load over the mean rank's (cost.moe)
        busiest = load_factor(tokens[:, None], lay.experts[None, :], lay.top_k[None, :], ep[:, None], p)
        ep_t = np.where(lay.a2a[None, :] > 0, 4 * ep_g.all_to_all(
            (tokens * scale)[:, None] * lay.a2a[None, :] * busiest), 0.0)
        ep_s = C.sum(ep_t, exp_ids)
    async_f = col(np.where(cols["async_tp"], p.tp_exposed_async, 1.0))
    tp_f = tp_fwd * async_f + cp_f + ep_s / 2
    tp_b = tp_bwd * async_f + cp_b + ep_s / 2
    tp_f_ovl = tp_fwd * (1 - async_f) + cp_fo
    tp_b_ovl = tp_bwd * (1 - async_f) + cp_bo

    # Parameters and FSDP per layer (the blocks are FSDP units; the rest is the root unit).
    lp = local_params(lay, tp, ep)
    fsdp = (zero == 3) & (shard > 1)
    per_step = (zero == 3) & (pp > 1)
    blocked = (fsdp & ~per_step)[:, None]
    if (zero == 3).any():
        shard_g = dpcp_group(cluster, column_st(st), cp[:, None], shard[:, None], flat=fl)
        ag, rs = shard_g.all_gather(2.0 * lp), shard_g.reduce_scatter(reduce_bytes(cols, p)[:, None] * lp)
    else:
        ag = rs = np.zeros_like(lp)
    if blocked.any():
        f_exp = np.where(blocked, exposed_under(ag, f, p.overlap_slowdown), 0.0)
        b_exp = np.where(blocked, exposed_under(ag + rs, bi + bw + rc, p.overlap_slowdown), 0.0)
        f_ovl, b_ovl = np.where(blocked, ag - f_exp, 0.0), np.where(blocked, ag + rs - b_exp, 0.0)
    else:
        f_exp = b_exp = f_ovl = b_ovl = np.zeros_like(lp)
    plocal, tied_local = _rank_params(lay, C, lp, tp, pp, valid, first, last)
    blk_params = C.sum(lp, blk_ids)
    lp_unit = np.max(np.where(lay.is_block[None, :], lp, 0.0), axis=1)
    offload = offload_seconds(cols, plocal, shard, p)
    dp_f_blk, dp_b_blk = C.sum(f_exp, blk_ids), C.sum(b_exp, blk_ids)
    dp_f = dp_f_blk + offload / 2
    dp_b = dp_b_blk + offload / 2
    dp_f_ovl, dp_b_ovl = C.sum(f_ovl, blk_ids), C.sum(b_ovl, blk_ids)

    send_bytes = tokens * scale * lay.send / np.where(cols["p2p_sharded"], tp, 1)
    # each pipeline boundary's send on the link it crosses (cost.comm.pipeline_links); where every
    # boundary a row uses has the same link, the per-rank sum is the one-link form (same bits)
    meshes = mesh_keys(cols, (v > 1) & ~zbv)  # the distinct (mesh, placement, wrap) of the rows
    sends = boundary_sends(cluster, cols, send_bytes, width, meshes)
    send = sends[:, 0]
    ex = p2p_exposed(p, v)  # the profile's pp_p2p_overlap: the sends' exposed fraction
    wrap = (v > 1) & ~zbv
    used = (j < (pp - 1)[:, None]) | ((j == (pp - 1)[:, None]) & wrap[:, None])
    uniform = np.all(np.where(used, sends == send[:, None], True), axis=1)
    p2p = stage_sends(np.where(pp > 1, 2 * v * send * ex, 0), pp, zbv, j, np.where(pp > 1, send * ex, 0))
    if not uniform.all():
        p2p = np.where(uniform[:, None], p2p,
                       np.where(valid & (pp > 1)[:, None], rank_sends(sends, pp, v, zbv, j) * ex[:, None], 0.0))
    tp_t = tp_fwd + tp_bwd
    terms = {"compute": compute, "recompute": recompute, "tp_comm": tp_t * async_f,
             "tp_comm_overlapped": tp_t * (1 - async_f), "cp_comm": cp_f + cp_b,
             "cp_comm_overlapped": cp_fo + cp_bo, "ep_comm": ep_s,
             "dp_comm": dp_f_blk + dp_b_blk, "dp_comm_overlapped": dp_f_ovl + dp_b_ovl,
             "pp_comm": p2p, "offload": offload}
    exposed = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm", "offload")
    totals = np.where(valid, sum(terms[k] for k in exposed), -np.inf)
    tied = tied_sync(cluster, tied_local, cp, dp, shard, tp, p, cols, meshes)
    return Assembly(
        lay=lay, cols=cols, micro=micro, tokens=tokens, shard=shard, valid=valid, first=first, last=last, zbv=zbv,
        split=(((np.asarray(cols["schedule"]) == "zero-bubble") | zbv) & (pp > 1)), counts=counts,
        C=C, R=R, q=q, fwd=fwd, b_in=b_in, b_w=b_w, fwd_x=fwd_x, bin_x=bin_x, bw_x=bw_x, terms=terms,
        tp_f=tp_f, tp_b=tp_b, tp_f_ovl=tp_f_ovl, tp_b_ovl=tp_b_ovl, dp_f=dp_f, dp_b=dp_b,
        dp_f_ovl=dp_f_ovl, dp_b_ovl=dp_b_ovl, send=send, sends=sends, st=st, p2p=p2p,
        totals=totals, plocal=plocal, lp_unit=lp_unit, blk_params=blk_params, ag=ag, rs=rs, fsdp=fsdp,
        per_step=per_step, tied=tied * np.ones(n), tied_local=tied_local * np.ones(n),
        opt=optimizer_cost(work.optimizer, graph))


def local_params(lay: Layout, tp: np.ndarray, ep: np.ndarray) -> np.ndarray:
    """(rows, B) parameters of each distinct layer on one GPU before ZeRO sharding (TP and EP;
    experts kept whole under TP, ``params_ep``, by EP alone)."""
    return ((lay.params - lay.params_split - lay.params_ep)[None, :]
            + (lay.params_split - lay.params_expert)[None, :] / tp[:, None]
            + lay.params_expert[None, :] / (tp * ep)[:, None] + lay.params_ep[None, :] / ep[:, None])


def _rank_params(lay: Layout, C: Counts, lp: np.ndarray, tp: np.ndarray, pp: np.ndarray,
                 valid: np.ndarray, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """((rows, ranks) parameters per GPU before sharding, (rows) tied parameters per GPU): a
    tied weight counted at both users, once when one rank holds both (pp = 1)."""
    tied_local = lay.graph.tied_params / np.where(lay.graph.tied_split, tp, 1.0)
    single = (pp == 1)[:, None]
    return np.where(valid, C.sum(lp) - (first & last & single) * tied_local[:, None], 0.0), tied_local


def expert_local_params(a: Assembly) -> np.ndarray:
    """(rows, ranks) parameters of the experts each rank holds (split over tp x ep, or over ep
    alone for experts TP keeps whole: local_params), before ZeRO sharding."""
    tp = np.asarray(a.cols[AX.TP], dtype=float)
    ep = np.asarray(a.cols[AX.EP], dtype=float)
    lay = a.lay
    le = lay.params_expert[None, :] / (tp * ep)[:, None] + lay.params_ep[None, :] / ep[:, None]
    return np.where(a.valid, a.C.sum(le), 0.0)


def expert_shard(a: Assembly) -> np.ndarray:
    """(rows, 1) ranks each expert a rank holds is sharded over: its replicas (dp*cp/ep), at most
    the plan's sharding group; at least 1."""
    cols = a.cols
    dpcp = np.asarray(cols[AX.DP], dtype=float) * np.asarray(cols[AX.CP], dtype=float)
    ep = np.asarray(cols[AX.EP], dtype=float)
    return np.maximum(1.0, np.minimum(np.asarray(a.shard, dtype=float), dpcp / ep))[:, None]


def optimizer_params(a: Assembly) -> np.ndarray:
    """(rows, ranks) parameters to pass cost.parts.optimizer_seconds with the plan's sharding
    group: the experts counted shard / expert_shard times, so that dividing by the group gives each
    rank's own share of them (as the memory does: model_state_arrays' expert part)."""
    ep = np.asarray(a.cols[AX.EP], dtype=float)
    if not (ep > 1).any():
        return a.plocal
    zero = np.asarray(a.cols["zero"], dtype=float)[:, None]
    shard = np.asarray(a.shard, dtype=float)[:, None]
    factor = np.where(zero >= 1, shard / expert_shard(a), 1.0)
    return a.plocal + expert_local_params(a) * (factor - 1.0)


def stage_params(graph: LayerGraph, cols: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """((rows, ranks) parameters per GPU before ZeRO sharding, (rows) parameters of the largest
    block) for plain plan columns with tp, ep, pp, virtual_stages, schedule, stage_layers: the
    placement of assemble, for the search's memory lower bound."""
    lay = layout(graph)
    tp, pp, ep = (np.asarray(cols[k]).astype(float) for k in (AX.TP, AX.PP, AX.EP))
    width = int(pp.max())
    counts = _placement(lay, cols, width)
    j = np.arange(width)[None, :]
    valid, first = j < pp[:, None], j == 0
    last = output_stage(pp, np.asarray(cols["schedule"]) == "zbv", j)
    lp = local_params(lay, tp, ep)
    plocal, _ = _rank_params(lay, Counts(counts), lp, tp, pp, valid, first, last)
    return plocal, np.max(np.where(lay.is_block[None, :], lp, 0.0), axis=1)


def stage_forward(a: Assembly) -> np.ndarray:
    """(rows, ranks) forward seconds per micro-batch of each rank as the simulator runs them
    (cost.durations): the layers, the exposed TP/CP/EP and FSDP communication of the forward,
    half the offload copies and half the sends."""
    return a.fwd + a.tp_f + a.dp_f + a.p2p / 2


def drain(a: Assembly, p: CostParams) -> np.ndarray:
    """(rows, ranks) seconds between each rank's last backward and the end of the pipeline
    (rank 0's). The last backward passes drain from the last rank down to rank 0, one (chunk of
    a) rank's backward and one send each, so rank r ends sum_{j<r} (b_j + send) - send earlier
    (GPipe, 1F1B, interleaved 1F1B with b_j per chunk). A rank's end-of-step gradient sync and
    optimizer start there (the simulator runs the same). Split-backward schedules end with W
    passes that do not chain: 0 (the step's end is then every rank's)."""
    pp, v = np.asarray(a.cols[AX.PP]), np.asarray(a.cols["virtual_stages"]).astype(float)
    fwd = stage_forward(a)
    per = np.where(a.valid, np.where(np.isfinite(a.totals), a.totals, 0.0) - fwd, 0.0) / v[:, None]
    before = np.cumsum(per, axis=1) - per  # sum over j < r
    j = np.arange(per.shape[1])[None, :]
    # the send across boundary r - 1 (rank r's gradient to rank r - 1)
    ex = p2p_exposed(p, np.asarray(a.cols["virtual_stages"]))[:, None]
    send = np.where((pp > 1)[:, None], np.roll(a.sends, 1, axis=1) * ex, 0.0)
    out = np.maximum(0.0, before - np.where(j >= 1, send, 0.0))
    return np.where(a.split[:, None] | ~a.valid, 0.0, out)


def _rank_passes(a: Assembly, p: CostParams) -> RankPasses:
    """Per-micro-batch forward / input-gradient / weight-gradient seconds of each rank, split
    as the simulator runs them (cost.durations): exposed TP/CP/EP and FSDP communication with
    the pass that carries it, half the sends with the forward. For ZBV also each rank's
    second chunk (virtual stage 2 pp - 1 - r): half its blocks and communication, the output
    layer on rank 0, and that chunk's own sends."""
    def col(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=float)[:, None]

    fwd = stage_forward(a)
    wgt = a.b_w
    bwd = np.where(a.valid, a.totals, 0.0) - fwd - wgt
    chunk1 = None
    if a.zbv.any():
        pp = col(a.cols[AX.PP])
        j = np.arange(a.valid.shape[1])[None, :]
        on = col(np.where(a.cols[AX.PP] > 1, p2p_exposed(p, np.asarray(a.cols["virtual_stages"])), 0.0))
        ahead, back = a.sends * on, np.roll(a.sends, 1, axis=1) * on  # boundaries j and j - 1
        suf = a.lay.suffix[None, :]
        out_f, out_b, out_w = (a.last * (a.q[k] * suf).sum(1)[:, None] for k in ("f", "bi", "bw"))
        f1 = (fwd - a.fwd_x - a.p2p / 2) / 2 + out_f + back * (j > 0)
        b1 = (bwd - a.bin_x - a.p2p / 2) / 2 + out_b + ahead * (j < pp - 1)
        w1 = (wgt - a.bw_x) / 2 + out_w
        chunk1 = (f1, b1, w1)
    return rank_passes(fwd, bwd, wgt, a.valid, chunk1)


def check(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload) -> None:
    """Raise MeshplanError naming every reason the plan cannot run (memory aside): the kernel's
    precondition (spec.constraints), checked by every stage that prices one plan."""
    bad = violations(model, cluster, plan, work)
    if bad:
        raise MeshplanError("plan cannot run: " + "; ".join(reason for _, reason in bad))


def estimate_batch(model: LayerGraph | ModelSpec, cluster: ClusterSpec, work: Workload,
                   plans: Sequence[Plan] | Mapping[str, np.ndarray],
                   params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """Step time, throughput and memory of many plans. Plans must already satisfy
    meshplan.spec.constraints (estimate() checks; the search masks).

    Returns arrays: step_time_s, tokens_per_s, tflops_per_gpu, mfu, hfu, peak_memory_gib, fits,
    microbatches, time.<term> for every TIME_KEYS term, memory.<part> of the fullest stage,
    stage_memory_gib (rows, stages; NaN beyond pp).
    """
    graph = as_graph(model, work.seq_len)
    cols = plans if isinstance(plans, Mapping) else plans_to_columns(plans)
    cols = {k: np.asarray(v) if k != "stage_layers" else v for k, v in cols.items()}
    return by_pipeline_depth(cols, lambda c: _estimate(graph, cluster, work, c, params))


def by_pipeline_depth(cols: dict[str, Any], fn: Any) -> dict[str, np.ndarray]:
    """``fn(cols)`` (an estimate_batch-style result) over many rows, one pipeline depth at a
    time (the stage axis is then no wider than needed), merged back in row order;
    stage_memory_gib is (rows, the deepest pp) with NaN beyond each row's pp."""
    pp = cols[AX.PP]
    degrees = np.unique(pp)
    if len(pp) <= 64 or len(degrees) == 1:
        return fn(cols)
    parts = [(np.nonzero(pp == d)[0], d) for d in degrees]
    outs = [fn({k: v[idx] for k, v in cols.items()}) for idx, _ in parts]
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


def end_of_step(a: Assembly, cluster: ClusterSpec, p: CostParams) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, overlapped) (rows, ranks) seconds of each rank's gradient sync / ZeRO gathers of
    its own parameters, plus the tied weights' all-reduce on the ranks holding them."""
    cols = a.cols
    tp, dp, cp, pp = (np.asarray(cols[k]).astype(float) for k in (AX.TP, AX.DP, AX.CP, AX.PP))
    c2 = {k: np.asarray(cols[k])[:, None] for k in ("zero", AX.PP, "grad_sync", "precision", "grad_compression")}
    _, n_in, _ = sync_groups(cols, cluster)  # a local-sgd/diloco row syncs its inner group every step
    psgd, psgd_t = powersgd_terms(a, cluster, p)
    e_r, o_r = dp_end_of_step(cluster, c2, p, tp[:, None], n_in[:, None].astype(float), cp[:, None],
                              a.shard[:, None], a.lp_unit[:, None], a.plocal,
                              (a.terms["compute"][:, 0] / 2)[:, None], a.micro[:, None], psgd, psgd_t,
                              column_st(a.st))
    j = np.arange(a.valid.shape[1])[None, :]
    ends = a.first | (j == (pp[:, None] - 1))
    tie = ((pp > 1) & (a.lay.graph.tied_params > 0) & ~a.zbv)[:, None]
    return e_r + np.where(ends & tie, a.tied[:, None], 0), o_r


def powersgd_terms(a: Assembly, cluster: ClusterSpec, p: CostParams) -> tuple[np.ndarray | None, Any]:
    """((rows, ranks) bytes PowerSGD all-reduces per step, (rows, ranks) seconds of its
    compression in HBM), or (None, 0) when no row compresses with PowerSGD."""
    cols = a.cols
    psgd = np.asarray(cols["grad_compression"]) == "powersgd"
    if not psgd.any():
        return None, 0.0
    tp, ep = (np.asarray(cols[k], dtype=float) for k in (AX.TP, AX.EP))
    lp = local_params(a.lay, tp, ep)
    sent = powersgd_bytes(a.lay, a.C, lp, tp, ep, np.asarray(cols["compression_rank"]))
    hbm = cluster.gpu.hbm_bandwidth_gbps * 1e9 * p.hbm_efficiency
    return sent, np.where(psgd[:, None], p.powersgd_bytes_per_param * a.plocal / hbm, 0.0)


def held_params(a: Assembly) -> np.ndarray:
    """(rows, ranks) parameters each rank holds after ZeRO within its (inner) group."""
    zero = np.asarray(a.cols["zero"])[:, None]
    return a.plocal / np.where(zero >= 1, a.shard[:, None], 1.0)


def weak_link_terms(a: Assembly, cluster: ClusterSpec, p: CostParams, step: np.ndarray,
                    busy: np.ndarray) -> dict[str, np.ndarray]:
    """Per row: the outer sync of local-sgd/diloco rows amortised over H steps (exposed,
    overlapped, and one whole outer sync), the expected straggler wait and what a synchronous
    plan would wait, the token-efficiency factor. ``step``: the step before these (the inner
    step the outer sync may hide under); ``busy``: the GPU's compute per step (computing and
    recomputing: what jitters from run to run; time waiting on links does not)."""
    cols = a.cols
    periodic, n_in, n_out = sync_groups(cols, cluster)
    rows = np.arange(len(step))
    n = cols[AX.TP] * cols[AX.PP] * cols[AX.DP] * cols[AX.CP]
    out = {"outer_exposed": np.zeros(len(rows)), "outer_overlapped": np.zeros(len(rows)),
           "outer_sync_s": np.zeros(len(rows))}
    if periodic.any():
        held = held_params(a)
        t, t_step = outer_sync(cluster, cols, p, held, n_in, n_out, a.st)
        x, o = amortised_outer(t, t_step, step[:, None], cols, p.overlap_slowdown)
        x, o = np.where(a.valid, x, -np.inf), np.where(a.valid, o, 0.0)
        worst = np.argmax(x, axis=1)
        out = {"outer_exposed": np.maximum(0.0, x[rows, worst]), "outer_overlapped": o[rows, worst],
               "outer_sync_s": np.where(a.valid, t, 0.0).max(axis=1)}
    inner_ranks = n // np.maximum(n_out, 1)
    wait, wait_sync = straggler_seconds(cluster.step_jitter, busy, n, periodic, inner_ranks, n_out,
                                        cols["sync_every"])
    eff = token_efficiency(p.token_efficiency_file)
    factor = eff.factor(cols["grad_sync"], cols["sync_every"], n_out, cols["grad_compression"],
                        cols["compression_rank"])
    return out | {"straggler": wait, "straggler_sync": wait_sync, "token_factor": factor,
                  "n_out": n_out.astype(float)}


def cross_site(a: Assembly, cluster: ClusterSpec, p: CostParams) -> np.ndarray:
    """(rows) bytes per step that cross each direction of the link between two datacenters (the
    busiest pipeline rank's data-parallel traffic x the ranks, the pipeline sends, the outer
    sync / H); 0 on one datacenter. TP, CP and EP groups stay within a datacenter in the plans
    meshplan enumerates and are not counted."""
    cols = a.cols
    n_rows = len(a.micro)
    if cluster.num_dcs < 2:
        return np.zeros(n_rows)
    tp, pp, dp, cp = (np.asarray(cols[k], dtype=float) for k in (AX.TP, AX.PP, AX.DP, AX.CP))
    zero = np.asarray(cols["zero"])
    periodic, n_in, n_out = sync_groups(cols, cluster)
    n_in = n_in.astype(float)
    plocal = np.where(a.valid, a.plocal, 0.0).max(axis=1)
    micro = np.asarray(a.micro, dtype=float)
    # the per-step data-parallel collective (over the inner group for periodic rows)
    n_sync = n_in * cp
    grads = 4.0 * plocal
    comp = np.asarray(cols["grad_compression"])
    psgd, _ = powersgd_terms(a, cluster, p)
    sent = compressed_sync_bytes(grads, plocal, comp, None if psgd is None else
                                 np.where(a.valid, psgd, 0.0).max(axis=1))
    sent = np.where(periodic, grads, sent)
    gs = np.asarray(cols["grad_sync"])
    allreduce = (gs == "all-reduce") | ((gs != "reduce-scatter") & (zero == 0))
    shard = a.shard
    st = a.st  # the placement: where each axis's groups sit

    def xb(n: Any, size: Any, passes: Any, skip: Any = 1.0) -> np.ndarray:  # a dp x cp group's bytes across sites
        return cross_bytes(cluster, n, 1.0, size, passes, parts=dpcp_parts(st, cp, n, skip))

    dp_sync = np.where(zero == 3, 0.0, xb(n_sync, sent, 1.0) * np.where(allreduce, 2.0, 1.0)
                       * np.where(zero == 2, micro, 1.0))
    dp_sync = dp_sync + np.where((zero == 1) | (zero == 2), xb(n_sync, 2.0 * plocal, 1.0), 0.0)
    # ZeRO-3: every block gathered twice and reduce-scattered per micro-batch (once per step under a pipeline)
    times = np.where(pp > 1, 1.0, micro)
    rb = reduce_bytes(cols, p)
    # (under a pipeline each rank's stage is gathered once per step: one pass, as cost.batch prices it)
    z3 = times * (xb(shard, 2.0 * plocal, np.where(pp > 1, 1.0, 2.0)) + xb(shard, rb * plocal, 1.0))
    hsdp = xb(np.maximum(1.0, n_sync / shard), rb * plocal / shard, 2.0, shard)
    z3 = np.where(zero == 3, z3 + np.where(shard < n_sync, hsdp, 0.0), 0.0)
    # pipeline sends: each pair of peers whose boundary crosses a site link (cost.comm.pipeline_site_pairs)
    # sends one activation forward and one gradient back per micro-batch (each way) and chunk
    send_bytes = np.asarray(a.tokens, dtype=float) * act_scale(cols["precision"]) * a.lay.send / np.where(
        cols["p2p_sharded"], tp, 1.0)
    v = np.asarray(cols["virtual_stages"], dtype=float)
    wrap = (v > 1) & (np.asarray(cols["schedule"]) != "zbv")
    pairs = np.zeros(n_rows)
    keys, inv = mesh_keys(cols, wrap)
    for k, (sz, order, wr) in enumerate(keys):
        if sz[0] > 1:  # AXES[0] is pp
            o, sites = mesh_placement(order)
            pairs[inv == k] = pipeline_site_pairs(cluster, dict(zip(AXES, sz)), o, bool(wr), sites)
    sends = micro * v * send_bytes * pairs
    # the outer sync, once per H steps
    per_value = outer_bytes(comp)
    held = np.where(a.valid, held_params(a), 0.0).max(axis=1)
    outer = cross_bytes(cluster, n_out, tp * cp * n_in, per_value * held, 2.0) / np.maximum(
        1.0, np.asarray(cols["sync_every"], dtype=float))
    outer = np.where(periodic, outer, 0.0)
    return dp_sync + z3 + sends + outer


def _estimate(graph: LayerGraph, cluster: ClusterSpec, work: Workload, cols: dict[str, Any],
              params: CostParams) -> dict[str, np.ndarray]:
    return estimate_assembly(assemble(graph, cluster, work, cols, params), cluster, work, params)


def estimate_assembly(a: Assembly, cluster: ClusterSpec, work: Workload, params: CostParams,
                      rank_ends: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """estimate_batch's result from an Assembly (cost.durations reuses the one it lists).
    ``rank_ends``: (end-of-step exposed, overlapped, optimizer) seconds per (row, rank) computed
    by the caller, for ranks on different hardware (cost.pools); default: from ``cluster``."""
    p, cols = params, a.cols
    tp, pp, v = (cols[k].astype(float) for k in (AX.TP, AX.PP, "virtual_stages"))
    zero, micro, totals, valid = cols["zero"], a.micro, a.totals, a.valid
    crit = np.argmax(totals, axis=1)
    rows = np.arange(len(crit))
    tmax, tsum = totals[rows, crit], np.where(valid, totals, 0).sum(axis=1)
    busy = micro * tmax
    blk = a.lay.is_block[None, :] * a.lay.total[None, :]
    w_frac = (blk * a.q["bw"]).sum(1) / np.maximum(1e-30, (blk * (a.q["f"] + a.q["bi"] + a.q["bw"] + a.q["rc"])).sum(1))
    sched = cols["schedule"]
    passes = _rank_passes(a, p) if a.split.any() else None
    bubble = bubble_array(tsum, tmax, pp, v, sched, w_frac, micro, passes)

    # End of step, per rank: gradient sync / ZeRO gathers of the rank's own parameters, then the
    # optimizer, from the rank's last backward on (the drain ends the ranks one after another).
    if rank_ends is None:
        e_r, o_r = end_of_step(a, cluster, p)
    else:
        e_r, o_r = rank_ends[0], rank_ends[1]
    dr = drain(a, p)
    fullest = np.argmax(np.where(valid, a.plocal, -1.0), axis=1)
    dp_exp, dp_ovl = np.zeros(len(rows)), o_r[rows, fullest]
    # FSDP under a pipeline gathers the stage's parameters once, during the first micro-batch's
    # forward, and reduce-scatters the gradients once, during the last one's backward: only that
    # one micro-batch's compute can hide each (torch.distributed.pipelining, torchtitan PP+FSDP).
    cc = a.counts[rows, crit] * a.lay.is_block[None, :]  # (rows, B) blocks on the critical rank
    ag_s, rs_s = (cc * a.ag).sum(1), (cc * a.rs).sum(1)
    f_c = (cc * a.q["f"]).sum(1)
    # (split backward: the last weight gradients come with the last W, which hides it alone)
    hide_rs = np.where(a.split, (cc * a.q["bw"]).sum(1) / np.where(a.zbv, 2, 1),
                       (cc * (a.q["bi"] + a.q["bw"] + a.q["rc"])).sum(1))
    exp_s = staged_fsdp_exposed(ag_s, f_c, rs_s, hide_rs, pp, a.split, p.overlap_slowdown)
    staged = a.fsdp & a.per_step
    dp_exp = dp_exp + np.where(staged, exp_s, 0)
    dp_ovl = dp_ovl + np.where(staged, staged_fsdp_overlapped(ag_s, f_c, rs_s, hide_rs), 0)
    # FSDP's root unit (the layers that are not blocks) is gathered and reduce-scattered too:
    # per micro-batch without a pipeline (FSDP2 reshards it after each backward), once per step
    # under one, under the blocks' compute (only a step's first gather is exposed, in
    # dp_end_of_step), which it slows like any collective (exposed_under), so that the memory
    # ZeRO-3 saves on it carries its time.
    root_x, root_o = root_fsdp(cluster, p, a.plocal[rows, crit] - a.blk_params[rows, crit], a.shard, tp, tmax,
                               micro, a.fsdp, a.per_step, reduce_bytes(cols, p), a.st, cols[AX.CP].astype(float))
    dp_exp, dp_ovl = dp_exp + root_x, dp_ovl + root_o
    opt_t = (optimizer_seconds(cluster, optimizer_params(a), zero, a.shard, np.asarray(cols["offload_optimizer"], dtype=bool), p,
                               a.opt) if rank_ends is None else rank_ends[2])
    end = np.where(valid, e_r + opt_t - dr, -np.inf).max(axis=1)
    opt = np.minimum(np.where(valid, opt_t, 0).max(axis=1), end)  # >= 0: rank 0 has no drain
    dp_exp = dp_exp + end - opt
    base = busy + bubble + dp_exp + opt
    compute_busy = micro * (a.terms["compute"] + a.terms["recompute"])[rows, crit]
    weak = weak_link_terms(a, cluster, p, base, compute_busy)
    step = base + weak["outer_exposed"] + weak["straggler"] + p.step_overhead_s

    out: dict[str, np.ndarray] = {f"time.{k}": micro * t[rows, crit] for k, t in a.terms.items()}
    out["time.dp_comm"] = out["time.dp_comm"] + dp_exp
    out["time.dp_comm_overlapped"] = out["time.dp_comm_overlapped"] + dp_ovl
    out |= {"time.bubble": bubble, "time.optimizer": opt, "time.outer_sync": weak["outer_exposed"],
            "time.outer_sync_overlapped": weak["outer_overlapped"], "time.straggler": weak["straggler"],
            "time.overhead": np.full(len(rows), p.step_overhead_s)}
    mem = memory_parts(a, p, cluster.gpu.family)
    out |= _summary(a, cluster, work, p, step, mem)
    out |= {"token_factor": weak["token_factor"], "time_to_target_s": step * weak["token_factor"],
            "outer_sync_s": weak["outer_sync_s"], "straggler_sync_s": weak["straggler_sync"],
            "outer_workers": weak["n_out"], "cross_site_gb": cross_site(a, cluster, p) / 1e9}
    return out


def memory_parts(a: Assembly, p: CostParams, family: str = "") -> dict[str, np.ndarray]:
    """(rows, ranks) bytes per part; see memory.py for the per-parameter byte counts and
    cost.reserved for 'allocator' and 'outside' (``family``: the GPU's, for cuBLAS's workspace)."""
    cols = a.cols

    def col(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=float)[:, None]

    def flag(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=bool)[:, None]

    zero, pp = col(cols["zero"]), col(cols[AX.PP])
    plocal = a.plocal
    prec = np.asarray(cols["precision"])[:, None]
    # The experts a rank holds (split over ep) are sharded over their own replicas only (the
    # expert-data-parallel group, dp*cp/ep ranks: Megatron's and torchtitan's EP layout; at most the
    # plan's sharding group), the rest over the whole sharding group: expert_local_params.
    has_ep = bool((np.asarray(cols[AX.EP]) > 1).any())
    elocal = expert_local_params(a) if has_ep else np.zeros_like(plocal)
    args = (flag(cols["offload_params"]), flag(cols["offload_optimizer"]), col(cols[AX.DP] * cols[AX.CP]), p, prec)
    w, g, o, buffers = model_state_arrays(plocal - elocal, col(a.lp_unit), zero, col(a.shard), *args, opt=a.opt)
    if has_ep:
        we, ge, oe, _ = model_state_arrays(elocal, col(a.lp_unit), zero, expert_shard(a), *args, opt=a.opt,
                                           level_shard=col(a.shard))
        w, g, o = w + we, g + ge, o + oe
    zero = effective_zero(zero, col(a.shard), flag(cols["offload_params"]))  # nothing to shard: ZeRO-0's memory
    per_step = (zero == 3) & (pp > 1)  # pipelined FSDP keeps unsharded 16-bit (fp32) params + fp32 grads
    w, g = w + per_step * np.where(prec == "fp32", 4, 2) * plocal, g + per_step * 4 * plocal

    t = col(a.tokens)
    rec = np.asarray(cols["recompute"])
    full_mode, op_mode = (rec == "full")[:, None], (rec == "op")[:, None]
    keep = np.where(full_mode, a.q["inp"], np.where(op_mode, a.q["op"], a.q["full"]))  # (rows, B)
    C, R = a.C, a.R
    blk_ids = a.lay.ids_where(a.lay.is_block)
    kept = t * (R.sum(keep, blk_ids) + C.sum(a.q["full"]) - R.sum(a.q["full"], blk_ids))
    one_block = np.zeros(C.shape)
    for b in blk_ids:  # the largest block a rank holds, being recomputed: what the recompute makes
        # again beyond what the block kept (its kept tensors are already in the activations)
        redo = a.q["full"][:, b:b + 1] - keep[:, b:b + 1]
        one_block = np.maximum(one_block, np.where(C.slices[b] > 0, redo, 0.0))
    transient = np.where(full_mode | op_mode, t * one_block, 0.0)
    width = plocal.shape[1]
    inflight = in_flight_array(col(cols[AX.PP]), col(cols["virtual_stages"]), cols["schedule"][:, None],
                               np.arange(width)[None, :], a.micro[:, None])
    # MoE: the busiest expert-parallel rank's routed activations over the in-flight micro-batches
    # (independent routing draws: their excess adds as sqrt(in flight), not in flight)
    acts = (kept + t * routed_excess(a, p, full_mode | op_mode, inflight)) * inflight
    logits = np.zeros(C.shape)
    for b in a.lay.ids_where(a.lay.loss):
        logits = np.maximum(logits, np.where(C.slices[b] > 0, logit_bytes(a, b, p)[:, None], 0.0))
    has_loss = logits > 0
    transient = np.where(has_loss, np.maximum(transient, logits), transient) + buffers
    transient = transient + p.allocator_fragmentation * (acts + transient)
    # The optimizer step's temporaries (torch's foreach AdamW: CostParams.optimizer_temp_bytes per
    # parameter it updates) live after the backward, when the activations are freed: the peak is
    # the larger of the two.
    offo = flag(cols["offload_optimizer"])
    opt_tmp = np.where(offo, 0.0, p.optimizer_temp_bytes * plocal / np.where(zero >= 1, col(a.shard), 1.0))
    transient = np.maximum(transient, opt_tmp - acts)
    # Framework state inside torch's allocator; the CUDA context and NCCL's buffers are outside it
    # (the 'outside' part below, cost.reserved).
    overhead = p.framework_overhead_gib * GiB
    # DiLoCo's outer state: the fp32 anchor and the Nesterov momentum of the parameters a rank
    # holds; PowerSGD's error feedback (fp32, the unsharded gradients) and its P, Q factors.
    # Local SGD with a compressed outer sync keeps the fp32 anchor it sends deltas from; an
    # overlapped outer sync (sync_overlap) keeps an fp32 snapshot of the parameters at the sync.
    gs = np.asarray(cols["grad_sync"])[:, None]
    comp_outer = (np.asarray(cols["grad_compression"]) != "none")[:, None]
    overlap = (np.asarray(cols["sync_overlap"]) > 0)[:, None] & ((gs == "diloco") | (gs == "local-sgd"))
    outer_state = np.where(gs == "diloco", 8.0, np.where((gs == "local-sgd") & comp_outer, 4.0, 0.0))
    o = o + (outer_state + np.where(overlap, 4.0, 0.0)) * held_params(a)
    if (np.asarray(cols["grad_compression"]) == "powersgd").any():
        psgd = (np.asarray(cols["grad_compression"]) == "powersgd")[:, None]
        tp_, ep_ = (np.asarray(cols[k], dtype=float) for k in (AX.TP, AX.EP))
        _, sides = matrix_elements(a.lay, tp_, ep_)
        factors = 4.0 * col(cols["compression_rank"]) * C.sum(sides)
        g = g + np.where(psgd, 4.0 * plocal + factors, 0.0)
    parts = {"weights": w, "grads": g, "optimizer": o, "activations": acts, "transient": transient,
             "overhead": np.broadcast_to(overhead, plocal.shape)}
    if p.codebase_memory != 1.0:  # a calibrated codebase's own allocations (calibration.space.CODEBASE)
        parts = {k: v * p.codebase_memory for k, v in parts.items()}
    # Reserved beyond allocated (cost.reserved): rounding, the cached blocks the churning
    # allocations (activations, transients) fragment without expandable segments, more so where
    # their sizes vary within the step (several in-flight micro-batches of a pipeline, MoE), and
    # cuBLAS's workspace; then the CUDA context and NCCL's buffers, outside the allocator.
    varying = (pp > 1) | (col(cols[AX.EP]) > 1)
    layers_held = C.sum(np.ones((plocal.shape[0], len(C.slices))))
    parts["allocator"] = np.broadcast_to(
        allocator_bytes(acts + transient, layers_held, varying, family, p), plocal.shape)
    if p.optimizer_init_cache:
        # DeepSpeed's fp16 optimizer wrapper frees the tensors its flat buffers replaced without
        # emptying the cache: the reserved peak is at least its start-up mark (cost.reserved).
        init = deepspeed_init_reserved_bytes(plocal, col(a.shard), zero, a.opt.state_bytes)
        applies = (prec == "fp16") & (zero < 3) & ~flag(cols["offload_optimizer"]) & ~flag(cols["offload_params"])
        held = sum(parts[k] for k in ALLOCATED_KEYS) + parts["allocator"]
        parts["allocator"] = parts["allocator"] + np.where(applies, np.maximum(0.0, init - held), 0.0)
    parts["outside"] = np.broadcast_to(
        outside_bytes(col(cols[AX.TP]), col(cols[AX.DP]), col(cols[AX.CP]), col(cols[AX.EP]), pp, p), plocal.shape)
    # Host memory the offload takes per GPU: the optimizer states it moves (Adam's fp32 m, v, and
    # the master copy but with ZeRO-3), and with parameter offload FSDP's fp32 parameter and
    # gradient shards (FSDP2's CPUOffloadPolicy keeps both on the host).
    offp = flag(cols["offload_params"])
    opt_host = np.where(zero == 3, a.opt.state_bytes, master_bytes(prec) + a.opt.state_bytes) * plocal / np.where(
        zero >= 1, col(a.shard), 1.0)
    parts["host"] = np.where(offo, opt_host, 0.0) + np.where(offp & (zero == 3), 8.0 * plocal / col(a.shard), 0.0)
    return {k: np.where(a.valid, v, np.nan) for k, v in parts.items()}


def routed_excess(a: Assembly, p: CostParams, recomputing: np.ndarray, inflight: Any = 1.0) -> np.ndarray:
    """(rows, ranks) bytes per token and in-flight micro-batch the busiest expert-parallel rank keeps
    beyond the mean rank: the MoE layers' routed activations (LayerOps.saved_routed_*) of the layers
    it keeps whole (not recomputed: ``recomputing`` (rows, 1) says the recomputed blocks keep their
    input only), times cost.moe.memory_factor - 1 over the MoE layers it holds and the ``inflight``
    micro-batches it keeps (each an independent draw of every router)."""
    cols, lay, C, R = a.cols, a.lay, a.C, a.R
    out = np.zeros(C.shape)
    ep = np.asarray(cols[AX.EP], dtype=float)
    ids = lay.ids_where(lay.experts > 0)
    if not ids or not ((ep > 1).any() or p.moe_pad_to_capacity):
        return out
    tp = np.asarray(cols[AX.TP], dtype=float)
    sp = np.where(np.asarray(cols["sequence_parallel"], dtype=bool), tp, 1.0)
    fused = np.asarray(cols["compile"], dtype=bool) | elementwise_fused(False, p)
    scale = act_scale(cols["precision"])
    held = C.sum(np.ones((C.shape[0], len(C.slices))), ids) * inflight  # routing draws a rank keeps
    for b in ids:
        o = lay.ops[b]
        kept_rep = o.saved_routed_rep - (o.saved_combine_rep if p.moe_probs_in_activation else 0.0)
        routed = (kept_rep / (sp if o.splits else 1.0)
                  + np.where(fused, o.saved_routed_split[0], o.saved_routed_split[1]) / tp) * scale
        f = memory_factor(a.tokens[:, None], o.experts, o.top_k, ep[:, None], held, p)
        kept = C.slices[b] - np.where(recomputing, R.slices[b], 0.0)
        out += kept * (f - 1.0) * routed[:, None]
    return out


def logit_bytes(a: Assembly, b: int, p: CostParams = DEFAULT_PARAMS) -> np.ndarray:
    """(rows) bytes alive at the cross-entropy of loss layer ``b`` for one micro-batch: its logits
    (split over TP when vocabulary-parallel) at the bytes per element of the loss's kernels
    (compute.loss_kind; fp32 upcast or not, CostParams.logits_fp32). A chunked loss (Liger's fused
    linear cross-entropy) holds one chunk of ceil(vocab / hidden) at a time, at the fused bytes."""
    tp = np.asarray(a.cols[AX.TP], dtype=float)
    split = bool(a.lay.loss_split[b])
    fused = np.asarray(a.cols["fused_loss"], dtype=bool)
    kinds = {f: loss_kind(f, p) for f in (False, True)}
    torch_per = np.where((tp > 1) & split, VOCAB_PARALLEL_LOGITS_BYTES_PER_ELEM,
                         LOGITS_BYTES_PER_ELEM) if p.logits_fp32 else np.full(len(tp), BF16_LOGITS_BYTES_PER_ELEM)
    chunks = max(1.0, float(np.ceil(a.lay.vocab[b] / max(1.0, _loss_hidden(a.lay.ops[b])))))
    inplace = INPLACE_LOGITS_BYTES_PER_ELEM if p.logits_fp32 else INPLACE_16_LOGITS_BYTES_PER_ELEM
    per_kind = {"torch": torch_per, "inplace": np.full(len(tp), inplace),
                "fused": np.full(len(tp), FUSED_LOGITS_BYTES_PER_ELEM),
                "chunked": np.full(len(tp), FUSED_LOGITS_BYTES_PER_ELEM / chunks)}
    per = np.where(fused, per_kind[kinds[True]], per_kind[kinds[False]])
    return a.tokens * a.lay.vocab[b] / (tp if split else 1.0) * per


def _loss_hidden(o: Any) -> float:
    """The input width of a loss layer's output GEMM (the hidden size; Liger chunks the logits
    into ceil(vocab / hidden) pieces), or the vocabulary when it has none (one chunk)."""
    return max((float(g.k) for g in o.gemms), default=float(o.loss_vocab))


def mfu_basis(precision: str) -> str:
    """The peak MFU (and HFU) divide by, as a dtype of GPUSpec.peak_tflops: bf16 for bf16 and fp8 plans (the
    convention of Megatron, torchtitan and PaLM's MFU: fp8 runs are reported against the 16-bit peak), fp16
    for fp16, and fp32 for fp32 plans: the GPU's plain fp32 (CUDA-core) peak, not tf32's tensor cores (an
    fp32 plan's GEMMs are priced at that peak too), so an fp32 plan's MFU is not comparable with a bf16 one's."""
    return "bf16" if precision in ("bf16", "fp8") else precision


def _summary(a: Assembly, cluster: ClusterSpec, work: Workload, p: CostParams, step: np.ndarray,
             mem: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    cols = a.cols
    gpu = cluster.gpu
    tp, cp, mb = (cols[k].astype(float) for k in (AX.TP, AX.CP, "micro_batch"))
    n = cols[AX.TP] * cols[AX.PP] * cols[AX.DP] * cols[AX.CP]
    scale = tp * cp / mb * work.global_batch
    total = a.lay.total[None, :]
    model_flops = 3.0 * (total * a.q["flops"]).sum(1) * scale
    rc_flops = (total * a.lay.is_block[None, :] * a.q["rc_flops"]).sum(1) * scale
    prec = cols["precision"]
    peak = np.empty(len(prec))
    for name in np.unique(prec):  # MFU basis (mfu_basis): the 16-bit peak for bf16/fp8, else the dtype's own
        peak[prec == name] = gpu.peak(mfu_basis(str(name)))
    total_mem = np.sum([mem[k] for k in MEMORY_KEYS], axis=0)
    worst = np.nanargmax(total_mem, axis=1)
    rows = np.arange(len(worst))
    peak_gib = total_mem[rows, worst] / GiB
    fits, at_risk, oom = verdicts(peak_gib, usable_gib(cluster, p), p)
    low, high = step_band(step, cols[AX.PP], p)
    out = {"step_time_s": step, "tokens_per_s": work.tokens / step,
           "step_time_s_low": low, "step_time_s_high": high,
           "peak_memory_gib_high": memory_high(peak_gib, p), "oom_probability": oom,
           "tflops_per_gpu": model_flops / step / n / 1e12, "mfu": model_flops / step / n / peak,
           "hfu": (model_flops + rc_flops) / step / n / peak, "peak_memory_gib": peak_gib,
           "fits": fits, "at_risk": at_risk, "microbatches": a.micro,
           "num_gpus": n, "stage_memory_gib": total_mem / GiB}
    out |= {f"memory.{k}": mem[k][rows, worst] / GiB for k in MEMORY_KEYS}
    # allocated (max_memory_allocated) and reserved (max_memory_reserved) of the same rank; the
    # peak (what nvidia-smi shows, and what the verdict takes) adds the memory outside the allocator
    out["allocated_memory_gib"] = np.sum([out[f"memory.{k}"] for k in ALLOCATED_KEYS], axis=0)
    out["reserved_memory_gib"] = out["allocated_memory_gib"] + out["memory.allocator"]
    host = np.nanmax(mem["host"], axis=1) / GiB
    # the fullest GPU's offload against its share of the node's host memory (ClusterSpec.host_memory_gib)
    out |= {"host_memory_gib": host, "host_fits": host <= cluster.host_memory_per_gpu_gib}
    return out

