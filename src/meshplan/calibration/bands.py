"""Uncertainty bands from out-of-sample errors (see cost.uncertainty for how they are used).

Every run is predicted by the calibration that did not see its source (leave one source out,
calibration.fit.cross_validate). From those predictions:

- step time, per kind of plan (pipeline or not, and pooled): the 5th and 95th percentiles of
  log(measured / predicted);
- peak memory, per implementation profile and pooled: (mu, sigma) of log(true / predicted peak),
  by maximum likelihood over the measured peaks (a normal density) and the out-of-memory
  outcomes (censored: a run that ran out of memory had a true peak above the usable memory, one
  that ran had it below). The pooled fit weighs each source by rows^-1/2, as the calibration
  does; each profile's fit takes the pooled value as a prior (mu +- 0.10, log sigma +- 0.5), so a
  profile with only outcomes, or a few rows, stays near it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from meshplan.cost.uncertainty import NO_PIPELINE, PIPELINE, POOLED, Bands, normal_cdf

MU_GRID = np.arange(-0.30, 0.40001, 0.005)
SIGMA_GRID = np.arange(0.015, 0.30001, 0.005)
PRIOR_MU_SD = 0.10
PRIOR_LOG_SIGMA_SD = 0.5
MIN_RUNS = 5
"""Fewer step residuals than this in a kind: the pooled band is used for it."""


class Residuals:
    """Out-of-sample predictions of a set of runs, row by row."""

    def __init__(self, runs: Any, pred_step: np.ndarray, pred_mem: np.ndarray, usable: np.ndarray) -> None:
        self.runs = runs
        self.pred_step, self.pred_mem, self.usable = pred_step, pred_mem, usable

    @property
    def step_log(self) -> np.ndarray:
        return np.log(self.runs.step / self.pred_step)

    @property
    def mem_log(self) -> np.ndarray:
        mem = self.runs.mem if self.runs.mem_reported is None else self.runs.mem_reported
        return np.log(mem / self.pred_mem)

    def subset(self, mask: np.ndarray) -> Residuals:
        idx = np.nonzero(mask)[0]
        return Residuals(self.runs.subset(idx), self.pred_step[idx], self.pred_mem[idx], self.usable[idx])


def residuals(runs: Any, folds: Sequence[Any]) -> Residuals:
    """Each run predicted by the fold that left its source out."""
    from meshplan.calibration.fit import predict
    n = len(runs)
    t, m, u = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    for f in folds:
        idx = np.nonzero(runs.source == f.source_id)[0]
        if len(idx):
            t[idx], m[idx], u[idx] = predict(runs, f.values, idx)
    return Residuals(runs, t, m, u)


def _step_bands(r: Residuals) -> dict[str, tuple[float, float]]:
    e = r.step_log
    ok = np.isfinite(e)
    pipe = np.array([c.plan.pp > 1 for c in r.runs.cases], dtype=bool)
    out: dict[str, tuple[float, float]] = {}
    for name, sel in ((POOLED, ok), (PIPELINE, ok & pipe), (NO_PIPELINE, ok & ~pipe)):
        if sel.sum() >= MIN_RUNS:
            lo, hi = np.quantile(e[sel], [0.05, 0.95])
            out[name] = (min(0.0, float(lo)), max(0.0, float(hi)))
    return out


def _loglik(r: Residuals, weights: np.ndarray) -> np.ndarray:
    """Log-likelihood on the (mu, sigma) grid: shape (len(MU_GRID), len(SIGMA_GRID))."""
    mu = MU_GRID[:, None, None]
    sig = SIGMA_GRID[None, :, None]
    ll = np.zeros((len(MU_GRID), len(SIGMA_GRID)))
    e = r.mem_log
    has = np.isfinite(e)
    if has.any():
        z = (e[has][None, None, :] - mu) / sig
        ll += ((-np.log(sig) - 0.5 * z * z) * weights[has]).sum(-1)
    out = ~has & (r.runs.fits != 0) & np.isfinite(r.pred_mem)
    if out.any():
        c = np.log(r.usable[out] / r.pred_mem[out])
        p_fit = np.clip(normal_cdf((c[None, None, :] - mu) / sig), 1e-9, 1 - 1e-9)
        ran = r.runs.fits[out] > 0
        ll += (np.where(ran, np.log(p_fit), np.log1p(-p_fit)) * weights[out]).sum(-1)
    return ll


def _best(ll: np.ndarray) -> tuple[float, float]:
    i, j = np.unravel_index(int(np.argmax(ll)), ll.shape)
    return float(MU_GRID[i]), float(SIGMA_GRID[j])


def _memory_bands(r: Residuals) -> dict[str, tuple[float, float]]:
    informs = np.isfinite(r.mem_log) | ((r.runs.fits != 0) & np.isfinite(r.pred_mem))
    if not informs.any():
        return {}
    pooled = _best(_loglik(r, r.runs.weights))
    out = {POOLED: pooled}
    profiles = np.array([b.profile for b in r.runs.bases])  # "unknown" for unrecognised codebases
    prior = (-0.5 * ((MU_GRID[:, None] - pooled[0]) / PRIOR_MU_SD) ** 2
             - 0.5 * (np.log(SIGMA_GRID[None, :] / pooled[1]) / PRIOR_LOG_SIGMA_SD) ** 2)
    for name in sorted(set(profiles[informs].tolist()) - {"unknown"}):
        sel = (profiles == name) & informs
        ll = _loglik(r.subset(sel), np.ones(int(sel.sum())))
        out[name] = _best(ll + prior)
    return out


def compute_bands(r: Residuals) -> Bands:
    return Bands(_step_bands(r), _memory_bands(r))


def bands_without(r: Residuals, source: str) -> Bands:
    """The bands from every source but ``source`` (to judge that source's verdicts honestly)."""
    return compute_bands(r.subset(r.runs.source != source))


def oom_verdicts(r: Residuals, folds: Sequence[Any]) -> None:
    """Replace each fold's out-of-memory verdicts with the band-aware ones (fits unless the chance
    of running out of memory is at least one half), each source judged with the bands of the
    other sources only."""
    from meshplan.cost.uncertainty import oom_probability
    for f in folds:
        b = bands_without(r, f.source_id)
        idx = np.nonzero((r.runs.source == f.source_id) & (r.runs.fits != 0) & np.isfinite(r.pred_mem))[0]
        prob = [float(oom_probability(r.pred_mem[i], float(r.usable[i]), r.runs.bases[i], b)) for i in idx]
        f.oom = [(bool(r.runs.fits[i] > 0), q < 0.5) for i, q in zip(idx, prob)]
        f.oom_risk = prob
        f.max_oom_risk = [float(r.runs.bases[i].max_oom_risk) for i in idx]


def bands_info(r: Residuals) -> dict[str, Any]:
    """The "uncertainty" section of a calibration file."""
    b = compute_bands(r)
    n_step = int(np.isfinite(r.step_log).sum())
    n_mem = int(np.isfinite(r.mem_log).sum())
    n_oom = int(((r.runs.fits != 0) & ~np.isfinite(r.mem_log)).sum())
    return b.to_dict() | {
        "derived_from": (f"leave-one-source-out predictions of {len(r.runs)} runs from "
                         f"{len(set(r.runs.source.tolist()))} sources: {n_step} step times; {n_mem} measured "
                         f"peaks and {n_oom} fit/out-of-memory outcomes")}
