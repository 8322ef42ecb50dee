"""The cost model's front door: estimate(model, cluster, plan, workload) for any cluster (one GPU
pool or several), any workload (one length, or a length distribution: padded, bucketed, packed)
and any plan (pools / pool_dp / pool_pp / dp_shares, buckets). A pure function.

It dispatches once, downward, through the layers of cost/ (each imports only those below it):

- cost.batch: the vectorised kernel, one length on one GPU type (one implementation for one plan
  or 10^5); ``estimate_batch`` there, ``check`` the plan's constraints;
- cost.lengths: a length distribution over the kernel (the expected step, its imbalance);
- cost.buckets: bucket plans over lengths, and ``plan_report`` / ``plan_batch``: a plan on one GPU
  type, its buckets if it has them, else cost.lengths;
- cost.pools: placement, a plan over pools (pool_dp, pool_pp) or with uneven dp_shares, each
  pool's part priced by the layers below;
- here: which of those a (cluster, plan) needs.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshplan.cost.activations import SELECTIVE_NOTE, selective_saves_nothing
from meshplan.cost.batch import check
from meshplan.cost.buckets import plan_batch, plan_report
from meshplan.cost.lengths import expected_batch
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.pools import PooledEstimate, estimate_pooled, shares_report
from meshplan.cost.report import CostReport
from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX
from meshplan.spec.cluster import ClusterSpec, PooledCluster
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

__all__ = ["check", "estimate", "estimate_batch", "lengths_summary"]


def estimate(model: LayerGraph | ModelSpec, cluster: ClusterSpec | PooledCluster, plan: Plan, work: Workload,
             params: CostParams = DEFAULT_PARAMS) -> CostReport | PooledEstimate:
    """Predict step time, throughput and peak memory per GPU of ``plan``.

    A cluster of one pool gives a CostReport (a plan with ``pools`` naming one pool, or with
    uneven dp_shares, priced on it by cost.pools); a cluster of several pools gives a
    PooledEstimate (cost.pools: every rank on its own pool's hardware, the pools' parts each a
    CostReport), with the same step_time_s, tokens_per_s, mfu, fits, peak_memory_gib, notes."""
    if len(cluster.pools) > 1:
        return estimate_pooled(model, cluster, plan, work, params)
    pool = cluster.pools[0]
    other = [n for n in plan.pools or () if n != pool.name]
    if other:  # a cluster of one GPU type has one pool, its own name
        raise MeshplanError(f"plan: pools={':'.join(plan.pools or ())}: cluster {pool.name} has one GPU type, "
                            f"{pool.gpu.name}: one pool, named {pool.name!r}, and no pool named {other[0]!r}",
                            hint="drop pools= from the plan, or give a cluster file with [[pools]]")
    if plan.pools is not None or plan.dp_shares is not None:  # placement on the pool, uneven shares
        return shares_report(model, pool, plan, work, params)
    report = plan_report(model, pool, plan, work, params)
    if plan.recompute == "selective" and selective_saves_nothing(model, plan, params, work.seq_len):
        rc = report.time.get("recompute", 0.0)
        took = f"{rc * 1e3:,.1f} ms" if rc < 1 else f"{rc:,.2f} s"
        report.notes.append(SELECTIVE_NOTE.format(cost=f"+{took} per step, {100 * rc / report.step_time_s:.1f}% of the step"))
    return report


def estimate_batch(model: LayerGraph | ModelSpec, cluster: ClusterSpec | PooledCluster, work: Workload,
                   plans: Sequence[Plan] | Mapping[str, Any],
                   params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """``estimate`` of many plans on one GPU pool, vectorised (the search's entry): plans or
    columns (cost.parts.plans_to_columns), already satisfying spec.constraints (the search masks);
    one length (cost.batch's keys) or a length distribution (cost.lengths': the expected step,
    with time.imbalance and cost.lengths.EXTRA_KEYS); bucket plans (all of them) by cost.buckets.
    Plans over several pools are priced one at a time by ``estimate`` (cost.pools)."""
    if len(cluster.pools) > 1:
        raise MeshplanError(f"cluster {cluster.name} has {len(cluster.pools)} pools: estimate_batch prices plans on "
                            "one pool (each pool's part of a plan over pools is priced on that pool)",
                            hint="call it with cluster.pool(NAME), or estimate() per plan over the pools")
    return plan_batch(model, cluster.pools[0], work, plans, params)


def lengths_summary(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                    params: CostParams = DEFAULT_PARAMS) -> dict[str, Any]:
    """The length terms of one plan on one pool (for --json and the text views): the distribution,
    the expected step, the even-load step, the imbalance, padding; with buckets, what they are."""
    if plan.buckets is not None:
        from meshplan.spec.buckets import describe
        r = plan_batch(model, cluster, work, [plan], params)
        extra = {"buckets": describe(plan.bucket_specs)}
    else:
        r = expected_batch(model, cluster, work, [plan], params)
        extra = {}
    d = work.lengths
    return {"lengths": d.text() if d else str(work.seq_len), "packing": d.packing if d else "padded",
            "mean_length": d.mean_len if d else float(work.seq_len), "max_length": work.seq_len,
            "expected_step_s": float(r["step_time_s"][0]), "step_time_even_s": float(r["step_time_even_s"][0]),
            "imbalance_s": float(r["imbalance_s"][0]), "padding_fraction": float(r["padding_fraction"][0]),
            "real_tokens_per_step": int(work.tokens), "padded_tokens_per_step": float(r["padded_tokens"][0]),
            AX.PP: plan.pp, "pipeline_one_shape": bool(plan.pp > 1 and not params.pipeline_variable_shapes
                                       and (d is None or d.packing != "packed"))} | extra
