"""Issue 29: a MoE layer priced as Megatron-core runs it, not as a dense one.

- the token permutation (permute, per-expert sort and its inverse, unpermute) is memory-bound HBM
  traffic, forward and backward (cost.moe.permute_bytes);
- under fp8 every local expert casts its own rows and its own weight (not one expert's);
- megatron-core multiplies the routing probabilities in the experts' activation, so its combine
  keeps no expert outputs (CostParams.moe_probs_in_activation, the megatron and nemo profiles);
- invariants: a MoE layer's time is non-decreasing in top-k, and on one GPU holding every expert
  (ep = 1) never below the same tokens through one dense FFN of the active width (top_k x expert
  width). Under ep > 1 it can be: each expert then runs ep ranks' rows, a taller GEMM than one
  rank's dense FFN.
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost import DEFAULT_PARAMS as P
from meshplan.cost.compute import mem_time
from meshplan.cost.layer import quantities
from meshplan.cost.moe import permute_bytes
from meshplan.cost.profile import get_profile
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import parse_plan
from meshplan.spec.transformer import block_ops

def _gpu():
    return load_cluster("h100-sxm-80gb:8").gpu


def test_permute_bytes_closed_form() -> None:
    """permute 2kH, sorts 4kH only with more than one local expert (at the busiest load), unpermute kH + H."""
    h, k = 4096.0, 8
    assert permute_bytes(h, k, 1) == 3 * k * h + h
    assert permute_bytes(h, k, 16) == 7 * k * h + h
    assert permute_bytes(h, k, 16, busiest=1.5) == 2 * k * h + 1.5 * 4 * k * h + k * h + h
    assert permute_bytes(h, 0, 16) == 0.0


@pytest.mark.parametrize("plan", ["dp=8,ep=8,micro_batch=1", "dp=8,ep=1,micro_batch=2",
                                  "tp=2,dp=4,ep=4,micro_batch=1,sequence_parallel=1"])
def test_moe_layer_pays_for_token_permutation(plan: str) -> None:
    """The forward and the input-gradient pass of a MoE block each carry the permutation's HBM bytes
    (a block whose hidden bytes are zeroed moves none); the weight-gradient pass does not."""
    m, g = load_model("mixtral-8x7b"), _gpu()
    pl = parse_plan(plan)
    o = block_ops(m)
    a = quantities(o, pl, 4096, g, P)
    b = quantities(dataclasses.replace(o, hidden=0.0), pl, 4096, g, P)
    tokens = pl.micro_batch * 4096 / pl.cp / (pl.tp if pl.sequence_parallel else 1)
    from meshplan.cost.moe import load_factor
    busiest = float(load_factor(pl.micro_batch * 4096 / pl.cp, o.experts, o.top_k, pl.ep, P))
    want = mem_time(tokens * permute_bytes(o.hidden, o.top_k, o.experts // pl.ep, busiest), g, P)
    assert want > 0
    assert a["f"] - b["f"] == pytest.approx(want, rel=1e-9)
    assert a["bi"] - b["bi"] == pytest.approx(want, rel=1e-9)
    assert a["bw"] == b["bw"]
    dense = block_ops(load_model("llama3-8b"))  # no experts: nothing to permute
    assert quantities(dense, pl, 4096, g, P)["f"] == quantities(dataclasses.replace(dense, hidden=0.0), pl, 4096, g, P)["f"]


def test_fp8_casts_every_local_expert() -> None:
    """Under fp8 the cast bytes of the expert GEMMs are those of every local expert: for a fixed
    total of routed rows, 8 local experts cast 8 weights. The forward's memory-bound part with fp8
    minus bf16 is exactly fp8_cast_bytes_per_elem x (all routed rows x K + every local weight)."""
    m, g = load_model("mixtral-8x7b"), _gpu()
    o = block_ops(m)
    base = parse_plan("dp=8,ep=1,micro_batch=1,precision=bf16")
    f8 = dataclasses.replace(base, precision="fp8")
    # the expert GEMMs alone, on a GPU of practically infinite FLOPs: only HBM bytes cost time
    keep = tuple(gm for gm in o.gemms if gm.expert)
    ew_only = dataclasses.replace(o, attention=None, gemms=keep)
    fast = dataclasses.replace(g, peak_tflops={k: v * 1e12 for k, v in g.peak_tflops.items()})
    a = quantities(ew_only, f8, 4096, fast, P)["f"]
    b = quantities(ew_only, base, 4096, fast, P)["f"]
    tokens, local = 4096.0, o.experts
    cast = sum(local * ((tokens * o.top_k / local) * gm.k + gm.k * gm.n) for gm in keep)
    assert a - b == pytest.approx(mem_time(P.fp8_cast_bytes_per_elem * cast, fast, P), rel=1e-3)


def test_megatron_combine_keeps_no_expert_outputs() -> None:
    """megatron-core (megatron and nemo profiles) applies the routing probabilities in the experts'
    activation: the block keeps top_k x 2h bytes per token fewer than a codebase whose combine weights
    (and keeps) the expert outputs; a dense block is unchanged."""
    m, g = load_model("mixtral-8x7b"), _gpu()
    o, pl = block_ops(m), parse_plan("dp=8,ep=8,micro_batch=1")
    assert o.saved_combine_rep == m.experts_per_token * 2 * m.hidden_size
    for name in ("megatron", "nemo"):
        prof = get_profile(name).apply(P)
        assert prof.moe_probs_in_activation
        keep = quantities(o, pl, 4096, g, prof.replace(moe_probs_in_activation=False))["full"]
        assert keep - quantities(o, pl, 4096, g, prof)["full"] == pytest.approx(o.saved_combine_rep)
        dense, dp = block_ops(load_model("llama3-8b")), parse_plan("dp=8,micro_batch=1")
        assert (quantities(dense, dp, 4096, g, prof)["full"]
                == quantities(dense, dp, 4096, g, prof.replace(moe_probs_in_activation=False))["full"])
    assert not get_profile("torchtitan").apply(P).moe_probs_in_activation


def _moe(h: int, e: int, k: int, f: int) -> ModelSpec:
    return dataclasses.replace(load_model("mixtral-8x7b"), num_layers=2, hidden_size=h, num_attention_heads=h // 64,
                               num_kv_heads=h // 256, ffn_hidden_size=4 * h, seq_len=512, num_experts=e,
                               experts_per_token=k, expert_ffn_hidden_size=f)


def _time(q: dict) -> float:
    return q["f"] + q["bi"] + q["bw"]


@given(st.sampled_from([512, 1024, 2048]), st.sampled_from([8, 16, 64, 128]), st.integers(1, 8),
       st.sampled_from([256, 768, 1536]), st.sampled_from([1, 2, 8]), st.sampled_from([1, 4]),
       st.sampled_from(["bf16", "fp8"]))
@settings(max_examples=60, deadline=None)
def test_moe_time_monotone_in_top_k_and_not_below_dense(h: int, e: int, k: int, f: int, ep: int, mb: int,
                                                        prec: str) -> None:
    if k >= e or e % ep:
        return
    g = _gpu()
    pl = parse_plan(f"dp=8,ep={ep},micro_batch={mb},precision={prec}")
    a = _time(quantities(block_ops(_moe(h, e, k, f)), pl, 512, g, P))
    b = _time(quantities(block_ops(_moe(h, e, k + 1, f)), pl, 512, g, P))
    assert b >= a * (1 - 1e-12)
    if ep > 1:
        # expert parallelism gathers ep ranks' rows on each expert (taller GEMMs than one rank's dense
        # FFN): the dense comparison is for one GPU holding every expert, the same tokens and FLOPs
        return
    dense = dataclasses.replace(_moe(h, e, k, f), num_experts=1, experts_per_token=1, ffn_hidden_size=k * f,
                                expert_ffn_hidden_size=None)
    d = _time(quantities(block_ops(dense), parse_plan(f"dp=8,micro_batch={mb},precision={prec}"), 512, g, P))
    assert a >= d * (1 - 1e-12)


def test_force_balanced_router_rows_have_no_persistent_skew() -> None:
    """A Megatron-Bridge Qwen3 row run with moe_router_force_load_balancing=True (random logits) is
    validated with moe_expert_load_cv = 0; a dense row of the same source keeps the default."""
    from meshplan.validate.report import case_params
    from meshplan.validate.runs import load_runs
    from meshplan.validate.report import default_runs_path
    cases = {c.row_id: c for c in load_runs(default_runs_path()) if c.row_id in ("3016", "3020")}
    moe, dense = cases["3016"], cases["3020"]
    assert moe.overrides.get("moe_expert_load_cv") == 0.0 and case_params(moe).moe_expert_load_cv == 0.0
    assert any("forced to balance" in a for a in moe.assumptions)
    assert "moe_expert_load_cv" not in dense.overrides
