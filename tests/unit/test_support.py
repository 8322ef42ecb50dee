"""The runtime's rules on the weak-link plan fields (grad_sync local-sgd/diloco, grad_compression):
each scalar rule (spec.support) against its vectorised twin (search.constraints) on random plans
that draw those fields, and one example plan per rule."""
from __future__ import annotations

import numpy as np
import pytest

from meshplan.search.columns import PlanColumns
from meshplan.search.constraints import RUNTIME_CHECKS
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import GRAD_COMPRESSION, Plan, Workload
from meshplan.spec.support import RULES, export_targets, runtime_violations

NEW = ("PowerSGD under FSDP2", "periodic sync with expert parallel")


def random_plan(rng: np.random.Generator) -> Plan:
    def pick(xs):  # type: ignore[no-untyped-def]
        return xs[int(rng.integers(len(xs)))]
    sync = pick(["auto", "all-reduce", "reduce-scatter", "local-sgd", "diloco"])
    periodic = sync in ("local-sgd", "diloco")
    comp = pick(GRAD_COMPRESSION)
    every = pick([1, 4]) if periodic else 1
    return Plan(dp=pick([1, 2, 4, 8]), tp=pick([1, 2]), ep=pick([1, 1, 2]), zero=int(rng.integers(4)),
                offload_params=bool(rng.random() < 0.2), offload_optimizer=bool(rng.random() < 0.2),
                grad_sync=sync, sync_every=every, sync_overlap=pick([0, 0, 1]) if every > 1 else 0,
                sync_scope=pick(["all", "node", "dc"]) if periodic else "all", grad_compression=comp,
                compression_rank=pick([1, 4]) if comp == "powersgd" else 1)


def test_new_rules_equal_their_vectorised_twins() -> None:
    m, c = load_model("tiny-llama"), load_cluster("h100-sxm-80gb:16")
    w = Workload(global_batch=64, seq_len=64)
    rng = np.random.default_rng(7)
    plans = [random_plan(rng) for _ in range(600)]
    cols = PlanColumns.from_plans(plans)
    fired = {name: 0 for name in NEW}
    for name in NEW:
        mask = np.asarray(RUNTIME_CHECKS[name](m, c, w, cols), dtype=bool)
        for i, p in enumerate(plans):
            scalar = RULES[name].why(p, 8, m) is not None
            assert bool(mask[i]) == scalar, (name, p.short())
            fired[name] += scalar
    assert all(n > 10 for n in fired.values()), fired


POWERSGD_OFFLOAD = Plan(dp=8, grad_compression="powersgd", offload_optimizer=True)
OVERLAP = Plan(dp=8, grad_sync="diloco", sync_every=4, sync_overlap=1)
DILOCO_EP = Plan(dp=8, ep=2, grad_sync="diloco", sync_every=4)


@pytest.mark.parametrize("name,plan,kind,fine", [
    # what the runtime does run: PowerSGD on DDP; fp8 and bf16 under FSDP2 (custom reduce-scatter,
    # reduce_dtype)
    (NEW[0], POWERSGD_OFFLOAD, "runs-as", [POWERSGD_OFFLOAD.replace(offload_optimizer=False),
                                           Plan(dp=8, zero=3, grad_compression="fp8"),
                                           Plan(dp=8, zero=1, grad_compression="bf16")]),
    # a periodic plan without experts, experts with a synchronous plan
    (NEW[1], DILOCO_EP, "refused", [DILOCO_EP.replace(ep=1), DILOCO_EP.replace(grad_sync="auto", sync_every=1)]),
])
def test_examples(name: str, plan: Plan, kind: str, fine: list[Plan]) -> None:
    assert RULES[name].kind == kind
    # (PowerSGD with offload_optimizer also breaks "optimizer offload without parameter offload")
    assert name in [r.name for r, _ in runtime_violations(plan, 8)]
    assert export_targets(plan, 8) == ()  # no export target runs either as planned
    for p in fine:
        assert not [r for r, _ in runtime_violations(p, 8) if r.name == name], p.short()


@pytest.mark.parametrize("plan", [OVERLAP, OVERLAP.replace(grad_sync="local-sgd"),
                                  OVERLAP.replace(sync_every=8, sync_overlap=7, grad_compression="fp8", zero=3),
                                  OVERLAP.replace(grad_sync="local-sgd", sync_overlap=2, grad_compression="bf16")])
def test_overlapped_outer_sync_runs_as_planned(plan: Plan) -> None:
    """sync_overlap = tau > 0 (DiLoCo and local SGD, any compression): the runtime overlaps the
    outer sync with the next tau inner steps (runtime/periodic.py), so no rule of its table fires
    and the plan needs no export target; the vectorised rules agree."""
    assert runtime_violations(plan, 8) == [] and export_targets(plan, 8) is None
    m, c = load_model("tiny-llama"), load_cluster("h100-sxm-80gb:16")
    cols = PlanColumns.from_plans([plan])
    w = Workload(global_batch=64, seq_len=64)
    assert not any(bool(np.asarray(fn(m, c, w, cols), dtype=bool)[0]) for fn in RUNTIME_CHECKS.values())
