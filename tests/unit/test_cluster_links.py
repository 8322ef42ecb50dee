"""Cluster files: per-kind default link efficiency (spec.links), [[site_links]] and node_nic_gbps."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.builtin_calibration import builtin_link_value
from meshplan.errors import MeshplanError
from meshplan.spec.base import to_dict
from meshplan.spec.io import cluster_from_dict, load_cluster
from meshplan.spec.links import KIND_DEFAULTS, known_kinds, link_efficiency

BASE = {"gpu": "h100-sxm-80gb", "num_nodes": 2}


def test_unfitted_kind_no_longer_inherits_infiniband():
    ib = builtin_link_value("inter_node", "infiniband")
    for kind in ("roce", "efa", "ethernet", "tcp", "tcpx"):
        c = cluster_from_dict({**BASE, "inter_node": {"kind": kind, "bandwidth_gbps": 25.0}})
        assert c.inter_node.efficiency == KIND_DEFAULTS[kind].efficiency
        assert c.inter_node.efficiency != ib
    c = cluster_from_dict({**BASE, "intra_node": {"kind": "pcie", "bandwidth_gbps": 32.0}})
    assert c.intra_node.efficiency == KIND_DEFAULTS["pcie"].efficiency


def test_fitted_kind_uses_calibration_and_stated_efficiency_wins():
    c = cluster_from_dict({**BASE, "inter_node": {"kind": "infiniband"}})
    assert c.inter_node.efficiency == builtin_link_value("inter_node", "infiniband")
    c = cluster_from_dict({**BASE, "inter_node": {"kind": "EFA", "efficiency": 0.33}})
    assert c.inter_node.efficiency == 0.33
    # no kind: the tier's default link (InfiniBand) and its efficiency, as before
    c = cluster_from_dict({**BASE, "inter_node": {"bandwidth_gbps": 10.0}})
    assert c.inter_node.kind == "infiniband" and c.inter_node.efficiency == builtin_link_value("inter_node",
                                                                                               "infiniband")


def test_unknown_kind_is_a_clear_error_unless_efficiency_is_stated():
    with pytest.raises(MeshplanError, match="infinband.*known kinds: .*infiniband"):
        cluster_from_dict({**BASE, "inter_node": {"kind": "infinband"}})
    c = cluster_from_dict({**BASE, "inter_node": {"kind": "slingshot", "efficiency": 0.7}})
    assert c.inter_node.kind == "slingshot" and c.inter_node.efficiency == 0.7


def test_defaults_are_physical():
    for k in known_kinds():
        d = KIND_DEFAULTS[k]
        assert 0 < d.efficiency <= 1 and d.basis in ("estimated", "prior", "assumed") and d.source
        assert 0 < link_efficiency("inter_node", k) <= 1


PRESET_EFFICIENCIES = {  # the shipped presets keep their numbers (issue 26: nothing may move)
    "cloud-h100-100gbe": ("inter_node", 0.8), "two-dc-h100": ("inter_dc", 0.9),
    "jean-zay-a100": ("inter_node", builtin_link_value("inter_node", "omnipath")),
}


@pytest.mark.parametrize("name", sorted(PRESET_EFFICIENCIES))
def test_presets_unchanged(name):
    tier, eff = PRESET_EFFICIENCIES[name]
    assert getattr(load_cluster(name), tier).efficiency == eff


def test_site_links_parse_and_round_trip():
    d = {"gpu": "h100-sxm-80gb", "num_nodes": 6, "nodes_per_dc": 2, "node_nic_gbps": 12.5,
         "inter_dc": {"bandwidth_gbps": 1.0, "latency_us": 20000.0, "kind": "wan", "efficiency": 0.9, "shared": True},
         "site_links": [{"sites": [1, 0], "bandwidth_gbps": 4.0},
                        {"sites": [1, 2], "latency_us": 50000.0, "kind": "roce"}]}
    c = cluster_from_dict(d)
    assert c.node_nic_gbps == 12.5 and c.num_dcs == 3
    a, b = c.site_links
    assert a.sites == (0, 1) and a.bandwidth_gbps == 4.0 and a.latency_us == 20000.0 and a.efficiency == 0.9
    assert a.shared and a.kind == "wan"
    assert b.sites == (1, 2) and b.bandwidth_gbps == 1.0 and b.efficiency == KIND_DEFAULTS["roce"].efficiency
    assert c.site_link(2, 0) == c.inter_dc  # a pair not listed
    assert cluster_from_dict(to_dict(c)) == c


def test_site_links_without_inter_dc_use_the_slowest():
    c = cluster_from_dict({"gpu": "h100-sxm-80gb", "num_nodes": 4, "nodes_per_dc": 2,
                           "site_links": [{"sites": [0, 1], "bandwidth_gbps": 3.0, "latency_us": 1000.0}]})
    assert c.inter_dc is not None and c.inter_dc.sites is None and c.inter_dc.bandwidth_gbps == 3.0
    assert c.inter_dc.kind == "wan" and c.inter_dc.efficiency == KIND_DEFAULTS["wan"].efficiency
    three = load_cluster("three-region-h100")
    assert three.num_dcs == 3 and len(three.site_links) == 3
    assert three.inter_dc.bytes_per_s == min(t.bytes_per_s for t in three.site_links)


@pytest.mark.parametrize("bad, msg", [
    ({"site_links": {"sites": [0, 1]}}, "list of tables"),
    ({"site_links": [{"sites": [0, 1], "bandwidth_gbps": 1.0, "latency_us": 1.0, "colour": 1}]}, "unknown key 'colour'"),
    ({"site_links": [{"sites": [0], "bandwidth_gbps": 1.0, "latency_us": 1.0}]}, "two site numbers"),
    ({"site_links": [{"sites": [0, True], "bandwidth_gbps": 1.0, "latency_us": 1.0}]}, "two site numbers"),
    ({"site_links": [{"sites": "0-1", "bandwidth_gbps": 1.0, "latency_us": 1.0}]}, "two site numbers"),
    ({"site_links": [{"sites": [0, 5], "bandwidth_gbps": 1.0, "latency_us": 1.0}]}, "sites"),
    ({"site_links": [{"sites": [1, 1], "bandwidth_gbps": 1.0, "latency_us": 1.0}]}, "two different sites"),
    ({"site_links": [{"sites": [0, 1], "latency_us": 1.0}]}, "missing bandwidth_gbps"),
    ({"site_links": [{"sites": [0, 1], "bandwidth_gbps": "fast", "latency_us": 1.0}]}, "bandwidth_gbps"),
    ({"site_links": [{"sites": [0, 1], "bandwidth_gbps": 1.0, "latency_us": 1.0},
                     {"sites": [1, 0], "bandwidth_gbps": 2.0, "latency_us": 1.0}]}, "linked twice"),
    ({"node_nic_gbps": -1.0}, "node_nic_gbps"),
    ({"node_nic_gbps": "wide"}, "node_nic_gbps"),
])
def test_bad_site_links_are_clear_errors(bad, msg):
    with pytest.raises(MeshplanError, match=msg):
        cluster_from_dict({"gpu": "h100-sxm-80gb", "num_nodes": 4, "nodes_per_dc": 2, **bad})


def test_site_links_need_nodes_per_dc():
    with pytest.raises(MeshplanError, match="nodes_per_dc"):
        cluster_from_dict({"gpu": "h100-sxm-80gb", "num_nodes": 4,
                           "site_links": [{"sites": [0, 1], "bandwidth_gbps": 1.0, "latency_us": 1.0}]})


def test_pooled_cluster_rejects_site_links_at_the_top():
    with pytest.raises(MeshplanError, match="site_links"):
        cluster_from_dict({"pools": [{"name": "a", "gpu": "h100-sxm-80gb", "num_nodes": 1},
                                     {"name": "b", "gpu": "a100-sxm-80gb", "num_nodes": 1}],
                           "site_links": []})


def test_inter_pool_kind_gets_its_default():
    c = cluster_from_dict({"pools": [{"name": "a", "gpu": "h100-sxm-80gb", "num_nodes": 1},
                                     {"name": "b", "gpu": "a100-sxm-80gb", "num_nodes": 1}],
                           "inter_pool": {"kind": "ethernet", "bandwidth_gbps": 1.25}})
    assert c.inter_pool.efficiency == KIND_DEFAULTS["ethernet"].efficiency


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.floats(0.01, 100.0)), min_size=1, max_size=6))
def test_site_links_parse_or_fail_cleanly(entries):
    raw = [{"sites": [a, b], "bandwidth_gbps": bw, "latency_us": 1000.0} for a, b, bw in entries]
    try:
        c = cluster_from_dict({"gpu": "h100-sxm-80gb", "num_nodes": 8, "nodes_per_dc": 2, "site_links": raw})
    except MeshplanError:
        return
    assert c.inter_dc.bytes_per_s == min(t.bytes_per_s for t in c.site_links)
    assert all(t.sites[0] < t.sites[1] < 4 for t in c.site_links)


def test_efa_generations_are_distinct_kinds():
    """EFA v1 (p4d, 0.5-0.7 of its line rate in the published rows) is its own kind; the later
    generations share 'efa' under their own names too (issue 26)."""
    assert link_efficiency("inter_node", "efa-v1") == KIND_DEFAULTS["efa-v1"].efficiency
    assert KIND_DEFAULTS["efa-v1"].efficiency < 0.7 < KIND_DEFAULTS["efa"].efficiency
    for alias in ("efa-v2", "efa-v3", "EFA-v4"):
        assert link_efficiency("inter_node", alias) == KIND_DEFAULTS["efa"].efficiency
    with pytest.raises(MeshplanError, match="efa-v2"):
        link_efficiency("inter_node", "efa-v9")
