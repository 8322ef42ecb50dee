"""Default efficiency of a link, per kind: what a link that names its kind but states no efficiency gets.

A link's ``efficiency`` is the fraction of its line rate that bulk NCCL collectives achieve
(nccl-tests bus bandwidth / line rate, per GPU, one direction). The kinds the built-in calibration
has fitted (meshplan/data/calibration.json: nvlink, nvswitch, infiniband, omnipath) use the fitted
value; every other kind uses the table below. Before this table, a link of an unfitted kind (roce,
efa, ethernet, wan, ...) silently inherited InfiniBand's fitted efficiency.

Where the table's value is *estimated*, it comes from the collective-level rows of
meshplan/data/collectives_dev.csv (docs/collectives.md): for each all-reduce of >= 1 GiB (bandwidth-bound)
the efficiency at which the cost model itself (cost.comm: NCCL's ring, or its tree on 2 nodes)
reproduces the measured bus bandwidth; the mean over sources (each source weighs once). The estimate
is thus consistent with whatever algorithm cost.comm prices. tests/unit/test_collectives_data.py
recomputes these estimates from the data, and their leave-one-source-out spread. Where it is an
*assumption*, the entry says so.

An unknown kind with no stated efficiency is an error that lists the known kinds (a typo such as
``infiniband`` -> ``infinband`` must not silently price a link).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.builtin_calibration import builtin_link_value
from meshplan.errors import MeshplanError


@dataclass(frozen=True)
class LinkDefault:
    """One kind's default efficiency and where it comes from."""

    efficiency: float
    basis: str
    """'estimated' (from collectives_dev.csv), 'prior' (a physical argument) or 'assumed'."""
    source: str


KIND_DEFAULTS: dict[str, LinkDefault] = {
    # Fitted kinds: these are the priors, used only where the calibration file lacks the kind.
    "nvlink": LinkDefault(0.8, "prior", "NCCL ring busbw ~80% of the NVLink line rate (ml-engineering "
                          "network/README.md: A100 node 234.89 of 300 GB/s = 78%); calibration fits it"),
    "nvswitch": LinkDefault(0.8, "prior", "as nvlink (H200 node, ring: 367.2 of 450 GB/s = 82%, "
                            "ml-engineering); calibration fits it"),
    "infiniband": LinkDefault(0.8, "prior", "NIC_EFFICIENCY prior; calibration fits it"),
    "omnipath": LinkDefault(0.5, "prior", "calibration fits it (0.44, BLOOM runs on Jean Zay)"),
    # Unfitted kinds.
    "xgmi": LinkDefault(0.70, "estimated", "MI300X 8-GPU all-reduce, 4 GiB: busbw 312.912 GB/s of 448 GB/s "
                        "(ml-engineering network/README.md); collectives_dev.csv row mle-mi300x-8"),
    "pcie": LinkDefault(0.8, "prior", "PCIe protocol overhead (TLP headers, flow control) caps DMA at "
                        "~80% of the raw rate; the default_links fallback (NVLINK_EFFICIENCY)"),
    "efa": LinkDefault(0.98, "estimated", "AWS EFA v2 and later (p5 EFA v2, p5en EFA v3, p6 EFA v4; also 'efa-v2', "
                       "'efa-v3', 'efa-v4'): the efficiency at which cost.comm reproduces multi-node all-reduce "
                       ">= 1 GiB (ring on 4 nodes), ml-engineering p6-b200 and p5en, 4 nodes: 0.96-1.0 (one source: "
                       "its rows' leave-one-source-out falls back to the 0.8 prior). EFA v1 (p4d) is 'efa-v1'"),
    "efa-v1": LinkDefault(0.58, "estimated", "AWS EFA v1 (p4d / p4de, 4 x 100 Gb/s per node, aws-ofi-nccl): the "
                          "efficiency at which cost.comm reproduces all-reduce >= 1 GiB (NCCL's tree on 2 nodes, ring "
                          "on 3-4), mean of 2 sources: NVIDIA/nccl#527 (NCCL 2.9.9, 2-4 nodes: 0.60-0.69) and AWS's "
                          "aws-samples/aws-efa-eks log (NCCL 2.9.9, 2 nodes: 0.51-0.52); leave-one-source-out 0.51 / 0.64"),
    "roce": LinkDefault(0.75, "assumed", "RoCEv2 with GPUDirect RDMA, tuned, performs close to InfiniBand "
                        "(Gangidi et al., 'RDMA over Ethernet for Distributed AI Training at Meta Scale', "
                        "SIGCOMM 2024); taken a little below InfiniBand's 0.8 prior: no RoCE rows yet"),
    "tcpx": LinkDefault(0.98, "estimated", "GCP GPUDirect-TCPX(O) (A3 / A3 Mega): 2 nodes x 8 H100, 1 and 8 GiB "
                        "all-reduce busbw 297.86 and 338.82 GB/s, which NCCL's tree on 2 nodes (S per node each "
                        "way, NCCL's 0.9 tree factor) reaches at 0.95 and 1.0 of 25 GB/s per GPU "
                        "(collectives_dev.csv, one source)"),
    "ethernet": LinkDefault(0.40, "prior", "NCCL's socket transport over plain TCP/IP Ethernet (no RDMA): "
                            "~4.7 GB/s busbw on 100 Gb/s = 0.38 (NVIDIA/nccl#398, p3dn); conservative"),
    "tcp": LinkDefault(0.40, "prior", "as ethernet (NCCL socket transport)"),
    "wan": LinkDefault(0.50, "assumed", "long-haul links between sites: TCP windows and shared paths; "
                       "a conservative default, state the measured efficiency in the cluster file"),
}
"""kind -> its default efficiency. Kinds are lower-case; a kind the calibration has fitted uses the
fitted value first (``link_efficiency``)."""

KIND_ALIASES: dict[str, str] = {"efa-v2": "efa", "efa-v3": "efa", "efa-v4": "efa"}
"""Other names of a kind: the EFA generations after v1 share 'efa' (their rows reach the same fraction
of the line rate; EFA v1 on p4d, at 0.5-0.7 of it, is its own kind 'efa-v1')."""

TIERS = ("intra_node", "inter_node", "inter_dc", "inter_pool")


def known_kinds() -> list[str]:
    return sorted(KIND_DEFAULTS)


def fitted_efficiency(tier: str, kind: str) -> float | None:
    """The built-in calibration's efficiency of ``kind`` on ``tier``, else on any tier (a kind's
    fitted value holds wherever the link sits: an InfiniBand link between pools is InfiniBand)."""
    v = builtin_link_value(tier, kind)
    if v is None:
        for t in TIERS:
            v = builtin_link_value(t, kind)
            if v is not None:
                break
    return v


def link_efficiency(tier: str, kind: str, *, where: str = "link") -> float:
    """Efficiency of a ``tier`` link of ``kind`` that states none: the calibration's fitted value
    for the kind, else KIND_DEFAULTS; an unknown kind is an error listing the known ones."""
    key = kind.strip().lower()
    key = KIND_ALIASES.get(key, key)
    fitted = fitted_efficiency(tier, key)
    if fitted is not None:
        return fitted
    hit = KIND_DEFAULTS.get(key)
    if hit is None:
        raise MeshplanError(f"{where}: link kind {kind!r} has no default efficiency; known kinds: "
                            f"{', '.join(known_kinds())} (and {', '.join(KIND_ALIASES)})",
                            hint="use one of the known kinds, or state efficiency = 0.8 (the achieved fraction "
                                 "of the line rate) in the same table")
    return hit.efficiency
