"""MoE load imbalance under expert parallelism (issue 29, cost.moe): the busiest ep rank's load
over the mean, from routing statistics, and what it does to the estimate (expert GEMM time, the
all-to-all, routed activation memory) for presets and ingested models.

Properties (hypothesis): the factor is >= 1, exactly 1 at ep = 1 (one rank runs the whole layer:
nothing to wait for), non-increasing in tokens per expert, at most every pair on one rank; a
capacity factor caps it (padding pins it); the estimate stays non-negative and its peak memory and
step time are monotone in the router's skew. Closed forms: expected maxima of normals, the
hypergeometric variance of a rank's share.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost import DEFAULT_PARAMS, estimate
from meshplan.cost.moe import expected_max_normal, load_factor, memory_factor
from meshplan.cost.profile import get_profile
from meshplan.errors import MeshplanError
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Workload, parse_plan
from meshplan.spec.transformer import block_ops

P = DEFAULT_PARAMS


@st.composite
def layers(draw: st.DrawFn) -> tuple[int, int, int]:
    """(experts, top_k, ep) with ep dividing the experts."""
    e = draw(st.sampled_from([2, 4, 8, 16, 32, 60, 64, 128, 256]))
    k = draw(st.integers(1, min(e, 8)))
    ep = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32, 64) if e % d == 0]))
    return e, k, ep


tokens_st = st.floats(1.0, 1e7, allow_nan=False)
cv_st = st.floats(0.0, 1.0, allow_nan=False)


@given(layers(), tokens_st, cv_st)
@settings(max_examples=300, deadline=None)
def test_factor_is_at_least_one_and_one_without_ep(layer: tuple[int, int, int], tokens: float, cv: float) -> None:
    e, k, ep = layer
    p = P.replace(moe_expert_load_cv=cv)
    f = float(load_factor(tokens, e, k, ep, p))
    assert f >= 1.0
    assert f <= ep * min(k, e / ep) / k + 1e-12  # at most every pair on one rank
    assert float(load_factor(tokens, e, k, 1, p)) == 1.0
    m = float(memory_factor(tokens, e, k, ep, 4, p))
    assert 1.0 <= m <= f + 1e-12  # the sum over 4 independent layers spreads less


@given(layers(), tokens_st, st.floats(1.0, 1e4), cv_st)
@settings(max_examples=300, deadline=None)
def test_factor_does_not_grow_with_tokens(layer: tuple[int, int, int], tokens: float, more: float, cv: float) -> None:
    e, k, ep = layer
    p = P.replace(moe_expert_load_cv=cv)
    assert float(load_factor(tokens * more, e, k, ep, p)) <= float(load_factor(tokens, e, k, ep, p)) + 1e-12
    assert float(memory_factor(tokens, e, k, ep, 8, p)) <= float(memory_factor(tokens, e, k, ep, 2, p)) + 1e-12


@given(layers(), tokens_st, st.floats(1.0, 4.0))
@settings(max_examples=200, deadline=None)
def test_capacity_caps_and_padding_pins(layer: tuple[int, int, int], tokens: float, cap: float) -> None:
    e, k, ep = layer
    free = float(load_factor(tokens, e, k, ep, P))
    assert float(load_factor(tokens, e, k, ep, P.replace(moe_capacity_factor=cap))) == pytest.approx(min(free, cap))
    padded = P.replace(moe_capacity_factor=cap, moe_pad_to_capacity=True)
    assert float(load_factor(tokens, e, k, ep, padded)) == pytest.approx(cap)


def test_closed_forms() -> None:
    # expected maximum of n standard normals: 1/sqrt(pi) for 2, 3/(2 sqrt(pi)) for 3 (exact)
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    # without router skew, ep = 2 over E = 2 experts, top-1: a rank's share of N = 2T tokens is
    # Binomial(2T, 1/2) over its mean T: sd 1/sqrt(2T); the max of the two is mean + |deviation|,
    # E|X| = sd sqrt(2/pi); the factor's iid-normal form gives sqrt(2) sd e(2) = the same
    t = 1000.0
    want = 1 + math.sqrt(1 / (2 * t)) * math.sqrt(2 / math.pi)
    assert float(load_factor(t, 2, 1, 2, P.replace(moe_expert_load_cv=0.0))) == pytest.approx(want, rel=1e-6)
    # router skew alone (many tokens), one expert per rank: c e(ep) (Mixtral at ep = 8: 0.1 x 1.42)
    assert float(load_factor(1e12, 8, 2, 8, P)) == pytest.approx(1 + 0.1 * expected_max_normal(8), rel=1e-6)
    # the prior: Switch's 1.25 capacity read as the busiest of 128 experts' load
    assert 1 + P.moe_expert_load_cv * expected_max_normal(128) == pytest.approx(1.25, abs=0.015)


def test_out_of_bounds_parameters_are_one_line_errors() -> None:
    with pytest.raises(MeshplanError, match="moe_expert_load_cv"):
        load_factor(100.0, 8, 2, 2, P.replace(moe_expert_load_cv=1.5))
    with pytest.raises(MeshplanError, match="moe_capacity_factor"):
        load_factor(100.0, 8, 2, 2, P.replace(moe_capacity_factor=0.5))


def test_preset_routed_bytes_are_the_routed_copies_and_expert_tensors() -> None:
    m = load_model("mixtral-8x7b")
    o = block_ops(m)
    h, k = m.hidden_size, m.experts_per_token
    assert o.saved_routed_rep == 2 * (k * 2 * h)  # dispatched copies + the combine's expert outputs
    assert o.saved_routed_rep < o.saved_rep and 0 < o.saved_routed_split[0] < o.saved_split[0]
    dense = block_ops(load_model("llama3-8b"))
    assert dense.saved_routed_rep == 0 and dense.saved_routed_split == (0.0, 0.0)


WORK = Workload(global_batch=256, seq_len=4096)


@pytest.mark.parametrize("plan", ["dp=64,ep=8,zero=2,micro_batch=1", "dp=64,ep=4,zero=3,micro_batch=2",
                                  "tp=2,dp=32,ep=8,zero=1,micro_batch=1,sequence_parallel=1",
                                  "dp=64,ep=8,zero=3,micro_batch=1,recompute=full"])
def test_estimate_pays_for_imbalance(plan: str) -> None:
    """Mixtral-8x7B on 64 H100 under ep > 1: against a perfectly balanced router over infinitely many
    tokens (cv 0 and the balanced routing the cost model had before), the step is longer by the expert
    GEMMs' and the all-to-all's excess, and the busiest rank keeps more routed activations."""
    m, c = load_model("mixtral-8x7b"), load_cluster("h100-sxm-80gb:64")
    pl = parse_plan(plan)
    skew, flat = estimate(m, c, pl, WORK), estimate(m, c, pl, WORK, P.replace(moe_expert_load_cv=0.0))
    assert skew.step_time_s > flat.step_time_s * 1.02
    assert skew.time["ep_comm"] > flat.time["ep_comm"] > 0
    assert skew.peak_memory_gib >= flat.peak_memory_gib
    if "recompute" not in plan:
        assert skew.memory["activations"] > flat.memory["activations"]


def test_no_ep_no_imbalance() -> None:
    """ep = 1: one rank runs every expert of its tokens; the router's skew costs nothing (dropless)."""
    m, c = load_model("mixtral-8x7b"), load_cluster("h100-sxm-80gb:64")
    pl = parse_plan("tp=8,dp=8,zero=3,micro_batch=1")
    a, b = estimate(m, c, pl, WORK), estimate(m, c, pl, WORK, P.replace(moe_expert_load_cv=1.0))
    assert a.step_time_s == b.step_time_s and a.peak_memory_gib == b.peak_memory_gib


def test_padded_capacity_profile_runs_capacity_sized_experts() -> None:
    """megatron-deepspeed (DeepSpeed-MoE: capacity 1.0, padded): every rank runs the mean load, so
    the router's skew costs nothing and ep = 8 prices as the balanced routing."""
    prof = get_profile("megatron-deepspeed").apply(P)
    assert prof.moe_capacity_factor == 1.0 and prof.moe_pad_to_capacity
    m, c = load_model("mixtral-8x7b"), load_cluster("h100-sxm-80gb:64")
    pl = parse_plan("dp=64,ep=8,zero=3,micro_batch=1")
    a, b = estimate(m, c, pl, WORK, prof), estimate(m, c, pl, WORK, prof.replace(moe_expert_load_cv=1.0))
    assert a.step_time_s == b.step_time_s


@given(st.sampled_from(["dp=8,ep=2", "dp=8,ep=4", "dp=8,ep=4,zero=3", "tp=2,dp=4,ep=2,micro_batch=2",
                        "pp=2,dp=4,ep=4,micro_batch=1", "dp=8,ep=2,recompute=full"]),
       st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.sampled_from([64, 512, 2048]))
@settings(max_examples=40, deadline=None)
def test_estimate_non_negative_and_monotone_in_skew(plan: str, cv1: float, cv2: float, seq: int) -> None:
    lo, hi = sorted((cv1, cv2))
    m, c = load_model("tiny-moe"), load_cluster("h100-sxm-80gb:8")
    w, pl = Workload(global_batch=16, seq_len=seq), parse_plan(plan)
    a, b = estimate(m, c, pl, w, P.replace(moe_expert_load_cv=lo)), estimate(m, c, pl, w, P.replace(moe_expert_load_cv=hi))
    for r in (a, b):
        assert r.step_time_s > 0 and all(v >= 0 for v in r.time.values())
        assert r.peak_memory_gib > 0 and all(v >= 0 for v in r.memory.values())
    assert b.step_time_s >= a.step_time_s * (1 - 1e-12)
    assert b.peak_memory_gib >= a.peak_memory_gib * (1 - 1e-12)


def test_ingested_moe_records_routed_bytes_and_pays_for_imbalance() -> None:
    """The ingested Mixtral: what its fused experts keep per token-expert pair is recorded apart
    (ingest.moe.routed), and ep > 1 prices the imbalance on it as on the preset."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pathlib import Path

    from meshplan.ingest import ingest
    hf = Path(__file__).resolve().parents[1] / "data" / "hf"
    g = ingest(f"hf:{hf / 'mixtral-tiny.json'}", seq_len=32)
    o = g.ops["MixtralDecoderLayer"]
    h, k = 128, 2
    # at least the dispatched copies and the combine's expert outputs (2 B each per pair), within what is saved
    assert 2 * k * 2 * h <= o.saved_routed_rep < o.saved_rep
    c = load_cluster("h100-sxm-80gb:8")
    w, pl = Workload(global_batch=16, seq_len=32), parse_plan("dp=8,ep=4,zero=2")
    skew, flat = estimate(g, c, pl, w), estimate(g, c, pl, w, P.replace(moe_expert_load_cv=0.0))
    assert skew.step_time_s > flat.step_time_s and skew.memory["activations"] > flat.memory["activations"]
    assert np.isfinite(skew.step_time_s)
