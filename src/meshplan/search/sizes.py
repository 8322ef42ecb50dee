"""Cluster sizes: resize a cluster (of one GPU type, or a GPU budget over several pools), and the
sizes a --gpus range searches."""
from __future__ import annotations

from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec, PooledCluster

MAX_GPUS = 2**31 - 1
"""Largest cluster the search takes: plan degrees are int32 columns (and divisors of the GPU
count are found by trial division, so far larger counts would not finish)."""

def node_size(cluster: ClusterSpec | PooledCluster) -> int:
    """GPUs per node when the cluster grows: its own node size, or, for a single node with fewer
    GPUs (e.g. `h100-sxm-80gb:2`), the GPU's typical node (GPUSpec.gpus_per_node: 8 for
    DGX/HGX parts, 4 for GH200), as the cluster shorthand uses. Several pools: the smallest
    pool's node."""
    if isinstance(cluster, PooledCluster):
        return min(node_size(p) for p in cluster.pools)
    g = cluster.gpus_per_node
    return max(g, cluster.gpu.gpus_per_node) if cluster.num_nodes == 1 else g


def resized(cluster: ClusterSpec | PooledCluster, num_gpus: int) -> ClusterSpec | PooledCluster:
    """The same GPUs and links with ``num_gpus`` GPUs in whole nodes (or one partial node
    when ``num_gpus`` is smaller than a node). Several pools: the same pools under a budget of
    ``num_gpus`` GPUs in all (PooledCluster.max_gpus: plans take them fastest pool first)."""
    if isinstance(cluster, PooledCluster):
        if num_gpus <= 0:
            raise MeshplanError(f"cluster size must be positive; got {num_gpus}")
        return cluster.replace(max_gpus=num_gpus)
    g = node_size(cluster)
    name = f"{cluster.gpu.name}:{num_gpus}"
    if num_gpus <= 0:
        raise MeshplanError(f"cluster size must be positive; got {num_gpus}")
    if num_gpus < g:
        return cluster.replace(name=name, num_nodes=1, gpus_per_node=num_gpus, nodes_per_dc=None,
                               inter_dc=None, site_links=())
    if num_gpus % g:
        raise MeshplanError(f"{num_gpus} GPUs is not a whole number of {g}-GPU nodes")
    nodes = num_gpus // g
    dc = cluster.nodes_per_dc if cluster.nodes_per_dc and nodes % cluster.nodes_per_dc == 0 else None
    sites = nodes // dc if dc else 1
    # the first sites of the cluster, with the links between them (a per-pair link to a site left out goes)
    links = tuple(t for t in cluster.site_links if max(t.sites) < sites) if dc and sites > 1 else ()
    return cluster.replace(name=name, num_nodes=nodes, gpus_per_node=g, nodes_per_dc=dc if sites > 1 else None,
                           inter_dc=cluster.inter_dc if dc and sites > 1 else None, site_links=links)


def nice_sizes(lo: int, hi: int, node: int) -> list[int]:
    """Sizes in [lo, hi] that are powers of two or three times a power of two (the usual
    allocation sizes: 64, 96, 128, 192, 256, ...), in whole nodes (or, below one node, a
    divisor of the node size)."""
    out = set()
    p = 1
    while p <= hi:
        for n in (p, 3 * p):
            if lo <= n <= hi and (n % node == 0 or (n < node and node % n == 0)):
                out.add(n)
        p *= 2
    return sorted(out)


def parse_gpus(text: str, node: int) -> list[int]:
    """--gpus 'A..B' (the nice sizes in the range) or 'A,B,C' (exactly these)."""
    t = text.strip()
    empty = False
    try:
        if not t.strip(" ,"):
            raise ValueError("no size")
        if ".." in t:
            lo, hi = (int(x) for x in t.split("..", 1))
            listed = None
        else:
            items = t.split(",")
            listed = sorted({int(x) for x in items if x.strip()})
            if not all(x.strip() for x in items):
                listed = None
                empty = True
    except ValueError:  # int() of a non-number (MeshplanError is raised below, outside)
        raise MeshplanError(f"--gpus {text}: expected LOW..HIGH or a comma-separated list of GPU counts",
                            hint="e.g. --gpus 64..1024 or --gpus 64,128,256") from None
    if empty:
        raise MeshplanError(f"--gpus {text}: an empty item in the list (two commas, or a comma at an end)",
                            hint="e.g. --gpus 64,128,256")
    if listed is None:
        if lo <= 0 or hi <= 0:
            raise MeshplanError(f"--gpus {text}: sizes must be positive")
        if lo > hi:
            raise MeshplanError(f"--gpus {text}: the range is empty ({lo} > {hi})",
                                hint=f"write it low..high, e.g. --gpus {hi}..{lo}")
        sizes = nice_sizes(lo, hi, node)
        if not sizes:
            raise MeshplanError(f"--gpus {text}: no size in the range is a power of two or 3 x 2^k "
                                f"in whole {node}-GPU nodes",
                                hint="widen the range or list sizes, e.g. --gpus 64,128")
        return sizes
    if not listed or listed[0] <= 0:
        raise MeshplanError(f"--gpus {text}: sizes must be positive")
    for n in listed:
        if n >= node and n % node:
            raise MeshplanError(f"--gpus {text}: {n} GPUs is not a whole number of {node}-GPU nodes")
    return listed
