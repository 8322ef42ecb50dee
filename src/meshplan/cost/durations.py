"""Per-pass, per-stage durations of one plan, from the cost model (for the simulator).

A pure addition: it evaluates the same terms as ``batch._estimate`` (reusing its helpers and
the scalar functions of compute.py / comm.py) but keeps them apart by pass (forward,
input-gradient backward, weight-gradient backward), by stream (compute, TP/CP/EP, data
parallel, pipeline sends) and by pipeline rank, instead of summing them into a step time.
``stage_totals`` recombines them into the cost model's per-rank times, and a unit test checks
that they give ``estimate().step_time_s``: the two stay in step.

Under ZBV the cost model places the final norm, output layer and loss on rank 0 (the V's last
virtual stage). Here the per-rank step work (optimizer, gradient sync, parameter offload)
follows that placement, while the output layer's pass pieces are listed at rank pp - 1
(``*_extra_s[pp - 1]``, included in ``fwd_s[pp - 1]``, ...) and its static bytes are
``static_bytes`` minus the simulator's move: ``sim.build.spec_from_durations`` takes both
from rank pp - 1 and puts them on the last virtual stage (rank 0), as it does for any
schedule's last stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshplan.cost import batch as _b
from meshplan.cost.compute import embedding_times, output_layer_times
from meshplan.cost.memory import output_layer_static_bytes
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.schedule import in_flight_array
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload, microbatches


@dataclass(frozen=True)
class StageDurations:
    """Seconds per micro-batch per pipeline rank (lists indexed by rank) unless stated.

    ``*_extra_*``: the embedding (rank 0) and output layer + loss (last rank; under ZBV the
    simulator moves them to rank 0's second chunk) parts, which a virtual-stage split must
    not divide. Communication ``*_exposed`` is on the critical path
    of its pass (after the compute); ``*_overlapped`` runs under the pass's compute.
    """

    pp: int
    virtual_stages: int
    microbatches: int
    schedule: str
    fwd_s: list[float]
    bwd_input_s: list[float]
    bwd_weight_s: list[float]
    recompute_s: list[float]
    fwd_extra_s: list[float]
    bwd_input_extra_s: list[float]
    bwd_weight_extra_s: list[float]
    tp_fwd_exposed_s: list[float]        # TP + CP + EP (one stream), forward pass
    tp_fwd_overlapped_s: list[float]
    tp_bwd_exposed_s: list[float]        # backward (input grads + recompute)
    tp_bwd_overlapped_s: list[float]
    dp_fwd_exposed_s: list[float]        # per-block FSDP gathers (no pipeline), parameter offload
    dp_fwd_overlapped_s: list[float]
    dp_bwd_exposed_s: list[float]
    dp_bwd_overlapped_s: list[float]
    p2p_send_s: float                    # one activation (or gradient) send between stages
    p2p_exposed: float                   # fraction of a send the sender blocks on
    staged_gather_s: list[float]         # pipelined FSDP: once per step, under the first forward
    staged_reduce_s: list[float]         # ... and under the last backward
    end_dp_exposed_s: list[float]        # per step: gradient sync / gathers ending the step
    end_dp_overlapped_s: list[float]     # ... the part hidden under the last backward
    optimizer_s: list[float]
    overhead_s: float
    static_bytes: list[float]            # memory that does not vary within the step
    act_bytes_per_microbatch: list[float]  # activations one micro-batch leaves on a rank (+ fragmentation)
    analytic: dict[str, float] = field(default_factory=dict)
    """The cost model's own per-step terms (time.* of estimate_batch, step_time_s)."""
    overlap_slowdown: float = 0.0
    """CostParams.overlap_slowdown: the compute a pipelined FSDP gather or reduce-scatter runs
    under is slowed by this fraction of the time they share (the per-block and end-of-step
    terms above already include it)."""


def stage_durations(model: ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                    params: CostParams = DEFAULT_PARAMS) -> StageDurations:
    """The cost model's durations of ``plan``, kept apart by pass, stream and rank."""
    p, m_ = params, model
    cols = {k: np.asarray(v) if k != "stage_layers" else v for k, v in _b.plans_to_columns([plan]).items()}
    tp, pp, dp, cp, ep = (cols[k].astype(float) for k in ("tp", "pp", "dp", "cp", "ep"))
    zero = cols["zero"]
    shard = _b._shard(cols)
    micro = microbatches(work.global_batch, cols["dp"], cols["micro_batch"])
    tokens = cols["micro_batch"].astype(float) * work.seq_len / cp
    blk = _b._blocks(model, cluster, work, cols, p)
    layers = _b._stage_layers(model, cols)
    width = layers.shape[1]
    j = np.arange(width)[None, :]
    valid, first, last = j < pp[:, None], j == 0, j == (pp[:, None] - 1)
    zbv = plan.schedule == "zbv" and plan.pp > 1
    held = _b.output_stage(pp, cols["schedule"] == "zbv", j)  # the output layer's parameters: rank 0 under ZBV
    emb = embedding_times(model, plan, work.seq_len, cluster.gpu, p)
    out = output_layer_times(model, plan, work.seq_len, cluster.gpu, p)

    def col(x: object) -> np.ndarray:
        return np.asarray(x, dtype=float)[:, None]

    full_rc = cols["recompute"] == "full"
    rl = cols["recompute_layers"]
    rc_layers = np.where(full_rc[:, None] & (rl[:, None] >= 0), np.minimum(layers, rl[:, None]), layers)
    bw = col(blk.bw)
    bin_ = col(blk.b) - bw
    fwd_x = first * emb.fwd_s + last * out.fwd_s
    bin_x = first * emb.bwd_input_s + last * out.bwd_input_s
    bw_x = first * emb.bwd_weight_s + last * out.bwd_weight_s
    fwd = layers * col(blk.f) + fwd_x
    b_in = layers * bin_ + bin_x
    b_w = layers * bw + bw_x
    recompute = rc_layers * col(blk.rc)

    async_f = col(np.where(cols["async_tp"], p.tp_exposed_async, 1.0))
    c = _b._comm(m_, cluster, cols, p, blk, tokens, shard)
    tp_fwd = layers * col(2 * c.tp_one)
    tp_bwd = (layers - rc_layers) * col(2 * c.tp_one) + rc_layers * col(np.where(full_rc, 4, 2) * c.tp_one)
    cp_t, cp_exp, ep_t = c.cp, c.cp_exposed, c.ep
    share_f = blk.f / np.maximum(1e-30, blk.f + blk.b)
    tp_f_exp = tp_fwd * async_f + layers * col(cp_exp * share_f + ep_t / 2)
    tp_b_exp = tp_bwd * async_f + layers * col(cp_exp * (1 - share_f) + ep_t / 2)
    tp_f_ovl = tp_fwd * (1 - async_f) + layers * col((cp_t - cp_exp) * share_f)
    tp_b_ovl = tp_bwd * (1 - async_f) + layers * col((cp_t - cp_exp) * (1 - share_f))

    lp, ag, rs, fsdp, per_step = c.lp, c.ag, c.rs, c.fsdp, c.per_step
    f_exp, b_exp = c.fwd_exposed, c.bwd_exposed
    blocked = fsdp & ~per_step
    f_ovl = np.where(blocked, ag - f_exp, 0)
    b_ovl = np.where(blocked, ag + rs - b_exp, 0)

    plocal = _b._stage_params(m_, layers, valid, first, held, tp, lp)
    offload = _b._offload(cols, plocal, shard, p)
    dp_f_exp = layers * col(f_exp) + offload / 2
    dp_b_exp = layers * col(b_exp) + offload / 2

    send = float(np.where(pp > 1, c.send, 0)[0])

    staged = fsdp & per_step
    ag_s = np.where(staged[:, None], layers * col(ag), 0)
    rs_s = np.where(staged[:, None], layers * col(rs), 0)

    # End of step, per rank with the rank's own parameters (the cost model takes the fullest).
    end_exp, end_ovl = [], []
    for r in range(width):
        ea, oa = _b._dp_end_of_step(cluster, cols, p, tp, dp, cp, shard, lp, plocal[:, r],
                                    (fwd[:, 0] + b_in[:, 0] + b_w[:, 0]) / 2, micro)
        rt = (fwd[:, r] + b_in[:, r] + b_w[:, r] + recompute[:, r] + tp_f_exp[:, r] + tp_b_exp[:, r]
              + dp_f_exp[:, r] + dp_b_exp[:, r])  # the rank's exposed time per micro-batch
        # FSDP's root unit: its exposed part ends the step (its hidden traffic runs between the
        # blocks' gathers; the simulator's data-parallel stream does not draw it)
        rx, _ = _b.root_fsdp(cluster, p, plocal[:, r] - layers[:, r] * lp, shard, tp, rt, micro, fsdp, per_step)
        e, o = float(ea[0] + rx[0]), float(oa[0])
        if plan.pp > 1 and m_.tied_embeddings and not zbv and r in (0, width - 1):  # zbv: one rank holds both
            e += float(_b.tied_sync(cluster, m_, tp, cp, dp, shard, p)[0])
        end_exp.append(e)
        end_ovl.append(o)
    opt_t = _b.optimizer_seconds(cluster, plocal, zero, shard, np.asarray(cols["offload_optimizer"], dtype=bool), p)

    mem = _b._memory(model, work, cols, p, layers, valid, first, held, plocal, lp, shard, tokens, blk, micro)
    inflight = in_flight_array(col(cols["pp"]), col(cols["virtual_stages"]), cols["schedule"][:, None],
                               np.arange(width)[None, :], micro[:, None])
    acts = mem["activations"][0]
    per_mb = acts / inflight[0]
    frag = p.allocator_fragmentation
    static = sum(mem[k][0] for k in ("weights", "grads", "optimizer", "overhead", "transient")) - frag * acts
    if zbv:  # listed as if on rank pp - 1, where sim.build takes them from (module docstring)
        moved = output_layer_static_bytes(model, plan, work, p)
        static[0] -= moved
        static[plan.pp - 1] += moved

    est = _b.estimate_batch(model, cluster, work, [plan], p)
    analytic = {k[5:]: float(v[0]) for k, v in est.items() if k.startswith("time.")}
    analytic["step_time_s"] = float(est["step_time_s"][0])

    def row(a: np.ndarray) -> list[float]:
        return [float(x) for x in np.broadcast_to(a, layers.shape)[0]]

    return StageDurations(
        pp=plan.pp, virtual_stages=plan.virtual_stages, microbatches=int(micro[0]), schedule=plan.schedule,
        fwd_s=row(fwd), bwd_input_s=row(b_in), bwd_weight_s=row(b_w), recompute_s=row(recompute),
        fwd_extra_s=row(fwd_x), bwd_input_extra_s=row(bin_x), bwd_weight_extra_s=row(bw_x),
        tp_fwd_exposed_s=row(tp_f_exp), tp_fwd_overlapped_s=row(tp_f_ovl),
        tp_bwd_exposed_s=row(tp_b_exp), tp_bwd_overlapped_s=row(tp_b_ovl),
        dp_fwd_exposed_s=row(dp_f_exp), dp_fwd_overlapped_s=row(layers * col(f_ovl)),
        dp_bwd_exposed_s=row(dp_b_exp), dp_bwd_overlapped_s=row(layers * col(b_ovl)),
        p2p_send_s=send, p2p_exposed=p.pp_p2p_exposed,
        staged_gather_s=row(ag_s), staged_reduce_s=row(rs_s),
        end_dp_exposed_s=end_exp, end_dp_overlapped_s=end_ovl, optimizer_s=row(opt_t),
        overhead_s=p.step_overhead_s, static_bytes=[float(x) for x in static],
        overlap_slowdown=p.overlap_slowdown,
        act_bytes_per_microbatch=[float(x) * (1 + frag) for x in per_mb], analytic=analytic)


def stage_totals(d: StageDurations) -> list[float]:
    """Exposed seconds of one micro-batch on each rank, as the cost model sums them (2 v sends
    per rank, one less on ranks 0 and pp - 1; under ZBV the output layer on rank 0, and 2 sends
    on ranks 0 and pp - 1)."""
    out = [d.fwd_s[r] + d.bwd_input_s[r] + d.bwd_weight_s[r] + d.recompute_s[r]
           + d.tp_fwd_exposed_s[r] + d.tp_bwd_exposed_s[r] + d.dp_fwd_exposed_s[r] + d.dp_bwd_exposed_s[r]
           + (2 * d.virtual_stages * d.p2p_send_s * d.p2p_exposed if d.pp > 1 else 0.0)
           for r in range(d.pp)]
    if d.schedule == "zbv" and d.pp > 1:
        last = d.pp - 1
        extra = d.fwd_extra_s[last] + d.bwd_input_extra_s[last] + d.bwd_weight_extra_s[last]
        out[0] += extra
        out[last] -= extra
        for r in (0, last):
            out[r] -= (2 * d.virtual_stages - 2) * d.p2p_send_s * d.p2p_exposed
    elif d.pp > 1:
        for r in (0, d.pp - 1):
            out[r] -= d.p2p_send_s * d.p2p_exposed
    return out
