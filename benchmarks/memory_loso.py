"""Leave one source out, memory only: for each source with measured memory or an out-of-memory
outcome, fit the memory parameters (calibration.space, target 'memory') on the other sources from
their physics priors and predict the source left out. The time parameters stay the built-in ones
(memory does not depend on them), so this takes about a minute where the full
`validate --cross-validate` takes half an hour.

    PYTHONPATH=src python3 benchmarks/memory_loso.py [OUT.json] [--write-bands]

Prints per source the out-of-sample memory error by what the rows measured (allocated, reserved,
nvidia-smi), pooled figures, the out-of-memory verdicts (the point estimate's, and the band-aware
ones `validate --cross-validate` reports: each source judged with the memory bands of the other
sources, calibration.bands.oom_verdicts), and the fitted values per fold. With --write-bands the
memory bands these folds give (calibration.bands: per profile, measured peaks and censored
outcomes) replace the "memory" part of src/meshplan/data/calibration.json's uncertainty section
(the step part stays: it comes from the full cross-validation).
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np


def main() -> None:
    from meshplan.calibration.fit import _by_measure, _fold, pooled, runs_from_cases
    from meshplan.calibration.space import GLOBAL
    from meshplan.cli.calibrate_cmd import _cases
    from meshplan.validate.report import default_runs_path
    names = [f.name for f in GLOBAL if f.target == "memory"]
    runs = runs_from_cases(_cases(str(default_runs_path())))
    mem_all = runs.mem if runs.mem_reported is None else runs.mem_reported
    sources = [s for s in dict.fromkeys(runs.source.tolist())
               if np.any((runs.source == s) & (~np.isnan(mem_all) | (runs.fits != 0)))]
    t0 = time.perf_counter()
    folds = [_fold(runs, s, names, 25) for s in sources]
    errs = [x for f in folds for x in f.mem_errors_pct]
    kinds = [k for f in folds for k in f.mem_measures]
    oom = [(m, p) for f in folds for m, p in f.oom]
    died = [p for m, p in oom if not m]
    ran = [p for m, p in oom if m]
    from meshplan.calibration.bands import _memory_bands, oom_verdicts, residuals
    point = {"oom_runs": len(died), "oom_predicted_to_fit": int(sum(died)), "trained_runs": len(ran),
             "trained_predicted_not_to_fit": int(sum(not p for p in ran))}
    res = residuals(runs, folds)
    oom_verdicts(res, folds)  # band-aware: P(out of memory) >= 1/2 is 'does not fit', above max_oom_risk 'at risk'
    summary = pooled(folds)  # the verdicts as `validate --cross-validate` counts them
    verdicts = dict(summary["memory_verdicts"], oom_accuracy_pct=summary["oom_accuracy_pct"])
    bands = _memory_bands(res)
    out = {"parameters": names, "point_estimate_fits": point, "memory_verdicts": verdicts,
           "memory_bands": {k: {"mu": round(a, 5), "sigma": round(b, 5)} for k, (a, b) in bands.items()}, "seconds": round(time.perf_counter() - t0, 1),
           "memory_mape_pct_by_measure": _by_measure(errs, kinds),
           "memory_mape_pct": round(float(np.mean(np.abs(errs))), 2) if errs else None,
           "folds": [{"source_id": f.source_id, "memory_rows": len(f.mem_errors_pct),
                      "memory_mape_pct_by_measure": _by_measure(f.mem_errors_pct, f.mem_measures),
                      "memory_bias_pct": (round(float(np.mean(f.mem_errors_pct)), 2) if f.mem_errors_pct else None),
                      "values": {n: round(f.values[n], 4) for n in names}} for f in folds]}
    for f in out["folds"]:
        print(f"{f['source_id']:22s} rows {f['memory_rows']:3d}  {f['memory_mape_pct_by_measure']}  "
              f"bias {f['memory_bias_pct']}  {f['values']}")
    print("pooled:", out["memory_mape_pct_by_measure"], "all", out["memory_mape_pct"], f"{out['seconds']} s")
    print("point estimate:", point)
    print("verdicts (band-aware, out of sample):", verdicts)
    print("memory bands:", out["memory_bands"])
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if args:
        with open(args[0], "w") as fh:
            json.dump(out, fh, indent=1)
    if "--write-bands" in sys.argv:
        from pathlib import Path
        p = Path(__file__).resolve().parents[1] / "src" / "meshplan" / "data" / "calibration.json"
        cal = json.loads(p.read_text())
        cal["uncertainty"]["memory"] = out["memory_bands"]
        cal["uncertainty"]["memory_derived_from"] = (
            f"benchmarks/memory_loso.py --write-bands: leave-one-source-out memory fits of {len(runs)} runs from "
            f"{len(sources)} sources with measured peaks or out-of-memory outcomes ({len(errs)} measured peaks, "
            f"{verdicts['oom_runs']} out-of-memory runs)")
        p.write_text(json.dumps(cal, indent=1) + "\n")
        print(f"wrote the memory bands into {p}")


if __name__ == "__main__":
    main()
