"""Per-rank order of pipeline passes for each schedule.

An op is (kind, micro-batch, chunk): kind F (forward), B (backward: input gradients, plus the
weight gradients unless the schedule splits them out) or W (weight gradients, zero-bubble).
Chunk c of rank r is virtual stage c * pp + r (Megatron's interleaved placement).
"""
from __future__ import annotations

from meshplan.errors import MeshplanError

Op = tuple[str, int, int]
SIMULATED = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def rank_orders(schedule: str, pp: int, m: int, v: int = 1) -> list[list[Op]]:
    """The sequence of F and B passes each pipeline rank runs in one step. Zero-bubble uses
    the 1F1B order for F and B (input gradients); the engine fills waits with W passes."""
    if schedule not in SIMULATED:
        raise MeshplanError(f"the simulator does not model schedule {schedule!r} yet",
                            hint="simulate it as zero-bubble; supported: " + ", ".join(SIMULATED))
    if pp == 1:
        return [[op for i in range(m) for op in (("F", i, 0), ("B", i, 0))]]
    if schedule == "gpipe":
        return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)] for _ in range(pp)]
    if schedule == "interleaved-1f1b" and v > 1:
        if m % pp:
            raise MeshplanError(f"interleaved 1F1B needs micro-batches per step ({m}) divisible by pp={pp}")
        return [_interleaved(r, pp, m, v) for r in range(pp)]
    return [_one_f_one_b(r, pp, m) for r in range(pp)]


def _one_f_one_b(r: int, pp: int, m: int) -> list[Op]:
    warm = min(pp - r - 1, m)
    ops: list[Op] = [("F", i, 0) for i in range(warm)]
    for k in range(m - warm):
        ops += [("F", warm + k, 0), ("B", k, 0)]
    ops += [("B", i, 0) for i in range(m - warm, m)]
    return ops


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
