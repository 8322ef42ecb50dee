"""Published training runs -> validation cases.

Each CSV row (columns as in shared/data/published_runs_dev.csv, see its README) becomes a
:class:`meshplan.cases.RunCase`: a ModelSpec, a ClusterSpec, a Plan and a Workload, plus the measured step
time converted with the source's own formula and the measured peak memory.

Rules:

* Never drop a row. A row that cannot be expressed becomes ``status='unsupported'`` with a
  one-line ``reason``.
* Missing, blank, "not stated" or "unknown" cells get the usual setting of the row's
  framework (Megatron-LM, torchtitan, llm-foundry, Megatron-DeepSpeed), and every such
  default is written to ``assumptions``.
* The row's own ``status`` column ('ok', 'oom', 'failed', ...) is kept in ``run_status``;
  an 'oom' row is still a valid case (the cost model should say it does not fit).

The pieces live beside this module: ``rows`` (reading cells), ``frameworks`` (which framework
and its defaults), ``models`` (ModelSpec), ``clusters`` (GPU preset and cluster), ``plans`` (Plan
and Workload, in named steps), ``measured`` (step time, peak memory, fit) and ``formulas`` (the
sources' step-time and FLOPs formulas). The names callers use are re-exported here.
"""
from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshplan.cases import RunCase
from meshplan.cost.profile import DEFAULT_PROFILE
from meshplan.errors import MeshplanError
from meshplan.spec.constraints import violations
from meshplan.validate.clusters import build_cluster, gpu_preset, gpu_preset_for, known_system, system_cluster
from meshplan.validate.formulas import flops_kor22_hardware, flops_kor22_model, flops_meg21
from meshplan.validate.frameworks import detect_framework, profile_of
from meshplan.validate.measured import (
    OK_STATUS,
    default_peak_tflops,
    did_not_fit,
    fit_from_status,
    measure_peak_mem,
    measure_step_time,
    memory_by_nvidia_smi,
)
from meshplan.validate.models import build_model, check_params
from meshplan.validate.plans import plan_from_row
from meshplan.validate.rows import Row, Unsupported, norm_key

# Imported from here by callers (tests): the published formulas and the GPU mapping.
__all__ = ["case_from_row", "default_peak_tflops", "flops_kor22_hardware", "flops_kor22_model",
           "flops_meg21", "gpu_preset_for", "load_runs"]


def case_from_row(raw: dict[str, Any], index: int = 0) -> RunCase:
    """Build one RunCase from a CSV row dict. Never raises for bad data: unsupported instead."""
    row = Row(raw)
    assumptions: list[str] = []

    def assume(msg: str) -> None:
        if msg not in assumptions:
            assumptions.append(msg)

    row_id = row.text("row_id") or str(index + 1)
    source_id = row.text("source_id") or "unknown"
    model_name = row.text("model") or f"row-{row_id}"
    run_status = (row.text("status") or "ok").strip().lower()
    fw = detect_framework(row, assume)
    profile = profile_of(row, fw)
    overrides: dict[str, Any] = {}
    if fw == "unknown" and profile == DEFAULT_PROFILE and not row.text("framework"):
        # no codebase recognised: meshplan's settings, but the memory band of all codebases (cost.uncertainty)
        overrides["profile"] = "unknown"
        overrides["band_basis"] = "unknown"
        assume(f"implementation profile: {profile} (codebase not recognised: its memory band is that of all codebases, "
               "its step band the unknown codebase's)")
    elif row.text("framework"):
        assume(f"implementation profile: {profile}")
    out: dict[str, Any] = dict(row_id=row_id, source_id=source_id, model_name=model_name,
                               raw=dict(row.cells), run_status=run_status, framework=fw,
                               profile=profile, overrides=overrides)
    model = cluster = plan = work = None
    n = None
    reasons: list[str] = []

    def attempt(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (Unsupported, MeshplanError) as e:
            reasons.append(str(e))
        except Exception as e:  # never lose a row to an unexpected cell
            reasons.append(f"could not read the row ({type(e).__name__}: {e})")
        return None

    model = attempt(lambda: build_model(row, fw, assume))
    if model is not None:
        attempt(lambda: check_params(row, model, assume))
        got = attempt(lambda: plan_from_row(row, fw, model, assume, profile, overrides))
        if got is not None:
            plan, work, n = got
    gpu = attempt(lambda: gpu_preset(row, assume))
    system = known_system(row, gpu)
    if system is not None and plan is not None and n:
        cluster = attempt(lambda: system_cluster(system, n, assume))
    elif gpu is not None and plan is not None:
        cluster = attempt(lambda: build_cluster(gpu, n, row.integer("gpus_per_node"), plan.tp,
                                                assume))
    if cluster is not None:
        bad = violations(model, cluster, plan, work)
        reasons += [f"{name}: {why}" for name, why in bad]
    if not reasons and cluster is None:  # pragma: no cover - defensive
        reasons.append("could not build the case")
    reason = "; ".join(reasons)

    # Measurements (best effort even for unsupported rows).
    B = work.global_batch if work else _safe_int(row, "global_batch_seqs")
    s = work.seq_len if work else _safe_int(row, "seq_len")
    if n is None:
        n = _safe_int(row, "num_gpus")
    for col in MEASURED_COLUMNS:  # a measurement cell that is not a number is said, not silently skipped
        cell = (row.text(col) or "").strip()
        if cell and row.positive_number(col) is None:
            assume(f"{col}={cell!r} is not a positive number: ignored")
    if not (did_not_fit(run_status) or OK_STATUS.match(run_status)):
        assume(f"status={run_status!r} is neither a run that trained nor one that ran out of GPU memory: "
               "its outcome is not used")
    try:
        t, how = measure_step_time(row, B=B, s=s, n=n, model=model,
                                   recompute=plan.recompute if plan else "none", fw=fw, gpu=gpu,
                                   precision=plan.precision if plan else "bf16", assume=assume)
    except (Unsupported, MeshplanError, ArithmeticError, ValueError) as e:
        t, how = None, ""
        assume(f"measurement not readable: {e}")
    mem = measure_peak_mem(row, assume)
    fits, how = fit_from_status(run_status, how)
    return RunCase(status="unsupported" if reason else "ok", reason=reason,
                   assumptions=assumptions, model=model, cluster=cluster, plan=plan, work=work,
                   measured_step_time_s=t, measured_peak_mem_gib=mem, measured_from=how,
                   memory_by_nvidia_smi=mem is not None and memory_by_nvidia_smi(row),
                   measured_fits=fits, gpu_preset=gpu, **out)


def _safe_int(row: Row, name: str) -> int | None:
    """The cell as a whole number, or None when it is blank or not one."""
    try:
        return row.integer(name)
    except Unsupported:
        return None


#: The cells a row's measurements are read from (a filled one that is not a positive number is
#: reported on the row).
MEASURED_COLUMNS = ("reported_step_time_s", "reported_tokens_per_s_per_gpu", "reported_tokens_per_s_total",
                    "reported_samples_per_s", "reported_tflops_per_gpu", "reported_mfu_pct", "reported_hfu_pct",
                    "reported_peak_mem_gib")


#: Columns every row needs (the model's shape and the GPU count): a header without one is refused.
REQUIRED_COLUMNS = ("num_layers", "hidden_size", "num_gpus")


def load_runs(path: str | Path) -> list[RunCase]:
    """Read a published-runs CSV into one RunCase per row (none dropped)."""
    p = Path(path)
    try:
        if p.is_dir():
            raise MeshplanError(f"--runs {p} is a directory, not a runs CSV",
                                hint="give the CSV file (the format of src/meshplan/data/published_runs_dev.csv)")
        if not p.is_file():
            raise MeshplanError(f"runs file not found: {p}")
        with p.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = {norm_key(k) for k in (reader.fieldnames or [])}
    except OSError as e:
        raise MeshplanError(f"cannot read the runs file (--runs) {str(p)[:80]}: {e.strerror or e}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise MeshplanError(f"cannot read the runs file (--runs) {str(p)[:80]}: {e}") from None
    needed = {"num_layers", "hidden_size", "num_gpus"}
    if rows and not needed & header:
        raise MeshplanError(f"{p} is not a published-runs CSV: none of the columns "
                            f"{', '.join(sorted(needed))} is present",
                            hint="see the README next to published_runs_dev.csv "
                                 "(src/meshplan/data/README.md) for the format")
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if rows and missing:
        raise MeshplanError(f"{p}: missing column{'s' * (len(missing) > 1)} {', '.join(missing)} (no row can be "
                            "priced without it)",
                            hint="add the column to the header; src/meshplan/data/README.md describes the format")
    return [case_from_row(r, i) for i, r in enumerate(rows)]
