"""`meshplan export` without the target tools: the mapping of every plan field, the unsupported
lists, the file formats and the command line (tests/export checks against the real parsers)."""
from __future__ import annotations

import functools
import json
import shlex
import subprocess
import sys
import tomllib

import pytest
from clirun import run
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshplan.errors import MeshplanError
from meshplan.export import ExportInput, export, render
from meshplan.export.common import stage_layer_counts, sync_groups, toml_text
from meshplan.export.megatron import layout
from meshplan.export.torchtitan import FT_CONFIG_MODULE, flavor
from meshplan.spec.base import to_dict
from meshplan.spec.io import cluster_from_dict, dump_toml, load_cluster, load_model, load_plan, plan_document
from meshplan.spec.plan import Plan, parse_plan

TARGETS = ("torchtitan", "megatron", "deepspeed")
LLAMA = load_model("llama3-8b")
GPT = load_model("gpt3-1.3b")
MIXTRAL = load_model("mixtral-8x7b")
HAS_OVERLAP = "sync_overlap" in Plan.flat_hints()
SYNC_FIELDS = ("grad_sync", "sync_every", "sync_scope", "grad_compression", "compression_rank") + \
    (("sync_overlap",) if HAS_OVERLAP else ())
"""The gradient-sync fields of a Plan (local SGD / DiLoCo, compression): each is exported or listed."""
TWO_DCS = {"name": "two-dcs", "gpu": "h100-sxm-80gb", "num_nodes": 4, "gpus_per_node": 8, "nodes_per_dc": 2,
           "inter_dc": {"bandwidth_gbps": 12.5, "latency_us": 2000, "kind": "wan", "shared": True}}


@functools.cache
def h100s(n: int):
    return load_cluster(f"h100-sxm-80gb:{n}")


def inp(plan: str, model=LLAMA, gb: int = 64, seq: int | None = 4096, cluster=None) -> ExportInput:
    return ExportInput(plan=parse_plan(plan), model=model, global_batch=gb, seq_len=seq, cluster=cluster)


def carried_sync_fields(target: str, i: ExportInput, res) -> set[str]:
    """The gradient-sync fields an export writes a setting for."""
    out = set()
    if target == "torchtitan":
        ft = res.config.get("fault_tolerance", {})
        if ft:
            out |= {"grad_sync", "sync_every"}  # semi_sync_method, sync_steps
            split = sync_groups(i)
            if split is not None and ft["group_size"] == split[1]:
                out.add("sync_scope")  # the replica groups
        if "fragment_sync_delay" in ft:
            out.add("sync_overlap")
        if ft.get("should_quantize"):
            out.add("grad_compression")
    elif "--grad-reduce-in-bf16" in res.config or "communication_data_type" in res.config:  # megatron, deepspeed
        out.add("grad_compression")
    return out


def assert_sync_fields_exported_or_listed(target: str, i: ExportInput, res) -> None:
    p, default = i.plan, Plan()
    carried = carried_sync_fields(target, i, res)
    for f in SYNC_FIELDS:
        if getattr(p, f) == getattr(default, f) or (f == "grad_sync" and not p.periodic):
            continue  # the default, or a synchronous collective (mapped as before)
        assert f in carried or any(f"{f}=" in u for u in res.unsupported), (target, f, p.short(), res.unsupported)


def megatron_flags(args: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    key = ""
    for a in args:
        if a.startswith("--"):
            assert a not in out, f"{a} given twice"
            key = a
            out[key] = []
        else:
            out[key].append(a)
    return out


def overrides_to_tables(overrides: list[str]) -> dict:
    """Invert torchtitan's --section.key value overrides (to compare them with the TOML tables)."""
    tables: dict = {}
    i = 0
    while i < len(overrides):
        flag = overrides[i][2:]
        section, key = flag.rsplit(".", 1)
        t = tables
        for part in section.split("."):
            t = t.setdefault(part, {})
        nxt = overrides[i + 1] if i + 1 < len(overrides) else "--"
        if nxt.startswith("--"):
            if key.startswith("no-"):
                t[key[3:]] = False
            else:
                t[key] = True
            i += 1
            continue
        values = []
        i += 1
        while i < len(overrides) and not overrides[i].startswith("--"):
            values.append(overrides[i])
            i += 1
        t[key] = values
    return tables


def _flatten(v):
    if isinstance(v, list):
        if v and isinstance(v[0], list):
            return [",".join(x) for x in v]
        return [",".join(map(str, v))]
    return [str(v)] if not isinstance(v, bool) else v


def assert_same_settings(tables: dict, cli: dict) -> None:
    for k, v in tables.items():
        if isinstance(v, dict):
            assert_same_settings(v, cli[k])
        else:
            assert _flatten(v) == cli[k], k


# ---- the mapping, over many plans ----------------------------------------------------------------

PLAN_FIELDS = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2, 4, 8]), "pp": st.sampled_from([1, 2, 4]), "dp": st.sampled_from([1, 2, 4, 8]),
    "cp": st.sampled_from([1, 2]), "zero": st.integers(0, 3), "micro_batch": st.sampled_from([1, 2]),
    "virtual_stages": st.sampled_from([1, 2]),
    "schedule": st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv"]),
    "recompute": st.sampled_from(["none", "selective", "op", "full"]),
    "recompute_layers": st.sampled_from([None, 0, 1, 2, 3]),
    "sequence_parallel": st.booleans(), "offload_optimizer": st.booleans(), "offload_params": st.booleans(),
    "precision": st.sampled_from(["bf16", "fp16", "fp8", "fp32"]), "compile": st.booleans(),
    "flash_attention": st.booleans(), "fused_loss": st.booleans(), "async_tp": st.booleans(),
    "grad_sync": st.sampled_from(["auto", "all-reduce", "reduce-scatter", "local-sgd", "diloco"]),
    "p2p_sharded": st.booleans(), "shard_group": st.sampled_from([0, 2]), "uneven": st.booleans(),
    "sync_every": st.sampled_from([1, 8]), "sync_scope": st.sampled_from(["all", "node"]),
    "grad_compression": st.sampled_from(["none", "bf16", "fp8", "powersgd"]),
    "compression_rank": st.sampled_from([1, 4]),
    **({"sync_overlap": st.sampled_from([0, 1])} if HAS_OVERLAP else {}),
})


def _plan(d: dict) -> Plan | None:
    d = dict(d)
    uneven = d.pop("uneven")
    if d["recompute"] != "full":
        d["recompute_layers"] = None
    if d["grad_sync"] not in ("local-sgd", "diloco"):  # valid combinations only
        d["sync_every"], d["sync_scope"] = 1, "all"
    if HAS_OVERLAP and d["sync_overlap"] >= d["sync_every"]:
        d["sync_overlap"] = 0
    if d["grad_compression"] != "powersgd":
        d["compression_rank"] = 1
    if uneven and d["pp"] > 1:
        base = [32 // d["pp"]] * d["pp"]
        base[0] -= d["virtual_stages"]
        base[-1] += d["virtual_stages"]
        d["stage_layers"] = tuple(base)
    try:
        return Plan(**d)
    except MeshplanError:
        return None


@pytest.mark.slow  # 150 random plans through every exporter
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(PLAN_FIELDS, st.sampled_from([64, 128]))
def test_every_target_maps_every_valid_plan(fields, gb):
    plan = _plan(fields)
    assume(plan is not None)
    i = ExportInput(plan=plan, model=LLAMA, global_batch=gb, seq_len=4096, cluster=h100s(plan.num_gpus))
    try:
        results = {t: export(t, i) for t in TARGETS}
    except MeshplanError as e:
        assert "cannot run" in str(e)
        assume(False)
        return
    p = plan
    m = i.microbatches
    # torchtitan: the TOML parses, the overrides say the same, the degrees multiply out
    tt = results["torchtitan"]
    text = render(tt)
    parsed = tomllib.loads(text)
    assert parsed == tt.config
    assert_same_settings(tt.config, overrides_to_tables(tt.overrides))
    par = parsed["parallelism"]
    groups = parsed["fault_tolerance"]["group_size"] if p.periodic else 1  # torchft: one job per replica group
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] * groups == p.dp
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["context_parallel_degree"]) == \
        (p.tp, p.pp, p.cp)
    tr = parsed["training"]
    assert tr["global_batch_size"] == gb
    if p.pp > 1:
        assert tr["local_batch_size"] == m * p.micro_batch and par["pipeline_parallel_microbatch_size"] == p.micro_batch
        chunks = 2 if p.schedule == "zbv" else p.virtual_stages
        if "module_fqns_per_model_part" in par:
            assert len(par["module_fqns_per_model_part"]) == p.pp * chunks
        else:
            assert par["pipeline_parallel_layers_per_stage"] * p.pp * chunks == LLAMA.num_layers
    else:
        assert tr["local_batch_size"] == p.micro_batch
    # megatron: every flag once, the degrees and the batch
    mg = megatron_flags(results["megatron"].config)
    assert mg["--tensor-model-parallel-size"] == [str(p.tp)] and mg["--pipeline-model-parallel-size"] == [str(p.pp)]
    assert mg["--context-parallel-size"] == [str(p.cp)]
    assert mg["--global-batch-size"] == [str(gb)] and mg["--micro-batch-size"] == [str(p.micro_batch)]
    assert ("--use-distributed-optimizer" in mg) == (p.zero >= 1 or p.offload_optimizer)
    assert ("--use-megatron-fsdp" in mg) == (p.zero >= 2)
    if "--pipeline-model-parallel-layout" in mg:
        assert mg["--pipeline-model-parallel-layout"][0].count("t") <= LLAMA.num_layers
    sh = render(results["megatron"], "sh")
    assert shlex.split(sh.split("MEGATRON_ARGS=(", 1)[1].rsplit(")", 1)[0]) == results["megatron"].config
    # deepspeed: the batch identity DeepSpeed checks
    ds = json.loads(render(results["deepspeed"]))
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * p.dp
    assert ds["zero_optimization"]["stage"] == p.zero
    assert ds["_meshplan_unsupported"] == results["deepspeed"].unsupported
    for r in results.values():  # everything unsupported is written into the file too
        body = render(r)
        for line in r.unsupported:
            assert line.split(":")[0] in body
    for target, r in results.items():  # every gradient-sync field: in the settings, or listed
        assert_sync_fields_exported_or_listed(target, i, r)


@pytest.mark.parametrize("plan,target,needle", [
    ("dp=8,zero=1,micro_batch=1", "torchtitan", "zero=1: torchtitan (FSDP2) has no optimizer-only sharding"),
    ("tp=2,dp=4,zero=3,micro_batch=1", "torchtitan", "sequence_parallel=0 with tp>1"),
    ("tp=2,dp=4,micro_batch=1,sequence_parallel=1", "torchtitan", "zero=0 (DDP) with TP/PP/CP"),
    ("dp=8,zero=3,micro_batch=1,precision=fp16", "torchtitan", "precision=fp16"),
    ("dp=8,zero=3,micro_batch=1,recompute=selective", "torchtitan", "recompute=selective"),
    ("dp=8,zero=3,micro_batch=1,fused_loss=1", "torchtitan", "fused_loss"),
    ("dp=8,zero=3,micro_batch=1,flash_attention=0", "torchtitan", "flash_attention=0"),
    ("dp=8,zero=1,micro_batch=1,offload_optimizer=1", "torchtitan", "offload_optimizer without offload_params"),
    ("tp=2,dp=4,zero=3,micro_batch=1,sequence_parallel=1,async_tp=1", "torchtitan", "async_tp without compile"),
    ("pp=4,dp=2,zero=1,micro_batch=1,recompute=full,recompute_layers=3", "torchtitan", "recompute_layers=3"),
    ("pp=4,dp=2,micro_batch=1,schedule=gpipe", "megatron", "schedule=gpipe"),
    ("pp=4,dp=2,micro_batch=1,schedule=zero-bubble", "megatron", "schedule=zero-bubble"),
    ("pp=4,dp=2,micro_batch=1,virtual_stages=2,schedule=zbv", "megatron", "schedule=zbv"),
    ("dp=8,zero=3,micro_batch=1,offload_params=1", "megatron", "offload_params"),
    ("dp=8,zero=1,micro_batch=1,recompute=op", "megatron", "recompute=op"),
    ("dp=8,zero=1,micro_batch=1,grad_sync=all-reduce", "megatron", "grad_sync=all-reduce"),
    ("tp=2,pp=2,dp=2,micro_batch=1", "megatron", "p2p_sharded=1 without sequence_parallel"),
    ("tp=2,dp=4,micro_batch=1,sequence_parallel=0,async_tp=1", "megatron", "async_tp without sequence_parallel"),
    ("pp=4,dp=2,micro_batch=1,schedule=gpipe", "deepspeed", "1F1B only"),
    ("pp=4,dp=2,micro_batch=1,virtual_stages=2,schedule=interleaved-1f1b", "deepspeed", "virtual_stages=2"),
    ("pp=2,dp=4,zero=2,micro_batch=1", "deepspeed", "ZeRO stage 0 or 1 only"),
    ("dp=4,cp=2,zero=1,micro_batch=1", "deepspeed", "Ulysses"),
    ("dp=8,zero=3,shard_group=4,micro_batch=1", "deepspeed", "hpZ"),
    ("dp=8,zero=1,shard_group=4,micro_batch=1", "deepspeed", "shard_group=4 with zero=1"),
    ("dp=8,zero=1,micro_batch=1,precision=fp8", "deepspeed", "precision=fp8"),
    ("dp=8,zero=1,micro_batch=1,compile=1", "deepspeed", "engine.compile()"),
    ("dp=8,zero=1,micro_batch=1,recompute=op", "deepspeed", "recompute=op"),
    ("tp=2,dp=4,zero=1,micro_batch=1,sequence_parallel=1", "deepspeed", "no Megatron-style sequence parallelism"),
    # gradient sync: local SGD / DiLoCo and compression
    ("dp=8,zero=3,micro_batch=1,grad_compression=bf16", "torchtitan", 'accepts only "float32"'),
    ("dp=8,zero=3,micro_batch=1,grad_compression=fp8", "torchtitan", "grad_compression=fp8: torchtitan 0.2.x"),
    ("dp=8,micro_batch=1,grad_compression=powersgd,compression_rank=4", "torchtitan",
     "grad_compression=powersgd (compression_rank=4): torchtitan has no setting for a DDP communication hook"),
    ("dp=8,micro_batch=1,grad_sync=diloco,sync_every=8,grad_compression=bf16", "torchtitan",
     "grad_compression=bf16 of the outer sync of grad_sync=diloco"),
    ("dp=8,micro_batch=1,grad_sync=local-sgd,sync_every=8,grad_compression=fp8", "torchtitan",
     "LocalSGD takes no quantization"),
    ("tp=2,dp=8,zero=3,micro_batch=1,sequence_parallel=1,grad_sync=diloco,sync_every=8,sync_scope=node",
     "torchtitan", "sync_scope=node: the replica groups (one per node) depend on the cluster"),
    ("dp=8,micro_batch=1,grad_sync=diloco,sync_every=8", "megatron",
     "grad_sync=diloco (sync_every=8, sync_scope=all): Megatron-LM has no local SGD or DiLoCo"),
    ("dp=8,micro_batch=1,grad_sync=local-sgd,sync_every=8,grad_compression=bf16", "megatron",
     "grad_compression=bf16 (of the outer sync of grad_sync=local-sgd): Megatron-LM has no outer sync"),
    ("dp=8,micro_batch=1,precision=fp16,grad_compression=bf16", "megatron",
     "--grad-reduce-in-bf16 acts only with --bf16"),
    ("dp=8,micro_batch=1,grad_compression=fp8", "megatron", "never fp8"),
    ("dp=8,micro_batch=1,grad_compression=powersgd,compression_rank=2", "megatron",
     "grad_compression=powersgd (compression_rank=2): Megatron-LM has no PowerSGD"),
    ("dp=8,micro_batch=1,grad_sync=local-sgd,sync_every=8", "deepspeed",
     "grad_sync=local-sgd (sync_every=8, sync_scope=all): DeepSpeed has no local SGD or DiLoCo"),
    ("dp=8,zero=1,micro_batch=1,grad_compression=fp8", "deepspeed", "communication_data_type takes fp16, bf16 or fp32"),
    ("dp=8,micro_batch=1,grad_compression=powersgd", "deepspeed", "DeepSpeed has no PowerSGD"),
])
def test_unsupported_parts_are_listed(plan, target, needle):
    res = export(target, inp(plan))
    assert any(needle in u for u in res.unsupported), res.unsupported
    assert_sync_fields_exported_or_listed(target, inp(plan), res)


def test_gradient_sync_mapping():
    """local-sgd/diloco -> torchtitan's torchft semi-sync settings (one job per replica group);
    bf16 compression -> Megatron's --grad-reduce-in-bf16 and DeepSpeed's communication_data_type."""
    plan = "tp=2,dp=16,zero=3,micro_batch=1,sequence_parallel=1,grad_sync=diloco,sync_every=50,sync_scope=node"
    res = export("torchtitan", inp(plan + ",grad_compression=fp8", gb=128, cluster=h100s(32)))
    cfg = res.config
    assert cfg["job"]["custom_config_module"] == FT_CONFIG_MODULE
    assert cfg["fault_tolerance"] == {"enable": True, "process_group": "nccl", "group_size": 4,
                                      "semi_sync_method": "diloco", "sync_steps": 50, "should_quantize": True}
    par = cfg["parallelism"]  # one replica group: 4 data-parallel ranks of a node (8 GPUs / tp=2)
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, 4)
    assert cfg["training"]["global_batch_size"] == 128  # the batch of all groups (FTManager.get_dp_info)
    assert res.unsupported == [] and any("launch 4 replica group(s) of 8 GPUs" in n for n in res.notes)
    assert any("torchft" in n for n in res.notes)
    assert "--fault_tolerance.sync_steps" in res.overrides and res.overrides[:4] == \
        ["--job.description", res.overrides[1], "--job.custom_config_module", FT_CONFIG_MODULE]
    # a datacenter-scoped DiLoCo: one replica group per datacenter
    dcs = cluster_from_dict(TWO_DCS)
    ft = export("torchtitan", inp("dp=32,zero=1,micro_batch=1,grad_sync=local-sgd,sync_every=4,sync_scope=dc",
                                  gb=128, cluster=dcs)).config["fault_tolerance"]
    assert (ft["group_size"], ft["semi_sync_method"], ft["sync_steps"]) == (2, "local_sgd", 4)
    # classic workers (sync_scope=all): one group per data-parallel rank; no cluster needed
    res = export("torchtitan", inp("dp=8,zero=0,micro_batch=1,grad_sync=local-sgd,sync_every=8"))
    assert res.config["fault_tolerance"]["group_size"] == 8 and "fault_tolerance" not in \
        export("torchtitan", inp("dp=8,zero=3,micro_batch=1")).config
    if HAS_OVERLAP:
        ft = export("torchtitan", inp("dp=8,micro_batch=1,grad_sync=diloco,sync_every=8,sync_overlap=1"))
        assert ft.config["fault_tolerance"]["fragment_sync_delay"] == 1
    # compression of the per-step sync
    mg = megatron_flags(export("megatron", inp("dp=8,zero=1,micro_batch=1,grad_compression=bf16")).config)
    assert "--grad-reduce-in-bf16" in mg and "--bf16" in mg
    assert "--grad-reduce-in-bf16" not in megatron_flags(export("megatron", inp("dp=8,zero=1,micro_batch=1")).config)
    ds = export("deepspeed", inp("dp=8,zero=2,micro_batch=1,grad_compression=bf16")).config
    assert ds["communication_data_type"] == "bf16"
    assert "communication_data_type" not in export("deepspeed", inp("dp=8,zero=2,micro_batch=1")).config


@pytest.mark.parametrize("plan,needle", [
    ("dp=8,zero=3,micro_batch=1,grad_compression=powersgd", "powersgd with zero=3"),
    ("dp=1,micro_batch=1,grad_sync=diloco,sync_every=8", "needs dp >= 2"),
    ("dp=8,zero=3,shard_group=4,micro_batch=1,grad_sync=diloco,sync_every=8,sync_scope=node", "shard_group with"),
])
@pytest.mark.parametrize("target", TARGETS)
def test_invalid_gradient_sync_is_refused(plan, needle, target):
    with pytest.raises(MeshplanError, match="cannot run") as e:
        export(target, inp(plan))
    assert needle in str(e.value)


def test_sync_scope_dc_needs_two_datacenters_when_the_cluster_is_known():
    plan = "dp=16,micro_batch=1,grad_sync=diloco,sync_every=8,sync_scope=dc"
    assert export("deepspeed", inp(plan)).unsupported  # without a cluster: exported, listed
    with pytest.raises(MeshplanError, match="one datacenter"):
        export("torchtitan", inp(plan, cluster=h100s(16)))


@pytest.mark.parametrize("target", TARGETS)
def test_a_plain_fsdp_plan_needs_no_caveat_in_torchtitan_and_megatron(target):
    res = export(target, inp("tp=8,dp=4,zero=3,micro_batch=1,sequence_parallel=1,compile=1,async_tp=1"))
    if target != "deepspeed":
        assert res.unsupported == []


def test_model_mapping():
    assert flavor(LLAMA) == ("llama3", "8B")
    assert flavor(load_model("llama3.1-405b")) == ("llama3", "405B")
    assert flavor(load_model("llama2-7b")) is None and flavor(GPT) is None
    tt = export("torchtitan", inp("dp=8,zero=3,micro_batch=1", model=load_model("llama2-7b")))
    assert tt.config["model"] == {"name": "llama3", "flavor": "llama2-7b"}
    assert "llama3_args['llama2-7b'] = TransformerModelArgs(dim=4096, n_layers=32" in tt.unsupported[0]
    gpt = export("torchtitan", inp("dp=8,zero=3,micro_batch=1", model=GPT, seq=2048))
    assert gpt.config["model"]["name"] == "gpt3-1.3b" and "not one of torchtitan's model families" in gpt.unsupported[0]
    mg = megatron_flags(export("megatron", inp("dp=8,micro_batch=1", model=GPT, seq=2048)).config)
    assert mg["--position-embedding-type"] == ["learned_absolute"] and mg["--normalization"] == ["LayerNorm"]
    assert "--disable-bias-linear" not in mg and "--untie-embeddings-and-output-weights" not in mg
    assert "--attention-dropout" not in mg and "--swiglu" not in mg  # GPT-3: dropout, GeLU
    mg = megatron_flags(export("megatron", inp("tp=2,dp=8,ep=4,micro_batch=1,sequence_parallel=1",
                                               model=MIXTRAL)).config)
    assert mg["--num-experts"] == ["8"] and mg["--moe-router-topk"] == ["2"]
    assert mg["--moe-ffn-hidden-size"] == ["14336"]
    assert mg["--expert-model-parallel-size"] == ["4"] and mg["--num-query-groups"] == ["8"]
    ds = export("deepspeed", inp("tp=2,dp=8,ep=4,micro_batch=1", model=MIXTRAL)).config
    assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 4}


def test_recompute_mapping():
    def tt(plan):
        return export("torchtitan", inp(plan)).config["activation_checkpoint"]

    def mg(plan):
        return megatron_flags(export("megatron", inp(plan)).config)

    assert tt("dp=8,zero=3,micro_batch=1,recompute=full") == {"mode": "full"}
    assert tt("dp=8,zero=3,micro_batch=1,recompute=op") == {"mode": "selective", "selective_ac_option": "op"}
    assert tt("dp=8,zero=3,micro_batch=1,recompute=full,recompute_layers=8") == \
        {"mode": "selective", "selective_ac_option": "4"}
    assert tt("dp=8,zero=3,micro_batch=1,recompute=full,recompute_layers=0") == {"mode": "none"}
    assert mg("dp=8,zero=1,micro_batch=1,recompute=full")["--recompute-method"] == ["uniform"]
    m = mg("pp=4,dp=2,zero=1,micro_batch=1,recompute=full,recompute_layers=3")
    assert (m["--recompute-method"], m["--recompute-num-layers"]) == (["block"], ["3"])
    assert "--recompute-granularity" not in mg("dp=8,zero=1,micro_batch=1,recompute=full,recompute_layers=0")
    assert mg("dp=8,zero=1,micro_batch=1,recompute=selective")["--recompute-granularity"] == ["selective"]
    ds = export("deepspeed", inp("pp=4,dp=2,micro_batch=1,recompute=full")).config
    assert ds["pipeline"]["activation_checkpoint_interval"] == 1 and "activation_checkpointing" in ds


def test_zero_and_hybrid_sharding_mapping():
    def par(plan):
        return export("torchtitan", inp(plan)).config["parallelism"]

    assert par("dp=8,micro_batch=1")["data_parallel_replicate_degree"] == 8  # DDP
    p = par("dp=8,zero=3,shard_group=4,micro_batch=1")
    assert (p["data_parallel_replicate_degree"], p["data_parallel_shard_degree"]) == (2, 4)
    assert p["fsdp_reshard_after_forward"] == "default"
    p = par("dp=4,cp=2,zero=3,shard_group=4,micro_batch=1")  # shard over dp_shard x cp = 2 x 2
    assert (p["data_parallel_replicate_degree"], p["data_parallel_shard_degree"]) == (2, 2)
    assert par("dp=8,zero=2,micro_batch=1")["fsdp_reshard_after_forward"] == "never"
    mg = megatron_flags(export("megatron", inp("dp=8,zero=3,shard_group=2,micro_batch=1")).config)
    assert mg["--data-parallel-sharding-strategy"] == ["optim_grads_params"] and mg["--ckpt-format"] == ["fsdp_dtensor"]
    assert mg["--num-distributed-optimizer-instances"] == ["4"]
    mg = megatron_flags(export("megatron", inp("dp=8,zero=1,micro_batch=1,offload_optimizer=1")).config)
    assert "--optimizer-cpu-offload" in mg and "--use-precision-aware-optimizer" in mg
    ds = export("deepspeed", inp("dp=8,zero=3,micro_batch=1,offload_params=1,offload_optimizer=1")).config
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "offload_param": {"device": "cpu", "pin_memory": True}}


def test_pipeline_stage_split():
    p = parse_plan("pp=4,dp=2,micro_batch=1,stage_layers=7:9:9:7")
    assert stage_layer_counts(32, p) == [7, 9, 9, 7]
    assert layout([7, 9, 9, 7]) == "Et*7|t*9|t*9|t*7L"
    assert layout([1, 0, 2]) == "Et||t*2L"
    p = parse_plan("pp=2,dp=2,micro_batch=1,virtual_stages=2,schedule=zbv")
    assert stage_layer_counts(32, p) == [8, 8, 8, 8]
    res = export("torchtitan", inp("pp=4,dp=2,micro_batch=1,stage_layers=7:9:9:7"))
    parts = res.config["parallelism"]["module_fqns_per_model_part"]
    assert parts[0][:2] == ["tok_embeddings", "layers.0"] and parts[-1][-2:] == ["norm", "output"]
    assert [len([n for n in part if n.startswith("layers.")]) for part in parts] == [7, 9, 9, 7]
    mg = megatron_flags(export("megatron", inp("pp=4,dp=2,micro_batch=1,virtual_stages=2,"
                                               "schedule=interleaved-1f1b")).config)
    assert mg["--num-layers-per-virtual-pipeline-stage"] == ["4"]


def test_toml_writer():
    text = toml_text({"a": {"x": 1, "y": [["p", "q"], ["r"]], "s": "v\"w", "b": True, "sub": {"z": 2.5}},
                      "weird key": {"k": "v"}})
    assert tomllib.loads(text) == {"a": {"x": 1, "y": [["p", "q"], ["r"]], "s": "v\"w", "b": True,
                                         "sub": {"z": 2.5}}, "weird key": {"k": "v"}}


def test_plans_that_cannot_run_are_refused():
    with pytest.raises(MeshplanError, match="cannot run.*not divisible by dp\\*micro_batch"):
        export("deepspeed", inp("dp=8,micro_batch=3"))
    with pytest.raises(MeshplanError, match="tp=3"):
        export("megatron", inp("tp=3,dp=1,micro_batch=1"))
    with pytest.raises(MeshplanError, match="needs the model"):
        export("megatron", inp("dp=8,micro_batch=1", model=None))
    with pytest.raises(MeshplanError, match="needs the global batch"):
        export("deepspeed", ExportInput(plan=parse_plan("dp=8")))
    with pytest.raises(MeshplanError, match="unknown export target"):
        export("jax", inp("dp=8"))


# ---- the command line ---------------------------------------------------------------------------

def test_cli_writes_each_target(capsys, tmp_path):
    plan = "tp=2,pp=2,dp=2,zero=1,micro_batch=1,sequence_parallel=1,schedule=gpipe"
    for target, name in (("torchtitan", "job.toml"), ("megatron", "args.sh"), ("megatron", "args.json"),
                         ("deepspeed", "ds.json")):
        out = tmp_path / name
        code, stdout, err = run(capsys, "export", "--plan", plan, "--to", target, "--out", str(out),
                                "--model", "llama3-8b", "--global-batch", "64")
        assert code == 0, err
        assert stdout == "" and f"wrote {out}" in err
        text = out.read_text()
        if name.endswith(".toml"):
            tomllib.loads(text)
        elif name.endswith(".json"):
            json.loads(text)
        else:
            assert "MEGATRON_ARGS=(" in text and "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    assert "cannot express" in err and "1F1B only" in err  # deepspeed's caveats on stderr


def test_cli_reads_model_and_batch_from_a_plan_file(capsys, tmp_path):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan_document(parse_plan("dp=8,zero=3,micro_batch=2"), model="llama3-8b",
                                          cluster="h100-sxm-80gb:8", global_batch=64, seq_len=2048)))
    code, out, err = run(capsys, "export", "--plan", str(f), "--to", "megatron")
    assert code == 0, err
    flags = megatron_flags(shlex.split(out.split("MEGATRON_ARGS=(", 1)[1].rsplit(")", 1)[0]))
    assert flags["--global-batch-size"] == ["64"] and flags["--seq-length"] == ["2048"]
    assert flags["--num-layers"] == ["32"] and flags["--micro-batch-size"] == ["2"]
    code, out, err = run(capsys, "export", "--plan", str(f), "--to", "deepspeed", "--global-batch", "128")
    assert code == 2 and "--global-batch 128 disagrees with the plan file's 64" in err  # cli/planfile.py
    code, out, err = run(capsys, "export", "--plan", str(f), "--to", "deepspeed", "--global-batch", "128",
                         "--override")
    assert code == 0 and json.loads(out)["train_batch_size"] == 128
    assert "--global-batch 128 replaces the plan file's 64" in err


@pytest.mark.parametrize("suffix", ["json", "toml"])
def test_cli_exports_the_sync_fields_of_a_plan_file(capsys, tmp_path, suffix):
    """The gradient-sync fields go through a plan file (JSON or TOML) into the export."""
    plan = parse_plan("dp=8,zero=1,micro_batch=1,grad_sync=diloco,sync_every=25,grad_compression=fp8"
                      + (",sync_overlap=1" if HAS_OVERLAP else ""))
    doc = plan_document(plan, model="llama3-8b", global_batch=64, seq_len=2048)
    f = tmp_path / f"plan.{suffix}"
    f.write_text(json.dumps(doc) if suffix == "json" else dump_toml(doc))
    assert load_plan(str(f)) == plan
    code, out, err = run(capsys, "export", "--plan", str(f), "--to", "torchtitan")
    assert code == 0, err
    ft = tomllib.loads(out)["fault_tolerance"]
    assert (ft["semi_sync_method"], ft["sync_steps"], ft["should_quantize"], ft["group_size"]) == \
        ("diloco", 25, True, 8)
    code, out, err = run(capsys, "export", "--plan", str(f), "--to", "deepspeed")
    assert code == 0 and "grad_sync=diloco (sync_every=25, sync_scope=all" in err
    assert json.loads(out)["_meshplan"]["plan"] == plan.short()
    assert to_dict(plan)["sync_every"] == 25


def test_cli_plan_out_then_export(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, _, err = run(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:4", "--global-batch",
                       "8", "--seq-len", "64", "--out", str(path))
    assert code == 0, err
    for target in TARGETS:
        code, out, err = run(capsys, "export", "--plan", str(path), "--to", target)
        assert code == 0, err
        assert out


@pytest.mark.parametrize("argv,needle", [
    (["--plan", "dp=8", "--to", "jax"], "invalid choice: 'jax'"),
    (["--plan", "missing.json", "--to", "deepspeed", "--global-batch", "8"], "file not found: missing.json"),
    (["--plan", "dp=8", "--to", "deepspeed"], "needs the global batch size"),
    (["--plan", "dp=8", "--to", "megatron", "--global-batch", "8"], "needs the model"),
    (["--plan", "dp=8", "--to", "torchtitan", "--global-batch", "8"], "needs the model"),
    (["--plan", "dp=8,micro_batch=3", "--to", "deepspeed", "--global-batch", "8"], "cannot run"),
    (["--plan", "dp=8", "--to", "deepspeed", "--global-batch", "0"],
     "argument --global-batch: must be a positive integer"),
    (["--plan", "dp=8", "--to", "megatron", "--global-batch", "8", "--model", "llama9"], "unknown model"),
    (["--plan", "dp=8,bogus=1", "--to", "deepspeed", "--global-batch", "8"], "unknown key 'bogus'"),
    (["--plan", "dp=8", "--to", "deepspeed", "--global-batch", "8", "--out", "/nonexistent/dir/x.json"],
     "cannot write --out"),
    (["--plan", "dp=8", "--to", "deepspeed", "--global-batch", "8", "--out", ""], "empty --out"),
])
def test_cli_bad_input_is_one_line(capsys, argv, needle):
    code, out, err = run(capsys, "export", *argv)
    assert code == 2
    assert err.startswith("meshplan: error: ") and err.count("\n") == 1, err
    assert needle in err, err


def test_cli_plan_file_with_an_unknown_model(capsys, tmp_path):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan_document(parse_plan("dp=8"), model="my-custom-model", global_batch=8)))
    code, _, err = run(capsys, "export", "--plan", str(f), "--to", "megatron")
    assert code == 2 and "model 'my-custom-model' recorded in the plan file" in err and "--model" in err
    f.write_text(json.dumps(plan_document(parse_plan("dp=8"), global_batch="eight")))
    code, _, err = run(capsys, "export", "--plan", str(f), "--to", "deepspeed")
    assert code == 2 and "'global_batch' must be a positive integer" in err


def test_export_imports_no_torch():
    code = ("import sys; from meshplan.cli.main import main; "
            "[main(['export', '--plan', 'tp=2,pp=2,dp=2,micro_batch=1', '--to', t, '--model', 'llama3-8b', "
            "'--global-batch', '16', '--out', '/dev/null']) for t in ('torchtitan', 'megatron', 'deepspeed')]; "
            "sys.exit(1 if any(m in sys.modules for m in ('torch', 'deepspeed', 'megatron', 'torchtitan')) else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_cli_ingested_models_have_no_shape_to_export(capsys, tmp_path):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan_document(parse_plan("dp=8"), model="hf:org/config.json", global_batch=16)))
    code, _, err = run(capsys, "export", "--plan", str(f), "--to", "megatron")
    assert code == 2 and "needs a transformer ModelSpec" in err and err.count("\n") == 1
    code, out, err = run(capsys, "export", "--plan", str(f), "--to", "deepspeed")  # DeepSpeed takes no shape
    assert code == 0 and json.loads(out)["gradient_accumulation_steps"] == 2
    code, _, err = run(capsys, "export", "--plan", "dp=8", "--to", "torchtitan", "--global-batch", "8",
                       "--model", "module:pkg.mod:factory")
    assert code == 2 and "needs a transformer ModelSpec" in err


def test_torchtitan_mixed_precision_needs_fsdp():
    res = export("torchtitan", inp("tp=8,pp=4,dp=1,micro_batch=1,sequence_parallel=1", gb=32))
    assert any("computes in fp32" in u for u in res.unsupported)
    assert not any("fp32" in u for u in export("torchtitan", inp("tp=8,dp=4,zero=3,micro_batch=1,"
                                                                 "sequence_parallel=1")).unsupported)
