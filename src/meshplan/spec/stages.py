"""How a plan's pipeline stages map onto pipeline ranks and blocks. Pure Python (no torch):
shared by the exporters (export/) and the runtime (runtime/parallelize.py, runtime/generic.py)."""
from __future__ import annotations

from meshplan.spec.plan import Plan


def _even(n: int, k: int) -> list[int]:
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def stage_ids_for_rank(pp_rank: int, plan: Plan) -> list[int]:
    """Global stage indices held by one pipeline rank: looped (r, r+pp, ...) or V-shaped (zbv);
    the same rule as torch.distributed.pipelining."""
    pp, v = plan.pp, plan.virtual_stages
    if plan.schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(v)]


def stage_layer_counts(num_layers: int, plan: Plan) -> list[int]:
    """Transformer blocks per global pipeline stage (pp * virtual_stages of them, model order).
    ``plan.stage_layers`` gives blocks per pipeline rank, split evenly over the rank's chunks."""
    v = plan.virtual_stages
    if plan.stage_layers is None:
        return _even(num_layers, plan.pp * v)
    counts = [0] * (plan.pp * v)
    for r, n in enumerate(plan.stage_layers):
        for i, c in zip(stage_ids_for_rank(r, plan), _even(n, v)):
            counts[i] = c
    return counts
