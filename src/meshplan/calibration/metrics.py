"""`meshplan train --metrics` files -> calibration cases (meshplan.cases.RunCase, as validate.runs builds them).

A metrics file is JSON lines: one record per step (``step``, ``loss``, ``step_time_s``, ...), records
with a ``kind`` (``warning``, ``replan-check``, ``calibration``, ``ranking``, ``switch``) and, at the
end of each run (or of the part of a run before ``--switch`` moved it to another plan), a
``{"kind": "summary"}`` record. Each summary is one case:

- the model: ``model_spec`` (a ModelSpec, or the LayerGraph an ingested model was traced to, as
  plan files record them: spec.io.spec_fields);
- the cluster: ``cluster_spec``, the one the runtime's estimate used (a GPU preset of the CUDA
  device, or on CPU the ``local-cpu`` device with its measured matmul rate);
- the plan: ``plan_as_run`` (the plan as this hardware runs it: on CPU offload flags are no-ops and
  fp8 runs as bf16), else ``plan``;
- the workload: ``global_batch`` and ``seq_len`` (tokens per sample);
- measured: ``measured.step_time_s`` (the median step time after the first step of that run or
  part) and ``measured.peak_memory_gib`` (max over ranks: torch.cuda.max_memory_allocated, on CPU
  the peak RSS); the run ran, so ``measured_fits`` is True;
- profile ``meshplan`` (meshplan's own runtime), no overrides.

A summary without these fields (a file written before the runtime recorded them) becomes an
``unsupported`` case with its reason, as validate.runs does for rows it cannot express: nothing is
dropped silently. Pure Python (no torch).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from meshplan.cases import RunCase
from meshplan.errors import MeshplanError

PROFILE = "meshplan"
"""The implementation profile of runs of meshplan's own runtime (cost.profile)."""
NEEDED = ("model_spec", "cluster_spec", "global_batch", "seq_len")
"""What a summary must carry to be a case (written by `meshplan train` since issue 14)."""


def read_records(path: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of every JSON object in a metrics file; one-line errors for a missing
    file or a line that is not a JSON object."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MeshplanError(f"--metrics {path}: no such file",
                            hint="give the file `meshplan train --metrics FILE` wrote") from None
    except IsADirectoryError:
        raise MeshplanError(f"--metrics {path} is a directory",
                            hint="give the file `meshplan train --metrics FILE` wrote") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MeshplanError(f"cannot read --metrics {path}: {getattr(e, 'strerror', None) or e}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise MeshplanError(f"--metrics {path} line {n}: not JSON ({e.msg})",
                                hint="give the JSON-lines file `meshplan train --metrics FILE` wrote") from None
        if not isinstance(rec, dict):
            raise MeshplanError(f"--metrics {path} line {n}: not a JSON object",
                                hint="give the JSON-lines file `meshplan train --metrics FILE` wrote")
        out.append((n, rec))
    return out


def cases_from_metrics(paths: list[str]) -> list[RunCase]:
    """One RunCase per summary record of each `meshplan train --metrics` file (in file order). The
    source of a case is its file (the runs of one file are weighed together by the fit)."""
    cases: list[RunCase] = []
    for path in paths:
        for n, rec in read_records(path):
            if rec.get("kind") == "summary":
                cases.append(case_from_summary(rec, source_id=str(path), row_id=f"{path}:{n}"))
    return cases


def _positive(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        return None
    return float(x)


def case_from_summary(rec: dict[str, Any], *, source_id: str, row_id: str) -> RunCase:
    """The RunCase of one summary record (see the module doc); never raises for a bad record:
    ``status='unsupported'`` with the reason instead."""
    name = str(rec.get("model") or "unknown")
    base: dict[str, Any] = dict(row_id=row_id, source_id=source_id, model_name=name, profile=PROFILE,
                                framework="meshplan", raw={"file": source_id, "record": row_id})
    missing = [k for k in NEEDED if rec.get(k) is None]
    if missing:
        return RunCase(status="unsupported", **base,
                       reason=f"the summary has no {', '.join(missing)} (written by a `meshplan train` that did not "
                              "record the run's specs; run it again with this version)")
    measured = rec.get("measured") if isinstance(rec.get("measured"), dict) else {}
    step = _positive(measured.get("step_time_s"))
    mem = _positive(measured.get("peak_memory_gib"))
    assumptions = ["implementation profile: meshplan (meshplan's own runtime)"]
    if rec.get("device") == "cpu":
        assumptions.append("peak memory is each process's peak RSS (CPU)")
    try:
        model, cluster, plan, work = _problem(rec)
    except MeshplanError as e:
        return RunCase(status="unsupported", reason=str(e), assumptions=assumptions, measured_step_time_s=step,
                       measured_peak_mem_gib=mem, **base)
    from meshplan.spec.constraints import violations
    bad = violations(model, cluster, plan, work)
    if step is None and mem is None:
        bad = [*bad, ("measured", "no step was measured")]
    steps = rec.get("steps")
    how = "meshplan train --metrics: median step time after the first step"
    if isinstance(steps, list) and len(steps) == 2 and all(isinstance(x, int) for x in steps):
        a, b = steps
        after = f"step {b}" if b == a + 1 else f"steps {a + 1}-{b}"
        how = (f"meshplan train --metrics: median step time of {after} (step {a}, the first, is warm-up)"
               if b > a else f"meshplan train --metrics: step {a}, the only one (warm-up included)")
    return RunCase(status="unsupported" if bad else "ok", reason="; ".join(f"{k}: {why}" for k, why in bad),
                   assumptions=assumptions, model=model, cluster=cluster, plan=plan, work=work,
                   measured_step_time_s=step, measured_peak_mem_gib=mem, measured_from=how if step else "",
                   measured_fits=True, gpu_preset=cluster.gpu.name, **base)


def _problem(rec: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(model, cluster, plan, workload) of a summary record; MeshplanError when one cannot be read."""
    from meshplan.spec.base import from_dict
    from meshplan.spec.graph import LayerGraph
    from meshplan.spec.io import cluster_from_dict, model_from_dict
    from meshplan.spec.plan import Workload, parse_plan
    spec = rec["model_spec"]
    if not isinstance(spec, dict):
        raise MeshplanError("summary: model_spec is not an object")
    if isinstance(spec.get("layers"), list):  # an ingested model's LayerGraph
        data = {k: v for k, v in spec.items() if k not in ("schema_version", "kind", "meta")}
        model: Any = from_dict(LayerGraph, data, where="summary: model_spec")
    else:
        model = model_from_dict(spec, where="summary: model_spec")
    if not isinstance(rec["cluster_spec"], dict):
        raise MeshplanError("summary: cluster_spec is not an object")
    cluster = cluster_from_dict(rec["cluster_spec"], where="summary: cluster_spec")
    text = rec.get("plan_as_run") or rec.get("plan")
    if not isinstance(text, str):
        raise MeshplanError("summary: no plan")
    plan = parse_plan(text)
    gb, seq = rec["global_batch"], rec["seq_len"]
    if isinstance(gb, bool) or isinstance(seq, bool) or not isinstance(gb, int) or not isinstance(seq, int):
        raise MeshplanError(f"summary: global_batch and seq_len must be whole numbers; got {gb!r}, {seq!r}")
    optimizer = rec.get("optimizer", "adamw")  # train --metrics records it (older files: AdamW)
    if not isinstance(optimizer, str):
        raise MeshplanError(f"summary: optimizer must be a name; got {optimizer!r}")
    return model, cluster, plan, Workload(global_batch=gb, seq_len=seq, optimizer=optimizer)
