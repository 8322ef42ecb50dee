"""ClusterSpec: what it runs on. GPUs (data files, one per type) and link tiers.

Bandwidths are per GPU, one direction, in GB/s (1e9 bytes/s); latencies in microseconds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshplan.builtin_calibration import builtin_link_value
from meshplan.errors import MeshplanError
from meshplan.spec.base import positive

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

DEFAULT_HOST_MEMORY_GIB_PER_GPU = 128.0
"""Host memory per GPU of a GPU file that states none: a DGX A100 320GB's 1 TiB over its 8 GPUs
(the smallest of the 8-GPU SXM systems' figures in the presets, docs/cost-model.md)."""


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One accelerator type. Peaks are vendor dense (no sparsity) numbers."""

    name: str
    """Preset name, e.g. 'a100-sxm-80gb'."""
    vendor_name: str = ""
    """Marketing name, e.g. 'NVIDIA A100-SXM4-80GB'."""
    peak_tflops: dict[str, float]
    """Dense peak TFLOP/s per dtype: fp32, tf32, bf16, fp16, fp8 (absent = unsupported)."""
    memory_gib: float
    """HBM capacity in GiB as the driver reports it."""
    hbm_bandwidth_gbps: float
    """HBM bandwidth, GB/s."""
    intra_node_bandwidth_gbps: float
    """NVLink/NVSwitch/Infinity Fabric/PCIe bandwidth per GPU, one direction, GB/s."""
    intra_node_link: str = "nvlink"
    """nvlink, nvswitch, xgmi or pcie."""
    price_per_hour_usd: float = 2.0
    """Default on-demand price per GPU-hour (US$), order-of-magnitude cloud list price."""
    tdp_w: float = 0.0
    """Board power, W (informational)."""
    family: str = ""
    """Architecture family used to pick calibrated efficiencies: ampere, hopper, blackwell, cdna3, ada, volta."""
    gemm_efficiency: float = 0.75
    """Achieved fraction of the dense peak on large, well-shaped GEMMs (cuBLAS at its best
    shapes, sustained clocks). Calibrated per GPU type: a micro-benchmark or published runs."""
    attention_efficiency: float | None = None
    """Achieved fraction of the dense peak of FlashAttention's forward pass at long sequences;
    None = gemm_efficiency x the cost model's flash_fwd_efficiency (FA2 paper: ~0.7 on A100,
    ~0.35-0.45 on H100 before FA3)."""
    clock_ratio: float = 1.0
    """Sustained tensor-core clock relative to the family's reference part whose datasheet peak
    this part also quotes (1 for most parts). A power-capped part runs slower at the same quoted
    peak: dynamic power ~ f V^2 with V ~ f gives f ~ P^(1/3), so a 500 W H100 SXM runs at
    (500/700)^(1/3) = 0.894 and a 300 W A100 PCIe at (300/400)^(1/3) = 0.909. A calibration's
    family efficiencies are multiplied by it."""
    default_nic_gbps: float = 25.0
    """Per-GPU inter-node bandwidth of the typical system, GB/s (25 = 200 Gb/s HDR, 50 = 400 Gb/s NDR)."""
    gpus_per_node: int = 8
    """GPUs in the typical node of this part (8 for HGX/DGX; 4 for GH200 blades): the node
    size of the ``--cluster GPU:COUNT`` shorthand."""
    host_memory_gib_per_gpu: float = DEFAULT_HOST_MEMORY_GIB_PER_GPU
    """Host (CPU) memory of the typical system of this part, GiB, over its GPUs: what a cluster of
    this GPU has for offloaded optimizer states and parameters unless its file gives
    ``host_memory_gib`` (per node). E.g. 256 for a DGX H100 (2 TiB over 8 GPUs)."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        w = f"gpu {self.name!r}"
        if "bf16" not in self.peak_tflops and "fp16" not in self.peak_tflops:
            raise MeshplanError(f"{w}: peak_tflops needs at least bf16 or fp16")
        for k, v in self.peak_tflops.items():
            if k not in DTYPES:
                raise MeshplanError(f"{w}: unknown dtype {k!r} in peak_tflops (use {', '.join(DTYPES)})")
            positive(f"{w}: peak_tflops.{k}", v)
        positive(f"{w}: memory_gib", self.memory_gib)
        positive(f"{w}: hbm_bandwidth_gbps", self.hbm_bandwidth_gbps)
        positive(f"{w}: intra_node_bandwidth_gbps", self.intra_node_bandwidth_gbps)
        positive(f"{w}: price_per_hour_usd", self.price_per_hour_usd, allow_zero=True)
        positive(f"{w}: default_nic_gbps", self.default_nic_gbps)
        positive(f"{w}: tdp_w", self.tdp_w, allow_zero=True)
        positive(f"{w}: host_memory_gib_per_gpu", self.host_memory_gib_per_gpu)
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node <= 0:
            raise MeshplanError(f"{w}: gpus_per_node must be a positive whole number; got {self.gpus_per_node!r}")
        if not 0 < self.clock_ratio <= 1:
            raise MeshplanError(f"{w}: clock_ratio must be in (0, 1]; got {self.clock_ratio}")
        for f in ("gemm_efficiency", "attention_efficiency"):
            v = getattr(self, f)
            if v is not None and not 0 < v <= 1:
                raise MeshplanError(f"{w}: {f} must be in (0, 1]; got {v}")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``. fp8 falls back to the 16-bit peak (fp8 runs as 16-bit on
        GPUs without fp8 tensor cores); bf16 and fp16 fall back to each other; tf32 to fp32."""
        chain = {"fp8": ("fp8", "bf16", "fp16"), "bf16": ("bf16", "fp16"), "fp16": ("fp16", "bf16"),
                 "tf32": ("tf32", "fp32"), "fp32": ("fp32",)}.get(dtype, (dtype,))
        for d in chain:
            if d in self.peak_tflops:
                return self.peak_tflops[d] * 1e12
        raise MeshplanError(f"gpu {self.name!r} has no peak for {dtype}",
                            hint=f"add peak_tflops.{dtype} to its GPU file, or use another precision")


@dataclass(frozen=True, kw_only=True)
class LinkTier:
    """One level of the network: intra-node, inter-node or inter-datacenter."""

    name: str
    """intra_node, inter_node or inter_dc."""
    bandwidth_gbps: float
    """Per-GPU bandwidth, one direction, GB/s (for inter-node: the NIC bandwidth per GPU)."""
    latency_us: float = 5.0
    """Per-message latency of one hop, microseconds."""
    efficiency: float = 0.8
    """Fraction of bandwidth that bulk collectives achieve (bus bandwidth / line rate)."""
    kind: str = ""
    """nvlink, nvswitch, pcie, infiniband, roce, ethernet, wan (informational)."""
    shared: bool = False
    """bandwidth_gbps is the whole link's, shared by every GPU whose traffic crosses it (the
    link between two datacenters), not each GPU's. Only for inter_dc."""
    sites: tuple[int, int] | None = None
    """For one entry of a cluster's site_links: the two sites (datacenters, 0-based, in node
    order) this link joins. None for the tiers themselves."""

    def __post_init__(self) -> None:
        positive(f"link {self.name}: bandwidth_gbps", self.bandwidth_gbps)
        if self.sites is not None:
            a, b = self.sites
            if a == b or min(a, b) < 0:
                raise MeshplanError(f"link {self.name}: sites must name two different sites (0-based); "
                                    f"got {list(self.sites)}", hint="e.g. sites = [0, 1]")
            object.__setattr__(self, "sites", (min(a, b), max(a, b)))
        if self.shared and self.name != "inter_dc":
            raise MeshplanError(f"link {self.name}: shared=true is only for inter_dc (the link between sites); "
                                f"{self.name} bandwidth is per GPU",
                                hint=f"drop shared from [{self.name}]")
        positive(f"link {self.name}: latency_us", self.latency_us, allow_zero=True)
        if not 0 < self.efficiency <= 1:
            raise MeshplanError(f"link {self.name}: efficiency must be in (0, 1]; got {self.efficiency}")

    @property
    def bytes_per_s(self) -> float:
        """Achievable bytes per second."""
        return self.bandwidth_gbps * 1e9 * self.efficiency


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """nodes x GPUs per node, with link tiers. Datacenters optional."""

    name: str = "cluster"
    gpu: GPUSpec
    """The GPU type (all GPUs are the same type)."""
    num_nodes: int
    """Number of nodes."""
    gpus_per_node: int = 8
    """GPUs in one node (sharing the intra-node link)."""
    intra_node: LinkTier
    """Link between GPUs of one node."""
    inter_node: LinkTier
    """Link between nodes of one datacenter (per-GPU NIC bandwidth)."""
    inter_dc: LinkTier | None = None
    """Link between datacenters, if the cluster spans several."""
    nodes_per_dc: int | None = None
    """Nodes per datacenter (None: one datacenter)."""
    site_links: tuple[LinkTier, ...] = ()
    """Optional per-pair links between sites (each with ``sites = [a, b]``): the bandwidth and
    latency matrix between datacenters or regions. A pair not listed uses inter_dc."""
    node_nic_gbps: float | None = None
    """Network bandwidth of a whole node, GB/s one direction, shared by its GPUs (one 100 GbE
    NIC per cloud node: 12.5). None: every GPU has inter_node.bandwidth_gbps of its own."""
    price_per_gpu_hour_usd: float | None = None
    """Override of the GPU's default price."""
    step_jitter: float = 0.0
    """Coefficient of variation of one GPU's step time from run to run (noisy neighbours,
    throttling, network contention; 0.02 = 2%). A synchronous step waits for the slowest of
    the ranks it syncs: meshplan prices the expected maximum (cost.sync.straggler_seconds)."""
    host_memory_gib: float | None = None
    """Host (CPU) memory of one node, GiB: what offloaded optimizer states and parameters
    (offload_optimizer, offload_params) of the node's GPUs share. None: the GPU preset's
    typical system (GPUSpec.host_memory_gib_per_gpu x gpus_per_node)."""

    def __post_init__(self) -> None:
        if self.host_memory_gib is not None:
            positive(f"cluster {self.name}: host_memory_gib", self.host_memory_gib)
        if not 0 <= self.step_jitter < 1:
            raise MeshplanError(f"cluster {self.name}: step_jitter must be in [0, 1) (a fraction of the step "
                                f"time, e.g. 0.02); got {self.step_jitter}")
        positive(f"cluster {self.name}: num_nodes", self.num_nodes)
        positive(f"cluster {self.name}: gpus_per_node", self.gpus_per_node)
        if self.nodes_per_dc is not None:
            positive(f"cluster {self.name}: nodes_per_dc", self.nodes_per_dc)
        if self.price_per_gpu_hour_usd is not None:
            positive(f"cluster {self.name}: price_per_gpu_hour_usd", self.price_per_gpu_hour_usd,
                     allow_zero=True)
        if self.inter_dc is not None and not self.nodes_per_dc:
            raise MeshplanError(f"cluster {self.name}: inter_dc given but nodes_per_dc is missing")
        if self.node_nic_gbps is not None:
            positive(f"cluster {self.name}: node_nic_gbps", self.node_nic_gbps)
        if self.site_links:
            if self.inter_dc is None:
                raise MeshplanError(f"cluster {self.name}: site_links need inter_dc and nodes_per_dc (the sites, "
                                    "and the link of any pair not listed)")
            seen = set()
            for link in self.site_links:
                if link.sites is None or max(link.sites) >= self.num_nodes // (self.nodes_per_dc or 1):
                    raise MeshplanError(f"cluster {self.name}: a site link joins sites "
                                        f"{None if link.sites is None else list(link.sites)}, but the cluster has "
                                        f"{self.num_nodes // (self.nodes_per_dc or 1)} sites (0-based)",
                                        hint="give each [[site_links]] entry sites = [a, b] of two existing sites")
                if link.sites in seen:
                    raise MeshplanError(f"cluster {self.name}: sites {list(link.sites)} are linked twice")
                seen.add(link.sites)
        if self.nodes_per_dc is not None and self.num_nodes % self.nodes_per_dc:
            raise MeshplanError(f"cluster {self.name}: num_nodes={self.num_nodes} is not a multiple "
                                f"of nodes_per_dc={self.nodes_per_dc}")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def host_memory_per_node_gib(self) -> float:
        """Host memory of one node, GiB (host_memory_gib, else the GPU preset's typical system)."""
        if self.host_memory_gib is not None:
            return float(self.host_memory_gib)
        return self.gpu.host_memory_gib_per_gpu * self.gpus_per_node

    @property
    def host_memory_per_gpu_gib(self) -> float:
        """A GPU's share of its node's host memory, GiB: what one GPU's offload may take."""
        return self.host_memory_per_node_gib / self.gpus_per_node

    def host_memory_basis(self) -> str:
        """Where host_memory_per_node_gib comes from, in words."""
        if self.host_memory_gib is not None:
            return f"{self.name}'s host_memory_gib"
        return f"the typical {self.gpu.name} system's"

    @property
    def price_per_hour(self) -> float:
        """US$ per GPU-hour."""
        p = self.price_per_gpu_hour_usd
        return self.gpu.price_per_hour_usd if p is None else p

    @property
    def num_dcs(self) -> int:
        """Datacenters (1 without inter_dc)."""
        return self.num_nodes // self.nodes_per_dc if self.inter_dc is not None and self.nodes_per_dc else 1

    @property
    def gpus_per_dc(self) -> int:
        return self.num_gpus // self.num_dcs

    def tier_for_span(self, span: int) -> LinkTier:
        """Slowest link crossed by a group of ``span`` consecutive ranks (innermost axes first). (The
        cost model prices each group on every tier it crosses: cost.comm.Group.)"""
        if span <= self.gpus_per_node:
            return self.intra_node
        if self.inter_dc is not None and self.nodes_per_dc and span > self.nodes_per_dc * self.gpus_per_node:
            return self.inter_dc
        return self.inter_node

    def site_link(self, a: int, b: int) -> LinkTier:
        """The link between sites ``a`` and ``b`` (its site_links entry, else inter_dc)."""
        key = (min(a, b), max(a, b))
        for link in self.site_links:
            if link.sites == key:
                return link
        if self.inter_dc is None:
            raise MeshplanError(f"cluster {self.name} has one site")
        return self.inter_dc

    def replace(self, **changes: object) -> ClusterSpec:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    # A cluster is a list of one or more GPU pools: a cluster of one GPU type is one pool (itself);
    # PooledCluster has several. Code that takes a cluster reads these, whichever it is given.

    @property
    def pools(self) -> tuple[ClusterSpec, ...]:
        """The cluster's GPU pools: itself."""
        return (self,)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def inter_pool(self) -> LinkTier | None:
        """The link between pools: none in a cluster of one pool."""
        return None

    def pool(self, name: str) -> ClusterSpec:
        """The pool a plan's ``pools=NAME`` places it on: the one pool (the name is placement only)."""
        return self

    def describe(self) -> str:
        return f"{self.name}: {self.num_nodes}x{self.gpus_per_node} {self.gpu.name}"


NVLINK_EFFICIENCY = 0.8
"""Prior (and fallback) achieved fraction of a link's line rate by NCCL collectives; the fitted
values per link kind come from the built-in calibration (meshplan/data/calibration.json)."""
NIC_EFFICIENCY = 0.8


def default_links(gpu: GPUSpec, *, nic_gbps: float | None = None) -> tuple[LinkTier, LinkTier]:
    """Typical DGX/HGX links for ``gpu``: its intra-node fabric and one NIC per GPU.

    nic_gbps: per-GPU inter-node bandwidth, GB/s; 25 GB/s = 200 Gb/s HDR InfiniBand (DGX A100),
    50 GB/s = 400 Gb/s NDR (DGX H100). Latencies: NVLink ~3 us, InfiniBand ~8 us per hop
    (NCCL tests, typical ring latency per step).
    """
    nic_gbps = gpu.default_nic_gbps if nic_gbps is None else nic_gbps
    e_intra = builtin_link_value("intra_node", gpu.intra_node_link) or NVLINK_EFFICIENCY
    e_inter = builtin_link_value("inter_node", "infiniband") or NIC_EFFICIENCY
    intra = LinkTier(name="intra_node", bandwidth_gbps=gpu.intra_node_bandwidth_gbps,
                     latency_us=3.0, efficiency=e_intra, kind=gpu.intra_node_link)
    inter = LinkTier(name="inter_node", bandwidth_gbps=nic_gbps, latency_us=8.0,
                     efficiency=e_inter, kind="infiniband")
    return intra, inter



@dataclass(frozen=True, kw_only=True)
class PooledCluster:
    """A cluster of several GPU pools: each pool is a ClusterSpec of one GPU type with its own
    nodes and links (its ``name`` names the pool), joined by ``inter_pool`` (per GPU, one
    direction, like inter_node). A plan uses some or all pools (Plan.pools): data-parallel
    replicas per pool (Plan.pool_dp) or pipeline stages per pool (Plan.pool_pp)."""

    name: str = "pools"
    pools: tuple[ClusterSpec, ...]
    inter_pool: LinkTier
    """The link between pools, per GPU (the slower pool's NIC when they share one fabric)."""
    max_gpus: int | None = None
    """A budget of GPUs in all (`meshplan plan --gpus` on pools): plans use at most this many,
    taken fastest pool first (search.pools.budget_pools). None: every GPU of every pool."""

    def __post_init__(self) -> None:
        if self.max_gpus is not None:
            positive(f"cluster {self.name}: max_gpus", self.max_gpus)
        if len(self.pools) < 2:
            raise MeshplanError(f"cluster {self.name}: a pooled cluster needs at least two [[pools]]",
                                hint="for one GPU type, use its ClusterSpec (a cluster file with one [[pools]] "
                                     "table, or gpu/num_nodes at the top level, loads as one)")
        names = [p.name for p in self.pools]
        for n in names:
            if not n.strip() or any(ch in n for ch in ":,=; \t"):
                raise MeshplanError(f"cluster {self.name}: pool name {n!r} cannot be used in plans (pools=NAME:NAME)",
                                    hint="name each pool with letters, digits, '-' or '_', e.g. name = \"h100\"")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise MeshplanError(f"cluster {self.name}: pool name {dup[0]!r} is used twice",
                                hint="give every [[pools]] entry its own name")
        for p in self.pools:
            if p.inter_dc is not None:
                raise MeshplanError(f"cluster {self.name}: pool {p.name!r} has inter_dc; pools of several "
                                    "datacenters are not modelled",
                                    hint="drop inter_dc/nodes_per_dc from the pool (inter_pool is the link "
                                         "between pools)")

    @property
    def num_gpus(self) -> int:
        """GPUs in all (at most ``max_gpus``)."""
        n = sum(p.num_gpus for p in self.pools)
        return n if self.max_gpus is None else min(n, self.max_gpus)

    def replace(self, **changes: object) -> PooledCluster:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pools)

    def pool(self, name: str) -> ClusterSpec:
        for p in self.pools:
            if p.name == name:
                return p
        raise MeshplanError(f"cluster {self.name}: no pool named {name!r}",
                            hint=f"its pools: {', '.join(self.names)}")

    def describe(self) -> str:
        return " + ".join(f"{p.name}: {p.num_nodes}x{p.gpus_per_node} {p.gpu.name}" for p in self.pools)
