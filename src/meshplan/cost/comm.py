"""Collective communication times (alpha-beta model, ring algorithms).

Sizes are the full tensor size in bytes as each rank sees it after the collective
(all-gather output, reduce-scatter input, all-reduce buffer). Ring costs (Thakur et al. 2005;
NCCL docs, "bus bandwidth"):
  all-reduce      2 (n-1)/n * S / B + 2 (n-1) * alpha  (across nodes: or the tree's
                  2 S / B + 2 ceil(log2 n) alpha, where shorter, as NCCL picks)
  all-gather      (n-1)/n * S / B + (n-1) * alpha
  reduce-scatter  (n-1)/n * S / B + (n-1) * alpha
  all-to-all      (n-1)/n * S / B + (n-1) * alpha
  send/recv       S / B + alpha
A group spanning nodes with k members per node runs k rings in parallel, one per NIC, so its
per-rank bandwidth is min(intra-node, k x NIC) (NCCL multi-ring; busbw of DGX all-reduce).
A group crossing a shared link between datacenters (``LinkTier.shared``: its bandwidth is the
whole link's) gets n / N of it: all N / n groups of the collective cross it at once.

Every function here accepts numpy arrays as well as scalars (one row per candidate plan):
the scalar estimate and the vectorised search share this code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.spec.cluster import ClusterSpec
from meshplan.units import US

Num = Any  # float or numpy array


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


_GROUPS: dict[tuple[Any, ...], tuple[float, float]] = {}


def _link_key(c: ClusterSpec) -> tuple[Any, ...]:
    """Everything of a cluster that Group.of reads."""
    dc = c.inter_dc
    return (c.gpus_per_node, c.intra_node.bytes_per_s, c.intra_node.latency_us,
            c.inter_node.bytes_per_s, c.inter_node.latency_us, c.nodes_per_dc,
            None if dc is None else (dc.bytes_per_s, dc.latency_us, dc.shared, c.num_gpus))


@dataclass(frozen=True)
class Group:
    """A communication group: ``n`` ranks, achievable bytes/s per rank, per-hop latency (s)."""

    n: Num
    bytes_per_s: Num
    latency_s: Num
    across_nodes: Num = False
    """The group spans nodes: its all-reduce may run as NCCL's tree (``all_reduce``)."""

    @staticmethod
    def of(cluster: ClusterSpec, n: Num, stride: Num) -> Group:
        """Group of ``n`` ranks whose members are ``stride`` ranks apart (mesh axis placement)."""
        n, stride = np.asarray(n, dtype=float), np.asarray(stride, dtype=float)
        if n.size == 1 and stride.size == 1:
            # One plan (estimate()): the same few groups recur for every plan on a cluster;
            # memoised on the values that decide them (pure function of them, so exact).
            key = (_link_key(cluster), float(n.flat[0]), float(stride.flat[0]))
            hit = _GROUPS.get(key)
            if hit is None:
                if len(_GROUPS) > 4096:
                    _GROUPS.clear()
                g = Group._of(cluster, n.reshape(()), stride.reshape(()))
                hit = _GROUPS[key] = (float(g.bytes_per_s), float(g.latency_s), bool(g.across_nodes))
            shape = np.broadcast_shapes(n.shape, stride.shape)
            return Group(n.reshape(shape) if n.shape != shape else n, np.full(shape, hit[0]),
                         np.full(shape, hit[1]), np.full(shape, hit[2]))
        return Group._of(cluster, n, stride)

    @staticmethod
    def _of(cluster: ClusterSpec, n: np.ndarray, stride: np.ndarray) -> Group:
        gpn = cluster.gpus_per_node
        intra, inter = cluster.intra_node, cluster.inter_node
        span = n * stride
        inside = span <= gpn
        tier_bw, tier_lat = inter.bytes_per_s, inter.latency_us * US
        if cluster.inter_dc is not None and cluster.nodes_per_dc:
            dc = span > cluster.nodes_per_dc * gpn
            tier_bw = np.where(dc, cluster.inter_dc.bytes_per_s, tier_bw)
            tier_lat = np.where(dc, cluster.inter_dc.latency_us * US, tier_lat)
        # k ranks of the group per node (one ring per NIC), 1 when the stride spans nodes
        per_node = np.where(stride < gpn, np.minimum(np.maximum(gpn // np.maximum(stride, 1), 1),
                                                     np.maximum(n, 1)), 1)
        intra_bw = intra.bytes_per_s
        bw = np.where(inside, intra_bw, np.minimum(intra_bw, per_node * tier_bw))
        if cluster.inter_dc is not None and cluster.nodes_per_dc and cluster.inter_dc.shared:
            # One link between sites, shared: every group runs the collective at once (N / n
            # groups), and each group's ring crosses it once per direction, so each gets n / N of it.
            bw = np.where(dc, np.minimum(bw, cluster.inter_dc.bytes_per_s * n / cluster.num_gpus), bw)
        lat = np.where(n <= 1, 0.0, np.where(inside, intra.latency_us * US, tier_lat))
        return Group(n, bw, lat, ~inside)

    def _ring(self, size: Num, passes: float) -> Num:
        n = np.maximum(self.n, 1)
        m = n - 1
        t = passes * (m / n * size / self.bytes_per_s + m * self.latency_s)
        return np.where((self.n <= 1) | (size <= 0), 0.0, t)

    def all_reduce(self, size: Num) -> Num:
        """The ring's time, or across nodes the tree's where it is shorter: NCCL's double binary
        tree moves about 2 S / B and pays 2 ceil(log2 n) latencies instead of the ring's 2 (n - 1),
        so it wins when the latency dominates (small messages over many nodes, or slow links
        between sites)."""
        ring = self._ring(size, 2.0)
        n = np.maximum(self.n, 1)
        tree = 2.0 * size / self.bytes_per_s + 2.0 * np.ceil(np.log2(n)) * self.latency_s
        return np.where(np.asarray(self.across_nodes, dtype=bool) & (self.n > 1) & (np.asarray(size) > 0),
                        np.minimum(ring, tree), ring)

    def all_gather(self, size: Num) -> Num:
        return self._ring(size, 1.0)

    def reduce_scatter(self, size: Num) -> Num:
        return self._ring(size, 1.0)

    def all_to_all(self, size: Num) -> Num:
        return self._ring(size, 1.0)

    def send_recv(self, size: Num) -> Num:
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
