"""estimate(model, cluster, plan, workload) -> CostReport. A pure function.

The arithmetic lives in batch.estimate_batch (one implementation for one plan or 10^5);
this module checks the plan and turns the single row into a CostReport.
"""
from __future__ import annotations

import numpy as np

from meshplan.cost.batch import MEMORY_KEYS, TIME_KEYS, estimate_batch
from meshplan.cost.memory import usable_gib
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.report import CostReport
from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.constraints import violations
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload


def check(model: ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload) -> None:
    """Raise MeshplanError naming every reason the plan cannot run (memory aside)."""
    bad = violations(model, cluster, plan, work)
    if bad:
        raise MeshplanError("plan cannot run: " + "; ".join(reason for _, reason in bad))


def estimate(model: ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
             params: CostParams = DEFAULT_PARAMS) -> CostReport:
    """Predict step time, throughput and peak memory per GPU of ``plan``."""
    if plan.pools is not None or plan.dp_shares is not None:  # placement on pools, uneven shares: cost.pools
        from meshplan.cost.pools import single_type_report
        return single_type_report(model, cluster, plan, work, params)
    if plan.buckets is not None:  # a data-aware plan: micro-batch and cp per length bucket
        from meshplan.cost.buckets import estimate_buckets
        return estimate_buckets(model, cluster, plan, work, params)
    check(model, cluster, plan, work)
    r = estimate_batch(model, cluster, work, [plan], params)
    return report_from_row(model, cluster, r, 0, params)


def report_from_row(model: ModelSpec, cluster: ClusterSpec, r: dict[str, np.ndarray], i: int,
                    params: CostParams = DEFAULT_PARAMS) -> CostReport:
    """Row ``i`` of an estimate_batch result as a CostReport."""
    time = {k: float(r[f"time.{k}"][i]) for k in TIME_KEYS}
    exposed = {k: v for k, v in time.items() if not k.endswith("_overlapped")}
    memory = {k: float(r[f"memory.{k}"][i]) for k in MEMORY_KEYS}
    memory["total"] = sum(memory.values())
    stages = r["stage_memory_gib"][i]
    return CostReport(
        step_time_s=float(r["step_time_s"][i]), tokens_per_s=float(r["tokens_per_s"][i]),
        tflops_per_gpu=float(r["tflops_per_gpu"][i]), mfu=float(r["mfu"][i]), hfu=float(r["hfu"][i]),
        peak_memory_gib=float(r["peak_memory_gib"][i]), fits=bool(r["fits"][i]), at_risk=bool(r["at_risk"][i]),
        oom_probability=float(r["oom_probability"][i]), step_time_s_low=float(r["step_time_s_low"][i]),
        step_time_s_high=float(r["step_time_s_high"][i]), peak_memory_gib_high=float(r["peak_memory_gib_high"][i]),
        host_memory_gib=float(r["host_memory_gib"][i]), host_fits=bool(r["host_fits"][i]),
        usable_memory_gib=usable_gib(cluster, params),
        params=model.num_params(), num_gpus=int(r["num_gpus"][i]),
        microbatches=int(r["microbatches"][i]), memory=memory,
        memory_per_stage=[float(x) for x in stages[~np.isnan(stages)]], time=time,
        dominant=max(exposed, key=exposed.__getitem__), token_factor=float(r["token_factor"][i]),
        time_to_target_s=float(r["time_to_target_s"][i]), cross_site_gb=float(r["cross_site_gb"][i]),
        outer_sync_s=float(r["outer_sync_s"][i]), outer_workers=int(r["outer_workers"][i]),
        straggler_sync_s=float(r["straggler_sync_s"][i]))
