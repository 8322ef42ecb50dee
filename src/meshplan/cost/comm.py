"""Collective communication times (alpha-beta model of NCCL's ring and tree algorithms).

Sizes are the full tensor size in bytes as each rank sees it after the collective
(all-gather output, reduce-scatter input, all-reduce buffer). Ring costs (Thakur et al. 2005;
NCCL docs, "bus bandwidth"), plus NCCL's base latency per collective (NCCL_BASE_US):
  all-reduce      2 (n-1)/n * S / B + 2 (n-1) * alpha  (across nodes: or NCCL's double binary
                  tree, where shorter, as NCCL picks: S / B per node on 2 nodes, 2 S / B on 3 or
                  more, the chain inside a node S / B_intra, 2 ((c-1) + ceil(log2 k)) tree hops;
                  Group._tree)
  all-gather      (n-1)/n * S / B + (n-1) * alpha
  reduce-scatter  (n-1)/n * S / B + (n-1) * alpha
  all-to-all      (n-1)/n * S / B + (n-1) * alpha
  send/recv       S / B + alpha
Each (algorithm, protocol) has NCCL v2.7.5's latencies and bandwidth factor (below: NCCL_BASE_US,
NCCL_HW_US, NCCL_BW_FACTOR, TREE_CORRECTION); PROTOCOLS says which protocols are priced. The
published nccl-tests rows that score these forms: data/collectives_dev.csv, docs/collectives.md.
A group spanning nodes with k members per node runs k rings in parallel, one per NIC, so its
per-rank bandwidth is min(intra-node, k x NIC) (NCCL multi-ring; busbw of DGX all-reduce). A
node whose GPUs share one NIC (``ClusterSpec.node_nic_gbps``) gives each GPU its share.

Every byte on the link it crosses (issue 26):
- **Groups under a placement.** A group is given by its members' rank stride (``Group.of``) or by
  the (degree, stride) of each mesh axis it spans (``Group.over``; ``dpcp_group`` for dp x cp),
  from the plan's placement (spec.axes.axis_strides); members per node and per site follow.
- **Across sites, hierarchical.** A group of k members in each of m sites reduce-scatters inside
  each site, all-reduces each member's 1 / k shard between the sites (k rings or trees in
  parallel, 2 (m - 1) or 2 log2 m latencies of the slowest hop between the sites, ``site_links``
  or ``inter_dc``), and all-gathers inside each site: NCCL's and Megatron's hierarchical
  all-reduce (NVIDIA NCCL User Guide, "Collective Operations"; Sergeev & Del Balso 2018,
  Horovod's hierarchical allreduce). A link shared by every GPU crossing it gives each of the
  N / m rings crossing it at once m / N of it. Where the phases one after another are slower
  than one flat ring or tree over all members at the slowest link, that is priced (``alt``):
  the library picks the faster algorithm, as NCCL picks between ring and tree.
- **Pipeline sends** per boundary on the link its peers cross (``pipeline_links``).
- Bus bandwidth follows nccl-tests' definitions (NVIDIA nccl-tests, doc/PERFORMANCE.md:
  busbw = algbw x 2 (n - 1) / n for all-reduce, (n - 1) / n for all-gather, reduce-scatter,
  all-to-all); the published rows it is scored against are data/collectives_dev.csv
  (meshplan validate, "Collectives").

Every function here accepts numpy arrays as well as scalars (one row per candidate plan):
the scalar estimate and the vectorised search share this code.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.spec.axes import AX, AXES, ParallelDims, column_strides, parse_order, parse_sites, site_order_fault
from meshplan.spec.cluster import ClusterSpec
from meshplan.units import US

Num = Any  # float or numpy array

# NCCL's cost model (NVIDIA/nccl src/graph/tuning.cc, v2.7.5, commit 01afd20: baseLat, hwLat,
# ncclTopoTuneModel, ncclTopoGetAlgoTime): per (algorithm, protocol) a base latency (us), a per-hop latency
# (hwLat[NVLINK or NET], us) and a factor on the link's bus bandwidth; NCCL prices every (algorithm,
# protocol) as latency + bytes / bandwidth and runs the fastest. Here a link's latency_us is the per-hop
# latency of the ring's Simple protocol (the bulk one, as before this table); another protocol's (or the
# tree's) hop is that shifted by NCCL's hwLat difference to ring/Simple on the same hardware (NVLink inside
# a node, NET across nodes), never below NCCL's hwLat for it: hop_latency. LL128 needs NVLink: inside a
# node only. v2.7.5's constants, not the current ones (v2.30.7, commit 5067397c: tree/Simple hops of 4 and
# 14 us instead of 28 and 50): with those, 1-16 MiB all-reduce on 2-4 nodes of EFA or TCPX comes out
# 2-4.5x faster than measured (collectives busbw mean error 43% against 20%; docs/collectives.md): v2.7.5's
# tree/Simple hop ('the latency of a 256kB chunk') is closer to what these networks show.
NCCL_BASE_US = {("ring", "ll"): 3.6, ("ring", "ll128"): 10.0, ("ring", "simple"): 8.4,
                ("tree", "ll"): 4.4, ("tree", "ll128"): 4.4, ("tree", "simple"): 0.0}
"""baseLat of NCCL v2.7.5 tuning.cc, microseconds, added once per collective."""
NCCL_HW_US = {"nvlink": {("ring", "ll"): 0.47, ("ring", "ll128"): 1.9, ("ring", "simple"): 3.4,
                         ("tree", "ll"): 0.52, ("tree", "ll128"): 1.2, ("tree", "simple"): 28.0},
              "net": {("ring", "ll"): 2.7, ("ring", "ll128"): 4.0, ("ring", "simple"): 9.6,
                      ("tree", "ll"): 5.0, ("tree", "ll128"): 8.5, ("tree", "simple"): 50.0}}
"""hwLat of NCCL v2.7.5 tuning.cc, microseconds per hop ('Tree/Simple is the latency a 256kB chunk')."""
NCCL_BW_FACTOR = {("ring", "ll"): 1 / 4, ("ring", "ll128"): 0.92, ("ring", "simple"): 1.0,
                  ("tree", "ll"): 0.9 / 3.8, ("tree", "ll128"): 0.9 * 0.915, ("tree", "simple"): 0.9}
"""Factor on the bus bandwidth per (algorithm, protocol) (NCCL v2.7.5 tuning.cc 'Various model
refinements': ring LL 1/4, LL128 0.92; tree 0.9, with LL a further 1 / 3.8, LL128 0.915 across nodes)."""
TREE_CORRECTION = {"ll": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0,
                          1.0),
                   "simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8,
                              .9)}
"""NCCL v2.7.5 treeCorrectionFactor ('Trees are not perfectly sticking to the model for medium sizes'):
the tree's bandwidth factor by log2(bytes / 64), 64 B to 128 MiB; 1 beyond."""


def tree_correction(proto: str, size: Num) -> Num:
    """TREE_CORRECTION for ``size`` bytes, interpolated in log2(size) between NCCL's powers of two (1 from
    256 MiB): NCCL steps it, which would make a larger message faster; a factor that changes by at most
    0.1 per doubling, interpolated, keeps the time growing with the size."""
    table = np.asarray(TREE_CORRECTION[proto] + (1.0,))
    x = np.log2(np.maximum(np.asarray(size, dtype=float), 64.0) / 64.0)
    return np.interp(x, np.arange(len(table), dtype=float), table)


def hop_latency(link_s: Num, hw: str, key: tuple[str, str]) -> Num:
    """Seconds per hop of (algorithm, protocol) ``key`` on a link of per-hop latency ``link_s`` (the
    ring/Simple hop, exactly): the link's latency shifted by NCCL's hwLat difference between the protocol
    and ring/Simple, and never below NCCL's hwLat for the protocol (nor the link's own latency where that
    is lower): a link's latency beyond NCCL's (a long link's) is a delay no protocol avoids."""
    t = NCCL_HW_US[hw]
    a = np.asarray(link_s, dtype=float)
    return np.maximum(a + (t[key] - t[("ring", "simple")]) * US, np.minimum(a, t[key] * US))


PROTOCOLS: tuple[str, ...] = ("simple",)
"""The ring protocols priced (the fastest is taken). Only Simple: with NCCL's LL/LL128 constants the
1 MiB rows of data/collectives_dev.csv come out 1.5-6x faster than measured on every source (mean
busbw error 54% with them, 20% without; docs/collectives.md), so the low-latency protocols are left
out until rows show them. ("ll", "ll128", "simple") prices all three."""
TREE_PROTOCOLS: tuple[str, ...] = ("simple",)
"""The tree's protocols (LL128 needs NVLink and the tree runs across nodes: "ll", "simple")."""


def exposed_under(comm: Num, compute: Num, slowdown: float) -> Num:
    """Seconds a collective adds to the compute it runs under: the part the compute cannot
    hide, or, when the compute hides all of it, the compute's slowdown while both share the
    GPU (NCCL kernels hold SMs and HBM bandwidth: ``slowdown`` x the shared time)."""
    comm, compute = np.asarray(comm, dtype=float), np.asarray(compute, dtype=float)
    return np.maximum(np.maximum(0.0, comm - compute), slowdown * np.minimum(comm, compute))


def staged_fsdp_exposed(gather: Num, fwd: Num, reduce: Num, hide: Num, pp: Num, split: Num,
                        slowdown: float) -> Num:
    """Seconds FSDP under a pipeline adds (gathered and reduced once per step): the gather
    under the first forward, the reduce-scatter under the last backward (the last W pass with
    a split backward). Every rank's last backward is slowed while its reduce-scatter runs, and
    the drain hands them on one after another (the gradient sends), so that slowdown counts
    pp times; a W pass is off that chain (sim.engine runs the same)."""
    chained = np.where(split, 0.0, (np.asarray(pp) - 1) * slowdown * np.minimum(reduce, hide))
    return exposed_under(gather, fwd, slowdown) + exposed_under(reduce, hide, slowdown) + chained


def staged_fsdp_overlapped(gather: Num, fwd: Num, reduce: Num, hide: Num) -> Num:
    """Seconds of that gather and reduce-scatter hidden under the compute (>= 0): the
    communication less the parts the compute cannot hide. The slowdown they cause is extra
    compute time, counted in staged_fsdp_exposed, not communication taken off this."""
    gather, reduce = np.asarray(gather, dtype=float), np.asarray(reduce, dtype=float)
    return np.minimum(gather, fwd) + np.minimum(reduce, hide)


_GROUPS: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _link_key(c: ClusterSpec) -> tuple[Any, ...]:
    """Everything of a cluster that Group.of reads."""
    dc = c.inter_dc
    return (c.gpus_per_node, c.intra_node.bytes_per_s, c.intra_node.latency_us,
            c.inter_node.bytes_per_s, c.inter_node.latency_us, c.nodes_per_dc, c.node_nic_gbps,
            None if dc is None else (dc.bytes_per_s, dc.latency_us, dc.shared, c.num_gpus,
                                     tuple((t.sites, t.bytes_per_s, t.latency_us, t.shared) for t in c.site_links)))


def nic_bytes_per_s(cluster: ClusterSpec, crossing: Num) -> Num:
    """Achievable inter-node bytes/s of one GPU when ``crossing`` GPUs of its node send across
    nodes at once: its own NIC's (inter_node), or its share of the node's NIC (node_nic_gbps,
    at the inter-node link's efficiency) where the node's GPUs share one."""
    inter = cluster.inter_node
    if cluster.node_nic_gbps is None:
        return inter.bytes_per_s
    share = cluster.node_nic_gbps * 1e9 * inter.efficiency / np.maximum(np.asarray(crossing, dtype=float), 1.0)
    return np.minimum(inter.bytes_per_s, share)


def members_within(size: float, parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(members of the group in one block of ``size`` consecutive ranks (a node or a site), whether
    the whole group lies in one): the product over the group's axes (``parts``: (degree, stride)
    of each mesh axis it spans) of the members each axis keeps inside the block."""
    if len(parts) == 1:  # one axis (the common case): its members in the block, as a strided run
        n, st = parts[0]
        return (np.where(st < size, np.minimum(np.maximum(size // np.maximum(st, 1), 1), np.maximum(n, 1)), 1),
                n * st <= size)
    per, inside = np.ones(()), np.ones((), dtype=bool)
    for n, st in parts:
        one = n <= 1
        k = np.where(st < size, np.minimum(np.maximum(size // np.maximum(st, 1), 1), np.maximum(n, 1)), 1)
        per = per * np.where(one, 1.0, k)
        inside = inside & (one | (n * st <= size))
    return per, inside


def _site_ring(cluster: ClusterSpec, m: int, step: int) -> tuple[float, float, int]:
    """(bytes/s, latency s, pairs) of the slowest hop of a ring over ``m`` sites ``step`` sites
    apart, over every such ring of the cluster (site_links; else inter_dc), and how many of the
    ring's hops cross one link."""
    n_sites = cluster.num_dcs
    worst_bw, worst_lat = np.inf, 0.0
    for base in range(n_sites):
        sites = [(base + k * step) % n_sites for k in range(m)]
        for a, b in zip(sites, sites[1:] + sites[:1]):
            if a == b:
                continue
            link = cluster.site_link(a, b)
            worst_bw, worst_lat = min(worst_bw, link.bytes_per_s), max(worst_lat, link.latency_us * US)
    return worst_bw, worst_lat, 1


@dataclass(frozen=True)
class Group:
    """A communication group: ``n`` ranks, achievable bytes/s per rank, per-hop latency (s).

    A group spanning several sites (datacenters) is priced hierarchically, as NCCL and every
    multi-site system reduce: these fields are the part inside one site (``n`` members per site)
    and ``outer`` the ring (or tree) between the sites, one per member of a site, that carries
    only the 1 / n of the bytes each member holds after the site's reduce-scatter."""

    n: Num
    bytes_per_s: Num
    latency_s: Num
    across_nodes: Num = False
    """The group spans nodes: its all-reduce may run as NCCL's tree (``all_reduce``)."""
    outer: Group | None = None
    """The tier between sites (n = sites spanned; 1 where a row's group stays in one site)."""
    alt: Group | None = None
    """Across sites: one flat ring (or tree) over all the members at the slowest link, which the
    library runs instead where it is faster (the hierarchical phases run one after another)."""
    per_node: Num = 1.0
    """Members of the group in each node (across nodes: the tree's chain inside a node)."""
    intra_bps: Num = None
    """Bytes/s of the intra-node link (the tree's chain inside a node); None: bytes_per_s."""
    intra_lat: Num = 0.0
    """Per-hop latency (s) of the intra-node link (the tree's chain inside a node)."""

    @staticmethod
    def of(cluster: ClusterSpec, n: Num, stride: Num, flat: bool = False) -> Group:
        """Group of ``n`` ranks whose members are ``stride`` ranks apart (mesh axis placement).
        ``flat``: one ring over every member at the slowest link, no tree, no hierarchy (what gloo
        runs, or a profile whose collectives = flat-ring)."""
        n, stride = np.asarray(n, dtype=float), np.asarray(stride, dtype=float)
        if flat:
            return Group._of(cluster, [(n, stride)], flat=True)
        if n.size == 1 and stride.size == 1:
            # One plan (estimate()): the same few groups recur for every plan on a cluster;
            # memoised on the values that decide them (pure function of them, so exact).
            key = (_link_key(cluster), float(n.flat[0]), float(stride.flat[0]))
            hit = _GROUPS.get(key)
            if hit is None:
                if len(_GROUPS) > 4096:
                    _GROUPS.clear()
                hit = _GROUPS[key] = Group._of(cluster, [(n.reshape(()), stride.reshape(()))]).scalars()
            shape = np.broadcast_shapes(n.shape, stride.shape)
            return Group.from_scalars(hit, n.reshape(shape) if n.shape != shape else n, shape)
        return Group._of(cluster, [(n, stride)])

    @staticmethod
    def over(cluster: ClusterSpec, parts: list[tuple[Num, Num]], flat: bool = False) -> Group:
        """Group spanning several mesh axes at once (``parts``: (degree, stride) of each), e.g. the
        ranks of dp x cp when a placement puts another axis between them. One part = Group.of."""
        parts = [(np.asarray(n, dtype=float), np.asarray(s, dtype=float)) for n, s in parts]
        if len(parts) == 1:
            return Group.of(cluster, *parts[0], flat=flat)
        return Group._of(cluster, parts, flat=flat)

    def scalars(self) -> tuple[Any, ...]:
        o, a = self.outer, self.alt
        return (float(self.bytes_per_s), float(self.latency_s), bool(self.across_nodes), float(self.n),
                None if o is None else (float(o.n), float(o.bytes_per_s), float(o.latency_s)),
                None if a is None else (float(a.n), float(a.bytes_per_s), float(a.latency_s), bool(a.across_nodes),
                                        float(a.per_node), float(a.intra_bps), float(a.intra_lat)),
                (float(self.per_node), float(self.intra_bps), float(self.intra_lat)))

    @staticmethod
    def from_scalars(hit: tuple[Any, ...], n: np.ndarray, shape: tuple[int, ...]) -> Group:
        outer = alt = None
        if hit[4] is not None:
            on, obw, olat = hit[4]
            outer = Group(np.full(shape, on), np.full(shape, obw), np.full(shape, olat), np.full(shape, True))
            an, abw, alat, aac, apn, aib, ail = hit[5]
            alt = Group(np.full(shape, an), np.full(shape, abw), np.full(shape, alat), np.full(shape, aac),
                        per_node=np.full(shape, apn), intra_bps=np.full(shape, aib), intra_lat=np.full(shape, ail))
            n = np.full(shape, hit[3])
        pn, ib, il = hit[6]
        return Group(n, np.full(shape, hit[0]), np.full(shape, hit[1]), np.full(shape, hit[2]), outer, alt,
                     np.full(shape, pn), np.full(shape, ib), np.full(shape, il))

    @staticmethod
    def _of(cluster: ClusterSpec, parts: list[tuple[np.ndarray, np.ndarray]], flat: bool = False) -> Group:
        gpn = cluster.gpus_per_node
        intra, inter = cluster.intra_node, cluster.inter_node
        n = np.ones(())
        for k, _ in parts:
            n = n * np.maximum(k, 1)
        # k ranks of the group per node (one ring per NIC), 1 when the stride spans nodes
        per_node, inside = members_within(gpn, parts)
        nic = nic_bytes_per_s(cluster, gpn)  # every group of the axis runs at once: all of a node's GPUs
        intra_bw = intra.bytes_per_s
        bw = np.where(inside, intra_bw, np.minimum(intra_bw, per_node * nic))
        lat = np.where(n <= 1, 0.0, np.where(inside, intra.latency_us * US, inter.latency_us * US))
        intra_lat = intra.latency_us * US
        node_n = np.where(inside, n, per_node)
        if cluster.inter_dc is None or not cluster.nodes_per_dc or cluster.num_dcs < 2:
            return Group(n, bw, lat, ~inside & (not flat), per_node=node_n, intra_bps=intra.bytes_per_s,
                         intra_lat=intra_lat)
        gps = cluster.gpus_per_dc
        per_site, one_site = members_within(gps, parts)
        m = np.where(one_site, 1.0, np.round(n / np.maximum(per_site, 1)))
        # the sites' ring: the slowest hop between the sites it joins, per GPU (never faster than the
        # GPU's NIC); a link shared by every GPU crossing it (LinkTier.shared) gives each of the N / m
        # rings that cross it at once m / N of it
        extent = np.zeros(np.shape(m))
        for k, st in parts:
            extent = np.maximum(extent, np.where(k > 1, k * st, 0.0))
        step = np.maximum(1.0, np.floor(np.ceil(extent / gps) / np.maximum(m, 1)))  # sites between members
        site_bw, site_lat = np.full(np.shape(m), np.inf), np.zeros(np.shape(m))
        for mv, sv in {(float(a), float(b)) for a, b in zip(np.ravel(m), np.ravel(step + 0 * m)) if a > 1}:
            rows = (m == mv) & (step == sv)
            rbw, rlat, _ = _site_ring(cluster, int(mv), int(sv))
            site_bw, site_lat = np.where(rows, rbw, site_bw), np.where(rows, rlat, site_lat)
        shared = cluster.inter_dc.shared or any(t.shared for t in cluster.site_links)
        share = site_bw * m / cluster.num_gpus if shared else site_bw
        outer_bw = np.minimum(np.minimum(intra_bw, nic), share)
        fbw = np.where(m > 1, np.minimum(bw, np.minimum(site_bw * n / cluster.num_gpus if shared else site_bw,
                                                        per_node * nic)), bw)
        flat_group = Group(n, fbw, np.where(m > 1, site_lat, lat), ~inside, per_node=node_n,
                           intra_bps=intra_bw, intra_lat=intra_lat)
        if flat:  # one ring over every member at the slowest link (gloo; the hierarchical form's bound)
            return Group(n, fbw, flat_group.latency_s, np.zeros(np.shape(inside), dtype=bool), per_node=node_n,
                         intra_bps=intra_bw, intra_lat=intra_lat)
        inner_n = np.where(m > 1, per_site, n)
        inner_inside = inside | (inner_n <= per_node)
        inner_bw = np.where(inner_inside, np.where(inside, bw, intra_bw), np.minimum(intra_bw, per_node * nic))
        inner_lat = np.where(inner_n <= 1, 0.0, np.where(inner_inside, intra.latency_us * US,
                                                          inter.latency_us * US))
        outer = Group(m, np.where(m > 1, outer_bw, 1.0), np.where(m > 1, site_lat, 0.0), np.ones(np.shape(m), bool))
        return Group(inner_n, inner_bw, inner_lat, ~inner_inside, outer, flat_group,
                     np.where(inner_inside, inner_n, per_node), intra_bw, intra_lat)

    def flat(self, cluster: ClusterSpec, parts: list[tuple[Num, Num]]) -> Group:
        """The same devices as one flat ring at the slowest link it crosses (what gloo, or a
        runtime without hierarchical collectives, runs): the bound the hierarchical form beats."""
        return Group._of(cluster, [(np.asarray(n, dtype=float), np.asarray(s, dtype=float)) for n, s in parts],
                         flat=True)

    def _ring(self, size: Num, passes: float) -> Num:
        """A ring of ``passes`` passes (all-reduce 2, the others 1): (n - 1) steps of size / n per pass,
        each step as slow as the ring's slowest hop. Under NCCL the fastest of its protocols
        (NCCL_BASE_US, hop_latency, NCCL_BW_FACTOR): LL for small messages, Simple for bulk."""
        n = np.maximum(self.n, 1)
        m = n - 1
        size = np.asarray(size, dtype=float)
        if PROTOCOLS == ("simple",):  # the default: the link's latency is the hop (hop_latency), factor 1
            t = passes * (m / n * size / self.bytes_per_s + m * self.latency_s) + NCCL_BASE_US[("ring", "simple")] * US
            return np.where((self.n <= 1) | (size <= 0), 0.0, t)
        across = np.asarray(self.across_nodes, dtype=bool)
        t = np.inf
        for p in PROTOCOLS:
            key = ("ring", p)
            hop = np.where(across, hop_latency(self.latency_s, "net", key), hop_latency(self.latency_s, "nvlink", key))
            lat = passes * m * hop + NCCL_BASE_US[key] * US
            tp = passes * m / n * size / (self.bytes_per_s * NCCL_BW_FACTOR[key]) + lat
            if p == "ll128":  # NVLink only
                tp = np.where(across, np.inf, tp)
            t = np.minimum(t, tp)
        return np.where((self.n <= 1) | (size <= 0), 0.0, t)

    def _tree(self, size: Num) -> Num:
        """NCCL's double binary tree all-reduce across k nodes with c members per node (a chain inside
        each node, a binary tree between the nodes, two trees on half the data each): latency
        2 ((c - 1) intra hop + ceil(log2 k) inter hop) (NCCL v2.7.5 tuning.cc). Bytes: each node sends
        (and receives) S on its NICs when k = 2 (each node is the other's parent in one tree) and 2 S
        when k >= 3 (an interior node of one tree forwards to two children), against the ring's
        2 (n - 1) / n S; the chain moves S each way on the intra-node link; the chain and the tree
        pipeline, so the slower of the two counts. On 2 nodes the tree's bus bandwidth is about
        2 (n - 1) / n times the ring's (NVIDIA/nccl#527: 2 p4d nodes 57 GB/s, 3-4 nodes 30-32)."""
        n = np.maximum(self.n, 1)
        c = np.maximum(np.asarray(self.per_node, dtype=float), 1.0)
        k = np.maximum(np.round(n / c), 1.0)
        size = np.asarray(size, dtype=float)
        ib = self.bytes_per_s if self.intra_bps is None else self.intra_bps
        net = np.where(k <= 2, 1.0, 2.0) * size / self.bytes_per_s
        chain = np.where(c > 1, size / ib, 0.0)
        t = np.inf
        for p in TREE_PROTOCOLS:
            key = ("tree", p)
            lat = 2.0 * ((c - 1) * hop_latency(self.intra_lat, "nvlink", key)
                         + np.ceil(np.log2(k)) * hop_latency(self.latency_s, "net", key))
            bw_factor = NCCL_BW_FACTOR[key] * tree_correction(p, size)
            t = np.minimum(t, np.maximum(net, chain) / bw_factor + lat + NCCL_BASE_US[key] * US)
        return t

    def all_reduce(self, size: Num) -> Num:
        """Within one site: the ring's time, or across nodes NCCL's tree's where it is shorter (_tree).
        Across sites: reduce-scatter within each site, all-reduce of each member's 1 / n shard between the
        sites (ring or tree), all-gather within each site (NCCL's hierarchical form, as in
        Megatron's / Horovod's hierarchical all-reduce): only 1 / n of the bytes crosses the slow
        tier, with 2 (m - 1) (or 2 log2 m) of its latencies instead of 2 (n m - 1)."""
        ring = self._ring(size, 2.0)
        use_tree = np.asarray(self.across_nodes, dtype=bool) & (self.n > 1) & (np.asarray(size) > 0)
        one = np.where(use_tree, np.minimum(ring, self._tree(size)), ring) if np.any(use_tree) else ring
        o = self.outer
        if o is None:
            return one
        shard = np.asarray(size, dtype=float) / np.maximum(self.n, 1)
        hier = self._ring(size, 1.0) + o.all_reduce(shard) + self._ring(size, 1.0)
        return np.where(o.n > 1, self._best(hier, "all_reduce", size), one)

    def _best(self, hier: Num, op: str, size: Num) -> Num:
        """The hierarchical time, or the flat algorithm's where shorter (``alt``)."""
        return hier if self.alt is None else np.minimum(hier, getattr(self.alt, op)(size))

    def all_gather(self, size: Num) -> Num:
        """Across sites: between the sites first (each member's piece from every site: size / n),
        then within each site (the whole size)."""
        return self._best(self._ring(size, 1.0) + self._outer(size, "all_gather"), "all_gather", size)

    def reduce_scatter(self, size: Num) -> Num:
        """Across sites: within each site (the whole size), then between the sites (size / n)."""
        return self._best(self._ring(size, 1.0) + self._outer(size, "reduce_scatter"), "reduce_scatter", size)

    def all_to_all(self, size: Num) -> Num:
        """Across sites: the (n - 1) / (n m) of each rank's bytes that stay in its site on the
        site's links, the (m - 1) / m that leave it on the link between sites."""
        o = self.outer
        if o is None:
            return self._ring(size, 1.0)
        m = np.maximum(o.n, 1)
        return self._best(self._ring(np.asarray(size, dtype=float) / m, 1.0) + o._ring(size, 1.0), "all_to_all", size)

    def _outer(self, size: Num, op: str) -> Num:
        o = self.outer
        if o is None:
            return 0.0
        return getattr(o, op)(np.asarray(size, dtype=float) / np.maximum(self.n, 1))

    def send_recv(self, size: Num) -> Num:
        o = self.outer
        if o is not None:  # a pair on two sites: the link between them
            bw = np.where(o.n > 1, o.bytes_per_s, self.bytes_per_s)
            lat = np.where(o.n > 1, o.latency_s, self.latency_s)
            return np.where(np.asarray(size) <= 0, 0.0, size / bw + lat)
        return np.where(np.asarray(size) <= 0, 0.0, size / self.bytes_per_s + self.latency_s)


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""The collectives a Group prices (nccl-tests' names: all_reduce_perf, ...)."""


def collective_seconds(cluster: ClusterSpec, op: str, nbytes: float, n: int, stride: int = 1) -> float:
    """Seconds of one collective ``op`` (COLLECTIVES) of ``nbytes`` (nccl-tests' size: the
    all-reduce buffer, the all-gather output, the reduce-scatter input) over ``n`` ranks whose
    members are ``stride`` ranks apart on ``cluster`` (n consecutive ranks: stride 1)."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(COLLECTIVES)}")
    return float(getattr(Group.of(cluster, n, stride), op)(float(nbytes)))


BUS_FACTOR = {"all_reduce": lambda n: 2.0 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "send_recv": lambda n: 1.0}
"""nccl-tests' bus bandwidth = algorithm bandwidth (size / time) x this factor of the ranks
(NVIDIA nccl-tests doc/PERFORMANCE.md)."""


def bus_bandwidth(op: str, nbytes: float, n: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth, bytes/s, of ``op`` on ``n`` ranks moving ``nbytes`` in ``seconds``."""
    return nbytes / seconds * BUS_FACTOR[op](n)


_PIPES: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray, int]] = {}


def pipeline_links(cluster: ClusterSpec, sizes: dict[str, int], order: tuple[str, ...] | None,
                   wrap: bool, sites: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bytes/s, latency s) of each pipeline boundary, (pp,): boundary j carries the sends between
    stage j and stage j + 1 (the last, pp - 1 -> 0, is used by interleaved schedules only:
    ``wrap``). Every rank of a stage sends to its peer at once; a boundary is as fast as its
    slowest pair: inside a node the intra-node link; across nodes the GPU's NIC (or its share of
    a node NIC, among the node's GPUs crossing at this boundary); across sites the link between
    the two sites (a shared one divided among every pair of every boundary that crosses it).
    ``sites``: the plan's site order (Plan.site_order): the stages' blocks on the sites in that
    order (spec.axes.ParallelDims.rank_grid), so its boundaries cross those sites' links."""
    hit = _pipes(cluster, sizes, order, wrap, sites)
    return hit[0], hit[1]


def pipeline_site_pairs(cluster: ClusterSpec, sizes: dict[str, int], order: tuple[str, ...] | None,
                        wrap: bool, sites: tuple[int, ...] | None = None) -> int:
    """Pairs of peer ranks whose pipeline sends cross a link between sites, over every boundary
    (each sends one activation and one gradient per micro-batch and chunk across it)."""
    return _pipes(cluster, sizes, order, wrap, sites)[2]


def _pipes(cluster: ClusterSpec, sizes: dict[str, int], order: tuple[str, ...] | None,
           wrap: bool, sites: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    key = (_link_key(cluster), cluster.num_gpus, tuple(int(sizes[a]) for a in AXES), order, wrap, sites)
    hit = _PIPES.get(key)
    if hit is not None:
        return hit
    if len(_PIPES) > 4096:
        _PIPES.clear()
    fast = _pipes_default(cluster, sizes, order, wrap) if sites is None else None
    if fast is not None:
        _PIPES[key] = fast
        return fast
    dims = ParallelDims(**{a: int(sizes[a]) for a in AXES}, order=order or AXES, sites=sites)
    fault = site_order_fault(dims, cluster.num_dcs)
    if fault is not None:
        from meshplan.errors import MeshplanError
        raise MeshplanError(f"plan: {fault}", hint="site_order orders the sites a pipeline crosses")
    grid = dims.rank_grid().reshape(dims.pp, -1)
    pp, gpn = dims.pp, cluster.gpus_per_node
    gps = cluster.gpus_per_dc if cluster.num_dcs > 1 else None
    intra, inter = cluster.intra_node, cluster.inter_node
    bws, lats = np.full(pp, np.inf), np.zeros(pp)
    used = [j for j in range(pp) if j < pp - 1 or (wrap and pp > 1)]
    pairs = {j: (grid[j], grid[(j + 1) % pp]) for j in used}
    site_load: dict[tuple[int, int], int] = {}
    if gps is not None:
        for a, b in pairs.values():
            sa, sb = a // gps, b // gps
            for x, y in zip(sa[sa != sb], sb[sa != sb]):
                k = (int(min(x, y)), int(max(x, y)))
                site_load[k] = site_load.get(k, 0) + 1
    for j, (a, b) in pairs.items():
        na, nb = a // gpn, b // gpn
        if (na == nb).all():
            bws[j], lats[j] = intra.bytes_per_s, intra.latency_us * US
            continue
        crossing = np.bincount(na[na != nb]).max()
        bw = float(np.minimum(intra.bytes_per_s, nic_bytes_per_s(cluster, crossing)))
        lat = inter.latency_us * US
        if gps is not None:
            sa, sb = a // gps, b // gps
            for k in {(int(min(x, y)), int(max(x, y))) for x, y in zip(sa[sa != sb], sb[sa != sb])}:
                link = cluster.site_link(*k)
                lb = link.bytes_per_s / site_load[k] if link.shared else link.bytes_per_s
                bw, lat = min(bw, lb), max(lat, link.latency_us * US)
        bws[j], lats[j] = bw, lat
    _PIPES[key] = (bws, lats, sum(site_load.values()))
    return _PIPES[key]


def _pipes_default(cluster: ClusterSpec, sizes: dict[str, int], order: tuple[str, ...] | None,
                   wrap: bool) -> tuple[np.ndarray, np.ndarray, int] | None:
    """_pipes without enumerating ranks where the layout is regular: one site, no shared node NIC,
    the default order (stage j holds the s = N / pp consecutive ranks from j s), and a stage's
    ranks tile nodes (s a multiple or a divisor of the node). None otherwise."""
    if order is not None or cluster.num_dcs > 1 or cluster.node_nic_gbps is not None:
        return None
    pp, g = int(sizes[AX.PP]), cluster.gpus_per_node
    s = int(sizes[AX.DP]) * int(sizes[AX.CP]) * int(sizes[AX.TP])
    if s % g and g % s:
        return None
    intra, inter = cluster.intra_node, cluster.inter_node
    cross_bw = float(np.minimum(intra.bytes_per_s, nic_bytes_per_s(cluster, min(s, g))))
    bws, lats = np.full(pp, np.inf), np.zeros(pp)
    for j in range(pp - 1 if not (wrap and pp > 1) else pp):
        if j < pp - 1:
            crosses = s >= g or ((j + 1) * s) % g == 0
        else:  # the wrap: rank pp - 1 's peers back to rank 0's
            crosses = pp * s > g or g % (pp * s) != 0
        bws[j], lats[j] = ((cross_bw, inter.latency_us * US) if crosses
                           else (intra.bytes_per_s, intra.latency_us * US))
    return bws, lats, 0


def pair_link(cluster: ClusterSpec, sizes: dict[str, int], order: tuple[str, ...] | None,
              sites: tuple[int, ...] | None = None) -> tuple[float, float]:
    """(bytes/s, latency s) between the first and the last pipeline stage's peers (the tied
    embedding's gradient all-reduce): the wrap boundary's link (under the site order ``sites``:
    between the first and the last site the pipeline visits)."""
    if int(sizes[AX.PP]) < 2:
        return cluster.intra_node.bytes_per_s, 0.0
    bws, lats = pipeline_links(cluster, sizes, order, True, sites)
    return float(bws[-1]), float(lats[-1])


class Strides(dict):
    """Axis -> (rows) rank distance (mesh_strides); ``default``: every row in the default order."""

    default: bool = False


def mesh_strides(cols: Mapping[str, Any]) -> Strides:
    """(rows) rank distance between neighbours on each mesh axis under each row's placement
    (Plan.mesh_order; '' or absent = the default pp:dp:cp:tp: tp 1, cp tp, dp tp x cp, pp tp x cp x dp)."""
    orders = cols.get("mesh_order")
    if orders is None or (isinstance(orders, np.ndarray) and (orders.dtype.itemsize == 0 or not orders.any())):
        tp, cp, dp = (np.asarray(cols[a], dtype=float) for a in (AX.TP, AX.CP, AX.DP))
        out = Strides({AX.TP: np.ones(tp.shape), AX.CP: 1 * tp, AX.DP: 1 * tp * cp, AX.PP: 1 * tp * cp * dp})
        out.default = True
        return out
    return Strides(column_strides(orders, {a: np.asarray(cols[a], dtype=float) for a in AXES}))


def column_st(st: Mapping[str, np.ndarray]) -> Strides:
    """Per-row strides as (rows, 1) columns (to broadcast against per-layer or per-rank arrays)."""
    out = Strides({a: np.asarray(x)[:, None] for a, x in st.items()})
    out.default = getattr(st, "default", False)
    return out


def dpcp_group(cluster: ClusterSpec, st: Mapping[str, Any], cp: Any, n: Any, skip: Any = 1,
               flat: bool = False) -> Group:
    """The group of ``n`` ranks ``skip`` apart along dp x cp flattened (cp varies fastest, as the
    runtime's dp_cp mesh dimension): ZeRO/FSDP shards, data-parallel and expert groups, HSDP's
    replicas. Under the default placement (cp just inside dp) it is one strided axis; when the
    placement puts another axis between dp and cp, a group over both."""
    if getattr(st, "default", False):
        return Group.of(cluster, n, st[AX.CP] * skip, flat=flat)
    s_cp, s_dp = np.asarray(st[AX.CP], dtype=float), np.asarray(st[AX.DP], dtype=float)
    if np.all(s_dp == s_cp * np.asarray(cp, dtype=float)):
        return Group.of(cluster, n, s_cp * np.asarray(skip, dtype=float), flat=flat)
    return Group.over(cluster, dpcp_parts(st, cp, n, skip), flat=flat)


def dpcp_parts(st: Mapping[str, Any], cp: Any, n: Any, skip: Any = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """(degree, stride) of the cp and the dp part of the group of ``n`` ranks ``skip`` apart along
    dp x cp flattened (dpcp_group), under the strides ``st``."""
    s_cp, s_dp = np.asarray(st[AX.CP], dtype=float), np.asarray(st[AX.DP], dtype=float)
    cp, n, skip = np.asarray(cp, dtype=float), np.asarray(n, dtype=float), np.asarray(skip, dtype=float)
    inner = skip < cp
    n_cp = np.where(inner, np.minimum(n, np.maximum(cp / skip, 1.0)), 1.0)
    return [(n_cp, s_cp * skip), (n / n_cp, np.where(inner, s_dp, s_dp * skip / cp))]


def mesh_placement(text: str) -> tuple[tuple[str, ...] | None, tuple[int, ...] | None]:
    """A mesh_keys placement text -> (mesh order, site order), None for the defaults."""
    order, _, sites = str(text).partition("@")
    return parse_order(order), parse_sites(sites)


def any_text(values: Any) -> bool:
    """Whether a text column holds a non-empty string (its bytes: no string comparison, so that
    a column of '' costs next to nothing)."""
    a = np.asarray(values)
    if a.dtype.kind not in "US":
        return bool(a.any())
    return a.dtype.itemsize > 0 and bool(np.ascontiguousarray(a).view(np.uint8).any())


def text_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct strings of a text column, each row's index into them), by one vectorised
    comparison per distinct value (placement columns hold few; faster than np.unique's string sort)."""
    values = np.asarray(values, dtype=str)
    idx = np.full(values.shape, -1, dtype=np.int64)
    out: list[str] = []
    left = np.flatnonzero(idx < 0)
    while len(left):
        v = values.flat[left[0]]
        hit = left[values.flat[left] == v]
        idx.flat[hit] = len(out)
        out.append(str(v))
        left = left[idx.flat[left] < 0]
    return np.array(out if out else [""]), idx


def mesh_keys(cols: Mapping[str, Any], extra: Any = None) -> tuple[list[tuple[Any, ...]], np.ndarray]:
    """The distinct meshes of a plan table: ([(sizes per AXES, placement text, extra), ...], the
    index of each row's), so that per-mesh work (cost.comm.pipeline_links) runs once per mesh.
    The placement text is the mesh order's, with ``@`` and the site order where a row has one
    (``mesh_placement`` reads it back)."""
    sizes = [np.asarray(cols[a]).astype(np.int64) for a in AXES]
    n = len(sizes[0])
    orders = np.broadcast_to(np.asarray(cols.get("mesh_order", ""), dtype=str), (n,))
    if orders.any():
        o_vals, o_idx = np.unique(orders, return_inverse=True)
    else:
        o_vals, o_idx = np.array([""]), np.zeros(n, dtype=np.int64)
    site = cols.get("site_order")
    if site is not None and any_text(site):  # order@sites
        s_vals, s_idx = text_codes(np.broadcast_to(np.asarray(site, dtype=str), (n,)))
        both = o_idx.reshape(n) * len(s_vals) + s_idx.reshape(n)
        used, o_idx = np.unique(both, return_inverse=True)
        o_vals = np.array([str(o_vals[u // len(s_vals)]) + (f"@{s_vals[u % len(s_vals)]}" if s_vals[u % len(s_vals)]
                                                             else "") for u in used])
    ex = np.zeros(n, dtype=np.int64) if extra is None else np.asarray(extra).astype(np.int64)
    # one int64 per row (each degree < 2^12 here, else the row-wise unique): a 1-D unique is fast
    if max(int(x.max(initial=0)) for x in sizes) < 4096 and len(o_vals) < 64 and int(ex.max(initial=0)) < 2:
        code = np.zeros(n, dtype=np.int64)
        for x in sizes:
            code = code * 4096 + x
        code = (code * 64 + o_idx.reshape(n)) * 2 + ex
        _, rows, inv = np.unique(code, return_index=True, return_inverse=True)
        keys = [(tuple(int(x[i]) for x in sizes), str(o_vals[o_idx.reshape(n)[i]]), int(ex[i])) for i in rows]
        return keys, inv.reshape(n)
    uniq, inv = np.unique(np.column_stack([*sizes, o_idx.reshape(n), ex]), axis=0, return_inverse=True)
    keys = [(tuple(int(x) for x in u[:4]), str(o_vals[u[4]]), int(u[5])) for u in uniq]
    return keys, inv.reshape(n)
