"""Out-of-sample figures from the leave-one-source-out predictions (calibration.bands.Residuals):
the within-sweep ranking and the band coverage that ``validate --cross-validate`` reports (the
in-sample versions and the scoring: validate.ranking, validate.coverage)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from meshplan.validate.coverage import entry, pooled
from meshplan.validate.ranking import RankRow, sweep_key


def rank_rows(residuals: Any) -> list[RankRow]:
    """RankRows of the leave-one-source-out predictions (calibration.bands.Residuals): each source's
    times from the fit without it, its verdicts from the bands without it."""
    from meshplan.calibration.bands import bands_without
    from meshplan.cost.uncertainty import verdicts
    runs = residuals.runs
    out: list[RankRow] = []
    for s in dict.fromkeys(runs.source.tolist()):
        bands = bands_without(residuals, s)
        for i in np.nonzero(runs.source == s)[0]:
            c = runs.cases[i]
            k = sweep_key(c)
            t, m = float(residuals.pred_step[i]), float(residuals.pred_mem[i])
            if k is None or not math.isfinite(t):
                continue
            rec = False
            if math.isfinite(m):
                fits, risky, _ = verdicts(m, float(residuals.usable[i]), runs.bases[i], bands)
                rec = bool(fits) and not bool(risky)
            meas = float(runs.step[i]) if math.isfinite(runs.step[i]) else None
            fit = None if runs.fits[i] == 0 else bool(runs.fits[i] > 0)
            out.append(RankRow(str(c.row_id), s, k, meas, t, rec, fit))
    return out


def coverage(residuals: Any) -> dict[str, Any]:
    """Coverage of the leave-one-source-out predictions (calibration.bands.Residuals), each source
    banded by the bands fitted without it."""
    from meshplan.calibration.bands import bands_without
    from meshplan.cost.uncertainty import oom_probability, step_band
    runs = residuals.runs
    per, all_in, all_cross = [], [], []
    for s in dict.fromkeys(runs.source.tolist()):
        b = bands_without(residuals, s)
        inside, crossed = [], []
        for i in np.nonzero(runs.source == s)[0]:
            t, m = float(residuals.pred_step[i]), float(residuals.pred_mem[i])
            base = runs.bases[i]
            if math.isfinite(runs.step[i]) and math.isfinite(t):
                lo, hi = step_band(t, runs.cases[i].plan.pp, base, b)
                inside.append(bool(float(lo) <= runs.step[i] <= float(hi)))
            if runs.fits[i] < 0 and math.isfinite(m):
                crossed.append(bool(oom_probability(m, float(residuals.usable[i]), base, b) >= 0.05))
        per.append(entry(s, inside, crossed))
        all_in += inside
        all_cross += crossed
    return {"by_source": per, "pooled": pooled(per, all_in, all_cross)}
