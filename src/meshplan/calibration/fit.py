"""Fit a calibration to measured runs, and leave-one-source-out cross-validation.

The fit is maximum a posteriori over the named parameters of calibration.space:

  time:    sum over runs of w_i soft_l1(log(predicted / measured step time)) / NOISE^2
           + sum over parameters ((u - u_prior) / sigma)^2          (u = log value or value)
  memory:  the same on measured peak memory; where the runs measured no peak at all, a hinge on
           out-of-memory outcomes instead (a run that ran out of memory must be predicted above
           the usable memory, one that ran below it). Measured peaks are what the allocation
           physics is fitted to: an outcome censors the total, codebase-specific terms the model
           lacks included, and a hard hinge on it would move a global constant (the framework's
           overhead) to explain one codebase's misses (it drove framework_overhead_gib to its
           3 GiB bound in the fold without Megatron-Core's measured rows). Outcomes inform the
           memory bands instead (calibration.bands: per profile, censored), which decide the
           verdicts.

Each source's rows together weigh sqrt(rows) (w_i = rows^-1/2), so that one big sweep does not
decide every constant. Levenberg-Marquardt on the transformed parameters with a forward-difference
Jacobian; each Jacobian column re-estimates only the runs that parameter can move (a GPU family's
efficiency only its runs). Time and memory parameters are fitted separately: memory does not
depend on the time parameters.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.builtin_calibration import gpu_key, link_key
from meshplan.calibration.space import CODEBASE, GLOBAL, GPU_FIELDS, Fittable, by_name
from meshplan.calibration.store import Calibration
from meshplan.cases import MEMORY_MEASURES, case_params, memory_measure
from meshplan.cost.batch import estimate_batch
from meshplan.cost.memory import usable_gib
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.errors import MeshplanError

NOISE = 0.05
"""Per-run scatter the data term assumes (log units): the +-3% repeat noise of one vendor's
measurements plus the model's own error on a run."""
SOFT = 0.10
"""Soft-L1 scale (log units): errors beyond ~10% count linearly, so a few odd runs do not
drag the constants."""
HINGE = 0.02
"""Scale of the out-of-memory hinge (log units)."""


Z90 = 1.6448536269514722
"""Standard normal 95th percentile: a step band's (log q05, log q95) spans 2 Z90 standard deviations."""

REFINE = "both"
"""How ``refinement`` refines a calibrated centre by default (`meshplan calibrate --prior builtin`):
the variant with the lowest pooled held-out step error at k = 1 and 3 in benchmarks/few_shot.py
(docs/cost-model.md, Few-shot calibration)."""
REFINEMENTS = ("physics", "posterior", "scatter", "both")


def refinement(posterior_sd: Mapping[str, float] | None, step_band: tuple[float, float] | None,
               how: str = REFINE) -> dict[str, Any]:
    """``fit`` keyword arguments (prior_sd, noise) for refining a calibrated centre on a few runs.

    A calibration fitted to many runs is not a first-principles guess: its parameters are known to
    within its fit's posterior, and its predictions already explain what its parameters can, so a
    run's error against it is partly the model's own out-of-sample scatter. ``how``:

    - 'physics': the priors of a fit from first principles (Fittable.sigma) and NOISE: a few runs
      move every parameter they inform as if nothing were known (what refinement did before).
    - 'posterior': each parameter's prior is the posterior of the calibration being refined
      (``posterior_sd``: FitResult.posterior_sd of its fit, the 'posterior_sd' section of a
      calibration file): refining on k runs approximates refitting the big fit with the k runs
      added (a Laplace approximation of its posterior, correlations dropped).
    - 'scatter': physics priors, and the step-time data term assumes the centre's out-of-sample
      per-run scatter (the standard deviation of its 90% step band ``step_band``) instead of NOISE.
    - 'both': the posterior priors and the out-of-sample scatter.
    """
    if how not in REFINEMENTS:
        raise ValueError(f"refinement {how!r}: one of {', '.join(REFINEMENTS)}")
    out: dict[str, Any] = {}
    if how in ("posterior", "both") and posterior_sd:
        out["prior_sd"] = dict(posterior_sd)
    if how in ("scatter", "both") and step_band is not None:
        out["noise"] = max(NOISE, (step_band[1] - step_band[0]) / (2 * Z90))
    return out


def refinement_of(cal: Calibration, how: str = REFINE) -> dict[str, Any]:
    """``refinement`` of a calibration: its file's 'posterior_sd' and pooled ('*') step band."""
    band = ((cal.info.get("uncertainty") or {}).get("step") or {}).get("*")
    return refinement(cal.info.get("posterior_sd"), None if not band else (band["log_q05"], band["log_q95"]), how)


@dataclass
class Runs:
    """The runs a fit uses, with what each can say."""

    cases: list[Any]
    bases: list[CostParams]
    step: np.ndarray
    """measured step time (nan where none)"""
    mem: np.ndarray
    """measured peak memory the fit uses, GiB (nan where none, and for nvidia-smi rows)"""
    fits: np.ndarray
    """+1 ran, -1 ran out of memory, 0 unknown"""
    source: np.ndarray
    family: np.ndarray
    links: list[set[str]]
    mem_reported: np.ndarray | None = None
    """every measured peak memory, nvidia-smi rows included (what cross-validation reports)"""

    def __len__(self) -> int:
        return len(self.cases)

    def subset(self, idx: Sequence[int] | np.ndarray) -> Runs:
        ix = list(np.asarray(idx, dtype=int))
        return Runs([self.cases[i] for i in ix], [self.bases[i] for i in ix], self.step[ix], self.mem[ix],
                    self.fits[ix], self.source[ix], self.family[ix], [self.links[i] for i in ix],
                    None if self.mem_reported is None else self.mem_reported[ix])

    def measured(self, target: str) -> np.ndarray:
        """Which runs a ``target`` ('time' or 'memory') parameter can be fitted to: a step time; a
        peak memory the fit uses or an out-of-memory outcome."""
        if target == "time":
            return ~np.isnan(self.step)
        return ~np.isnan(self.mem) | (self.fits != 0)

    @property
    def weights(self) -> np.ndarray:
        n = {s: int((self.source == s).sum()) for s in set(self.source.tolist())}
        return np.array([n[s] ** -0.5 for s in self.source])


def _links(cluster: Any) -> set[str]:
    out = set()
    for tier in ("intra_node", "inter_node", "inter_dc"):
        t = getattr(cluster, tier, None)
        if t is not None:
            out.add(link_key(t.name, t.kind))
    return out


def unusable(case: Any) -> str | None:
    """Why a fit cannot use ``case`` (None: it can): not expressible, nothing measured, or a plan
    that cannot run."""
    from meshplan.spec.constraints import violations
    if not getattr(case, "ok", False):
        return getattr(case, "reason", "") or "unsupported"
    if case.measured_step_time_s is None and case.measured_peak_mem_gib is None and case.measured_fits is None:
        return "no measured step time, peak memory or out-of-memory outcome"
    bad = violations(case.model, case.cluster, case.plan, case.work)
    return "; ".join(r for _, r in bad) if bad else None


def runs_from_cases(cases: Sequence[Any], base: CostParams = DEFAULT_PARAMS) -> Runs:
    """The expressible runs with a measured step time, peak memory or fit outcome."""
    keep = [c for c in cases if unusable(c) is None]
    return Runs(
        cases=keep, bases=[case_params(c, base) for c in keep],
        step=np.array([c.measured_step_time_s or np.nan for c in keep], dtype=float),
        mem=np.array([np.nan if getattr(c, "memory_by_nvidia_smi", False) else (c.measured_peak_mem_gib or np.nan)
                      for c in keep], dtype=float),
        fits=np.array([0 if c.measured_fits is None else (1 if c.measured_fits else -1) for c in keep]),
        source=np.array([c.source_id for c in keep]),
        family=np.array([c.cluster.gpu.family for c in keep]),
        links=[_links(c.cluster) for c in keep],
        mem_reported=np.array([c.measured_peak_mem_gib or np.nan for c in keep], dtype=float))


def predict(runs: Runs, values: dict[str, float], idx: Sequence[int] | None = None,
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step time s, peak memory GiB, usable GiB) of runs ``idx`` (all) under ``values``. The
    peak is the quantity the run measured (meshplan.cases.memory_measure: allocated, reserved or
    nvidia-smi's; the device peak where it measured none), and the usable memory is lowered by
    what the device peak holds beyond it, so that peak <= usable is the verdict's test."""
    cal = Calibration(values)
    ix = range(len(runs)) if idx is None else idx
    t, m, u = [], [], []
    for i in ix:
        c = runs.cases[i]
        p = cal.apply_params(runs.bases[i])
        cl = cal.apply_cluster(c.cluster)
        r = estimate_batch(c.model, cl, c.work, [c.plan], p)
        t.append(float(r["step_time_s"][0]))
        peak = float(r["peak_memory_gib"][0])
        key = MEMORY_MEASURES[memory_measure(c)] if c.measured_peak_mem_gib else "peak_memory_gib"
        matched = float(r[key][0]) if key in r else peak
        m.append(matched)
        u.append(usable_gib(cl, p) - (peak - matched))
    return np.array(t), np.array(m), np.array(u)


def informs(runs: Runs, name: str) -> bool:
    """Whether some run can inform parameter ``name`` (a measurement of its kind on a run it moves)."""
    return bool((_affects(name, runs) & runs.measured(fittable(name).target)).any())


def informs_any(runs: Runs) -> bool:
    return bool(runs.measured("time").any() or runs.measured("memory").any())


def step_mape(runs: Runs, values: dict[str, float]) -> float | None:
    """Step-time MAPE (%) of the runs with a step time under ``values`` (None without any)."""
    has = runs.measured("time")
    if not has.any():
        return None
    t, _, _ = predict(runs, values, np.nonzero(has)[0])
    return float(np.mean(np.abs(t / runs.step[has] - 1)) * 100)


def default_names(runs: Runs, target: str) -> list[str]:
    """Every parameter of ``target`` ('time' or 'memory') the runs can inform."""
    if target == "memory":
        return [f.name for f in GLOBAL if f.target == "memory"]
    names = [f.name for f in GLOBAL if f.target == "time"]
    timed = runs.measured("time")
    for fam in sorted({f for f, ok in zip(runs.family, timed) if ok and f}):
        names += [gpu_key(k, fam) for k in GPU_FIELDS]
    names += sorted({k for ls, ok in zip(runs.links, timed) if ok for k in ls})
    return names


def fittable(name: str) -> Fittable:
    try:
        return by_name(name)
    except KeyError:
        from meshplan.calibration.space import FAMILIES, GPU_FIELDS, all_names_help
        field = name.partition("@")[0]
        if field in GPU_FIELDS:  # a GPU family's field without (or with a misspelt) family
            raise MeshplanError(f"--fit: {name!r} needs a GPU family: {field}@FAMILY",
                                hint=f"e.g. {field}@ampere or {field}@hopper (FAMILY: {', '.join(FAMILIES)})") from None
        if field == "link_efficiency":
            raise MeshplanError(f"--fit: {name!r} needs a link tier and kind: link_efficiency@TIER:KIND",
                                hint="e.g. link_efficiency@inter_node:infiniband; " + all_names_help()) from None
        raise MeshplanError(f"--fit: unknown parameter {name!r}", hint=f"parameters: {all_names_help()}") from None


def codebase_names() -> list[str]:
    """The codebase parameters (calibration.space.CODEBASE): fitted by `meshplan calibrate` on one
    codebase's runs, never by the pooled fit of many codebases."""
    return [f.name for f in CODEBASE]


def _affects(name: str, runs: Runs) -> np.ndarray:
    """Which runs parameter ``name`` can move."""
    if "@" not in name or name.startswith("codebase_speed@"):
        return np.ones(len(runs), dtype=bool)
    field_, _, rest = name.partition("@")
    if field_ in GPU_FIELDS:
        return runs.family == rest
    return np.array([name in ls for ls in runs.links])


@dataclass
class FitResult:
    values: dict[str, float]
    start: dict[str, float]
    names: list[str]
    iterations: int
    seconds: float
    cost: float
    rows: int
    history: list[float] = field(default_factory=list)
    posterior_sd: dict[str, float] = field(default_factory=dict)
    """Each fitted parameter's posterior standard deviation, in the units of its prior
    (Fittable.sigma: of log(value) when log): sqrt of the diagonal of (J^T J + P)^-1, the inverse
    of the Gauss-Newton precision of the cost at the last Jacobian (J: the weighted data residuals'
    Jacobian, already divided by the noise; P: the prior precision)."""


def _soft(e: np.ndarray) -> np.ndarray:
    """Signed square root of the soft-L1 loss: ~e for small e, ~sqrt(2 SOFT |e|) for large."""
    rho = 2 * SOFT ** 2 * (np.sqrt(1 + (e / SOFT) ** 2) - 1)
    return np.sign(e) * np.sqrt(rho)


def _fit(runs: Runs, names: list[str], start: dict[str, float], target: str,
         max_iter: int, progress: Callable[[str], None] | None,
         centre: dict[str, float] | None = None, prior_sd: Mapping[str, float] | None = None,
         noise: float = NOISE) -> FitResult:
    specs = [fittable(n) for n in names]
    lo = np.array([math.log(f.low) if f.log else f.low for f in specs])
    hi = np.array([math.log(f.high) if f.log else f.high for f in specs])
    mid = [min(f.high, max(f.low, (centre or {}).get(f.name, f.prior))) for f in specs]
    prior = np.array([math.log(m) if f.log else m for f, m in zip(specs, mid)])
    sig = np.array([min(f.sigma, (prior_sd or {}).get(f.name, f.sigma)) for f in specs])

    def to_val(u: np.ndarray) -> dict[str, float]:
        return {n: float(min(f.high, max(f.low, math.exp(x) if f.log else x))) for n, f, x in zip(names, specs, u)}

    rows = np.nonzero(runs.measured(target))[0]
    w = runs.subset(rows).weights if len(rows) else np.zeros(0)
    measured_any = bool(len(rows)) and bool(np.any(~np.isnan(runs.mem[rows])))
    affects = [(_affects(n, runs)[rows]) for n in names]

    def data_res(pred: tuple[np.ndarray, np.ndarray, np.ndarray], sel: np.ndarray) -> np.ndarray:
        t, m, u = pred
        r = rows[sel]
        ws = np.sqrt(w[sel])
        if target == "time":
            return ws * _soft(np.log(t / runs.step[r])) / noise
        out = np.zeros(len(r))
        has = ~np.isnan(runs.mem[r])
        out[has] = _soft(np.log(m[has] / runs.mem[r][has])) / NOISE
        if measured_any:  # outcomes censor the total: the bands' job, not the physics'
            return ws * out
        f = runs.fits[r]
        over = np.log(np.maximum(m, 1e-9) / u)
        miss = np.where(f < 0, np.maximum(0, -over), np.where((f > 0) & ~has, np.maximum(0, over), 0))
        return ws * (out + miss / HINGE)

    def evaluate(vals: dict[str, float], sel: np.ndarray) -> np.ndarray:
        full = {**start, **vals}
        return data_res(predict(runs, full, rows[sel]), sel)

    u = np.clip(np.array([math.log(start[n]) if f.log else start[n] for n, f in zip(names, specs)]), lo, hi)
    everything = np.ones(len(rows), dtype=bool)
    t0 = time.perf_counter()
    d = evaluate(to_val(u), everything)

    def total(d: np.ndarray, u: np.ndarray) -> float:
        return float(d @ d + (((u - prior) / sig) ** 2).sum())

    cost, lam, it, hist = total(d, u), 1e-2, 0, []
    hist.append(cost)
    h = 1e-3
    P = np.diag(1 / sig ** 2)
    A = P
    for it in range(1, max_iter + 1):
        J = np.zeros((len(rows), len(names)))
        for j in range(len(names)):
            sel = affects[j]
            if not sel.any():
                continue
            up = u.copy()
            step = h if u[j] + h <= hi[j] else -h
            up[j] += step
            J[sel, j] = (evaluate(to_val(up), sel) - d[sel]) / step
        g = J.T @ d + P @ (u - prior)
        A = J.T @ J + P
        improved = False
        for _ in range(8):
            delta = np.linalg.solve(A + lam * np.diag(np.diag(A)), -g)
            un = np.clip(u + delta, lo, hi)
            dn = evaluate(to_val(un), everything)
            cn = total(dn, un)
            if cn < cost:
                rel = (cost - cn) / max(cost, 1e-12)
                u, d, cost, lam, improved = un, dn, cn, max(lam / 3, 1e-6), True
                break
            lam *= 4
        hist.append(cost)
        if progress:
            progress(f"  {target} iteration {it}: cost {cost:.4g}")
        if not improved or rel < 1e-4:
            break
    try:
        post = np.sqrt(np.clip(np.diag(np.linalg.inv(A)), 0, None))
    except np.linalg.LinAlgError:
        post = sig
    return FitResult(to_val(u), {n: start[n] for n in names}, names, it, time.perf_counter() - t0, cost,
                     len(rows), hist, {n: float(min(x, sg)) for n, x, sg in zip(names, post, sig)})


def fit(runs: Runs, names: Sequence[str] | None = None, *, start: dict[str, float] | None = None,
        from_prior: bool = True, prior: str | Mapping[str, float] = "physics", max_iter: int = 25,
        progress: Callable[[str], None] | None = None, prior_sd: Mapping[str, float] | None = None,
        noise: float = NOISE) -> tuple[dict[str, float], list[FitResult]]:
    """Fit ``names`` (default: every parameter the runs inform) to ``runs``.

    Parameters not fitted keep ``start`` (default: the built-in calibration). ``prior``: 'physics'
    centres each parameter's prior on its first-principles value (what the built-in calibration
    and cross-validation use: nothing fitted leaks in); 'builtin' on the built-in calibration's
    value (a few runs of one's own then refine what the development runs taught); a mapping of
    values centres each parameter it names there (e.g. a calibration fitted without the runs at
    hand), the others on their first-principles value. With ``from_prior`` the fitted ones start
    at the prior centre. ``prior_sd`` narrows the prior of each parameter it names to that standard
    deviation (units of Fittable.sigma; never wider than the physics one) and ``noise`` is the
    per-run scatter the step-time data term assumes: a refinement of a calibrated centre passes
    ``refinement(calibration)`` (see there). Returns (all values, one FitResult per target fitted)."""
    from meshplan.calibration.store import builtin
    base = dict(builtin().values)
    if start:
        base.update(start)
    results = []
    for target in ("time", "memory"):
        default = default_names(runs, target)
        chosen = [n for n in (default if names is None else names) if fittable(n).target == target]
        if not chosen or not runs.measured(target).any():
            continue
        init = dict(base)
        centre = (dict(prior) if not isinstance(prior, str)
                  else dict(builtin().values) if prior == "builtin" else {})
        for n in chosen:
            f = fittable(n)
            init[n] = centre.get(n, f.prior) if from_prior or n not in init else init[n]
        res = _fit(runs, chosen, init, target, max_iter, progress, centre, prior_sd, noise)
        base.update(res.values)
        results.append(res)
    return base, results


def fit_as_calibrate(runs: Runs, names: Sequence[str] | None = None, *, prior: str = "builtin",
                     start: dict[str, float] | None = None) -> tuple[dict[str, float], list[FitResult]]:
    """The runs fit of `meshplan calibrate` (also `train --replan-after`'s): ``prior`` 'builtin'
    refines the built-in calibration with its posterior as the prior (``refinement_of``);
    'physics' fits from first-principles priors (from them, unless ``start`` gives values, e.g.
    the micro-benchmarks'). Returns (the fitted values only, one FitResult per target)."""
    from meshplan.calibration.store import builtin
    if names is None:  # every parameter the runs inform, and the codebase's own (one codebase's runs)
        names = [n for t in ("time", "memory") for n in default_names(runs, t)]
        names += [n for n in codebase_names() if runs.measured(fittable(n).target).any()]
    full, results = fit(runs, names, start=start or None, prior=prior, from_prior=prior == "physics" and not start,
                        **(refinement_of(builtin()) if prior == "builtin" else {}))
    return {n: full[n] for r in results for n in r.names}, results


def fit_info(results: Sequence[FitResult], seconds: float, mape_before: float | None,
             mape_after: float | None) -> dict[str, Any]:
    """The "fit" (and "posterior_sd") sections a calibration file carries about its runs fit:
    time, iterations, step error before and after, and what a later refinement takes as prior."""
    out: dict[str, Any] = {"fit": {
        "seconds": seconds, "iterations": {t: r.iterations for t, r in zip(("time", "memory"), results)},
        "step_mape_pct_before": None if mape_before is None else round(mape_before, 2),
        "step_mape_pct_after": None if mape_after is None else round(mape_after, 2)}}
    if results:
        out["posterior_sd"] = {n: round(v, 5) for r in results for n, v in r.posterior_sd.items()}
    return out


@dataclass
class Fold:
    source_id: str
    n: int
    errors_pct: list[float]
    oom: list[tuple[bool, bool]]
    """(measured fits, predicted fits) of the source's runs with a fit outcome."""
    mem_errors_pct: list[float]
    values: dict[str, float]
    seconds: float
    posterior_sd: dict[str, float] = field(default_factory=dict)
    """The fold's fit's FitResult.posterior_sd (what a refinement of ``values`` takes as its prior)."""
    mem_measures: list[str] = field(default_factory=list)
    """What each of mem_errors_pct measured: allocated, reserved or nvidia-smi (cases.memory_measure)."""
    oom_risk: list[float] = field(default_factory=list)
    """P(out of memory) of the runs of ``oom`` (after oom_verdicts; empty before)."""
    max_oom_risk: list[float] = field(default_factory=list)
    """Each of those runs' CostParams.max_oom_risk: above it, a plan that fits is 'at-risk'."""

    def summary(self) -> dict[str, Any]:
        e = np.abs(np.array(self.errors_pct)) if self.errors_pct else None
        out: dict[str, Any] = {
            "source_id": self.source_id, "n": self.n,
            "step_rows": len(self.errors_pct),
            "step_mape_pct": None if e is None else round(float(e.mean()), 2),
            "max_abs_error_pct": None if e is None else round(float(e.max()), 2),
            "step_bias_pct": None if e is None else round(float(np.mean(self.errors_pct)), 2),
            "memory_mape_pct": (round(float(np.mean(np.abs(self.mem_errors_pct))), 2)
                                if self.mem_errors_pct else None),
            "memory_mape_pct_by_measure": _by_measure(self.mem_errors_pct, self.mem_measures),
            "seconds": round(self.seconds, 1)}
        if any(not m for m, _ in self.oom):
            ok = sum(m == p for m, p in self.oom)
            out["oom_accuracy_pct"] = round(100 * ok / len(self.oom), 1)
            out["oom_runs"] = sum(not m for m, _ in self.oom)
            out["oom_predicted_to_fit"] = sum((not m) and p for m, p in self.oom)
        return out


_RUNS: Runs | None = None
"""The runs of a parallel cross-validation (set before the worker processes fork)."""


def _fold(runs: Runs, s: str, names: Sequence[str] | None, max_iter: int) -> Fold:
    t0 = time.perf_counter()
    test = np.nonzero(runs.source == s)[0]
    train = runs.subset(np.nonzero(runs.source != s)[0])
    vals, res = fit(train, names, max_iter=max_iter)
    t, m, u = predict(runs, vals, test)
    mem_all = runs.mem if runs.mem_reported is None else runs.mem_reported
    step, mem, fits = runs.step[test], mem_all[test], runs.fits[test]
    has_t, has_m = ~np.isnan(step), ~np.isnan(mem)
    err = ((t[has_t] / step[has_t] - 1) * 100).tolist()
    merr = ((m[has_m] / mem[has_m] - 1) * 100).tolist()
    kinds = [memory_measure(runs.cases[i]) for i in test[has_m]]
    oom = [(bool(f > 0), bool(mm <= uu)) for f, mm, uu in zip(fits, m, u) if f != 0]
    return Fold(s, len(test), err, oom, merr, vals, time.perf_counter() - t0,
                {n: v for r in res for n, v in r.posterior_sd.items()}, kinds)


def _by_measure(errors: Sequence[float], kinds: Sequence[str]) -> dict[str, float]:
    """Mean absolute memory error by what the rows measured (allocated, reserved, nvidia-smi)."""
    out: dict[str, float] = {}
    for k in dict.fromkeys(kinds):
        e = [abs(x) for x, kk in zip(errors, kinds) if kk == k]
        out[k] = round(float(np.mean(e)), 2)
    return out


def _fold_in_worker(args: tuple[str, Sequence[str] | None, int]) -> Fold:
    assert _RUNS is not None
    return _fold(_RUNS, *args)


def cross_validate(runs: Runs, names: Sequence[str] | None = None, *, max_iter: int = 25,
                   progress: Callable[[str], None] | None = None, workers: int | None = None) -> list[Fold]:
    """Leave one source out: fit on the other sources (from the priors), predict the one left out.
    The folds are independent: with ``workers`` > 1 (default: the CPUs, where processes can fork)
    they run in parallel processes."""
    global _RUNS
    sources = list(dict.fromkeys(runs.source.tolist()))
    n = min(len(sources), workers if workers is not None else (os.cpu_count() or 1))
    jobs = [(s, names, max_iter) for s in sources]
    if n > 1 and "fork" in mp.get_all_start_methods():
        _RUNS = runs
        try:
            with mp.get_context("fork").Pool(n) as pool:
                folds = pool.map(_fold_in_worker, jobs, chunksize=1)
        finally:
            _RUNS = None
    else:
        folds = [_fold(runs, *job) for job in jobs]
    if progress:
        for fold in folds:
            sm = fold.summary()
            progress(f"  left out {fold.source_id}: {fold.n} runs, step MAPE {sm['step_mape_pct']}%, "
                     f"{fold.seconds:.1f} s")
    return folds


def pooled(folds: Sequence[Fold]) -> dict[str, Any]:
    """Every run predicted by the fold that left its source out, pooled."""
    e = np.abs(np.array([x for f in folds for x in f.errors_pct]))
    oom = [x for f in folds for x in f.oom]
    big = [f for f in folds if len(f.errors_pct) >= 3]
    risk = [(m, r, cap) for f in folds for (m, _), r, cap in zip(f.oom, f.oom_risk, f.max_oom_risk)]
    ran = [r for m, r, _ in risk if m]
    died = [(r, cap) for m, r, cap in risk if not m]
    verdicts = {} if not risk else {
        "oom_runs": len(died),
        "oom_called_at_risk_or_does_not_fit": sum(r > cap for r, cap in died),
        "trained_runs": len(ran),
        "trained_called_does_not_fit_pct": round(100 * sum(r >= 0.5 for r in ran) / len(ran), 1) if ran else None}
    return {"step_mape_pct": round(float(e.mean()), 2) if len(e) else None,
            "max_abs_error_pct": round(float(e.max()), 2) if len(e) else None,
            "worst_source_mape_pct": (round(max(float(np.mean(np.abs(f.errors_pct))) for f in big), 2)
                                      if big else None),
            "mean_source_mape_pct": (round(float(np.mean([np.mean(np.abs(f.errors_pct)) for f in big])), 2)
                                     if big else None),
            "oom_accuracy_pct": (round(100 * sum(m == p for m, p in oom) / len(oom), 1) if oom else None),
            "runs": int(sum(len(f.errors_pct) for f in folds)),
            "memory_mape_pct_by_measure": _by_measure([x for f in folds for x in f.mem_errors_pct],
                                                      [k for f in folds for k in f.mem_measures]),
            "memory_verdicts": verdicts}
