"""Collective communication times (alpha-beta model, ring algorithms).

Sizes are the full tensor size in bytes as each rank sees it after the collective
(all-gather output, reduce-scatter input, all-reduce buffer). Ring costs (Thakur et al. 2005;
NCCL docs, "bus bandwidth"):
  all-reduce      2 (n-1)/n * S / B + 2 (n-1) * alpha
  all-gather      (n-1)/n * S / B + (n-1) * alpha
  reduce-scatter  (n-1)/n * S / B + (n-1) * alpha
  all-to-all      (n-1)/n * S / B + (n-1) * alpha
  send/recv       S / B + alpha
A group spanning nodes with k members per node runs k rings in parallel, one per NIC, so its
per-rank bandwidth is min(intra-node, k x NIC) (NCCL multi-ring; busbw of DGX all-reduce).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.spec.cluster import ClusterSpec
from meshplan.units import US


@dataclass(frozen=True)
class Group:
    """A communication group: ``n`` ranks, achievable bytes/s per rank, per-hop latency (s)."""

    n: int
    bytes_per_s: float
    latency_s: float

    @staticmethod
    def of(cluster: ClusterSpec, n: int, stride: int) -> "Group":
        """Group of ``n`` ranks whose members are ``stride`` ranks apart (mesh axis placement)."""
        intra = cluster.intra_node
        if n <= 1:
            return Group(1, intra.bytes_per_s, 0.0)
        if n * stride <= cluster.gpus_per_node:
            return Group(n, intra.bytes_per_s, intra.latency_us * US)
        tier = cluster.tier_for_span(n * stride)
        per_node = max(1, min(n, cluster.gpus_per_node // stride)) if stride < cluster.gpus_per_node else 1
        bw = min(intra.bytes_per_s, per_node * tier.bytes_per_s)
        return Group(n, bw, tier.latency_us * US)

    def _ring(self, size: float, passes: float) -> float:
        if self.n <= 1 or size <= 0:
            return 0.0
        n = self.n
        return passes * ((n - 1) / n * size / self.bytes_per_s + (n - 1) * self.latency_s)

    def all_reduce(self, size: float) -> float:
        return self._ring(size, 2.0)

    def all_gather(self, size: float) -> float:
        return self._ring(size, 1.0)

    def reduce_scatter(self, size: float) -> float:
        return self._ring(size, 1.0)

    def all_to_all(self, size: float) -> float:
        return self._ring(size, 1.0)

    def send_recv(self, size: float) -> float:
        return 0.0 if size <= 0 else size / self.bytes_per_s + self.latency_s
