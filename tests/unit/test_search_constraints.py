"""Vectorised constraints equal the scalar predicates; the memory lower bound and the
micro-batch pruning never reject a plan that estimate() says fits; evaluate() equals
estimate() row by row; columns round-trip Plans."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from meshplan.cost import estimate
from meshplan.cost.memory import usable_gib
from meshplan.search.bounds import states_lower_bound_gib
from meshplan.search.columns import PlanColumns
from meshplan.search.constraints import (
    AT_RISK,
    HOST_OOM,
    RUNTIME_CHECKS,
    SEARCH_CHECKS,
    VECTOR_CHECKS,
    ZERO_BUBBLE_DP,
    first_violation,
    reason_names,
    violation_masks,
)
from meshplan.search.evaluate import COLUMNS, evaluate, evaluate_loop
from meshplan.spec.constraints import CHECKS, violations
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import COLON_LISTS, PRECISIONS, RECOMPUTE, SCHEDULES, Plan, Workload
from meshplan.spec.support import RULES, runtime_violations


@functools.cache
def model(name):
    return load_model(name)


@functools.cache
def cluster(name):
    return load_cluster(name)


def random_plan(rng: np.random.Generator, num_layers: int) -> Plan:
    """A Plan that constructs, with every field drawn so that each predicate fires sometimes."""
    def pick(xs):
        return xs[int(rng.integers(len(xs)))]

    pp, v = pick([1, 2, 3, 4, 8]), pick([1, 1, 2, 3])
    recompute = pick(RECOMPUTE)
    stage_layers = None
    if rng.random() < 0.3:
        cuts = np.sort(rng.integers(0, num_layers + 1, pp - 1))
        stage_layers = tuple(int(x) for x in np.diff(np.concatenate([[0], cuts, [num_layers]])))
        if rng.random() < 0.2:
            stage_layers = stage_layers[:-1] + (stage_layers[-1] + 1,)
        if rng.random() < 0.3:
            stage_layers = tuple(v * max(1, round(num_layers / (pp * v))) for _ in range(pp))
    return Plan(tp=pick([1, 2, 3, 4, 8, 16]), pp=pp, dp=pick([1, 2, 3, 4, 8]), cp=pick([1, 2, 4, 8]),
                ep=pick([1, 1, 2, 4, 8]), zero=int(rng.integers(4)), shard_group=pick([0, 0, 2, 4, 8]),
                micro_batch=pick([1, 2, 3, 4]), virtual_stages=v, schedule=pick(SCHEDULES),
                recompute=recompute,
                recompute_layers=(pick([None, 1, 3]) if recompute == "full" else None),
                sequence_parallel=bool(rng.random() < 0.5), offload_optimizer=bool(rng.random() < 0.3),
                offload_params=bool(rng.random() < 0.2), precision=pick(PRECISIONS),
                compile=bool(rng.random() < 0.5), flash_attention=bool(rng.random() < 0.8),
                stage_layers=stage_layers)


CASES = [  # (model, cluster, global batch, seq len)
    ("llama3-8b", "h100-sxm-80gb:8", 64, 8192),
    ("mixtral-8x7b", "h100-sxm-80gb:64", 96, 4096),
    ("gpt3-175b", "a100-sxm-80gb:96", 1536, 2048),
    ("tiny-llama", "a100-sxm-80gb:4", 12, 3000),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_vectorised_masks_equal_scalar_predicates(case):
    m, c, B, s = model(case[0]), cluster(case[1]), *case[2:]
    w = Workload(global_batch=B, seq_len=s)
    rng = np.random.default_rng(len(case[0]))
    plans = [random_plan(rng, m.num_layers) for _ in range(800)]
    # Make the GPU count match often, so the other predicates are seen on plausible plans.
    plans = [p.replace(dp=max(1, c.num_gpus // (p.tp * p.pp * p.cp))) if i % 2 else p
             for i, p in enumerate(plans)]
    cols = PlanColumns.from_plans(plans)
    masks = violation_masks(m, c, w, cols)
    assert list(masks)[:len(CHECKS)] == list(CHECKS)
    for i, p in enumerate(plans):
        scalar = {name for name, _ in violations(m, c, p, w)}
        vec = {name for name in CHECKS if masks[name][i]}
        assert vec == scalar, (p.short(), vec ^ scalar)
        zb = p.schedule in ("zero-bubble", "zbv") and p.pp > 1 and p.dp * p.cp > 1
        assert masks[ZERO_BUBBLE_DP][i] == zb
        # the runtime's rules (spec.support): each vectorised mask equals its scalar rule
        micro = w.global_batch // (p.dp * p.micro_batch)
        assert {n for n in RUNTIME_CHECKS if masks[n][i]} == {r.name for r, _ in runtime_violations(p, micro, m)}
    fired = {name for name in CHECKS if masks[name].any()}
    assert len(fired) >= 9, f"random plans exercise too few predicates: {sorted(fired)}"


def test_every_scalar_check_has_a_vectorised_twin():
    assert set(VECTOR_CHECKS) == set(CHECKS)
    assert reason_names()[-4:] == ["out of memory", HOST_OOM, AT_RISK, "at risk: likely to run out of memory"] and set(SEARCH_CHECKS) <= set(reason_names())
    assert set(RUNTIME_CHECKS) == set(RULES)


def test_unique_rows_matches_numpy():
    from meshplan.search.bounds import unique_rows
    keys = np.random.default_rng(0).integers(0, 3, (500, 4))
    u, inv = unique_rows(keys)
    nu, ninv = np.unique(keys, axis=0, return_inverse=True)
    assert np.array_equal(u, nu) and np.array_equal(inv, ninv.reshape(-1))
    assert np.array_equal(u[inv], keys)


def test_first_violation_counts_each_row_once():
    masks = {"a": np.array([True, False, True, False]), "b": np.array([True, True, False, False])}
    assert first_violation(masks, 4).tolist() == [0, 1, 0, -1]


def test_columns_round_trip_plans():
    rng = np.random.default_rng(3)
    plans = [random_plan(rng, 32) for _ in range(200)]
    cols = PlanColumns.from_plans(plans)
    assert cols.plans() == plans
    both = PlanColumns.concat([cols.take(np.arange(100)), cols.take(np.arange(100, 200))])
    assert both.plans() == plans
    plain = cols.plain()  # decoded values, the layout a vectorised cost model reads
    for i, p in enumerate(plans[:50]):
        for f, arr in plain.items():
            want = getattr(p, f)
            if f in COLON_LISTS:  # their plan-string form, as cost.parts.plans_to_columns writes them
                want = "" if want is None else ":".join(map(str, want))
            assert arr[i] == (-1 if want is None and f == "recompute_layers" else want), f


def _valid_random_plans(m, c, w, n, seed):
    """Random plans that pass every constraint, built on this cluster's GPU count."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        p = random_plan(rng, m.num_layers)
        rest = c.num_gpus // (p.tp * p.pp * p.cp) if c.num_gpus % (p.tp * p.pp * p.cp) == 0 else 0
        if rest == 0 or w.global_batch % rest:
            continue
        mb = [d for d in (1, 2, 4, 8) if (w.global_batch // rest) % d == 0]
        p = p.replace(dp=rest, micro_batch=int(rng.choice(mb)), precision="bf16",
                      sequence_parallel=p.tp > 1)
        if not violations(m, c, p, w):
            out.append(p)
    return out


@pytest.mark.parametrize("case", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_memory_bounds_never_reject_a_fitting_plan(case):
    m, c, B, s = model(case[0]), cluster(case[1]), *case[2:]
    w = Workload(global_batch=B, seq_len=s)
    plans = _valid_random_plans(m, c, w, 150, seed=B)
    lb = states_lower_bound_gib(m, PlanColumns.from_plans(plans))
    usable = usable_gib(c)
    for p, bound in zip(plans, lb):
        r = estimate(m, c, p, w)
        assert bound <= r.peak_memory_gib * (1 + 1e-9), p.short()
        assert not (bound > usable and r.fits), p.short()
        # Micro-batch monotonicity: the same plan with a larger micro-batch needs no less.
        bigger = [d for d in range(p.micro_batch + 1, 2 * p.micro_batch + 1)
                  if (B // p.dp) % d == 0]
        for d in bigger[:1]:
            q = p.replace(micro_batch=d)
            if not violations(m, c, q, w):
                assert estimate(m, c, q, w).peak_memory_gib >= r.peak_memory_gib * (1 - 1e-12), q.short()


@pytest.mark.parametrize("case", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_evaluate_equals_estimate_row_by_row(case):
    m, c, B, s = model(case[0]), cluster(case[1]), *case[2:]
    w = Workload(global_batch=B, seq_len=s)
    plans = _valid_random_plans(m, c, w, 60, seed=7)
    cols = PlanColumns.from_plans(plans)
    fast, slow = evaluate(m, c, w, cols), evaluate_loop(m, c, w, cols)
    assert set(COLUMNS) <= set(fast) and set(COLUMNS) <= set(slow)
    for i, p in enumerate(plans):
        r = estimate(m, c, p, w)
        for out in (fast, slow):  # the vectorised kernel may differ in the last bits
            for k in ("step_time_s", "peak_memory_gib", "tokens_per_s", "tflops_per_gpu", "mfu"):
                assert out[k][i] == pytest.approx(getattr(r, k), rel=1e-12), (k, p.short())
            assert bool(out["fits"][i]) == r.fits and out["dominant"][i] == r.dominant, p.short()
    assert evaluate(m, c, w, cols.take(np.zeros(0, dtype=int)))["fits"].shape == (0,)
