"""`meshplan calibrate` and `meshplan validate` (with --calibration and --cross-validate)."""
from __future__ import annotations

import argparse
import datetime
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError


def add_parsers(sub: Any) -> None:
    """The `validate` and `calibrate` subcommands' arguments (called from cli.main.build_parser)."""
    from meshplan.calibration.space import all_names_help
    from meshplan.cli.args import positive_int
    from meshplan.cli.costing import add_cost_flags
    va = sub.add_parser("validate", help="compare the cost model with published measured runs")
    va.add_argument("--runs", help="CSV in the format of published_runs_dev.csv (default: the shipped dev set)")
    va.add_argument("--json", action="store_true", help="one JSON object on stdout")
    va.add_argument("--report", help="also write a markdown report to this file")
    add_cost_flags(va, profile=False)
    va.add_argument("--cross-validate", action="store_true",
                    help="leave one source out: for each source, fit the calibration on the other sources "
                         "and predict the one left out (the out-of-sample accuracy)")
    va.add_argument("--shots", metavar="K,...",
                    help="with --cross-validate: also calibrate each source on K of its runs (+ up to K out-of-memory "
                         "runs, fixed seed) from its leave-one-source-out calibration and predict the rest, for each "
                         "K (e.g. 0,1,3,5)")
    va.add_argument("--blind", action="store_true",
                    help="with --shots: hide each source's framework, attention and kernel cells (priced as "
                         "meshplan's default profile): a codebase meshplan has never seen")

    ca = sub.add_parser("calibrate", help="fit the cost model's named parameters to measured runs or micro-benchmarks",
                        description="Fit the cost model's named, bounded parameters (GPU family efficiencies, "
                                    "kernel and link efficiencies, allocator overhead) to measurements: a runs CSV "
                                    "in the format of published_runs_dev.csv (--runs), `meshplan train --metrics` "
                                    "files (--metrics), and/or micro-benchmarks of this machine's accelerators "
                                    "(--bench: GEMMs, attention, memory bandwidth, collectives under torchrun), in "
                                    "any mix. Runs are fitted by maximum a posteriori against first-principles "
                                    "priors; micro-benchmarks by inverting the cost model's own kernel and "
                                    "collective formulas (with runs too: the benchmarks first, then the runs' fit "
                                    "starting from them). Writes a calibration file for --calibration.")
    ca.add_argument("--runs", metavar="CSV", help="measured runs CSV (format of published_runs_dev.csv)")
    ca.add_argument("--metrics", metavar="FILE.jsonl", action="append",
                    help="`meshplan train --metrics` files (repeat the flag or give a comma list): their runs are "
                         "fitted with --runs'")
    ca.add_argument("--bench", action="store_true",
                    help="micro-benchmark this machine's accelerators through torch (GEMM throughput by shape and "
                         "dtype, attention by sequence length, elementwise memory bandwidth, NCCL collectives by "
                         "message size under torchrun) and fit the parameters they measure; on CPU the same code "
                         "runs small, against gloo, and the file is labelled CPU (a test of the pipeline, not GPU "
                         "numbers)")
    ca.add_argument("--bench-out", metavar="FILE", help="with --bench: also write the raw measurements (JSON) here")
    ca.add_argument("--bench-from", metavar="FILE",
                    help="fit the raw measurements a --bench-out file holds instead of measuring again")
    ca.add_argument("--gpu", metavar="PRESET",
                    help="with --bench: the GPU preset whose peaks and bandwidths the measurements are compared with "
                         "(default: the one matching the CUDA device's name)")
    ca.add_argument("--nproc-per-node", type=positive_int("--nproc-per-node"), metavar="N",
                    help="with --bench: processes per node for the collectives (default: the CUDA device count; 2 "
                         "on CPU)")
    ca.add_argument("--nnodes", type=positive_int("--nnodes"), default=1, metavar="N",
                    help="with --bench: nodes taking part (run the same command on each, with its --node-rank); "
                         "more than one measures the inter-node links too")
    ca.add_argument("--node-rank", type=int, default=0, metavar="R", help="with --bench --nnodes: this node's rank")
    ca.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="with --bench --nnodes: node 0's rendezvous address")
    ca.add_argument("--out", required=True, help="write the calibration (JSON) here")
    ca.add_argument("--fit", metavar="NAME,...",
                    help="fit only these parameters (default: every one the measurements inform); names: "
                         + all_names_help())
    ca.add_argument("--prior", choices=["builtin", "physics"], default="builtin",
                    help="centre each parameter's prior on the built-in calibration (default: a few runs of your "
                         "own refine it) or on its first-principles value (how the built-in one is fitted)")
    ca.add_argument("--bands", action="store_true",
                    help="also predict each source of --runs from the others (leave one source out) and store the "
                         "spread of those out-of-sample errors as the uncertainty bands (how the built-in "
                         "calibration's bands are made; minutes)")
    ca.add_argument("--infer-profile", choices=["auto", "yes", "no"], default="auto",
                    help="infer the codebase's implementation profile (attention kernel, fusion, overlaps, gradient "
                         "dtype, loss kernel, ...) from the runs, say how sure it is and which run would tell the "
                         "top two apart, and fit under it unless a run states its framework (a framework cell); "
                         "auto (default): when no run states its framework")
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


BENCH_ONLY = (("gpu", None, "--gpu"), ("nproc_per_node", None, "--nproc-per-node"), ("nnodes", 1, "--nnodes"),
              ("node_rank", 0, "--node-rank"), ("rdzv_endpoint", None, "--rdzv-endpoint"),
              ("bench_out", None, "--bench-out"))
"""Options that only mean something with --bench: (dest, default, flag)."""


def _check_sources(args: argparse.Namespace) -> list[str]:
    """Which measurements a calibrate command has (at least one), its --metrics paths as a list,
    and no --bench option without --bench."""
    metrics = [p.strip() for m in (args.metrics or []) for p in m.split(",")]
    if args.metrics is not None and not all(metrics):
        raise MeshplanError(f"--metrics {','.join(args.metrics)!r}: an empty file name",
                            hint="give FILE.jsonl, repeat --metrics or give a comma list")
    if args.runs is None and not metrics and not args.bench and args.bench_from is None:
        raise MeshplanError("calibrate needs measurements: --runs CSV, --metrics FILE.jsonl or --bench (any mix)",
                            hint="e.g. `meshplan calibrate --bench --out cal.json` micro-benchmarks this machine")
    if args.bench and args.bench_from is not None:
        raise MeshplanError("--bench and --bench-from both give micro-benchmarks",
                            hint="--bench measures now; --bench-from FILE refits a --bench-out file; drop one")
    if not args.bench:
        for dest, default, flag in BENCH_ONLY:
            if getattr(args, dest) != default:
                raise MeshplanError(f"{flag} is an option of --bench", hint=f"add --bench, or drop {flag}")
    return metrics


def _metrics_cases(paths: list[str]) -> list[Any]:
    try:
        from meshplan.calibration.metrics import cases_from_metrics
    except ImportError as e:
        if getattr(e, "name", None) != "meshplan.calibration.metrics":
            raise
        raise MeshplanError("--metrics: this meshplan cannot read training metrics (meshplan.calibration.metrics "
                            "is missing)", hint="give the runs as --runs CSV") from None
    cases = list(cases_from_metrics(paths))
    if not cases:
        raise MeshplanError(f"--metrics {','.join(paths)}: no runs (no summary record of a `meshplan train` run)",
                            hint="give the file `meshplan train --metrics` wrote after a run finished")
    return cases


def _bench_raw(args: argparse.Namespace) -> dict[str, Any] | None:
    """The micro-benchmarks: measured now (--bench) or read (--bench-from). None on a node other
    than node 0 of a multi-node --bench (it only took part in the collectives)."""
    import json
    import sys

    from meshplan.calibration.bench_fit import check_raw
    if args.bench_from is not None:
        from meshplan.calibration.store import read_json_file
        data = read_json_file(args.bench_from, "--bench-from",
                              "give the JSON file `meshplan calibrate --bench --bench-out` wrote")
        return check_raw(data, f"--bench-from {args.bench_from}")
    from meshplan.runtime.bench import BenchRequest, require_torch, run_bench
    require_torch()
    req = BenchRequest(gpu=args.gpu, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                       node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    raw = run_bench(req, progress=lambda s: print(f"meshplan: bench: {s}", file=sys.stderr, flush=True))
    if raw is not None and args.bench_out:
        try:
            with open(args.bench_out, "w") as f:
                f.write(json.dumps(raw, indent=1) + "\n")
        except OSError as e:
            raise MeshplanError(f"cannot write --bench-out {args.bench_out}: {e.strerror or e}") from None
    return raw


def _ids_text(ids: list[str]) -> str:
    if len(ids) <= 3:
        return ", ".join(ids)
    return f"{len(ids)} measurements: {ids[0]}, {ids[1]}, ..., {ids[-1]}"


def run_calibrate(args: argparse.Namespace) -> int:
    from meshplan.calibration.fit import (
        fit_as_calibrate,
        fit_info,
        fittable,
        informs,
        informs_any,
        runs_from_cases,
        step_mape,
    )
    from meshplan.calibration.store import Calibration, builtin, save_calibration
    from meshplan.cli.format import json_doc
    from meshplan.paths import check_output_file
    metrics = _check_sources(args)
    check_output_file("--out", args.out)
    check_output_file("--bench-out", args.bench_out)
    names = None
    if args.fit is not None:
        names = [n.strip() for n in args.fit.split(",") if n.strip()]
        if not names:
            raise MeshplanError(f"--fit {args.fit!r} names no parameter",
                                hint="give NAME,... (see `meshplan calibrate --help`), or leave --fit out to fit "
                                     "every parameter the measurements inform")
        for n in names:
            fittable(n)
    label = " and ".join(x for x in ((args.runs or ""), ",".join(metrics)) if x)
    flags = " and ".join(x for x in ((f"--runs {args.runs}" if args.runs else ""),
                                     (f"--metrics {','.join(metrics)}" if metrics else "")) if x)
    cases = (_cases(args.runs) if args.runs is not None else []) + (_metrics_cases(metrics) if metrics else [])
    runs = runs_from_cases(cases) if cases else None
    skipped, unread = _unused(cases)
    for line in _unused_lines(skipped, unread):
        print(f"meshplan: calibrate: {line}", file=sys.stderr)
    on_cpu = any(_on_cpu(c) for c in (runs.cases if runs is not None else []))
    if runs is not None and not len(runs):
        raise MeshplanError(f"{flags}: no run has a measured step time, peak memory or "
                            "out-of-memory outcome that meshplan can express",
                            hint="`meshplan validate --runs FILE` says why each row is unsupported")
    bench = args.bench or args.bench_from is not None
    if runs is not None and names is None and not informs_any(runs) and not bench:
        raise MeshplanError(f"{flags}: no run has a measured step time or peak memory to fit to",
                            hint="fill reported_step_time_s (or tokens/s, TFLOP/s, MFU) or reported_peak_mem_gib")
    before = builtin().values
    t0 = time.perf_counter()
    bf = None
    if bench:
        from meshplan.calibration.bench_fit import fit_bench
        raw = _bench_raw(args)
        if raw is None:
            print(f"node {args.node_rank} of {args.nnodes}: took part in the collectives; node 0 writes the "
                  "calibration")
            return 0
        bf = fit_bench(raw)
        if not bf.values and runs is None:
            why = "; ".join(f"{m['id']}: {m['why']}" for m in bf.summary["not_measured"][:3])
            raise MeshplanError("the micro-benchmarks gave no value to calibrate" + (f" ({why})" if why else ""),
                                hint="run --bench where torch sees the accelerators (`--bench-out` keeps what "
                                     "was measured)")
    bench_names = set(bf.values) if bf is not None else set()
    if names is not None:
        idle = [n for n in names if n not in bench_names and not (runs is not None and informs(runs, n))]
        if idle:
            why = []
            if runs is not None:
                why.append("no run with a measured step time, or memory, on that GPU family or link kind")
            if bf is not None:
                why.append(f"the micro-benchmarks give {', '.join(sorted(bench_names)) or 'no value'}")
            what = " or ".join(x for x in ((f"no run in {label}" if runs is not None else ""),
                                           ("no micro-benchmark" if bf is not None else "")) if x)
            raise MeshplanError(f"--fit: {what} informs {', '.join(idle)} ({'; '.join(why)})",
                                hint="leave it out, or add measurements that use it")
    start = {n: v for n, v in (bf.values.items() if bf is not None else ()) if names is None or n in names}
    values = dict(start)
    results: list[Any] = []
    m0 = m1 = None
    inferred = None
    if runs is not None and _infer_wanted(args, runs):
        from meshplan.calibration.infer import infer_for_cases
        # reported, and written as a profile file; the fit below stays under each run's own profile, so that
        # this calibration predicts as it was fitted wherever it is used without that file (a weakly
        # inferred profile must not silently change what --calibration means)
        inferred = infer_for_cases(runs)
    if runs is not None:
        run_names = None if names is None else [n for n in names if informs(runs, n)]
        if run_names is None or run_names:
            fitted_runs, results = fit_as_calibrate(runs, run_names, prior=args.prior, start=start)
            values.update(fitted_runs)
        m0, m1 = step_mape(runs, before), step_mape(runs, {**before, **values})
    took = time.perf_counter() - t0
    run_fitted = [n for r in results for n in r.names]
    fitted = list(start) + [n for n in run_fitted if n not in start]
    derived = {d.name: d for d in bf.derived} if bf is not None else {}
    changes: dict[str, Any] = {}
    for n in fitted:
        was = before.get(n, derived[n].was if n in derived else None)
        ch: dict[str, Any] = {"from": was, "to": values[n], "measurements": []}
        if n in start:
            ch.update({k: v for k, v in derived[n].change().items() if k not in ("from", "to")})
        if n in run_fitted:
            ch["measurements"] = ch["measurements"] + _informing_sources(runs, n)
            if n in start:
                ch["bench_value"] = start[n]
        changes[n] = ch
    info: dict[str, Any] = {"fitted_from": {"date": datetime.date.today().isoformat()}, "changes": changes}
    info["fitted_from"]["command"] = "meshplan " + " ".join(shlex.quote(a) for a in getattr(args, "argv", sys.argv[1:]))
    if runs is not None:
        info["fitted_from"].update({
            "runs": args.runs, **({"metrics": metrics} if metrics else {}), "rows": len(runs),
            "timed_runs": int(sum(math.isfinite(float(x)) for x in runs.step)),
            "sources": {s: int((runs.source == s).sum()) for s in dict.fromkeys(runs.source.tolist())},
            "prior": args.prior})
        if skipped:
            info["fitted_from"]["skipped_rows"] = skipped
        if unread:
            info["fitted_from"]["cells_not_understood"] = unread
        if on_cpu:
            info["device_kind"] = "cpu"
        info |= fit_info(results, round(took, 1), m0, m1)
    if bf is not None:
        info["fitted_from"]["bench"] = {k: bf.summary.get(k) for k in ("device_kind", "device_name", "reference",
                                                                        "backend", "nproc_per_node", "nnodes")}
        if args.bench_from is not None:
            info["fitted_from"]["bench"]["file"] = args.bench_from
        bi = bf.info()
        info.update({k: v for k, v in bi.items() if k != "changes"})
        if bf.notes:
            info["notes"] = bf.notes
    if getattr(args, "bands", False):
        info["uncertainty"] = _bands(runs, args)
    if inferred is not None:
        from meshplan.calibration.infer import profile_toml
        inferred["profile_file"] = str(Path(args.out).with_suffix("")) + ".profile.toml"
        try:
            Path(inferred["profile_file"]).write_text(profile_toml(inferred))
        except OSError as e:
            raise MeshplanError(f"cannot write {inferred['profile_file']}: {e.strerror or e}") from None
        info["inferred_profile"] = inferred
    cal = Calibration({n: values[n] for n in fitted}, args.out, info)
    save_calibration(cal, args.out)
    if args.json:
        print(json_doc("calibrate", cal.to_dict()))
        return 0
    print("\n".join(_calibrate_text(args, cal, runs, bf, before, took, m0, m1)))
    return 0


def _infer_wanted(args: argparse.Namespace, runs: Any) -> bool:
    """--infer-profile: yes, no, or auto (when no run states or reveals its framework, and some run
    has a step time or memory outcome to tell the profiles apart)."""
    how = getattr(args, "infer_profile", "no")
    if how == "no" or not (runs.measured("time").any() or runs.measured("memory").any()):
        return False
    return how == "yes" or not any((getattr(c, "raw", {}).get("framework") or "").strip() for c in runs.cases)


def _on_cpu(case: Any) -> bool:
    """A `meshplan train --metrics` run measured on CPU processes (the local-cpu device)."""
    name = getattr(getattr(case, "cluster", None), "name", "") or ""
    return name.startswith("local-cpu")


def _unused(cases: list[Any]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(the rows the fit leaves out, with why; the cells of the rows it uses that were not
    understood), so that nothing is dropped or reinterpreted silently."""
    from meshplan.calibration.fit import unusable
    skipped, unread = [], []
    for c in cases:
        row = str(getattr(c, "row_id", "?"))
        why = unusable(c)
        if why is not None:
            skipped.append({"row": row, "source": str(getattr(c, "source_id", "")), "reason": why})
            continue
        for a in getattr(c, "assumptions", []) or []:
            if "not understood" in a or "not a positive number" in a or "status=" in a:
                unread.append({"row": row, "source": str(getattr(c, "source_id", "")), "note": a})
    return skipped, unread


def _unused_lines(skipped: list[dict[str, str]], unread: list[dict[str, str]], cap: int = 8) -> list[str]:
    out = [f"skipped row {x['row']} ({x['source']}): {x['reason']}" for x in skipped[:cap]]
    if len(skipped) > cap:
        out.append(f"... and {len(skipped) - cap} more skipped rows (the calibration file lists them: "
                   "fitted_from.skipped_rows)")
    out += [f"row {x['row']} ({x['source']}): {x['note']}" for x in unread[:cap]]
    if len(unread) > cap:
        out.append(f"... and {len(unread) - cap} more cells not understood (fitted_from.cells_not_understood)")
    return out


def _bands(runs: Any, args: argparse.Namespace) -> dict[str, Any]:
    from meshplan.calibration.bands import bands_info, residuals
    from meshplan.calibration.fit import cross_validate
    if runs is None or len(set(runs.source.tolist())) < 2:
        raise MeshplanError("--bands needs --runs from at least two sources (each source is predicted by a "
                            "calibration fitted to the others)",
                            hint="add runs of another source, or leave --bands out")
    return bands_info(residuals(runs, cross_validate(runs)))


def _informing_sources(runs: Any, name: str) -> list[str]:
    """'runs: SOURCE (N rows)' for each source of ``runs`` with a run that informs ``name``."""
    from meshplan.calibration.fit import informs
    out = []
    for s in dict.fromkeys(runs.source.tolist()):
        idx = [i for i, x in enumerate(runs.source.tolist()) if x == s]
        if informs(runs.subset(idx), name):
            out.append(f"runs: {s} ({len(idx)} row{'s' * (len(idx) != 1)})")
    return out


def _calibrate_text(args: argparse.Namespace, cal: Any, runs: Any, bf: Any, before: dict[str, float], took: float,
                    m0: float | None, m1: float | None) -> list[str]:
    import numpy as np

    from meshplan.calibration.fit import codebase_names, fittable
    lines = []
    fitted = list(cal.values)
    if bf is not None:
        s = bf.summary
        counts: dict[str, int] = {}
        for m in s["measurements"]:
            k = m["id"].split("/", 1)[0]
            counts[k] = counts.get(k, 0) + 1
        what = ", ".join(f"{v} {k}" for k, v in counts.items())
        label = "CPU: the numbers are labelled CPU, not GPU ones" if s["device_kind"] == "cpu" else "GPU"
        procs = f"{s['nproc_per_node']} process{'es' * (s['nproc_per_node'] != 1)} x {s['nnodes']} node" \
                + ("s" * (s["nnodes"] != 1)) if s.get("nproc_per_node") else ""
        lines.append(f"micro-benchmarks on {s['device_name']} ({label}; compared with {s['reference']}"
                     + (f"; {s['backend']}, {procs}" if s.get("backend") else "")
                     + (f") in {s['seconds']:.1f} s" if isinstance(s.get("seconds"), (int, float)) else ")")
                     + f": {what}")
        for m in s["not_measured"]:
            lines.append(f"  not measured: {m['id']}: {m['why']}")
    if runs is not None:
        ns = len(dict.fromkeys(runs.source.tolist()))
        lines.append(f"runs: {len(runs)} run{'s' * (len(runs) != 1)} from {ns} source{'s' * (ns != 1)} "
                     f"(prior: {args.prior})")
    def was_of(n: str) -> float | None:  # a codebase parameter the built-in calibration lacks starts at its prior
        was = cal.info["changes"][n].get("from")
        return fittable(n).prior if was is None and n in codebase_names() else was

    def unchanged(n: str) -> bool:
        was = was_of(n)
        return isinstance(was, (int, float)) and abs(cal.values[n] - was) <= 1e-4 * max(abs(was), 1e-12)
    moved = sum(not unchanged(n) for n in fitted)
    lines.append(f"calibrated {len(fitted)} parameter{'s' * (len(fitted) != 1)} ({moved} changed) in {took:.1f} s "
                 "(name, from -> to, range, from which measurements):")
    warns = []
    for n in fitted:
        f = fittable(n)
        ch = cal.info["changes"][n]
        was = was_of(n)
        shown = "-" if was is None else f"{was:.4g}"
        v = cal.values[n]
        same = unchanged(n)
        mark = " (clamped)" if ch.get("clamped") else " (unchanged)" if same else ""
        tol = 1e-3 * max(f.high - f.low, 1e-12)
        if not same and min(abs(v - f.low), abs(v - f.high)) <= tol and abs(v - f.prior) > tol:
            side = "lower" if abs(v - f.low) < abs(v - f.high) else "upper"
            mark += f" (at its {side} bound)"
            warns.append(f"warning: {n} ended at the {side} bound of its physical range [{f.low:g}, {f.high:g}]: "
                         "the measurements ask for more than it can explain (check them, or the profile and "
                         "settings the rows state)")
        lines.append(f"  {n:42s} {shown:>9} -> {v:<9.4g} [{f.low:g}, {f.high:g}]{mark}")
        if same:
            continue
        ms = ch.get("measurements") or []
        bench_ids = [x for x in ms if not x.startswith("runs: ")]
        if bench_ids:
            lines.append(f"  {'':42s} from {_ids_text(bench_ids)}"
                         + (f" (then refined by the runs from {ch['bench_value']:.4g})" if "bench_value" in ch else ""))
        run_ids = [x[len("runs: "):] for x in ms if x.startswith("runs: ")]
        if run_ids:
            lines.append(f"  {'':42s} from runs of {', '.join(run_ids)}")
    if m0 is not None and m1 is not None:
        lines.append(f"step-time MAPE on these runs (in sample): {m0:.1f}% with the built-in calibration, "
                     f"{m1:.1f}% with this one")
        if m1 > m0 + 0.05:
            lines.append("note: this calibration fits these runs no better than the built-in one: the fit weighs "
                         "each run's log error with a robust loss against the parameters' priors, not this "
                         "MAPE; with few or scattered runs, keeping the built-in calibration is as good")
    if runs is not None:
        has_time = bool((~np.isnan(runs.step)).any())
        has_mem = bool((~np.isnan(runs.mem)).any())
        if not has_time and not has_mem and bool((runs.fits < 0).any()) and not bool((runs.fits > 0).any()):
            warns.append("warning: every run here ran out of memory: outcomes like these can only push the memory "
                         "parameters up; add runs that trained (or measured peaks) before planning with this file")
    lines += warns
    inf = cal.info.get("inferred_profile")
    if inf:
        from meshplan.calibration.infer import lines as inferred_lines
        lines += inferred_lines(inf)
        lines.append(f"wrote {inf['profile_file']}: the inferred profile, a hypothesis to test (the suggested run "
                     f"tells it apart); this calibration was fitted under each run's own profile, so use "
                     f"--calibration {cal.source} without --profile {inf['profile_file']}")
    for note in (cal.info.get("notes") or []):
        lines.append(f"note: {note}")
    if cal.measured_on_cpu:  # CPU micro-benchmarks, or a `meshplan train` run on CPU processes
        lines.append("warning: measured on CPU: the values describe this CPU, not a GPU; --calibration with this "
                     "file warns so")
    lines.append(f"wrote {args.out}: pass it to estimate/plan/simulate/report/validate with --calibration {args.out}")
    return lines


def run_validate(args: argparse.Namespace) -> int:
    from meshplan.cli.costing import costing
    from meshplan.cli.format import json_doc
    from meshplan.validate.report import default_runs_path, to_markdown, to_text, validate
    path = str(default_runs_path()) if args.runs is None else args.runs
    cases = _cases(path)
    cost = costing(args)
    result = validate(cases, calibration=cost.calibration)
    if cost.calibration is not None:
        result["calibration"] = cost.to_json()["calibration"]
    from meshplan.validate.ranking import rank_rows_from_validate, score_sweeps
    from meshplan.validate.ranking import to_lines as ranking_lines
    result["ranking"] = score_sweeps(rank_rows_from_validate(cases, result["rows"]))  # within sweeps, in sample
    from meshplan.validate import coverage
    result["band_coverage"] = coverage.in_sample(result["rows"])
    cv_text: list[str] = []
    shots = _shots(args)
    if args.cross_validate:
        cv_text = _cross_validate(cases, result, shots, getattr(args, "blind", False))
    from meshplan.validate.collectives import to_text as collectives_text
    from meshplan.validate.collectives import validate_collectives
    result["collectives"] = validate_collectives()  # published nccl-tests rows (data/collectives_dev.csv)
    if args.report is not None:
        try:
            with open(args.report, "w") as f:
                f.write(to_markdown(result))
        except OSError as e:
            raise MeshplanError(f"cannot write --report {args.report}: {e.strerror}") from None
    if args.json:
        print(json_doc("validate", result))
    else:
        # the collectives (a different kind of row) first, the step-time and memory summary of the runs last
        print("\n".join(cost.lines() + [collectives_text(result["collectives"]), ""] + cv_text
                        + ranking_lines(result["ranking"], "Ranking within sweeps, in sample")
                        + coverage.to_lines(result["band_coverage"], "Band coverage, in sample") + [to_text(result)]))
    return 0


def _shots(args: argparse.Namespace) -> list[int] | None:
    """--shots K,... as a list of counts (None without it); --shots/--blind without what they need: errors."""
    raw = getattr(args, "shots", None)
    if raw is None:
        if getattr(args, "blind", False):
            raise MeshplanError("--blind needs --shots", hint="e.g. --cross-validate --shots 0,1,3,5 --blind")
        return None
    if not args.cross_validate:
        raise MeshplanError("--shots needs --cross-validate", hint="e.g. --cross-validate --shots 0,1,3,5")
    try:
        ks = sorted({int(x) for x in raw.split(",")})  # an empty item ("0,,3") is not a number either
    except ValueError:
        raise MeshplanError(f"--shots {raw!r}: not a list of whole numbers", hint="e.g. --shots 0,1,3,5") from None
    if not ks or any(k < 0 or k > 50 for k in ks):
        raise MeshplanError(f"--shots {raw!r}: counts must be 0 to 50", hint="e.g. --shots 0,1,3,5")
    return ks


def _cross_validate(cases: list[Any], result: dict[str, Any], shots: list[int] | None = None,
                    blind: bool = False) -> list[str]:
    from meshplan.calibration.bands import bands_info, oom_verdicts, residuals
    from meshplan.calibration.fit import cross_validate, pooled, runs_from_cases
    from meshplan.calibration.out_of_sample import coverage as oos_coverage
    from meshplan.calibration.out_of_sample import rank_rows as oos_rank_rows
    from meshplan.validate.ranking import score_sweeps
    from meshplan.validate.ranking import to_lines as ranking_lines
    t0 = time.perf_counter()
    runs = runs_from_cases(cases)
    n_src = len(set(runs.source.tolist()))
    print(f"meshplan: validate: leaving out each of the {n_src} sources in turn ({n_src} fits from the priors, in "
          "parallel processes; a few minutes) ...", file=sys.stderr, flush=True)
    folds = cross_validate(runs, progress=lambda s: print(f"meshplan: validate: {s.strip()}", file=sys.stderr))
    res = residuals(runs, folds)
    oom_verdicts(res, folds)
    result["ranking_out_of_sample"] = score_sweeps(oos_rank_rows(res))
    from meshplan.validate import coverage
    result["band_coverage_out_of_sample"] = oos_coverage(res)
    # the bands these out-of-sample predictions give (what `calibrate --bands` stores in a calibration)
    result["cross_validation_bands"] = bands_info(res)
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
              f"{len(folds)} fits in {took:.0f} s"]
    by = total.get("memory_mape_pct_by_measure") or {}
    if by:
        lines.append("memory error out of sample by what the rows measured: "
                     + ", ".join(f"{k} {f(v)}%" for k, v in by.items()))
    mv = total.get("memory_verdicts") or {}
    if mv:
        lines.append(f"out-of-memory runs called at-risk or does-not-fit: {mv['oom_called_at_risk_or_does_not_fit']} "
                     f"of {mv['oom_runs']}; runs that trained called does-not-fit: "
                     f"{f(mv['trained_called_does_not_fit_pct'])}% of {mv['trained_runs']}")
    lines += [""]
    lines += ranking_lines(result["ranking_out_of_sample"], "Ranking within sweeps, out of sample")
    lines += coverage.to_lines(result["band_coverage_out_of_sample"], "Band coverage, out of sample")
    if shots:
        from meshplan.calibration.few_shot import few_shot
        from meshplan.calibration.few_shot import to_lines as few_lines
        print(f"meshplan: validate: calibrating each source on {', '.join(map(str, shots))} of its runs"
              + (" (blind)" if blind else "") + " ...", file=sys.stderr, flush=True)
        result["few_shot"] = few_shot(runs, folds, shots, blind)
        lines += few_lines(result["few_shot"])
    lines += ["In sample (the built-in calibration, fitted to every source):", ""]
    return lines
