"""Plans exported in the real-parser tests: together they use every plan field an exporter maps."""
from __future__ import annotations

import functools

from meshplan.export import ExportInput
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.io import cluster_from_dict, load_cluster, load_model
from meshplan.spec.plan import Plan, parse_plan

HAS_OVERLAP = "sync_overlap" in Plan.flat_hints()
"""Plan.sync_overlap (streaming DiLoCo's delayed outer sync), where this meshplan has it."""
OVERLAP = ",sync_overlap=1" if HAS_OVERLAP else ""

TWO_DCS = {"name": "two-dcs", "gpu": "h100-sxm-80gb", "num_nodes": 4, "gpus_per_node": 8, "nodes_per_dc": 2,
           "step_jitter": 0.02, "inter_dc": {"bandwidth_gbps": 12.5, "latency_us": 2000, "kind": "wan", "shared": True}}
"""Two datacenters of two 8-GPU nodes, joined by one shared link."""


@functools.cache
def cluster(arg: str | None) -> ClusterSpec | None:
    """A cluster shorthand (GPU:COUNT), or "two-dcs"."""
    if arg is None:
        return None
    return cluster_from_dict(TWO_DCS) if arg == "two-dcs" else load_cluster(arg)


CASES: dict[str, tuple] = {
    # id: (plan, model, global batch, seq len[, cluster])
    "fsdp-op-compile": ("dp=8,zero=3,micro_batch=2,recompute=op,compile=1,fused_loss=1", "llama3-8b", 64, 4096),
    "tp-pp-vpp-sp-async": ("tp=8,pp=4,dp=4,zero=1,micro_batch=1,virtual_stages=2,schedule=interleaved-1f1b,"
                           "recompute=full,sequence_parallel=1,async_tp=1,compile=1", "llama3.1-70b", 512, 8192),
    "405b-uneven-cp-hsdp-fp8": ("tp=8,pp=8,dp=2,cp=2,zero=3,shard_group=2,micro_batch=1,"
                                "stage_layers=15:16:16:16:16:16:16:15,recompute=full,recompute_layers=4,"
                                "sequence_parallel=1,precision=fp8", "llama3.1-405b", 256, 8192),
    "moe-ep": ("tp=2,dp=8,ep=4,zero=1,micro_batch=1,sequence_parallel=1,recompute=selective",
               "mixtral-8x7b", 256, 4096),
    "gpt3-gpipe-offload": ("tp=8,pp=8,dp=2,zero=1,micro_batch=1,schedule=gpipe,offload_optimizer=1,"
                           "recompute=selective,sequence_parallel=1,grad_sync=all-reduce", "gpt3-175b", 512, 2048),
    "zbv-cp-partial": ("pp=2,dp=2,cp=2,zero=1,micro_batch=1,virtual_stages=2,schedule=zbv,recompute=full,"
                       "recompute_layers=2,offload_params=0", "llama2-7b", 64, 4096),
    "zero-bubble-ddp": ("pp=4,dp=2,micro_batch=2,schedule=zero-bubble,precision=fp16,flash_attention=0",
                        "llama3-8b", 64, 2048),
    "fsdp-offload-fp32": ("dp=4,zero=3,micro_batch=1,offload_params=1,offload_optimizer=1,precision=fp32,"
                          "recompute=full,recompute_layers=0", "gpt3-1.3b", 32, 2048),
    "ddp-only": ("dp=16,micro_batch=4", None, 128, None),
    "diloco-fsdp-node-fp8": ("tp=2,dp=16,zero=3,micro_batch=1,sequence_parallel=1,grad_sync=diloco,sync_every=50,"
                             "sync_scope=node,grad_compression=fp8", "llama3-8b", 128, 4096, "h100-sxm-80gb:32"),
    "diloco-dc-bf16": ("dp=32,zero=1,micro_batch=1,grad_sync=diloco,sync_every=20,sync_scope=dc,grad_compression=bf16"
                       + OVERLAP, "llama3-8b", 128, 4096, "two-dcs"),
    "local-sgd-workers": ("pp=2,dp=4,micro_batch=1,grad_sync=local-sgd,sync_every=8", "llama3-8b", 32, 2048),
    "ddp-powersgd": ("dp=8,micro_batch=1,grad_compression=powersgd,compression_rank=4", "gpt3-1.3b", 32, 2048),
    "fsdp-bf16-reduce": ("tp=2,dp=8,zero=3,micro_batch=1,sequence_parallel=1,grad_compression=bf16", "llama3-8b",
                         64, 4096),
}
NEEDS_MODEL = {"torchtitan", "megatron"}


def inputs(target: str) -> dict[str, ExportInput]:
    out = {}
    for name, (plan, model, gb, seq, *where) in CASES.items():
        if model is None and target in NEEDS_MODEL:
            continue
        out[name] = ExportInput(plan=parse_plan(plan), model=load_model(model) if model else None,
                                global_batch=gb, seq_len=seq, cluster=cluster(where[0] if where else None))
    return out


def sync_fields(c) -> dict:  # type: ignore[no-untyped-def]
    """Random valid gradient-sync fields (``c``: random.Random.choice): periodic ones only with
    local-sgd/diloco, compression_rank only with powersgd."""
    d = {"grad_sync": c(["auto", "all-reduce", "reduce-scatter", "local-sgd", "diloco"]),
         "grad_compression": c(["none", "none", "bf16", "fp8", "powersgd"])}
    if d["grad_sync"] in ("local-sgd", "diloco"):
        d["sync_every"], d["sync_scope"] = c([1, 4, 50]), c(["all", "node", "dc"])
        if HAS_OVERLAP and d["sync_every"] > 1:
            d["sync_overlap"] = c([0, 1])
    if d["grad_compression"] == "powersgd":
        d["compression_rank"] = c([1, 4])
    return d


def cluster_for(plan: Plan, dcs: bool) -> ClusterSpec:
    """H100 nodes of 8 (fewer GPUs: one node) holding the plan's GPUs; ``dcs``: two datacenters where
    the node count is even."""
    n = plan.num_gpus
    c = cluster(f"h100-sxm-80gb:{n}")
    assert c is not None
    if dcs and c.num_nodes % 2 == 0:
        return cluster_from_dict({**TWO_DCS, "num_nodes": c.num_nodes, "nodes_per_dc": c.num_nodes // 2})
    return c


def random_inputs(n: int, seed: int, model: str = "llama3-8b") -> dict[str, ExportInput]:
    """``n`` random plans that can run (every field drawn), deterministic for a seed."""
    import random

    from meshplan.errors import MeshplanError
    from meshplan.export.common import check_plan
    from meshplan.spec.plan import Plan
    rng = random.Random(seed)
    m = load_model(model)
    out: dict[str, ExportInput] = {}
    while len(out) < n:
        c = rng.choice
        d = {"tp": c([1, 2, 4, 8]), "pp": c([1, 2, 4]), "dp": c([1, 2, 4]), "cp": c([1, 2]), "zero": c([0, 1, 2, 3]),
             "micro_batch": c([1, 2]), "virtual_stages": c([1, 2]),
             "schedule": c(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv"]),
             "recompute": c(["none", "selective", "op", "full"]), "sequence_parallel": c([False, True]),
             "offload_optimizer": c([False, True]), "offload_params": c([False, True]),
             "precision": c(["bf16", "fp16", "fp8", "fp32"]), "compile": c([False, True]),
             "flash_attention": c([False, True]), "fused_loss": c([False, True]), "async_tp": c([False, True]),
             "p2p_sharded": c([False, True]), "shard_group": c([0, 2]), **sync_fields(c)}
        if d["recompute"] == "full":
            d["recompute_layers"] = c([None, 0, 1, 2, 3])
        if d["pp"] > 1 and c([False, True]):
            base = [m.num_layers // d["pp"]] * d["pp"]
            base[0] -= d["virtual_stages"]
            base[-1] += d["virtual_stages"]
            d["stage_layers"] = tuple(base)
        try:
            plan = Plan(**d)
            i = ExportInput(plan=plan, model=m, global_batch=c([32, 64, 128]), seq_len=4096,
                            cluster=cluster_for(plan, dcs=plan.sync_scope == "dc"))
            check_plan(i)
        except MeshplanError:
            continue
        out[f"random{len(out)}"] = i
    return out
