"""Properties of cost.comm's collective forms: NCCL's ring and tree, its protocols, the hierarchy.

The model under test (docs/collectives.md): a group's all-reduce is the fastest of NCCL's ring and, across
nodes, its double binary tree (2 nodes: S per node each way; 3 or more: 2 S), each (algorithm, protocol)
priced with NCCL v2.7.5's base latency, per-hop latency and bandwidth factor."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost import comm
from meshplan.cost.comm import NCCL_BW_FACTOR, NCCL_HW_US, Group, hop_latency, tree_correction
from meshplan.spec.cluster import LinkTier
from meshplan.spec.io import load_cluster

GPUS = ("h100-sxm-80gb", "a100-sxm-80gb", "a100-pcie-80gb")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@st.composite
def groups(draw):
    """A cluster of 1-16 nodes of 8 and a group of its ranks (n members ``stride`` apart)."""
    gpu = draw(st.sampled_from(GPUS))
    nodes = draw(st.sampled_from((1, 2, 3, 4, 8, 16)))
    c = load_cluster(f"{gpu}:{nodes * 8}")
    nic = draw(st.sampled_from((None, 6.25, 25.0, 50.0)))
    if nic is not None:
        c = c.replace(inter_node=LinkTier(name="inter_node", bandwidth_gbps=nic, latency_us=draw(
            st.sampled_from((2.0, 8.0, 40.0))), efficiency=0.8, kind="infiniband"))
    stride = draw(st.sampled_from([s for s in (1, 2, 4, 8, 16) if 2 * s <= c.num_gpus]))
    n = draw(st.sampled_from([k for k in (2, 3, 4, 8, 16, 32, 64) if k * stride <= c.num_gpus]))
    return c, n, stride


SIZES = st.floats(min_value=1.0, max_value=3e10, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(groups(), SIZES)
def test_never_faster_than_the_slowest_link_allows(g, size):
    """An all-reduce moves at least 2 (k - 1) / k of the bytes through each of the k nodes' NICs (k = 2:
    the tree's S, exactly) and 2 (n - 1) / n through each GPU inside one node, at the group's per-rank
    bandwidth (min of the intra-node link and the node's NICs); the others (n - 1) / n."""
    c, n, stride = g
    grp = Group.of(c, n, stride)
    k = n / float(grp.per_node) if bool(grp.across_nodes) else float(n)
    bw = float(grp.bytes_per_s)
    assert float(grp.all_reduce(size)) >= 2 * (k - 1) / k * size / bw * (1 - 1e-12)
    for op in ("all_gather", "reduce_scatter"):
        assert float(getattr(grp, op)(size)) >= (n - 1) / n * size / bw * (1 - 1e-12)


@settings(max_examples=150, deadline=None)
@given(groups(), SIZES, st.floats(min_value=1.01, max_value=64.0))
def test_monotone_in_size(g, size, factor):
    """More bytes never take less time, whichever algorithm and protocol wins at each size (NCCL's tree
    correction is interpolated so that it cannot make a larger message faster)."""
    c, n, stride = g
    grp = Group.of(c, n, stride)
    for op in OPS:
        f = getattr(grp, op)
        assert float(f(size * factor)) >= float(f(size)) * (1 - 1e-12), op
    if bool(grp.across_nodes):  # the tree alone, where it may not win
        assert float(grp._tree(size * factor)) >= float(grp._tree(size)) * (1 - 1e-12)


def _protocols(monkeypatch, ring=("ll", "ll128", "simple"), tree=("ll", "simple")):
    monkeypatch.setattr(comm, "PROTOCOLS", ring)
    monkeypatch.setattr(comm, "TREE_PROTOCOLS", tree)


@settings(max_examples=100, deadline=None)
@given(groups(), SIZES)
def test_choice_is_the_minimum_over_the_options(g, size):
    """With every protocol enabled, the ring is the fastest single protocol and the all-reduce the faster
    of the ring and (across nodes) the tree: the library's pick is a minimum, so adding an option never
    makes a collective slower."""
    c, n, stride = g
    grp = Group.of(c, n, stride)
    mp = pytest.MonkeyPatch()
    try:
        one = {}
        for p in ("ll", "ll128", "simple"):
            _protocols(mp, ring=(p,), tree=(p,) if p != "ll128" else ("simple",))
            one[p] = (float(grp._ring(size, 2.0)), float(grp._tree(size)))
        _protocols(mp)
        ring_all, tree_all = float(grp._ring(size, 2.0)), float(grp._tree(size))
        both = float(grp.all_reduce(size))
        _protocols(mp, ring=("simple",), tree=("simple",))
        simple_only = float(grp.all_reduce(size))
    finally:
        mp.undo()
    assert ring_all == pytest.approx(min(v[0] for v in one.values()))
    assert tree_all == pytest.approx(min(one["ll"][1], one["simple"][1]))
    expect = min(ring_all, tree_all) if bool(grp.across_nodes) else ring_all
    assert both == pytest.approx(expect)
    assert both <= simple_only * (1 + 1e-12)


def test_two_node_tree_beats_the_ring_on_bandwidth():
    """On exactly 2 nodes the tree moves S per node each way against the ring's 2 (n - 1) / n S: bulk
    all-reduce runs at 0.9 (NCCL's tree factor) x 2 (n - 1) / n x the ring's bus bandwidth; on 3 or more
    nodes (2 S per node) the ring wins."""
    big = 2.0 ** 33
    g2 = Group.of(load_cluster("a100-sxm-80gb:16"), 16, 1)
    ring2 = float(g2._ring(big, 2.0))
    assert float(g2.all_reduce(big)) == pytest.approx(float(g2._tree(big)))
    assert ring2 / float(g2.all_reduce(big)) == pytest.approx(NCCL_BW_FACTOR[("tree", "simple")] * 2 * 15 / 16,
                                                              rel=0.01)
    g4 = Group.of(load_cluster("a100-sxm-80gb:32"), 32, 1)
    assert float(g4.all_reduce(big)) == pytest.approx(float(g4._ring(big, 2.0)))
    assert float(g4._tree(big)) > float(g4._ring(big, 2.0))
    inside = Group.of(load_cluster("a100-sxm-80gb:8"), 8, 1)  # one node: no tree
    assert float(inside.all_reduce(big)) == pytest.approx(float(inside._ring(big, 2.0)))


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0.0, max_value=0.1), st.sampled_from(("nvlink", "net")),
       st.sampled_from(sorted(NCCL_HW_US["net"])))
def test_hop_latency(link_s, hw, key):
    """The ring/Simple hop is the link's latency; another (algorithm, protocol) differs from it by NCCL's
    hwLat difference, is never below the smaller of the link's latency and NCCL's hwLat, and grows with
    the link's latency (a long link's delay is paid whatever the protocol)."""
    h = float(hop_latency(link_s, hw, key))
    if key == ("ring", "simple"):
        assert h == pytest.approx(link_s)
    assert h >= min(link_s, NCCL_HW_US[hw][key] * 1e-6) - 1e-15
    assert float(hop_latency(link_s + 1e-3, hw, key)) >= h


def test_tree_correction_is_nccls_at_powers_of_two():
    """NCCL v2.7.5's treeCorrectionFactor at its powers of two (64 B x 2^i), 1 from 256 MiB."""
    for proto in ("ll", "simple"):
        table = comm.TREE_CORRECTION[proto]
        sizes = 64.0 * 2.0 ** np.arange(len(table))
        assert np.allclose(tree_correction(proto, sizes), table)
        assert float(tree_correction(proto, 2.0 ** 31)) == 1.0


@pytest.mark.parametrize("nodes", (2, 4))
def test_tree_is_monotone_across_nccls_steps(nodes):
    """On a fine grid of sizes (64 B to 1 GiB, 64 per doubling, across every power of two where NCCL's
    correction steps), the tree's time never falls as the size grows."""
    g = Group.of(load_cluster(f"h100-sxm-80gb:{nodes * 8}"), nodes * 8, 1)
    sizes = np.geomspace(64.0, 2.0 ** 30, 24 * 64 + 1)
    t = np.asarray(g._tree(sizes), dtype=float)
    assert np.all(np.diff(t) >= -1e-15)
