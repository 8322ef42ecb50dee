"""Leave one source out, memory only: for each source with measured memory or an out-of-memory
outcome, fit the memory parameters (calibration.space, target 'memory') on the other sources from
their physics priors and predict the source left out. The time parameters stay the built-in ones
(memory does not depend on them), so this takes about a minute where the full
`validate --cross-validate` takes half an hour.

    PYTHONPATH=src python3 benchmarks/memory_loso.py [OUT.json]

Prints per source the out-of-sample memory error by what the rows measured (allocated, reserved,
nvidia-smi), pooled figures, the out-of-memory verdicts, and the fitted values per fold.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np


def main() -> None:
    from meshplan.calibration.fit import _by_measure, _fold, runs_from_cases
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
    out = {"parameters": names, "seconds": round(time.perf_counter() - t0, 1),
           "memory_mape_pct_by_measure": _by_measure(errs, kinds),
           "memory_mape_pct": round(float(np.mean(np.abs(errs))), 2) if errs else None,
           "oom_runs": len(died), "oom_predicted_to_fit": int(sum(died)),
           "trained_runs": len(ran), "trained_predicted_not_to_fit": int(sum(not p for p in ran)),
           "folds": [{"source_id": f.source_id, "memory_rows": len(f.mem_errors_pct),
                      "memory_mape_pct_by_measure": _by_measure(f.mem_errors_pct, f.mem_measures),
                      "memory_bias_pct": (round(float(np.mean(f.mem_errors_pct)), 2) if f.mem_errors_pct else None),
                      "values": {n: round(f.values[n], 4) for n in names}} for f in folds]}
    for f in out["folds"]:
        print(f"{f['source_id']:22s} rows {f['memory_rows']:3d}  {f['memory_mape_pct_by_measure']}  "
              f"bias {f['memory_bias_pct']}  {f['values']}")
    print("pooled:", out["memory_mape_pct_by_measure"], "all", out["memory_mape_pct"],
          f"OOM runs predicted to fit {out['oom_predicted_to_fit']}/{out['oom_runs']};",
          f"trained predicted not to fit {out['trained_predicted_not_to_fit']}/{out['trained_runs']};",
          f"{out['seconds']} s")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
