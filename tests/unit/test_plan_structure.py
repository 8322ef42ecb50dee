"""The structured Plan (spec.plan: a few sub-records) and the axis object (spec.axes).

- Plan has at most 10 dataclass fields, each a frozen sub-record; every flat key still reads,
  builds and changes flat (``plan.tp``, ``Plan(tp=4)``, ``plan.replace(tp=8)``).
- Over generated plans (every sub-record field, pools, pool_dp, dp_shares, buckets and stage_layers
  included): plan string -> plan -> string, plan -> JSON dict -> plan, and plan file write -> read
  round-trip unchanged, and plan JSON is the flat table of PLAN_FIELDS, in that order.
- No axis-name string literal ('tp', 'pp', 'dp', 'cp', 'ep') remains in src/meshplan outside the
  axis module: the names come from ``spec.axes.AX``.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX, AXES, DEGREES, ParallelDims
from meshplan.spec.base import from_dict, to_dict
from meshplan.spec.io import dump_toml, load_plan, plan_document
from meshplan.spec.plan import (
    GRAD_COMPRESSION,
    PLAN_FIELDS,
    PLAN_PARTS,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    SYNC_SCOPES,
    Degrees,
    Plan,
    parse_plan,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "meshplan"


# ---- generated plans -------------------------------------------------------------------------------

@st.composite
def buckets_for(draw, cp: int) -> tuple[str, ...]:
    """Valid buckets for a plan of context-parallel degree ``cp`` (a power of two): ascending
    limits, cps dividing each other, the largest equal to cp."""
    k = draw(st.integers(1, 4))
    limits = sorted(draw(st.sets(st.integers(1, 1 << 17), min_size=k, max_size=k)))
    exps = sorted(draw(st.lists(st.integers(0, cp.bit_length() - 1), min_size=k, max_size=k)))
    exps[-1] = cp.bit_length() - 1
    return tuple(f"{n}x{draw(st.integers(1, 16))}cp{1 << e}" for n, e in zip(limits, exps))


@st.composite
def sync_fields(draw) -> dict:
    grad_sync = draw(st.sampled_from(["auto", "all-reduce", "reduce-scatter", "local-sgd", "diloco"]))
    periodic = grad_sync in ("local-sgd", "diloco")
    compression = draw(st.sampled_from(GRAD_COMPRESSION))
    return {"grad_sync": grad_sync,
            "sync_every": draw(st.integers(1, 1000)) if periodic else 1,
            "sync_scope": draw(st.sampled_from(SYNC_SCOPES)) if periodic else "all",
            "sync_overlap": draw(st.integers(0, 3)) if periodic else 0,
            "grad_compression": compression,
            "compression_rank": draw(st.integers(1, 64)) if compression == "powersgd" else 1}


@st.composite
def plans(draw) -> Plan:
    """A valid Plan over every field: either a bucket plan (pp = ep = 1, one pool at most) or a
    plan with stage_layers, dp_shares and pools (pool_dp or pool_pp)."""
    kind = draw(st.sampled_from(["plain", "buckets", "pool_dp", "pool_pp"]))
    recompute = draw(st.sampled_from(RECOMPUTE))
    kw: dict = {
        "tp": draw(st.sampled_from([1, 2, 4, 8, 3])),
        "zero": draw(st.integers(0, 3)),
        "shard_group": draw(st.integers(0, 64)),
        "virtual_stages": draw(st.integers(1, 4)),
        "schedule": draw(st.sampled_from(SCHEDULES)),
        "recompute": recompute,
        "recompute_layers": draw(st.none() | st.integers(0, 50)) if recompute == "full" else None,
        "sequence_parallel": draw(st.booleans()),
        "offload_optimizer": draw(st.booleans()),
        "offload_params": draw(st.booleans()),
        "precision": draw(st.sampled_from(PRECISIONS)),
        "compile": draw(st.booleans()),
        "flash_attention": draw(st.booleans()),
        "fused_loss": draw(st.booleans()),
        "p2p_sharded": draw(st.booleans()),
        "async_tp": draw(st.booleans()),
        **draw(sync_fields()),
    }
    names = draw(st.lists(st.sampled_from(["h100", "a100", "l40s", "mi300x"]), min_size=1, max_size=3, unique=True))
    if kind == "buckets":
        cp = draw(st.sampled_from([1, 2, 4, 8]))
        buckets = draw(buckets_for(cp))
        kw.update(pp=1, ep=1, cp=cp, dp=draw(st.integers(1, 64)), buckets=buckets,
                  micro_batch=int(buckets[-1].split("x")[1].split("cp")[0]))
        if draw(st.booleans()):
            kw["pools"] = tuple(names[:1])
        return Plan(**kw)
    pp = draw(st.integers(1, 6))
    kw.update(pp=pp, cp=draw(st.integers(1, 4)), micro_batch=draw(st.integers(1, 8)),
              stage_layers=draw(st.none() | st.lists(st.integers(0, 40), min_size=pp, max_size=pp).map(tuple)))
    if kind == "pool_dp":
        pool_dp = draw(st.lists(st.integers(1, 4), min_size=len(names), max_size=len(names)))
        kw.update(pools=tuple(names), pool_dp=tuple(pool_dp), dp=sum(pool_dp),
                  shard_group=draw(st.sampled_from([0, math.gcd(*pool_dp) * kw["cp"]])))
        if draw(st.booleans()):
            kw["dp_shares"] = tuple(draw(st.lists(st.integers(1, 5), min_size=len(names), max_size=len(names))))
    else:
        dp = draw(st.integers(1, 16))
        kw["dp"] = dp
        if kind == "pool_pp" and len(names) <= pp:
            cuts = sorted(draw(st.sets(st.integers(1, pp - 1), min_size=len(names) - 1,
                                       max_size=len(names) - 1))) if len(names) > 1 else []
            bounds = [0, *cuts, pp]
            kw.update(pools=tuple(names), pool_pp=tuple(b - a for a, b in zip(bounds, bounds[1:])))
        if draw(st.booleans()):
            block = draw(st.sampled_from([d for d in range(1, dp + 1) if dp % d == 0]))
            kw["dp_shares"] = tuple(draw(st.lists(st.integers(1, 5), min_size=dp // block, max_size=dp // block)))
    kw["ep"] = draw(st.sampled_from([e for e in (1, 2, 4) if (kw["dp"] * kw["cp"]) % e == 0]))
    return Plan(**kw)


def test_plan_has_at_most_ten_fields_each_a_frozen_sub_record():
    fields = dataclasses.fields(Plan)
    assert len(fields) <= 10
    for f in fields:
        cls = PLAN_PARTS[f.name]
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    flat = [g.name for f in fields for g in dataclasses.fields(PLAN_PARTS[f.name])]
    assert sorted(flat) == sorted(PLAN_FIELDS) and len(flat) == len(set(flat))


def test_flat_access_construction_and_replace():
    p = Plan(tp=4, pp=2, dp=8, zero=3, micro_batch=2, grad_sync="diloco", sync_every=50)
    assert (p.tp, p.pp, p.dp, p.zero, p.sync_every) == (4, 2, 8, 3, 50)
    assert p.degrees == Degrees(tp=4, pp=2, dp=8) and p.sharding.zero == 3
    q = p.replace(tp=2, schedule="gpipe")
    assert (q.tp, q.schedule, q.pp, q.zero) == (2, "gpipe", 2, 3) and p.tp == 4
    assert q.kernels is p.kernels  # records left unchanged are shared
    assert dataclasses.replace(p, tp=2) == p.replace(tp=2) == Plan(**{**p.flat_dict(), "tp": 2})
    assert Plan(degrees=Degrees(tp=4), zero=1) == Plan(tp=4, zero=1)
    assert p.dims == ParallelDims(pp=2, dp=8, cp=1, tp=4, ep=1)
    with pytest.raises(TypeError):
        Plan(tensor_parallel=4)  # type: ignore[call-arg]
    with pytest.raises(MeshplanError, match="plan: tp must be > 0"):
        Plan(tp=0)
    with pytest.raises(MeshplanError, match="stage_layers has 1 entries but pp=2"):
        Plan(pp=2, stage_layers=(4,))  # a rule across records stays in Plan
    assert repr(Plan()).startswith("Plan(tp=1, pp=1, dp=1, cp=1, ep=1, zero=0,")


@settings(max_examples=300, deadline=None)
@given(plans())
def test_plan_string_json_and_file_round_trips(tmp_path_factory, plan):
    text = plan.short()
    assert parse_plan(text) == plan and parse_plan(text).short() == text
    d = to_dict(plan)
    assert list(d) == list(PLAN_FIELDS)  # plan JSON: the flat table, in the fields' order
    assert d == {k: (list(v) if isinstance(v, tuple) else v) for k, v in
                 ((k, getattr(plan, k)) for k in PLAN_FIELDS)}
    assert from_dict(Plan, json.loads(json.dumps(d))) == plan
    doc = plan_document(plan, model="llama3-8b", global_batch=64)
    tmp = tmp_path_factory.mktemp("plans")
    for suffix, body in (("json", json.dumps(doc, indent=2)), ("toml", dump_toml(doc))):
        path = tmp / f"plan.{suffix}"
        path.write_text(body)
        back = load_plan(str(path))
        assert back == plan
        assert json.dumps(plan_document(back, model="llama3-8b", global_batch=64), indent=2) == \
            json.dumps(doc, indent=2)  # written again: byte-identical


def test_old_flat_plan_files_load(tmp_path):
    """A plan file as written before the sub-records (one flat table) loads."""
    old = {"schema_version": 1, "kind": "plan",
           "plan": {"tp": 8, "pp": 2, "dp": 4, "cp": 1, "ep": 1, "zero": 1, "shard_group": 0, "micro_batch": 1,
                    "virtual_stages": 1, "schedule": "1f1b", "recompute": "none", "recompute_layers": None,
                    "sequence_parallel": True, "offload_optimizer": False, "offload_params": False,
                    "precision": "bf16", "compile": False, "flash_attention": True, "fused_loss": False,
                    "grad_sync": "auto", "sync_every": 1, "sync_scope": "all", "sync_overlap": 0,
                    "grad_compression": "none", "compression_rank": 1, "p2p_sharded": True, "async_tp": False,
                    "stage_layers": [15, 17], "dp_shares": None, "pools": None, "pool_dp": None,
                    "pool_pp": None, "buckets": None}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    plan = load_plan(str(path))
    assert plan == parse_plan("tp=8,pp=2,dp=4,zero=1,sequence_parallel=1,stage_layers=15:17")
    new = to_dict(plan)  # keys added since (the placement) come back at their defaults
    assert {k: new[k] for k in old["plan"]} == old["plan"]
    assert {k: v for k, v in new.items() if k not in old["plan"]} == {"mesh_order": None, "site_order": None}
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"tp": 2, "dp": 4, "micro_batch": 2}))  # bare keys, no plan table
    assert load_plan(str(short)) == Plan(tp=2, dp=4, micro_batch=2)


# ---- the axis object -------------------------------------------------------------------------------

def test_axis_object():
    assert AXES == (AX.PP, AX.DP, AX.CP, AX.TP) and set(DEGREES) == {*AXES, AX.EP}
    dims = ParallelDims(pp=2, dp=3, cp=2, tp=4, ep=2)
    assert dims.world_size == 48 and dims.mesh_shape == (2, 3, 2, 4) and dims.mesh_dims == AXES
    assert dims.root_shape == (2, 6, 4) and dims.root_dims == (AX.PP, AX.DP_CP, AX.TP)
    seen = {tuple(dims.coords(r).values()) for r in range(dims.world_size)}
    assert len(seen) == dims.world_size
    assert dims.coords(1) == {AX.PP: 0, AX.DP: 0, AX.CP: 0, AX.TP: 1}  # tp innermost
    assert all(dims.rank(*dims.coords(r).values()) == r for r in range(dims.world_size))
    assert ParallelDims.of(Plan(tp=2, pp=3)) == ParallelDims(tp=2, pp=3)


AXIS_NAMES = frozenset({AX.TP, AX.PP, AX.DP, AX.CP, AX.EP})
AXIS_MODULE = SRC / "spec" / "axes.py"
ALLOWED: dict[str, int] = {}
"""Files (relative to src/meshplan) still holding axis-name literals, and how many: to be emptied."""


def axis_literals(path: Path) -> list[int]:
    """Lines of the string constants exactly equal to an axis name (f-strings and longer strings
    that merely contain one are not axis literals; docstrings never equal one)."""
    tree = ast.parse(path.read_text(), str(path))
    in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return sorted(n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and n.value in AXIS_NAMES and id(n) not in in_fstrings)


def test_no_axis_name_literal_outside_the_axis_module():
    found: dict[str, list[int]] = {}
    for path in sorted(SRC.rglob("*.py")):
        if path == AXIS_MODULE:
            continue
        lines = axis_literals(path)
        if lines:
            found[path.relative_to(SRC).as_posix()] = lines
    bad = [f"src/meshplan/{f}:{n}" for f, lines in found.items() if len(lines) > ALLOWED.get(f, 0) for n in lines]
    assert not bad, ("axis-name string literals outside spec/axes.py (use spec.axes.AX.TP, ...):\n  "
                     + "\n  ".join(bad))
