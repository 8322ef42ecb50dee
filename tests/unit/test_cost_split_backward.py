"""The cost model under the split-backward schedules (zero-bubble = ZB-H1, zbv) against the
simulator that runs torch.distributed.pipelining's orders: the V's placement of the output
layer (rank 0), its sends, tied weights, memory per stage, step time, the durations the
simulator takes, and the search's memory lower bound."""
from __future__ import annotations

import numpy as np
import pytest

from meshplan.cost import estimate
from meshplan.cost.batch import estimate_batch
from meshplan.cost.durations import stage_durations, stage_totals
from meshplan.search.bounds import states_lower_bound_gib
from meshplan.search.columns import PlanColumns
from meshplan.sim import simulate
from meshplan.spec.io import load_cluster, load_model, load_plan
from meshplan.spec.plan import Plan, Workload

_CACHE: dict[str, object] = {}


def _m(name: str):
    return _CACHE.setdefault("m:" + name, load_model(name))


def _c(name: str):
    return _CACHE.setdefault("c:" + name, load_cluster(name))


def test_zbv_output_layer_on_rank_0_llama3_8b():
    """The issue's case: llama3-8b tp=4 pp=8, global batch 64, seq 8192. torch's V puts the last
    stage (output layer, loss, logits) on rank 0: rank 0 31.9 GiB, the others 22.3 (the cost
    model said 24.8 / 29.4 before); ZB-H1 keeps pp micro-batches on every rank until their W:
    the last rank 29.4 GiB (13.6 before). Both equal the simulated peaks. (Figures with GQA's
    k and v kept at the query heads' width, issue 12.)"""
    from meshplan.cost.params import DEFAULT_PARAMS
    # the figures are the schedule's accounting: the fitted memory constants held at the values
    # they were worked out with
    q = DEFAULT_PARAMS.replace(allocator_fragmentation=0.06, framework_overhead_gib=1.0)
    m, c, w = _m("llama3-8b"), _c("h100-sxm-80gb:32"), Workload(global_batch=64, seq_len=8192)
    # (+3.5 GiB on every rank since the reserved-memory model: the caching allocator's part, 2.4 GiB
    # here without expandable segments, and the CUDA context and NCCL buffers, 1.0 GiB: cost.reserved)
    for plan, first, last in (("tp=4,pp=8,schedule=zbv,virtual_stages=2", 35.4, 25.2),
                              ("tp=4,pp=8,schedule=zero-bubble", 27.7, 32.8)):
        p = load_plan(plan)
        r = estimate(m, c, p, w, q)
        assert (round(r.memory_per_stage[0], 1), round(r.memory_per_stage[-1], 1)) == (first, last)
        _, s = simulate(m, c, p, w, q)
        assert [x["peak_memory_gib"] for x in s["ranks"]] == pytest.approx(r.memory_per_stage, rel=1e-9)
        assert abs(s["sim_vs_analytic_pct"]) < 0.2


@pytest.mark.parametrize("model,cluster,plan,gb,seq", [
    ("llama3-8b", "h100-sxm-80gb:8", "tp=2,pp=4,schedule=zbv,virtual_stages=2", 16, 8192),
    ("llama3-8b", "h100-sxm-80gb:16", "tp=2,pp=8,schedule=zbv,virtual_stages=2,recompute=full", 64, 4096),
    ("llama3-8b", "h100-sxm-80gb:16", "tp=4,pp=4,schedule=zbv,virtual_stages=2,zero=3,fused_loss=true", 16, 4096),
    ("gpt3-13b", "a100-sxm-80gb:16", "tp=4,pp=4,schedule=zbv,virtual_stages=2", 4, 2048),  # tied, m = pp
    ("gpt3-13b", "a100-sxm-80gb:16", "tp=4,pp=4,schedule=zero-bubble", 6, 2048),
    ("llama3-70b", "h100-sxm-80gb:32", "tp=8,pp=4,schedule=zbv,virtual_stages=2,recompute=full", 7, 4096),
    ("llama3-70b", "h100-sxm-80gb:64", "tp=8,pp=8,schedule=zero-bubble,stage_layers=9:10:10:10:10:10:10:11", 24,
     8192),
    ("mixtral-8x7b", "h100-sxm-80gb:32", "tp=4,pp=4,dp=2,ep=2,schedule=zbv,virtual_stages=2", 16, 4096),
    # pipelined FSDP: the once-per-step reduce-scatter follows the last W (13% low before)
    ("gpt3-175b", "a100-sxm-80gb:96", "tp=2,pp=2,dp=24,zero=3,micro_batch=2,schedule=zero-bubble,"
     "recompute=selective,sequence_parallel=1,compile=1,fused_loss=1", 96, 2048),
    ("gpt3-175b", "a100-sxm-80gb:96", "tp=1,pp=8,dp=12,zero=3,schedule=zbv,virtual_stages=2,compile=1", 96, 2048),
])
def test_estimate_agrees_with_the_simulation(model, cluster, plan, gb, seq):
    """Step time within 1.5% of the simulated step, memory per stage exactly the simulated peaks."""
    m, c, p, w = _m(model), _c(cluster), load_plan(plan), Workload(global_batch=gb, seq_len=seq)
    r = estimate(m, c, p, w)
    _, s = simulate(m, c, p, w)
    assert abs(s["sim_vs_analytic_pct"]) < 1.5, s["sim_vs_analytic_pct"]
    assert [x["peak_memory_gib"] for x in s["ranks"]] == pytest.approx(r.memory_per_stage, rel=1e-9)
    assert sum(v for k, v in r.time.items() if not k.endswith("_overlapped")) == pytest.approx(r.step_time_s)


def test_zbv_sends_and_tied_weights():
    """Under the V, ranks 0 and pp - 1 send one activation and one gradient per micro-batch (2,
    not 2 v = 4: no neighbour outside the first and last stage, the turn stays on rank pp - 1),
    and the embedding and output layer share rank 0: the tied copy is summed there, no tied
    all-reduce. Interleaved, the last rank (critical: the output layer) sends 2 v - 1 = 3."""
    m, c, w = _m("gpt3-13b"), _c("a100-sxm-80gb:32"), Workload(global_batch=32, seq_len=2048)
    zbv = load_plan("tp=4,pp=4,dp=2,schedule=zbv,virtual_stages=2")
    inter = zbv.replace(schedule="interleaved-1f1b")
    d, di = stage_durations(m, c, zbv, w), stage_durations(m, c, inter, w)
    send = d.p2p_send_s * d.p2p_exposed
    r, ri = estimate(m, c, zbv, w), estimate(m, c, inter, w)
    assert r.time["pp_comm"] == pytest.approx(d.microbatches * 2 * send, rel=1e-12)  # critical rank 0
    assert ri.time["pp_comm"] == pytest.approx(d.microbatches * 3 * send, rel=1e-12)
    assert m.tied_embeddings
    assert d.end_dp_exposed_s[0] < di.end_dp_exposed_s[0]  # no tied all-reduce
    assert d.end_dp_exposed_s[0] > d.end_dp_exposed_s[1]  # ... but rank 0 syncs the output layer's gradients
    assert d.optimizer_s[0] > d.optimizer_s[-1] and di.optimizer_s[-1] > di.optimizer_s[1]
    vh = m.vocab_size * m.hidden_size / zbv.tp
    lb_zbv = states_lower_bound_gib(m, PlanColumns.from_plans([zbv]))[0]
    lb_int = states_lower_bound_gib(m, PlanColumns.from_plans([inter]))[0]
    # rank 0 under the V holds what interleaving's last rank holds (its blocks, the output layer and
    # the tied copy) plus the embedding's vocabulary matrix: 16 bytes (ZeRO-0 states) per parameter
    assert lb_zbv == pytest.approx(lb_int + 16 * vh / 2**30, rel=1e-4)


@pytest.mark.parametrize("plan", ["tp=2,pp=4,schedule=zbv,virtual_stages=2",
                                  "tp=2,pp=4,schedule=zbv,virtual_stages=2,recompute=full,micro_batch=2",
                                  "tp=2,pp=4,schedule=zero-bubble,offload_params=true,zero=3"])
def test_durations_recombine(plan):
    """stage_totals are the cost model's per-rank totals (output layer on rank 0 under ZBV, its
    sends): m max T + bubble + optimizer + overhead = the estimate's step (dp = 1: no end-of-step
    sync)."""
    m, c, w = _m("llama3-8b"), _c("h100-sxm-80gb:8"), Workload(global_batch=16, seq_len=4096)
    p = load_plan(plan)
    d = stage_durations(m, c, p, w)
    t = stage_totals(d)
    a = d.analytic
    rest = a["step_time_s"] - a["bubble"] - a["optimizer"] - a["overhead"] - d.microbatches * max(t)
    assert rest == pytest.approx(0.0, abs=1e-12 * a["step_time_s"])
    if p.schedule == "zbv":
        assert t.index(max(t)) == 0
    assert max(d.optimizer_s) == pytest.approx(a["optimizer"], rel=1e-12)


@pytest.mark.parametrize("stage_layers", [(2, 8, 8, 14), (4, 8, 8, 12), None])
def test_states_bound_follows_the_v(stage_layers):
    """The search's lower bound counts the output layer where the V puts it (rank 0, with the
    embedding) and the last rank's blocks alone: it stays below the estimate's peak when the
    last rank holds the most blocks (charging it the output layer as well, the bound for
    (2, 8, 8, 14) would be 54.3 GiB against a 51.5 GiB peak)."""
    m, c, w = _m("llama3-8b"), _c("h100-sxm-80gb:4"), Workload(global_batch=4, seq_len=512)
    p = Plan(pp=4, virtual_stages=2, schedule="zbv", stage_layers=stage_layers)
    peak = estimate(m, c, p, w).peak_memory_gib
    lb = states_lower_bound_gib(m, PlanColumns.from_plans([p]))[0]
    assert lb <= peak
    assert lb > 0.85 * peak


def test_split_rows_do_not_change_other_rows():
    """A batch mixing split-backward rows with others gives the others' exact single-plan values
    (the split-backward terms are computed only where they apply)."""
    m, c, w = _m("llama3-8b"), _c("h100-sxm-80gb:8"), Workload(global_batch=16, seq_len=4096)
    plans = [load_plan(x) for x in ("tp=2,pp=4", "tp=2,pp=4,schedule=zbv,virtual_stages=2", "tp=2,pp=4,schedule=gpipe",
                                    "tp=2,pp=4,schedule=zero-bubble", "tp=2,pp=4,virtual_stages=2,"
                                    "schedule=interleaved-1f1b")]
    r = estimate_batch(m, c, w, plans)
    for i, p in enumerate(plans):
        one = estimate_batch(m, c, w, [p])
        assert r["step_time_s"][i] == one["step_time_s"][0]
        assert np.array_equal(r["stage_memory_gib"][i], one["stage_memory_gib"][0])
