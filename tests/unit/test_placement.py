"""The placement (plan field mesh_order) outside the cost model: plan strings, plan JSON and plan
files (TOML, JSON) round-trip every permutation of the mesh axes (hypothesis, over the generated
plans of test_plan_structure), and the runtime's periodic inner groups refuse a placement that
spreads one over several nodes."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan_structure import plans

from meshplan.errors import MeshplanError
from meshplan.spec.axes import AXES, DEFAULT_ORDER, ParallelDims
from meshplan.spec.base import from_dict, to_dict
from meshplan.spec.io import dump_toml, load_plan, plan_document
from meshplan.spec.plan import Plan, parse_plan

ORDERS = list(itertools.permutations(AXES))


@settings(max_examples=200, deadline=None)
@given(plans(), st.sampled_from(ORDERS), st.sampled_from(["mesh_order", "placement", "order"]))
def test_mesh_order_round_trips(tmp_path_factory, plan: Plan, order: tuple[str, ...], key: str) -> None:
    if plan.pool_dp is not None or plan.pool_pp is not None:  # pools by replica/stage place themselves
        plan = plan.replace(pool_dp=None, pool_pp=None, pools=None, dp_shares=None)
    plan = plan.replace(mesh_order=order)
    want = None if order == DEFAULT_ORDER else order
    assert plan.mesh_order == want and plan.dims.order == order
    text = plan.short()
    assert parse_plan(text) == plan and parse_plan(text).short() == text
    assert ("mesh_order=" + ":".join(order) in text) == (want is not None)
    alias = f"{plan.replace(mesh_order=None).short()},{key}={':'.join(order)}"  # the aliases of plan strings
    assert parse_plan(alias) == plan
    d = to_dict(plan)
    assert d["mesh_order"] == (list(order) if want else None)
    assert from_dict(Plan, json.loads(json.dumps(d))) == plan
    doc = plan_document(plan, model="llama3-8b", global_batch=64)
    tmp = tmp_path_factory.mktemp("placement")
    for suffix, body in (("json", json.dumps(doc, indent=2)), ("toml", dump_toml(doc))):
        path = tmp / f"plan.{suffix}"
        path.write_text(body)
        assert load_plan(str(path)) == plan


@pytest.mark.parametrize("bad", ["tp:pp:dp", "tp:pp:dp:cp:ep", "tp:tp:dp:cp", "tp:pp:dp:xx"])
def test_bad_orders_are_one_line_errors(bad: str) -> None:
    with pytest.raises(MeshplanError, match="a placement names each of"):
        parse_plan(f"tp=2,mesh_order={bad}")


def test_estimate_json_names_the_placement(capsys) -> None:
    """`estimate --json` writes the plan as its plan string, which carries the placement back."""
    from clirun import run
    rc, out, err = run(capsys, "estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16",
                       "--plan", "tp=2,pp=2,dp=4,mesh_order=dp:pp:cp:tp", "--global-batch", "64", "--json")
    assert rc == 0, err
    assert parse_plan(json.loads(out)["plan"]).mesh_order == ("dp", "pp", "cp", "tp")


@pytest.mark.parametrize("order,ok", [
    (None, True),  # the default: dp neighbours tp = 2 ranks apart, an inner group of 2 in one node of 4
    ("pp:tp:cp:dp", True),  # dp innermost: an inner group is 2 consecutive ranks
    ("dp:pp:cp:tp", False),  # dp outermost: dp neighbours tp x pp = 4 ranks apart, in two nodes
])
def test_periodic_inner_groups_under_a_placement(order: str | None, ok: bool) -> None:
    pytest.importorskip("torch")
    from meshplan.runtime.periodic import inner_dp_of
    plan = parse_plan("dp=4,tp=2,pp=2,grad_sync=diloco,sync_every=2,sync_scope=node"
                      + (f",mesh_order={order}" if order else ""))
    if ok:
        assert inner_dp_of(plan, procs_per_node=4) == 2
        grid = ParallelDims.of(plan).rank_grid()  # each inner group (2 dp ranks at one pp, tp) in one node
        for p, g, t in itertools.product(range(2), range(2), range(2)):
            assert len({int(r) // 4 for r in grid[p, 2 * g:2 * g + 2, 0, t]}) == 1
    else:
        with pytest.raises(MeshplanError, match="spans several nodes"):
            inner_dp_of(plan, procs_per_node=4)
