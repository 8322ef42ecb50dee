"""Pure kernels of the search: the stage-split dynamic program against brute force, and the
Pareto front against the O(n^2) definition."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from meshplan.errors import MeshplanError
from meshplan.search.pareto import naive_pareto_mask, pareto_mask, usd_per_million_tokens
from meshplan.search.stages import balanced_stage_layers, split_layers, stage_cost_max


def _compositions(n: int, k: int, lo: int):
    """All tuples of k integers >= lo summing to n, in lexicographic order."""
    if k == 1:
        if n >= lo:
            yield (n,)
        return
    for first in range(lo, n - lo * (k - 1) + 1):
        for rest in _compositions(n - first, k - 1, lo):
            yield (first,) + rest


def _brute(costs, pp, first, last, lo):
    """The documented choice by exhaustion: least max, then least sum of squares, then the
    lexicographically smallest split (all with the same tolerance as the kernel)."""
    best = None
    for split in _compositions(len(costs), pp, lo):
        b = np.concatenate([[0], np.cumsum(split)])
        per = [float(np.sum(costs[b[i]:b[i + 1]])) for i in range(pp)]
        per[0] += first
        per[-1] += last
        key = (max(per), sum(c * c for c in per))
        if best is None or _less(key, best[0]):
            best = (key, split)
    return best[1]


def _less(a, b, rtol=1e-9):
    if a[0] < b[0] * (1 - rtol) - 1e-300:
        return True
    if a[0] > b[0] * (1 + rtol):
        return False
    return a[1] < b[1] * (1 - rtol) - 1e-300


def test_dp_matches_brute_force_on_random_instances():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        pp = int(rng.integers(1, n + 1))
        lo = int(rng.integers(0, 2)) if pp * 1 <= n else 0
        if rng.random() < 0.5:  # integer costs produce many ties
            costs = rng.integers(1, 4, n).astype(float)
            first, last = float(rng.integers(0, 3)), float(rng.integers(0, 3))
        else:
            costs = rng.random(n) * 3
            first, last = float(rng.random()), float(rng.random() * 2)
        got = split_layers(costs, pp, first, last, min_layers=lo)
        want = _brute(costs, pp, first, last, lo)
        assert got == want, (costs.tolist(), pp, first, last, lo)
        assert sum(got) == n and len(got) == pp and min(got) >= lo
        assert stage_cost_max(costs, got, first, last) == pytest.approx(
            stage_cost_max(costs, want, first, last))


def test_uniform_layers_ties_go_to_the_most_even_then_later_heavier_split():
    # 9 blocks on 3 stages, no extras: 3:3:3 (the only optimum).
    assert split_layers(np.ones(9), 3) == (3, 3, 3)
    # 10 blocks on 4 stages: max 3 in any optimum; most even = two 3s and two 2s; the
    # earliest stages lightest: 2:2:3:3.
    assert split_layers(np.ones(10), 4) == (2, 2, 3, 3)
    # An output layer worth one block moves a block off the last stage.
    assert split_layers(np.ones(8), 3, last_extra=1.0) == (3, 3, 2)


def test_published_splits_are_reproduced():
    # torchtitan Llama 3.1 405B: 126 blocks on 8 stages, output layer about one block.
    assert balanced_stage_layers(126, 8, last_extra=0.9) == (15, 16, 16, 16, 16, 16, 16, 15)
    # BLOOM-176B (Megatron-DeepSpeed): 70 blocks on 12 stages, embedding and output each
    # cost about a block: 5:6:...:6:5.
    assert balanced_stage_layers(70, 12, first_extra=0.8, last_extra=0.8) == (5,) + (6,) * 10 + (5,)


def test_virtual_stages_split_in_whole_chunks():
    split = balanced_stage_layers(30, 4, 2, last_extra=1.0)
    assert split is not None and sum(split) == 30 and all(n % 2 == 0 for n in split)
    assert balanced_stage_layers(31, 4, 2) is None  # 31 blocks cannot form chunks of 2
    assert balanced_stage_layers(6, 8) is None  # fewer blocks than stages


def test_zbv_split_charges_the_output_layer_to_rank_0_dp_vs_brute_force():
    """ZBV's V puts the output layer and the loss on rank 0 with the embedding: the split
    minimises the slowest rank with both extras there, as exhaustion over every split in whole
    chunks finds it (the same tie rules)."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        units = int(rng.integers(2, 10))
        pp = int(rng.integers(2, min(units, 5) + 1))
        layer = float(rng.choice([1.0, rng.random() * 2 + 0.1]))
        first, last = (float(rng.integers(0, 3)), float(rng.integers(0, 6))) if rng.random() < 0.5 else \
            (float(rng.random()), float(rng.random() * 6))
        got = balanced_stage_layers(2 * units, pp, 2, layer_cost=layer, first_extra=first, last_extra=last,
                                    schedule="zbv")
        assert got is not None and sum(got) == 2 * units and all(n % 2 == 0 and n > 0 for n in got)
        want = _brute(np.full(units, 2 * layer), pp, first + last, 0.0, 1)
        assert got == tuple(2 * u for u in want), (units, pp, layer, first, last)
        costs = np.full(2 * units, layer)
        best = min(stage_cost_max(costs, tuple(2 * u for u in c), first, last, schedule="zbv")
                   for c in _compositions(units, pp, 1))
        assert stage_cost_max(costs, got, first, last, schedule="zbv") == pytest.approx(best, rel=1e-12)


def test_zbv_split_moves_blocks_off_rank_0():
    # 12 blocks, pp = 2 (chunks of 2), an output layer worth 3.7 blocks (a GPT-3 125M-like
    # vocabulary): on the last rank it takes blocks off rank 1; under ZBV it sits on rank 0.
    assert balanced_stage_layers(12, 2, 2, first_extra=0.01, last_extra=3.7) == (8, 4)
    assert balanced_stage_layers(12, 2, 2, first_extra=0.01, last_extra=3.7, schedule="zbv") == (4, 8)
    # Other schedules, and a single stage, are unchanged by the keyword.
    for sched in ("1f1b", "gpipe", "zero-bubble", "interleaved-1f1b"):
        assert balanced_stage_layers(12, 2, 2, last_extra=3.7, schedule=sched) == (8, 4)
    assert stage_cost_max(np.ones(4), (4,), 1.0, 2.0, schedule="zbv") == stage_cost_max(np.ones(4), (4,), 1.0, 2.0)
    assert stage_cost_max(np.ones(4), (2, 2), 1.0, 2.0, schedule="zbv") == 5.0


def test_impossible_split_is_a_clear_error():
    with pytest.raises(MeshplanError):
        split_layers(np.ones(3), 4)


@pytest.mark.parametrize("k", [2, 3])
def test_pareto_matches_naive_filter(k):
    rng = np.random.default_rng(k)
    for trial in range(60):
        n = int(rng.integers(0, 60))
        pts = (rng.integers(0, 6, (n, k)) if trial % 2 else rng.random((n, k))).astype(float)
        assert np.array_equal(pareto_mask(pts), naive_pareto_mask(pts)), pts


def test_pareto_keeps_identical_points_and_drops_dominated():
    pts = np.array([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0], [2.0, 2.0], [1.0, 3.0]])
    assert pareto_mask(pts).tolist() == [True, True, True, False, False]


def test_dollars_per_million_tokens():
    # 8 GPUs at $2/h, 3.6 s per step: 8 * 2 * 3.6 / 3600 = $0.016 per step; 1e6 tokens per step.
    assert usd_per_million_tokens(8, 2.0, 3.6, 1e6) == pytest.approx(0.016)


def test_compositions_helper_is_complete():
    assert list(_compositions(4, 2, 1)) == [(1, 3), (2, 2), (3, 1)]
    assert len(list(itertools.islice(_compositions(9, 3, 0), 100))) == 55
