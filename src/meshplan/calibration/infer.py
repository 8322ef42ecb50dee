"""Which codebase ran these runs? Profile inference for `meshplan calibrate` (issue 28, item 1).

A user's runs come from a codebase that is none of the built-in profiles exactly: a fork with its
own kernels, overlaps and buffers. Its discrete implementation settings (cost.profile.PROFILE_FIELDS:
attention kernel, elementwise fusion, gradient-sync overlap, main-gradient dtype, loss kernel,
pipeline-send overlap, ...) are inferred together with the continuous parameters:

1. every built-in profile is a candidate; then, from the best, one setting at a time is changed to
   each of its other values (a coordinate search over the grid of ``SETTINGS``) and kept where it
   raises the posterior, until no single change does;
2. each candidate is scored by the maximum a posteriori fit of the codebase's own continuous
   parameters (calibration.space.CODEBASE: speed per kind of work and a per-step overhead, loose
   priors) and the memory parameters, on the runs' step times and peak memory, with the
   out-of-memory runs as censored observations (their true peak above the usable memory: the
   fit's hinge). The hardware parameters stay at the built-in calibration (their physical
   priors are not the codebase's to move). Score = -cost / 2 of that fit: the log posterior at its
   mode, up to a constant shared by every candidate (the same runs, data terms and priors);
3. the output names the best candidate, the next best ones and the likelihood ratio
   exp(score_best - score_other) ("how sure"), and suggests the run that would best tell the top
   two apart: among neighbours of the user's own plans (each degree doubled or halved against
   dp, the micro-batch doubled or halved, the other recomputation, the other ZeRO levels), the one
   that fits under both and whose predicted step times differ the most.

A row's own cells (e.g. an attention_impl cell) are facts about that run and stay on top of any
candidate (RunCase.overrides).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshplan.cost.profile import PROFILE_FIELDS, PROFILES, get_profile
from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX

#: The discrete settings searched, each over its values (the grid). Settings that only move memory
#: are informed by peaks and out-of-memory outcomes; the rest by step times.
SETTINGS: dict[str, tuple[Any, ...]] = {
    "attention_kernel": ("flash2", "sdpa", "cudnn", "flash3", "triton", "eager", "fused-softmax"),
    "elementwise_kernels": tuple(PROFILE_FIELDS["elementwise_kernels"]),
    "dp_overlap": (True, False),
    "param_gather_overlap": (True, False),
    "main_grads": tuple(PROFILE_FIELDS["main_grads"]),
    "loss_kernel": tuple(PROFILE_FIELDS["loss_kernel"]),
    "logits_fp32": (True, False),
    "pp_p2p_overlap": tuple(PROFILE_FIELDS["pp_p2p_overlap"]),
}
MIN_GAIN = 0.5
"""A setting change is kept only if it raises the log posterior by this much (a likelihood ratio
of e^0.5 = 1.6): a change the runs cannot tell apart keeps the profile's value."""


@dataclass(frozen=True)
class Candidate:
    """One profile (a built-in one plus changed settings) and how well it explains the runs."""

    profile: str
    settings: dict[str, Any]
    """Settings changed from the profile's own."""
    score: float
    """Log posterior at the fit's mode (-cost / 2), up to a shared constant."""
    values: dict[str, float]
    """The fitted continuous parameters."""

    @property
    def label(self) -> str:
        ch = ", ".join(f"{k}={_txt(v)}" for k, v in self.settings.items())
        return self.profile + (f" with {ch}" if ch else "")


def _txt(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def runs_as(runs: Any, profile: str, settings: dict[str, Any]) -> Any:
    """``runs`` (calibration.fit.Runs) with every run's CostParams rebuilt as ``profile`` plus
    ``settings``, the run's own cells (RunCase.overrides) on top."""
    from meshplan.cost.params import DEFAULT_PARAMS
    prof = get_profile(profile)
    bases = []
    for c in runs.cases:
        p = prof.apply(DEFAULT_PARAMS).replace(**settings)
        bases.append(p.replace(**getattr(c, "overrides", {})) if getattr(c, "overrides", None) else p)
    return dataclasses.replace(runs, bases=bases)


SCREEN = ("codebase_speed@all",)
"""The codebase parameter each candidate is screened with (a profile likelihood over one speed
factor: a uniform slowdown is not evidence for any setting); the best ones are refitted with
every codebase parameter (``full``)."""


def score(runs: Any, profile: str, settings: dict[str, Any], full: bool = False,
          cache: dict[Any, Any] | None = None) -> Candidate:
    """Fit the codebase's speed (``full``: every codebase parameter) and the memory parameters under
    one candidate; its log posterior at the mode. ``cache``: a candidate whose predictions of these
    runs (step times, or peaks) equal an earlier one's under the built-in calibration gets that
    one's fit of that target (the same data, the same fit)."""
    import numpy as np

    from meshplan.calibration.fit import codebase_names, default_names, fit, predict
    from meshplan.calibration.store import builtin
    r = runs_as(runs, profile, settings)
    t, m, _ = predict(r, dict(builtin().values))
    cost, fitted = 0.0, {}
    for target, pred, names in (
            ("time", t, (codebase_names() if full else list(SCREEN))), ("memory", m, default_names(r, "memory"))):
        if not r.measured(target).any() or not names:
            continue
        key = (target, full, tuple(np.round(pred, 9).tolist()))
        hit = None if cache is None else cache.get(key)
        if hit is None:
            values, results = fit(r, names, prior="builtin", from_prior=True, max_iter=15 if full else 8)
            hit = (sum(x.cost for x in results), {n: values[n] for x in results for n in x.names})
            if cache is not None:
                cache[key] = hit
        cost += hit[0]
        fitted.update(hit[1])
    return Candidate(profile, dict(settings), -0.5 * cost, fitted)


def infer(runs: Any, profiles: Sequence[str] | None = None,
          progress: Callable[[str], None] | None = None) -> list[Candidate]:
    """Candidates, best first: every profile, then the best one's coordinate search over SETTINGS."""
    if not (runs.measured("time").any() or runs.measured("memory").any()):
        raise MeshplanError("profile inference needs runs with a measured step time, peak memory or "
                            "out-of-memory outcome", hint="add such runs to --runs, or pass --no-infer")
    seen: dict[str, Candidate] = {}
    cache: dict[Any, Any] = {}

    def add(c: Candidate) -> Candidate:
        seen[c.label] = c
        return c

    for name in profiles or list(PROFILES):
        add(score(runs, name, {}, cache=cache))
        if progress:
            progress(f"  profile {name}: log posterior {seen[name].score:.2f}")
    best = max(seen.values(), key=lambda c: c.score)
    base_p = get_profile(best.profile).apply(_default())
    improved = True
    while improved:
        improved = False
        for key, options in SETTINGS.items():
            if not _matters(key, runs, best):
                continue
            for v in options:
                cur = best.settings.get(key, getattr(base_p, key))
                if v == cur:
                    continue
                s = dict(best.settings)
                if v == getattr(base_p, key):
                    s.pop(key, None)
                else:
                    s[key] = v
                label = Candidate(best.profile, s, 0.0, {}).label
                cand = seen.get(label) or add(score(runs, best.profile, s, cache=cache))
                if cand.score > best.score + MIN_GAIN:
                    best, improved = cand, True
                    if progress:
                        progress(f"  {cand.label}: log posterior {cand.score:.2f}")
    return sorted(seen.values(), key=lambda c: -c.score)


def _default() -> Any:
    from meshplan.cost.params import DEFAULT_PARAMS
    return DEFAULT_PARAMS


def _matters(key: str, runs: Any, best: Candidate) -> bool:
    """Whether ``key`` can move any of these runs (a pipeline setting needs a pipelined run, a
    data-parallel one data parallelism)."""
    plans = [c.plan for c in runs.cases if c.plan is not None]
    if key == "pp_p2p_overlap":
        return any(p.pp > 1 for p in plans)
    if key in ("dp_overlap", "param_gather_overlap"):
        return any(p.dp * p.cp > 1 for p in plans)
    if key == "main_grads":
        return any(p.zero < 3 for p in plans)
    return True


def ratio_text(best: Candidate, other: Candidate) -> str:
    """exp(score difference), readable ('12x', '>1000x')."""
    d = best.score - other.score
    return ">1000x" if d > math.log(1000) else f"{math.exp(d):.3g}x"


def _predictor(runs: Any, c: Candidate) -> Callable[[int, Any], Any]:
    """(run index, plan) -> the estimate of that plan on the run's model, cluster and workload under
    candidate ``c`` (its profile and settings, the run's own cells, its fitted values)."""
    from meshplan.calibration.store import Calibration, builtin
    from meshplan.cost import estimate
    r = runs_as(runs, c.profile, c.settings)
    cal = Calibration({**builtin().values, **c.values})

    def one(i: int, plan: Any) -> Any:
        case = runs.cases[i]
        return estimate(case.model, cal.apply_cluster(case.cluster), plan, case.work, cal.apply_params(r.bases[i]))
    return one


def _neighbourhood(runs: Any) -> list[tuple[int, Any]]:
    """(run index, plan) of every neighbour of the runs' plans, once per job and plan."""
    out, seen = [], set()
    for i, c in enumerate(runs.cases):
        if c.plan is None or c.model is None:
            continue
        job = (c.model_name, c.cluster.name, c.cluster.num_gpus, c.work.global_batch, c.work.seq_len)
        for plan in neighbours(c.plan):
            key = (job, plan.short())
            if key not in seen:
                seen.add(key)
                out.append((i, plan))
    return out


def suggest_run(runs: Any, a: Candidate, b: Candidate, cache: dict[Any, Any] | None = None) -> dict[str, Any] | None:
    """The neighbour of the runs' plans whose predicted step times under ``a`` and ``b`` differ the
    most, among those both predict to fit (and not at risk); None if there is none. ``cache`` keeps
    ``a``'s estimates between calls."""
    cache = {} if cache is None else cache
    pa, pb = _predictor(runs, a), _predictor(runs, b)
    best: dict[str, Any] | None = None
    for i, plan in _neighbourhood(runs):
        key = (a.label, i, plan.short())
        try:
            if key not in cache:
                cache[key] = pa(i, plan)
            ea = cache[key]
            if ea is None or not ea.fits or getattr(ea, "at_risk", False):
                continue
            eb = pb(i, plan)
        except MeshplanError:
            cache[key] = None
            continue
        if not eb.fits or getattr(eb, "at_risk", False):
            continue
        gap = abs(math.log(ea.step_time_s / eb.step_time_s))
        if best is None or gap > best["gap"]:
            c = runs.cases[i]
            best = {"gap": gap, "row_id": c.row_id, "model": c.model_name, "plan": plan.short(),
                    "gpus": c.cluster.num_gpus, "gpu": c.cluster.gpu.name, "global_batch": c.work.global_batch,
                    "seq_len": c.work.seq_len, "step_s": {a.label: ea.step_time_s, b.label: eb.step_time_s}}
    return best


def neighbours(plan: Any) -> list[Any]:
    """Plans one step from ``plan``: a degree doubled or halved against dp, the micro-batch doubled
    or halved, the other recomputation, another ZeRO level (each kept only if the Plan accepts it)."""
    out = []
    changes: list[dict[str, Any]] = []
    for ax in (AX.TP, AX.PP, AX.CP):
        a, dp = getattr(plan, ax), plan.dp
        if dp % 2 == 0:
            changes.append({ax: a * 2, AX.DP: dp // 2})
        if a % 2 == 0:
            changes.append({ax: a // 2, AX.DP: dp * 2})
    mb = plan.micro_batch
    changes += [{"micro_batch": mb * 2}] + ([{"micro_batch": mb // 2}] if mb > 1 else [])
    for r in ("none", "selective", "full"):
        if r != plan.recompute:
            changes.append({"recompute": r})
    for z in range(4):
        if z != plan.zero:
            changes.append({"zero": z})
    for ch in changes:
        try:
            out.append(plan.replace(**ch))
        except (MeshplanError, ValueError, TypeError):
            continue
    return out


WEAK = 3.0
"""Below this likelihood ratio over the runner-up the output calls the inference weak."""
TIE = 0.01
"""Candidates whose log posterior is within this of the best explain the runs equally well."""


def summary(cands: list[Candidate], suggestion: dict[str, Any] | None, top: int = 3) -> dict[str, Any]:
    """The calibration file's "inferred_profile" section: the best candidate, those the runs cannot
    tell from it (``tied``), the next best others with their likelihood ratios, the suggested run."""
    best = cands[0]
    tied = [c.label for c in cands[1:] if best.score - c.score <= TIE]
    rest = [c for c in cands[1:] if best.score - c.score > TIE]
    return {"profile": best.profile, "settings": {k: v for k, v in best.settings.items()},
            "label": best.label, "log_posterior": round(best.score, 3), "tied": tied,
            "next_best": [{"label": c.label, "log_posterior": round(c.score, 3),
                           "likelihood_ratio": ratio_text(best, c)} for c in rest[:top]],
            "suggested_run": None if suggestion is None else {
                k: (round(v, 4) if isinstance(v, float) else v) for k, v in suggestion.items()
                if k != "step_s"} | {"step_s": {k: round(v, 4) for k, v in suggestion["step_s"].items()}}}


def lines(info: dict[str, Any]) -> list[str]:
    """The terminal lines of an "inferred_profile" section."""
    out = [f"inferred codebase profile: {info['label']} (log posterior {info['log_posterior']:.2f})"]
    if info.get("tied"):
        shown = ", ".join(info["tied"][:6]) + (f" and {len(info['tied']) - 6} more" if len(info["tied"]) > 6 else "")
        out.append(f"  these runs cannot tell it from: {shown}")
    for c in info["next_best"]:
        out.append(f"  {c['likelihood_ratio']} more likely than {c['label']}")
    nb = info["next_best"]
    if info.get("tied") or (nb and info["log_posterior"] - nb[0]["log_posterior"] < math.log(WEAK)):
        out.append(f"  weak evidence (a likelihood ratio under {WEAK:g} against the runner-up): a guess, not a finding; "
                   "the suggested run is what would settle it")
    s = info.get("suggested_run")
    if s:
        (la, ta), (lb, tb) = list(s["step_s"].items())[:2]
        out.append(f"  to tell {la} from {lb}, run {s['model']} on {s['gpus']} x {s['gpu']} (global batch "
                   f"{s['global_batch']}, seq {s['seq_len']}) with {s['plan']}: predicted {ta:.3g} s as the first, "
                   f"{tb:.3g} s as the second ({100 * (math.exp(s['gap']) - 1):.0f}% apart)")
    elif len(info["next_best"]) + len(info.get("tied", [])):
        out.append("  no neighbour of these runs' plans that fits tells the best from the next ones apart by 1% or more")
    return out


def profile_toml(info: dict[str, Any]) -> str:
    """A profile file (docs/profiles.md) of the inferred profile: ``--profile FILE`` plans with it."""
    rows = [f'name = "inferred-{info["profile"]}"', f'label = "inferred by meshplan calibrate: {info["label"]}"',
            f'base = "{info["profile"]}"']
    for k, v in info["settings"].items():
        rows.append(f"{k} = {_txt(v) if isinstance(v, bool) else repr(v) if isinstance(v, (int, float)) else chr(34) + str(v) + chr(34)}")
    return "\n".join(rows) + "\n"


MIN_SPLIT = 0.01
"""A suggested run must predict the two candidates at least this far apart (log)."""


SUGGEST_TRIES = 12
"""At most this many runners-up (within a likelihood ratio of 1000) are tried for the suggestion."""


def infer_for_cases(runs: Any, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Inference and suggestion as the calibration file's section. The suggestion tells the best
    candidate from the closest runner-up that some neighbouring run can tell from it by at least
    MIN_SPLIT (ties that no run could tell apart, such as two kernels priced alike, are skipped)."""
    cands = infer(runs, progress=progress)
    best, sug, cache = cands[0], None, {}
    seen_pred: set[Any] = set()
    tries = 0
    for other in cands[1:]:
        if tries >= SUGGEST_TRIES or best.score - other.score > math.log(1000):
            break
        sig = (other.profile, tuple(sorted(other.settings.items())))
        if sig in seen_pred:
            continue
        seen_pred.add(sig)
        tries += 1
        found = suggest_run(runs, best, other, cache)
        if found is not None and found["gap"] >= MIN_SPLIT:
            sug = found
            break
    return summary(cands, sug)


__all__ = ["Candidate", "SETTINGS", "infer", "infer_for_cases", "lines", "neighbours", "profile_toml",
           "ratio_text", "score", "suggest_run", "summary"]
