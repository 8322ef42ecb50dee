"""meshplan train --site / --site-node: the node rank that realises a plan's site order (issue 26)."""
from __future__ import annotations

import argparse
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cli.train_cmd import resolve_site, site_node_rank
from meshplan.errors import MeshplanError
from meshplan.spec.axes import ParallelDims
from meshplan.spec.plan import parse_plan


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(4)).flatmap(lambda p: st.tuples(st.integers(1, len(p)), st.just(p))),
       st.integers(1, 3))
def test_site_blocks_are_the_plan_s_blocks(sites_spec, per):
    """Every (site, node) gets a different node rank, and the nodes of site site_order[k] are exactly the
    k-th block of node ranks: the block whose global ranks the plan's rank grid (with its site order)
    puts on site site_order[k]'s devices."""
    m, perm = sites_spec
    order = tuple(p for p in perm if p < m)
    plan = parse_plan(f"pp={m},tp=2,site_order={':'.join(map(str, order))}")
    nnodes = m * per
    got = {(s, i): site_node_rank(plan, nnodes, s, i)[0] for s in range(m) for i in range(per)}
    assert sorted(got.values()) == list(range(nnodes))
    grid = ParallelDims.of(plan).rank_grid().reshape(m, -1)  # stage k's devices (cluster order)
    devices_per_site = grid.size // m
    for (s, i), rank in got.items():
        k = rank // per
        assert order[k] == s
        assert set((grid[k] // devices_per_site).tolist()) == {s}  # stage k runs on site s's devices


def _args(**kw):
    base = dict(site=None, site_node=None, node_rank=None, nnodes=2, nodes_per_dc=None, nproc_per_node=2)
    base.update(kw)
    return argparse.Namespace(**base)


def test_resolve_site_sets_and_prints(capsys):
    plan = parse_plan("pp=2,tp=2,site_order=1:0")
    a = _args(site=1)
    resolve_site(a, plan)
    assert a.node_rank == 0
    assert "site 1 node 0 (of 1 per site) -> node rank 0 of 2, global ranks 0-1" in capsys.readouterr().err
    b = _args(site=0)
    resolve_site(b, plan)
    assert b.node_rank == 1
    c = _args()
    resolve_site(c, plan)  # no --site: --node-rank as given (default 0)
    assert c.node_rank == 0


@pytest.mark.parametrize("kw,plan,match", [
    (dict(site=1), "pp=2,tp=2", "has no site_order"),
    (dict(site=2), "pp=2,tp=2,site_order=1:0", "has sites 0..1"),
    (dict(site=1, node_rank=1), "pp=2,tp=2,site_order=1:0", "disagrees"),
    (dict(site=1, nnodes=3), "pp=2,tp=2,site_order=1:0", "not a multiple"),
    (dict(site=1, nnodes=4), "pp=2,tp=2,site_order=1:0", "--site-node"),
    (dict(site=1, nnodes=4, site_node=2), "pp=2,tp=2,site_order=1:0", "each site has 2"),
    (dict(site=1, nnodes=4, site_node=0, nodes_per_dc=1), "pp=2,tp=2,site_order=1:0", "nodes per site"),
    (dict(site_node=0), "pp=2,tp=2,site_order=1:0", "needs --site"),
])
def test_inconsistent_site_input_is_refused(kw, plan, match):
    with pytest.raises(MeshplanError, match=match):
        resolve_site(_args(**kw), parse_plan(plan), quiet=True)


def test_every_node_of_two_per_site():
    plan = parse_plan("pp=4,tp=2,site_order=1:0")
    ranks = {(s, i): site_node_rank(plan, 4, s, i)[0] for s, i in itertools.product(range(2), range(2))}
    assert ranks == {(1, 0): 0, (1, 1): 1, (0, 0): 2, (0, 1): 3}
