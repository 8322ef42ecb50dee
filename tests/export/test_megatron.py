"""`meshplan export --to megatron` against Megatron-LM's argument names and megatron-core's configs.

See megatron_lm_args.py for what is real and what is transcribed: the flags are Megatron-LM's own
add_argument calls (megatron-core's wheel does not ship megatron/training/arguments.py), and every
parsed value then goes through the installed megatron-core TransformerConfig (with
ModelParallelConfig), DistributedDataParallelConfig, OptimizerConfig, PipelineParallelLayerLayout and
micro-batch calculator, which validate it.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import warnings
from typing import Any

import pytest
from export_cases import inputs, random_inputs
from megatron_lm_args import core_configs, dests_reach_core, parse, validate

from meshplan.export import ExportInput, export, render

CASES = {**inputs("megatron"), **random_inputs(30, seed=30)}


def _check(args: list[str], env: dict[str, str], world: int, mc: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ns = validate(parse(args, mc.AttnBackend), world, mc.Layout, env)
        return ns, core_configs(ns, mc)


def test_every_flag_reaches_megatron_core(megatron: Any) -> None:
    assert dests_reach_core(megatron) == set()


@pytest.mark.parametrize("name", list(CASES))
def test_export_validates_in_megatron_core(name: str, megatron: Any) -> None:
    inp = CASES[name]
    p, m = inp.plan, inp.model
    assert m is not None
    res = export("megatron", inp)
    ns, core = _check(res.config, res.env, p.num_gpus, megatron)
    t = core.transformer
    assert (t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.context_parallel_size,
            t.expert_model_parallel_size) == (p.tp, p.pp, p.cp, p.ep)
    assert ns.data_parallel_size == p.dp
    assert core.microbatches == inp.microbatches
    chunks = 2 if p.schedule == "zbv" else p.virtual_stages
    assert (t.virtual_pipeline_model_parallel_size or 1) == (chunks if p.pp > 1 else 1)
    assert t.sequence_parallel == (p.sequence_parallel and p.tp > 1)
    assert (t.num_layers, t.hidden_size, t.ffn_hidden_size, t.num_attention_heads) == \
        (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads)
    assert (t.num_query_groups or t.num_attention_heads) == m.kv_heads
    assert t.gated_linear_unit == (m.mlp_type == "swiglu")
    assert t.add_bias_linear == m.bias
    assert t.normalization == {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[m.norm]
    assert (t.num_moe_experts or 1) == m.num_experts
    if m.is_moe:
        assert (t.moe_router_topk, t.moe_ffn_hidden_size) == (m.experts_per_token, m.expert_ffn)
    assert ns.untie_embeddings_and_output_weights == (not m.tied_embeddings)
    assert (ns.seq_length, ns.global_batch_size, ns.micro_batch_size) == (inp.seq_len, inp.global_batch, p.micro_batch)
    assert t.bf16 == (p.precision in ("bf16", "fp8")) and t.fp16 == (p.precision == "fp16")
    assert (t.fp8 is not None) == (p.precision == "fp8")
    assert core.ddp.use_distributed_optimizer == (p.zero >= 1 or p.offload_optimizer)
    strategy = {0: "no_shard", 1: "no_shard", 2: "optim_grads", 3: "optim_grads_params"}[p.zero]
    assert core.ddp.data_parallel_sharding_strategy == strategy and core.ddp.use_megatron_fsdp == (p.zero >= 2)
    if p.zero and 0 < p.shard_group < p.dp * p.cp:
        assert core.ddp.num_distributed_optimizer_instances * p.shard_group == p.dp * p.cp
    assert core.optimizer.optimizer_cpu_offload == p.offload_optimizer
    # gradients reduced in fp32 under --bf16 unless --grad-reduce-in-bf16 (grad_compression=bf16); no periodic sync
    bf16_reduce = p.grad_compression == "bf16" and not p.periodic and t.bf16
    assert core.ddp.grad_reduce_in_fp32 == (t.bf16 and not bf16_reduce)
    assert ("--grad-reduce-in-bf16" in res.config) == bf16_reduce
    if p.periodic:
        assert any(u.startswith(f"grad_sync={p.grad_sync} (sync_every={p.sync_every}") for u in res.unsupported)
    if p.recompute == "full" and p.recompute_layers != 0:
        assert t.recompute_granularity == "full"
        if p.recompute_layers is not None:
            assert (t.recompute_method, t.recompute_num_layers) == ("block", p.recompute_layers)
    elif p.recompute in ("selective", "op"):
        assert t.recompute_granularity == "selective"
    else:
        assert t.recompute_granularity is None
    assert t.cross_entropy_loss_fusion == p.fused_loss
    assert t.tp_comm_overlap == (p.async_tp and p.tp > 1 and p.sequence_parallel)
    assert t.attention_backend.name == ("flash" if p.flash_attention else "unfused")
    if t.pipeline_model_parallel_layout is not None:  # parsed and validated by megatron-core
        layout = t.pipeline_model_parallel_layout
        assert sum(len(chunk) for rank in layout.layout for chunk in rank) == m.num_layers + 2


@pytest.mark.parametrize("name", ["tp-pp-vpp-sp-async", "405b-uneven-cp-hsdp-fp8"])
def test_shell_and_json_forms_carry_the_same_arguments(name: str, tmp_path: Any) -> None:
    res = export("megatron", CASES[name])
    script = tmp_path / "args.sh"
    script.write_text(render(res, "sh") + 'printf "%s\\n" "${MEGATRON_ARGS[@]}"\nenv | grep ^CUDA_ || true\n')
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[:len(res.config)] == res.config
    assert out[len(res.config):] == [f"{k}={v}" for k, v in res.env.items()]
    doc = json.loads(render(res, "json"))
    assert doc["args"] == res.config and doc["env"] == res.env
    assert doc["_meshplan_unsupported"] == res.unsupported
    assert shlex.split(" ".join(shlex.quote(a) for a in res.config)) == res.config


def test_misspelled_arguments_are_rejected(megatron: Any) -> None:
    """The checks the tests rely on do reject typos: a flag, a choice, and a config field."""
    inp = CASES["tp-pp-vpp-sp-async"]
    res = export("megatron", inp)
    _check(res.config, res.env, inp.plan.num_gpus, megatron)  # the real export passes
    bad = [a.replace("--tensor-model-parallel-size", "--tensor-model-paralel-size") for a in res.config]
    with pytest.raises(argparse.ArgumentError):
        _check(bad, res.env, inp.plan.num_gpus, megatron)
    bad = [a.replace("uniform", "uniformly") for a in res.config]
    with pytest.raises(argparse.ArgumentError):
        _check(bad, res.env, inp.plan.num_gpus, megatron)
    with pytest.raises(argparse.ArgumentError):  # no abbreviations, as in Megatron-LM
        _check([*res.config, "--sequence-par"], res.env, inp.plan.num_gpus, megatron)
    with pytest.raises(TypeError, match="tensor_model_paralel_size"):
        megatron.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, tensor_model_paralel_size=2)
    with pytest.raises((AssertionError, ValueError)):  # megatron-core's own validation: a bad layout
        megatron.TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=2,
                                   pipeline_dtype=None, pipeline_model_parallel_layout="Et*2|t*3L")


# ---- placement (mesh_order) ----------------------------------------------------------------------
def groups_of(plan: Any) -> dict[str, list[list[int]]]:
    """meshplan's rank groups per axis under the plan's placement (ParallelDims.rank_grid), sorted."""
    import numpy as np

    from meshplan.spec.axes import AXES
    grid = plan.dims.rank_grid()
    out = {}
    for i, a in enumerate(AXES):
        rows = np.moveaxis(grid, i, -1).reshape(-1, grid.shape[i])
        out[a] = sorted(sorted(int(r) for r in row) for row in rows)
    return out


@pytest.mark.parametrize("plan,mapped", [
    ("tp=2,pp=2,dp=2,cp=2", True),
    ("tp=2,pp=2,dp=2,cp=2,mesh_order=dp:pp:cp:tp", True),  # --use-tp-pp-dp-mapping
    ("tp=2,pp=4,dp=2,mesh_order=dp:cp:pp:tp", True),  # cp=1: the same layout as dp:pp:cp:tp
    ("tp=2,pp=2,dp=2,mesh_order=tp:pp:dp:cp", False),
    ("tp=2,pp=2,dp=2,cp=2,mesh_order=pp:dp:tp:cp", False),
])
def test_placement_is_megatrons_rank_order_or_unsupported(plan: str, mapped: bool, megatron: Any) -> None:
    """A placement Megatron-LM has (its default or --use-tp-pp-dp-mapping) is exported, and megatron-core's
    own RankGenerator then groups exactly the ranks the plan places together; any other placement is an
    unsupported line (exported with Megatron's default order, whose groups then differ)."""
    from meshplan.spec.io import load_model
    from meshplan.spec.plan import parse_plan
    p = parse_plan(plan)
    inp = ExportInput(plan=p, model=load_model("llama3-8b"), global_batch=64, seq_len=4096)
    res = export("megatron", inp)
    _, core = _check(res.config, res.env, p.num_gpus, megatron)
    got = {a: sorted(sorted(g) for g in gs) for a, gs in core.rank_groups.items()}
    lines = [u for u in res.unsupported if u.startswith("mesh_order=")]
    assert (got == groups_of(p)) == mapped, (got, groups_of(p))
    assert bool(lines) == (not mapped), res.unsupported
    assert ("--use-tp-pp-dp-mapping" in res.config) == (mapped and core.rank_order == "tp-cp-ep-pp-dp")
    if not mapped:
        assert got == groups_of(p.replace(mesh_order=None))
