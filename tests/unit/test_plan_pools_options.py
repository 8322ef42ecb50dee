"""`meshplan plan` options on a cluster of several GPU pools (issue 25): --gpus (a budget of GPUs in
all, fastest pool first), --price-per-gpu-hour (every pool's price, or POOL=USD), --deadline (the
cheapest plan that meets it, each pool at its own price) and --plot (the pooled Pareto front).
A tiny model on two one-node pools, so that each search takes a second or two."""
from __future__ import annotations

import json

import pytest

from meshplan.cli.main import main
from meshplan.search import search
from meshplan.search.pools import budget_pools
from meshplan.spec.io import cluster_from_dict, load_model
from meshplan.spec.plan import Workload

POOLS = {"schema_version": 1, "kind": "cluster", "name": "mix", "pools": [
    {"name": "a100", "gpu": "a100-sxm-80gb", "num_nodes": 1, "gpus_per_node": 8},
    {"name": "h100", "gpu": "h100-sxm-80gb", "num_nodes": 1, "gpus_per_node": 8}],
    "inter_pool": {"bandwidth_gbps": 25.0, "latency_us": 8.0}}
ARGS = ["--model", "gpt3-125m", "--global-batch", "64", "--seq-len", "2048"]


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pools") / "mix.json"
    path.write_text(json.dumps(POOLS))
    return str(path)


def _plan(capsys, cluster_file, *extra):
    rc = main(["plan", *ARGS, "--cluster", cluster_file, *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def base(cluster_file):
    """The --json of the plain pooled search (module scope: computed once)."""
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", *ARGS, "--cluster", cluster_file, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_budget_takes_the_fastest_pool_first():
    c = cluster_from_dict(POOLS)
    assert [(p.name, p.num_gpus) for p in budget_pools(c.replace(max_gpus=4))] == [("h100", 4)]
    assert [(p.name, p.num_gpus) for p in budget_pools(c.replace(max_gpus=12))] == [("a100", 4), ("h100", 8)]
    assert [p.num_gpus for p in budget_pools(c)] == [8, 8] and c.replace(max_gpus=12).num_gpus == 12


def test_search_is_one_front_door_for_pools():
    """search.search on pools: one SearchResult with the pooled parts, every plan within the budget."""
    c = cluster_from_dict(POOLS)
    r = search(load_model("gpt3-125m"), c.replace(max_gpus=12), Workload(global_batch=64, seq_len=2048))
    assert r.pooled and r.best_pooled is not None and r.explanation
    assert all(e.num_gpus <= 12 for e in r.pooled_plans)
    assert set(r.alone) == {"a100", "h100"} and r.per_cluster[0].num_gpus == 12
    assert r.best_multi is not None and r.best_multi.plan.pool_dp == (4, 8)


def test_gpus_lists_each_budget_with_its_best_plan(capsys, cluster_file, base):
    rc, out, err = _plan(capsys, cluster_file, "--gpus", "8..32", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    sizes = {c["num_gpus"]: c for c in doc["per_cluster"]}
    assert sorted(sizes) == [8, 16] and "32 left out" in err  # the pools hold 16 GPUs
    assert sizes[8]["best_step_time_s"] > sizes[16]["best_step_time_s"]  # the H100 pool alone vs both
    assert doc["best"]["step_time_s"] == pytest.approx(base["best"]["step_time_s"])  # 16 = the whole cluster
    assert all(p["num_gpus"] <= 16 for p in doc["plans"])
    rc, text, err = _plan(capsys, cluster_file, "--gpus", "8,16")
    assert rc == 0 and "best per cluster size:" in text and "<- winner" in text, err
    assert [line for line in text.splitlines() if line.strip().startswith(("8 GPUs", "16 GPUs"))]


def test_price_override_scales_dollars_by_the_price_ratio(capsys, cluster_file, base):
    rc, out, err = _plan(capsys, cluster_file, "--price-per-gpu-hour", "10", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["price"]["usd_per_gpu_hour"] == {"a100": 10.0, "h100": 10.0}
    b0, b1 = base["best"], doc["best"]
    assert b1["plan"] == b0["plan"]  # the ranking is by time: the winner does not change
    a100, h100 = (cluster_from_dict(POOLS).pool(n).price_per_hour for n in ("a100", "h100"))
    gpus = {p["pool"]: p["gpus"] for p in b0["pools"]}
    paid = gpus.get("a100", 0) * a100 + gpus.get("h100", 0) * h100
    want = b0["usd_per_m_tokens"] * 10 * sum(gpus.values()) / paid
    assert b1["usd_per_m_tokens"] == pytest.approx(want, rel=1e-9)
    # one pool's price alone: only that pool's plans get dearer
    rc, out, err = _plan(capsys, cluster_file, "--price-per-gpu-hour", f"a100={2 * a100}", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    h = doc["alone"]["h100"]
    assert h["usd_per_m_tokens"] == pytest.approx(base["alone"]["h100"]["usd_per_m_tokens"], rel=1e-12)
    assert doc["alone"]["a100"]["usd_per_m_tokens"] == pytest.approx(
        2 * base["alone"]["a100"]["usd_per_m_tokens"], rel=1e-9)
    rc, text, err = _plan(capsys, cluster_file, "--price-per-gpu-hour", "3")
    assert rc == 0 and "price per GPU-hour (--price-per-gpu-hour): a100 $3.00, h100 $3.00" in text, err


def test_deadline_keeps_the_cheapest_plan_that_meets_it(capsys, cluster_file, base):
    tokens_per_step = 64 * 2048
    steps = [p["step_time_s"] for p in base["plans"]]
    # a deadline between the fastest and the slowest of the ranked plans
    cut = sorted(steps)[len(steps) // 2]
    days = cut * 1e9 / tokens_per_step / 86400
    rc, out, err = _plan(capsys, cluster_file, "--train-tokens", "1B", "--deadline", f"{days:.9f}", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["objective"] == "cost" and doc["deadline_days"] == pytest.approx(days)
    kept = doc["plans"]
    assert kept and all(p["step_time_s"] * 1e9 / tokens_per_step / 86400 <= days for p in kept)
    usd = [p["usd_per_m_tokens"] for p in kept]
    assert usd == sorted(usd)  # the cheapest that meets it first
    assert doc["rejected"]["over the deadline"] >= 1 and "over the" in doc["reject_examples"]["over the deadline"]
    # nothing meets a deadline shorter than the fastest plan: one-line error naming it
    fastest = min(steps) * 1e9 / tokens_per_step / 86400
    rc, out, err = _plan(capsys, cluster_file, "--train-tokens", "1B", "--deadline", f"{fastest / 2:.9f}")
    assert rc == 3 and "within" in err and "over the" in err and "Traceback" not in err


def test_plot_draws_the_pooled_pareto_front(capsys, cluster_file, tmp_path, base):
    path = tmp_path / "front.svg"
    rc, out, err = _plan(capsys, cluster_file, "--plot", str(path))
    assert rc == 0, err
    svg = path.read_text()
    assert svg.lstrip().startswith("<") and 'class="front"' in svg and 'data-mark="front"' in svg
    assert "usable" in svg  # the tightest pool's usable memory


def test_no_search_module_imports_the_driver():
    """The stages (pools, buckets, ...) are run by the driver; none of them imports it back."""
    import ast
    from pathlib import Path

    import meshplan.search as pkg
    for path in Path(pkg.__file__).parent.glob("*.py"):
        if path.name in ("driver.py", "__init__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
                assert node.module != "meshplan.search.driver", path.name
                assert not (node.module == "meshplan.search" and "search" in names), path.name


def test_pipelines_over_pools_are_searched_under_a_length_distribution():
    """Under a length distribution the pools stage prices pipelines over pools too (cost.estimate:
    each stage's step, padded as the runtime pads a pipeline), and ranks them with the rest."""
    from meshplan.cost import estimate
    from meshplan.spec.lengths import parse_lengths
    c = cluster_from_dict({**POOLS, "pools": [dict(p, gpus_per_node=4) for p in POOLS["pools"]]})
    w = Workload.of(32, parse_lengths("512:0.7,2048:0.3"))
    g = load_model("gpt3-125m")
    r = search(g, c, w)
    e = r.best_by_kind["stages on pools"]
    assert e is not None and e.plan.pool_pp is not None and len(e.plan.pools) == 2
    assert e.step_time_s == pytest.approx(estimate(g, c, e.plan, w).step_time_s, rel=1e-12)
    assert r.best_pooled is not None and r.best_pooled.step_time_s <= e.step_time_s
    assert not any("not priced under a length distribution" in line for line in r.explanation)


def test_a_bucket_plan_over_pools_comes_out_of_the_search_when_it_wins():
    """Under a length distribution a pool's best bucket plan is also tried as the replica shape on
    several pools (even shares: a bucket plan deals samples by length); on two equal pools it wins."""
    from meshplan.cost import estimate
    from meshplan.spec.lengths import parse_lengths
    c = cluster_from_dict({"name": "twin", "pools": [
        {"name": "x", "gpu": "h100-sxm-80gb", "num_nodes": 1, "gpus_per_node": 4},
        {"name": "y", "gpu": "h100-sxm-80gb", "num_nodes": 1, "gpus_per_node": 4}],
        "inter_pool": {"bandwidth_gbps": 50.0, "latency_us": 8.0}})
    w = Workload.of(32, parse_lengths("512:0.7,2048:0.3"))
    g = load_model("gpt3-125m")
    r = search(g, c, w)
    best = r.best_pooled
    assert best is not None and best.plan.buckets is not None and best.plan.pool_dp == (4, 4)
    assert best.plan.dp_shares is None and best.step_time_s < min(e.step_time_s for e in r.alone.values() if e)
    assert best.step_time_s == pytest.approx(estimate(g, c, best.plan, w).step_time_s, rel=1e-12)


# ---- review fixes: the winner on the plot, per-budget explanations, budgets that take no GPU,
# report's options, export of a plan on one pool ----

def test_plot_stars_the_winner_in_a_colour_the_front_never_takes(capsys, cluster_file, tmp_path):
    """The pooled plot draws the winner (it has no RankedPlan: its PooledEstimate), and on both
    kinds of cluster the winner's red star is a colour of no front point (viridis, which ends yellow)."""
    import re

    from meshplan.report.charts import WINNER_COLOR
    from meshplan.svg import viridis
    assert WINNER_COLOR not in {viridis(k / 100) for k in range(101)}
    for cluster, name in ((cluster_file, "pools.svg"), ("h100-sxm-80gb:2", "one.svg")):
        path = tmp_path / name
        rc, out, err = _plan(capsys, cluster, "--plot", str(path), *(() if cluster == cluster_file else
                                                                      ("--fix", "tp=1|2,pp=1")))
        assert rc == 0, err
        svg = path.read_text()
        winner = re.findall(r'<polygon data-mark="winner"[^>]*fill="([^"]+)"', svg)
        assert winner == [WINNER_COLOR], name
        assert "winner (star)" in svg
        fronts = re.findall(r'<circle data-mark="front"[^>]*fill="([^"]+)"', svg)
        assert fronts and WINNER_COLOR not in fronts


def test_gpus_explains_from_the_plans_of_every_budget(capsys, cluster_file):
    """--gpus 8,16 by cost: the 8-GPU budget (the H100 pool alone) wins, and the explanation of the
    plans over several pools is of the 16-GPU budget's plans, which the table lists; the 16-GPU
    line says its best uses 8 of the GPUs; --train-tokens gives the run's dollars and days."""
    rc, text, err = _plan(capsys, cluster_file, "--gpus", "8,16", "--objective", "cost", "--train-tokens", "1B")
    assert rc == 0, err
    assert "found no plan over several pools" not in text and "none of the shapes tried" not in text
    assert "the best plan over several pools costs more" in text
    assert "pools=a100:h100" in text  # in the table too
    assert "$ to train" in text and "days" in text
    line16 = next(line for line in text.splitlines() if line.strip().startswith("16 GPUs:"))
    assert "using 8 of the 16 GPUs" in line16
    r = search(load_model("gpt3-125m"), [cluster_from_dict(POOLS).replace(max_gpus=n) for n in (8, 16)],
               Workload(global_batch=64, seq_len=2048), objective="cost")
    assert r.best_multi is not None and r.best_by_kind["replicas on pools"] is not None
    assert [c.used_gpus for c in r.per_cluster] == [8, r.per_cluster[1].used_gpus] and r.per_cluster[1].used_gpus


def test_a_missed_deadline_prints_no_empty_table(capsys, cluster_file):
    rc, out, err = _plan(capsys, cluster_file, "--train-tokens", "1T", "--deadline", "0.001")
    assert rc == 3 and "within 0.001 days" in err and "1T tokens" in err
    assert "GPUs  $/M tok" not in out and "no plan meets the 0.001-day deadline" in out


def test_a_budget_that_takes_no_whole_node_is_an_error_up_front(capsys, cluster_file):
    for gpus in ("3", "8,3"):
        rc, out, err = _plan(capsys, cluster_file, "--gpus", gpus)
        assert rc == 2 and out == "" and "3 GPUs is not a whole number of the pools' 8-GPU nodes" in err
        assert err.count("\n") == 1 and "1, 2, 4" in err


def test_report_help_leaves_out_deadline(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "--deadline" not in capsys.readouterr().out


def test_a_plan_on_one_pool_exports_as_that_pools_plan(capsys, cluster_file, tmp_path):
    out = str(tmp_path / "h8.json")
    rc, _, err = _plan(capsys, cluster_file, "--gpus", "8", "--out", out)
    assert rc == 0, err
    assert json.loads(open(out).read())["plan"]["pools"] == ["h100"]
    assert main(["export", "--plan", out, "--to", "torchtitan"]) == 0
    text = capsys.readouterr().out
    assert "# cluster: h100" in text and "data_parallel_shard_degree = 8" in text and "pools" not in text
    # several pools, or uneven shares: refused
    for plan in ("tp=1,dp=16,micro_batch=1,pools=a100:h100,pool_dp=8:8", "dp=8,micro_batch=1,dp_shares=1:3,pools=h100"):
        rc = main(["export", "--plan", plan, "--to", "torchtitan", "--cluster", cluster_file, *ARGS])
        err = capsys.readouterr().err
        assert rc == 2 and ("several GPU pools" in err or "uneven dp_shares" in err) and "Traceback" not in err
