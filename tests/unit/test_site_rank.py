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


# ---- two nodes given one node rank (issue 26): refused at once, not after the process-group timeout ------------
def test_a_second_launcher_of_one_node_rank_on_this_host_is_refused_in_the_pre_flight(tmp_path, monkeypatch):
    """preflight.node_lock: one launcher per (rendezvous, node rank) on a host; the second is refused in one line,
    naming the first; once the first ends, the node rank is free again."""
    import tempfile

    from meshplan.runtime.preflight import node_lock
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with node_lock("127.0.0.1:29500", 0, "--site 1"):
        with pytest.raises(MeshplanError, match=r"--site 1: node rank 0 of the rendezvous at 127.0.0.1:29500 is "
                                                r"already held .*\(pid \d+, --site 1\)") as e:
            with node_lock("127.0.0.1:29500", 0, "--site 1"):
                pass
        assert "\n" not in e.value.message
        with node_lock("127.0.0.1:29500", 1, "--site 0"):  # another node rank, another rendezvous: free
            pass
        with node_lock("127.0.0.1:29501", 0, "--site 1"):
            pass
    with node_lock("127.0.0.1:29500", 0, "--site 1"):  # released
        pass


def _claims(ranks, world, per_node, timeout_s=20.0):
    """claim_rank in one thread per process (``ranks``: the global rank each claims) on one store; what each raised."""
    import threading

    import torch.distributed as dist

    from meshplan.runtime.train import claim_rank
    store = dist.HashStore()
    out = [None] * len(ranks)

    def one(i, r):
        try:
            claim_rank(store, r, world, per_node, f"host{i} pid {100 + i}, --site {i // per_node}", timeout_s, "t")
        except MeshplanError as e:
            out[i] = e
    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_two_nodes_with_one_node_rank_fail_at_the_ranks_check():
    """train.claim_rank: every process of both nodes raises the same one line naming both holders and the node rank
    nobody holds; distinct ranks pass."""
    import time
    t0 = time.perf_counter()
    got = _claims([0, 1, 0, 1], world=4, per_node=2)
    assert time.perf_counter() - t0 < 10
    assert all(e is not None for e in got)
    msg = got[0].message
    assert "two nodes took node rank 0" in msg and "node rank 1 none" in msg and "--site 0" in msg
    assert ("host0 pid 100" in msg and "host2 pid 102" in msg) or ("host1 pid 101" in msg and "host3 pid 103" in msg)
    assert {e.message for e in got} == {msg} and "\n" not in msg
    assert _claims([2, 0, 3, 1], world=4, per_node=2) == [None] * 4


def test_a_process_that_never_claims_gives_a_clear_error_after_the_timeout():
    got = _claims([0, 1, 2], world=4, per_node=2, timeout_s=1.0)
    assert all(e is not None and "only 3 of the 4 processes reached the ranks' check" in e.message for e in got)
