"""Mixed GPU pools (spec.cluster.PooledCluster, cost.pools, search.pools, sim.pools, report.pools)
and uneven data-parallel shares. GPU pools are emulated: the cost model and the simulator time
every rank on its own pool's GPU; nothing here runs on a GPU."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cli.main import main
from meshplan.cost import estimate
from meshplan.cost.pools import estimate_pooled, pool_cluster, replica_samples
from meshplan.errors import MeshplanError
from meshplan.search import search
from meshplan.search.pools import _best_split
from meshplan.sim.pools import simulate_pooled
from meshplan.spec.cluster import PooledCluster
from meshplan.spec.io import cluster_from_dict, load_cluster, load_model, load_plan
from meshplan.spec.plan import Workload, parse_plan
from meshplan.spec.transformer import as_graph

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "docs" / "examples" / "a100-h100-pools.toml")
SMALL_SPACE = ["--fix", "tp=4,cp=1,zero=0,recompute=op"]  # a small search where the command line is the point
LONG_SPACE = ["--fix", "tp=4,cp=1,zero=0,recompute=full"]
"""The same at 32k-token sequences: with recompute=op a pool of 4 GPUs holds llama3-8b only at risk
of running out of memory once reserved memory (allocator, CUDA context, NCCL) is counted."""


def _small_example(tmp_path: Path) -> str:
    """The worked example's two pools (h100, a100) and links at one node of 4 GPUs each: the tests of
    paths, plan files and output use it; the search at full size is checked on EXAMPLE itself."""
    text = Path(EXAMPLE).read_text().replace("num_nodes = 8", "num_nodes = 1").replace("gpus_per_node = 8",
                                                                                    "gpus_per_node = 4")
    path = tmp_path / "pools.toml"
    path.write_text(text)
    return str(path)


def _pools(gpu_a: str = "h100-sxm-80gb", gpu_b: str = "a100-sxm-80gb", nodes: int = 2, inter: float = 25.0,
           latency: float = 8.0) -> PooledCluster:
    return cluster_from_dict({"name": "mix", "pools": [
        {"name": "a", "gpu": gpu_a, "num_nodes": nodes, "gpus_per_node": 8},
        {"name": "b", "gpu": gpu_b, "num_nodes": nodes, "gpus_per_node": 8}],
        "inter_pool": {"bandwidth_gbps": inter, "latency_us": latency}})  # type: ignore[return-value]


@pytest.fixture(scope="module")
def llama8b():
    return as_graph(load_model("llama3-8b"), 4096)


def test_cluster_file_loads_pools_with_their_own_links():
    c = load_cluster(EXAMPLE)
    assert isinstance(c, PooledCluster) and c.names == ("h100", "a100") and c.num_gpus == 128
    assert c.pool("h100").inter_node.bandwidth_gbps == 50 and c.pool("a100").inter_node.bandwidth_gbps == 25
    assert c.inter_pool.bandwidth_gbps == 25 and c.inter_pool.name == "inter_pool"


@pytest.mark.parametrize("data, words", [
    ({"pools": [{"name": "a", "gpu": "h100-sxm-80gb", "num_nodes": 1},
                {"name": "a", "gpu": "a100-sxm-80gb", "num_nodes": 1}]}, "used twice"),
    ({"pools": [{"gpu": "h100-sxm-80gb", "num_nodes": 1}, {"name": "b", "gpu": "a100-sxm-80gb", "num_nodes": 1}]},
     "needs a name"),
    ({"gpu": "h100-sxm-80gb", "pools": [{"name": "a", "gpu": "h100-sxm-80gb", "num_nodes": 1},
                                        {"name": "b", "gpu": "a100-sxm-80gb", "num_nodes": 1}]}, "inside each"),
    ({"pools": "h100"}, "list of tables"),
])
def test_bad_pooled_cluster_files_say_what_is_wrong(data, words):
    with pytest.raises(MeshplanError, match=words):
        cluster_from_dict(data, where="mix.toml")


@pytest.mark.parametrize("text, words", [
    ("dp=3,dp_shares=3:1", "does not divide"),
    ("dp=2,pools=a:b,pool_dp=1:2", "sums to 3"),
    ("pp=2,dp=2,pools=a:b,pool_dp=1:1,pool_pp=1:1", "not both"),
    ("dp=2,pool_dp=1:1", "needs pools"),
    ("dp=2,pools=a:a,pool_dp=1:1", "twice"),
    ("dp=2,dp_shares=x:1", "not a whole number"),
])
def test_bad_plan_fields(text, words):
    with pytest.raises(MeshplanError, match=words):
        parse_plan(text)


def test_one_pool_alone_is_the_plain_estimate_on_that_pool(llama8b):
    c = _pools()
    w = Workload(global_batch=64, seq_len=4096)
    plan = parse_plan("tp=2,dp=8,zero=3,micro_batch=1,pools=a")
    e = estimate_pooled(llama8b, c, plan, w)
    ref = estimate(llama8b, pool_cluster(c.pool("a"), 16), plan.replace(pools=None), w)
    assert e.step_time_s == pytest.approx(ref.step_time_s, rel=1e-12) and e.cross_pool_s == 0
    assert e.parts[0].gpus == 16 and e.imbalance_s == 0


def test_identical_pools_split_as_pipeline_equal_one_cluster(llama8b):
    """Two pools of the same GPU whose inter_pool link is their inter-node link: a pipeline over them
    is the same plan on one cluster (every spliced term is the same, the boundary send costs the same)."""
    c = _pools("h100-sxm-80gb", "h100-sxm-80gb", inter=50.0, latency=8.0)
    w = Workload(global_batch=64, seq_len=4096)
    plan = parse_plan("tp=4,pp=4,dp=2,micro_batch=1,stage_layers=10:8:8:6,pools=a:b,pool_pp=2:2")
    e = estimate_pooled(llama8b, c, plan, w)
    ref = estimate(llama8b, pool_cluster(c.pool("a"), 32), plan.replace(pools=None, pool_pp=None), w)
    assert e.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9)


def test_a_slower_pool_slows_its_stages_and_its_replicas(llama8b):
    w = Workload(global_batch=64, seq_len=4096)
    same, mixed = _pools("h100-sxm-80gb", "h100-sxm-80gb"), _pools()
    for text in ("tp=4,pp=4,dp=2,micro_batch=1,pools=a:b,pool_pp=2:2",
                 "tp=4,pp=2,dp=4,micro_batch=1,pools=a:b,pool_dp=2:2"):
        plan = parse_plan(text)
        fast, slow = estimate_pooled(llama8b, same, plan, w), estimate_pooled(llama8b, mixed, plan, w)
        assert slow.step_time_s > fast.step_time_s
        assert slow.parts[1].step_s > slow.parts[0].step_s  # the A100 pool's part is the slower one
        assert slow.parts[0].idle_s > 0 and slow.imbalance_s > 0


def test_shares_move_work_to_the_faster_pool(llama8b):
    c = _pools()
    w = Workload(global_batch=64, seq_len=4096)
    even = estimate_pooled(llama8b, c, parse_plan("tp=4,pp=2,dp=4,micro_batch=1,pools=a:b,pool_dp=2:2"), w)
    uneven = estimate_pooled(llama8b, c, parse_plan(
        "tp=4,pp=2,dp=4,micro_batch=1,dp_shares=5:3,pools=a:b,pool_dp=2:2"), w)
    assert uneven.step_time_s < even.step_time_s
    assert [p.role.split(",")[1].strip().split()[0] for p in uneven.parts] == ["20", "12"]  # micro-batches each


def test_replica_samples_and_refusals():
    assert replica_samples(parse_plan("dp=4,dp_shares=3:1,micro_batch=2"), 32) == [12, 12, 4, 4]
    with pytest.raises(MeshplanError, match="whole micro-batches"):
        replica_samples(parse_plan("dp=2,dp_shares=3:1,micro_batch=2"), 4)  # 3 and 1 samples: not whole mbs
    with pytest.raises(MeshplanError, match="whole micro-batches"):
        replica_samples(parse_plan("dp=2,dp_shares=2:1"), 8)


def test_uneven_shares_on_one_gpu_type_cost_the_largest_share(llama8b):
    c = load_cluster("h100-sxm-80gb:16")
    w = Workload(global_batch=32, seq_len=4096)
    even = estimate(llama8b, c, parse_plan("tp=8,dp=2,micro_batch=1"), w)
    uneven = estimate(llama8b, c, parse_plan("tp=8,dp=2,micro_batch=1,dp_shares=3:1"), w)
    assert uneven.step_time_s > even.step_time_s and uneven.microbatches == 24
    assert uneven.tokens_per_s == pytest.approx(w.tokens / uneven.step_time_s)
    assert any("uneven dp_shares" in n for n in uneven.notes)
    with pytest.raises(MeshplanError, match="one GPU"):
        estimate(llama8b, c, parse_plan("tp=8,dp=2,pools=a:b,pool_dp=1:1"), w)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=3), st.integers(8, 40),
       st.lists(st.tuples(st.floats(0, 5), st.floats(0.01, 3)), min_size=3, max_size=3))
def test_best_split_is_optimal(n, M, lines):
    """The integer split of the micro-batches is the best of all splits (brute force)."""
    import itertools
    lines = lines[:len(n)]
    got = _best_split(n, M, lines)
    best = math.inf
    for ms in itertools.product(*(range(1, M // k + 1) for k in n)):
        if sum(a * b for a, b in zip(n, ms)) == M:
            best = min(best, max(a + b * m for (a, b), m in zip(lines, ms)))
    if best == math.inf:
        assert got is None
    else:
        assert sum(a * b for a, b in zip(n, got)) == M
        assert max(a + b * m for (a, b), m in zip(lines, got)) == pytest.approx(best)


@pytest.mark.parametrize("text", [
    "tp=4,pp=2,dp=4,micro_batch=1,dp_shares=5:3,pools=a:b,pool_dp=2:2",
    "tp=4,pp=4,dp=2,micro_batch=1,stage_layers=10:10:6:6,pools=a:b,pool_pp=2:2",
    "tp=2,pp=4,dp=2,cp=2,zero=3,micro_batch=1,stage_layers=9:9:7:7,pools=a:b,pool_pp=2:2",
])
def test_simulator_times_every_rank_on_its_pool_like_the_cost_model(llama8b, text):
    c = _pools()
    w = Workload(global_batch=64, seq_len=4096)
    sim = simulate_pooled(llama8b, c, parse_plan(text), w)
    assert sim.step_time_s == pytest.approx(sim.analytic_step_time_s, rel=0.03)
    assert {p.name for p in sim.pools} == {"a", "b"}
    assert sum(len(p.ranks) for p in sim.pools) == sim.result.pp


@pytest.mark.slow  # the worked example at full size; the small searches below check the parts
def test_done_when_two_pools_beat_the_h100_pool_alone():
    """Issue 16: 8x8 A100-80GB + 8x8 H100, Llama 3 70B, global batch 512 x 4096: the plan uses both
    pools and is predicted faster than the best plan on the H100 pool alone."""
    c = load_cluster(EXAMPLE)
    w = Workload(global_batch=512, seq_len=4096)
    r = search(load_model("llama3-70b"), c, w)
    best, h100 = r.best_pooled, r.alone["h100"]
    assert best is not None and h100 is not None and best.plan.multi_pool
    assert set(best.plan.pools) == {"h100", "a100"} and best.step_time_s < 0.9 * h100.step_time_s
    assert best.fits and not best.at_risk
    assert any("vs h100 alone" in line and "faster" in line for line in r.explanation)
    assert r.best_by_kind["replicas on pools"] is not None and r.best_by_kind["stages on pools"] is not None


def test_a_weak_link_between_pools_keeps_one_pool_and_says_why(tmp_path):
    c = load_cluster(_small_example(tmp_path))
    slow = PooledCluster(name="slow", pools=c.pools, inter_pool=c.inter_pool.__class__(
        name="inter_pool", bandwidth_gbps=0.05, latency_us=20000.0))
    r = search(load_model("tiny-llama"), slow, Workload(global_batch=16, seq_len=256))
    best = r.best_pooled
    assert best is not None and not best.plan.multi_pool and best.plan.pools == ("h100",)
    assert r.best_multi is not None and r.best_multi.step_time_s > best.step_time_s
    assert any("slower" in line for line in r.explanation)


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_plan_estimate_simulate_report_on_pools(capsys, tmp_path):
    common = ["--model", "llama3-8b", "--cluster", _small_example(tmp_path), "--global-batch", "32",
              "--seq-len", "4096"]
    rc, out, err = _run(capsys, "plan", *common, *SMALL_SPACE, "--json", "--out", str(tmp_path / "p.json"))
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["best"]["pools"] and doc["alone"]["h100"] and doc["explanation"]
    assert load_plan(str(tmp_path / "p.json")) == parse_plan(doc["best"]["plan"])  # the plan file reloads
    plan = "tp=2,pp=2,dp=2,micro_batch=1,stage_layers=18:14,pools=h100:a100,pool_pp=1:1"
    rc, out, err = _run(capsys, "estimate", *common, "--plan", plan)
    assert rc == 0 and "pool h100" in out and "pool a100" in out and "imbalance" in out, err
    rc, out, err = _run(capsys, "simulate", *common, "--plan", plan, "--json")
    assert rc == 0, err
    s = json.loads(out)
    assert abs(s["sim_vs_analytic_pct"]) < 3 and [p["pool"] for p in s["pools"]] == ["h100", "a100"]
    rc, out, err = _run(capsys, "report", *common, *SMALL_SPACE, "--out", str(tmp_path / "r.html"))
    assert rc == 0, err
    html = (tmp_path / "r.html").read_text()
    assert "Per-pool utilisation" in html and "Time lost to imbalance" in html and 'data-plot="gantt"' in html


def test_cli_price_override_on_pools(capsys):
    """--price-per-gpu-hour on pools: one price for every pool, or POOL=USD pairs; unknown pools refused."""
    rc, out, err = _run(capsys, "plan", "--model", "llama3-8b", "--cluster", EXAMPLE, "--global-batch", "64",
                        "--price-per-gpu-hour", "h200=2")
    assert rc == 2 and "no pool 'h200'" in err and "h100, a100" in err and "Traceback" not in err


def test_cli_estimate_with_an_unknown_pool(capsys):
    rc, out, err = _run(capsys, "estimate", "--model", "llama3-8b", "--cluster", EXAMPLE, "--global-batch", "64",
                        "--plan", "dp=8,pools=h200:a100,pool_dp=4:4")
    assert rc == 2 and "no pool named 'h200'" in err and "h100, a100" in err


def test_uneven_shares_under_zero3_are_priced_as_the_runtime_runs_them(llama8b):
    """The runtime keeps parameters gathered for the step when replicas run different numbers of
    micro-batches (zero=2/3 with uneven shares): priced as zero=1, and said."""
    c = load_cluster("h100-sxm-80gb:16")
    w = Workload(global_batch=32, seq_len=4096)
    z3 = estimate(llama8b, c, parse_plan("tp=8,dp=2,zero=3,micro_batch=1,dp_shares=3:1"), w)
    z1 = estimate(llama8b, c, parse_plan("tp=8,dp=2,zero=1,micro_batch=1,dp_shares=3:1"), w)
    assert z3.peak_memory_gib == pytest.approx(z1.peak_memory_gib) and any("priced as zero=1" in n for n in z3.notes)
    even = estimate(llama8b, c, parse_plan("tp=8,dp=2,zero=3,micro_batch=1,dp_shares=1:1"), w)
    assert even.peak_memory_gib < z3.peak_memory_gib  # even shares: real zero=3


def test_batch_check_follows_the_shares():
    from meshplan.spec.constraints import violations
    m, c = load_model("llama3-8b"), load_cluster("h100-sxm-80gb:16")
    ok = violations(m, c, parse_plan("tp=8,dp=2,micro_batch=2,dp_shares=3:1"), Workload(global_batch=8, seq_len=4096))
    assert not [r for r in ok if "split" in r[1] or "divisible" in r[1]]
    bad = violations(m, c, parse_plan("tp=8,dp=2,micro_batch=2,dp_shares=3:1"), Workload(global_batch=4, seq_len=4096))
    assert any("whole micro-batches" in r[1] for r in bad)


def test_pools_under_a_length_distribution(capsys, tmp_path):
    """Replicas on pools are priced with each pool's part by cost.lengths (the expected step of a
    length distribution); a pipeline over pools at every length (by default one shape: the longest)."""
    from meshplan.spec.lengths import parse_lengths
    c = _pools()
    dist = parse_lengths("2048:0.6,8192:0.3,32768:0.1")
    w = Workload.of(32, dist)
    g = load_model("llama3-8b")
    plan = parse_plan("tp=8,cp=2,dp=2,micro_batch=1,dp_shares=5:3,pools=a:b,pool_dp=1:1")
    e = estimate_pooled(g, c, plan, w)
    fixed = estimate_pooled(g, c, plan, Workload(global_batch=32, seq_len=32768))
    assert e.step_time_s < fixed.step_time_s  # most samples are short: cheaper than all at the longest
    assert e.parts[0].report is not None and e.parts[0].report.time.get("imbalance", 0) >= 0
    pipe = parse_plan("tp=8,pp=2,micro_batch=1,pools=a:b,pool_pp=1:1")  # one micro-batch shape: the longest
    assert estimate_pooled(g, c, pipe, w).step_time_s == pytest.approx(
        estimate_pooled(g, c, pipe, Workload(global_batch=32, seq_len=32768)).step_time_s, rel=1e-9)
    rc, out, err = _run(capsys, "plan", "--model", "llama3-8b", "--cluster", _small_example(tmp_path), "--global-batch",
                        "32", "--seq-len", "2048:0.6,8192:0.3,32768:0.1", *LONG_SPACE)
    assert rc == 0 and "lengths 2048:0.6" in out and "pool_pp=" in out, err  # stages on pools priced too


def test_a_pooled_plan_file_reloads_in_every_command(capsys, tmp_path):
    """`plan --out` on a pooled cluster: estimate / simulate / report / export read the file alone."""
    out = str(tmp_path / "p.json")
    rc, _, err = _run(capsys, "plan", "--model", "llama3-8b", "--cluster", _small_example(tmp_path), "--global-batch",
                      "32", "--seq-len", "4096", *SMALL_SPACE, "--out", out)
    assert rc == 0, err
    rc, text, err = _run(capsys, "estimate", "--plan", out)
    assert rc == 0 and "pool h100" in text, err
    rc, text, err = _run(capsys, "simulate", "--plan", out, "--json")
    assert rc == 0 and json.loads(text)["pools"], err
    rc, text, err = _run(capsys, "report", "--plan", out, *SMALL_SPACE, "--out", str(tmp_path / "r.html"))
    assert rc == 0 and "Per-pool utilisation" in (tmp_path / "r.html").read_text(), err
    rc, _, err = _run(capsys, "export", "--to", "torchtitan", "--plan", out)
    assert rc == 2 and "several GPU pools" in err and "Traceback" not in err


def test_pools_of_different_sizes_get_replicas_in_proportion(tmp_path):
    """16 H100 + 8 A100: replicas on pools may differ per pool (8:4), sharded in groups that divide
    both counts (shard_group = gcd x cp), not cut down to the smaller pool's count."""
    c = cluster_from_dict({"name": "uneven", "pools": [
        {"name": "h100", "gpu": "h100-sxm-80gb", "num_nodes": 2},
        {"name": "a100", "gpu": "a100-sxm-80gb", "num_nodes": 1}]})
    r = search(load_model("llama3-8b"), c, Workload(global_batch=128, seq_len=4096))
    e = r.best_by_kind["replicas on pools"]
    assert e is not None and e.plan.pool_dp is not None and e.plan.pool_dp[0] > e.plan.pool_dp[1]
    assert e.num_gpus == 24
    sg = e.plan.shard_group
    assert sg == 0 or all((n * e.plan.cp) % sg == 0 for n in e.plan.pool_dp)


def test_pool_names_must_work_in_plan_strings():
    with pytest.raises(MeshplanError, match="cannot be used in plans"):
        cluster_from_dict({"pools": [{"name": "a:b", "gpu": "h100-sxm-80gb", "num_nodes": 1},
                                     {"name": "c", "gpu": "a100-sxm-80gb", "num_nodes": 1}]})


def test_the_nearest_global_batches_that_split():
    from meshplan.cost.pools import nearest_batches
    assert nearest_batches(parse_plan("dp=3"), 64) == (63, 66)
    assert nearest_batches(parse_plan("dp=2,dp_shares=3:1,micro_batch=2"), 100) == (96, 104)
    with pytest.raises(MeshplanError, match="evenly over dp=3.*--global-batch 63 or 66"):
        replica_samples(parse_plan("dp=3"), 64)


def test_objective_cost_says_dollars(tmp_path):
    r = search(load_model("tiny-llama"), load_cluster(_small_example(tmp_path)), Workload(global_batch=16, seq_len=256),
               objective="cost")
    assert r.best_pooled is not None
    if not r.best_pooled.plan.multi_pool and r.best_multi is not None:
        assert any("costs more" in line and "per M tokens" in line for line in r.explanation)


def test_one_share_per_pool_and_shard_groups_within_pools():
    p = parse_plan("tp=1,dp=24,pools=h100:a100,pool_dp=16:8,dp_shares=3:1")
    assert p.replica_shares == (3,) * 16 + (1,) * 8  # per pool, not blocks of 12
    assert parse_plan("dp=4,dp_shares=3:1").replica_shares == (3, 3, 1, 1)  # no pools: blocks
    with pytest.raises(MeshplanError, match="must lie in one pool"):
        parse_plan("dp=12,zero=1,shard_group=8,pools=a:b,pool_dp=8:4")


@pytest.mark.slow  # a three-pool search on 28 GPUs
def test_a_small_third_pool_does_not_hide_replicas_on_the_others():
    c = cluster_from_dict({"name": "three", "pools": [
        {"name": "h100", "gpu": "h100-sxm-80gb", "num_nodes": 2},
        {"name": "a100", "gpu": "a100-sxm-80gb", "num_nodes": 1},
        {"name": "l40s", "gpu": "l40s-48gb", "num_nodes": 1, "gpus_per_node": 4}]})
    r = search(load_model("llama3-8b"), c, Workload(global_batch=128, seq_len=4096))
    e = r.best_by_kind["replicas on pools"]
    assert e is not None and len(e.plan.pools) >= 2


def test_a_plan_file_saved_elsewhere_reloads_from_anywhere(capsys, tmp_path, monkeypatch):
    sub = tmp_path / "plans"
    sub.mkdir()
    out = str(sub / "p.json")
    rc, _, err = _run(capsys, "plan", "--model", "llama3-8b", "--cluster", _small_example(tmp_path), "--global-batch",
                      "32", "--seq-len", "2048:0.6,8192:0.3,32768:0.1", *LONG_SPACE, "--out", out)
    assert rc == 0, err
    planned = json.loads(Path(out).read_text())
    monkeypatch.chdir(tmp_path)
    rc, text, err = _run(capsys, "estimate", "--plan", out, "--json")
    assert rc == 0, err
    doc = json.loads(text)
    assert doc["step_time_s"] == pytest.approx(planned["predicted"]["step_time_s"])  # the distribution kept
    assert doc["lengths"]["lengths"].startswith("2048:0.6")
    rc, text, err = _run(capsys, "report", "--plan", out, *LONG_SPACE, "--out", str(tmp_path / "r.html"))
    assert rc == 0 and f"{planned['predicted']['step_time_s']:.3f}" in text, err
    assert "lengths 2048:0.6" in (tmp_path / "r.html").read_text()


@pytest.mark.slow  # bucket plans win only at scale (64 + 64 GPUs); the one-pool bucket plan is simulated below
def test_a_pool_alone_may_win_with_a_bucket_plan():
    """Under a length distribution each pool's own search has its data-aware stage: a bucket plan on
    the H100 pool alone beats every one-shape plan over both pools, and the pooled search says so;
    the plan (pools=h100 with buckets) prices as the same plan on that pool's cluster, and the
    simulator's sampled mean agrees with it."""
    from meshplan.cost import estimate
    from meshplan.sim.pools import simulate_pooled
    from meshplan.spec.lengths import parse_lengths
    c = _pools(nodes=8)
    w = Workload.of(256, parse_lengths("2048:0.6,8192:0.3,32768:0.1"))
    g = load_model("llama3-8b")
    r = search(g, c, w, top=5)
    best = r.best_pooled
    assert best.plan.buckets is not None and best.plan.pools == ("a",)
    assert r.best_multi is not None and r.best_multi.step_time_s > best.step_time_s
    assert any("a data-aware plan" in x and "even shares" in x for x in r.explanation)
    plain = estimate(g, c.pool("a"), best.plan.replace(pools=None), w)
    assert best.step_time_s == pytest.approx(plain.step_time_s)
    sim = simulate_pooled(g, c, best.plan, w)
    assert abs(sim.step_time_s / best.step_time_s - 1) < 0.05
    parse_plan("tp=2,dp=8,cp=4,buckets=8192x1cp1:32768x1cp4,pools=a:b,pool_dp=4:4")  # a bucket plan per pool
    with pytest.raises(MeshplanError, match="deals each step's samples to its ranks by length"):
        parse_plan("tp=2,dp=8,cp=4,buckets=8192x1cp1:32768x1cp4,dp_shares=3:1")


def test_simulate_a_one_pool_plan_under_a_length_distribution(capsys):
    rc, out, err = _run(capsys, "simulate", "--model", "llama3-8b", "--cluster", EXAMPLE, "--global-batch", "64",
                        "--seq-len", "2048:0.6,8192:0.3,32768:0.1", "--batches", "5",
                        "--plan", "tp=2,dp=4,cp=4,zero=1,pools=h100,buckets=8192x1cp1:32768x1cp4")
    assert rc == 0 and "simulated on that pool" in err and "simulated 5 sampled steps" in out, err
    rc, out, err = _run(capsys, "simulate", "--model", "llama3-8b", "--cluster", EXAMPLE, "--global-batch", "64",
                        "--seq-len", "2048:0.6,8192:0.3,32768:0.1",
                        "--plan", "tp=8,dp=8,micro_batch=1,dp_shares=5:3,pools=h100:a100,pool_dp=4:4", "--batches", "5")
    assert rc == 0 and "pool" in out and "a100" in out and "mean of 5 sampled batches" in out, err  # on both pools


# review fixes: a plan over pools obeys the rules of a plan on one GPU type; its memory verdict in simulate;
# no zero terms on one pool; a cluster file of one [[pools]] table


@pytest.mark.parametrize("plan", [
    "tp=2,pp=2,dp=4,zero=2,micro_batch=1,pools=a:b,pool_dp=2:2",  # replicas on pools
    "tp=2,pp=2,dp=2,zero=2,micro_batch=1,pools=a:b,pool_pp=1:1",  # stages on pools
    "tp=2,pp=2,dp=2,zero=2,micro_batch=1,pools=a",  # one pool of several
])
def test_a_plan_over_pools_is_refused_where_one_gpu_type_refuses_it(plan):
    """spec.constraints on every pool's part (cost.batch.check), the pool named in the one-line reason."""
    tiny, work = load_model("tiny-llama"), Workload(global_batch=32, seq_len=256)
    one = parse_plan(plan.split(",pools")[0])
    with pytest.raises(MeshplanError, match="zero=2 with pp > 1") as plain:
        estimate(tiny, load_cluster(f"h100-sxm-80gb:{one.num_gpus}"), one, work)
    with pytest.raises(MeshplanError, match="^plan cannot run: pool a: zero=2 with pp > 1") as pooled:
        estimate(tiny, _pools(nodes=1), parse_plan(plan), work)
    assert str(pooled.value).split("pool a: ")[1] == str(plain.value).split("plan cannot run: ")[1]


@pytest.mark.parametrize("plan, rule", [
    ("tp=2,pp=2,dp=2,zero=1,micro_batch=1,schedule=zero-bubble,pools=a:b,pool_pp=1:1", "schedule=zero-bubble"),
    ("dp=16,zero=1,micro_batch=1,offload_optimizer=1,pools=a:b,pool_dp=8:8", "offload_optimizer without"),
])
def test_runtime_rules_of_every_pools_part_are_reported_and_never_ranked(capsys, plan, rule):
    """spec.support on each pool's part, as on one GPU type: estimate says what meshplan train does
    (text and --json), and the pooled search ranks only plans it runs as planned."""
    tiny, work = load_model("tiny-llama"), Workload(global_batch=32, seq_len=256)
    e = estimate(tiny, _pools(nodes=1), parse_plan(plan), work)
    assert not e.runs_as_planned and {i["pool"] for i in e.runtime if rule in i["reason"]} == {"a", "b"}
    assert e.to_dict()["runtime"]["runs_as_planned"] is False
    ok = estimate(tiny, _pools(nodes=1), parse_plan("dp=16,zero=1,micro_batch=1,pools=a:b,pool_dp=8:8"), work)
    assert ok.runs_as_planned and ok.to_dict()["runtime"] == {"runs_as_planned": True, "issues": []}
    rc, out, err = _run(capsys, "estimate", "--model", "tiny-llama", "--cluster", EXAMPLE, "--global-batch", "32",
                        "--seq-len", "256", "--plan", plan.replace("=a:b", "=h100:a100"))
    assert rc == 0 and f"(pools h100, a100): {rule}" in out, err


def test_the_pooled_search_ranks_no_plan_the_runtime_refuses(tmp_path):
    """Stages on pools from a pool's zero=2 shape (pp=1 there) would be zero=2 under a pipeline:
    estimate refuses it, so the pooled search skips it (it once ranked one)."""
    from meshplan.cost.params import DEFAULT_PARAMS
    from meshplan.search.pools import _stages_on_pools
    c = load_cluster(_small_example(tmp_path))
    tiny, work = load_model("tiny-llama"), Workload(global_batch=16, seq_len=256)
    with pytest.raises(MeshplanError, match="pool h100: zero=2 with pp > 1"):
        _stages_on_pools(as_graph(tiny, 256), c, parse_plan("dp=2,zero=2,micro_batch=1"), work, DEFAULT_PARAMS)
    for e in search(tiny, c, work).pooled_plans:
        assert e.runs_as_planned, e.plan.short()


def test_simulate_of_a_plan_over_pools_says_its_memory_verdict(capsys, tmp_path):
    common = ["--model", "gpt3-125m", "--cluster", _small_example(tmp_path), "--global-batch", "16",
              "--seq-len", "1024"]
    for plan, verdict in (("dp=8,micro_batch=1,pools=h100:a100,pool_dp=4:4", "fits"),
                          ("dp=8,micro_batch=2,recompute=none,pools=h100:a100,pool_dp=4:4", None),
                          ("dp=4,micro_batch=1,pools=h100", "fits")):
        rc, out, err = _run(capsys, "estimate", *common, "--plan", plan, "--json")
        assert rc == 0, err
        est = json.loads(out)
        rc, out, err = _run(capsys, "simulate", *common, "--plan", plan, "--json")
        assert rc == 0, err
        s = json.loads(out)
        assert s["verdict"] == est["verdict"] and s["oom_probability"] == est["oom_probability"]
        assert verdict is None or s["verdict"] == verdict
        assert s["memory_pool"] in ("h100", "a100") and s["peak_memory_gib"] == max(
            p["peak_memory_gib"] for p in est["pools"])
        rc, out, err = _run(capsys, "simulate", *common, "--plan", plan)
        assert rc == 0 and f"memory: {s['verdict']} (" in out and f"tightest pool {s['memory_pool']}" in out, err


def test_a_pooled_plan_that_does_not_fit_says_so_in_simulate(capsys, tmp_path):
    common = ["--model", "llama3-8b", "--cluster", _small_example(tmp_path), "--global-batch", "8",
              "--seq-len", "4096", "--plan", "dp=8,zero=0,micro_batch=1,pools=h100:a100,pool_dp=4:4"]
    rc, out, err = _run(capsys, "estimate", *common)
    assert rc == 0 and "DOES NOT FIT" in out and "memory does-not-fit" in out, err
    rc, out, err = _run(capsys, "simulate", *common)
    assert rc == 0 and "memory: does-not-fit (" in out, err


def test_a_plan_on_one_pool_prints_no_cross_pool_terms(capsys, tmp_path):
    common = ["--model", "gpt3-125m", "--cluster", _small_example(tmp_path), "--global-batch", "16",
              "--seq-len", "1024"]
    rc, out, err = _run(capsys, "estimate", *common, "--plan", "dp=4,micro_batch=1,pools=h100")
    assert rc == 0 and "pool h100" in out, err
    assert "waits" not in out and "across pools" not in out and "imbalance" not in out
    rc, out, err = _run(capsys, "simulate", *common, "--plan", "dp=4,micro_batch=1,pools=h100")
    assert rc == 0 and "across pools" not in out and "imbalance" not in out, err
    rc, out, err = _run(capsys, "estimate", *common, "--plan", "dp=8,micro_batch=1,pools=h100:a100,pool_dp=4:4")
    assert rc == 0 and "waits" in out and "across pools" in out and "imbalance" in out, err


def test_a_cluster_file_of_one_pool_is_that_pools_cluster(capsys, tmp_path):
    """A homogeneous cluster is one pool: a file with one [[pools]] table loads as that pool's
    ClusterSpec, which every command takes (with or without pools=NAME)."""
    path = tmp_path / "one.toml"
    path.write_text('schema_version = 1\nkind = "cluster"\nname = "solo"\n\n[[pools]]\nname = "h100"\n'
                    'gpu = "h100-sxm-80gb"\nnum_nodes = 1\ngpus_per_node = 8\n')
    c = load_cluster(str(path))
    plain = load_cluster("h100-sxm-80gb:8")
    assert not isinstance(c, PooledCluster) and c.pools == (c,) and c.names == ("h100",)
    assert c.num_gpus == 8 and c.gpu == plain.gpu and c.inter_node == plain.inter_node
    tiny, work = load_model("gpt3-125m"), Workload(global_batch=16, seq_len=1024)
    want = estimate(tiny, plain, parse_plan("dp=8,micro_batch=1"), work).step_time_s
    for plan in ("dp=8,micro_batch=1", "dp=8,micro_batch=1,pools=h100"):
        assert estimate(tiny, c, parse_plan(plan), work).step_time_s == want
    for cmd in ("estimate", "simulate"):
        rc, out, err = _run(capsys, cmd, "--model", "gpt3-125m", "--cluster", str(path), "--global-batch", "16",
                            "--seq-len", "1024", "--plan", "dp=8,micro_batch=1")
        assert rc == 0, err
    with pytest.raises(MeshplanError, match="max_gpus"):
        cluster_from_dict({"name": "x", "max_gpus": 4, "pools": [{"name": "a", "gpu": "h100-sxm-80gb",
                                                                  "num_nodes": 1}]})
