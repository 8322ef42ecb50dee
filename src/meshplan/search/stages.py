"""Uneven pipeline stages by dynamic programming.

Given a cost per layer (any array), an extra cost on the first stage (embedding) and on the
last (final norm, output projection and loss), and ``pp`` stages of contiguous layers, pick the
split that minimises the maximum stage cost: the pipeline runs at the pace of its slowest
stage (m x max_i T_i in every schedule of ``meshplan.cost.schedule``). Under ZBV the V puts the
last virtual stage, with the output layer and the loss, on rank 0 beside the embedding
(``cost.batch.output_stage``): ``balanced_stage_layers(..., schedule="zbv")`` charges both
extras to the first rank.

Ties are common (whole layers, uniform costs), so the choice among optimal splits is fixed:
  1. least maximum stage cost;
  2. then least sum of squared stage costs (the most even split among them: a lighter
     non-critical stage shortens the fill/drain bubble and leaves no stage needlessly idle);
  3. then the lexicographically smallest tuple of layer counts: earlier stages lighter,
     because under 1F1B stage i keeps pp - i micro-batches of activations alive, so stage 0
     is the memory-critical one. (The brief suggested earliest-heavier; later-heavier costs
     nothing in time and lowers the peak memory.)
For Llama 3.1 405B (126 layers, pp=8, output layer about one block) this gives
15:16:16:16:16:16:16:15, torchtitan's published split.

The kernel (`split_layers`) is pure numpy over prefix sums: O(pp L^2) with L^2 vectorised.
`balanced_stage_layers` is the driver that prices layers with the cost model's compute.
"""
from __future__ import annotations

import numpy as np

from meshplan.errors import MeshplanError

_RTOL = 1e-9  # costs within this relative tolerance count as equal (tie)


def _seg_matrix(costs: np.ndarray) -> np.ndarray:
    """seg[j, e] = sum of costs[j:e] (inf where e < j)."""
    pre = np.concatenate([[0.0], np.cumsum(costs, dtype=float)])
    seg = pre[None, :] - pre[:, None]
    n = len(costs)
    seg[np.tril_indices(n + 1, -1)] = np.inf
    return seg


def _stage_costs(seg: np.ndarray, k_left: int, pp: int, first: float, last: float) -> np.ndarray:
    """Cost of a stage spanning [j, e) when it is the stage with ``k_left`` stages left (itself
    included) out of ``pp``: segment sum plus the first/last extras where they apply."""
    c = seg.copy()
    if k_left == pp:  # the first stage starts at layer 0 only
        c[0, :] += first
    if k_left == 1:
        c += last
    return c


def split_layers(costs: np.ndarray, pp: int, first_extra: float = 0.0, last_extra: float = 0.0,
                 min_layers: int = 1) -> tuple[int, ...]:
    """Layers per stage (length ``pp``, sum len(costs), each >= ``min_layers``) minimising the
    maximum stage cost, ties broken as in the module docstring."""
    costs = np.asarray(costs, dtype=float)
    n = len(costs)
    if pp < 1 or min_layers < 0 or pp * min_layers > n:
        raise MeshplanError(f"cannot split {n} layers into {pp} stages of at least {min_layers}")
    seg = _seg_matrix(costs)
    idx = np.arange(n + 1)
    valid_len = (idx[None, :] - idx[:, None]) >= min_layers
    # stage[k][j, e]: cost of a stage spanning [j, e) with k stages left (index 0 unused).
    stage = [np.empty((0, 0))] + [
        np.where(valid_len, _stage_costs(seg, k, pp, first_extra, last_extra), np.inf)
        for k in range(1, pp + 1)]
    # best[k][j]: least max cost of splitting layers j..n into k stages (inf if impossible).
    best = [np.full(n + 1, np.inf) for _ in range(pp + 1)]
    best[0][n] = 0.0
    for k in range(1, pp + 1):
        best[k] = np.min(np.maximum(stage[k], best[k - 1][None, :]), axis=1)
    opt = best[pp][0]
    if not np.isfinite(opt):
        raise MeshplanError(f"cannot split {n} layers into {pp} stages")
    cap = opt * (1 + _RTOL) + 1e-300
    # sq[k][j]: least sum of squared stage costs splitting j..n into k stages, each <= cap.
    sq = [np.full(n + 1, np.inf) for _ in range(pp + 1)]
    sq[0][n] = 0.0
    for k in range(1, pp + 1):
        c = stage[k]
        sq[k] = np.min(np.where(c <= cap, c * c, np.inf) + sq[k - 1][None, :], axis=1)
    return _reconstruct(stage, sq, cap, pp, n)


def _reconstruct(stage: list[np.ndarray], sq: list[np.ndarray], cap: float, pp: int,
                 n: int) -> tuple[int, ...]:
    """Walk forward choosing, at each stage, the fewest layers that keep both optima."""
    out, j = [], 0
    for k in range(pp, 0, -1):
        c = stage[k][j]
        total = np.where(c <= cap, c * c, np.inf) + sq[k - 1]
        target = total.min()
        ok = np.nonzero(total <= target * (1 + _RTOL) + 1e-300)[0]
        e = int(ok[0])
        out.append(e - j)
        j = e
    assert j == n
    return tuple(out)


def stage_cost_max(costs: np.ndarray, split: tuple[int, ...], first_extra: float = 0.0,
                   last_extra: float = 0.0, schedule: str = "1f1b") -> float:
    """Maximum stage cost of ``split`` (for tests and reports); ``last_extra`` on rank 0 under
    zbv (``output_on_first_rank``)."""
    costs = np.asarray(costs, dtype=float)
    bounds = np.concatenate([[0], np.cumsum(split)])
    per = [costs[bounds[i]:bounds[i + 1]].sum() for i in range(len(split))]
    per[0] += first_extra
    per[0 if output_on_first_rank(schedule, len(split)) else -1] += last_extra
    return float(max(per))


def output_on_first_rank(schedule: str, pp: int) -> bool:
    """Whether the output layer (and the loss) runs on pipeline rank 0: ZBV's V puts the last
    virtual stage there (torch.distributed.pipelining, cost.batch.output_stage)."""
    return schedule == "zbv" and pp > 1


def balanced_stage_layers(num_layers: int, pp: int, virtual_stages: int = 1, *,
                          layer_cost: float = 1.0, first_extra: float = 0.0,
                          last_extra: float = 0.0, schedule: str = "1f1b") -> tuple[int, ...] | None:
    """Blocks per pipeline rank for a model of identical blocks, balancing the embedding
    (``first_extra``, on rank 0) and the output layer + loss (``last_extra``: on the last rank,
    or on rank 0 with the embedding when ``schedule`` is zbv). With virtual stages each rank
    holds ``virtual_stages`` chunks, so the split is in units of ``virtual_stages`` blocks (the
    constraint `layers_split` asks each rank's count to be divisible by it). None when no
    split exists (too few layers, or num_layers not divisible by virtual_stages)."""
    v = virtual_stages
    if num_layers % v or num_layers // v < pp:
        return None
    units = num_layers // v
    if output_on_first_rank(schedule, pp):
        first_extra, last_extra = first_extra + last_extra, 0.0
    split = split_layers(np.full(units, layer_cost * v), pp, first_extra, last_extra)
    return tuple(u * v for u in split)
