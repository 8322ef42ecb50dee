"""The placement (plan field mesh_order) in `meshplan train`: 2 emulated nodes x 2 processes (two
launchers sharing a c10d rendezvous on this machine), gloo, tiny-llama in fp32.

A permuted placement moves which global ranks form each process group, never what a mesh
coordinate computes: each (pp, dp, cp, tp) coordinate reads the same rows and holds the same
shard, so the losses equal the default placement's. Tolerance: exactly equal. Every group here
has two members and every reduction sums their values in the group's coordinate order (group
rank i = coordinate i under both placements); a sum of two fp32 values does not depend on
their order (IEEE 754 addition is commutative), so no reduction can round differently.

The groups: every rank writes the global ranks of each of its process groups (runtime/mesh.py,
MESHPLAN_MESH_GROUPS) and they must be the ones ParallelDims.rank_grid names for the plan.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, metric_losses, run_env

from meshplan.spec.axes import AX, AXES, ParallelDims
from meshplan.spec.plan import parse_plan

pytest.importorskip("torch")

COMMON = ["--model", "tiny-llama", "--global-batch", "8", "--seq-len", "32", "--pg-timeout", "60",
          "--steps", "3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_two_nodes(tmp: Path, name: str, plan: str) -> tuple[list[float], dict[int, dict]]:
    """(per-step losses, {rank: its groups and coordinates}) of `meshplan train --plan PLAN` on
    2 nodes of 2 processes."""
    port, m, groups = free_port(), tmp / f"{name}.jsonl", tmp / f"{name}.groups"
    cmd = [sys.executable, "-m", "meshplan.cli.train_cmd", *COMMON, "--nproc-per-node", "2", "--nnodes", "2",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--plan", plan, "--metrics", str(m)]
    env = run_env(MESHPLAN_MESH_GROUPS=str(groups))
    procs = [subprocess.Popen([*cmd, "--node-rank", str(r)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    ranks = {int(json.loads(f.read_text())["rank"]): json.loads(f.read_text()) for f in groups.glob("rank*.json")}
    assert sorted(ranks) == [0, 1, 2, 3]
    return metric_losses(m), ranks


def expected_groups(plan_text: str, rank: int) -> dict[str, list[int]]:
    """The global ranks of ``rank``'s group on each axis, read from the plan's rank grid."""
    dims = ParallelDims.of(parse_plan(plan_text))
    grid, at = dims.rank_grid(), dims.coords(rank)
    out = {}
    for i, a in enumerate(AXES):
        idx = tuple(slice(None) if j == i else at[b] for j, b in enumerate(AXES))
        out[f"world.{a}"] = sorted(int(r) for r in np.asarray(grid[idx]).ravel())
    dp_cp = grid[at[AX.PP], :, :, at[AX.TP]]
    out[AX.DP_CP] = sorted(int(r) for r in dp_cp.ravel())
    return out


def check_groups(plan_text: str, ranks: dict[int, dict]) -> None:
    dims = ParallelDims.of(parse_plan(plan_text))
    for rank, doc in ranks.items():
        want = expected_groups(plan_text, rank)
        got = {k: doc["groups"][k] for k in want}
        assert got == want, (plan_text, rank, got, want)
        assert doc["coords"] == dims.coords(rank), (plan_text, rank)
        assert doc["groups"]["sync"] == want[AX.DP_CP]  # synchronous: gradients averaged over all of dp x cp


@pytest.mark.parametrize("plan,order,moved", [
    # by default the tp pairs sit inside a node and the pipeline crosses the nodes; tp outermost puts
    # the tp pairs across the nodes and the pipeline inside them
    ("tp=2,pp=2,precision=fp32", "tp:pp:dp:cp", {"world.tp": [0, 2], "world.pp": [0, 1]}),
    # dp x tp: data parallel inside the node, tensor parallel across the nodes
    ("tp=2,dp=2,zero=1,precision=fp32", "tp:dp:pp:cp", {"world.tp": [0, 2], "world.dp": [0, 1]}),
])
def test_permuted_placement_trains_as_the_default(tmp_path: Path, plan: str, order: str,
                                                  moved: dict[str, list[int]]) -> None:
    base_losses, base_ranks = train_two_nodes(tmp_path, "default", plan)
    permuted = f"{plan},mesh_order={order}"
    got_losses, got_ranks = train_two_nodes(tmp_path, "permuted", permuted)
    check_groups(plan, base_ranks)
    check_groups(permuted, got_ranks)
    for key, members in moved.items():  # the placement really regrouped rank 0
        assert got_ranks[0]["groups"][key] == members and base_ranks[0]["groups"][key] != members, key
    assert len(base_losses) == 3 and all(np.isfinite(base_losses))
    assert got_losses == base_losses  # exactly (module docstring)



def test_site_order_trains_as_the_default(tmp_path: Path) -> None:
    """A site order (site_order=1:0: the two emulated nodes as two sites) is realised at launch (the
    nodes of site 1 take the first node ranks: runtime/mesh.py root_mesh), so the global ranks form
    the default placement's groups and train as it does; the plan's rank grid names, for each rank,
    the device of the other node (its stage's block moved whole)."""
    plan = "tp=2,pp=2,precision=fp32"
    base_losses, base_ranks = train_two_nodes(tmp_path, "default", plan)
    moved = f"{plan},site_order=1:0"
    got_losses, got_ranks = train_two_nodes(tmp_path, "sites", moved)
    check_groups(plan, base_ranks)
    check_groups(plan, got_ranks)
    grid = ParallelDims.of(parse_plan(moved)).rank_grid()
    assert grid[0].ravel().tolist() == [2, 3] and grid[1].ravel().tolist() == [0, 1]
    assert len(base_losses) == 3 and all(np.isfinite(base_losses))
    assert got_losses == base_losses


def test_site_flag_realises_the_site_order(tmp_path: Path) -> None:
    """`meshplan train --site S` (no --node-rank) on a plan with site_order=1:0: the launcher of site 1
    takes node rank 0 and says so, each rank runs the coordinates the plan's rank grid (with the site
    order) names for its device (site S's devices are S x 2 onwards, in cluster order), and the
    losses are the default placement's. Each emulated node writes its groups to its own folder, so
    the test knows which node (site) every global rank ran on."""
    plan = "tp=2,pp=2,precision=fp32"
    base_losses, base_ranks = train_two_nodes(tmp_path, "default", plan)
    moved = f"{plan},site_order=1:0"
    port, m = free_port(), tmp_path / "site.jsonl"
    cmd = [sys.executable, "-m", "meshplan.cli.train_cmd", *COMMON, "--nproc-per-node", "2", "--nnodes", "2",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--plan", moved]
    procs = {}
    for site in (0, 1):
        env = run_env(MESHPLAN_MESH_GROUPS=str(tmp_path / f"site{site}"))
        metrics = ["--metrics", str(m)] if site == 1 else []  # the node holding global rank 0 writes them
        procs[site] = subprocess.Popen([*cmd, "--site", str(site), *metrics], env=env, cwd=ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {s: p.communicate(timeout=240) for s, p in procs.items()}
    for s, p in procs.items():
        assert p.returncode == 0, outs[s][1][-4000:]
    assert "site 1 node 0 (of 1 per site) -> node rank 0 of 2, global ranks 0-1" in outs[1][1]
    assert "site 0 node 0 (of 1 per site) -> node rank 1 of 2, global ranks 2-3" in outs[0][1]
    sites_dims = ParallelDims.of(parse_plan(moved))
    ranks = {}
    for site in (0, 1):
        docs = [json.loads(f.read_text()) for f in (tmp_path / f"site{site}").glob("rank*.json")]
        assert sorted(d["rank"] for d in docs) == ([2, 3] if site == 0 else [0, 1])
        for d in docs:
            device = site * 2 + d["rank"] % 2  # this node's devices in the cluster's order
            assert d["coords"] == sites_dims.coords(device), (site, d)  # what the plan names for it
            ranks[int(d["rank"])] = d
    check_groups(plan, ranks)  # the groups are the default placement's
    assert got_losses_equal(metric_losses(m), base_losses)


def got_losses_equal(got: list[float], base: list[float]) -> bool:
    return len(base) == 3 and all(np.isfinite(base)) and got == base  # exactly (module docstring)


def test_two_nodes_given_the_same_site_fail_fast(tmp_path: Path) -> None:
    """Two nodes started with the same --site (issue 26; both map to node rank 0). On one host the second launcher
    is refused by the pre-flight at once (preflight.node_lock). On two hosts (emulated here by separate temporary
    folders, so that the lock does not see the other) both reach torchrun, and every rank fails at the ranks' check
    (train.claim_rank) in seconds, in one line naming the node rank, instead of waiting out --pg-timeout 60."""
    import time
    moved = "tp=2,pp=2,precision=fp32,site_order=1:0"
    port = free_port()
    cmd = [sys.executable, "-m", "meshplan.cli.train_cmd", *COMMON, "--nproc-per-node", "2", "--nnodes", "2",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--plan", moved, "--site", "1"]
    first = subprocess.Popen(cmd, env=run_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # its own process group: the launcher and its torchrun
    try:
        time.sleep(8)  # the first launcher holds node rank 0 (it waits for the second node at the rendezvous)
        second = subprocess.run(cmd, env=run_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        line = [x for x in second.stderr.splitlines() if "error" in x]
        assert line and "--site 1: node rank 0 of the rendezvous" in line[0] and "already held" in line[0], \
            second.stderr[-2000:]
    finally:
        import os
        import signal
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    port = free_port()
    cmd[cmd.index("--rdzv-endpoint") + 1] = f"127.0.0.1:{port}"
    t0 = time.perf_counter()
    procs = []
    for k in range(2):
        tmp = tmp_path / f"tmp{k}"
        tmp.mkdir()
        procs.append(subprocess.Popen(cmd, env=run_env(TMPDIR=str(tmp)), cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    took = time.perf_counter() - t0
    assert all(p.returncode != 0 for p in procs)
    err = "\n".join(e for _, e in outs)
    assert "two nodes took node rank 0" in err and "node rank 1 none" in err, err[-4000:]
    assert took < 50, took  # not the 60 s process-group timeout
