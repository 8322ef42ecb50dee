"""Evaluators for the benchmarks: the library's `evaluate` (one estimate() per plan) and a
preview of the vectorised seam on meshplan.cost.batch.estimate_batch, to measure what the
search costs once evaluate() is vectorised. Both return evaluate()'s columns."""
from __future__ import annotations

import numpy as np

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.search.columns import PlanColumns
from meshplan.search.evaluate import FLOAT_COLUMNS, evaluate
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Workload


def batch_evaluate(model: ModelSpec, cluster: ClusterSpec, work: Workload, cols: PlanColumns,
                   params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """evaluate()'s contract through estimate_batch (dominant: the largest exposed term, first
    in TIME_KEYS order on ties, as CostReport.dominant)."""
    from meshplan.cost.batch import TIME_KEYS, estimate_batch
    r = estimate_batch(model, cluster, work, cols.plain(), params)
    exposed = [k for k in TIME_KEYS if not k.endswith("_overlapped")]
    t = np.stack([np.asarray(r[f"time.{k}"], dtype=float) for k in exposed])
    dominant = (np.asarray(exposed)[np.argmax(t, axis=0)] if cols.num_rows
                else np.zeros(0, dtype=str))
    out = {k: np.asarray(r[k], dtype=float) for k in FLOAT_COLUMNS}
    return out | {"fits": np.asarray(r["fits"], dtype=bool), "dominant": dominant}


EVALUATORS = {"loop": (evaluate, 2048), "batch": (batch_evaluate, 1 << 17)}
"""name -> (evaluator, rows per call)."""
