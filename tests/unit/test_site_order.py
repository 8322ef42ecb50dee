"""The explicit stage-to-site map (plan field site_order, issue 26): plan strings, plan JSON and plan
files round-trip it (hypothesis); bad values are one-line errors; the rank grid under a site order
is a permutation that moves whole sites (every group but the pipeline's keeps its members' offsets
and its site); compute and memory do not change under any site order, only the pipeline's
boundary links (and the tied sync) do; the vectorised constraint equals the scalar one; the search
on three sites of unequal links keeps the pipeline off the slowest pair, and adds no candidate on
one or two sites."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan_structure import plans

from meshplan.cost import estimate
from meshplan.cost.comm import pipeline_links
from meshplan.errors import MeshplanError
from meshplan.search.columns import PlanColumns
from meshplan.search.constraints import violation_masks
from meshplan.search.space import SearchSpace, enumerate_space, site_order_options
from meshplan.spec.axes import AXES, ParallelDims, site_order_fault
from meshplan.spec.base import from_dict, to_dict
from meshplan.spec.constraints import violations
from meshplan.spec.io import dump_toml, load_cluster, load_model, load_plan, plan_document
from meshplan.spec.plan import Plan, Workload, parse_plan

THREE = "three-region-h100"  # 3 sites of 4 nodes x 8 H100; links 0-1 1.25 GB/s, 0-2 0.625, 1-2 0.3125
PERMS3 = list(itertools.permutations(range(3)))


@st.composite
def site_orders(draw) -> tuple[int, ...]:
    k = draw(st.integers(2, 5))
    return tuple(draw(st.permutations(range(k))))


@settings(max_examples=150, deadline=None)
@given(plans(), site_orders(), st.sampled_from(["site_order", "sites"]))
def test_site_order_round_trips(tmp_path_factory, plan: Plan, sites: tuple[int, ...], key: str) -> None:
    if plan.pools is not None:  # a cluster of pools has no sites to order
        plan = plan.replace(pool_dp=None, pool_pp=None, pools=None, dp_shares=None)
    plan = plan.replace(site_order=sites)
    assert plan.site_order == sites and plan.dims.sites == sites  # kept in order too: its count is checked
    text = plan.short()
    assert parse_plan(text) == plan and parse_plan(text).short() == text
    assert "site_order=" + ":".join(map(str, sites)) in text
    assert parse_plan(f"{plan.replace(site_order=None).short()},{key}={':'.join(map(str, sites))}") == plan
    d = to_dict(plan)
    assert d["site_order"] == list(sites)
    assert from_dict(Plan, json.loads(json.dumps(d))) == plan
    doc = plan_document(plan, model="llama3-8b", global_batch=64)
    tmp = tmp_path_factory.mktemp("sites")
    for suffix, body in (("json", json.dumps(doc, indent=2)), ("toml", dump_toml(doc))):
        path = tmp / f"plan.{suffix}"
        path.write_text(body)
        assert load_plan(str(path)) == plan


@pytest.mark.parametrize("bad,match", [("1:1:2", "not a permutation"), ("1:2:3", "not a permutation"),
                                       ("a:0", "whole numbers"), ("-1:0", "whole numbers")])
def test_bad_site_orders_are_one_line_errors(bad: str, match: str) -> None:
    with pytest.raises(MeshplanError, match=match):
        parse_plan(f"tp=8,pp=3,dp=4,site_order={bad}")
    with pytest.raises(MeshplanError, match="site_order with pools"):
        parse_plan("tp=8,pp=3,dp=4,pools=a:b,site_order=1:0")


@pytest.mark.parametrize("plan,match", [
    ("tp=8,pp=3,dp=4,site_order=1:0", "names 2 sites but the cluster has 3"),
    ("tp=8,pp=1,dp=12,site_order=1:0:2", "every pipeline stage inside one site"),
    ("tp=8,pp=3,dp=4,mesh_order=dp:pp:cp:tp,site_order=1:0:2", "every pipeline stage inside one site"),
])
def test_site_orders_the_cost_model_cannot_price_are_refused(plan: str, match: str) -> None:
    m, c = load_model("llama3-8b"), load_cluster(THREE)
    w = Workload(global_batch=96, seq_len=4096)
    p = parse_plan(plan + ("" if "pp=1" in plan else ",stage_layers=11:11:10"))
    assert any(match in why for _, why in violations(m, c, p, w))
    with pytest.raises(MeshplanError, match=match):
        estimate(m, c, p, w)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]),
       st.sampled_from(list(itertools.permutations(AXES))), st.data())
def test_rank_grid_under_a_site_order_moves_whole_sites(pp, dp, cp, tp, order, data) -> None:
    world = pp * dp * cp * tp
    k = data.draw(st.sampled_from([d for d in (2, 3, 4, 6) if world % d == 0] or [1]))
    sites = tuple(data.draw(st.permutations(range(k))))
    base = ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, order=order)
    dims = ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, order=order, sites=sites)
    g0, g = base.rank_grid(), dims.rank_grid()
    assert sorted(g.ravel().tolist()) == list(range(world))  # each rank once
    block = world // k
    assert (g % block == g0 % block).all()  # offsets inside a site (and so nodes) kept
    assert (g // block == np.asarray(sites)[g0 // block]).all()  # block k on site sites[k]
    for idx in itertools.product(*(range(n) for n in g.shape)):
        r = int(g[idx])
        assert dims.rank(*idx) == r and tuple(dims.coords(r).values()) == idx
    # dp and tp groups: the same members (by offset) in one site, wherever they lay in one under the default
    for axis in (1, 3):
        a0 = np.moveaxis(g0, axis, -1).reshape(-1, g.shape[axis])
        a = np.moveaxis(g, axis, -1).reshape(-1, g.shape[axis])
        one0 = (a0 // block == a0[:, :1] // block).all(axis=1)
        one = (a // block == a[:, :1] // block).all(axis=1)
        assert (one == one0).all()
    if site_order_fault(dims, k) is None:  # the pipeline the only axis across the sites
        per_stage = g.reshape(pp, -1) // block
        assert (per_stage == per_stage[:, :1]).all()


PLANS3 = ["tp=8,pp=3,dp=4,micro_batch=1,stage_layers=11:11:10",
          "tp=4,pp=6,dp=4,zero=1,micro_batch=2,schedule=gpipe,stage_layers=6:6:6:6:4:4",
          "tp=2,pp=12,dp=4,micro_batch=1,virtual_stages=2,schedule=interleaved-1f1b,stage_layers=4x4:2x8"]


@settings(max_examples=18, deadline=None)
@given(st.sampled_from(PLANS3), st.sampled_from(PERMS3))
def test_compute_and_memory_do_not_change_under_any_site_order(text: str, sites: tuple[int, ...]) -> None:
    m, c = load_model("llama3-8b"), load_cluster(THREE)
    w = Workload(global_batch=192, seq_len=4096)
    p0 = parse_plan(text)
    r0, r = estimate(m, c, p0, w), estimate(m, c, p0.replace(site_order=sites), w)
    assert r.peak_memory_gib == r0.peak_memory_gib and r.fits == r0.fits
    assert r.memory == r0.memory and r.memory_per_stage == r0.memory_per_stage
    # the work per GPU (model and hardware FLOPs) is the same; only the time it takes may change
    assert r.tflops_per_gpu * r.step_time_s == pytest.approx(r0.tflops_per_gpu * r0.step_time_s, rel=1e-12)
    assert r.hfu * r.step_time_s == pytest.approx(r0.hfu * r0.step_time_s, rel=1e-12)
    assert r.cross_site_gb == r0.cross_site_gb  # as many pairs cross sites, in any order
    if p0.virtual_stages == 1:  # (interleaved: the critical rank, whose terms are reported, may move)
        for k in ("compute", "recompute", "tp_comm", "dp_comm", "offload"):
            assert r.time.get(k, 0.0) == r0.time.get(k, 0.0), k
    if sites == (0, 1, 2):
        assert r.step_time_s == r0.step_time_s  # the identity is the default, bit for bit


def test_pipeline_boundaries_follow_the_site_order() -> None:
    c = load_cluster(THREE)
    sizes = {"pp": 3, "dp": 4, "cp": 1, "tp": 8}
    for sites in PERMS3:
        bw, lat = pipeline_links(c, sizes, None, True, None if sites == (0, 1, 2) else sites)
        links = [c.site_link(sites[j], sites[(j + 1) % 3]) for j in range(3)]
        assert all(bw[j] <= t.bytes_per_s and lat[j] == pytest.approx(t.latency_us * 1e-6) for j, t in enumerate(links))
        share = [bw[j] / t.bytes_per_s for j, t in enumerate(links)]  # (a shared link: the same share of each)
        assert share == pytest.approx([share[0]] * 3)
    assert (pipeline_links(c, sizes, None, True, None)[0] == pipeline_links(c, sizes, None, True, (0, 1, 2))[0]).all()
    # the pipeline visiting 1, 0, 2 avoids the slowest pair (1-2) but for the wrap: its slowest boundary is 0-2
    own = pipeline_links(c, sizes, None, False, None)[0][:2]
    bw = pipeline_links(c, sizes, None, False, (1, 0, 2))[0][:2]
    assert bw.min() / own.min() == pytest.approx(c.site_link(0, 2).bytes_per_s / c.site_link(1, 2).bytes_per_s)


def test_vectorised_site_order_check_equals_the_scalar_one() -> None:
    m, c = load_model("llama3-8b"), load_cluster(THREE)
    w = Workload(global_batch=96, seq_len=4096)
    plans_ = [parse_plan(f"tp=8,pp={pp},dp={12 // pp},micro_batch=1{mo}{so}")
              for pp in (1, 2, 3, 6, 12) for mo in ("", ",mesh_order=dp:pp:cp:tp", ",mesh_order=pp:tp:cp:dp")
              for so in ("", ",site_order=1:0:2", ",site_order=2:1:0", ",site_order=1:0")]
    masks = violation_masks(m, c, w, PlanColumns.from_plans(plans_))
    for i, p in enumerate(plans_):
        want = site_order_fault(p.dims, c.num_dcs) is not None
        assert bool(masks["invalid site order"][i]) == want, p.short()
    assert masks["invalid site order"].any() and not masks["invalid site order"].all()


def test_search_keeps_the_pipeline_off_the_slowest_pair() -> None:
    """Pipeline across the sites (the default mesh order): the winner's slowest boundary between
    sites is the fastest any site order gives for its mesh, and it never crosses the 1-2 pair
    (2.5 Gb/s) without a wrap."""
    from meshplan.search import search
    from meshplan.search.explain import pipeline_site_crossings, placement_lines
    m, c = load_model("llama3-8b"), load_cluster(THREE)
    w = Workload(global_batch=192, seq_len=4096)
    r = search(m, c, w, SearchSpace(tp=(8,), pp=(3, 6), placements=(None,)), top=3)
    p = r.best.plan
    wrap = p.virtual_stages > 1 and p.schedule != "zbv"
    sizes = {a: p.dims.degree(a) for a in AXES}
    used = slice(None) if wrap else slice(0, p.pp - 1)
    mine = pipeline_links(c, sizes, None, wrap, p.site_order)[0][used].min()
    best = max(pipeline_links(c, sizes, None, wrap, None if s == (0, 1, 2) else s)[0][used].min() for s in PERMS3)
    assert mine == best
    if not wrap:
        assert p.site_order is not None
        assert all({a, b} != {1, 2} for _, a, b in pipeline_site_crossings(c, p, wrap))
    text = "\n".join(placement_lines(r))
    assert "pipeline across sites" in text and "vs the sites in their own order" in text


@pytest.mark.parametrize("name", ["h100-sxm-80gb:64", "two-dc-h100"])
def test_no_site_orders_on_one_or_two_sites(name: str) -> None:
    m, c = load_model("llama3-8b"), load_cluster(name)
    w = Workload(global_batch=256, seq_len=4096)
    space = SearchSpace(tp=(8,))
    for pp in (2, 4, 8):
        sizes = {"pp": pp, "dp": c.num_gpus // (8 * pp), "cp": 1, "tp": 8}
        assert site_order_options(c, space, sizes, None) == [(None, True, True)]
    cols = enumerate_space(m, c, w, space)
    assert not np.asarray(cols["site_order"]).any()


def test_three_sites_try_site_orders_in_the_enumeration() -> None:
    m, c = load_model("llama3-8b"), load_cluster(THREE)
    w = Workload(global_batch=192, seq_len=4096)
    cols = enumerate_space(m, c, w, SearchSpace(tp=(8,), pp=(3,), placements=(None,)))
    assert {"", "1:0:2", "2:0:1"} <= set(np.asarray(cols["site_order"]).tolist())


def test_estimate_names_the_site_pairs_the_pipeline_crosses(capsys) -> None:
    from clirun import run
    rc, out, err = run(capsys, "estimate", "--model", "llama3-8b", "--cluster", THREE, "--plan",
                       "tp=8,pp=3,dp=4,micro_batch=1,stage_layers=11:11:10,site_order=1:0:2",
                       "--global-batch", "96", "--seq-len", "4096")
    assert rc == 0, err
    assert "pipeline across sites (site_order=1:0:2): boundaries on 1->0" in out and "0->2" in out
