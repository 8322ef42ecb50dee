"""Per-rank order of pipeline passes for each schedule, and where each virtual stage lives.

An op is (kind, micro-batch, chunk): kind F (forward), B (backward: input gradients, plus the
weight gradients unless the schedule splits them out) or W (weight gradients: zero-bubble,
ZBV). Chunk c of rank r is virtual stage c * pp + r (Megatron's interleaved placement), or,
under ZBV, stage r for chunk 0 and stage 2 pp - 1 - r for chunk 1 (the V: rank 0 holds the
first and the last stage).
"""
from __future__ import annotations

from meshplan.errors import MeshplanError

Op = tuple[str, int, int]
SIMULATED = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
SPLIT_W = ("zero-bubble", "zbv")
"""Schedules whose backward is split into B (input gradients) and W (weight gradients)."""


def chunks_per_rank(schedule: str, pp: int, v: int) -> int:
    """Model chunks per pipeline rank the simulator places: v interleaved, 2 for ZBV, else 1."""
    if pp == 1:
        return 1
    return v if schedule == "interleaved-1f1b" else 2 if schedule == "zbv" else 1


def stage_of(schedule: str, pp: int, r: int, c: int) -> int:
    """Virtual stage (model order) of chunk c on rank r."""
    if schedule == "zbv":
        return r if c == 0 else 2 * pp - 1 - r
    return c * pp + r


def rank_chunk(schedule: str, pp: int, s: int) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage s; the inverse of stage_of."""
    if schedule == "zbv":
        return (s, 0) if s < pp else (2 * pp - 1 - s, 1)
    return s % pp, s // pp


def rank_orders(schedule: str, pp: int, m: int, v: int = 1) -> list[list[Op]]:
    """The sequence of passes each pipeline rank runs in one step, in the order of the
    framework that runs the schedule: Megatron for interleaved 1F1B; for zero-bubble (ZB-H1)
    and ZBV, F, B (input gradients) and W (weight gradients) in the order of
    torch.distributed.pipelining's ScheduleInterleavedZeroBubble (one chunk per rank) and
    ScheduleZBVZeroBubble, which ``meshplan train`` runs."""
    if schedule not in SIMULATED:
        raise MeshplanError(f"the simulator does not model schedule {schedule!r}",
                            hint="supported: " + ", ".join(SIMULATED))
    if pp == 1:
        return [[op for i in range(m) for op in (("F", i, 0), ("B", i, 0))]]
    if schedule == "gpipe":
        return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)] for _ in range(pp)]
    if schedule == "interleaved-1f1b" and v > 1:
        if m % pp:
            raise MeshplanError(f"interleaved 1F1B needs micro-batches per step ({m}) divisible by pp={pp}")
        return [_interleaved(r, pp, m, v) for r in range(pp)]
    if schedule == "zbv":
        return [_zbv(r, pp, m) for r in range(pp)]
    if schedule == "zero-bubble":
        return [_zb_h1(r, pp, m) for r in range(pp)]
    return [_one_f_one_b(r, pp, m) for r in range(pp)]


def _one_f_one_b(r: int, pp: int, m: int) -> list[Op]:
    warm = min(pp - r - 1, m)
    ops: list[Op] = [("F", i, 0) for i in range(warm)]
    for k in range(m - warm):
        ops += [("F", warm + k, 0), ("B", k, 0)]
    ops += [("B", i, 0) for i in range(m - warm, m)]
    return ops


def _zb_h1(r: int, pp: int, m: int) -> list[Op]:
    """ZB-H1 (Qi et al. 2024, section 2.1) as torch's ScheduleInterleavedZeroBubble orders it
    with one chunk per rank: 1F1B for F and B, with rank r's weight-gradient passes W
    delayed by r steps, so every rank has pp micro-batches in flight (B done or not, W not)
    at its peak; the delayed Ws run in the cool-down."""
    warm = min(pp - 1 - r, m)
    ops: list[Op] = [("F", i, 0) for i in range(warm)]
    w = 0
    for k in range(m - warm):
        ops += [("F", warm + k, 0), ("B", k, 0)]
        if k >= r:
            ops.append(("W", w, 0))
            w += 1
    for k, i in enumerate(range(m - warm, m), start=m - warm):
        ops.append(("B", i, 0))
        if k >= r:
            ops.append(("W", w, 0))
            w += 1
    return ops + [("W", i, 0) for i in range(w, m)]


def _interleaved(r: int, pp: int, m: int, v: int) -> list[Op]:
    """Megatron's interleaved 1F1B: micro-batches in groups of pp, each group through every
    chunk in turn (forwards: chunks 0..v-1, backwards: v-1..0)."""
    def seq(backward: bool) -> list[Op]:
        out: list[Op] = []
        for g0 in range(0, m, pp):
            group = range(g0, min(m, g0 + pp))
            chunks = range(v - 1, -1, -1) if backward else range(v)
            out += [("B" if backward else "F", i, c) for c in chunks for i in group]
        return out
    fwd, bwd = seq(False), seq(True)
    total = m * v
    warm = min(total, (pp - r - 1) * 2 + (v - 1) * pp)
    ops: list[Op] = fwd[:warm]
    for k in range(total - warm):
        ops += [fwd[warm + k], bwd[k]]
    ops += bwd[total - warm:]
    return ops


def _zbv(r: int, pp: int, m: int) -> list[Op]:
    """ZB-V (Qi et al. 2024, section 6), as torch.distributed.pipelining.ScheduleZBVZeroBubble
    orders it: warm-up 2 (pp - r) - 1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0),
    then pp - r triples (F, B, W of chunk 1); steady state F B W on chunk 0 then on chunk 1;
    cool-down r pairs (B chunk 0, B chunk 1), pp - r pairs (B, W of chunk 0), then the
    remaining W of chunk 1 and of chunk 0. The order is built for max(m, 2 pp - 1)
    micro-batches and the ones beyond m dropped, as torch does."""
    n = max(2 * pp - 1, m)
    ops: list[Op] = []
    f = [0, 0]
    b = [0, 0]

    def add(kind: str, c: int) -> None:
        cnt = f if kind == "F" else b
        ops.append((kind, cnt[c], c))
        cnt[c] += 1

    def bw(c: int) -> None:  # B then its W
        ops.append(("B", b[c], c))
        ops.append(("W", b[c], c))
        b[c] += 1

    for _ in range(2 * (pp - r) - 1):
        add("F", 0)
    for _ in range(r):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - r):
        add("F", 1)
        bw(1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            add("F", 0)
        bw(0)
        add("F", 1)
        bw(1)
    w = list(b)
    for _ in range(r):
        add("B", 0)
        add("B", 1)
    for _ in range(pp - r):
        add("B", 0)
        ops.append(("W", w[0], 0))
        w[0] += 1
    for c in (1, 0):
        while w[c] < b[c]:
            ops.append(("W", w[c], c))
            w[c] += 1
    if not (f == b == w == [n, n]):  # the order's invariant (torch asserts the same)
        raise AssertionError(f"ZBV order for rank {r} is inconsistent: F {f}, B {b}, W {w}, n={n}")
    return [op for op in ops if op[1] < m]
