"""`meshplan calibrate` and `meshplan validate` (with --calibration and --cross-validate)."""
from __future__ import annotations

import argparse
import datetime
import time
from typing import Any

from meshplan.errors import MeshplanError


def add_parsers(sub: Any) -> None:
    """The `validate` and `calibrate` subcommands' arguments (called from cli.main.build_parser)."""
    from meshplan.calibration.space import all_names_help
    from meshplan.cli.costing import add_cost_flags
    va = sub.add_parser("validate", help="compare the cost model with published measured runs")
    va.add_argument("--runs", help="CSV in the format of published_runs_dev.csv (default: the shipped dev set)")
    va.add_argument("--json", action="store_true", help="one JSON object on stdout")
    va.add_argument("--report", help="also write a markdown report to this file")
    add_cost_flags(va, profile=False)
    va.add_argument("--cross-validate", action="store_true",
                    help="leave one source out: for each source, fit the calibration on the other sources "
                         "and predict the one left out (the out-of-sample accuracy)")

    ca = sub.add_parser("calibrate", help="fit the cost model's named parameters to measured runs",
                        description="Fit the cost model's named, bounded parameters (GPU family efficiencies, "
                                    "kernel and link efficiencies, allocator overhead) to a runs CSV in the "
                                    "format of published_runs_dev.csv, by maximum a posteriori against "
                                    "first-principles priors. Writes a calibration file for --calibration.")
    ca.add_argument("--runs", required=True, help="measured runs CSV (format of published_runs_dev.csv)")
    ca.add_argument("--out", required=True, help="write the calibration (JSON) here")
    ca.add_argument("--fit", metavar="NAME,...",
                    help="fit only these parameters (default: every one the runs inform); names: "
                         + all_names_help())
    ca.add_argument("--prior", choices=["builtin", "physics"], default="builtin",
                    help="centre each parameter's prior on the built-in calibration (default: a few runs of your "
                         "own refine it) or on its first-principles value (how the built-in one is fitted)")
    ca.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _cases(path: str) -> list[Any]:
    from meshplan.validate.runs import load_runs
    try:
        cases = load_runs(path)
    except OSError as e:  # e.g. a name too long to stat
        raise MeshplanError(f"cannot read --runs {path}: {e.strerror or e}") from None
    if not cases:
        raise MeshplanError(f"--runs {path}: no runs (the file has no data rows)",
                            hint="use the format of published_runs_dev.csv: a header and one row per run")
    return cases


def run_calibrate(args: argparse.Namespace) -> int:
    from meshplan.calibration.fit import fit, fittable, informs, informs_any, runs_from_cases, step_mape
    from meshplan.calibration.store import Calibration, builtin, save_calibration
    from meshplan.cli.format import json_text
    cases = _cases(args.runs)
    runs = runs_from_cases(cases)
    if not len(runs):
        raise MeshplanError(f"--runs {args.runs}: no run has a measured step time, peak memory or "
                            "out-of-memory outcome that meshplan can express",
                            hint="`meshplan validate --runs FILE` says why each row is unsupported")
    names = None
    if args.fit is not None:
        names = [n.strip() for n in args.fit.split(",") if n.strip()]
        if not names:
            raise MeshplanError(f"--fit {args.fit!r} names no parameter",
                                hint="give NAME,... (see `meshplan calibrate --help`), or leave --fit out to fit "
                                     "every parameter the runs inform")
        for n in names:
            fittable(n)
        idle = [n for n in names if not informs(runs, n)]
        if idle:
            raise MeshplanError(f"--fit: no run in {args.runs} informs {', '.join(idle)} (no run with a measured step "
                                "time, or memory, on that GPU family or link kind)",
                                hint="leave it out, or add runs that use it")
    elif not informs_any(runs):
        raise MeshplanError(f"--runs {args.runs}: no run has a measured step time or peak memory to fit to",
                            hint="fill reported_step_time_s (or tokens/s, TFLOP/s, MFU) or reported_peak_mem_gib")
    before = builtin().values
    t0 = time.perf_counter()
    values, results = fit(runs, names, prior=args.prior, from_prior=args.prior == "physics")
    took = time.perf_counter() - t0
    fitted = [n for r in results for n in r.names]
    changes = {n: {"from": before.get(n), "to": values[n]} for n in fitted}
    m0, m1 = step_mape(runs, before), step_mape(runs, values)
    info = {
        "fitted_from": {"runs": args.runs, "rows": len(runs),
                        "sources": {s: int((runs.source == s).sum()) for s in dict.fromkeys(runs.source.tolist())},
                        "prior": args.prior, "date": datetime.date.today().isoformat()},
        "changes": changes,
        "fit": {"seconds": round(took, 1), "iterations": {t: r.iterations
                                                          for t, r in zip(("time", "memory"), results)},
                "step_mape_pct_before": None if m0 is None else round(m0, 2),
                "step_mape_pct_after": None if m1 is None else round(m1, 2)},
    }
    cal = Calibration({n: values[n] for n in fitted}, args.out, info)
    save_calibration(cal, args.out)
    if args.json:
        print(json_text(cal.to_dict()))
        return 0
    ns = len(info["fitted_from"]["sources"])
    print(f"calibrated {len(fitted)} parameter{'s' * (len(fitted) != 1)} on {len(runs)} run{'s' * (len(runs) != 1)} "
          f"from {ns} source{'s' * (ns != 1)} in {took:.1f} s (prior: {args.prior})")
    for n in fitted:
        f = fittable(n)
        was = before.get(n)
        shown = "-" if was is None else f"{was:.4g}"
        print(f"  {n:42s} {values[n]:9.4g}   built-in {shown:>8}   "
              f"range [{f.low:g}, {f.high:g}]")
    if m0 is not None and m1 is not None:
        print(f"step-time MAPE on these runs (in sample): {m0:.1f}% with the built-in calibration, "
              f"{m1:.1f}% with this one")
    print(f"wrote {args.out}: pass it to estimate/plan/simulate/report/validate with --calibration {args.out}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    from meshplan.cli.costing import costing
    from meshplan.cli.format import json_text
    from meshplan.validate.report import default_runs_path, to_markdown, to_text, validate
    path = str(default_runs_path()) if args.runs is None else args.runs
    cases = _cases(path)
    cost = costing(args)
    result = validate(cases, calibration=cost.calibration)
    if cost.calibration is not None:
        result["calibration"] = cost.to_json()["calibration"]
    cv_text: list[str] = []
    if args.cross_validate:
        cv_text = _cross_validate(cases, result)
    if args.report is not None:
        try:
            with open(args.report, "w") as f:
                f.write(to_markdown(result))
        except OSError as e:
            raise MeshplanError(f"cannot write --report {args.report}: {e.strerror}") from None
    if args.json:
        print(json_text(result))
    else:
        print("\n".join(cost.lines() + cv_text + [to_text(result)]))
    return 0


def _cross_validate(cases: list[Any], result: dict[str, Any]) -> list[str]:
    from meshplan.calibration.fit import cross_validate, pooled, runs_from_cases
    t0 = time.perf_counter()
    runs = runs_from_cases(cases)
    folds = cross_validate(runs)
    took = time.perf_counter() - t0
    entries = [f.summary() for f in folds]
    total = pooled(folds)
    result["cross_validation"] = entries
    result["cross_validation_summary"] = total | {"seconds": round(took, 1)}

    def f(x: Any, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)
    lines = ["Out of sample (leave one source out: each source predicted by a calibration fitted to the "
             "others)", "",
             f"{'source':22s} {'runs':>5s} {'step MAPE %':>12s} {'max abs %':>10s} {'bias %':>8s} "
             f"{'memory MAPE %':>14s} {'OOM accuracy %':>15s}"]
    for e in entries:
        oom = (f"{e['oom_accuracy_pct']:.0f} ({e['oom_runs']} OOM)" if "oom_accuracy_pct" in e else "-")
        lines.append(f"{e['source_id']:22s} {e['n']:5d} {f(e['step_mape_pct']):>12s} "
                     f"{f(e['max_abs_error_pct']):>10s} {f(e['step_bias_pct'], '+.1f'):>8s} "
                     f"{f(e['memory_mape_pct']):>14s} {oom:>15s}")
    lines += ["", f"out of sample: step MAPE {f(total['step_mape_pct'])}% over {total['runs']} runs "
              f"(mean of the sources with 3+ runs {f(total['mean_source_mape_pct'])}%, worst "
              f"{f(total['worst_source_mape_pct'])}%); OOM verdicts right {f(total['oom_accuracy_pct'])}%; "
              f"{len(folds)} fits in {took:.0f} s", "", "In sample (the built-in calibration, fitted to every source):",
              ""]
    return lines
