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
  dominant         str      the largest exposed time term (CostReport.dominant: compute,
                            recompute, tp_comm, cp_comm, ep_comm, dp_comm, pp_comm, bubble,
                            optimizer, overhead)

Contract: rows must satisfy every constraint of meshplan.spec.constraints (the search only
passes such rows); results for other rows are unspecified (this version gives inf / nan /
fits False / dominant "invalid"). The results must equal `meshplan.cost.estimate` row by row
(a test checks it on random plans), so a vectorised body can replace this loop without any
caller changing.
"""
from __future__ import annotations

import numpy as np

from meshplan.cost import estimate
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.errors import MeshplanError
from meshplan.search.columns import PlanColumns
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Workload

FLOAT_COLUMNS = ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_gib")
COLUMNS = FLOAT_COLUMNS + ("fits", "dominant")


def evaluate(model: ModelSpec, cluster: ClusterSpec, work: Workload, cols: PlanColumns,
             params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """Predicted cost of every row of ``cols`` (see the module docstring for the columns)."""
    n = cols.num_rows
    out = {k: np.full(n, np.nan) for k in FLOAT_COLUMNS}
    fits = np.zeros(n, dtype=bool)
    dominant = np.full(n, "invalid", dtype=object)
    for i, plan in enumerate(cols.plans()):
        try:
            r = estimate(model, cluster, plan, work, params)
        except MeshplanError:
            out["step_time_s"][i] = np.inf
            continue
        out["step_time_s"][i] = r.step_time_s
        out["tokens_per_s"][i] = r.tokens_per_s
        out["tflops_per_gpu"][i] = r.tflops_per_gpu
        out["mfu"][i] = r.mfu
        out["peak_memory_gib"][i] = r.peak_memory_gib
        fits[i] = r.fits
        dominant[i] = r.dominant
    return out | {"fits": fits, "dominant": dominant.astype(str)}
