"""The one seam between the search and the cost model: price many plans at once.

    evaluate(model, cluster, work, cols, params=DEFAULT_PARAMS) -> dict[str, np.ndarray]

``cols`` is a `meshplan.search.columns.PlanColumns` (one array per Plan field, categoricals as
codes, stage_layers as codes into ``cols.stage_table``). Every returned array has one entry
per row of ``cols``, in the same order:

  step_time_s      float64  predicted seconds per optimizer step (CostReport.step_time_s)
  tokens_per_s     float64  global tokens per second (global_batch x seq_len / step time)
  tflops_per_gpu   float64  model TFLOP/s per GPU (CostReport.tflops_per_gpu)
  mfu              float64  model FLOPs utilisation against the dense 16-bit peak
  peak_memory_gib  float64  predicted peak memory of the fullest GPU, GiB
  fits             bool     peak_memory_gib <= usable memory (HBM less the cost model's margin)
  at_risk          bool     fits, but within the memory model's demonstrated error of the limit
  host_fits        bool     the host memory an offload takes fits (ClusterSpec.host_memory_per_gpu_gib)
  dominant         str      the largest exposed time term (CostReport.dominant: compute,
                            recompute, tp_comm, cp_comm, ep_comm, dp_comm, pp_comm, bubble,
                            optimizer, overhead; the first in that order on ties)

Contract: rows must satisfy every constraint of meshplan.spec.constraints (the search only
passes such rows); results for other rows are unspecified. The results equal
`meshplan.cost.estimate` row by row (tests check it on random plans).

`evaluate` runs the cost model's vectorised kernel (`meshplan.cost.batch.estimate_batch`) on
the decoded columns; `evaluate_loop` is the reference: one `estimate()` per row (rows it
refuses get step_time_s = inf, fits False, dominant "invalid").
"""
from __future__ import annotations

import numpy as np

from meshplan.cost import estimate
from meshplan.cost.batch import TIME_KEYS, estimate_batch
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.errors import MeshplanError
from meshplan.search.columns import PlanColumns
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Workload

FLOAT_COLUMNS = ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_gib", "oom_probability",
                 "time_to_target_s", "cross_site_gb")
COLUMNS = (*FLOAT_COLUMNS, "fits", "at_risk", "host_fits", "dominant")
EXPOSED_TERMS = tuple(k for k in TIME_KEYS if not k.endswith("_overlapped"))
"""Time terms that add up to the step time, in CostReport.time order."""


def empty_columns() -> dict[str, np.ndarray]:
    return {k: np.zeros(0) for k in FLOAT_COLUMNS} | {
        "fits": np.zeros(0, dtype=bool), "at_risk": np.zeros(0, dtype=bool), "host_fits": np.zeros(0, dtype=bool),
        "dominant": np.zeros(0, dtype=str)}


def evaluate(model: ModelSpec, cluster: ClusterSpec, work: Workload, cols: PlanColumns,
             params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """Predicted cost of every row of ``cols`` (see the module docstring for the columns)."""
    if cols.num_rows == 0:
        return empty_columns()
    r = estimate_batch(model, cluster, work, cols.plain(), params)
    terms = np.stack([np.asarray(r[f"time.{k}"], dtype=float) for k in EXPOSED_TERMS])
    out = {k: np.asarray(r[k], dtype=float) for k in FLOAT_COLUMNS}
    return out | {"fits": np.asarray(r["fits"], dtype=bool), "at_risk": np.asarray(r["at_risk"], dtype=bool),
                  "host_fits": np.asarray(r["host_fits"], dtype=bool),
                  "dominant": np.asarray(EXPOSED_TERMS)[np.argmax(terms, axis=0)]}


def recommendable(res: dict[str, np.ndarray], headroom: bool = True) -> np.ndarray:
    """Rows of an evaluate() result the search may recommend: they fit on the GPU and on the
    host, and (with ``headroom``) not within the memory model's error of the limit."""
    ok = np.asarray(res["fits"], dtype=bool) & np.asarray(res.get("host_fits", True), dtype=bool)
    return ok & ~np.asarray(res.get("at_risk", False), dtype=bool) if headroom else ok


def evaluate_loop(model: ModelSpec, cluster: ClusterSpec, work: Workload, cols: PlanColumns,
                  params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """The same columns from one `estimate()` call per row (the reference for tests)."""
    n = cols.num_rows
    if n == 0:
        return empty_columns()
    out = {k: np.full(n, np.nan) for k in FLOAT_COLUMNS}
    fits = np.zeros(n, dtype=bool)
    at_risk = np.zeros(n, dtype=bool)
    host_fits = np.ones(n, dtype=bool)
    dominant = np.full(n, "invalid", dtype=object)
    for i, plan in enumerate(cols.plans()):
        try:
            r = estimate(model, cluster, plan, work, params)
        except MeshplanError:
            out["step_time_s"][i] = np.inf
            continue
        for k in FLOAT_COLUMNS:
            out[k][i] = getattr(r, k)
        fits[i] = r.fits
        at_risk[i] = r.at_risk
        host_fits[i] = r.host_fits
        dominant[i] = r.dominant
    return out | {"fits": fits, "at_risk": at_risk, "host_fits": host_fits, "dominant": dominant.astype(str)}
