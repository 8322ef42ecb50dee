"""Invariants of the cost model, the simulator, plan files and the search, property-tested
with hypothesis over random valid models, clusters, workloads and plans (issue 11).

- every time and memory term is >= 0;
- a higher ZeRO level never needs more memory for the same plan (the documented exception:
  ZeRO-3 under a pipeline, see docs/cost-model.md "ZeRO levels");
- every memory saving a plan field buys carries its time: the same plan with the saving on
  needs no more memory and is no faster (recompute, offload, ZeRO 1 -> 2), and the data-parallel
  communication grows with the ZeRO level;
- the simulator agrees with the estimate within 3%;
- plan files round-trip;
- every top-5 plan of a grid of searches passes the constraints and the runtime's rules
  (spec.support) and fits with headroom.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshplan.cost import estimate
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.profile import PROFILES
from meshplan.cost.uncertainty import safe_peak_gib
from meshplan.search.driver import search
from meshplan.sim import simulate
from meshplan.spec.constraints import violations
from meshplan.spec.io import load_cluster, load_model, load_plan, parse_cluster_shorthand, plan_document
from meshplan.spec.plan import Plan, Workload, microbatches, parse_plan
from meshplan.spec.support import runtime_violations

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                            HealthCheck.too_slow])
GPUS = ("a100-sxm-80gb", "a100-sxm-40gb", "h100-sxm-80gb")
REL = 1e-9  # float rounding between two evaluations of one formula


@st.composite
def models(draw, *, min_layers: int = 2, min_heads: int = 8):
    """A random decoder: Llama-like (SwiGLU, GQA, rotary) or GPT-like (GeLU, learned positions),
    sometimes MoE; dimensions from small to GPT-3 scale."""
    llama = draw(st.booleans())
    heads = draw(st.sampled_from([h for h in (8, 16, 32, 64) if h >= min_heads]))
    head_dim = draw(st.sampled_from((64, 128)))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8, heads) if heads % k == 0])) if llama else heads
    h = heads * head_dim
    moe = llama and draw(st.integers(0, 4)) == 0
    base = load_model("llama3-8b" if llama else "gpt3-1.3b")
    return base.replace(
        name="random", num_layers=draw(st.integers(min_layers, 48)), hidden_size=h, num_attention_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=draw(st.sampled_from((2, 3, 4))) * h,
        vocab_size=draw(st.sampled_from((32000, 50257, 128256))), seq_len=draw(st.sampled_from((1024, 2048, 4096))),
        num_experts=8 if moe else 1, experts_per_token=2 if moe else 1,
        expert_ffn_hidden_size=(2 * h) if moe else None)


@st.composite
def cases(draw, *, max_nodes: int = 8, min_layers: int = 2, min_heads: int = 8):
    """(model, cluster, plan, workload) that pass every constraint and the runtime's rules."""
    model = draw(models(min_layers=min_layers, min_heads=min_heads))
    gpu = draw(st.sampled_from(GPUS))
    nodes = draw(st.integers(1, max_nodes))
    cluster = parse_cluster_shorthand(f"{gpu}:{nodes}x8")
    n = cluster.num_gpus
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if model.num_attention_heads % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4, 8) if (n // tp) % p == 0 and p <= model.num_layers]))
    cp = draw(st.sampled_from([c for c in (1, 2) if (n // (tp * pp)) % c == 0]))
    dp = n // (tp * pp * cp)
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if model.num_experts % e == 0 and (dp * cp) % e == 0]))
    mb = draw(st.sampled_from((1, 2, 4)))
    m = draw(st.integers(1, 16))
    work = Workload(global_batch=dp * mb * m, seq_len=model.seq_len)
    sched, v = ("1f1b", 1)
    if pp > 1:
        sched = draw(st.sampled_from(("gpipe", "1f1b", "interleaved-1f1b")))
        v = draw(st.sampled_from((2, 3))) if sched == "interleaved-1f1b" else 1
    zero = draw(st.sampled_from((0, 1, 3) if pp > 1 else (0, 1, 2, 3)))
    recompute = draw(st.sampled_from(("none", "selective", "op", "full")))
    plan = Plan(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero=zero, micro_batch=mb, virtual_stages=v, schedule=sched,
                recompute=recompute, sequence_parallel=tp > 1, compile=draw(st.booleans()),
                offload_params=zero == 3 and draw(st.integers(0, 5)) == 0)
    assume(not violations(model, cluster, plan, work))
    assume(not runtime_violations(plan, microbatches(work.global_batch, plan.dp, plan.micro_batch), model))
    return model, cluster, plan, work


def _valid(model, cluster, plan, work) -> bool:
    return not violations(model, cluster, plan, work) and not runtime_violations(
        plan, microbatches(work.global_batch, plan.dp, plan.micro_batch), model)


@SETTINGS
@given(cases())
def test_every_time_and_memory_term_is_non_negative(case):
    r = estimate(*case)
    assert r.step_time_s > 0 and r.peak_memory_gib > 0
    for k, t in r.time.items():
        assert t >= 0, (k, t, case[2].short())
    for k, b in r.memory.items():
        assert b >= 0, (k, b, case[2].short())
    assert all(m >= 0 for m in r.memory_per_stage)
    exposed = sum(t for k, t in r.time.items() if not k.endswith("_overlapped"))
    assert exposed == pytest.approx(r.step_time_s, rel=1e-9)


@SETTINGS
@given(cases())
def test_a_higher_zero_level_never_needs_more_memory(case):
    model, cluster, plan, work = case
    plan = plan.replace(offload_params=False)  # (dp x cp = 1: every level ZeRO-0's memory, test_optimizer_memory.py)
    peaks = {}
    for z in (0, 1, 2, 3):
        p = plan.replace(zero=z)
        if _valid(model, cluster, p, work):
            peaks[z] = estimate(model, cluster, p, work)
    levels = sorted(peaks)
    for lo, hi in zip(levels, levels[1:]):
        if hi == 3 and plan.pp > 1:
            # Documented exception (docs/cost-model.md): under a pipeline FSDP2 keeps the whole stage
            # gathered and accumulates unsharded gradients, like ZeRO-1, plus its sharded fp32
            # gradients: at most 4 bytes per parameter / shard more than ZeRO-1.
            continue
        a, b = peaks[lo], peaks[hi]
        states = lambda r: r.memory["weights"] + r.memory["grads"] + r.memory["optimizer"]  # noqa: E731
        assert states(b) <= states(a) * (1 + REL), (lo, hi, plan.short())
        if hi < 3:  # ZeRO-3 trades its sharded weights for gathered layers (transient)
            assert b.peak_memory_gib <= a.peak_memory_gib * (1 + REL), (lo, hi, plan.short())


def _same_or_less_memory_and_no_faster(model, cluster, base, saving, work):
    a, b = estimate(model, cluster, base, work), estimate(model, cluster, saving, work)
    assert b.peak_memory_gib <= a.peak_memory_gib * (1 + REL), (base.short(), saving.short())
    assert b.step_time_s >= a.step_time_s * (1 - REL), (base.short(), saving.short())
    return a, b


@pytest.mark.slow  # seven estimates per random example
@SETTINGS
@given(cases())
def test_every_memory_saving_carries_its_time(case):
    model, cluster, plan, work = case
    base = plan.replace(recompute="none", recompute_layers=None, offload_params=False, offload_optimizer=False)
    # recomputation: less memory kept for the backward, paid in recompute time
    for rc in ("selective", "op", "full"):
        a, b = _same_or_less_memory_and_no_faster(model, cluster, base, base.replace(recompute=rc), work)
        assert b.time["recompute"] > 0 and a.time["recompute"] == 0
    # parameter offload (ZeRO-3): no weights on the GPU, paid in host-device copies
    if base.zero == 3 and _valid(model, cluster, base.replace(offload_params=True, offload_optimizer=True), work):
        _, b = _same_or_less_memory_and_no_faster(model, cluster, base,
                                                  base.replace(offload_params=True, offload_optimizer=True), work)
        assert b.time["offload"] > 0 and b.memory["optimizer"] == 0
        # under a pipeline the gathered stage stays on the GPU for the step: with nothing to shard over
        # (dp x cp = 1, where every ZeRO level holds ZeRO-0's weights) offload then saves no weight bytes
        assert b.memory["weights"] <= a.memory["weights"]
        if base.pp == 1:
            assert b.memory["weights"] < a.memory["weights"]
    # ZeRO-2 keeps gradients sharded only by reduce-scattering every micro-batch
    if base.pp == 1 and base.dp * base.cp > 1:
        z1, z2 = base.replace(zero=1), base.replace(zero=2)
        a, b = _same_or_less_memory_and_no_faster(model, cluster, z1, z2, work)
        comm = lambda r: r.time["dp_comm"] + r.time["dp_comm_overlapped"]  # noqa: E731
        assert comm(b) >= comm(a) * (1 - REL)
        if a.microbatches > 1:
            assert comm(b) > comm(a)
    # the data-parallel traffic grows with the ZeRO level (1, 2, 3 on one pipeline stage)
    if base.pp == 1 and base.dp * base.cp > 1:
        comm = [estimate(model, cluster, base.replace(zero=z), work) for z in (1, 2, 3)]
        total = [r.time["dp_comm"] + r.time["dp_comm_overlapped"] for r in comm]
        assert total == sorted(total) or all(abs(x - total[0]) <= REL * total[0] for x in total), total


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(cases(max_nodes=4, min_layers=8, min_heads=32), st.sampled_from(sorted(PROFILES)))
def test_the_simulator_agrees_with_the_estimate(case, profile):
    # Models of practical shape (>= 8 blocks, hidden >= 2048) and pipelines with at least 2 pp
    # micro-batches. With fewer, on stages made unequal by an output layer heavier than the
    # blocks, the analytic bubble (m max T + sum T - max T) is an upper bound on the simulated
    # GPipe/1F1B step, up to ~6% above it (docs/simulation.md).
    # Parameter offload under a pipeline is left out: the cost model charges its copies per
    # micro-batch while the stage stays gathered for the step (known deviation, up to ~12%;
    # docs/simulation.md).
    # Interleaved pipelines under FSDP (zero=3) with fewer than 4 pp micro-batches are left out
    # too: a once-per-step gather the simulator exposes (~0.03 ms x layers per step) that the
    # estimate hides, 4.5% at 2 pp micro-batches, 2.6% at 4 (known deviation, the same before
    # issue 12; docs/simulation.md).
    model, cluster, plan, work = case
    m = microbatches(work.global_batch, plan.dp, plan.micro_batch)
    assume(plan.pp <= 4 and 2 * plan.pp <= m <= 16 and not (plan.offload_params and plan.pp > 1))
    assume(not (plan.zero == 3 and plan.pp > 1 and plan.virtual_stages > 1 and m < 4 * plan.pp))
    params = PROFILES[profile].apply(DEFAULT_PARAMS)  # under every codebase's profile
    _, summary = simulate(model, cluster, plan, work, params)
    est = estimate(model, cluster, plan, work, params).step_time_s
    assert summary["step_time_s"] == pytest.approx(est, rel=0.03), (profile, plan.short())


@SETTINGS
@given(cases())
def test_plan_files_round_trip(tmp_path_factory, case):
    model, cluster, plan, work = case
    assert parse_plan(plan.short()) == plan
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    path.write_text(json.dumps(plan_document(plan, model=model.name, global_batch=work.global_batch,
                                             seq_len=work.seq_len)))
    assert load_plan(str(path)) == plan


GRID = [  # (model, cluster, global batch, seq len): presets, GPUs, sizes and batches of practice
    ("llama3-8b", "h100-sxm-80gb:8", 64, 8192),
    ("llama3-8b", "a100-sxm-40gb:32", 256, 4096),
    ("llama3-70b", "h100-sxm-80gb:64", 256, 8192),
    ("gpt3-13b", "a100-sxm-80gb:64", 512, 2048),
    ("mixtral-8x7b", "h100-sxm-80gb:32", 128, 4096),
    ("llama2-7b", "a100-sxm-80gb:16", 32, 4096),
]


@pytest.mark.parametrize("case", GRID, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in GRID])
def test_every_top_plan_passes_the_runtime_checks_and_fits_with_headroom(case):
    model, cluster, work = load_model(case[0]), load_cluster(case[1]), Workload(global_batch=case[2], seq_len=case[3])
    result = search(model, cluster, work, top=5)
    assert result.plans, result.nearest
    for ranked in result.plans:
        p = ranked.plan
        assert violations(model, cluster, p, work) == []
        assert runtime_violations(p, microbatches(work.global_batch, p.dp, p.micro_batch), model) == [], p.short()
        assert ranked.export_only is None
        assert ranked.report.fits and not ranked.report.at_risk, p.short()
        assert ranked.report.oom_probability <= DEFAULT_PARAMS.max_oom_risk
        assert ranked.report.peak_memory_gib <= \
            safe_peak_gib(ranked.report.usable_memory_gib, DEFAULT_PARAMS) * (1 + REL)


def test_memory_band_covers_the_allocator_measured_runs():
    """The memory band is measured, not chosen: every published run whose peak torch's allocator
    measured lies within 3 sigma of the band of its codebase (the band itself comes from the
    leave-one-source-out errors, `meshplan calibrate --bands`)."""
    import math

    from meshplan.cases import case_params
    from meshplan.cost.uncertainty import memory_params
    from meshplan.validate import default_runs_path, load_runs, validate
    cases = load_runs(default_runs_path())
    by_id = {c.row_id: c for c in cases}
    rows = validate(cases)["rows"]
    checked = 0
    for r in rows:
        c = by_id[r["row_id"]]
        if r["memory_error_pct"] is None or c.memory_by_nvidia_smi:
            continue
        if c.row_id.isdigit() and int(c.row_id) >= 2100:
            # issue 27's rows (Megatron-LM test goldens, torchtitan's reserved memory) are out of sample
            # for the band; their errors are what issue 27 items 1 and 6 must bring inside it
            continue
        mu, sigma = memory_params(case_params(c))
        e = math.log(r["measured_peak_memory_gib"] / r["predicted_peak_memory_gib"])
        assert abs(e - mu) <= 3 * sigma, (r["row_id"], e, mu, sigma)
        checked += 1
    assert checked >= 10
