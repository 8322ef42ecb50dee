"""A measured training run as the cost model sees it: RunCase, and the CostParams it is estimated with.

A RunCase is a ModelSpec, a ClusterSpec, a Plan and a Workload with the measured step time and
peak memory. ``validate.runs`` builds them from a published-runs CSV, ``calibration.metrics`` from
``meshplan train --metrics`` files; ``validate`` compares estimates with them and ``calibration``
fits to them. This module sits between ``cost`` and those two packages, so that neither imports
the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.profile import get_profile
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload


@dataclass(frozen=True)
class RunCase:
    """One published run, ready to be estimated and compared."""

    row_id: str
    source_id: str
    model_name: str
    status: str
    """'ok' (expressible) or 'unsupported' (see ``reason``)."""
    reason: str = ""
    """Why the row is unsupported ('' when ok)."""
    assumptions: list[str] = field(default_factory=list)
    """Every default the loader had to assume, one line each."""
    model: ModelSpec | None = None
    cluster: ClusterSpec | None = None
    plan: Plan | None = None
    work: Workload | None = None
    measured_step_time_s: float | None = None
    measured_peak_mem_gib: float | None = None
    measured_from: str = ""
    """Which column and formula gave ``measured_step_time_s`` ('' if none)."""
    memory_by_nvidia_smi: bool = False
    """``measured_peak_mem_gib`` is nvidia-smi's (the row says so), not torch's allocator's."""
    raw: dict[str, str] = field(default_factory=dict)
    """The CSV row as read (column name -> cell text)."""
    run_status: str = "ok"
    """The row's own status column: 'ok', 'oom', 'failed', ... (blank read as 'ok')."""
    measured_fits: bool | None = None
    """False for an 'oom' row, True for an 'ok' row with a measurement, else None."""
    framework: str = "unknown"
    """megatron, torchtitan, llm-foundry, deepspeed or unknown (drives the defaults)."""
    gpu_preset: str | None = None
    """The GPU preset name the row's gpu_type mapped to."""
    profile: str = "meshplan"
    """The implementation profile of the row's codebase (meshplan.cost.profile.get_profile):
    from an explicit ``framework`` cell, else the detected framework."""
    overrides: dict = field(default_factory=dict)
    """The row's CostParams settings beyond its profile (e.g. {'attention_kernel': 'eager'} from
    the attention_impl cell): params = get_profile(profile).apply(base).replace(**overrides)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


#: What a measured peak memory counts -> the estimate's field it is compared with (cost.reserved):
#: torch's max_memory_allocated, max_memory_reserved, or nvidia-smi's (context and NCCL included).
MEMORY_MEASURES = {"allocated": "allocated_memory_gib", "reserved": "reserved_memory_gib",
                   "nvidia-smi": "peak_memory_gib"}


def memory_measure(case: Any) -> str:
    """Which memory a case's measured peak is: 'nvidia-smi' where the row says so; 'allocated'
    where it names max_memory_allocated; else 'reserved' (torch's max_memory_reserved: what
    torchtitan logs as its peak memory, and meshplan train --metrics records)."""
    if getattr(case, "memory_by_nvidia_smi", False):
        return "nvidia-smi"
    raw = getattr(case, "raw", None) or {}
    text = " ".join(str(raw.get(k, "")) for k in ("other_settings", "notes", "uncertain_fields")).lower()
    return "allocated" if "max_memory_allocated" in text else "reserved"


def predicted_memory(case: Any, est: Any) -> float | None:
    """The estimate's memory that matches what ``case`` measured (memory_measure)."""
    key = MEMORY_MEASURES[memory_measure(case)]
    v = est.get(key) if isinstance(est, dict) else getattr(est, key, None)
    if v is None:  # an estimate without the split (a stand-in estimate function): its peak
        v = est.get("peak_memory_gib") if isinstance(est, dict) else getattr(est, "peak_memory_gib", None)
    return None if v is None else float(v[0] if hasattr(v, "__len__") else v)


def case_params(case: Any, base: CostParams = DEFAULT_PARAMS) -> CostParams:
    """A run's CostParams: its codebase's profile and its own cells (e.g. its attention kernel)."""
    p = get_profile(getattr(case, "profile", None) or None).apply(base)
    over = getattr(case, "overrides", None) or {}
    return p.replace(**over) if over else p
