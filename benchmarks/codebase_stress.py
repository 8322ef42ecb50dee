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

SOURCES = ("TT_2412_H100", "MOSAIC_LLMFOUNDRY", "BLOOM_PREQ_0225", "NEMO_2407_H100", "MEG_SC21_T1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "codebase_stress.json"))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--memory", action="store_true", help="the memory half (+15%% peaks)")
    args = ap.parse_args()
    if args.memory:
        return memory_half(args)
    from meshplan.calibration.fit import fit_as_calibrate, predict, runs_from_cases
    from meshplan.calibration.store import builtin
    from meshplan.cli.calibrate_cmd import _cases
    from meshplan.validate.report import default_runs_path
    cases = _cases(str(default_runs_path()))
    base = dict(builtin().values)
    rows = []
    for src in SOURCES:
        runs = runs_from_cases([c for c in cases if c.source_id == src])
        timed = np.nonzero(np.isfinite(runs.step))[0]
        for seed in range(args.seeds):
            pick = np.random.default_rng(seed).choice(timed, 3, replace=False)
            rest = np.array([i for i in timed if i not in pick])[:30]
            as_is, _ = fit_as_calibrate(runs.subset(pick))
            slow, _ = fit_as_calibrate(dataclasses.replace(runs, step=runs.step * 1.25).subset(pick))
            t0, _, _ = predict(runs, {**base, **as_is}, rest)
            t1, _, _ = predict(runs, {**base, **slow}, rest)
            dev = np.abs(t1 / t0 / 1.25 - 1) * 100
            rows.append({"source": src, "seed": seed, "rest": len(rest), "mean_dev_pct": round(float(dev.mean()), 2),
                         "max_dev_pct": round(float(dev.max()), 2),
                         "codebase_speed_all": slow.get("codebase_speed@all")})
            print(rows[-1], flush=True)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"commit": rev, "rows": rows, "mean_dev_pct": round(float(np.mean([r["mean_dev_pct"] for r in rows])), 2),
           "max_dev_pct": max(r["max_dev_pct"] for r in rows)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"mean {out['mean_dev_pct']}%, worst {out['max_dev_pct']}% -> {args.out}")


MEMORY_SOURCES = ("TT_2412_H100", "MCORE_FT_H100_SMALL")


def memory_half(args: argparse.Namespace) -> None:
    from meshplan.calibration.fit import fit_as_calibrate, predict, runs_from_cases
    from meshplan.calibration.store import builtin
    from meshplan.cli.calibrate_cmd import _cases
    from meshplan.validate.report import default_runs_path
    cases = _cases(str(default_runs_path()))
    base = dict(builtin().values)
    rows = []
    for src in MEMORY_SOURCES:
        runs = runs_from_cases([c for c in cases if c.source_id == src])
        measured = np.nonzero(np.isfinite(runs.mem))[0]
        big = dataclasses.replace(runs, mem=runs.mem * 1.15,
                                  mem_reported=None if runs.mem_reported is None else runs.mem_reported * 1.15)
        for seed in range(args.seeds):
            pick = np.random.default_rng(seed).choice(measured, 3, replace=False)
            rest = np.array([i for i in measured if i not in pick])[:30]
            as_is, _ = fit_as_calibrate(runs.subset(pick))
            bigger, _ = fit_as_calibrate(big.subset(pick))
            _, m0, _ = predict(runs, {**base, **as_is}, rest)
            _, m1, _ = predict(runs, {**base, **bigger}, rest)
            dev = np.abs(m1 / m0 / 1.15 - 1) * 100
            rows.append({"source": src, "seed": seed, "rest": len(rest), "mean_dev_pct": round(float(dev.mean()), 2),
                         "max_dev_pct": round(float(dev.max()), 2), "codebase_memory": bigger.get("codebase_memory")})
            print(rows[-1], flush=True)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"commit": rev, "half": "memory (+15% peaks)", "rows": rows,
           "mean_dev_pct": round(float(np.mean([r["mean_dev_pct"] for r in rows])), 2),
           "max_dev_pct": max(r["max_dev_pct"] for r in rows)}
    dest = args.out if args.out != str(Path(__file__).parent / "results" / "codebase_stress.json") \
        else str(Path(__file__).parent / "results" / "codebase_stress_memory.json")
    Path(dest).write_text(json.dumps(out, indent=1) + "\n")
    print(f"mean {out['mean_dev_pct']}%, worst {out['max_dev_pct']}% -> {dest}")


if __name__ == "__main__":
    main()
