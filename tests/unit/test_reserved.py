"""Reserved memory (cost.reserved): the caching allocator's rounding rules against the documented
ones, the allocator's and NCCL's terms, and the properties the verdict relies on: reserved >=
allocated, reserved monotone in allocated, expandable segments never increase reserved.

torch's CPU allocator does not use the CUDA caching allocator's rules (no pools, no segments), so
the rules are checked against the constants and functions of c10/cuda/CUDACachingAllocator.cpp
(round_size, get_allocation_size) as documented there, not measured on CPU."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cases import memory_measure
from meshplan.cost import estimate
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.profile import get_profile
from meshplan.cost.reserved import (
    CUDA_CONTEXT_GIB,
    NCCL_BUFFSIZE,
    allocator_bytes,
    cublas_workspace_bytes,
    expandable_size,
    fragmentation_fraction,
    nccl_bytes,
    outside_bytes,
    round_size,
    segment_size,
)
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload

MiB = 2**20


@pytest.mark.parametrize("n,block,segment", [
    (1, 512, 2 * MiB),                       # at least 512 B, from a 2 MiB small-pool segment
    (512, 512, 2 * MiB),
    (513, 1024, 2 * MiB),                    # multiples of 512 B
    (MiB, MiB, 2 * MiB),                     # the largest small allocation: 1 MiB
    (MiB + 1, MiB + 512, 20 * MiB),          # 1-10 MiB: a 20 MiB large-pool segment
    (10 * MiB - 512, 10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB, 10 * MiB),          # >= 10 MiB: its own segment, rounded to 2 MiB
    (11 * MiB, 11 * MiB, 12 * MiB),
    (11 * MiB + 1, 11 * MiB + 512, 12 * MiB),
])
def test_rounding_follows_the_caching_allocator(n, block, segment):
    assert int(round_size(n)) == block
    assert int(segment_size(n)) == segment


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**36))
def test_rounding_bounds(n):
    r, s, e = int(round_size(n)), int(segment_size(n)), int(expandable_size(n))
    assert r >= max(n, 512) and r % 512 == 0
    assert r - n < 512 or n < 512
    assert s >= r and e >= r
    assert e <= s  # expandable segments never map more than a segment would
    if r >= 10 * MiB:
        assert s % (2 * MiB) == 0 and s - r < 2 * MiB


def test_cublas_workspace_by_generation():
    assert cublas_workspace_bytes("hopper") == 32 * MiB
    assert cublas_workspace_bytes("ampere") == 4096 * 1024 * 2 + 16 * 1024 * 8


def test_nccl_buffers_per_communicator():
    one = float(nccl_bytes(1, 1, 1, 1, 1))  # the default group only
    assert one == 16 * 2 * 2 * NCCL_BUFFSIZE
    assert float(nccl_bytes(8, 1, 1, 1, 1)) == pytest.approx(2 * one)  # + the TP group
    assert float(nccl_bytes(8, 4, 2, 1, 1)) == pytest.approx(4 * one)
    assert float(nccl_bytes(8, 4, 2, 1, 4)) > float(nccl_bytes(8, 4, 2, 1, 1))  # + pipeline pairs
    p = DEFAULT_PARAMS.replace(cuda_context_gib=0.0)
    assert float(outside_bytes(1, 1, 1, 1, 1, p)) == pytest.approx(CUDA_CONTEXT_GIB * 2**30 + one)
    assert float(outside_bytes(1, 1, 1, 1, 1, p.replace(cuda_context_gib=1.5))) == pytest.approx(1.5 * 2**30 + one)


@settings(max_examples=100, deadline=None)
@given(st.floats(0, 1e11), st.floats(0, 1e11), st.floats(0, 200), st.booleans(), st.floats(0, 0.3))
def test_allocator_terms_properties(churn, more, layers, varying, frag):
    base = DEFAULT_PARAMS.replace(segment_fragmentation=frag, expandable_segments=False)
    exp = base.replace(expandable_segments=True)
    a = float(allocator_bytes(churn, layers, varying, "hopper", base))
    assert a >= 0  # reserved >= allocated
    assert float(allocator_bytes(churn + more, layers, varying, "hopper", base)) >= a  # monotone
    assert float(allocator_bytes(churn, layers, varying, "hopper", exp)) <= a  # expandable never adds
    assert float(fragmentation_fraction(base, varying)) <= 0.3


def _est(profile: str, **plan):
    p = get_profile(profile).apply(DEFAULT_PARAMS)
    return estimate(load_model("llama3-8b"), load_cluster("dgx-h100"), Plan(**plan),
                    Workload(global_batch=64, seq_len=4096), p)


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([0, 1, 3]),
       st.sampled_from(["none", "full"]))
def test_estimate_reserved_properties(mb, pp, zero, recompute):
    zero = 0 if pp > 1 and zero == 3 else zero
    kw = dict(dp=8 // pp, pp=pp, micro_batch=mb, zero=zero, recompute=recompute)
    plain = _est("meshplan", **kw)
    assert plain.reserved_memory_gib >= plain.allocated_memory_gib
    assert plain.peak_memory_gib >= plain.reserved_memory_gib
    assert plain.memory["allocator"] >= 0 and plain.memory["outside"] > 0
    p = get_profile("meshplan").apply(DEFAULT_PARAMS).replace(expandable_segments=True)
    e = estimate(load_model("llama3-8b"), load_cluster("dgx-h100"), Plan(**kw),
                 Workload(global_batch=64, seq_len=4096), p)
    assert e.allocated_memory_gib == pytest.approx(plain.allocated_memory_gib)
    assert e.reserved_memory_gib <= plain.reserved_memory_gib + 1e-9
    if mb < 4:  # reserved grows with the allocated bytes (a larger micro-batch)
        bigger = _est("meshplan", **(kw | {"micro_batch": mb * 2}))
        assert bigger.allocated_memory_gib >= plain.allocated_memory_gib
        assert bigger.reserved_memory_gib >= plain.reserved_memory_gib


def test_torchtitan_enables_expandable_segments_and_others_do_not():
    assert get_profile("torchtitan").apply(DEFAULT_PARAMS).expandable_segments is True
    for name in ("meshplan", "megatron", "megatron-deepspeed", "deepspeed", "llm-foundry", "nemo"):
        assert get_profile(name).apply(DEFAULT_PARAMS).expandable_segments is False, name


def test_estimate_json_shows_allocated_and_reserved():
    d = _est("torchtitan", dp=8, zero=3).to_dict()
    assert 0 < d["allocated_memory_gib"] <= d["reserved_memory_gib"] <= d["peak_memory_gib"]
    assert d["memory"]["total"] == pytest.approx(d["peak_memory_gib"])


def test_rows_are_compared_with_what_they_measured():
    from meshplan.validate.report import default_runs_path
    from meshplan.validate.runs import load_runs
    cases = {c.row_id: c for c in load_runs(default_runs_path())}
    assert memory_measure(cases["77"]) == "reserved"        # torchtitan logs max_memory_reserved
    assert memory_measure(cases["2000"]) == "nvidia-smi"    # the BLOOM chronicles' Mem column


def test_sim_memory_plot_shows_reserved():
    from meshplan.sim import simulate
    from meshplan.sim.output import sim_memory
    from meshplan.spec.io import load_plan
    res, _ = simulate(load_model("llama3-8b"), load_cluster("dgx-h100"),
                      load_plan("pp=2,dp=4,micro_batch=1,schedule=1f1b"), Workload(global_batch=32, seq_len=2048))
    for r in range(res.pp):
        level = res.reserved(r)[0][1]
        assert level >= max(b for _, b in res.memory[r])
        assert np.isfinite(level)
    svg = sim_memory(res)
    assert svg.count('data-mark="reserved"') == res.pp and 'data-mark="memory"' in svg
