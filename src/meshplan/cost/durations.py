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
from meshplan.cost.memory import (
    model_state_arrays,
)
from meshplan.cost.params import DEFAULT_PARAMS, CostParams, p2p_exposed
from meshplan.cost.parts import optimizer_seconds, rank_sends, root_fsdp
from meshplan.cost.schedule import in_flight_array
from meshplan.cost.sync import reduce_bytes
from meshplan.spec.axes import AX
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload
from meshplan.spec.transformer import as_graph


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
    reserved_extra_bytes: list[float] = field(default_factory=list)
    """Per rank: what the GPU holds beyond the allocated peak (cost.reserved: the caching
    allocator's rounding, fragmentation and cuBLAS workspace, then the CUDA context and NCCL's
    buffers): the memory timeline's dashed line, the peak the cost model reports."""
    output_static_bytes: float = 0.0
    """Under ZBV: the static bytes of the output layer (output_static_bytes) listed at rank
    pp - 1, which sim.build moves to rank 0 with the V's last stage."""
    overlap_slowdown: float = 0.0
    """CostParams.overlap_slowdown: the compute a pipelined FSDP gather or reduce-scatter runs
    under is slowed by this fraction of the time they share (the per-block and end-of-step
    terms above already include it)."""
    outer_sync_s: float = 0.0
    """Per step: the exposed share of a local-sgd/diloco outer sync (one every sync_every
    steps, amortised: cost.sync.amortised_outer), after the optimizer."""
    outer_sync_full_s: float = 0.0
    """One whole outer sync (what every sync_every-th step carries)."""
    sync_every: int = 1
    straggler_s: float = 0.0
    """Per step: the expected wait for the slowest rank (cost.sync.straggler_seconds)."""
    boundary_send_s: tuple[float, ...] = ()
    """One send across each pipeline boundary j -> j + 1 (the last: pp - 1 -> 0, interleaved
    schedules only), on the link it crosses (cost.parts.boundary_sends); p2p_send_s is the first's.
    Empty: every boundary takes p2p_send_s."""

    def send_across(self, j: int) -> float:
        """One send across boundary j (mod pp)."""
        b = self.boundary_send_s
        return b[j % len(b)] if b else self.p2p_send_s


def stage_durations(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                    params: CostParams = DEFAULT_PARAMS) -> StageDurations:
    """The cost model's durations of ``plan``, kept apart by pass, stream and rank: the pieces of
    cost.batch.assemble for its one row."""
    p = params
    graph = as_graph(model, work.seq_len)
    cols = {k: np.asarray(v) if k != "stage_layers" else v for k, v in _b.plans_to_columns([plan]).items()}
    a = _b.assemble(graph, cluster, work, cols, p)
    width = a.valid.shape[1]
    zbv = plan.schedule == "zbv" and plan.pp > 1
    micro = a.micro
    end_x, end_o = _b.end_of_step(a, cluster, p)
    # FSDP's root unit: its exposed part ends the step (its hidden traffic runs between the
    # blocks' gathers; the simulator's data-parallel stream does not draw it)
    tp = cols[AX.TP].astype(float)
    end_exp, end_ovl = [], []
    for r in range(width):
        rt = (a.fwd[:, r] + a.b_in[:, r] + a.b_w[:, r] + a.terms["recompute"][:, r] + a.tp_f[:, r] + a.tp_b[:, r]
              + a.dp_f[:, r] + a.dp_b[:, r])  # the rank's exposed time per micro-batch
        rx, _ = root_fsdp(cluster, p, a.plocal[:, r] - a.blk_params[:, r], a.shard, tp, rt, micro, a.fsdp, a.per_step,
                          reduce_bytes(cols, p), a.st, cols[AX.CP].astype(float))
        end_exp.append(float(end_x[0, r] + rx[0]))
        end_ovl.append(float(end_o[0, r]))
    offo = np.asarray(cols["offload_optimizer"], dtype=bool)
    opt_t = optimizer_seconds(cluster, _b.optimizer_params(a), cols["zero"], a.shard, offo, p, a.opt)
    blk = a.lay.ids_where(a.lay.is_block)
    staged = (a.fsdp & a.per_step)[:, None]
    ag_s = np.where(staged, a.C.sum(a.ag, blk), 0)
    rs_s = np.where(staged, a.C.sum(a.rs, blk), 0)

    mem = _b.memory_parts(a, p, cluster.gpu.family)
    inflight = in_flight_array(cols[AX.PP][:, None], cols["virtual_stages"][:, None], cols["schedule"][:, None],
                               np.arange(width)[None, :], micro[:, None])
    acts = mem["activations"][0]
    per_mb = acts / inflight[0]
    frag = p.allocator_fragmentation
    static = sum(mem[k][0] for k in ("weights", "grads", "optimizer", "overhead", "transient")) - frag * acts
    moved = output_static_bytes(a, p) if zbv else 0.0
    if zbv:  # listed as if on rank pp - 1, where sim.build takes them from (module docstring)
        static[0] -= moved
        static[plan.pp - 1] += moved
    # the output layer's pass pieces at rank pp - 1 (the simulator moves them with the V's last stage)
    fwd_x, bin_x, bw_x = a.fwd_x.copy(), a.bin_x.copy(), a.bw_x.copy()
    fwd, b_in, b_w = a.fwd.copy(), a.b_in.copy(), a.b_w.copy()
    if zbv:
        last = plan.pp - 1
        for arr, x in ((fwd, fwd_x), (b_in, bin_x), (b_w, bw_x)):
            out = x[0, 0] - _first_part(a, arr is fwd, arr is b_in)
            arr[0, 0] -= out
            arr[0, last] += out
            x[0, 0] -= out
            x[0, last] += out

    est = _b.estimate_assembly(a, cluster, work, p)
    analytic = {k[5:]: float(v[0]) for k, v in est.items() if k.startswith("time.")}
    analytic["step_time_s"] = float(est["step_time_s"][0])

    def row(x: np.ndarray) -> list[float]:
        return [float(v) for v in np.broadcast_to(x, a.valid.shape)[0]]

    return StageDurations(
        pp=plan.pp, virtual_stages=plan.virtual_stages, microbatches=int(micro[0]), schedule=plan.schedule,
        fwd_s=row(fwd), bwd_input_s=row(b_in), bwd_weight_s=row(b_w), recompute_s=row(a.terms["recompute"]),
        fwd_extra_s=row(fwd_x), bwd_input_extra_s=row(bin_x), bwd_weight_extra_s=row(bw_x),
        tp_fwd_exposed_s=row(a.tp_f), tp_fwd_overlapped_s=row(a.tp_f_ovl),
        tp_bwd_exposed_s=row(a.tp_b), tp_bwd_overlapped_s=row(a.tp_b_ovl),
        dp_fwd_exposed_s=row(a.dp_f), dp_fwd_overlapped_s=row(a.dp_f_ovl),
        dp_bwd_exposed_s=row(a.dp_b), dp_bwd_overlapped_s=row(a.dp_b_ovl),
        p2p_send_s=float(np.where(cols[AX.PP] > 1, a.send, 0)[0]),
        p2p_exposed=float(p2p_exposed(p, plan.virtual_stages)),
        staged_gather_s=row(ag_s), staged_reduce_s=row(rs_s),
        end_dp_exposed_s=end_exp, end_dp_overlapped_s=end_ovl, optimizer_s=row(opt_t),
        overhead_s=p.step_overhead_s, static_bytes=[float(x) for x in static],
        reserved_extra_bytes=[float(x) for x in (mem["allocator"] + mem["outside"])[0]],
        overlap_slowdown=p.overlap_slowdown, output_static_bytes=float(moved),
        act_bytes_per_microbatch=[float(x) * (1 + frag) for x in per_mb], analytic=analytic,
        outer_sync_s=float(est["time.outer_sync"][0]), outer_sync_full_s=float(est["outer_sync_s"][0]),
        sync_every=plan.sync_every, straggler_s=float(est["time.straggler"][0]),
        boundary_send_s=tuple(float(x) for x in a.sends[0, :plan.pp]) if plan.pp > 1 else ())


def _first_part(a: _b.Assembly, fwd: bool, b_in: bool) -> float:
    """Rank 0's share of its extra pieces that belongs to the layers before the first block."""
    key = "f" if fwd else ("bi" if b_in else "bw")
    return float((a.q[key] * a.lay.prefix[None, :]).sum(1)[0])


def output_static_bytes(a: _b.Assembly, p: CostParams) -> float:
    """Bytes a pipeline rank's memory carries for holding the layers after the last block (final
    norm, output projection, loss) when pp > 1: their model states (a separate copy when
    weights are tied), pipelined FSDP's copies, and the logits' transient beyond a block's,
    times (1 + fragmentation)."""
    cols = a.cols
    lp = _b.local_params(a.lay, cols[AX.TP].astype(float), cols[AX.EP].astype(float))
    n = float((lp * a.lay.suffix[None, :]).sum(1)[0])
    plan_z, shard = int(cols["zero"][0]), float(a.shard[0])
    w, g, o, _ = model_state_arrays(n, 0.0, plan_z, shard, bool(cols["offload_params"][0]),
                                    bool(cols["offload_optimizer"][0]), float(cols[AX.DP][0] * cols[AX.CP][0]), p,
                                    str(cols["precision"][0]), opt=a.opt)
    staged = (plan_z == 3 and int(cols[AX.PP][0]) > 1  # pipelined FSDP's unsharded copies
              and (shard > 1 or bool(cols["offload_params"][0])))
    states = float(w + g + o) + ((8.0 if str(cols["precision"][0]) == "fp32" else 6.0) * n if staged else 0.0)
    logits = max((float(_b.logit_bytes(a, b, p)[0]) for b in a.lay.ids_where(a.lay.loss)), default=0.0)
    rec = str(cols["recompute"][0])
    t = float(a.tokens[0])
    block = t * float(np.max(np.where(a.lay.is_block, a.q["full"][0], 0.0))) if rec in ("full", "op") else 0.0
    return states + (1 + p.allocator_fragmentation) * max(0.0, logits - block)


def stage_totals(d: StageDurations) -> list[float]:
    """Exposed seconds of one micro-batch on each rank, as the cost model sums them (2 v sends
    per rank, one less on ranks 0 and pp - 1; under ZBV the output layer on rank 0, and 2 sends
    on ranks 0 and pp - 1)."""
    out = [d.fwd_s[r] + d.bwd_input_s[r] + d.bwd_weight_s[r] + d.recompute_s[r]
           + d.tp_fwd_exposed_s[r] + d.tp_bwd_exposed_s[r] + d.dp_fwd_exposed_s[r] + d.dp_bwd_exposed_s[r]
           + (2 * d.virtual_stages * d.p2p_send_s * d.p2p_exposed if d.pp > 1 else 0.0)
           for r in range(d.pp)]
    b = d.boundary_send_s
    wrap = d.virtual_stages > 1 and d.schedule != "zbv"
    if d.pp > 1 and b and any(b[j] != b[0] for j in range(d.pp if wrap else d.pp - 1)):
        # boundaries on different links: each rank's own sends (cost.parts.rank_sends)
        sends = rank_sends(np.asarray([b]), np.asarray([d.pp]), np.asarray([d.virtual_stages]),
                           np.asarray([d.schedule == "zbv"]), np.arange(d.pp)[None, :])[0]
        base = [t - 2 * d.virtual_stages * d.p2p_send_s * d.p2p_exposed for t in out]
        out = [base[r] + float(sends[r]) * d.p2p_exposed for r in range(d.pp)]
        if d.schedule == "zbv":
            last = d.pp - 1
            extra = d.fwd_extra_s[last] + d.bwd_input_extra_s[last] + d.bwd_weight_extra_s[last]
            out[0] += extra
            out[last] -= extra
        return out
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
