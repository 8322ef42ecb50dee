"""The cost model, simulator and search on weak links (issue: Step 5): closed forms of the outer
sync, compression, stragglers and cross-site traffic; token efficiency; invariants over random
sync options (hypothesis); and the two-datacenter search of the issue's done-when."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.cost import estimate
from meshplan.cost.comm import NCCL_BASE_US, NCCL_BW_FACTOR, Group, hop_latency, tree_correction
from meshplan.cost.convergence import DEFAULTS, load_token_efficiency, token_efficiency
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.sync import cross_bytes, expected_max_normal, straggler_seconds
from meshplan.errors import MeshplanError
from meshplan.search.driver import search
from meshplan.search.space import SearchSpace, sync_options, weak_links
from meshplan.sim.build import run_and_summarise, spec_from_plan
from meshplan.spec.cluster import LinkTier
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload, parse_plan

LLAMA8 = load_model("llama3-8b")
TWO_DC = load_cluster("two-dc-h100")  # 2 sites x 16 nodes x 8 H100, 2 GB/s shared between them
WORK = Workload(global_batch=1024, seq_len=4096)
SMALL = load_model("llama3-8b").replace(num_layers=4)


def test_two_dc_preset_is_the_issue_cluster():
    assert TWO_DC.num_dcs == 2 and TWO_DC.gpus_per_dc == 128 and TWO_DC.num_gpus == 256
    assert TWO_DC.inter_dc.shared and TWO_DC.inter_dc.bandwidth_gbps == 2.0
    assert weak_links(TWO_DC) == ["dc"]
    assert weak_links(load_cluster("h100-sxm-80gb:256")) == []
    assert weak_links(load_cluster("cloud-h100-100gbe")) == ["node"]
    assert weak_links(load_cluster("jean-zay-a100")) == []  # 6.25 GB/s per GPU: BLOOM trained synchronously


def test_shared_link_gives_each_group_its_share():
    """A group spanning the two sites reduces hierarchically: its k members per site each run a
    ring between the sites, so N / m rings (m = 2 sites) cross the shared link at once and each
    gets m / N of it; the flat ring over the same devices (one ring per group, N / n of them)
    gets n / N."""
    c = TWO_DC
    total = c.inter_dc.bytes_per_s
    for n, stride in ((2, 128), (256, 1), (16, 16)):
        g = Group.of(c, n, stride)
        assert float(g.outer.n) == 2 and float(g.n) == n / 2
        assert float(g.outer.bytes_per_s) == pytest.approx(min(c.intra_node.bytes_per_s, total * 2 / c.num_gpus))
        flat = g.flat(c, [(n, stride)])
        assert float(flat.bytes_per_s) == pytest.approx(min(c.intra_node.bytes_per_s, total * n / c.num_gpus))
        assert float(g.all_reduce(1e9)) <= float(flat.all_reduce(1e9)) * (1 + 1e-12)
    # a per-GPU link (not shared) keeps its per-GPU bandwidth
    per_gpu = c.replace(inter_dc=LinkTier(name="inter_dc", bandwidth_gbps=2.0, efficiency=0.9))
    assert float(Group.of(per_gpu, 2, 128).outer.bytes_per_s) == pytest.approx(2.0e9 * 0.9)


def test_outer_sync_closed_form():
    """DiLoCo across the two sites, FSDP within each: every rank all-reduces its fp32 shard of the
    parameters (4 B x P / 128) with its peer in the other site, over its 2/256 share of the link,
    once every H steps; with sync_overlap = 0 nothing hides it."""
    plan = parse_plan("dp=256,zero=3,micro_batch=2,grad_sync=diloco,sync_every=100,sync_scope=dc")
    r = estimate(LLAMA8, TWO_DC, plan, WORK)
    held = LLAMA8.num_params() / 128
    bw = TWO_DC.inter_dc.bytes_per_s * 2 / 256
    lat = TWO_DC.inter_dc.latency_us * 1e-6
    ring = 2 * (1 / 2) * 4 * held / bw + 2 * lat
    assert r.outer_sync_s == pytest.approx(ring, rel=0.02)  # (the embedding's tied/untied split aside)
    step_bytes = DEFAULT_PARAMS.outer_step_bytes_per_param * held
    hbm = TWO_DC.gpu.hbm_bandwidth_gbps * 1e9 * DEFAULT_PARAMS.hbm_efficiency
    assert r.time["outer_sync"] == pytest.approx((r.outer_sync_s + step_bytes / hbm) / 100, rel=1e-6)
    # fp8 outer syncs send a quarter; sync_overlap=1 hides up to one inner step of it
    q = estimate(LLAMA8, TWO_DC, plan.replace(grad_compression="fp8"), WORK)
    fixed = 2 * lat + NCCL_BASE_US[("ring", "simple")] * 1e-6  # the ring's latencies and NCCL's base latency
    assert q.outer_sync_s == pytest.approx((r.outer_sync_s - fixed) / 4 + fixed, rel=1e-6)
    o = estimate(LLAMA8, TWO_DC, plan.replace(sync_overlap=1), WORK)
    assert o.time["outer_sync"] < r.time["outer_sync"]
    assert o.time["outer_sync_overlapped"] > 0
    # the outer state: fp32 anchor + momentum of the rank's shard (8 B per held parameter)
    m = estimate(LLAMA8, TWO_DC, plan.replace(grad_sync="local-sgd"), WORK)
    assert r.memory["optimizer"] - m.memory["optimizer"] == pytest.approx(8 * held / 2**30, rel=0.02)


def test_inner_group_shards_within_the_site():
    """A periodic plan syncs and shards only within its inner group (one site here)."""
    sync = estimate(LLAMA8, TWO_DC, parse_plan("dp=256,zero=3,micro_batch=1"), WORK)
    dil = estimate(LLAMA8, TWO_DC, parse_plan("dp=256,zero=3,micro_batch=1,grad_sync=local-sgd,sync_every=50,"
                                              "sync_scope=dc"), WORK)
    # weights/grads/optimizer are sharded over 128 ranks instead of 256: twice the bytes
    assert dil.memory["optimizer"] == pytest.approx(2 * sync.memory["optimizer"], rel=0.02)
    assert dil.cross_site_gb < sync.cross_site_gb / 100


def test_cross_site_bytes_of_plain_data_parallel():
    """DDP over all 256 ranks (tp=8: 32 replicas across both sites): a ring all-reduce of the fp32
    gradients crosses each direction of the link once per group."""
    plan = parse_plan("tp=8,dp=32,micro_batch=1,sequence_parallel=1")
    r = estimate(LLAMA8, TWO_DC, plan, WORK)
    grads = 4.0 * (r.memory["grads"] * 0 + 1)  # placeholder to keep names explicit below
    del grads
    n, groups = 32, 256 / 32
    # the gradient bytes of one rank: 4 B x the parameters it holds (TP splits them)
    from meshplan.cost.batch import estimate_batch
    b = estimate_batch(LLAMA8, TWO_DC, WORK, [plan])
    assert float(b["cross_site_gb"][0]) == pytest.approx(r.cross_site_gb)
    per_rank = r.cross_site_gb * 1e9 / (groups * 2 * (2 - 1) / 2)  # hierarchical: (m - 1) / m, m = 2 sites
    assert per_rank / 4 == pytest.approx(LLAMA8.num_params() / 8, rel=0.15)  # TP leaves norms whole
    assert float(cross_bytes(load_cluster("h100-sxm-80gb:256"), 32, 8, 1e9, 2)) == 0.0  # one site: nothing


def test_compression_shrinks_the_gradient_sync_and_powersgd_pays_memory():
    base = parse_plan("tp=8,dp=32,micro_batch=1,sequence_parallel=1")
    r = {c: estimate(LLAMA8, TWO_DC, base.replace(grad_compression=c), WORK) for c in ("none", "bf16", "fp8")}
    assert r["none"].cross_site_gb == pytest.approx(2 * r["bf16"].cross_site_gb, rel=1e-6)
    assert r["bf16"].cross_site_gb == pytest.approx(2 * r["fp8"].cross_site_gb, rel=1e-6)
    assert r["none"].time["dp_comm"] > r["bf16"].time["dp_comm"] > r["fp8"].time["dp_comm"]
    p1 = estimate(LLAMA8, TWO_DC, base.replace(grad_compression="powersgd", compression_rank=1), WORK)
    p4 = estimate(LLAMA8, TWO_DC, base.replace(grad_compression="powersgd", compression_rank=4), WORK)
    assert p1.cross_site_gb < p4.cross_site_gb < r["fp8"].cross_site_gb
    # error feedback: 4 B per local parameter, plus the P and Q factors
    assert p1.memory["grads"] - r["none"].memory["grads"] > 4 * LLAMA8.num_params() / 8 / 2**30 * 0.9
    assert p4.memory["grads"] > p1.memory["grads"]
    # token efficiency: PowerSGD rank 1 costs tokens, bf16/fp8 do not (cost.convergence defaults)
    assert p1.token_factor == DEFAULTS["powersgd"]["1"] and r["fp8"].token_factor == 1.0


def test_expected_max_of_normals():
    assert float(expected_max_normal(1)) == 0.0
    assert float(expected_max_normal(2)) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-5)  # exact: 0.5642
    assert float(expected_max_normal(1000)) == pytest.approx(3.2414, rel=1e-3)  # tables of order statistics
    z = expected_max_normal(np.array([2, 8, 64, 512]))
    assert np.all(np.diff(z) > 0)


def test_local_sgd_hides_stragglers():
    """Waiting every H steps for the slowest of M groups costs z(M) / sqrt(H) of a step's sigma."""
    wait, sync = straggler_seconds(0.02, np.array([1.0, 1.0]), np.array([256, 256]), np.array([False, True]),
                                   np.array([256, 128]), np.array([1, 2]), np.array([1, 100]))
    z = expected_max_normal(np.array([256, 128, 2]))
    assert wait[0] == pytest.approx(0.02 * z[0]) and sync[1] == pytest.approx(0.02 * z[0])
    assert wait[1] == pytest.approx(0.02 * (z[1] + z[2] / 10))
    jit = TWO_DC.replace(step_jitter=0.0)
    r0 = estimate(LLAMA8, jit, parse_plan("dp=256,zero=3,micro_batch=2"), WORK)
    assert r0.time["straggler"] == 0.0


def test_token_efficiency_defaults_and_override(tmp_path):
    eff = token_efficiency()
    assert float(eff.method_factor("diloco", 500, 8)) == 1.0  # DiLoCo's published regime
    assert float(eff.method_factor("diloco", 500, 16)) == pytest.approx(1.03)
    assert float(eff.method_factor("diloco", 1000, 16)) == pytest.approx(1.06)
    assert float(eff.method_factor("local-sgd", 1, 2)) == 1.0  # local SGD at H = 1 is data parallel
    assert float(eff.method_factor("auto", 1, 1)) == 1.0
    assert all("source" in t and t["source"] for t in DEFAULTS.values())
    f = tmp_path / "eff.toml"
    f.write_text('[diloco]\nfactor = 1.2\n[powersgd]\n"2" = 1.5\n')
    mine = load_token_efficiency(str(f))
    assert float(mine.method_factor("diloco", 100, 2)) == pytest.approx(1.2)
    assert float(mine.compression_factor("powersgd", 3)) == 1.5
    plan = parse_plan("dp=256,zero=3,micro_batch=2,grad_sync=diloco,sync_every=100,sync_scope=dc")
    r = estimate(LLAMA8, TWO_DC, plan, WORK, DEFAULT_PARAMS.replace(token_efficiency_file=str(f)))
    assert r.token_factor == pytest.approx(1.2) and r.time_to_target_s == pytest.approx(1.2 * r.step_time_s)
    for text, words in (('[dilco]\nfactor = 1\n', "unknown table"), ('[diloco]\nfactr = 1\n', "no key"),
                        ('[diloco]\nfactor = -1\n', "positive"), ('[powersgd]\nbig = 1\n', "ranks")):
        f.write_text(text)
        with pytest.raises(MeshplanError, match=words):
            load_token_efficiency(str(f))


SYNC = st.sampled_from([
    ("auto", 1, "all", "none", 1, 0), ("auto", 1, "all", "bf16", 1, 0), ("auto", 1, "all", "fp8", 1, 0),
    ("auto", 1, "all", "powersgd", 2, 0), ("diloco", 50, "dc", "none", 1, 0), ("diloco", 500, "dc", "fp8", 1, 1),
    ("diloco", 20, "node", "bf16", 1, 3), ("local-sgd", 8, "all", "none", 1, 0), ("local-sgd", 4, "dc", "fp8", 1, 1)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sync=SYNC, zero=st.sampled_from([0, 1, 2, 3]), tp=st.sampled_from([1, 2, 8]), pp=st.sampled_from([1, 2]),
       jitter=st.sampled_from([0.0, 0.03]))
def test_invariants_on_random_sync_plans(sync, zero, tp, pp, jitter):
    """Non-negative terms that sum to the step, time to target = step x factor, simulator =
    estimate, memory at least the synchronous plan's where the outer state adds to it."""
    fields = dict(zip(("grad_sync", "sync_every", "sync_scope", "grad_compression", "compression_rank",
                       "sync_overlap"), sync))
    cluster = TWO_DC.replace(step_jitter=jitter)
    dp = 256 // (tp * pp)
    if fields["grad_compression"] == "powersgd" and zero != 0 or (pp > 1 and zero == 2):
        return
    plan = Plan(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=1, sequence_parallel=tp > 1, **fields)
    from meshplan.spec.constraints import violations
    if violations(SMALL, cluster, plan, WORK):
        return
    r = estimate(SMALL, cluster, plan, WORK)
    exposed = {k: v for k, v in r.time.items() if not k.endswith("_overlapped")}
    assert all(v >= 0 for v in r.time.values())
    assert sum(exposed.values()) == pytest.approx(r.step_time_s, rel=1e-9)
    assert r.time_to_target_s == pytest.approx(r.step_time_s * r.token_factor)
    assert r.cross_site_gb >= 0 and r.token_factor >= 1.0
    spec, d = spec_from_plan(SMALL, cluster, plan, WORK)
    _, summary = run_and_summarise(spec, d)
    # exact without a pipeline; with one, within the simulator's known pipelined-FSDP gap (tests/unit/test_sim.py)
    assert abs(summary["sim_vs_analytic_pct"]) < (1e-6 if pp == 1 else 3.0)
    if plan.periodic:  # a longer period never costs more outer time per step
        longer = estimate(SMALL, cluster, plan.replace(sync_every=plan.sync_every * 4), WORK)
        assert longer.time["outer_sync"] <= r.time["outer_sync"] + 1e-12


def test_simulator_draws_the_outer_sync_and_stragglers():
    plan = parse_plan("dp=256,zero=3,micro_batch=2,grad_sync=diloco,sync_every=100,sync_scope=dc")
    spec, d = spec_from_plan(SMALL, TWO_DC, plan, WORK)
    res, _ = run_and_summarise(spec, d)
    names = {e.name for e in res.events}
    assert {"straggler wait", "outer sync (amortised)"} <= names
    ev = next(e for e in res.events if e.name == "outer sync (amortised)")
    assert ev.args["every_steps"] == 100 and ev.args["whole_outer_sync_s"] > ev.end - ev.start


def test_sync_options_follow_the_cluster_and_fix():
    assert sync_options(load_cluster("h100-sxm-80gb:256"), SearchSpace()) == [("auto", 1, "all", "none", 1, 0)]
    opts = sync_options(TWO_DC, SearchSpace())
    assert ("diloco", 500, "dc", "fp8", 1, 1) in opts and all(o[2] != "node" for o in opts)
    fixed = sync_options(TWO_DC, SearchSpace(base=Plan(grad_sync="diloco", sync_every=20),
                                             fixed_sync=(("grad_sync", "diloco"), ("sync_every", 20))))
    assert fixed and all(o[0] == "diloco" and o[1] == 20 for o in fixed)
    assert sync_options(TWO_DC, SearchSpace(sync_methods=False)) == [("auto", 1, "all", "none", 1, 0)]


@pytest.mark.slow  # two full searches on 256 GPUs over two sites
def test_two_datacenters_done_when():
    """The issue's acceptance: Llama 3 8B, global batch 1,024 x 4,096 on two sites of 16 x 8 H100
    joined by 2 GB/s: the chosen plan sends at least 10x less across the sites per step than the
    best fully synchronous plan, reaches the target sooner, and the explanation says why."""
    res = search(LLAMA8, [TWO_DC], WORK, SearchSpace(), objective="time-to-target", top=3)
    best, sync = res.best.report, res.best_synchronous.report
    assert res.best_synchronous.plan.grad_sync in ("auto", "all-reduce", "reduce-scatter")
    assert res.best_synchronous.plan.grad_compression == "none"
    assert best.cross_site_gb * 10 <= sync.cross_site_gb
    assert best.time_to_target_s < sync.time_to_target_s
    from meshplan.search.explain import explain
    text = "\n".join(explain(res))
    assert "cross the link between sites" in text and "to the target loss" in text
    # with the sync methods off, the search is the synchronous one
    plain = search(LLAMA8, [TWO_DC], WORK, SearchSpace(sync_methods=False), top=1)
    assert plain.best.plan.short() == res.best_synchronous.plan.short()


def test_all_reduce_takes_the_tree_where_latency_dominates():
    """Across nodes NCCL's tree replaces the ring where shorter: on k >= 3 nodes it moves 2 S per node
    (the ring 2 (n-1)/n S) but pays 2 ((c-1) intra + ceil(log2 k) inter) tree hops instead of 2 (n-1):
    small messages over many nodes, or slow links; inside a node, the ring."""
    c = load_cluster("h100-sxm-80gb:256")
    g = Group.of(c, 256, 1)  # every rank: across nodes (32 nodes of 8)
    small, big = 1e3, 1e12
    bw, lat = float(g.bytes_per_s), float(g.latency_s)
    ib, il = float(g.intra_bps), float(g.intra_lat)
    base = NCCL_BASE_US[("ring", "simple")] * 1e-6
    ring = lambda s: 2 * 255 / 256 * s / bw + 2 * 255 * lat + base  # noqa: E731
    key = ("tree", "simple")
    hops = 2 * (7 * float(hop_latency(il, "nvlink", key)) + 5 * float(hop_latency(lat, "net", key)))
    tree = lambda s: (max(2 * s / bw, s / ib) / (NCCL_BW_FACTOR[key] * float(tree_correction("simple", s)))  # noqa: E731
                      + hops + NCCL_BASE_US[key] * 1e-6)
    assert float(g.all_reduce(small)) == pytest.approx(tree(small)) and tree(small) < ring(small)
    assert float(g.all_reduce(big)) == pytest.approx(ring(big)) and ring(big) < tree(big)
    inside = Group.of(c, 8, 1)
    assert float(inside.all_reduce(small)) == pytest.approx(float(inside._ring(small, 2.0)))
    # across the 10 ms link between sites, 32 ranks (16 per site): hierarchically, the site's ring
    # (reduce-scatter, all-gather) plus 2 latencies of the link between the sites, not a flat
    # tree's 10 or ring's 62
    w = Group.of(TWO_DC, 32, 8)
    o = w.outer
    assert float(o.n) == 2 and float(w.n) == 16
    inner = 2 * float(w._ring(small, 1.0))
    shard, obw = small / 16, float(o.bytes_per_s)
    between = min(2 * (1 / 2) * shard / obw + 2 * 0.01 + base,  # ring of 2
                  shard / obw / (NCCL_BW_FACTOR[key] * float(tree_correction("simple", shard)))
                  + 2 * float(hop_latency(0.01, "net", key)))  # tree of 2 sites: S each way
    assert float(w.all_reduce(small)) == pytest.approx(inner + between)
    flat = w.flat(TWO_DC, [(32, 8)])  # one ring at the slowest link (gloo): 62 latencies
    assert float(flat.all_reduce(small)) == pytest.approx(2 * 31 / 32 * small / float(flat.bytes_per_s)
                                                          + 2 * 31 * 0.01 + base)
    assert float(w.all_reduce(small)) < float(flat.all_reduce(small)) / 4


@pytest.mark.slow  # two full searches on 256 GPUs over two sites
def test_explanation_names_the_baselines_and_the_objective(tmp_path):
    """Runner-up lines under time to target lead with it; with --fix leaving no uncompressed
    per-step plan, the compressed one is the baseline (and said so); per_doubling = 0 is allowed."""
    from meshplan.search.explain import compare_line, weak_link_lines
    res = search(LLAMA8, [TWO_DC], WORK, SearchSpace(), objective="time-to-target", top=2)
    lines = weak_link_lines(res)
    assert len(lines) == 3 and "uncompressed" in lines[1] and "compressed" in lines[2]
    fixed = search(LLAMA8, [TWO_DC], WORK, SearchSpace(fixed_sync=(("grad_compression", "fp8"),),
                                                       base=Plan(grad_compression="fp8")),
                   objective="time-to-target", top=1)
    assert fixed.best_synchronous is None and fixed.best_per_step is not None
    assert "as --fix asks" in "\n".join(weak_link_lines(fixed))
    a = res.plans[0]
    slow = estimate(LLAMA8, TWO_DC, parse_plan("tp=4,dp=64,micro_batch=2,sequence_parallel=1,"
                                               "grad_compression=powersgd,compression_rank=1"), WORK)
    line = compare_line(a, (parse_plan("tp=4,dp=64,micro_batch=2,sequence_parallel=1,grad_compression=powersgd,"
                                       "compression_rank=1"), slow), "#2")
    assert "to the target loss (tokens x1.15 vs x1.00)" in line
    f = tmp_path / "z.toml"
    f.write_text("[diloco]\nper_doubling = 0\n")
    assert float(load_token_efficiency(str(f)).method_factor("diloco", 4000, 64)) == 1.0
