"""Discrete-event simulation of one training step on every pipeline rank.

Each rank has four streams: ``compute``, ``tp`` (TP/CP/EP collectives), ``dp`` (data-parallel
and FSDP traffic, parameter offload) and ``pp`` (pipeline sends). Work on one stream
serialises (two transfers sharing a link queue); streams of a rank run concurrently. Each
rank runs its passes in the schedule's order (sim.schedules); a pass starts when the compute
stream is free and its inputs have arrived:

- F(i) on virtual stage s waits for F(i) on s-1 and its send; B(i) on s waits for F(i) on s
  and for B(i) on s+1 and its send; W(i) waits for B(i). Neighbouring stages on the same
  rank (ZBV's turn of the V) hand over without a send.
- A pass = compute; communication hidden under it starts with it on its stream; exposed
  communication follows the compute (the compute stream waits); then the send to the
  neighbouring stage (the sender blocks for ``p2p_exposed`` of it, the receiver for all).
- Pipelined FSDP gathers a rank's parameters once, under its first forward, and
  reduce-scatters once, from the pass that completes its weight gradients (the last B, or
  the last W when the schedule splits them); data-parallel gradient sync follows the rank's
  last pass (hidden under it as far as the cost model says it overlaps), then the optimizer
  step. The step ends when the slowest rank is done, plus the fixed overhead.

Durations per pass come from the cost model (``cost.durations``); the simulator adds the
timing structure: the schedule's real order, per-rank end of step, stream contention.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from meshplan.errors import MeshplanError
from meshplan.sim.schedules import SPLIT_W, Op, rank_chunk, rank_orders, stage_of
from meshplan.spec.axes import AX

STREAMS = ("compute", AX.TP, AX.DP, AX.PP)


@dataclass(frozen=True)
class Pass:
    """One pass of one micro-batch on one virtual stage: seconds per stream part."""

    compute: float
    tp_overlapped: float = 0.0
    tp_exposed: float = 0.0
    dp_overlapped: float = 0.0
    dp_exposed: float = 0.0


@dataclass(frozen=True)
class VStage:
    """A virtual pipeline stage, in model order (sim.schedules.stage_of places it on a rank)."""

    fwd: Pass
    bwd: Pass           # input gradients + recompute (+ weight gradients if not split)
    wgt: Pass           # weight gradients (run as W by zero-bubble and ZBV)
    act_bytes: float = 0.0  # activation bytes one micro-batch leaves on the rank


@dataclass(frozen=True)
class RankStep:
    """Once-per-step work of one pipeline rank."""

    staged_gather_s: float = 0.0
    staged_reduce_s: float = 0.0
    end_dp_exposed_s: float = 0.0
    end_dp_overlapped_s: float = 0.0
    optimizer_s: float = 0.0
    static_bytes: float = 0.0
    reserved_extra_bytes: float = 0.0
    """What the caching allocator reserves beyond the allocated level (cost.reserved)."""


@dataclass(frozen=True)
class SimSpec:
    pp: int
    v: int
    microbatches: int
    schedule: str
    stages: list[VStage]          # pp * v virtual stages, in model order
    ranks: list[RankStep]         # pp ranks
    send_s: float = 0.0
    send_exposed: float = 1.0
    overhead_s: float = 0.0
    overlap_slowdown: float = 0.0
    """Compute under a rank's once-per-step FSDP gather or reduce-scatter runs slower by this
    fraction of the time they share (cost.comm.exposed_under)."""
    straggler_s: float = 0.0
    """Expected wait per step for the slowest rank of the sync (drawn on every rank's compute
    stream after its optimizer step)."""
    outer_sync_s: float = 0.0
    """Exposed share per step of a local-sgd/diloco outer sync, amortised over sync_every steps
    (drawn on every rank's data-parallel stream after the straggler wait)."""
    outer_sync_full_s: float = 0.0
    sync_every: int = 1
    boundary_send_s: tuple[float, ...] = ()
    """One send across each pipeline boundary j -> j + 1 (mod pp) on the link it crosses; empty:
    every boundary takes send_s."""
    mb_stages: list[list[VStage]] | None = None
    """Per micro-batch, its own pp * v virtual stages (micro-batches of different lengths:
    sim.varlen); None: every micro-batch runs ``stages``."""


@dataclass(frozen=True)
class Event:
    rank: int
    stream: str
    name: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


@dataclass
class SimResult:
    step_time_s: float
    events: list[Event]
    memory: list[list[tuple[float, float]]]   # per rank: (time s, bytes) steps
    pp: int
    wait_s: list[float]                       # per rank: compute idle waiting for inputs
    rank_label: str = "pp rank"
    reserved_extra: list[float] = field(default_factory=list)
    """Per rank: bytes the caching allocator reserves beyond the allocated peak (cost.reserved)."""

    def reserved(self, rank: int) -> list[tuple[float, float]]:
        """The reserved memory of ``rank`` over a steady-state step: (time s, bytes) steps. The
        caching allocator keeps freed blocks (torch.cuda.empty_cache aside), so from the second
        step on it holds the step's allocated peak plus reserved_extra throughout."""
        extra = self.reserved_extra[rank] if rank < len(self.reserved_extra) else 0.0
        level = max(b for _, b in self.memory[rank]) + extra
        return [(0.0, level), (self.step_time_s, level)]
    """What a row of the timeline is ('pp rank'; 'dp x cp rank' for a bucket plan's ranks)."""

    def busy(self, rank: int, stream: str) -> float:
        """Seconds the stream works (the expected straggler wait, drawn on the compute stream, is not work)."""
        return sum(e.end - e.start for e in self.events
                   if e.rank == rank and e.stream == stream and e.name != "straggler wait"
                   and not e.name.startswith("waits for the slowest pool"))

    def summary(self) -> dict:
        t = self.step_time_s
        ranks = []
        for r in range(self.pp):
            busy = {s: self.busy(r, s) for s in STREAMS}
            ranks.append({"rank": r, "busy_s": busy, "idle_s": {s: t - b for s, b in busy.items()},
                          "pipeline_wait_s": self.wait_s[r],
                          "straggler_wait_s": sum(e.end - e.start for e in self.events
                                                  if e.rank == r and e.name == "straggler wait"),
                          "allocated_memory_gib": max(b for _, b in self.memory[r]) / 2**30,
                          "peak_memory_gib": self.reserved(r)[0][1] / 2**30})
        return {"step_time_s": t, "bubble_fraction": sum(self.wait_s) / (self.pp * t) if t > 0 else 0.0,
                "ranks": ranks, "events": len(self.events)}


def run(spec: SimSpec) -> SimResult:
    """Run the step of ``spec``; raises MeshplanError if the schedule deadlocks (a bug, not a user error)."""
    pp, v, m = spec.pp, spec.v, spec.microbatches
    sched = spec.schedule
    split_w = sched in SPLIT_W and pp > 1  # B = input gradients, W = weight gradients (in the order)
    orders = rank_orders(sched, pp, m, v)
    nvs = pp * v
    free = [dict.fromkeys(STREAMS, 0.0) for _ in range(pp)]
    ready: dict[tuple[str, int, int], float] = {}   # (kind, mb, vstage) -> inputs available downstream
    done: dict[tuple[str, int, int], float] = {}    # (kind, mb, vstage) -> pass end on its rank
    idx = [0] * pp
    wait = [0.0] * pp
    events: list[Event] = []
    mem_deltas: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    # Passes that complete weight gradients, per rank: the reduce-scatter follows the last one.
    wg_kind = "W" if split_w else "B"
    wg_left = [sum(op[0] == "B" for op in o) for o in orders]

    def put(r: int, stream: str, name: str, start: float, dur: float, **args: object) -> float:
        if dur <= 0:  # nothing to send: no wait for the stream
            return start
        start = max(start, free[r][stream])
        end = start + dur
        events.append(Event(r, stream, name, start, end, dict(args)))
        free[r][stream] = end
        return end

    def deps(op: Op, s: int) -> list[float] | None:
        kind, i, _ = op
        keys = []
        if kind == "F" and s > 0:
            keys.append(("Fs", i, s - 1))
        if kind == "B":
            keys.append(("F", i, s))
            if s < nvs - 1:
                keys.append(("Bs", i, s + 1))
        if kind == "W":
            keys.append(("B", i, s))
        out = []
        for k in keys:
            t = ready.get(k) if k[0].endswith("s") else done.get(k)
            if t is None:
                return None
            out.append(t)
        return out

    # Pipelined FSDP: each rank gathers its stage's parameters once, from the start of the step
    # (layer by layer, overlapping its first forward; ranks downstream gather while they wait).
    gathered = [put(r, AX.DP, "fsdp all-gather", 0.0, spec.ranks[r].staged_gather_s) for r in range(pp)]

    def run(r: int, op: Op, ts: list[float]) -> None:
        kind, i, c = op
        s = stage_of(sched, pp, r, c)
        st = (spec.stages if spec.mb_stages is None else spec.mb_stages[i])[s]
        ps = {"F": st.fwd, "B": st.bwd, "W": st.wgt}[kind]
        if kind == "B" and not split_w:
            ps = Pass(st.bwd.compute + st.wgt.compute, st.bwd.tp_overlapped + st.wgt.tp_overlapped,
                      st.bwd.tp_exposed + st.wgt.tp_exposed, st.bwd.dp_overlapped + st.wgt.dp_overlapped,
                      st.bwd.dp_exposed + st.wgt.dp_exposed)
        t0 = max([free[r]["compute"], *ts])
        wait[r] += t0 - free[r]["compute"]
        name = f"{kind}{i}" + (f".{c}" if v > 1 else "")
        end = t0 + ps.compute
        a = spec.overlap_slowdown
        if a and kind != "W" and idx[r] == 0:  # the step's gather runs under the first forward
            end += a * max(0.0, min(end, gathered[r]) - t0)
        if a and kind == wg_kind and wg_left[r] == 1:  # ... the reduce-scatter under the last gradients
            end += a * min(spec.ranks[r].staged_reduce_s, ps.compute)
        hold = end
        put(r, AX.TP, name + " tp", t0, ps.tp_overlapped)
        put(r, AX.DP, name + " dp", t0, ps.dp_overlapped)
        if kind != "W" and idx[r] == 0:  # the forward cannot finish before its last layer's parameters
            hold = max(hold, gathered[r])
        if kind == wg_kind:
            wg_left[r] -= 1
            if wg_left[r] == 0 and spec.ranks[r].staged_reduce_s > 0:  # async, from the last gradients
                put(r, AX.DP, "fsdp reduce-scatter", t0, spec.ranks[r].staged_reduce_s)
        if ps.compute > 0:
            events.append(Event(r, "compute", name, t0, end, {"mb": i, "chunk": c, "stage": s, "pass": kind}))
        hold = put(r, AX.TP, name + " tp exposed", hold, ps.tp_exposed)
        hold = put(r, AX.DP, name + " dp exposed", hold, ps.dp_exposed)
        nxt = s + 1 if kind == "F" else s - 1
        downstream = kind != "W" and 0 <= nxt < nvs
        arrive = hold
        peer = rank_chunk(sched, pp, nxt)[0] if downstream else r
        # the boundary it crosses: r -> r + 1 is boundary r, r -> r - 1 boundary r - 1; the wrap between
        # ranks pp - 1 and 0 (interleaved chunks) boundary pp - 1
        bnd = r if peer == r + 1 else (peer if peer == r - 1 else pp - 1)
        send_s = spec.boundary_send_s[bnd] if spec.boundary_send_s else spec.send_s
        if downstream and send_s > 0 and peer != r:  # same rank: no send
            arrive = put(r, AX.PP, f"send {name}", hold, send_s)
            hold = max(hold, arrive - send_s * (1 - spec.send_exposed))
        free[r]["compute"] = hold
        done[(kind, i, s)] = hold
        if downstream:
            ready[(kind + "s", i, s)] = arrive
        if kind == "F":
            mem_deltas[r].append((t0, st.act_bytes))
        elif (kind == "B" and not split_w) or kind == "W":  # split: W still needs the inputs
            mem_deltas[r].append((end, -st.act_bytes))
        idx[r] += 1

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while idx[r] < len(orders[r]):
                op = orders[r][idx[r]]
                ts = deps(op, stage_of(sched, pp, r, op[2]))
                if ts is None:
                    break
                run(r, op, ts)
                progress = True
    if any(idx[r] < len(orders[r]) for r in range(pp)):
        stuck = {r: orders[r][idx[r]] for r in range(pp) if idx[r] < len(orders[r])}
        raise MeshplanError(f"simulation deadlocked (schedule {sched}, pp={pp}, v={v}, m={m}): {stuck}")

    pipe_end = max(free[r]["compute"] for r in range(pp))
    ends = []
    for r in range(pp):
        rk, last = spec.ranks[r], free[r]["compute"]
        wait[r] += pipe_end - last
        t = last
        if rk.end_dp_exposed_s + rk.end_dp_overlapped_s > 0:
            t = put(r, AX.DP, "grad sync", last - rk.end_dp_overlapped_s,
                    rk.end_dp_overlapped_s + rk.end_dp_exposed_s)
        t = put(r, "compute", "optimizer", max(t, free[r][AX.DP]), rk.optimizer_s)
        ends.append(t)
    step = max(ends)
    if spec.straggler_s > 0:
        for r in range(pp):
            put(r, "compute", "straggler wait", step, spec.straggler_s,
                what="expected wait for the slowest rank of the sync (cluster step_jitter)")
        step += spec.straggler_s
    if spec.outer_sync_s > 0:
        for r in range(pp):
            put(r, AX.DP, "outer sync (amortised)", step, spec.outer_sync_s,
                whole_outer_sync_s=spec.outer_sync_full_s, every_steps=spec.sync_every)
        step += spec.outer_sync_s
    step += spec.overhead_s
    memory = []
    for r in range(pp):
        level, series = spec.ranks[r].static_bytes, [(0.0, spec.ranks[r].static_bytes)]
        for t, d in sorted(mem_deltas[r]):  # frees before allocations at the same instant
            level += d
            if len(series) > 1 and series[-1][0] == t:  # one level per instant (no zero-width dips)
                series[-1] = (t, level)
            else:
                series.append((t, level))
        series.append((step, level))
        memory.append(series)
    return SimResult(step_time_s=step, events=events, memory=memory, pp=pp, wait_s=wait,
                     reserved_extra=[spec.ranks[r].reserved_extra_bytes for r in range(pp)])
