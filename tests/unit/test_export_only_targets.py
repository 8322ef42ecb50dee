"""Export-only plans (--allow-export-only) are kept only where one export target runs every
runtime rule they break (spec.support.export_targets non-empty); the rest are rejected as
"no export target runs it as planned". And `meshplan plan`'s pre-check sets sequence parallel
and the pipeline sends as the enumeration does (search.space.mesh_sequence_parallel), so a
request with unsharded sends under a pipeline with TP is searched, not refused."""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from clirun import run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.search import SearchSpace, search
from meshplan.search.columns import PlanColumns
from meshplan.search.constraints import NO_EXPORT_TARGET, RUNTIME_CHECKS, reason_names, violation_masks
from meshplan.search.space import enumerate_space
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import (
    GRAD_COMPRESSION,
    GRAD_SYNC,
    PERIODIC_SYNC,
    PRECISIONS,
    SCHEDULES,
    SYNC_SCOPES,
    Plan,
    Workload,
    microbatches,
)
from meshplan.spec.support import RULES, export_targets, runtime_violations

UNFUSED, ALLREDUCE = "unfused attention", "all-reduce gradient sync with sharding"


@functools.cache
def problem(name: str = "llama3-8b", gpus: str = "h100-sxm-80gb:16", batch: int = 64, seq: int = 8192):
    return load_model(name), load_cluster(gpus), Workload(global_batch=batch, seq_len=seq)


def masks_of(plans: list[Plan], export_only: bool, case: tuple = ()) -> dict[str, np.ndarray]:
    m, c, w = problem(*case)
    return violation_masks(m, c, w, PlanColumns.from_plans(plans), export_only=export_only)


def runtime_rejected(masks: dict[str, np.ndarray]) -> np.ndarray:
    """Rows the runtime's rules (and NO_EXPORT_TARGET) reject."""
    out = masks[NO_EXPORT_TARGET].copy()
    for name in RUNTIME_CHECKS:
        out |= masks[name]
    return out


def test_rules_with_no_target_in_common_reject_the_plan():
    assert RULES[UNFUSED].targets == ("megatron",) and RULES[ALLREDUCE].targets == ("deepspeed",)
    both = Plan(tp=2, dp=8, zero=1, flash_attention=False, grad_sync="all-reduce")
    megatron = Plan(tp=2, dp=8, zero=0, flash_attention=False, fused_loss=True)  # both rules megatron's
    fine = Plan(tp=2, dp=8, zero=1, sequence_parallel=True)
    _, _, w = problem()
    assert export_targets(both, microbatches(w.global_batch, 8, 1)) == ()
    assert export_targets(megatron, microbatches(w.global_batch, 8, 1)) == ("megatron",)
    assert export_targets(fine, microbatches(w.global_batch, 8, 1)) is None
    masks = masks_of([both, megatron, fine], export_only=True)
    assert masks[NO_EXPORT_TARGET].tolist() == [True, False, False]
    assert not any(masks[n].any() for n in RUNTIME_CHECKS if RULES[n].targets)
    # without export_only: each rule rejects under its own name, and the new reason never fires
    plain = masks_of([both, megatron, fine], export_only=False)
    assert plain[UNFUSED].tolist() == [True, True, False] and plain[ALLREDUCE].tolist() == [True, False, False]
    assert not plain[NO_EXPORT_TARGET].any()
    # the masks come in reason_names() order (the driver indexes reasons by position)
    assert list(plain) == reason_names()[:len(plain)] and list(masks) == list(plain)
    assert reason_names().index(NO_EXPORT_TARGET) == len(plain) - 1


def test_a_rule_no_target_runs_still_rejects_under_its_own_name():
    zb = Plan(pp=2, dp=8, schedule="zero-bubble", flash_attention=False)  # zero-bubble with DP: no target
    masks = masks_of([zb], export_only=True)
    assert masks["zero-bubble schedule with data parallel gives wrong gradients in torch 2.13"][0]
    assert not masks[NO_EXPORT_TARGET][0]


HAS_OVERLAP = "sync_overlap" in Plan.flat_hints()


@st.composite
def sync_fields(draw) -> dict:
    """Valid gradient-sync fields: sync_every/sync_scope(/sync_overlap) only with local-sgd or diloco,
    compression_rank only with powersgd."""
    d = {"grad_sync": draw(st.sampled_from(GRAD_SYNC)), "grad_compression": draw(st.sampled_from(GRAD_COMPRESSION))}
    if d["grad_sync"] in PERIODIC_SYNC:
        d["sync_every"], d["sync_scope"] = draw(st.sampled_from([1, 4, 50])), draw(st.sampled_from(SYNC_SCOPES))
        if HAS_OVERLAP:
            d["sync_overlap"] = draw(st.sampled_from([0, 1]))
    if d["grad_compression"] == "powersgd":
        d["compression_rank"] = draw(st.sampled_from([1, 4]))
    return d


@st.composite
def plans(draw) -> Plan:
    """Plans over the fields the runtime's rules read, each rule firing often."""
    pp = draw(st.sampled_from([1, 2, 4]))
    schedule = draw(st.sampled_from(SCHEDULES)) if pp > 1 else "1f1b"
    return Plan(tp=draw(st.sampled_from([1, 2, 4, 8, 16])), pp=pp, dp=draw(st.sampled_from([1, 2, 4])),
                cp=draw(st.sampled_from([1, 1, 2])), zero=draw(st.integers(0, 3)),
                micro_batch=draw(st.sampled_from([1, 2, 8])), schedule=schedule,
                virtual_stages=2 if schedule in ("zbv", "interleaved-1f1b") else 1,
                recompute=draw(st.sampled_from(["none", "selective", "full"])),
                sequence_parallel=draw(st.booleans()), p2p_sharded=draw(st.booleans()),
                offload_optimizer=draw(st.booleans()), offload_params=draw(st.booleans()),
                precision=draw(st.sampled_from(PRECISIONS)), compile=draw(st.booleans()),
                async_tp=draw(st.booleans()), flash_attention=draw(st.booleans()),
                fused_loss=draw(st.booleans()), **draw(sync_fields()))


CASES = [("llama3-8b", "h100-sxm-80gb:16", 64, 8192), ("tiny-llama", "a100-sxm-80gb:4", 12, 3000)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(plans(), min_size=1, max_size=12))
def test_vectorised_verdict_equals_export_targets(case, batch):
    """With export_only, the runtime's rules reject a row exactly when it breaks a rule and
    export_targets() is empty; without, exactly when it breaks a rule (the default search)."""
    m, _, w = problem(*case)
    masks = masks_of(batch, export_only=True, case=case)
    plain = masks_of(batch, export_only=False, case=case)
    for i, p in enumerate(batch):
        micro = microbatches(w.global_batch, p.dp, p.micro_batch)
        targets = export_targets(p, micro, m)
        assert bool(runtime_rejected(masks)[i]) == (targets == ()), (p.short(), targets)
        assert bool(runtime_rejected(plain)[i]) == (targets is not None), (p.short(), targets)
        broken = {r.name for r, _ in runtime_violations(p, micro, m)}
        assert {n for n in RUNTIME_CHECKS if plain[n][i]} == broken
        # with export_only: the rules no target runs keep their masks; the rest say NO_EXPORT_TARGET
        assert {n for n in RUNTIME_CHECKS if masks[n][i]} == {n for n in broken if not RULES[n].targets}
        targeted = [set(RULES[n].targets) for n in broken if RULES[n].targets]
        if any(not RULES[n].targets for n in broken):  # rejected under that rule's name; the rules' targets alone
            assert bool(masks[NO_EXPORT_TARGET][i]) == bool(targeted and not set.intersection(*targeted))
        else:  # no target in common, or each common one has a limit of its own (spec.export_limits)
            assert bool(masks[NO_EXPORT_TARGET][i]) == bool(targeted and targets == ())


def test_the_search_rejects_and_explains_plans_no_target_runs():
    m, c, w = problem()
    base = Plan(flash_attention=False, grad_sync="all-reduce")  # megatron's rule; deepspeed's where zero >= 1
    r = search(m, c, w, SearchSpace(base=base, allow_export_only=True), top=20)
    assert r.rejected.get(NO_EXPORT_TARGET, 0) > 0 and r.plans
    assert all(p.export_only == ("megatron",) and p.plan.zero == 0 for p in r.plans)
    msg = r.reject_examples[NO_EXPORT_TARGET]
    assert msg.startswith("tp=") and f"{UNFUSED}: megatron" in msg
    # either no target runs both rules, or megatron (the one target of the unfused rule) has a limit of its own
    assert (("zero=" in msg.split(":")[0] and f"{ALLREDUCE}: deepspeed" in msg)
            or "megatron does not run its " in msg), msg
    # without --allow-export-only nothing of this is kept, and the new reason is not used
    r0 = search(m, c, w, SearchSpace(base=base), top=3)
    assert r0.feasible == 0 and NO_EXPORT_TARGET not in r0.rejected


def test_the_cli_lists_only_plans_one_target_runs(capsys):
    args = ["--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--global-batch", "64",
            "--no-flash-attention", "--fix", "grad_sync=all-reduce", "--allow-export-only", "--top", "10"]
    rc, out, _ = run(capsys, "plan", *args, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["plans"] and all(p["export_only"] == ["megatron"] for p in doc["plans"])
    assert doc["rejected"][NO_EXPORT_TARGET] > 0
    rc, out, _ = run(capsys, "plan", *args)
    assert "[export only: ]" not in out and "no export target runs it as planned" in out


# ---- sequence parallel with unsharded pipeline sends (the CLI pre-check) -------------------------

def test_plan_with_unsharded_sends_under_tp_and_pp_is_searched(capsys):
    rc, out, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16",
                       "--global-batch", "64", "--fix", "p2p_sharded=0,tp=2,pp=2", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["plans"]
    for p in doc["plans"]:
        plan = p["plan"]
        assert (plan["tp"], plan["pp"]) == (2, 2) and not plan["sequence_parallel"] and not plan["p2p_sharded"]


@pytest.mark.parametrize("fix", [{"p2p_sharded": False}, {"p2p_sharded": True}, {}])
@pytest.mark.parametrize("sp", [None, False])
def test_probes_set_sequence_parallel_and_sends_as_the_enumeration(fix, sp):
    from meshplan.cli.plan_cmd import _probes
    m, c, w = problem()
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        space = SearchSpace(base=Plan(**fix), tp=(tp,), pp=(pp,), sequence_parallel=sp)
        cols = enumerate_space(m, c, w, space)
        enumerated = set(zip(cols["sequence_parallel"].tolist(), cols["p2p_sharded"].tolist()))
        probed = {(p.sequence_parallel, p.p2p_sharded) for p in _probes(space, m)}
        assert probed == enumerated, (tp, pp, fix, sp)
