"""Spec layer: JSON round trips, helpful errors for unknown names, and named feasibility checks."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.errors import MeshplanError
from meshplan.spec import ClusterSpec, GPUSpec, LinkTier, ModelSpec, Plan, Workload, constraints, parse_plan
from meshplan.spec.base import from_dict, to_dict
from meshplan.spec.cluster import default_links
from meshplan.spec.io import (
    dump_json,
    dump_toml,
    load_cluster,
    load_gpu,
    load_model,
    load_plan,
    parse_cluster_shorthand,
    plan_document,
    preset_names,
)
from meshplan.spec.plan import (
    GRAD_COMPRESSION,
    GRAD_SYNC,
    PERIODIC_SYNC,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    SYNC_SCOPES,
)

# --------------------------------------------------------------------------------------
# helpers


def json_round_trip(obj):
    """to_dict -> JSON text -> dict -> from_dict of the same class."""
    text = json.dumps(to_dict(obj))
    return from_dict(type(obj), json.loads(text))


def write_toml(path: Path, data: dict) -> Path:
    """Writes with the library's own TOML writer (meshplan.spec.io.dump_toml)."""
    path.write_text(dump_toml(data))
    return path


@pytest.fixture(scope="module")
def llama() -> ModelSpec:
    return load_model("llama3-8b")


@pytest.fixture(scope="module")
def h100x64() -> ClusterSpec:
    return load_cluster("h100-sxm-80gb:64")


# --------------------------------------------------------------------------------------
# presets and shorthand


def test_llama3_8b_preset(llama):
    assert llama.name == "llama3-8b"
    assert (llama.num_layers, llama.hidden_size, llama.num_attention_heads, llama.kv_heads) == (32, 4096, 32, 8)
    assert llama.mlp_type == "swiglu" and llama.seq_len == 8192
    assert llama.num_params() == 8_030_261_248  # matches the published count in the preset's [meta]


def test_load_model_seq_len_override():
    assert load_model("llama3-8b", seq_len=4096).seq_len == 4096


@pytest.mark.parametrize("name", ["a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb", "h100-sxm-96gb-500w"])
def test_gpu_presets_load(name):
    g = load_gpu(name)
    assert g.name == name and g.peak("bf16") > 0 and g.memory_gib > 0
    assert name in preset_names("gpus")


@pytest.mark.parametrize("arg, nodes, per_node", [
    ("h100-sxm-80gb:64", 8, 8),
    ("h100-sxm-80gb:8", 1, 8),
    ("h100-sxm-80gb:4", 1, 4),
    ("a100-sxm-80gb:4x8", 4, 8),
    ("a100-sxm-80gb:2X4", 2, 4),
    ("a100-sxm-80gb", 1, 8),
    ("H100-SXM-80GB:16", 2, 8),
])
def test_cluster_shorthand(arg, nodes, per_node):
    c = load_cluster(arg)
    assert (c.num_nodes, c.gpus_per_node) == (nodes, per_node)
    assert c.num_gpus == nodes * per_node
    assert c.intra_node.bandwidth_gbps == c.gpu.intra_node_bandwidth_gbps
    assert c.inter_node.bandwidth_gbps == c.gpu.default_nic_gbps
    assert parse_cluster_shorthand(arg) == c


@pytest.mark.parametrize("arg, words", [
    ("h100-sxm-80gb:12", ["not a whole number of 8-GPU nodes", "h100-sxm-80gb:16", "2x6"]),
    ("h100-sxm-80gb:0", ["GPU count must be a positive integer"]),
    ("h100-sxm-80gb:-8", ["GPU count must be a positive integer"]),
    ("h100-sxm-80gb:lots", ["cannot read GPU count", "GPU:COUNT"]),
    ("h100-sxm-80gb:0x8", ["must be positive"]),
    ("h100-sxm-80gb:2x", ["cannot read GPU count"]),
    ("", ["empty --cluster"]),
    ("   ", ["empty --cluster"]),
])
def test_cluster_shorthand_errors(arg, words):
    with pytest.raises(MeshplanError) as ei:
        load_cluster(arg)
    for w in words:
        assert w in str(ei.value)


def test_missing_cluster_preset_directory_is_not_a_crash(monkeypatch, tmp_path):
    # git does not keep empty directories: a fresh clone may have no presets/clusters/.
    import meshplan.spec.io as io
    monkeypatch.setattr(io, "_preset_dir", lambda kind: tmp_path / "nope" / kind)
    assert io.preset_names("clusters") == []
    with pytest.raises(MeshplanError):
        io.load_cluster("some-cluster")


# --------------------------------------------------------------------------------------
# JSON round trips


def test_model_round_trip(llama):
    assert json_round_trip(llama) == llama
    moe = llama.replace(name="moe", num_experts=8, experts_per_token=2, expert_ffn_hidden_size=4096,
                        head_dim=128, max_position_embeddings=16384, position="learned",
                        norm="layernorm", bias=True, tied_embeddings=True, embedding_norm=True,
                        causal=False, mlp_type="gelu_4h")
    assert json_round_trip(moe) == moe


@pytest.mark.parametrize("name", ["a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb", "h100-sxm-96gb-500w"])
def test_gpu_round_trip(name):
    g = load_gpu(name)
    assert json_round_trip(g) == g


def test_cluster_round_trip(h100x64):
    assert json_round_trip(h100x64) == h100x64
    intra, inter = default_links(h100x64.gpu)
    multi = h100x64.replace(
        name="two-dc", num_nodes=8, nodes_per_dc=4, price_per_gpu_hour_usd=1.25,
        inter_dc=LinkTier(name="inter_dc", bandwidth_gbps=1.5, latency_us=2000.0, efficiency=0.5, kind="wan"))
    assert json_round_trip(multi) == multi
    assert multi.tier_for_span(8) == multi.intra_node
    assert multi.tier_for_span(16) == multi.inter_node
    assert multi.tier_for_span(64) == multi.inter_dc
    assert multi.price_per_hour == 1.25 and h100x64.price_per_hour == h100x64.gpu.price_per_hour_usd


def test_files_round_trip(tmp_path, llama, h100x64):
    """Spec -> .json / .toml file -> load_* gives the same spec."""
    (tmp_path / "m.json").write_text(dump_json(llama))
    assert load_model(str(tmp_path / "m.json")) == llama
    assert load_model(str(write_toml(tmp_path / "m.toml", to_dict(llama)))) == llama

    (tmp_path / "c.json").write_text(dump_json(h100x64))
    assert load_cluster(str(tmp_path / "c.json")) == h100x64
    assert load_cluster(str(write_toml(tmp_path / "c.toml", to_dict(h100x64)))) == h100x64

    g = h100x64.gpu
    (tmp_path / "g.json").write_text(dump_json(g))
    assert load_gpu(str(tmp_path / "g.json")) == g

    plan = Plan(tp=8, pp=4, dp=2, virtual_stages=2, schedule="interleaved-1f1b", stage_layers=(8, 8, 8, 8))
    (tmp_path / "p.json").write_text(json.dumps(plan_document(plan, model="llama3-8b")))
    assert load_plan(str(tmp_path / "p.json")) == plan
    assert load_plan(str(write_toml(tmp_path / "p.toml", to_dict(plan)))) == plan


def test_cluster_file_with_preset_gpu_and_partial_links(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('schema_version = 1\nkind = "cluster"\nname = "mine"\ngpu = "a100-sxm-80gb"\n'
                    'num_nodes = 4\n\n[inter_node]\nbandwidth_gbps = 12.5\n\n[meta]\nsource = "me"\n')
    c = load_cluster(str(path))
    assert c.gpu == load_gpu("a100-sxm-80gb")
    assert c.num_gpus == 32
    assert c.inter_node.bandwidth_gbps == 12.5 and c.inter_node.name == "inter_node"
    assert c.inter_node.latency_us == default_links(c.gpu)[1].latency_us


HAS_OVERLAP = "sync_overlap" in Plan.flat_hints()


@st.composite
def sync_fields(draw) -> dict:
    """Gradient-sync fields in valid combinations: sync_every / sync_scope (/ sync_overlap) only with
    local-sgd or diloco, compression_rank only with powersgd."""
    d = {"grad_sync": draw(st.sampled_from(GRAD_SYNC)), "grad_compression": draw(st.sampled_from(GRAD_COMPRESSION))}
    if d["grad_sync"] in PERIODIC_SYNC:
        d["sync_every"] = draw(st.integers(1, 10**6))
        d["sync_scope"] = draw(st.sampled_from(SYNC_SCOPES))
        if HAS_OVERLAP:
            d["sync_overlap"] = draw(st.integers(0, 100))
    if d["grad_compression"] == "powersgd":
        d["compression_rank"] = draw(st.integers(1, 1024))
    return d


@st.composite
def plans(draw) -> Plan:
    pp = draw(st.integers(1, 16))
    recompute = draw(st.sampled_from(RECOMPUTE))
    return Plan(
        tp=draw(st.sampled_from([1, 2, 4, 8, 16, 3, 10**12])),
        pp=pp,
        dp=draw(st.integers(1, 4096)),
        cp=draw(st.integers(1, 64)),
        ep=draw(st.integers(1, 64)),
        zero=draw(st.integers(0, 3)),
        shard_group=draw(st.integers(0, 512)),
        micro_batch=draw(st.integers(1, 64)),
        virtual_stages=draw(st.integers(1, 8)),
        schedule=draw(st.sampled_from(SCHEDULES)),
        recompute=recompute,
        recompute_layers=draw(st.none() | st.integers(0, 100)) if recompute == "full" else None,
        sequence_parallel=draw(st.booleans()),
        offload_optimizer=draw(st.booleans()),
        offload_params=draw(st.booleans()),
        precision=draw(st.sampled_from(PRECISIONS)),
        compile=draw(st.booleans()),
        async_tp=draw(st.booleans()),
        stage_layers=draw(st.none() | st.lists(st.integers(0, 200), min_size=pp, max_size=pp).map(tuple)),
        **draw(sync_fields()),
    )


@settings(max_examples=300, deadline=None)
@given(plans())
def test_plan_round_trips(plan):
    assert json_round_trip(plan) == plan
    text = plan.short()
    assert " " not in text and "\n" not in text
    assert parse_plan(text) == plan
    assert load_plan(text) == plan


def test_plan_short_examples():
    assert Plan().short() == "tp=1,pp=1,dp=1,micro_batch=1"
    p = Plan(tp=8, pp=2, dp=4, zero=1, sequence_parallel=True, stage_layers=(15, 17))
    assert p.short() == "tp=8,pp=2,dp=4,zero=1,micro_batch=1,sequence_parallel=1,stage_layers=15:17"


def test_parse_plan_aliases():
    p = parse_plan(" TP=8, pp=2 ,dp=4,mbs=2,vpp=2,schedule=interleaved,sp=true,ac=full,fsdp=fsdp,hsdp=2, ")
    assert p == Plan(tp=8, pp=2, dp=4, micro_batch=2, virtual_stages=2, schedule="interleaved-1f1b",
                     sequence_parallel=True, recompute="full", zero=3, shard_group=2)
    assert parse_plan("zero=yes").zero == 3
    assert parse_plan("schedule=ZB").schedule == "zero-bubble"
    assert parse_plan("stage_layers=3;5,pp=2").stage_layers == (3, 5)
    assert parse_plan("compile=no,async_tp=1").async_tp is True


@pytest.mark.parametrize("text, words", [
    ("", ["empty plan string"]),
    ("tp", ["'tp' is not key=value"]),
    ("tp=8,tp=4", ["'tp' given twice"]),
    ("tp=eight", ["plan: tp", "expected an integer", "'eight'"]),
    ("tp=0", ["plan: tp must be > 0"]),
    ("zero=4", ["zero must be 0, 1, 2 or 3"]),
    ("sequence_parallel=maybe", ["expected true/false"]),
    ("pp=2,stage_layers=1:x", ["stage_layers", "'x'"]),
    ("pp=2,stage_layers=4", ["stage_layers has 1 entries but pp=2"]),
    ("recompute_layers=2", ["recompute_layers needs recompute=full"]),
    ("precision=int8", ["precision must be one of"]),
])
def test_parse_plan_errors(text, words):
    with pytest.raises(MeshplanError) as ei:
        parse_plan(text)
    for w in words:
        assert w in str(ei.value)


# --------------------------------------------------------------------------------------
# unknown names suggest the close match


def _did_you_mean(err: MeshplanError, suggestion: str) -> None:
    msg = str(err).lower()
    assert "did you mean" in msg, msg
    assert suggestion in str(err), str(err)


def test_unknown_model_field_suggests(llama, tmp_path):
    d = to_dict(llama)
    d["num_layer"] = d.pop("num_layers")
    with pytest.raises(MeshplanError) as ei:
        from_dict(ModelSpec, d)
    _did_you_mean(ei.value, "'num_layers'")
    assert "unknown field 'num_layer'" in str(ei.value)
    assert "known fields:" in str(ei.value) and ei.value.hint

    d = to_dict(llama)
    d["hidden_sise"] = d.pop("hidden_size")
    (tmp_path / "m.json").write_text(json.dumps(d))
    with pytest.raises(MeshplanError) as ei:
        load_model(str(tmp_path / "m.json"))
    _did_you_mean(ei.value, "'hidden_size'")
    assert str(tmp_path / "m.json") in str(ei.value)


def test_unknown_gpu_and_link_fields_suggest(tmp_path, h100x64):
    d = to_dict(h100x64.gpu)
    d["memory_gb"] = d.pop("memory_gib")
    with pytest.raises(MeshplanError) as ei:
        from_dict(GPUSpec, d)
    _did_you_mean(ei.value, "'memory_gib'")

    c = to_dict(h100x64)
    c["gpus_per_nod"] = c.pop("gpus_per_node")
    (tmp_path / "c.json").write_text(json.dumps(c))
    with pytest.raises(MeshplanError) as ei:
        load_cluster(str(tmp_path / "c.json"))
    _did_you_mean(ei.value, "'gpus_per_node'")

    c = to_dict(h100x64)
    c["intra_node"] = {"bandwith_gbps": 100.0}
    (tmp_path / "c.json").write_text(json.dumps(c))
    with pytest.raises(MeshplanError) as ei:
        load_cluster(str(tmp_path / "c.json"))
    _did_you_mean(ei.value, "'bandwidth_gbps'")
    assert "intra_node" in str(ei.value)


def test_unknown_plan_key_suggests(tmp_path):
    with pytest.raises(MeshplanError) as ei:
        parse_plan("tp=8,dp=8,micro_bach=2")
    _did_you_mean(ei.value, "'micro_batch'")
    assert "known keys:" in str(ei.value)
    with pytest.raises(MeshplanError) as ei:
        parse_plan("tp=8,shedule=1f1b")
    _did_you_mean(ei.value, "'schedule'")
    (tmp_path / "p.json").write_text(json.dumps({"plan": {"tp": 8, "virtual_stage": 2}}))
    with pytest.raises(MeshplanError) as ei:
        load_plan(str(tmp_path / "p.json"))
    _did_you_mean(ei.value, "'virtual_stages'")


def test_bad_choice_values_suggest(llama):
    with pytest.raises(MeshplanError) as ei:
        parse_plan("schedule=1f1c")
    _did_you_mean(ei.value, "'1f1b'")
    with pytest.raises(MeshplanError) as ei:
        parse_plan("recompute=selectiv")
    _did_you_mean(ei.value, "'selective'")
    with pytest.raises(MeshplanError) as ei:
        llama.replace(mlp_type="swiglue")
    _did_you_mean(ei.value, "'swiglu'")
    with pytest.raises(MeshplanError) as ei:
        from_dict(ModelSpec, {**to_dict(llama), "norm": "rmsnrom"})
    _did_you_mean(ei.value, "'rmsnorm'")


def test_unknown_preset_names_suggest():
    with pytest.raises(MeshplanError) as ei:
        load_model("llama3-8")
    _did_you_mean(ei.value, "llama3-8b")
    assert "known models:" in str(ei.value)
    with pytest.raises(MeshplanError) as ei:
        load_cluster("h100-sxm-80g:64")
    _did_you_mean(ei.value, "h100-sxm-80gb")
    with pytest.raises(MeshplanError) as ei:
        load_gpu("a100-sxm-80")
    _did_you_mean(ei.value, "a100-sxm-80gb")


def test_other_field_errors(llama, tmp_path):
    with pytest.raises(MeshplanError, match="missing required field"):
        from_dict(ModelSpec, {"num_layers": 2})
    with pytest.raises(MeshplanError, match="expected an integer"):
        from_dict(ModelSpec, {**to_dict(llama), "num_layers": "many"})
    with pytest.raises(MeshplanError, match="expected an integer"):
        from_dict(ModelSpec, {**to_dict(llama), "num_layers": True})
    with pytest.raises(MeshplanError, match="num_kv_heads=5 must divide"):
        from_dict(ModelSpec, {**to_dict(llama), "num_kv_heads": 5})
    with pytest.raises(MeshplanError, match="set head_dim"):
        llama.replace(num_attention_heads=48)
    with pytest.raises(MeshplanError, match="experts_per_token=3 exceeds"):
        llama.replace(experts_per_token=3)
    with pytest.raises(MeshplanError, match="needs at least bf16 or fp16"):
        dataclasses.replace(load_gpu("h100-sxm-80gb"), peak_tflops={"fp32": 1.0})
    with pytest.raises(MeshplanError, match="schema_version 2 is not supported"):
        (tmp_path / "m.json").write_text(json.dumps({**to_dict(llama), "schema_version": 2}))
        load_model(str(tmp_path / "m.json"))
    with pytest.raises(MeshplanError, match="file not found"):
        load_model(str(tmp_path / "missing.toml"))
    with pytest.raises(MeshplanError, match="not valid TOML"):
        (tmp_path / "bad.toml").write_text("num_layers = = 3")
        load_model(str(tmp_path / "bad.toml"))
    with pytest.raises(MeshplanError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        load_model(str(tmp_path / "bad.json"))
    with pytest.raises(MeshplanError, match="not available yet"):
        load_model("hf:meta-llama/Meta-Llama-3-8B")


# --------------------------------------------------------------------------------------
# named feasibility predicates

WORK = Workload(global_batch=512, seq_len=8192)
MOE = dict(num_experts=8, experts_per_token=2)

# (check name, plan, model changes, cluster shorthand, workload, words the reason must contain)
GRAPH_ONLY_CHECKS = ("no layer for tensor parallel", "model cannot be pipelined",
                     "no replicated activations for sequence parallel", "no attention for context parallel")
"""Rules a transformer description cannot break; tests/unit/test_layer_graph.py breaks each on a graph."""

BAD_PLANS = [
    ("invalid gradient sync", Plan(dp=64, zero=3, grad_compression="powersgd"), {}, None, WORK,
     ["powersgd", "zero=3", "use zero=0"]),
    ("invalid gradient sync", Plan(dp=64, grad_sync="diloco", sync_scope="dc"), {}, None, WORK,
     ["sync_scope=dc", "one datacenter"]),
    ("invalid gradient sync", Plan(dp=64, grad_sync="diloco", sync_scope="node", zero=1, shard_group=8), {}, None,
     WORK, ["shard_group", "inner group"]),
    ("invalid gradient sync", Plan(dp=8, grad_sync="local-sgd", sync_scope="node"), {}, "h100-sxm-80gb:8",
     WORK, ["all 8 data-parallel ranks lie in one node", "use sync_scope=all"]),
    ("gpu count mismatch", Plan(tp=8, pp=2, dp=8), {}, None, WORK,
     ["8*2*8*1 = 128", "64 GPUs", "change dp to 4"]),
    ("gpu count mismatch", Plan(tp=2, pp=32, dp=1), {}, "h100-sxm-80gb:8x6", WORK,
     ["= 64 does not equal the cluster's 48 GPUs"]),
    ("tp does not divide heads", Plan(tp=8, dp=8), dict(num_attention_heads=36, num_kv_heads=4, head_dim=128),
     None, WORK, ["tp=8", "36 attention heads"]),
    ("tp does not divide heads", Plan(tp=8, dp=8), dict(num_attention_heads=48, num_kv_heads=6, head_dim=128),
     None, WORK, ["tp=8", "(6 kv heads)", "divides both"]),
    ("tp does not divide layer widths", Plan(tp=8, dp=8), dict(ffn_hidden_size=14340), None, WORK,
     ["tp=8", "ffn_hidden_size=14340"]),
    ("tp larger than a node", Plan(tp=16, dp=3), {}, "h100-sxm-80gb:8x6", Workload(global_batch=480, seq_len=8192),
     ["tp=16 is not a whole number of nodes (6 GPUs each)", "multiple of 6"]),
    ("tp larger than a node", Plan(tp=4, dp=12), {}, "h100-sxm-80gb:8x6", Workload(global_batch=480, seq_len=8192),
     ["tp=4 does not divide the 6 GPUs of a node"]),
    ("layers do not split into stages", Plan(tp=8, pp=4, dp=2, virtual_stages=3, schedule="interleaved-1f1b"),
     {}, None, WORK, ["32 layers", "pp*virtual_stages = 4*3", "stage_layers"]),
    ("layers do not split into stages", Plan(tp=8, pp=8, dp=1, virtual_stages=8, schedule="interleaved-1f1b"),
     {}, None, WORK, ["pp*virtual_stages = 64 exceeds the 32 layers"]),
    ("layers do not split into stages", Plan(tp=8, pp=2, dp=4, stage_layers=(16, 15)), {}, None, WORK,
     ["stage_layers sum to 31", "32 layers"]),
    ("layers do not split into stages", Plan(tp=8, pp=2, dp=4, virtual_stages=2, schedule="interleaved-1f1b",
                                              stage_layers=(15, 17)), {}, None, WORK,
     ["divisible by virtual_stages"]),
    ("batch not divisible", Plan(tp=8, dp=8, micro_batch=3), {}, None, WORK,
     ["global batch 512", "dp*micro_batch = 8*3"]),
    ("schedule incompatible", Plan(tp=8, pp=2, dp=4, virtual_stages=2, schedule="1f1b"), {}, None, WORK,
     ["virtual_stages=2 needs schedule=interleaved-1f1b", "1f1b"]),
    ("schedule incompatible", Plan(tp=8, pp=2, dp=4, schedule="zbv"), {}, None, WORK,
     ["zbv", "virtual_stages=2"]),
    ("schedule incompatible", Plan(tp=8, pp=2, dp=4, virtual_stages=2, schedule="interleaved-1f1b"), {}, None,
     Workload(global_batch=12, seq_len=8192), ["micro-batches per step (3)", "pp=2"]),
    ("cp does not divide sequence", Plan(tp=8, dp=4, cp=2), {}, None, Workload(global_batch=512, seq_len=8194),
     ["seq_len 8194", "2*cp = 4"]),
    ("sequence parallel without tp", Plan(tp=1, dp=64, sequence_parallel=True), {}, None, WORK,
     ["sequence_parallel needs tp > 1"]),
    ("zero=2 under a pipeline", Plan(tp=8, pp=2, dp=4, zero=2), {}, None, WORK,
     ["zero=2 with pp > 1", "use zero=1", "zero=3"]),
    ("recompute_layers beyond the stage", Plan(tp=8, dp=8, recompute="full", recompute_layers=100), {}, None,
     WORK, ["recompute_layers=100", "32 blocks", "use at most 32"]),
    ("recompute_layers beyond the stage", Plan(tp=8, pp=2, dp=4, recompute="full", recompute_layers=17,
                                                stage_layers=(16, 16)), {}, None, WORK, ["use at most 16"]),
    ("invalid expert parallel", Plan(tp=8, dp=8, ep=2), {}, None, WORK,
     ["ep=2", "no experts", "use ep=1"]),
    ("invalid expert parallel", Plan(tp=8, dp=8, ep=3), MOE, None, WORK,
     ["ep=3 does not divide num_experts=8"]),
    ("invalid expert parallel", Plan(tp=8, pp=2, dp=4, ep=8), MOE, None, WORK,
     ["ep=8 must divide dp*cp = 4"]),
    ("invalid hybrid sharding", Plan(tp=8, dp=8, shard_group=2), {}, None, WORK,
     ["shard_group", "needs zero >= 1"]),
    ("invalid hybrid sharding", Plan(tp=8, dp=8, zero=3, shard_group=3), {}, None, WORK,
     ["shard_group=3 must divide dp*cp = 8"]),
    ("invalid offload", Plan(tp=8, dp=8, zero=1, offload_params=True), {}, None, WORK,
     ["offload_params needs zero=3"]),
    ("invalid offload", Plan(tp=8, dp=8, offload_optimizer=True), {}, None, WORK,
     ["offload_optimizer needs zero >= 1"]),
    ("precision unsupported", Plan(tp=8, dp=8, precision="fp8"), {}, "a100-sxm-80gb:64", WORK,
     ["precision=fp8", "a100-sxm-80gb", "use bf16"]),
    ("invalid site order", Plan(tp=8, pp=2, dp=4, site_order=(1, 0)), {}, None, WORK,
     ["site_order=1:0 names 2 sites but the cluster has 1", "drop site_order"]),
    ("invalid site order", Plan(tp=8, dp=32, site_order=(1, 0)), {}, "two-dc-h100", WORK,
     ["every pipeline stage inside one site", "pp=1"]),
]


def test_every_check_has_a_bad_plan():
    # the rules a transformer description cannot break (it has attention, TP-split layers, a
    # replicated hidden state and a pipeline-able forward) are exercised on layer graphs in
    # tests/unit/test_layer_graph.py
    assert {case[0] for case in BAD_PLANS} | set(GRAPH_ONLY_CHECKS) == set(constraints.CHECKS)


@pytest.mark.parametrize("name, plan, model_changes, cluster_arg, work, words", BAD_PLANS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_PLANS)])
def test_check_fires_with_helpful_reason(llama, h100x64, name, plan, model_changes, cluster_arg, work, words):
    model = llama.replace(**model_changes) if model_changes else llama
    cluster = load_cluster(cluster_arg) if cluster_arg else h100x64
    found = constraints.violations(model, cluster, plan, work)
    # Each hand-made plan breaks exactly the one rule it is built to break.
    assert [n for n, _ in found] == [name], found
    reason = found[0][1]
    assert reason == constraints.CHECKS[name](constraints.Context(model, cluster, plan, work))
    assert "\n" not in reason and len(reason) < 300
    for w in words:
        assert w in reason, (w, reason)
    assert constraints.violations(model, cluster, plan, work, skip=(name,)) == []


GOOD_PLANS = [
    Plan(tp=8, dp=8),
    Plan(tp=1, dp=64),
    Plan(tp=4, pp=2, dp=8, zero=1, micro_batch=2),
    Plan(tp=8, pp=4, dp=2, virtual_stages=2, schedule="interleaved-1f1b"),
    Plan(tp=8, pp=2, dp=4, virtual_stages=2, schedule="zbv"),
    Plan(tp=8, pp=2, dp=4, schedule="zero-bubble", stage_layers=(15, 17), recompute="full", recompute_layers=4),
    Plan(tp=2, dp=16, cp=2, sequence_parallel=True, zero=3, shard_group=8, offload_params=True,
         offload_optimizer=True),
    Plan(tp=8, dp=8, precision="fp8", async_tp=True, compile=True, sequence_parallel=True),
    Plan(tp=8, pp=8, schedule="gpipe", micro_batch=4),
]


@pytest.mark.parametrize("plan", GOOD_PLANS, ids=lambda p: p.short())
def test_good_plans_have_no_violations(llama, h100x64, plan):
    assert constraints.violations(llama, h100x64, plan, WORK) == []


def test_moe_good_plan(llama, h100x64):
    assert constraints.violations(llama.replace(**MOE), h100x64, Plan(tp=8, dp=8, ep=8), WORK) == []


def test_tp_replicating_kv_heads_is_allowed(llama):
    # tp=16 > 8 kv heads: kv heads are replicated (16 % 8 == 0), which is fine.
    cluster = load_cluster("h100-sxm-80gb:4x16")
    assert constraints.violations(llama, cluster, Plan(tp=16, dp=4), WORK) == []


# --------------------------------------------------------------------------------------
# the gradient-sync plan fields and the weak-link cluster fields through files

TWO_DCS = ClusterSpec(name="two-dcs", gpu=load_gpu("h100-sxm-80gb"), num_nodes=4, gpus_per_node=8,
                      intra_node=default_links(load_gpu("h100-sxm-80gb"))[0],
                      inter_node=default_links(load_gpu("h100-sxm-80gb"))[1], nodes_per_dc=2, step_jitter=0.03,
                      inter_dc=LinkTier(name="inter_dc", bandwidth_gbps=12.5, latency_us=2000.0, kind="wan",
                                        shared=True))


@settings(max_examples=100, deadline=None)
@given(plans(), st.sampled_from(["json", "toml"]))
def test_sync_fields_round_trip_through_plan_files(tmp_path_factory, plan, suffix):
    """What `meshplan plan --out` writes (plan_document, with the cluster spec) reads back exactly:
    the plan by load_plan, the cluster (step_jitter, a shared inter_dc link) by cluster_from_dict."""
    from meshplan.spec.io import read_plan_file, spec_fields
    from meshplan.spec.io import cluster_from_dict
    doc = plan_document(plan, model="llama3-8b", cluster="two-dcs", global_batch=64,
                        **spec_fields(None, TWO_DCS))
    path = tmp_path_factory.mktemp("plans") / f"plan.{suffix}"
    path.write_text(json.dumps(doc) if suffix == "json" else dump_toml(doc))
    assert load_plan(str(path)) == plan
    pf = read_plan_file(str(path))
    assert pf is not None and cluster_from_dict(pf.cluster_spec) == TWO_DCS


@pytest.mark.parametrize("dump", [dump_json, dump_toml])
def test_cluster_step_jitter_and_shared_link_round_trip(tmp_path, dump):
    suffix = "json" if dump is dump_json else "toml"
    path = tmp_path / f"c.{suffix}"
    path.write_text(dump(TWO_DCS))
    c = load_cluster(str(path))
    assert c == TWO_DCS and c.step_jitter == 0.03 and c.inter_dc is not None and c.inter_dc.shared
    assert json_round_trip(TWO_DCS) == TWO_DCS
    # as written by hand: [inter_dc] shared = true, the rest from the defaults
    path = tmp_path / "hand.toml"
    path.write_text('gpu = "h100-sxm-80gb"\nnum_nodes = 4\nnodes_per_dc = 2\nstep_jitter = 0.05\n\n'
                    '[inter_dc]\nbandwidth_gbps = 5\nshared = true\n')
    c = load_cluster(str(path))
    assert c.step_jitter == 0.05 and c.inter_dc.shared and not c.inter_node.shared
    assert load_cluster(str(write_toml(tmp_path / "again.toml", to_dict(c)))) == c


def test_sync_fields_short_form_examples():
    p = parse_plan("dp=16,grad_sync=diloco,h=50,sync_scope=node,compression=fp8")
    assert (p.sync_every, p.grad_compression) == (50, "fp8")
    assert p.short() == "tp=1,pp=1,dp=16,micro_batch=1,grad_sync=diloco,sync_every=50,sync_scope=node," \
        "grad_compression=fp8"
    assert parse_plan(p.short()) == p
    q = parse_plan("dp=8,compression=powersgd,powersgd_rank=4")
    assert parse_plan(q.short()) == q and "compression_rank=4" in q.short()
