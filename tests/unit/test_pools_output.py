"""Issue 26 review of pooled estimates (3 nodes of 4 V100-16GB + 1 node of 4 T4, GPT-2 medium, fp16):

1. one definition of the time across pools: ``cross_pool_s`` is the exposed time over inter_pool on the
   step's critical path, always ``time["cross_pool"]`` (taken out of dp_comm / pp_comm), the same number
   in the text header and the breakdown; plans in device order count their bytes across pools too
   (they reported 0 GB while the time was inside dp_comm);
2. pooled ``estimate --json`` has every key a plan on one GPU type has (memory, memory_per_stage,
   peak_memory_gib, the step band, cross_site_gb, ...), with pooled meanings.
Cost model only; nothing runs on a GPU.
"""
from __future__ import annotations

import json
import re

import pytest

from meshplan.cli.main import main
from meshplan.cost import estimate
from meshplan.spec.io import load_model
from meshplan.spec.plan import parse_plan
from test_pools_defects import TOML, WORK, v100_t4

PLANS = [
    "tp=1,pp=1,dp=16,precision=fp16,pools=v100:t4",                       # device order, dp across pools
    "tp=1,pp=2,dp=8,zero=1,precision=fp16,pools=v100:t4",                 # device order, a stage spans pools
    "tp=1,pp=4,dp=4,zero=1,precision=fp16,pools=t4:v100",                 # device order, stage 0 on T4
    "tp=1,pp=1,dp=16,precision=fp16,pools=v100:t4,pool_dp=12:4",
    "tp=1,pp=4,dp=4,zero=1,precision=fp16,stage_layers=8:8:7:1,pools=v100:t4,pool_pp=3:1",
]


@pytest.fixture(scope="module")
def gpt2m():
    return load_model("gpt2-medium")


@pytest.mark.parametrize("plan", PLANS)
def test_cross_pool_is_one_number_and_the_exposed_terms_add_up(gpt2m, plan):
    e = estimate(gpt2m, v100_t4(), parse_plan(plan), WORK)
    assert e.cross_pool_s == e.time["cross_pool"]
    exposed = sum(v for k, v in e.time.items() if not k.endswith("_overlapped") and k != "pool_idle")
    assert exposed == pytest.approx(e.step_time_s, rel=1e-9)
    assert all(v >= 0 for v in e.time.values())
    # every plan here sends something across pools (a replica or a boundary spans them)
    assert e.cross_pool_gb > 0
    d = e.to_dict()
    assert d["cross_pool_s"] == d["time"]["cross_pool"] and d["cross_pool_gb"] == e.cross_pool_gb


def test_device_order_counts_the_data_parallel_exchange_like_pool_dp(gpt2m):
    """dp=16 in device order over 12 V100 + 4 T4 is the pool_dp=12:4 exchange: same bytes, same time."""
    c = v100_t4()
    dev = estimate(gpt2m, c, parse_plan(PLANS[0]), WORK)
    rep = estimate(gpt2m, c, parse_plan(PLANS[3]), WORK)
    assert dev.cross_pool_gb == pytest.approx(rep.cross_pool_gb, rel=1e-12) and dev.cross_pool_gb > 0
    assert dev.cross_pool_s == pytest.approx(rep.cross_pool_s, rel=1e-9)
    # it left dp_comm: what stays there is the sync within the pools
    assert dev.time["dp_comm"] < dev.cross_pool_s
    assert any("cross_pool, not dp_comm" in n for n in dev.notes)


def test_slower_link_between_pools_shows_in_cross_pool_only(gpt2m):
    from meshplan.spec.io import cluster_from_dict
    from test_pools_defects import T4, V100_16
    slow = cluster_from_dict({"name": "slow", "pools": [
        {"name": "v100", "gpu": V100_16, "num_nodes": 3, "gpus_per_node": 4},
        {"name": "t4", "gpu": T4, "num_nodes": 1, "gpus_per_node": 4}],
        "inter_pool": {"bandwidth_gbps": 0.5, "latency_us": 50.0}})
    plan = parse_plan(PLANS[1])
    a, b = estimate(gpt2m, v100_t4(), plan, WORK), estimate(gpt2m, slow, plan, WORK)
    assert b.cross_pool_s > a.cross_pool_s and b.step_time_s > a.step_time_s
    assert b.cross_pool_gb == pytest.approx(a.cross_pool_gb)  # the same bytes
    assert b.time["compute"] == pytest.approx(a.time["compute"])


@pytest.mark.parametrize("plan", [PLANS[0], PLANS[1]])
def test_text_header_and_breakdown_agree(tmp_path, capsys, plan):
    path = tmp_path / "v100-t4.toml"
    path.write_text(TOML)
    assert main(["estimate", "--model", "gpt2-medium", "--cluster", str(path), "--global-batch", "32",
                 "--plan", plan]) == 0
    out = capsys.readouterr().out
    head = re.search(r"^across pools\s+([\d.]+ \w+) per step exposed over inter_pool", out, re.M)
    row = re.search(r"^across pools \(inter_pool\)\s+([\d.]+ \w+)", out, re.M)
    assert head and row and head.group(1) == row.group(1), out
    gb = re.search(r"a GPU sends up to ([\d.]+) GB", out)
    assert gb and float(gb.group(1)) > 0


def _json(args, capsys):
    assert main(args + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("plan", [PLANS[1], PLANS[3], PLANS[4]])
def test_pooled_json_has_every_key_of_a_plan_on_one_gpu_type(tmp_path, capsys, plan):
    path = tmp_path / "v100-t4.toml"
    path.write_text(TOML)
    one = _json(["estimate", "--model", "gpt2-medium", "--cluster", "v100-sxm-32gb:2x4", "--global-batch", "32",
                 "--plan", "tp=1,pp=2,dp=4,precision=fp16"], capsys)
    d = _json(["estimate", "--model", "gpt2-medium", "--cluster", str(path), "--global-batch", "32",
               "--plan", plan], capsys)
    assert set(one) - set(d) == set()
    for k in one:
        assert isinstance(d[k], type(one[k])) or isinstance(one[k], float) and isinstance(d[k], int), k
    assert set(d["memory"]) == set(one["memory"])
    # the tightest pool's memory, named; each pool has its own
    tight = next(p for p in d["pools"] if p["pool"] == d["memory_pool"])
    assert d["peak_memory_gib"] == tight["peak_memory_gib"] and d["usable_memory_gib"] == tight["usable_memory_gib"]
    assert d["memory"]["total"] == pytest.approx(d["peak_memory_gib"], rel=1e-9)
    assert all(p["memory"]["total"] == pytest.approx(p["peak_memory_gib"], rel=1e-9) for p in d["pools"])
    assert max(d["memory_per_stage"]) <= max(p["peak_memory_gib"] for p in d["pools"]) + 1e-9
    assert d["step_time_s_low"] < d["step_time_s"] < d["step_time_s_high"]
    assert d["peak_memory_gib_high"] >= d["peak_memory_gib"]
    assert d["tflops_per_gpu"] > 0 and d["hfu"] >= d["mfu"] and d["params"] == one["params"]
    assert d["cross_site_gb"] == 0.0 and d["model"] == "gpt2-medium" and d["cluster"] == "v100-t4-pools"
    # the keys it already had keep their meaning
    assert d["cross_pool_s"] == d["time"]["cross_pool"] and "pools" in d["plan"]
