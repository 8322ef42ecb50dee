"""This machine's CPU as a cluster the cost model prices: ``cpu_cluster`` (what `meshplan train`
on CPU processes and `--cluster local-cpu` describe). Pure Python: the runtime measures the CPU's
rate (runtime.local.cpu_tflops) and passes it in; planning reads it from $MESHPLAN_CPU_TFLOPS or
measures numpy's (spec.io.local_cpu_cluster)."""
from __future__ import annotations

import os
from typing import Any

from meshplan.spec.cluster import ClusterSpec, GPUSpec, LinkTier, default_links
from meshplan.units import GiB

CPU_MEMORY_BANDWIDTH_GBPS = 20.0
"""Assumed DRAM bandwidth of the local CPU 'device' (one socket, a few channels); order of magnitude."""
LOOPBACK_GBPS = 2.0
"""Assumed gloo-over-loopback bandwidth between local processes, GB/s; order of magnitude."""
CPU_TFLOPS_ENV = "MESHPLAN_CPU_TFLOPS"
"""The CPU rate the launcher measured, passed to its ranks so that the estimate before the launch, the
--replan-after check and the summary price the same machine."""


def cpu_cluster(nproc: int, tflops: float = 1.0, memory_gib: float | None = None, *, nodes: int = 1,
                nodes_per_dc: int | None = None) -> Any:
    """A ClusterSpec of this machine's CPU as ``nproc`` 'GPUs' (one process each) for the cost
    model: fp32 matmul rate ``tflops`` (memory estimates do not depend on it), host memory; spread
    over ``nodes`` nodes (when they divide ``nproc``) of ``nodes_per_dc`` per datacenter (several
    datacenters: an inter_dc tier at the loopback rate), as `meshplan train --nnodes --nodes-per-dc`
    runs it (what decides a periodic plan's inner groups, spec.sync)."""
    if memory_gib is None:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    gpu = GPUSpec(name="local-cpu", vendor_name="this machine's CPU, one core per process",
                  peak_tflops={"fp32": tflops, "bf16": tflops, "fp16": tflops}, memory_gib=memory_gib,
                  hbm_bandwidth_gbps=CPU_MEMORY_BANDWIDTH_GBPS, intra_node_bandwidth_gbps=LOOPBACK_GBPS,
                  intra_node_link="pcie", default_nic_gbps=LOOPBACK_GBPS, gemm_efficiency=1.0,
                  source="measured fp32 matmul rate of one thread")
    intra, inter = default_links(gpu)
    if nodes < 1 or nproc % nodes:
        nodes = 1
    dc = None
    if nodes_per_dc and nodes_per_dc < nodes and nodes % nodes_per_dc == 0:
        dc = LinkTier(name="inter_dc", bandwidth_gbps=LOOPBACK_GBPS, kind="loopback")
    name = f"local-cpu:{nproc}" if nodes == 1 else f"local-cpu:{nodes}x{nproc // nodes}"
    return ClusterSpec(name=name, gpu=gpu, num_nodes=nodes, gpus_per_node=nproc // nodes,
                       intra_node=intra, inter_node=inter, inter_dc=dc, nodes_per_dc=nodes_per_dc if dc else None)
