"""Out-of-sample accuracy of the cost model, and how long the calibration takes.

    python benchmarks/cross_validate.py [--runs CSV]

1. `meshplan calibrate` on every development run with first-principles priors (what the built-in
   calibration, src/meshplan/data/calibration.json, is): wall time, in-sample step MAPE, and
   whether the fit reproduces the shipped values.
2. Leave one source out (`meshplan validate --cross-validate`): each source predicted by a
   calibration fitted to the others; per source step MAPE, worst row, bias, memory MAPE and
   out-of-memory verdicts; pooled over every run.

Writes benchmarks/results/cross_validate.{json,md}. On these shared machines compare the ratio of
times within one run, not absolute seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from meshplan.calibration.bands import oom_verdicts, residuals  # noqa: E402
from meshplan.calibration.fit import cross_validate, fit, pooled, runs_from_cases, step_mape  # noqa: E402
from meshplan.calibration.store import builtin  # noqa: E402
from meshplan.validate.report import default_runs_path  # noqa: E402
from meshplan.validate.runs import load_runs  # noqa: E402

OUT = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(default_runs_path()))
    args = ap.parse_args()
    runs = runs_from_cases(load_runs(args.runs))
    t0 = time.perf_counter()
    values, results = fit(runs, prior="physics")
    fit_s = time.perf_counter() - t0
    shipped = builtin().values
    drift = {k: abs(values[k] / shipped[k] - 1) for k in shipped if k in values and shipped[k]}
    t0 = time.perf_counter()
    folds = cross_validate(runs)
    res = residuals(runs, folds)
    oom_verdicts(res, folds)  # each source's verdicts with the other sources' bands
    cv_s = time.perf_counter() - t0
    doc = {
        "runs": len(runs), "sources": len(set(runs.source.tolist())),
        "calibrate_all_seconds": round(fit_s, 1),
        "calibrate_iterations": {t: r.iterations for t, r in zip(("time", "memory"), results)},
        "in_sample_step_mape_pct": round(step_mape(runs, values), 2),
        "refit_vs_shipped_max_rel_diff": round(max(drift.values()), 4) if drift else None,
        "cross_validate_seconds": round(cv_s, 1),
        "cross_validation": [f.summary() for f in folds],
        "pooled": pooled(folds),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "cross_validate.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# Out-of-sample accuracy (leave one source out)", "",
             f"`python benchmarks/cross_validate.py`: {doc['runs']} runs from {doc['sources']} sources. Each source is "
             "predicted by a calibration fitted to the other sources only (first-principles priors; nothing "
             "fitted to the source leaks in).", "",
             "| source | runs | step MAPE | worst run | bias | memory MAPE | OOM verdicts right |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def f(x, fmt=".1f", suffix="%"):
        return "-" if x is None else format(x, fmt) + suffix
    for e in doc["cross_validation"]:
        oom = (f"{e['oom_accuracy_pct']:.0f}% ({e['oom_runs']} OOM runs, {e['oom_predicted_to_fit']} predicted to fit)"
               if "oom_accuracy_pct" in e else "-")
        lines.append(f"| {e['source_id']} | {e['n']} | {f(e['step_mape_pct'])} | {f(e['max_abs_error_pct'])} | "
                     f"{f(e['step_bias_pct'], '+.1f')} | {f(e['memory_mape_pct'])} | {oom} |")
    p = doc["pooled"]
    lines += ["", f"Pooled over {p['runs']} runs: step MAPE {f(p['step_mape_pct'])}; mean of the sources with 3+ "
              f"runs {f(p['mean_source_mape_pct'])}, worst source {f(p['worst_source_mape_pct'])}; OOM verdicts "
              f"right {f(p['oom_accuracy_pct'])}.", "",
              f"Calibrating on all {doc['runs']} runs: {doc['calibrate_all_seconds']} s (in-sample step MAPE "
              f"{doc['in_sample_step_mape_pct']}%; largest relative difference from the shipped calibration "
              f"{doc['refit_vs_shipped_max_rel_diff']}). Cross-validation: {doc['cross_validate_seconds']} s."]
    (OUT / "cross_validate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
