"""Pareto front of plans over objectives to minimise (step time, peak memory per GPU, dollars
per million tokens).

A point is dominated when another point is no worse in every objective and strictly better in
at least one. Identical points do not dominate each other (both stay on the front).
"""
from __future__ import annotations

import numpy as np


def pareto_mask(points: np.ndarray) -> np.ndarray:
    """Boolean mask of the non-dominated rows of ``points`` (n x k, smaller is better).

    Sort lexicographically, then sweep: a point can only be dominated by one before it in that
    order, and only by a point on the front (dominance is transitive). k = 2 is a single
    vectorised prefix-minimum; k >= 3 checks each point against the front found so far.
    """
    pts = np.asarray(points, dtype=float)
    n = len(pts)
    if n == 0:
        return np.zeros(0, dtype=bool)
    if pts.ndim != 2:
        raise ValueError("points must be an (n, k) array")
    order = np.lexsort(pts.T[::-1])
    s = pts[order]
    keep = _sweep2(s) if s.shape[1] == 2 else _sweep(s)
    mask = np.zeros(n, dtype=bool)
    mask[order[keep]] = True
    return mask


def _sweep2(s: np.ndarray) -> np.ndarray:
    """Two objectives, rows sorted by (x, y): keep a row unless an earlier row has y below it,
    or the same y with a smaller x."""
    x, y = s[:, 0], s[:, 1]
    prev_min = np.concatenate([[np.inf], np.minimum.accumulate(y)[:-1]])
    keep = y < prev_min
    # Equal y to the running minimum: kept only when that minimum came from an identical point.
    tie = y == prev_min
    if tie.any():
        for i in np.nonzero(tie)[0]:
            earlier = s[:i]
            hit = earlier[(earlier[:, 1] == y[i])]
            keep[i] = bool(np.all(hit[:, 0] == x[i]))
    return np.nonzero(keep)[0]


def _sweep(s: np.ndarray) -> np.ndarray:
    front: list[int] = []
    fpts = np.empty((0, s.shape[1]))
    for i, p in enumerate(s):
        if len(front):
            le = np.all(fpts <= p, axis=1)
            lt = np.any(fpts < p, axis=1)
            if np.any(le & lt):
                continue
        front.append(i)
        fpts = s[front]
    return np.asarray(front, dtype=int)


def naive_pareto_mask(points: np.ndarray) -> np.ndarray:
    """O(n^2) reference: the definition, literally (for tests)."""
    pts = np.asarray(points, dtype=float)
    n = len(pts)
    out = np.ones(n, dtype=bool)
    for i in range(n):
        for j in range(n):
            if i != j and np.all(pts[j] <= pts[i]) and np.any(pts[j] < pts[i]):
                out[i] = False
                break
    return out


def usd_per_million_tokens(num_gpus: np.ndarray | float, price_per_gpu_hour: float,
                           step_time_s: np.ndarray | float, tokens_per_step: float) -> np.ndarray:
    """Dollars per million trained tokens: num_gpus x price x step time / 3600 per step
    (inf, without a warning, beyond the float range)."""
    with np.errstate(over="ignore"):
        usd_per_step = np.asarray(num_gpus, dtype=float) * price_per_gpu_hour * np.asarray(step_time_s) / 3600.0
        return usd_per_step / (tokens_per_step / 1e6)
