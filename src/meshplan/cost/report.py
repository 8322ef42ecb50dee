"""CostReport: what `estimate` returns for a plan on one GPU pool, and the row of a
cost.batch result it is made from."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from meshplan.cost.batch import ALLOCATED_KEYS, MEMORY_KEYS, TIME_KEYS
from meshplan.cost.memory import usable_gib
from meshplan.cost.params import DEFAULT_PARAMS, CostParams


@dataclass(frozen=True, kw_only=True)
class CostReport:
    """Predicted cost of one optimizer step of a plan. Times in seconds, memory in GiB."""

    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    """Model TFLOP/s per GPU (6N + 12 l h s per token convention; recompute not counted)."""
    mfu: float
    """Model FLOPs utilisation against the dense bf16/fp16 peak."""
    hfu: float
    """Hardware FLOPs utilisation (recompute counted)."""
    peak_memory_gib: float
    """Maximum over pipeline stages of the predicted peak memory per GPU: what nvidia-smi shows
    (reserved + the CUDA context and NCCL's buffers, cost.reserved), what the verdict takes."""
    fits: bool
    """peak_memory_gib <= usable memory (HBM less the stated safety margin)."""
    usable_memory_gib: float
    host_memory_gib: float = 0.0
    """Host memory per GPU the offload takes (optimizer states, FSDP's offloaded shards)."""
    host_fits: bool = True
    """host_memory_gib <= host_memory_per_gpu_gib."""
    host_memory_per_gpu_gib: float = 0.0
    """A GPU's share of its node's host memory (ClusterSpec.host_memory_per_gpu_gib): what its
    offload may take."""
    at_risk: bool = False
    """Fits, but its chance of running out of memory exceeds CostParams.max_oom_risk (or it
    leaves less than CostParams.headroom_gib free): not recommended by default."""
    oom_probability: float = 0.0
    """Chance that the true peak exceeds the usable memory, from the memory model's
    out-of-sample errors for this profile (cost.uncertainty)."""
    step_time_s_low: float = 0.0
    step_time_s_high: float = 0.0
    """The 90% band of the step time from the cost model's out-of-sample errors."""
    peak_memory_gib_high: float = 0.0
    """The 95th percentile of the peak memory per GPU."""
    allocated_memory_gib: float = 0.0
    """The same rank's live tensors at the peak (torch.cuda.max_memory_allocated)."""
    reserved_memory_gib: float = 0.0
    """... plus what PyTorch's caching allocator keeps beyond them (torch.cuda.max_memory_reserved)."""
    params: int
    num_gpus: int
    microbatches: int
    """Micro-batches per data-parallel rank per step."""
    memory: dict[str, float]
    """Breakdown of the worst stage: weights, grads, optimizer, activations, transient, overhead, total."""
    memory_per_stage: list[float]
    """Peak GiB of each pipeline stage."""
    time: dict[str, float]
    """Exposed seconds per step: compute, recompute, tp_comm, cp_comm, ep_comm, dp_comm,
    pp_comm, bubble, optimizer, outer_sync, straggler, overhead (they sum to step_time_s), plus
    *_overlapped entries for communication hidden under compute."""
    dominant: str
    """The largest exposed term."""
    notes: list[str] = field(default_factory=list)
    token_factor: float = 1.0
    """Tokens this plan's sync method and compression need to reach a target loss, relative to
    fully synchronous training (cost.convergence)."""
    time_to_target_s: float = 0.0
    """step_time_s x token_factor: seconds per step of synchronous-equivalent progress."""
    cross_site_gb: float = 0.0
    """GB per step crossing each direction of the link between two datacenters (0: one site)."""
    outer_sync_s: float = 0.0
    """One whole outer sync of a local-sgd/diloco plan (it is amortised over sync_every steps in
    time['outer_sync'])."""
    outer_workers: int = 1
    """Inner groups a local-sgd/diloco plan averages (1: synchronous)."""
    straggler_sync_s: float = 0.0
    """The straggler wait the same plan would have per step if it synced every step over all
    its ranks (equal to time['straggler'] for synchronous plans): what local SGD hides."""

    @property
    def verdict(self) -> str:
        """fits, at-risk or does-not-fit (cost.uncertainty)."""
        from meshplan.cost.uncertainty import verdict
        return verdict(self.fits and self.host_fits, self.at_risk)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"verdict": self.verdict}


def report_from_row(model: Any, cluster: Any, r: dict[str, np.ndarray], i: int,
                    params: CostParams = DEFAULT_PARAMS) -> CostReport:
    """Row ``i`` of a cost.batch (or cost.lengths / cost.buckets) result as a CostReport; a result
    that carries ``time.imbalance`` (a length distribution's) keeps it in ``time``."""
    time = {k: float(r[f"time.{k}"][i]) for k in TIME_KEYS}
    if "time.imbalance" in r:
        time["imbalance"] = float(r["time.imbalance"][i])
    exposed = {k: v for k, v in time.items() if not k.endswith("_overlapped")}
    memory = {k: float(r[f"memory.{k}"][i]) for k in MEMORY_KEYS}
    memory["total"] = sum(memory.values())
    allocated = sum(memory[k] for k in ALLOCATED_KEYS)
    stages = r["stage_memory_gib"][i]
    return CostReport(
        step_time_s=float(r["step_time_s"][i]), tokens_per_s=float(r["tokens_per_s"][i]),
        tflops_per_gpu=float(r["tflops_per_gpu"][i]), mfu=float(r["mfu"][i]), hfu=float(r["hfu"][i]),
        peak_memory_gib=float(r["peak_memory_gib"][i]), allocated_memory_gib=allocated,
        reserved_memory_gib=allocated + memory["allocator"], fits=bool(r["fits"][i]), at_risk=bool(r["at_risk"][i]),
        oom_probability=float(r["oom_probability"][i]), step_time_s_low=float(r["step_time_s_low"][i]),
        step_time_s_high=float(r["step_time_s_high"][i]), peak_memory_gib_high=float(r["peak_memory_gib_high"][i]),
        host_memory_gib=float(r["host_memory_gib"][i]), host_fits=bool(r["host_fits"][i]),
        host_memory_per_gpu_gib=float(getattr(cluster, "host_memory_per_gpu_gib", 0.0)),
        usable_memory_gib=usable_gib(cluster, params),
        params=model.num_params(), num_gpus=int(r["num_gpus"][i]),
        microbatches=int(r["microbatches"][i]), memory=memory,
        memory_per_stage=[float(x) for x in stages[~np.isnan(stages)]], time=time,
        dominant=max(exposed, key=exposed.__getitem__), token_factor=float(r["token_factor"][i]),
        time_to_target_s=float(r["time_to_target_s"][i]), cross_site_gb=float(r["cross_site_gb"][i]),
        outer_sync_s=float(r["outer_sync_s"][i]), outer_workers=int(r["outer_workers"][i]),
        straggler_sync_s=float(r["straggler_sync_s"][i]))
