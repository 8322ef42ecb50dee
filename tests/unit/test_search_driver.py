"""The search end to end: a hand-solved instance, the winner of an exhaustive estimate() loop,
determinism, the rejection histogram, pruning, uneven stages, cluster ranges, nothing-fits."""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from meshplan.cost import estimate
from meshplan.errors import MeshplanError
from meshplan.search import SearchSpace, enumerate_space, search
from meshplan.search.sizes import nice_sizes, parse_gpus, resized
from meshplan.spec.constraints import violations
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload, microbatches
from meshplan.spec.support import runtime_violations


@functools.cache
def model(name):
    return load_model(name)


@functools.cache
def cluster(name):
    return load_cluster(name)


def test_single_gpu_tiny_model_solved_by_hand():
    # One GPU: every degree is 1. Everything fits, so the fastest plan runs the whole batch
    # as one micro-batch (largest GEMMs, one pass), recomputes nothing, offloads nothing, and
    # among the equally fast ZeRO levels the least memory is zero=0 (bf16 grads, no fp32 copy).
    r = search(model("tiny-llama"), cluster("h100-sxm-80gb:1"), Workload(global_batch=8, seq_len=64))
    assert r.best is not None and r.best.plan == Plan(micro_batch=8)
    assert r.considered == r.feasible + sum(r.rejected.values())


def _exhaustive_best(m, c, w, space):
    """The definition: estimate() every candidate that passes the scalar constraints and the
    runtime's rules (spec.support), keep those that fit with headroom, order by (time, GPUs,
    memory, short())."""
    best, fitting = None, 0
    for p in enumerate_space(m, c, w, space).plans():
        if violations(m, c, p, w) or runtime_violations(p, microbatches(w.global_batch, p.dp, p.micro_batch), m):
            continue
        r = estimate(m, c, p, w)
        if r.fits and not r.at_risk:
            fitting += 1
            key = (r.step_time_s, p.num_gpus, r.peak_memory_gib, p.short())
            best = min(best, (key, p)) if best else (key, p)
    return best, fitting


@pytest.mark.parametrize("case", [
    ("tiny-llama", "h100-sxm-80gb:8", 16, 64, SearchSpace(offload=False, recompute_fractions=())),
    pytest.param(("llama3-8b", "h100-sxm-80gb:8", 64, 8192,
                  SearchSpace(cp=(1, 2), max_virtual_stages=2, recompute=("none", "op", "full"),
                              recompute_fractions=(0.5,), hybrid_nodes=(), zero=(1, 3), offload=False,
                              micro_batch=(1, 2, 4))),
                 marks=pytest.mark.slow),  # the exhaustive loop over a large space
], ids=["tiny-llama-8", "llama3-8b-8"])
def test_winner_equals_exhaustive_estimate_loop(case):
    m, c, w, space = model(case[0]), cluster(case[1]), Workload(global_batch=case[2], seq_len=case[3]), case[4]
    r = search(m, c, w, space)
    (key, plan), fitting = _exhaustive_best(m, c, w, space)
    assert r.best.plan == plan
    # The memory bound and the micro-batch pruning rejected no plan that fits.
    assert r.feasible == fitting and r.evaluated < r.considered
    assert r.best.report.step_time_s == key[0]


@functools.cache
def _llama8_results():
    m, c, w = model("llama3-8b"), cluster("h100-sxm-80gb:8"), Workload(global_batch=32, seq_len=8192)
    space = SearchSpace(cp=(1, 2), max_virtual_stages=3)
    return search(m, c, w, space), search(m, c, w, space), search(m, c, w, space, prune=False)


def test_same_input_gives_identical_json():
    a, b, _ = _llama8_results()
    assert json.dumps(a.to_json(timing=False)) == json.dumps(b.to_json(timing=False))


def test_pruning_changes_only_the_work_done():
    pruned, _, full = _llama8_results()
    a, b = pruned.to_json(timing=False), full.to_json(timing=False)
    assert pruned.evaluated < full.evaluated
    a.pop("evaluated"), b.pop("evaluated")
    assert a == b


def test_histogram_names_every_rejection():
    r, _, _ = _llama8_results()
    assert r.feasible > 0 and r.considered >= r.feasible
    assert sum(r.rejected.values()) == r.considered - r.feasible
    assert set(r.rejected) == set(r.reject_examples)
    assert "out of memory" in r.rejected
    assert "zero-bubble schedule with data parallel gives wrong gradients in torch 2.13" in r.rejected
    assert all(p.report.fits for p in r.plans)
    times = [p.report.step_time_s for p in r.plans]
    assert times == sorted(times)


def test_pareto_front_is_non_dominated_and_contains_the_winner():
    r, _, _ = _llama8_results()
    pts = np.array([[p.step_time_s, p.peak_memory_gib, p.usd_per_mtok] for p in r.pareto])
    assert r.pareto[0].plan == r.best.plan or pts[0, 0] == r.best.report.step_time_s
    for i, p in enumerate(pts):
        others = np.delete(pts, i, axis=0)
        assert not np.any(np.all(others <= p, axis=1) & np.any(others < p, axis=1))
    # No feasible point dominates a front point.
    allp = np.stack([r.points["step_time_s"], r.points["peak_memory_gib"], r.points["usd_per_mtok"]], 1)
    for p in pts:
        assert not np.any(np.all(allp <= p, axis=1) & np.any(allp < p, axis=1))


def test_uneven_stages_split_layers_that_do_not_divide():
    # 30 blocks on pp=4: no even split, so only the uneven space has pp=4 plans.
    m = load_model("tiny-llama").replace(num_layers=30, name="tiny-30")
    c, w = cluster("a100-sxm-80gb:4"), Workload(global_batch=8, seq_len=64)
    space = SearchSpace(tp=(1,), cp=(1,), pp=(4,), zero=(0,), recompute=("none",), offload=False)
    even = search(m, c, w, space.replace(uneven_stages=False))
    assert even.feasible == 0 and even.rejected["layers do not split into stages"] == even.considered
    for uneven_stages in (None, True):  # the default tries uneven splits where the layers do not divide
        uneven = search(m, c, w, space.replace(uneven_stages=uneven_stages))
        assert uneven.best is not None
        assert sum(uneven.best.plan.stage_layers) == 30 and len(uneven.best.plan.stage_layers) == 4


def test_default_search_splits_unevenly_only_where_the_layers_do_not_divide():
    # 30 blocks: pp=2 (and pp=2 x v=3, 5) divides them: even split only, by default; pp=4 does not.
    m, c, w = model("tiny-llama").replace(num_layers=30, name="tiny-30"), cluster("a100-sxm-80gb:4"), \
        Workload(global_batch=16, seq_len=64)
    space = SearchSpace(tp=(1,), cp=(1,), pp=(2, 4), zero=(0,), recompute=("none",), offload=False)
    plans = enumerate_space(m, c, w, space).plans()
    assert all(p.stage_layers is None for p in plans if p.pp == 2 and 30 % (2 * p.virtual_stages) == 0)
    assert any(p.stage_layers is not None and p.pp == 4 and p.virtual_stages == 1 for p in plans)
    assert not any(p.stage_layers for p in enumerate_space(m, c, w, space.replace(uneven_stages=False)).plans())


def test_nothing_fits_names_the_nearest_options():
    r = search(model("llama3-70b"), cluster("h100-sxm-80gb:1"), Workload(global_batch=8, seq_len=8192))
    assert r.feasible == 0 and r.plans == []
    text = " ".join(r.nearest)
    assert "needs at least" in text and "x h100-sxm-80gb" in text
    assert "most memory-saving plan" in text


def test_cluster_range_ranks_across_sizes():
    m, w = model("llama3-8b"), Workload(global_batch=64, seq_len=4096)
    base = cluster("h100-sxm-80gb:8")
    space = SearchSpace(tp=(1, 2), cp=(1,), max_virtual_stages=2, recompute=("none", "full"),
                        recompute_fractions=(), hybrid_nodes=())
    sizes = [resized(base, n) for n in (8, 16)]
    t = search(m, sizes, w, space, objective="time")
    cost = search(m, sizes, w, space, objective="cost")
    assert {pc.num_gpus for pc in t.per_cluster} == {8, 16}
    assert t.best.report.step_time_s == min(pc.best_step_time_s for pc in t.per_cluster)
    assert cost.best.usd_per_mtok == pytest.approx(min(pc.best_usd_per_mtok for pc in cost.per_cluster))


def test_gpu_ranges():
    assert nice_sizes(64, 1024, 8) == [64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert nice_sizes(1, 8, 8) == [1, 2, 4, 8]
    assert parse_gpus("64,128", 8) == [64, 128]
    for bad in ("10..5", "0..8", "a..b", "12", "9..15"):
        with pytest.raises(MeshplanError):
            parse_gpus(bad, 8)
    assert resized(cluster("h100-sxm-80gb:1"), 16).num_nodes == 2


def test_evaluator_is_a_replaceable_seam():
    from meshplan.search.evaluate import evaluate, evaluate_loop
    calls = []

    def counting(model, cluster, work, cols, params):
        calls.append(cols.num_rows)
        return evaluate(model, cluster, work, cols, params)

    m, c, w = model("tiny-llama"), cluster("h100-sxm-80gb:4"), Workload(global_batch=8, seq_len=64)
    a = search(m, c, w, evaluator=counting, chunk=100)
    b = search(m, c, w)
    assert sum(calls) == a.evaluated and max(calls) <= 100
    assert a.to_json(timing=False) == b.to_json(timing=False)
    # The per-plan reference loop gives the same winner and counts.
    loop = search(m, c, w, evaluator=evaluate_loop)
    assert loop.best.plan == b.best.plan and (loop.feasible, loop.evaluated) == (b.feasible, b.evaluated)


def test_a_partial_gh200_node_grows_into_4_gpu_nodes():
    from meshplan.spec.io import parse_cluster_shorthand
    base = parse_cluster_shorthand("gh200-96gb:2")
    c = resized(base, 12)
    assert (c.num_nodes, c.gpus_per_node) == (3, 4)
    c = resized(parse_cluster_shorthand("h100-sxm-80gb:2"), 16)
    assert (c.num_nodes, c.gpus_per_node) == (2, 8)
