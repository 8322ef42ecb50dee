"""Can `meshplan calibrate` learn a slower codebase from 3 runs? (issue 28's stress test)

Time half (default) and, with --memory, the memory half: every measured peak 15% larger, on the
sources with measured peaks the fit uses (allocated or reserved), the figure
|m_scaled / m_unscaled / 1.15 - 1| per remaining run.

For each development source: every measured step made 25% slower; `calibrate`'s fit
(calibration.fit.fit_as_calibrate, --prior builtin) on 3 runs chosen with a fixed seed, once on the
scaled and once on the unscaled runs; the remaining runs (at most 30) predicted by both. The
figure is |t_scaled / t_unscaled / 1.25 - 1| per remaining run: how far the fit failed to carry the
slowdown (the model's own error on the source cancels). Run it on any tree (it uses only
fit_as_calibrate and predict), e.g. on the commit before the codebase parameters for the before.

    PYTHONPATH=src python3 benchmarks/codebase_stress.py [--out benchmarks/results/codebase_stress.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class Half:
    """One half of the stress test: what is scaled, by how much, and which prediction carries it."""

    sources: tuple[str, ...]
    factor: float
    measured: str
    """Runs field the scaling applies to and the runs are chosen from: step or mem."""
    param: str
    """The codebase parameter the fit should move (reported per row)."""
    out: str
    label: str | None = None


TIME = Half(("TT_2412_H100", "MOSAIC_LLMFOUNDRY", "BLOOM_PREQ_0225", "NEMO_2407_H100", "MEG_SC21_T1"), 1.25,
            "step", "codebase_speed@all", "codebase_stress.json")
MEMORY = Half(("TT_2412_H100", "MCORE_FT_H100_SMALL"), 1.15, "mem", "codebase_memory",
              "codebase_stress_memory.json", "memory (+15% peaks)")


def scaled(runs, half: Half):
    """The runs with every measured step (or peak, also as reported) ``half.factor`` times larger."""
    if half.measured == "step":
        return dataclasses.replace(runs, step=runs.step * half.factor)
    rep = runs.mem_reported
    return dataclasses.replace(runs, mem=runs.mem * half.factor, mem_reported=None if rep is None else rep * half.factor)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: benchmarks/results/codebase_stress[_memory].json")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--memory", action="store_true", help="the memory half (+15%% peaks)")
    args = ap.parse_args()
    half = MEMORY if args.memory else TIME
    from meshplan.calibration.fit import fit_as_calibrate, predict, runs_from_cases
    from meshplan.calibration.store import builtin
    from meshplan.cli.calibrate_cmd import _cases
    from meshplan.validate.report import default_runs_path
    cases = _cases(str(default_runs_path()))
    base = dict(builtin().values)
    which = 0 if half.measured == "step" else 1  # predict's (step, memory, usable)
    rows = []
    for src in half.sources:
        runs = runs_from_cases([c for c in cases if c.source_id == src])
        chosen = np.nonzero(np.isfinite(getattr(runs, half.measured)))[0]
        big = scaled(runs, half)
        for seed in range(args.seeds):
            pick = np.random.default_rng(seed).choice(chosen, 3, replace=False)
            rest = np.array([i for i in chosen if i not in pick])[:30]
            as_is, _ = fit_as_calibrate(runs.subset(pick))
            moved, _ = fit_as_calibrate(big.subset(pick))
            x0 = predict(runs, {**base, **as_is}, rest)[which]
            x1 = predict(runs, {**base, **moved}, rest)[which]
            dev = np.abs(x1 / x0 / half.factor - 1) * 100
            rows.append({"source": src, "seed": seed, "rest": len(rest), "mean_dev_pct": round(float(dev.mean()), 2),
                         "max_dev_pct": round(float(dev.max()), 2),
                         half.param.replace("@", "_"): moved.get(half.param)})
            print(rows[-1], flush=True)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"commit": rev, **({"half": half.label} if half.label else {}), "rows": rows,
           "mean_dev_pct": round(float(np.mean([r["mean_dev_pct"] for r in rows])), 2),
           "max_dev_pct": max(r["max_dev_pct"] for r in rows)}
    dest = args.out or str(RESULTS / half.out)
    Path(dest).write_text(json.dumps(out, indent=1) + "\n")
    print(f"mean {out['mean_dev_pct']}%, worst {out['max_dev_pct']}% -> {dest}")


if __name__ == "__main__":
    main()
