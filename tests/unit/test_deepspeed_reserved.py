"""Issue 27: the memory Megatron-DeepSpeed's runs hold outside the live tensors, from the code that
ran (microsoft/DeepSpeed@2151c787a, bigscience-workshop/Megatron-DeepSpeed@541b967f):

* the NCCL communicators its PipelineEngine initializes: DeepSpeed's PipelineParallelGrid creates
  its own data-parallel, model (pp x tp), pipeline and tensor-slice groups beside Megatron's
  tensor-parallel group and the default group, plus the tied-embedding group of a pipeline;
* the start-up high-water mark of DeepSpeed's fp16 optimizer wrappers, whose freed per-parameter
  tensors and temporaries stay in PyTorch's cache (no torch.cuda.empty_cache())."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost import estimate
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.profile import get_profile
from meshplan.cost.reserved import (
    NCCL_BUFFSIZE,
    NCCL_CHANNELS,
    NCCL_PROTOCOL_BUFFERS,
    NCCL_RING_PEERS,
    deepspeed_init_reserved_bytes,
    deepspeed_pipe_communicators,
    nccl_bytes,
    nccl_communicators,
)
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload

PER_COMM = NCCL_CHANNELS * NCCL_RING_PEERS * NCCL_PROTOCOL_BUFFERS * NCCL_BUFFSIZE


@pytest.mark.parametrize("tp,dp,pp,count", [
    (1, 1, 1, 1),   # the default group only
    (1, 8, 1, 2),   # + DeepSpeed's data-parallel group (tr3m-1B3, pp 1)
    (8, 4, 12, 7),  # + Megatron tp, DS dp, DS model (pp x tp), DS pipe, DS slice, tied embedding (BLOOM)
    (1, 4, 2, 5),   # + DS dp, DS model, DS pipe, tied; no tensor slicing
    (4, 1, 16, 6),  # 52B GPT-2: no data parallelism
])
def test_deepspeed_pipe_communicators_follow_the_grid(tp, dp, pp, count):
    assert float(deepspeed_pipe_communicators(tp, dp, pp)) == count


def test_megatron_deepspeed_profile_counts_the_grids_groups():
    p = get_profile("megatron-deepspeed").apply(DEFAULT_PARAMS)
    assert p.nccl_groups == "deepspeed-pipe"
    bloom = float(nccl_bytes(8, 4, 1, 1, 12, groups=p.nccl_groups))
    axes = float(nccl_bytes(8, 4, 1, 1, 12))
    # DeepSpeed's pipe, slice, model and tied groups: four communicators more than one per axis
    assert bloom - axes == pytest.approx(4 * PER_COMM)
    for name in ("meshplan", "megatron", "torchtitan", "deepspeed"):
        assert get_profile(name).apply(DEFAULT_PARAMS).nccl_groups == "axes", name


@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 6, 12]))
@settings(max_examples=40, deadline=None)
def test_deepspeed_pipe_counts_at_least_the_axes(tp, dp, pp):
    assert deepspeed_pipe_communicators(tp, dp, pp) >= nccl_communicators(tp, dp, 1, 1)


def test_init_mark_zero1_and_zero0():
    P = 1e9
    # ZeRO-1 over 4 ranks, Adam: flat 2P + freed originals 2P + (clone 2 + master 4 + zero grad 4 + Adam 8) P/4
    assert float(deepspeed_init_reserved_bytes(P, 4, 1, 8.0)) == pytest.approx(4 * P + 18 * P / 4)
    # ZeRO-0 (FP16_Optimizer): originals, clones, flat, clone for the master 2 each, master 4, zero grad 4, Adam 8
    assert float(deepspeed_init_reserved_bytes(P, 4, 0, 8.0)) == pytest.approx(24 * P)


@given(st.floats(1e6, 1e11), st.sampled_from([1, 2, 4, 8, 64]))
@settings(max_examples=40, deadline=None)
def test_init_mark_bounds(params, shard):
    z1 = float(deepspeed_init_reserved_bytes(params, shard, 1, 8.0))
    z0 = float(deepspeed_init_reserved_bytes(params, shard, 0, 8.0))
    assert 4 * params <= z1 <= z0 + 1e-6 * z0  # sharding never raises the mark; the flat weights + freed originals stay


def _est(profile, precision="fp16", **kw):
    p = get_profile(profile).apply(DEFAULT_PARAMS)
    return estimate(load_model("gpt3-1.3b"), load_cluster("dgx-a100"), Plan(precision=precision, **kw),
                    Workload(global_batch=64, seq_len=2048), p)


def test_zero0_fp16_reserved_is_at_least_the_start_up_mark():
    # dp 1, ZeRO-0, fp16 under Megatron-DeepSpeed: the FP16_Optimizer's start-up leaves 24 B/param reserved
    e = _est("megatron-deepspeed", tp=8, dp=1, zero=0, micro_batch=1, recompute="full")
    params = e.memory["weights"] / 2.0  # 16-bit weights, GiB / 2 B
    assert e.reserved_memory_gib >= 24.0 * params * (1 - 1e-9)
    # the same plan without the start-up mark (meshplan's own runtime does not flatten at start-up)
    off = get_profile("megatron-deepspeed").apply(DEFAULT_PARAMS).replace(optimizer_init_cache=False)
    e2 = estimate(load_model("gpt3-1.3b"), load_cluster("dgx-a100"),
                  Plan(precision="fp16", tp=8, dp=1, zero=0, micro_batch=1, recompute="full"),
                  Workload(global_batch=64, seq_len=2048), off)
    assert e2.allocated_memory_gib == pytest.approx(e.allocated_memory_gib)
    assert e.reserved_memory_gib > e2.reserved_memory_gib
    # bf16 runs (DeepSpeed's BF16_Optimizer, another start-up) are not given the mark
    b = _est("megatron-deepspeed", precision="bf16", tp=8, dp=1, zero=0, micro_batch=1, recompute="full")
    assert b.reserved_memory_gib < 24.0 * params


def test_bloom_prequel_row_predicts_more_outside_memory():
    """Row 2120's plan (BLOOM prequel 181B, tp 8, pp 12, dp 4): the Megatron-DeepSpeed profile's
    memory outside the allocator includes the grid's four extra communicators."""
    from meshplan.calibration.fit import runs_from_cases
    from meshplan.cli.calibrate_cmd import _cases
    from meshplan.cost.batch import estimate_batch
    from meshplan.validate.report import default_runs_path
    runs = runs_from_cases(_cases(str(default_runs_path())))
    i = next(k for k, c in enumerate(runs.cases) if c.source_id == "BLOOM_PREQ_0221")
    c = runs.cases[i]
    r = estimate_batch(c.model, c.cluster, c.work, [c.plan], runs.bases[i])
    ctx = runs.bases[i].cuda_context_gib
    comm = float(nccl_bytes(8, 4, 1, 1, 12, groups="deepspeed-pipe")) / 2**30
    assert float(r["memory.outside"][0]) == pytest.approx(ctx + comm, rel=1e-6)
    assert comm > float(nccl_bytes(8, 4, 1, 1, 12)) / 2**30 + 0.9
