"""This machine as the cost model sees it: the cluster a `meshplan train` run is priced on
(``local_cluster``: a GPU preset on CUDA, else the CPU as ``cpu_cluster`` with its measured matmul rate,
``cpu_tflops``), the plan as this hardware runs it (``run_plan``) and the model the cost model prices
(``run_model``). Used by the launcher's pre-flight checks (preflight), the estimate beside a
measurement (launch, generic), --replan-after (replan) and calibrate --bench (bench).

No torch at import (torch is imported where a CUDA device or the CPU rate is read).
"""
from __future__ import annotations

import os
import time
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.runtime.hetero import local_plan
from meshplan.spec.cluster import ClusterSpec, GPUSpec, LinkTier, default_links
from meshplan.spec.io import parse_cluster_shorthand
from meshplan.spec.plan import Plan
from meshplan.spec.local_cpu import CPU_MEMORY_BANDWIDTH_GBPS, CPU_TFLOPS_ENV, LOOPBACK_GBPS, cpu_cluster
from meshplan.units import GiB

CUDA_PRESETS = (("H200", "h200-sxm-141gb"), ("H100", "h100-sxm-80gb"), ("A100-SXM4-40GB", "a100-sxm-40gb"),
                ("A100", "a100-sxm-80gb"), ("B200", "b200-sxm-192gb"), ("L40S", "l40s-48gb"),
                ("V100", "v100-sxm-32gb"))
"""CUDA device-name fragments -> GPU presets for the estimate printed beside the measurement."""
CPU_ESTIMATE_BASIS = ("cost model for a `local-cpu` device; indicative only on CPU: gloo and Python overheads "
                      "are not modelled")
"""The label of the estimate printed beside a CPU measurement (text and summary record)."""
CPU_MEMORY_BASIS = ("the pre-flight check's CPU-corrected figure: the cost model's 1 GiB GPU framework overhead "
                    "replaced by the host memory of an idle rank, fp32 activations counted at 4 bytes, offload "
                    "and fp8 as run on CPU")
"""The label of the estimated peak memory beside a CPU measurement (preflight.memory_estimate, not
the cost model's raw GPU figure, which is kept as ``cost_model_peak_memory_gib``)."""


def this_device_type() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_plan(plan: Plan, device_type: str) -> Plan:
    """The plan as this runtime runs it: on CPU offload flags are no-ops and fp8 runs as bf16
    (parallelize.hardware_notes), so the estimate is of the plan without them. Pools are placement
    only on one machine (runtime/hetero.py): priced without them, on this device type."""
    plan = local_plan(plan)
    if device_type == "cuda":
        return plan
    return plan.replace(offload_optimizer=False, offload_params=False,
                        precision="bf16" if plan.precision == "fp8" else plan.precision)


_CLUSTERS: dict[tuple[int, str, int, int | None], Any] = {}
"""local_cluster's ClusterSpecs in this process: the CPU rate is measured once, so the estimate, the
--replan-after check and the summary's cluster_spec describe the same cluster."""
_GRAPHS: dict[tuple[str, int | None], Any] = {}
"""run_model's traced LayerGraphs of ingested models in this process (None: not traceable)."""


def local_cluster(nproc: int, device_type: str, nodes: int = 1, nodes_per_dc: int | None = None) -> Any:
    """A ClusterSpec of this machine for the cost model: a GPU preset on CUDA, a measured CPU
    'GPU' (one process = one device) otherwise, over ``nodes`` nodes (``nodes_per_dc`` per
    datacenter, as --nnodes/--nodes-per-dc); one per process, size and topology (``_CLUSTERS``)."""
    key = (nproc, device_type, nodes, nodes_per_dc)
    if key not in _CLUSTERS:
        _CLUSTERS[key] = _local_cluster(nproc, device_type, nodes, nodes_per_dc)
    return _CLUSTERS[key]


def _local_cluster(nproc: int, device_type: str, nodes: int = 1, nodes_per_dc: int | None = None) -> Any:
    if device_type == "cuda":
        import torch
        name = torch.cuda.get_device_name()
        if nodes < 1 or nproc % nodes:
            nodes = 1
        for frag, preset in CUDA_PRESETS:
            if frag in name:
                c = parse_cluster_shorthand(f"{preset}:{nodes}x{nproc // nodes}")
                if nodes_per_dc and nodes_per_dc < nodes and nodes % nodes_per_dc == 0:
                    c = c.replace(inter_dc=LinkTier(name="inter_dc", bandwidth_gbps=c.inter_node.bandwidth_gbps,
                                                    kind="wan"), nodes_per_dc=nodes_per_dc)
                return c
    return cpu_cluster(nproc, cpu_tflops(), nodes=nodes, nodes_per_dc=nodes_per_dc)


def cpu_tflops(seconds: float = 0.2) -> float:
    """fp32 matmul TFLOP/s of one thread (256x256), measured for ``seconds`` after a warm-up. One
    thread whatever this process runs with (a rank runs one; the launcher, before any rank starts,
    would otherwise measure torch's default thread pool, which on a loaded machine was 10-60x slower)."""
    known = os.environ.get(CPU_TFLOPS_ENV)
    if known:
        try:
            return float(known)
        except ValueError:
            pass
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256)
        for _ in range(3):
            a @ a
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ a
            n += 1
        rate = 2 * 256**3 * n / (time.perf_counter() - t0) / 1e12
    finally:
        torch.set_num_threads(threads)
    os.environ[CPU_TFLOPS_ENV] = repr(rate)  # the ranks (and a --switch restart) inherit it: one estimate
    return rate


def estimate_basis(cluster_name: str) -> str:
    """What the estimate beside a measurement is: on CPU, the cost model for a `local-cpu` device,
    indicative only; on GPUs, the cost model for the device's GPU preset."""
    if cluster_name.startswith("local-cpu"):
        return CPU_ESTIMATE_BASIS
    return f"cost model for {cluster_name} (the GPU preset of this device)"


def run_model(job: Any) -> Any:
    """What the cost model prices for this job: a preset's ModelSpec, an ingested model's LayerGraph
    at the run's sequence length (traced once per process; None when it cannot be traced)."""
    if not job.ingested:
        return job.model
    key = (str(job.model), job.seq_len)
    if key not in _GRAPHS:
        from meshplan.ingest import ingest
        try:
            _GRAPHS[key] = ingest(job.model, seq_len=job.seq_len)
        except MeshplanError:
            _GRAPHS[key] = None
    return _GRAPHS[key]


def cpu_memory(est: dict[str, Any], mem: Any) -> dict[str, Any]:
    """An estimate dict (``estimate_for``) with the pre-flight check's CPU-corrected peak memory per
    process (``mem``: preflight.MemoryEstimate, the fullest rank) in place of the cost model's GPU
    figure, labelled (``peak_memory_basis``); the raw figure is kept as
    ``cost_model_peak_memory_gib``. Unchanged when ``mem`` is None (not priced)."""
    if mem is None:
        return est
    return {**est, "peak_memory_gib": mem.per_process_gib, "peak_memory_basis": CPU_MEMORY_BASIS,
            "cost_model_peak_memory_gib": est.get("peak_memory_gib")}


