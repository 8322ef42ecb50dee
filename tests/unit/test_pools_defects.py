"""Issue 26's pooled-cluster defects, on its cluster: 3 nodes of 4 V100-16GB and 1 node of 4 T4
(GPT-2 medium, fp16). GPU pools are emulated by the cost model; nothing here runs on a GPU.

- Defect A: with --no-flash-attention (every plan export-only) the pooled search said "no plan
  fits", although a plan on the V100 pool alone fits: the pools stage dropped every plan that
  meshplan's runtime does not run, also on a pool alone, where --allow-export-only allows it.
- Defect B: "replicas on pools: none of the shapes tried fits", although plain data parallelism
  over both pools fits: the shortlist of shapes was filled by the first (larger) pool's shapes,
  all wider than the T4 pool, and a shape's micro-batch could leave replicas without one.
"""
from __future__ import annotations

import pytest

from meshplan.cli.main import main
from meshplan.cost import estimate
from meshplan.search import search
from meshplan.search.pools import BLOCKED
from meshplan.search.space import SearchSpace
from meshplan.spec.io import cluster_from_dict, load_model
from meshplan.spec.plan import Plan, Workload, parse_plan

V100_16 = {"name": "v100-sxm-16gb", "family": "volta", "memory_gib": 15.78, "hbm_bandwidth_gbps": 900.0,
           "intra_node_bandwidth_gbps": 150.0, "intra_node_link": "nvlink", "default_nic_gbps": 3.125,
           "gpus_per_node": 4, "gemm_efficiency": 0.7, "peak_tflops": {"fp32": 15.7, "fp16": 125.0},
           "source": "NVIDIA Tesla V100 datasheet (2020), SXM2 16 GB"}
T4 = {"name": "t4-16gb", "family": "volta", "memory_gib": 14.75, "hbm_bandwidth_gbps": 320.0,
      "intra_node_bandwidth_gbps": 16.0, "intra_node_link": "pcie", "default_nic_gbps": 3.125, "gpus_per_node": 4,
      "gemm_efficiency": 0.6, "peak_tflops": {"fp32": 8.1, "fp16": 65.0},
      "source": "NVIDIA T4 datasheet (2019): 65 TFLOPS fp16 tensor, 320 GB/s GDDR6, PCIe Gen3 x16"}
TOML = """schema_version = 1
kind = "cluster"
name = "v100-t4-pools"

[[pools]]
name = "v100"
num_nodes = 3
gpus_per_node = 4
[pools.gpu]
name = "v100-sxm-16gb"
family = "volta"
memory_gib = 15.78
hbm_bandwidth_gbps = 900.0
intra_node_bandwidth_gbps = 150.0
default_nic_gbps = 3.125
gpus_per_node = 4
gemm_efficiency = 0.7
peak_tflops = { fp32 = 15.7, fp16 = 125.0 }

[[pools]]
name = "t4"
num_nodes = 1
gpus_per_node = 4
[pools.gpu]
name = "t4-16gb"
family = "volta"
memory_gib = 14.75
hbm_bandwidth_gbps = 320.0
intra_node_bandwidth_gbps = 16.0
intra_node_link = "pcie"
default_nic_gbps = 3.125
gpus_per_node = 4
gemm_efficiency = 0.6
peak_tflops = { fp32 = 8.1, fp16 = 65.0 }
"""


def v100_t4():
    return cluster_from_dict({"name": "v100-t4-pools", "pools": [
        {"name": "v100", "gpu": V100_16, "num_nodes": 3, "gpus_per_node": 4},
        {"name": "t4", "gpu": T4, "num_nodes": 1, "gpus_per_node": 4}]})


@pytest.fixture(scope="module")
def gpt2m():
    return load_model("gpt2-medium")


WORK = Workload(global_batch=32, seq_len=1024)


def test_defect_a_export_only_plan_on_one_pool_is_found(gpt2m):
    cluster = v100_t4()
    fixed = parse_plan("tp=1,pp=6,dp=2,precision=fp16,flash_attention=false,pools=v100")
    e = estimate(gpt2m, cluster, fixed, WORK)
    assert e.fits and not e.at_risk  # the plan fits on the V100 pool alone
    space = SearchSpace(base=Plan().replace(precision="fp16", flash_attention=False), allow_export_only=True)
    r = search(gpt2m, cluster, WORK, space)
    assert r.best_pooled is not None, r.explanation
    assert r.best_pooled.plan.pools == ("v100",) and r.best_pooled.fits
    assert r.best_pooled.step_time_s <= e.step_time_s * (1 + 1e-9)  # at least as fast as the plan
    assert any("export only (megatron)" in line for line in r.explanation)
    # no plan over several pools: each would need meshplan's runtime, which runs none of these shapes; said so
    assert r.best_multi is None
    assert any(n.startswith(BLOCKED) for n in r.notes)
    assert any("export-only" in line and "meshplan's runtime" in line for line in r.explanation)


def test_defect_a_cli(tmp_path, capsys):
    path = tmp_path / "v100-t4.toml"
    path.write_text(TOML)
    rc = main(["plan", "--model", "gpt2-medium", "--cluster", str(path), "--precision", "fp16",
               "--no-flash-attention", "--allow-export-only", "--global-batch", "32"])
    out = capsys.readouterr().out
    assert rc == 0 and "uses pool v100 alone" in out and "no plan fits" not in out


def test_defect_b_replicas_over_both_pools_are_found(gpt2m):
    cluster = v100_t4()
    plain = parse_plan("tp=1,pp=1,dp=16,micro_batch=1,precision=fp16,pools=v100:t4,pool_dp=12:4")
    e = estimate(gpt2m, cluster, plain, WORK)
    assert e.fits and not e.at_risk  # plain data parallelism over both pools fits
    r = search(gpt2m, cluster, WORK, SearchSpace(base=Plan().replace(precision="fp16")))
    rep = r.best_by_kind["replicas on pools"]
    assert rep is not None, r.explanation
    assert rep.plan.pools == ("v100", "t4") and rep.fits and not rep.at_risk
    assert not any("replicas on pools: none of the shapes tried fits" in line for line in r.explanation)


def test_replicas_take_a_smaller_micro_batch_when_the_shape_leaves_replicas_without_one(gpt2m):
    """A shape of 4-sample micro-batches has 8 in a step of 32: too few for 16 replicas. The search tries the
    largest smaller micro-batch that gives each replica one (here 2)."""
    from meshplan.search import pools as sp
    shape = parse_plan("tp=1,pp=1,dp=4,zero=1,micro_batch=4,precision=fp16")
    got = sp._enough_micro_batches(shape, 16, WORK)
    assert [p.micro_batch for p in got] == [2]
    assert sp._enough_micro_batches(shape, 8, WORK) == [shape]
    assert sp._enough_micro_batches(shape, 64, WORK) == []


@pytest.mark.parametrize("plan", [
    "tp=1,pp=1,dp=16,micro_batch=2,precision=fp16,dp_shares=1:1,pools=v100:t4,pool_dp=12:4",
    "tp=1,pp=4,dp=4,zero=1,micro_batch=1,precision=fp16,stage_layers=8:8:7:1,pools=v100:t4,pool_pp=3:1",
    "tp=1,pp=6,dp=2,precision=fp16,pools=v100"])
def test_pooled_estimate_has_the_per_term_breakdown(gpt2m, plan):
    """Item 3: a pooled estimate's time by term has every key a plan on one GPU type has, plus cross_pool (exposed)
    and pool_idle (apart); the exposed terms add up to the step, and each pool's part has its own terms."""
    from meshplan.cost.batch import TIME_KEYS
    e = estimate(gpt2m, v100_t4(), parse_plan(plan), WORK)
    assert set(TIME_KEYS) <= set(e.time) and {"cross_pool", "pool_idle"} <= set(e.time)
    exposed = sum(v for k, v in e.time.items() if not k.endswith("_overlapped") and k != "pool_idle")
    assert exposed == pytest.approx(e.step_time_s, rel=1e-9)
    assert e.time["pool_idle"] == pytest.approx(e.imbalance_s)
    assert e.time["compute"] > 0 and e.dominant in e.time
    if "pool_dp" in plan:
        assert e.time["cross_pool"] == pytest.approx(e.cross_pool_s) and e.cross_pool_s > 0
    for p in e.parts:
        assert p.time["compute"] > 0 and set(p.time) <= set(e.time)
    d = e.to_dict()
    assert d["time"] == e.time and all("time" in p for p in d["pools"])


def test_pooled_estimate_cli_shows_the_terms(tmp_path, capsys):
    import json
    path = tmp_path / "v100-t4.toml"
    path.write_text(TOML)
    args = ["estimate", "--model", "gpt2-medium", "--cluster", str(path), "--global-batch", "32", "--plan",
            "tp=1,pp=1,dp=16,micro_batch=2,precision=fp16,dp_shares=1:1,pools=v100:t4,pool_dp=12:4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "time per step (exposed; overlapped shown apart), along the slowest pool (t4)" in out
    assert "compute (fwd+bwd)" in out and "across pools (inter_pool)" in out
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["time"]["cross_pool"] > 0 and d["time"]["compute"] > 0 and "pool_idle" in d["time"]
