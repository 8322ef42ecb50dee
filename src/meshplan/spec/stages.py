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


def stage_layer_ranges(kinds: list[str] | tuple[str, ...], plan: Plan) -> list[tuple[int, int]]:
    """[start, end) layer indices of each global pipeline stage (pp * virtual_stages of them,
    model order) of a model whose layers have the given kinds (LayerGraph layer kinds).

    ``stage_layers`` and the even split count the layers of kind ``block`` only (a transformer's
    decoder layers, a ResNet's bottlenecks). The other layers go with their neighbours: those
    before the first block with the first stage, one between blocks with the block before it,
    and those after the last block (final norm, head, loss) with the last stage."""
    blocks = [i for i, k in enumerate(kinds) if k == "block"]
    counts = stage_layer_counts(len(blocks), plan)
    n = len(kinds)
    after_last = blocks[-1] + 1 if blocks else n

    def start(k: int) -> int:
        return blocks[k] if k < len(blocks) else after_last

    starts, done = [0], 0
    for c in counts[:-1]:
        done += c
        starts.append(start(done))
    ends = starts[1:] + [n]
    return list(zip(starts, ends))
