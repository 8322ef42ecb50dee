"""Per-pass, per-rank, per-stream durations of a plan on a layer graph (for the simulator).

    graph_stage_durations(graph, cluster, plan, work, params=None) -> GraphStageDurations

The layer-graph twin of ``cost.durations.stage_durations``: the same ``StageDurations`` fields,
with the same meaning, taken from ``cost.graph``'s own pieces (layer_costs, stage_sums,
boundary_sends, the FSDP/optimizer/memory helpers of finish) without summing them. It adds
what a graph has and a transformer stack does not:

- ``chunks``: the same durations per model chunk (pipeline virtual stage, model order), each
  the sum over the chunk's own layers. A graph's chunks are uneven (an embedding, a head, unequal
  blocks), so the simulator takes them as they are instead of dividing a rank's total by v.
- ``p2p_rank_s``: the cost model's exposed pipeline-send seconds per micro-batch per rank (one
  send per boundary and direction, each of the boundary layer's own size). ``p2p_send_s`` is the
  mean send over the boundaries that cross ranks: the simulator has one send size per pipeline.
- ``loss_fwd_s`` / ``loss_bwd_s``, ``w_frac``, ``tied_sync_s`` / ``tied_ranks``: what
  ``graph_analytic_step_time`` needs to recombine the durations into estimate_graph's step.

``graph_analytic_step_time`` recombines them with the closed-form schedule exactly as
``cost.graph.finish`` does; a unit test checks it equals ``estimate_graph().step_time_s``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshplan.cost import batch as _b
from meshplan.cost.comm import staged_fsdp_exposed
from meshplan.cost.durations import StageDurations
from meshplan.cost.graph import (
    TIME_KEYS,
    boundary_sends,
    check_graph,
    chunk_passes,
    finish_plan,
    fsdp_layer_exposed,
    fsdp_layer_traffic,
    graph_arrays,
    layer_costs,
    make_layout,
    memory_parts,
    plan_sums,
    recompute_mask,
    tied_sync_seconds,
)
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.schedule import SPLIT_BACKWARD, bubble_array
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.plan import Plan, Workload


@dataclass(frozen=True)
class ChunkDurations:
    """Seconds per micro-batch of one model chunk (virtual stage) on its rank; fields as in
    StageDurations. ``fwd_s`` / ``bwd_input_s`` include the loss on the chunk of the last layer."""

    rank: int
    first_layer: int
    end_layer: int                       # exclusive
    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    recompute_s: float
    tp_fwd_exposed_s: float
    tp_fwd_overlapped_s: float
    tp_bwd_exposed_s: float
    tp_bwd_overlapped_s: float
    dp_fwd_exposed_s: float              # per-layer FSDP gathers (no pipeline), parameter offload
    dp_fwd_overlapped_s: float
    dp_bwd_exposed_s: float
    dp_bwd_overlapped_s: float
    act_bytes: float                     # activations one micro-batch leaves (+ fragmentation)
    send_s: float                        # one send to the next chunk (0: last chunk, or the same rank)


@dataclass(frozen=True)
class GraphStageDurations(StageDurations):
    """StageDurations of a plan on a layer graph, with its chunks and the terms the
    closed-form recombination needs (see the module docstring)."""

    chunks: tuple[ChunkDurations, ...] = ()
    p2p_rank_s: list[float] = field(default_factory=list)
    loss_fwd_s: list[float] = field(default_factory=list)
    loss_bwd_s: list[float] = field(default_factory=list)
    w_frac: float = 0.0
    tied_sync_s: float = 0.0
    tied_ranks: tuple[int, ...] = ()


def graph_stage_durations(graph: LayerGraph, cluster: ClusterSpec, plan: Plan, work: Workload,
                          params: CostParams | None = None) -> GraphStageDurations:
    """estimate_graph's durations of ``plan``, kept apart by pass, stream, chunk and rank.

    Raises MeshplanError (one line) when the plan cannot run on the graph."""
    p = DEFAULT_PARAMS if params is None else params
    check_graph(graph, cluster, plan, work)
    ga = graph_arrays(graph)
    lay = make_layout(graph.num_layers, plan.pp, plan.virtual_stages, plan.schedule, plan.stage_layers)
    lc = layer_costs(graph, ga, cluster, plan.tp, plan.micro_batch, plan.precision, plan.fused_loss, p)
    s = plan_sums(graph, ga, cluster, plan, lay, p, lc)
    r = finish_plan(cluster, work, plan, s, p)
    pp, tp, dp, cp = s.pp, plan.tp, plan.dp, plan.cp
    nch = len(lay.stage_layers)
    chunk_of = np.repeat(np.arange(nch), lay.stage_layers)
    last_chunk = int(chunk_of[-1])

    def by_chunk(x: np.ndarray) -> np.ndarray:
        return np.bincount(chunk_of, weights=np.asarray(x, dtype=float), minlength=nch)

    def by_rank(x: np.ndarray) -> np.ndarray:
        return np.bincount(lay.chunk_rank, weights=x, minlength=pp)

    # Compute per layer; the loss on the last layer (its forward share, the rest backward).
    rc_mask = recompute_mask(lay, plan.recompute, plan.recompute_layers)
    loss_f = lc.loss_s * lc.loss_fwd_share
    loss_b = lc.loss_s - loss_f
    at_loss = np.arange(nch) == last_chunk
    fwd = by_chunk(lc.f) + at_loss * loss_f
    b_in = by_chunk(lc.b - lc.bw) + at_loss * loss_b
    b_w = by_chunk(lc.bw)
    rc = by_chunk(np.where(rc_mask, lc.rc, 0.0))

    # TP: one all-reduce set forward, one backward, one more in the recomputed forward.
    a = p.tp_exposed_async if plan.async_tp else 1.0
    tp_f = lc.tp2 / 2
    tp_b = np.where(rc_mask, lc.tp3, lc.tp2) - tp_f
    tp_f_exp, tp_b_exp = by_chunk(tp_f * a), by_chunk(tp_b * a)
    tp_f_ovl, tp_b_ovl = by_chunk(tp_f - tp_f * a), by_chunk(tp_b - tp_b * a)

    # FSDP per layer (no pipeline), parameter offload (half before the forward, half before the backward).
    zero = np.array([plan.zero])
    shard = np.array([plan.effective_shard], dtype=float)
    fsdp, per_step = plan.zero == 3 and plan.effective_shard > 1, plan.zero == 3 and pp > 1
    ag, rs = (x[0] for x in fsdp_layer_traffic(cluster, s, shard, tp, p))
    fe, be = (x[0] for x in fsdp_layer_exposed(ag[None, :], rs[None, :], s, p))
    blocked = fsdp and not per_step
    zeros = np.zeros(graph.num_layers)
    dp_f_exp = by_chunk(fe if blocked else zeros)
    dp_b_exp = by_chunk(be if blocked else zeros)
    dp_f_ovl = by_chunk(ag - fe if blocked else zeros)
    dp_b_ovl = by_chunk(ag + rs - be if blocked else zeros)
    chunk_params = by_chunk(lc.lp) + at_loss * s.tied_local
    offload = _b._offload({"offload_params": np.array([plan.offload_params])}, chunk_params[None, :], shard, p)[0]
    dp_f_exp, dp_b_exp = dp_f_exp + offload / 2, dp_b_exp + offload / 2

    # Pipeline sends: one per boundary between chunks on different ranks.
    sends = np.zeros(nch)
    if pp > 1:
        _, _, t, moved = boundary_sends(cluster, lc, lay, tp=tp, cp=cp, dp=dp, p2p_sharded=plan.p2p_sharded)
        sends[:-1] = np.where(moved, t, 0.0)
    crossing = sends[sends > 0]
    mean_send = float(crossing.mean()) if len(crossing) else 0.0

    # Activations per micro-batch and static memory per rank (the cost model's pieces).
    frag = p.allocator_fragmentation
    kept = by_chunk(np.where(rc_mask, lc.inp, lc.saved))
    plocal = s.plocal[None, :]
    micro = int(r["microbatches"][0])
    mem = memory_parts(cluster, s, plocal, dp=dp, cp=cp, micro=micro, schedule=plan.schedule,
                       v=plan.virtual_stages, zero=zero, shard=shard,
                       offload_params=np.array([plan.offload_params]),
                       offload_optimizer=np.array([plan.offload_optimizer]), params=p)
    static = sum(np.broadcast_to(mem[k], (1, pp))[0] for k in ("weights", "grads", "optimizer", "transient",
                                                                 "overhead"))
    static = static - frag * np.broadcast_to(mem["activations"], (1, pp))[0]

    # Once per step, per rank: pipelined FSDP, the data-parallel sync of the rank's own
    # parameters (+ the tied weights' all-reduce on the two ranks holding them), the optimizer.
    staged = fsdp and per_step
    gather = by_rank(by_chunk(ag)) if staged else np.zeros(pp)
    reduce = by_rank(by_chunk(rs)) if staged else np.zeros(pp)
    cols = {"zero": zero, "pp": np.full(1, pp), "grad_sync": np.asarray([plan.grad_sync])}
    one = np.ones(1)
    tied = tied_sync_seconds(cluster, s, tp=tp, cp=cp, dp=dp)
    tied_ranks = (0, int(lay.rank[-1])) if tied else ()
    end_exp, end_ovl = [], []
    for k in range(pp):
        e, o = _b._dp_end_of_step(cluster, cols, p, tp * one, dp * one, cp * one, shard, s.first_lp * one,
                                  s.plocal[k] * one, s.compute[0] / 2 * one, micro)
        end_exp.append(float(e[0]) + (tied if k in tied_ranks else 0.0))
        end_ovl.append(float(o[0]))
    opt = _b.optimizer_seconds(cluster, plocal, zero, shard, np.array([plan.offload_optimizer]), p)[0]

    chunks = tuple(ChunkDurations(
        rank=int(lay.chunk_rank[c]), first_layer=int(lay.chunk_end[c] - lay.stage_layers[c]),
        end_layer=int(lay.chunk_end[c]), fwd_s=float(fwd[c]), bwd_input_s=float(b_in[c]), bwd_weight_s=float(b_w[c]),
        recompute_s=float(rc[c]), tp_fwd_exposed_s=float(tp_f_exp[c]), tp_fwd_overlapped_s=float(tp_f_ovl[c]),
        tp_bwd_exposed_s=float(tp_b_exp[c]), tp_bwd_overlapped_s=float(tp_b_ovl[c]),
        dp_fwd_exposed_s=float(dp_f_exp[c]), dp_fwd_overlapped_s=float(dp_f_ovl[c]),
        dp_bwd_exposed_s=float(dp_b_exp[c]), dp_bwd_overlapped_s=float(dp_b_ovl[c]),
        act_bytes=float(kept[c] * (1 + frag)), send_s=float(sends[c])) for c in range(nch))

    # Extras: the layers pinned to the first and last chunk (embeddings, heads) and the loss.
    pinned = (np.arange(graph.num_layers) < ga.prefix) | (np.arange(graph.num_layers) >= ga.suffix)
    loss_rank = np.arange(pp) == int(lay.rank[-1])

    def rank_list(x: np.ndarray) -> list[float]:
        return [float(v) for v in x]

    def pinned_rank(x: np.ndarray) -> np.ndarray:
        return by_rank(by_chunk(np.where(pinned, x, 0.0)))

    analytic = {k: float(r[f"time.{k}"][0]) for k in TIME_KEYS}
    analytic["step_time_s"] = float(r["step_time_s"][0])
    return GraphStageDurations(
        pp=pp, virtual_stages=plan.virtual_stages, microbatches=micro, schedule=plan.schedule,
        fwd_s=rank_list(by_rank(fwd)), bwd_input_s=rank_list(by_rank(b_in)), bwd_weight_s=rank_list(by_rank(b_w)),
        recompute_s=rank_list(by_rank(rc)),
        fwd_extra_s=rank_list(pinned_rank(lc.f) + loss_rank * loss_f),
        bwd_input_extra_s=rank_list(pinned_rank(lc.b - lc.bw) + loss_rank * loss_b),
        bwd_weight_extra_s=rank_list(pinned_rank(lc.bw)),
        tp_fwd_exposed_s=rank_list(by_rank(tp_f_exp)), tp_fwd_overlapped_s=rank_list(by_rank(tp_f_ovl)),
        tp_bwd_exposed_s=rank_list(by_rank(tp_b_exp)), tp_bwd_overlapped_s=rank_list(by_rank(tp_b_ovl)),
        dp_fwd_exposed_s=rank_list(by_rank(dp_f_exp)), dp_fwd_overlapped_s=rank_list(by_rank(dp_f_ovl)),
        dp_bwd_exposed_s=rank_list(by_rank(dp_b_exp)), dp_bwd_overlapped_s=rank_list(by_rank(dp_b_ovl)),
        p2p_send_s=mean_send, p2p_exposed=p.pp_p2p_exposed,
        staged_gather_s=rank_list(gather), staged_reduce_s=rank_list(reduce),
        end_dp_exposed_s=end_exp, end_dp_overlapped_s=end_ovl, optimizer_s=rank_list(opt),
        overhead_s=p.step_overhead_s, static_bytes=rank_list(static), overlap_slowdown=p.overlap_slowdown,
        act_bytes_per_microbatch=rank_list(by_rank(kept) * (1 + frag)), analytic=analytic,
        chunks=chunks, p2p_rank_s=rank_list(s.p2p), loss_fwd_s=rank_list(loss_rank * loss_f),
        loss_bwd_s=rank_list(loss_rank * loss_b), w_frac=s.w_frac, tied_sync_s=tied, tied_ranks=tied_ranks)


def graph_stage_totals(d: GraphStageDurations) -> list[float]:
    """Exposed seconds of one micro-batch on each rank, as cost.graph.finish sums them."""
    return [d.fwd_s[r] + d.bwd_input_s[r] + d.bwd_weight_s[r] + d.recompute_s[r]
            + d.tp_fwd_exposed_s[r] + d.tp_bwd_exposed_s[r] + d.dp_fwd_exposed_s[r] + d.dp_bwd_exposed_s[r]
            + d.p2p_rank_s[r] for r in range(d.pp)]


def graph_analytic_step_time(d: GraphStageDurations) -> float:
    """The durations recombined with the closed-form schedule, as cost.graph.finish does:
    m x the slowest rank's micro-batch + the bubble (zero-bubble and ZBV: from each rank's F, B,
    W passes and ZBV's chunks, ``cost.graph.chunk_passes``) + the end-of-step data-parallel
    terms (the fullest rank's sync, the tied weights' all-reduce, pipelined FSDP's traffic not
    hidden under one micro-batch of the slowest rank, the reduce-scatter under its last W pass
    when the backward is split) + the slowest optimizer step + the overhead."""
    t = graph_stage_totals(d)
    crit = int(np.argmax(t))
    split = d.schedule in SPLIT_BACKWARD and d.pp > 1
    if split:
        ch, x = d.chunks, d.p2p_exposed  # each send with the pass that sends it (F: activation, B: gradient)
        fwd = [c.fwd_s + c.tp_fwd_exposed_s + c.dp_fwd_exposed_s + x * c.send_s for c in ch]
        bwd = [c.bwd_input_s + c.recompute_s + c.tp_bwd_exposed_s + c.dp_bwd_exposed_s
               + (x * ch[k - 1].send_s if k else 0.0) for k, c in enumerate(ch)]
        passes = chunk_passes(np.array([fwd]), np.array([bwd]), np.array([[c.bwd_weight_s for c in ch]]),
                              np.array([c.rank for c in ch]), np.array([t]), d.schedule == "zbv")
        bubble = float(bubble_array(np.array([sum(t)]), np.array([t[crit]]), d.pp, d.virtual_stages,
                                    np.asarray(d.schedule), d.w_frac, d.microbatches, passes)[0])
    else:
        bubble = float(bubble_array(sum(t), t[crit], d.pp, d.virtual_stages, np.asarray(d.schedule), d.w_frac))
    end = max(e - (d.tied_sync_s if r in d.tied_ranks else 0.0) for r, e in enumerate(d.end_dp_exposed_s))
    f_c = d.fwd_s[crit] - d.loss_fwd_s[crit]
    b_c = d.bwd_input_s[crit] + d.bwd_weight_s[crit] + d.recompute_s[crit] - d.loss_bwd_s[crit]
    if split:  # the rank's last W pass hides the reduce-scatter (ZBV: its first chunk's, model chunk crit)
        b_c = d.chunks[crit].bwd_weight_s if d.schedule == "zbv" else d.bwd_weight_s[crit]
    staged = float(staged_fsdp_exposed(d.staged_gather_s[crit], f_c, d.staged_reduce_s[crit], b_c, d.pp, split,
                                       d.overlap_slowdown))
    return (d.microbatches * t[crit] + bubble + end + d.tied_sync_s + staged + max(d.optimizer_s)
            + d.overhead_s)
