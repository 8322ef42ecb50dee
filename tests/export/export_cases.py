"""Plans exported in the real-parser tests: together they use every plan field an exporter maps."""
from __future__ import annotations

from meshplan.export import ExportInput
from meshplan.spec.io import load_model
from meshplan.spec.plan import parse_plan

CASES: dict[str, tuple[str, str | None, int, int | None]] = {
    # id: (plan, model, global batch, seq len)
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
}
NEEDS_MODEL = {"torchtitan", "megatron"}


def inputs(target: str) -> dict[str, ExportInput]:
    out = {}
    for name, (plan, model, gb, seq) in CASES.items():
        if model is None and target in NEEDS_MODEL:
            continue
        out[name] = ExportInput(plan=parse_plan(plan), model=load_model(model) if model else None,
                                global_batch=gb, seq_len=seq)
    return out


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
             "grad_sync": c(["auto", "all-reduce"]), "p2p_sharded": c([False, True]), "shard_group": c([0, 2])}
        if d["recompute"] == "full":
            d["recompute_layers"] = c([None, 0, 1, 2, 3])
        if d["pp"] > 1 and c([False, True]):
            base = [m.num_layers // d["pp"]] * d["pp"]
            base[0] -= d["virtual_stages"]
            base[-1] += d["virtual_stages"]
            d["stage_layers"] = tuple(base)
        try:
            i = ExportInput(plan=Plan(**d), model=m, global_batch=c([32, 64, 128]), seq_len=4096)
            check_plan(i)
        except MeshplanError:
            continue
        out[f"random{len(out)}"] = i
    return out
