"""Every top plan meshplan recommends runs: a tiny-scale stand-in of each trains on CPU (issue 11).

For a grid of searches (the headline cases among them), the top plans are shrunk to at most 4
CPU processes and a tiny model of the same kind, keeping what the runtime does differently per
plan: the schedule and its virtual stages, uneven stages, the ZeRO level, recomputation,
sequence / context / expert parallelism, hybrid sharding, offload, and tensor and pipeline
parallelism of degree 2. `meshplan train` then runs 3 steps; the losses must be finite and the
run must end cleanly (the runtime accepts the plan and the step works).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import meshplan_train

from meshplan.search.driver import search
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

BUDGET = 4  # processes
SEQ = 32

GRID = [  # (model, cluster, global batch, seq len), top plans
    ("llama3-70b", "h100-sxm-80gb:256", 512, 8192, 3),   # headline: NeMo / torchtitan Llama 3 70B
    ("gpt3-175b", "a100-sxm-80gb:1024", 1536, 2048, 2),  # headline: Megatron SC'21 / KOR22 GPT-3 175B
    ("llama3.1-405b", "h100-sxm-80gb:16384", 2048, 8192, 1),  # uneven stages by default
    ("mixtral-8x7b", "h100-sxm-80gb:32", 128, 4096, 1),
    ("llama3-8b", "a100-sxm-40gb:16", 64, 4096, 1),
]


def stand_in(plan: Plan, real: ModelSpec) -> tuple[Plan, int, dict]:
    """(plan on <= BUDGET processes, global batch, tiny model's fields) keeping the plan's and the
    model's kind (tied embeddings, positions, norm, MLP, biases, experts, a vocabulary the plan's
    tp does not divide when the real one's does not)."""
    moe = real.is_moe
    deg = {"pp": 1, "dp": 1, "tp": 1, "cp": 1}
    n = 1
    for axis in ("pp", "dp", "tp", "cp"):  # pipeline and sharding first: they change the most code
        if getattr(plan, axis) > 1 and n * 2 <= BUDGET:
            deg[axis] = 2
            n *= 2
    dpc = deg["dp"] * deg["cp"]
    ep = 2 if plan.ep > 1 and dpc % 2 == 0 else 1
    v = plan.virtual_stages if deg["pp"] > 1 else 1
    blocks_per_chunk = 2
    layers = max(2, deg["pp"] * v * blocks_per_chunk)
    stage_layers = None
    if plan.stage_layers is not None and deg["pp"] > 1:  # uneven: one more chunk on the first stage
        stage_layers = (v * (blocks_per_chunk + 1), v * (blocks_per_chunk - 1))
    micro = 2 * deg["pp"] if deg["pp"] > 1 else 2
    rl = None
    if plan.recompute_layers is not None:
        rl = max(1, min(plan.recompute_layers, layers // deg["pp"] - 1))
    small = Plan(
        tp=deg["tp"], pp=deg["pp"], dp=deg["dp"], cp=deg["cp"], ep=ep, zero=plan.zero if dpc > 1 else 0,
        shard_group=0, micro_batch=1, virtual_stages=v, schedule=plan.schedule if deg["pp"] > 1 else "1f1b",
        recompute=plan.recompute, recompute_layers=rl, sequence_parallel=plan.sequence_parallel and deg["tp"] > 1,
        offload_optimizer=plan.offload_optimizer, offload_params=plan.offload_params and plan.zero == 3,
        precision="fp32", compile=False, stage_layers=stage_layers,
        p2p_sharded=plan.sequence_parallel and deg["tp"] > 1 or deg["tp"] == 1)
    if small.zero == 2 and small.pp > 1:
        small = small.replace(zero=1)
    model = dict(num_layers=layers, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                 vocab_size=256 if real.vocab_size % plan.tp == 0 else 257, seq_len=SEQ,
                 mlp_type=f'"{real.mlp_type}"', position=f'"{real.position}"', norm=f'"{real.norm}"',
                 tied_embeddings=str(real.tied_embeddings).lower(), bias=str(real.bias).lower())
    if real.position == "learned":
        model["max_position_embeddings"] = SEQ
    if moe:
        model |= dict(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=64)
    return small, deg["dp"] * micro, model


def _top_plans() -> list[tuple[str, Plan, ModelSpec]]:
    out = []
    for name, cl, batch, seq, top in GRID:
        model = load_model(name)
        result = search(model, load_cluster(cl), Workload(global_batch=batch, seq_len=seq), top=top)
        assert result.plans, (name, result.nearest)
        out += [(f"{name}#{p.rank}", p.plan, model) for p in result.plans]
    return out


TOP = _top_plans()


@pytest.mark.parametrize("name, plan, real", TOP, ids=[t[0] for t in TOP])
def test_a_tiny_stand_in_of_each_top_plan_trains_on_cpu(tmp_path: Path, name: str, plan: Plan, real: ModelSpec):
    small, batch, fields = stand_in(plan, real)
    spec = "\n".join(["schema_version = 1", 'kind = "model"', f'name = "stand-in-{name.split("#")[0]}"',
                      *(f"{k} = {v}" for k, v in fields.items())])
    (tmp_path / "model.toml").write_text(spec + "\n")
    p = meshplan_train("--model", str(tmp_path / "model.toml"), "--plan", small.short(), "--global-batch",
                       str(batch), "--seq-len", str(SEQ), "--steps", "3", "--nproc-per-node", str(small.num_gpus),
                       "--metrics", str(tmp_path / "m.jsonl"), "--pg-timeout", "60")
    assert p.returncode == 0, f"{plan.short()} -> {small.short()}\n{p.stderr[-3000:]}"
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "step" in r]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), losses
