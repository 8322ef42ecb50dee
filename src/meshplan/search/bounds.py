"""Cheap exact lower bounds that reject plans before the full cost estimate.

A bound may only reject a plan that `meshplan.cost.estimate` would also find not to fit
(tests check this on random plans and on whole small spaces). Two are used:

1. Model states (``states_lower_bound_gib``). The estimate's peak memory of a stage is
   weights + grads + optimizer + activations + transient + overhead, every part >= 0, and the
   first three are ``meshplan.cost.memory.model_state_bytes(stage params, ...)`` (FSDP under a
   pipeline adds more, ignored here). So the states of the stage holding the embedding and of
   the one holding the output layer, plus the fixed framework overhead, bound the peak from
   below. Stage parameters are counted as the cost model counts them (blocks split by TP and
   EP; embedding on the first stage; final norm and output projection, a copy when tied, on
   the last; under ZBV both on rank 0, no copy, and the last rank holds blocks only:
   ``cost.batch.output_stage``). The bytes per parameter come from the cost model's own
   function, called once per distinct (degrees, zero, offload, split, zbv or not, precision).

2. Micro-batch monotonicity (used by the search driver, not here): with every other field
   fixed, the estimate's peak memory does not decrease with micro_batch (kept activations
   scale with micro_batch x micro-batches in flight, which never shrinks: GPipe keeps
   B/dp sequences, 1F1B min(B/dp, (pp - i) x micro_batch), zero-bubble min(B/dp, pp x
   micro_batch), ZBV min(B/dp, (B/dp + (i + 1) micro_batch) / 2, pp x micro_batch);
   transients scale with it). So once a micro-batch size does not fit, the larger ones of the
   same plan are not estimated.
"""
from __future__ import annotations

import numpy as np

from meshplan.cost.batch import stage_params
from meshplan.cost.memory import model_state_arrays, optimizer_cost
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.parts import plans_to_columns, shard_degree
from meshplan.search.columns import CATEGORIES, NONE_CODE, PlanColumns
from meshplan.spec.axes import AX
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload
from meshplan.spec.transformer import as_graph
from meshplan.units import GiB

_STATE_KEYS = (AX.TP, AX.PP, AX.DP, AX.CP, AX.EP, "zero", "shard_group", "offload_optimizer",
               "offload_params", "stage_layers", "virtual_stages", "precision")
_ZBV = CATEGORIES["schedule"].index("zbv")


def unique_rows(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows of a 2-D int array in lexicographic order, index of each row's distinct
    row): np.unique(axis=0, return_inverse=True), by lexsort (about 15x faster)."""
    order = np.lexsort(keys.T[::-1])
    s = keys[order]
    new = np.ones(len(s), dtype=bool)
    new[1:] = np.any(s[1:] != s[:-1], axis=1)
    inverse = np.empty(len(s), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return s[new], inverse


def states_lower_bound_gib(model: LayerGraph | ModelSpec, cols: PlanColumns, work: Workload | None = None,
                           params: CostParams = DEFAULT_PARAMS) -> np.ndarray:
    """Per row: a lower bound on the estimate's peak memory per GPU, GiB (``work``: the
    sequence length a transformer description is generated at; default its own)."""
    n = cols.num_rows
    if n == 0:
        return np.zeros(0)
    graph = as_graph(model, work.seq_len if work is not None else getattr(model, "seq_len", 0))
    keys = np.stack([cols[k].astype(np.int64) for k in _STATE_KEYS] + [(cols["schedule"] == _ZBV).astype(np.int64)],
                    axis=1)
    uniq, inverse = unique_rows(keys)
    plans = []
    for row in uniq.tolist():
        d = dict(zip(_STATE_KEYS, row))
        code = d["stage_layers"]
        plans.append(Plan(tp=d[AX.TP], pp=d[AX.PP], dp=d[AX.DP], cp=d[AX.CP], ep=d[AX.EP], zero=d["zero"],
                          shard_group=d["shard_group"], offload_optimizer=bool(d["offload_optimizer"]),
                          offload_params=bool(d["offload_params"]),
                          schedule="zbv" if row[-1] else ("interleaved-1f1b" if d["virtual_stages"] > 1 else "1f1b"),
                          virtual_stages=d["virtual_stages"], precision=CATEGORIES["precision"][d["precision"]],
                          stage_layers=None if code == NONE_CODE else cols.stage_table[code]))
    plain = plans_to_columns(plans)
    plocal, lp = stage_params(graph, plain)
    shard = shard_degree(plain)

    def col(k: str) -> np.ndarray:
        return np.asarray(plain[k])[:, None]

    opt = optimizer_cost(work.optimizer if work is not None else "adamw", graph)
    w, g, o, _ = model_state_arrays(plocal, lp[:, None], col("zero"), shard[:, None], col("offload_params"),
                                    col("offload_optimizer"), col(AX.DP) * col(AX.CP), params, col("precision"),
                                    opt=opt)
    valid = np.arange(plocal.shape[1])[None, :] < col(AX.PP)
    out = np.where(valid, w + g + o, 0.0).max(axis=1)
    return out[inverse] / GiB + params.framework_overhead_gib
