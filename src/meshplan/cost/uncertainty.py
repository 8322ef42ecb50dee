"""How sure an estimate is: step-time and peak-memory bands, the chance of running out of
memory, and the three-level verdict (fits / at-risk / does-not-fit).

The bands are not guessed: they are the spread of the cost model's *out-of-sample* errors.
``meshplan calibrate --bands`` (and the built-in calibration) predicts every development run
with a calibration fitted to the other sources only (leave one source out) and stores

- for step time, per kind of plan (with or without a pipeline, where the residuals differ), the
  5th and 95th percentiles of log(measured / predicted): the 90% band is
  ``[t x exp(q05), t x exp(q95)]``;
- for peak memory, per implementation profile (a codebase's accounting differs: Megatron-
  DeepSpeed's ran ~20% above the model, NeMo's below it), the mean ``mu`` and spread ``sigma``
  of log(true peak / predicted peak), fitted by maximum likelihood to the measured peaks and to
  the out-of-memory outcomes (a run that ran out of memory says the true peak exceeded the
  usable memory; one that ran, that it did not), with the pooled value as a prior.

The chance of running out of memory is then
``P(OOM) = 1 - Phi((log(usable / peak) - mu) / sigma)``, and the verdict

- ``does-not-fit``: P(OOM) >= 1/2 (the bias-corrected peak exceeds the usable memory);
- ``at-risk``: it fits, but P(OOM) > ``CostParams.max_oom_risk`` (default 5%) or it leaves less
  than ``CostParams.headroom_gib`` free; meshplan does not recommend it by default;
- ``fits``: otherwise.

The step band's width also depends on how well meshplan knows the codebase
(``CostParams.band_basis``, issue 28): a built-in profile takes the bands above, fitted on the
named codebases; a codebase meshplan has no evidence for (a profile file, runs whose framework it
does not recognise) takes the **unknown** band, the 5th/95th percentiles of every development
source's step error when it is predicted blind (its framework, attention and kernel cells hidden)
by the calibration fitted without it; a codebase calibrated on K of its own runs takes the band of
the blind few-shot benchmark at that K (the held-out runs' errors after the K-run fit), ``KNOWLEDGE``.
Both come from ``meshplan validate --cross-validate --shots 0,1,3,5 --blind`` (written by
benchmarks/blind_bands.py). Where the calibration carries no such band, a calibration of the
user's own runs shrinks the built-in band by what it earned on them (``CostParams.band_scale``: its
step error after the fit over before, never below ``MIN_BAND_SCALE``). Pure numpy: no torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from meshplan.builtin_calibration import builtin_calibration

Z95 = 1.6448536269514722
"""One-sided 95% quantile of the standard normal: peak_memory_gib_high is the 95th percentile."""
MIN_BAND_SCALE = 0.9
"""A calibration shrinks the bands by at most 10%: its in-sample gain overstates what it earns on
plans it has not measured. Measured by benchmarks/few_shot.py: refined on 3 (5) runs of a source,
the held-out step error is 0.93 (0.91) of the uncalibrated one, pooled over the development
sources (5.4% and 5.3% vs 5.8%)."""
PIPELINE, NO_PIPELINE = "pipeline", "no-pipeline"
POOLED = "*"
ALIASES = {"meshplan": "torchtitan"}
"""Profiles without memory evidence of their own that share another's stack: meshplan's runtime
is FSDP2/DTensor on torch's caching allocator, as torchtitan is (whose runs measured
torch.cuda.max_memory_reserved)."""

KNOWLEDGE = ("unknown", "k1", "k3", "k5")
"""The step bands by how well the codebase is known (CostParams.band_basis other than 'profile'):
never seen (blind, K = 0), or calibrated on 1, 3, 5 of its runs."""
KNOWLEDGE_WORDS = {"profile": "the named codebases' leave-one-source-out errors",
                   "unknown": "an unknown codebase: the spread across codebases, blind",
                   "k1": "a codebase calibrated on 1 of its runs (blind few-shot, K = 1)",
                   "k3": "a codebase calibrated on 3 of its runs (blind few-shot, K = 3)",
                   "k5": "a codebase calibrated on 5+ of its runs (blind few-shot, K = 5)"}


def knowledge_for_runs(k: int) -> str:
    """The knowledge band of a calibration on ``k`` timed runs of one codebase: the largest measured
    K not above k (fewer runs: the wider band); 0 runs: 'unknown'."""
    k = int(k)
    return "unknown" if k < 1 else "k1" if k < 3 else "k3" if k < 5 else "k5"


# Used only when the calibration carries no bands (a broken install): wide, conservative.
_FALLBACK_STEP = (-0.15, 0.15)
_FALLBACK_MEMORY = (0.05, 0.15)


@dataclass(frozen=True)
class Bands:
    step: dict[str, tuple[float, float]]
    """plan kind -> (log q05, log q95) of measured / predicted step time."""
    memory: dict[str, tuple[float, float]]
    """profile (or POOLED) -> (mu, sigma) of log(true / predicted peak memory)."""
    knowledge: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """KNOWLEDGE key -> (log q05, log q95) of measured / predicted step time (blind, out of sample)."""

    def step_log(self, kind: str) -> tuple[float, float]:
        return self.step.get(kind) or self.step.get(POOLED) or _FALLBACK_STEP

    def knowledge_log(self, basis: str) -> tuple[float, float] | None:
        """The knowledge band of ``basis`` (None: 'profile', or a calibration without that band)."""
        return None if basis == "profile" else self.knowledge.get(basis)

    def memory_log(self, profile: str | None) -> tuple[float, float]:
        return self.memory.get(self.memory_group(profile), _FALLBACK_MEMORY)

    def memory_group(self, profile: str | None) -> str:
        """Which group's evidence a profile's memory band comes from: its own, its alias's, or POOLED."""
        name = profile or "meshplan"
        for key in (name, ALIASES.get(name)):
            if key is not None and key in self.memory:
                return key
        return POOLED

    def to_dict(self) -> dict[str, Any]:
        def quantiles(d: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
            return {k: {"log_q05": round(a, 5), "log_q95": round(b, 5)} for k, (a, b) in d.items()}
        out = {"step": quantiles(self.step),
               "memory": {k: {"mu": round(a, 5), "sigma": round(b, 5)} for k, (a, b) in self.memory.items()}}
        if self.knowledge:
            out["knowledge"] = quantiles(self.knowledge)
        return out


def bands_from_dict(d: dict[str, Any] | None) -> Bands | None:
    if not d:
        return None
    try:
        step = {k: (float(v["log_q05"]), float(v["log_q95"])) for k, v in d.get("step", {}).items()}
        mem = {k: (float(v["mu"]), float(v["sigma"])) for k, v in d.get("memory", {}).items()}
        know = {k: (float(v["log_q05"]), float(v["log_q95"])) for k, v in d.get("knowledge", {}).items()
                if k in KNOWLEDGE}
    except (KeyError, TypeError, ValueError):
        return None
    if any(not (a <= 0 <= b) for a, b in step.values()) or any(s <= 0 for _, s in mem.values()) \
            or any(not a < b for a, b in know.values()):
        return None
    return Bands(step, mem, know)


@lru_cache(maxsize=1)
def builtin_bands() -> Bands:
    """The bands of the built-in calibration (meshplan/data/calibration.json, "uncertainty")."""
    b = bands_from_dict(builtin_calibration().get("uncertainty"))
    return b if b is not None else Bands({POOLED: _FALLBACK_STEP}, {POOLED: _FALLBACK_MEMORY})


def _erf(x: np.ndarray) -> np.ndarray:
    """Vectorised erf (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7)."""
    x = np.asarray(x, dtype=float)
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
               + 0.254829592) * t * np.exp(-a * a)
    return s * y


def normal_cdf(z: Any) -> np.ndarray:
    return 0.5 * (1.0 + _erf(np.asarray(z, dtype=float) / math.sqrt(2.0)))


def step_band(step_s: Any, pp: Any, p: Any, bands: Bands | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(low, high): the 90% band of the step time: by how well the codebase is known
    (p.band_basis, where the calibration carries that band), else by plan kind (pipeline or not)."""
    b = bands or builtin_bands()
    step = np.asarray(step_s, dtype=float)
    know = b.knowledge_log(str(getattr(p, "band_basis", "profile")))
    if know is not None:
        return step * math.exp(know[0]), step * math.exp(know[1])
    pipe = np.broadcast_to(np.asarray(pp) > 1, step.shape)
    lo_p, hi_p = b.step_log(PIPELINE)
    lo_n, hi_n = b.step_log(NO_PIPELINE)
    k = float(p.band_scale)
    lo = np.where(pipe, lo_p, lo_n) * k
    hi = np.where(pipe, hi_p, hi_n) * k
    return step * np.exp(lo), step * np.exp(hi)


def memory_params(p: Any, bands: Bands | None = None) -> tuple[float, float]:
    """(mu, sigma) of log(true / predicted peak) for ``p``'s profile. A calibration's band_scale
    does not narrow it: what a calibration earns is measured on step times."""
    return (bands or builtin_bands()).memory_log(getattr(p, "profile", None))


def memory_high(peak_gib: Any, p: Any, bands: Bands | None = None) -> np.ndarray:
    """The 95th percentile of the true peak memory, GiB."""
    mu, sigma = memory_params(p, bands)
    return np.asarray(peak_gib, dtype=float) * math.exp(mu + Z95 * sigma)


def oom_probability(peak_gib: Any, usable_gib: float, p: Any, bands: Bands | None = None) -> np.ndarray:
    """The chance that the true peak exceeds the usable memory."""
    mu, sigma = memory_params(p, bands)
    peak = np.maximum(np.asarray(peak_gib, dtype=float), 1e-9)
    return 1.0 - normal_cdf((np.log(usable_gib / peak) - mu) / sigma)


def verdicts(peak_gib: Any, usable_gib: float, p: Any,
             bands: Bands | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fits, at_risk, P(OOM)): fits = not does-not-fit; at_risk = fits but not safe enough to
    recommend under ``p.max_oom_risk`` and ``p.headroom_gib``."""
    prob = oom_probability(peak_gib, usable_gib, p, bands)
    fits = prob < 0.5
    tight = (usable_gib - np.asarray(peak_gib, dtype=float)) < float(p.headroom_gib)
    return fits, fits & ((prob > float(p.max_oom_risk)) | tight), prob


def verdict(fits: bool, at_risk: bool) -> str:
    return "does-not-fit" if not fits else "at-risk" if at_risk else "fits"


def memory_policy_words(p: Any, headroom: bool = True, bands: Bands | None = None) -> str:
    """One line: the memory band ``p``'s profile takes and where it comes from, then the policy
    (``headroom`` False: --no-headroom, every plan that fits is listed)."""
    b = bands or builtin_bands()
    mu, sigma = memory_params(p, b)
    group = b.memory_group(getattr(p, "profile", None))
    policy = (f"recommended only with P(OOM) <= {100 * float(p.max_oom_risk):g}%"
              + (f" and at least {float(p.headroom_gib):g} GiB free" if float(p.headroom_gib) > 0 else "")
              if headroom else "--no-headroom: every plan that fits is listed")
    return (f"peak memory bias {100 * (math.exp(mu) - 1):+.1f}%, spread {100 * sigma:.1f}% "
            f"({'all codebases' if group == POOLED else group + ' runs'}); {policy}")


def normal_quantile(q: float) -> float:
    """Inverse of normal_cdf (bisection; q in (0, 1))."""
    q = min(max(float(q), 1e-12), 1 - 1e-12)
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float(normal_cdf(mid)) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def safe_peak_gib(usable_gib: float, p: Any, bands: Bands | None = None) -> float:
    """The largest predicted peak a recommended plan may have: its chance of running out of memory
    at most p.max_oom_risk, and p.headroom_gib left free."""
    mu, sigma = memory_params(p, bands)
    risk = float(p.max_oom_risk)
    by_risk = usable_gib if risk >= 0.5 else usable_gib * math.exp(-mu - sigma * normal_quantile(1 - risk))
    return min(by_risk, usable_gib - float(p.headroom_gib))


def risk_words(p: Any) -> str:
    """What makes a plan at risk, in words (the policy)."""
    out = f"its chance of running out of memory is above {100 * float(p.max_oom_risk):g}%"
    if float(p.headroom_gib) > 0:
        out += f", or it leaves less than {float(p.headroom_gib):g} GiB free"
    return out


def risk_reason(peak_gib: float, usable_gib: float, prob: float, p: Any) -> str:
    """Why this plan is at risk: its chance of running out of memory over the allowed one, or too
    little free memory for --headroom (or both)."""
    out = []
    if prob > float(p.max_oom_risk):
        for digits in range(4):  # never "a 5% chance ... over the 5% allowed": as many digits as tell them apart
            pct = f"{100 * prob:.{digits}f}"
            if float(pct) > 100 * float(p.max_oom_risk):
                break
        out.append(f"a {pct}% chance of running out of memory, over the {100 * float(p.max_oom_risk):g}% "
                   "allowed (--max-oom-risk)")
    free = usable_gib - peak_gib
    if free < float(p.headroom_gib):
        out.append(f"{free:.1f} GiB free, under the {float(p.headroom_gib):g} GiB asked (--headroom)")
    return " and ".join(out) or f"a {100 * prob:.1f}% chance of running out of memory"


def policy_flag(peak_gib: float, usable_gib: float, prob: float, p: Any) -> str:
    """The flag that would accept this at-risk plan."""
    flags = []
    if prob > float(p.max_oom_risk):
        flags.append(f"--max-oom-risk {min(0.49, math.ceil(100 * prob + 1) / 100):g}")
    if usable_gib - peak_gib < float(p.headroom_gib):
        flags.append(f"--headroom {max(0.0, math.floor(usable_gib - peak_gib)):g}")
    return " ".join(flags) + " or --no-headroom" if flags else "--no-headroom"
