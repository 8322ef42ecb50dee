"""Fuzzing the spec parsers: any input either gives a valid object or a MeshplanError.

Never a TypeError, KeyError, AttributeError, ZeroDivisionError, RecursionError, OverflowError...
Bounded so the whole file runs in a few seconds.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from meshplan.errors import MeshplanError
from meshplan.spec import ClusterSpec, GPUSpec, LinkTier, ModelSpec, Plan, parse_plan
from meshplan.spec.base import from_dict, to_dict
from meshplan.spec.io import (
    load_cluster,
    load_gpu,
    load_model,
    load_plan,
    parse_cluster_shorthand,
    read_data_file,
)
from meshplan.spec.plan import PLAN_KEY_ALIASES, SCHEDULE_ALIASES

FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

GPU_NAMES = ["a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb", "h100-sxm-96gb-500w"]
MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelSpec)]
GPU_FIELDS = [f.name for f in dataclasses.fields(GPUSpec)]
LINK_FIELDS = [f.name for f in dataclasses.fields(LinkTier)]
CLUSTER_FIELDS = [f.name for f in dataclasses.fields(ClusterSpec)]
PLAN_FIELDS = list(Plan.flat_hints())
META_KEYS = ["schema_version", "kind", "meta"]


def valid_or_meshplan_error(fn, *args):
    """Call fn; a MeshplanError (with a non-empty message) is fine, any other exception fails."""
    try:
        out = fn(*args)
    except MeshplanError as e:
        assert str(e).strip()
        event(f"{fn.__name__}: MeshplanError")
        return None
    event(f"{fn.__name__}: valid")
    return out


def assert_round_trips(obj) -> None:
    """A returned spec is valid: it survives to_dict -> JSON -> from_dict unchanged."""
    assert from_dict(type(obj), json.loads(json.dumps(to_dict(obj)))) == obj


# --------------------------------------------------------------------------------------
# strategies

INTERESTING = st.sampled_from([
    0, 1, -1, 2, 3, 7, 8, 64, 4096, 10**30, -(10**30), 10**400, 0.0, -0.0, 0.5, 1.5, 1e308, -1e-300,
    math.inf, -math.inf, math.nan, True, False, None, "", " ", "0", "1", "-1", "8", "1e3", "nan", "inf",
    "true", "no", "swiglu", "rmsnorm", "learned", "fp8", "bf16", "1f1b", "interleaved-1f1b", "zbv",
    "full", "h100-sxm-80gb", "a100-sxm-40gb", "x.toml", "pyproject.toml", [], {}, [1, 2], [0], [8, 8],
    {"bf16": 1.0}, {"fp16": -1.0}, {"fp9": 1.0}, {"bandwidth_gbps": 0}, {"name": "x", "bandwidth_gbps": 1},
])
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | INTERESTING)
JSON_LIKE = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
VALUES = INTERESTING | JSON_LIKE
# Values that are often accepted, so fuzzing also reaches __post_init__ and the round trips.
NICE = st.integers(1, 64) | st.sampled_from([
    True, False, 0, 2.0, 0.5, "2", "swiglu", "gelu_4h", "layernorm", "alibi", "learned", "rotary",
    "nvlink", "hopper", "full", "selective", "gpipe", "zbv", "fp16", "bf16", "fp8"])


def spec_dicts(fields: list[str], base: dict | None = None, values=VALUES):
    """Dicts keyed mostly by real field names; optionally a valid ``base`` with some fields changed."""
    keys = st.sampled_from(fields + META_KEYS) | st.text(max_size=10)
    random_dict = st.dictionaries(keys, values, max_size=10)
    if base is None:
        return random_dict

    @st.composite
    def mutated(draw, changes):
        d = dict(base)
        if draw(st.integers(0, 3)) == 0:
            d.pop(draw(st.sampled_from(sorted(d))), None)
        d.update(draw(changes))
        return d

    @st.composite
    def same_type(draw):
        """Change a few fields to other values of the same type (often still valid)."""
        out = {}
        for k in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
            v = base.get(k)
            if isinstance(v, bool):
                out[k] = draw(st.booleans())
            elif isinstance(v, int):
                out[k] = draw(st.sampled_from([v, 2 * v, max(1, v // 2), 1, 0, -v]) | st.integers(-1, 10**6))
            elif isinstance(v, float):
                out[k] = draw(st.sampled_from([v, v / 2, 2 * v, 0.0, 1.0, -v]) | st.floats(-1.0, 1e4))
            elif isinstance(v, dict):
                out[k] = {**v, **draw(st.dictionaries(st.sampled_from(["bf16", "fp16", "fp8", "fp32", "int8"]),
                                                      st.floats(-1.0, 1e4), max_size=2))}
            else:
                out[k] = draw(NICE | values)
        return out

    few_nice = st.dictionaries(st.sampled_from(fields), NICE | values, max_size=2)
    return st.one_of(mutated(same_type()), mutated(same_type()), mutated(few_nice),
                     mutated(st.dictionaries(keys, values, max_size=3)), random_dict)


def _toml_value(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # TOML accepts inf, -inf, nan and 1e+16 forms
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(x for x in map(_toml_value, v) if x is not None) + "]"
    if isinstance(v, dict):
        items = [(json.dumps(k), _toml_value(x)) for k, x in v.items()]
        return "{" + ", ".join(f"{k} = {x}" for k, x in items if x is not None) + "}"
    raise TypeError(type(v))


def toml_text(data: dict) -> str:
    """Tiny TOML writer: scalars first, then one [table] per dict value (None values dropped)."""
    lines, tables = [], []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif (s := _toml_value(v)) is not None:
            lines.append(f"{json.dumps(k)} = {s}")
    for name, table in tables:
        lines.append(f"[{json.dumps(name)}]")
        lines += [f"{json.dumps(k)} = {s}" for k, x in table.items() if (s := _toml_value(x)) is not None]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def fuzzdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def write_both(fuzzdir: Path, data) -> list[str]:
    """The same data as a .json and (when it is a dict) a .toml file; returns the paths."""
    j = fuzzdir / "spec.json"
    j.write_text(json.dumps(data))
    paths = [str(j)]
    if isinstance(data, dict):
        t = fuzzdir / "spec.toml"
        t.write_text(toml_text(data))
        paths.append(str(t))
    return paths


# --------------------------------------------------------------------------------------
# parse_plan

PLAN_KEYS = st.sampled_from(PLAN_FIELDS + sorted(PLAN_KEY_ALIASES) + ["TP", " pp ", "Micro_Batch"])
PLAN_VALUES = (
    st.sampled_from(["1", "2", "8", "0", "-1", "3", "true", "false", "yes", "fsdp", "1:2", "4;4", "8:8:8:8",
                     "::", ":", "", " ", "1e3", "2.0", "nan", "full", "selective", "none", "fp8", "bf16",
                     "=", "==8", "x"] + sorted(SCHEDULE_ALIASES) + ["1f1b", "gpipe", "zbv", "zero-bubble"])
    | st.integers().map(str)
    | st.lists(st.integers(-2, 40), min_size=1, max_size=9).map(lambda xs: ":".join(map(str, xs)))
    | st.text(max_size=8)
)


@FUZZ
@given(st.text())
def test_parse_plan_arbitrary_text(text):
    plan = valid_or_meshplan_error(parse_plan, text)
    if plan is not None:
        assert isinstance(plan, Plan)
        assert parse_plan(plan.short()) == plan


_BOOL_WORDS = ["0", "1", "true", "false", "yes", "no", "True"]
_GOOD_PLAN_VALUES = {
    "zero": ["0", "1", "2", "3", "fsdp", "true"], "shard_group": ["0", "2", "4"],
    "schedule": ["1f1b", "gpipe", "zero-bubble", "ZB", "interleaved"], "recompute": ["none", "selective"],
    "precision": ["bf16", "fp16", "fp8", "fp32"], "stage_layers": ["4", "2:2"], "recompute_layers": ["1"],
    "grad_sync": ["auto", "all-reduce", "reduce-scatter", "local-sgd", "diloco", "diloco", "DiLoCo"],
    "sync_every": ["1", "8", "500", "0"], "sync_scope": ["all", "node", "dc", "rack"], "sync_overlap": ["0", "1", "2"],
    "grad_compression": ["none", "bf16", "fp8", "powersgd", "powersgd", "int4"], "compression_rank": ["1", "4", "0"],
    **{k: _BOOL_WORDS for k in ("sequence_parallel", "offload_optimizer", "offload_params", "compile",
                                "flash_attention", "async_tp")},
}


@st.composite
def plan_pair(draw):
    """One key=value pair: mostly a real key with a value that suits it."""
    key = draw(st.one_of(PLAN_KEYS, PLAN_KEYS, PLAN_KEYS, st.text(max_size=6)))
    field = PLAN_KEY_ALIASES.get(key.strip().lower(), key.strip().lower())
    good = st.sampled_from(_GOOD_PLAN_VALUES.get(field, ["1", "2", "4", "8", " 2 "]))
    return key, draw(st.one_of(good, good, good, PLAN_VALUES))


@FUZZ
@given(st.lists(plan_pair(), max_size=5),
       st.sampled_from([",", ", ", " ,"]))
def test_parse_plan_near_valid(pairs, sep):
    text = sep.join(f"{k}={v}" for k, v in pairs)
    plan = valid_or_meshplan_error(parse_plan, text)
    if plan is not None:
        assert isinstance(plan, Plan)
        assert parse_plan(plan.short()) == plan
        assert_round_trips(plan)
    # load_plan on a string that is not a file name goes through the same parser.
    if not text.endswith((".toml", ".json")):
        assert valid_or_meshplan_error(load_plan, text) == plan


# --------------------------------------------------------------------------------------
# cluster shorthand

COUNTS = (st.integers().map(str) | st.text(max_size=6)
          | st.tuples(st.integers(-2, 64), st.sampled_from("xX"), st.integers(-2, 64))
          .map(lambda t: "".join(map(str, t)))
          | st.sampled_from(["", "x", "8x", "x8", "1x2x3", " 8", "8 ", "0", "٨", "1_6", "+8", "1e2"]))
GPU_ARGS = st.sampled_from(GPU_NAMES + ["H100-SXM-80GB", " a100-sxm-80gb ", "h100", "", "x.toml", "x.json",
                                        "/", "a" * 300 + ".toml"]) | st.text(max_size=10)


@FUZZ
@given(st.one_of(
    st.text(),
    st.tuples(GPU_ARGS, st.sampled_from([":", "::", ""]), COUNTS).map("".join),
    st.tuples(st.sampled_from(GPU_NAMES), st.just(":"),
              st.one_of(st.integers(1, 8), st.integers(1, 64).map(lambda n: 8 * n),
                        st.tuples(st.integers(1, 16), st.sampled_from("xX"), st.integers(1, 16))
                        .map(lambda t: "".join(map(str, t)))).map(str)).map("".join),
))
def test_load_cluster_shorthand(arg):
    for fn in (load_cluster, parse_cluster_shorthand):
        c = valid_or_meshplan_error(fn, arg)
        if c is not None:
            assert isinstance(c, ClusterSpec)
            assert c.num_gpus >= 1 and c.num_nodes >= 1 and c.gpus_per_node >= 1
            assert_round_trips(c)


# --------------------------------------------------------------------------------------
# spec files from arbitrary dicts

LLAMA = to_dict(load_model("llama3-8b"))
H100 = to_dict(load_gpu("h100-sxm-80gb"))
LINKS = spec_dicts(LINK_FIELDS, base={"name": "inter_node", "bandwidth_gbps": 50.0})
GPU_VALUES = st.sampled_from(GPU_NAMES) | spec_dicts(GPU_FIELDS, base=H100) | VALUES


@pytest.mark.slow  # fuzzing writes and loads TOML and JSON files
@FUZZ
@given(spec_dicts(MODEL_FIELDS + ["model"], base=LLAMA) | JSON_LIKE)
def test_model_files(fuzzdir, data):
    for path in write_both(fuzzdir, data):
        m = valid_or_meshplan_error(load_model, path)
        if m is not None:
            assert isinstance(m, ModelSpec)
            assert isinstance(m.num_params(), int) and isinstance(m.num_active_params(), int)
            assert_round_trips(m)


@pytest.mark.slow  # fuzzing writes and loads TOML and JSON files
@FUZZ
@given(spec_dicts(GPU_FIELDS, base=H100) | JSON_LIKE)
def test_gpu_files(fuzzdir, data):
    for path in write_both(fuzzdir, data):
        g = valid_or_meshplan_error(load_gpu, path)
        if g is not None:
            assert isinstance(g, GPUSpec)
            assert g.peak("fp8") > 0
            assert_round_trips(g)


@st.composite
def cluster_dicts(draw):
    names = st.sampled_from(GPU_NAMES)
    d = {"gpu": draw(st.one_of(names, names, names, GPU_VALUES)),
         "num_nodes": draw(st.one_of(st.integers(1, 16), st.integers(1, 16), st.integers(-1, 16) | VALUES))}
    for tier in ("intra_node", "inter_node", "inter_dc"):
        if draw(st.booleans()):
            d[tier] = draw(st.one_of(st.builds(dict, bandwidth_gbps=st.floats(0.5, 1000)), LINKS, VALUES))
    if "inter_dc" in d or draw(st.integers(0, 3)) == 0:
        valid = st.sampled_from([1, d["num_nodes"]])
        d["nodes_per_dc"] = draw(st.one_of(valid, valid, valid, st.integers(-1, 4) | VALUES))
    if "inter_dc" in d and isinstance(d["inter_dc"], dict) and draw(st.booleans()):
        d["inter_dc"] = {**d["inter_dc"], "shared": draw(st.booleans() | VALUES)}
    if draw(st.booleans()):  # the run-to-run variation of a GPU's step time, often valid
        d["step_jitter"] = draw(st.sampled_from([0, 0.0, 0.02, 0.5, 0.999]) | st.floats(-1, 2) | VALUES)
    if draw(st.booleans()):
        d.update(draw(st.dictionaries(st.sampled_from(CLUSTER_FIELDS + META_KEYS) | st.text(max_size=8),
                                      st.integers(-2, 16) | VALUES, max_size=2)))
    return d


@pytest.mark.slow  # fuzzing writes and loads TOML and JSON files
@FUZZ
@given(st.one_of(cluster_dicts(), cluster_dicts(), JSON_LIKE))
def test_cluster_files(fuzzdir, data):
    for path in write_both(fuzzdir, data):
        c = valid_or_meshplan_error(load_cluster, path)
        if c is not None:
            assert isinstance(c, ClusterSpec)
            assert c.num_gpus >= 1
            assert c.tier_for_span(c.num_gpus) in (c.intra_node, c.inter_node, c.inter_dc)
            assert_round_trips(c)


PLAN_DICTS = spec_dicts(PLAN_FIELDS, base={"tp": 8, "pp": 2, "dp": 4, "stage_layers": [16, 16]},
                        values=st.integers(-1, 9) | VALUES)
SYNC_PLAN_DICTS = spec_dicts(PLAN_FIELDS, base={"dp": 16, "zero": 1, "grad_sync": "diloco", "sync_every": 50,
                                                "sync_scope": "node", "grad_compression": "fp8"},
                             values=st.sampled_from(["local-sgd", "diloco", "all", "dc", "bf16", "powersgd", 1, 4])
                             | st.integers(-1, 9) | VALUES)
"""Plans with local SGD / DiLoCo and compression, changed a little (sync fields without their
grad_sync or compression are MeshplanErrors)."""


@FUZZ
@given(PLAN_DICTS | PLAN_DICTS.map(lambda d: {"schema_version": 1, "kind": "plan", "plan": d}) | SYNC_PLAN_DICTS
       | SYNC_PLAN_DICTS.map(lambda d: {"schema_version": 1, "kind": "plan", "plan": d}) | JSON_LIKE)
def test_plan_files(fuzzdir, data):
    for path in write_both(fuzzdir, data):
        p = valid_or_meshplan_error(load_plan, path)
        if p is not None:
            assert isinstance(p, Plan)
            assert parse_plan(p.short()) == p
            assert_round_trips(p)


@FUZZ
@given(st.text() | st.binary().map(lambda b: b.decode("latin-1")), st.sampled_from([".toml", ".json", ".TOML"]))
def test_read_data_file_random_text(fuzzdir, text, suffix):
    path = fuzzdir / f"random{suffix}"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    data = valid_or_meshplan_error(read_data_file, path)
    assert data is None or isinstance(data, dict)


@FUZZ
@given(st.binary(max_size=200), st.sampled_from(["m.toml", "m.json"]))
def test_load_model_random_bytes(fuzzdir, raw, name):
    path = fuzzdir / name
    path.write_bytes(raw)
    m = valid_or_meshplan_error(load_model, str(path))
    assert m is None or isinstance(m, ModelSpec)


# --------------------------------------------------------------------------------------
# regressions: inputs the fuzzers (or reading the code) turned up


@pytest.mark.parametrize("text", [
    "[" * 100_000,                       # RecursionError in json
    "a = " + "[" * 100_000,              # RecursionError in tomllib (arrays)
    "a = " + "{b = " * 100_000,          # RecursionError in tomllib (inline tables)
    "1" * 5000,                          # ValueError: int string conversion limit
    '{"num_layers": ' + "1" * 5000 + "}",
    "a = " + "1" * 5000,
], ids=["json-list", "toml-array", "toml-table", "int", "json-int", "toml-int"])
@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_pathological_files(tmp_path, text, suffix):
    path = tmp_path / f"x{suffix}"
    path.write_text(text)
    with pytest.raises(MeshplanError):
        read_data_file(path)
    with pytest.raises(MeshplanError):
        load_model(str(path))


def test_too_long_file_names():
    for arg in ("a" * 300 + ".toml", "a" * 300 + ".json"):
        for fn in (load_model, load_cluster, load_plan, load_gpu, read_data_file):
            with pytest.raises(MeshplanError, match="file not found|cannot read"):
                fn(arg)
    with pytest.raises(MeshplanError):
        load_cluster("a" * 300 + ".toml:8")


@pytest.mark.parametrize("gpu", [5, True, 1.5, [[1, 2]], ["ab"]])
def test_cluster_gpu_of_wrong_type(tmp_path, gpu):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"gpu": gpu, "num_nodes": 1}))
    with pytest.raises(MeshplanError, match="gpu"):
        load_cluster(str(path))


@pytest.mark.parametrize("npd, ok", [(0, False), ("0", False), (-2, False), (0.0, False), (2, True), (None, True)])
def test_cluster_nodes_per_dc(tmp_path, npd, ok):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"gpu": "h100-sxm-80gb", "num_nodes": 4, "nodes_per_dc": npd}))
    if ok:
        assert load_cluster(str(path)).nodes_per_dc == npd
    else:
        with pytest.raises(MeshplanError, match="nodes_per_dc"):
            load_cluster(str(path))


@pytest.mark.parametrize("value", [10**400, -(10**400), math.nan], ids=["big", "-big", "nan"])
def test_float_fields_huge_or_nan(tmp_path, value):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({**H100, "memory_gib": value}))  # json writes NaN for nan
    with pytest.raises(MeshplanError, match="memory_gib"):
        load_gpu(str(path))
    with pytest.raises(MeshplanError, match="tdp_w"):
        from_dict(GPUSpec, {**H100, "tdp_w": value})


def test_from_dict_odd_keys_and_values():
    with pytest.raises(MeshplanError, match="unknown field"):
        from_dict(Plan, {1: 2})
    with pytest.raises(MeshplanError, match="expected a string"):
        from_dict(ModelSpec, {**LLAMA, "name": 10**5000})
    with pytest.raises(MeshplanError):
        from_dict(Plan, "tp=8")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# known bugs outside the files this suite may fix (model.py / cluster.py): see the report.


def test_clusterspec_nodes_per_dc_zero_direct():
    c = load_cluster("h100-sxm-80gb:64")
    with pytest.raises(MeshplanError):
        c.replace(nodes_per_dc=0)


@pytest.mark.parametrize("field", ["head_dim", "max_position_embeddings", "expert_ffn_hidden_size"])
def test_model_optional_sizes_must_be_positive(field):
    with pytest.raises(MeshplanError):
        from_dict(ModelSpec, {**LLAMA, field: -128})
