"""A calibration: fitted parameter values, where they came from, and how to apply them.

    cal = load_calibration("calibration.json")
    params = cal.apply_params(params)       # CostParams fields
    cluster = cal.apply_cluster(cluster)    # GPU family efficiencies and link efficiencies

The file (JSON): {"schema_version": 1, "kind": "calibration", "values": {name: value},
"fitted_from": {...}, "changes": {name: {"from": x, "to": y, "measurements": [...]}}, ...}; a file
from micro-benchmarks run on CPU carries "device_kind": "cpu", and loading it warns (stderr). Only the names in
``values`` are applied; everything else keeps the built-in calibration's numbers.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from meshplan.builtin_calibration import builtin_calibration, gpu_key, link_key, part_efficiency
from meshplan.calibration.space import GPU_FIELDS, all_names_help, by_name, codebase_factor
from meshplan.cost.params import CostParams
from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec, GPUSpec, LinkTier

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    values: dict[str, float]
    source: str = "built-in"
    """Where it was read from (a path, or 'built-in')."""
    info: dict[str, Any] = field(default_factory=dict)
    """fitted_from, changes, fit statistics: whatever the file carries besides values."""

    def apply_params(self, p: CostParams) -> CostParams:
        changes: dict[str, Any] = {k: v for k, v in self.values.items() if "@" not in k}
        mem, att = codebase_factor(self.values, "memory"), codebase_factor(self.values, "attention")
        if mem != 1.0:  # the codebase's memory-bound kernels (calibration.space.CODEBASE)
            changes["hbm_efficiency"] = min(1.0, changes.get("hbm_efficiency", p.hbm_efficiency) * mem)
        if att != 1.0:  # attention where the GPU gives no attention_efficiency (apply_gpu does the rest)
            changes["flash_fwd_efficiency"] = min(1.0, changes.get("flash_fwd_efficiency", p.flash_fwd_efficiency)
                                                  * att / codebase_factor(self.values, "gemm"))
        scale = self.band_scale
        if scale != 1.0:
            changes["band_scale"] = scale
        basis = self.band_basis
        if basis is not None:
            changes["band_basis"] = basis
        return p.replace(**changes) if changes else p

    @property
    def band_basis(self) -> str | None:
        """How well this calibration knows its codebase (CostParams.band_basis): fitted on K timed runs
        of one source (a user's codebase), the blind few-shot band at K (cost.uncertainty.
        knowledge_for_runs); None for a calibration of several sources, of micro-benchmarks only, or
        measured on CPU (the built-in bands stay)."""
        from meshplan.cost.uncertainty import knowledge_for_runs
        ff = self.info.get("fitted_from") or {}
        n, sources = ff.get("timed_runs"), ff.get("sources") or {}
        if not isinstance(n, int) or isinstance(n, bool) or len(sources) != 1 or self.measured_on_cpu:
            return None
        return knowledge_for_runs(n)

    @property
    def band_scale(self) -> float:
        """How much this calibration shrinks the out-of-sample bands (cost.uncertainty): a refinement
        of the built-in calibration on the user's own runs earns its step error after the fit over
        before it (at least cost.uncertainty.MIN_BAND_SCALE); a calibration from the priors, or one
        without those figures, keeps the built-in bands."""
        from meshplan.cost.uncertainty import MIN_BAND_SCALE
        fit = self.info.get("fit") or {}
        before, after = fit.get("step_mape_pct_before"), fit.get("step_mape_pct_after")
        prior = (self.info.get("fitted_from") or {}).get("prior")
        if prior != "builtin" or not isinstance(before, (int, float)) or not isinstance(after, (int, float)) \
                or before <= 0 or self.measured_on_cpu:
            return 1.0
        return max(MIN_BAND_SCALE, min(1.0, after / before))

    def apply_gpu(self, g: GPUSpec) -> GPUSpec:
        ch = {f: part_efficiency(self.values[gpu_key(f, g.family)], g.clock_ratio)
              for f in GPU_FIELDS if gpu_key(f, g.family) in self.values}
        gemm, att = codebase_factor(self.values, "gemm"), codebase_factor(self.values, "attention")
        if gemm != 1.0:  # the codebase's speed (calibration.space.CODEBASE) on top of the GPU's
            ch["gemm_efficiency"] = min(1.0, ch.get("gemm_efficiency", g.gemm_efficiency) * gemm)
        a = ch.get("attention_efficiency", g.attention_efficiency)
        if att != 1.0 and a is not None:
            ch["attention_efficiency"] = min(1.0, a * att)
        return dataclasses.replace(g, **ch) if ch else g

    def apply_link(self, t: LinkTier | None) -> LinkTier | None:
        if t is None:
            return None
        v = self.values.get(link_key(t.name, t.kind))
        comm = codebase_factor(self.values, "comm")
        if comm != 1.0:
            v = min(1.0, (t.efficiency if v is None else v) * comm)
        return t if v is None else dataclasses.replace(t, efficiency=v)

    def apply_cluster(self, c: ClusterSpec) -> ClusterSpec:
        ch: dict[str, Any] = {"gpu": self.apply_gpu(c.gpu)}
        for tier in ("intra_node", "inter_node", "inter_dc"):
            t = getattr(c, tier, None)
            if t is not None:
                ch[tier] = self.apply_link(t)
        return c.replace(**ch)

    @property
    def measured_on_cpu(self) -> bool:
        """Whether the values were measured on CPU (`meshplan calibrate --bench` without a GPU, or
        --metrics of a `meshplan train` run on CPU processes)."""
        return self.info.get("device_kind") == "cpu"

    def warnings(self) -> list[str]:
        """What a command using this calibration should warn about (one line each)."""
        if self.measured_on_cpu:
            return [f"--calibration {self.source} was measured on CPU (micro-benchmarks or a training run on CPU "
                    "processes): its values describe this machine's CPU, not a GPU; use it to test the pipeline, "
                    "not to plan GPU runs"]
        return []

    def describe(self) -> list[str]:
        """One line per value: name = value, and the built-in value it replaces (this meshplan's, not
        the one the file was fitted against) where it differs."""
        base = builtin().values
        out = []
        for k, v in sorted(self.values.items()):
            was = base.get(k)
            same = isinstance(was, (int, float)) and abs(v - was) <= 1e-6 * max(abs(was), 1e-12)
            out.append(f"{k} = {v:.4g}" + ("" if not isinstance(was, (int, float))
                                          else " (the built-in value)" if same else f" (built-in {was:.4g})"))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "kind": "calibration", **self.info,
                "values": {k: float(v) for k, v in sorted(self.values.items())}}


def _check_values(values: Any, where: str) -> dict[str, float]:
    if not isinstance(values, dict):
        raise MeshplanError(f"{where}: 'values' must be a table of parameter name -> number")
    out: dict[str, float] = {}
    for k, v in values.items():
        try:
            f = by_name(k)
        except KeyError:
            raise MeshplanError(f"{where}: unknown parameter {k!r}",
                                hint=f"calibrated parameters: {all_names_help()}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise MeshplanError(f"{where}: {k} must be a number; got {v!r}")
        if not f.low <= v <= f.high:
            raise MeshplanError(f"{where}: {k} = {v} is outside its physical range [{f.low:g}, {f.high:g}]",
                                hint="refit with `meshplan calibrate`, or correct the value")
        out[k] = float(v)
    return out


def calibration_from_dict(data: Any, where: str, source: str | None = None) -> Calibration:
    hint = "write one with `meshplan calibrate --runs RUNS.csv --out calibration.json`"
    if not isinstance(data, dict):
        raise MeshplanError(f"{where}: not a calibration file (expected a JSON object with 'values')", hint=hint)
    if data.get("kind") not in (None, "calibration"):
        raise MeshplanError(f"{where}: a {data.get('kind')!r} file, not a calibration", hint=hint)
    if "values" not in data:
        raise MeshplanError(f"{where}: not a calibration file (no 'values' table)", hint=hint)
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise MeshplanError(f"{where}: schema_version {version!r} is not one this meshplan reads ({SCHEMA_VERSION})",
                            hint="refit it with this version's `meshplan calibrate`")
    info = {k: v for k, v in data.items() if k not in ("values", "schema_version", "kind")}
    for k in ("fit", "fitted_from", "changes", "uncertainty", "posterior_sd"):
        if k in info and not isinstance(info[k], dict):
            raise MeshplanError(f"{where}: '{k}' must be a table (a JSON object); got {type(info[k]).__name__}",
                                hint="give the JSON file `meshplan calibrate --out` wrote, or delete that entry")
    return Calibration(_check_values(data["values"], where), source or where, info)


def read_json_file(path: str, flag: str, hint: str) -> Any:
    """A JSON file named by ``flag`` (e.g. --calibration), with one-line errors: unreadable, not
    text, not JSON."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise MeshplanError(f"cannot read {flag} {path}: {e.strerror or e}", hint=hint) from None
    except UnicodeDecodeError:
        raise MeshplanError(f"{flag} {path}: not a text file (JSON expected)", hint=hint) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MeshplanError(f"{flag} {path}: not valid JSON ({e.msg}, line {e.lineno})", hint=hint) from None


def load_calibration(path: str) -> Calibration:
    """A calibration file written by `meshplan calibrate` (clear errors, never a traceback)."""
    data = read_json_file(path, "--calibration", "give the JSON file `meshplan calibrate --out` wrote")
    cal = calibration_from_dict(data, f"--calibration {path}", path)
    for w in cal.warnings():
        print(f"meshplan: warning: {w}", file=sys.stderr, flush=True)
    return cal


def save_calibration(cal: Calibration, path: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(json.dumps(cal.to_dict(), indent=1) + "\n")
    except OSError as e:
        raise MeshplanError(f"cannot write --out {path}: {e.strerror or e}") from None


def builtin() -> Calibration:
    data = builtin_calibration()
    return calibration_from_dict(data, "built-in calibration", "built-in") if data else Calibration({})
