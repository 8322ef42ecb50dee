"""`meshplan plan`: --fix offload, flags the runtime does not run,
at-risk marks, the zero=3-under-a-pipeline explanation, conflicting flags, formatting, sequence
lengths past the model's positions, more GPUs than a batch can use, and error wording."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
from clirun import one_line_error, run
from hypothesis import given, settings
from hypothesis import strategies as st
from test_spec import plans

from meshplan.cost import estimate
from meshplan.search.explain import (
    compare_line,
    plan_differences,
    size_reason,
    winner_line,
    zero_memory_note,
)
from meshplan.search.space import SearchSpace, enumerate_space, most_gpus, zero_options
from meshplan.spec.io import load_cluster, load_model, load_plan
from meshplan.spec.plan import Plan, Workload, format_stage_layers, parse_plan, parse_stage_layers
from meshplan.units import gib_need

SMALL = ["plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:4", "--global-batch", "8",
         "--seq-len", "64"]


def plan_json(capsys, *extra: str) -> tuple[dict, str]:
    rc, out, err = run(capsys, *SMALL, "--json", "--top", "50", *extra)
    assert rc == 0, err
    return json.loads(out), err


# ---- [1] --fix offload ------------------------------------------------------------------------

def test_fix_offload_restricts_the_space(capsys):
    every, _ = plan_json(capsys)
    only, _ = plan_json(capsys, "--fix", "offload=1")
    none, _ = plan_json(capsys, "--fix", "offload=0")
    assert only["considered"] < every["considered"] and none["considered"] < every["considered"]
    assert only["plans"] and none["plans"]
    for p in only["plans"]:
        assert p["plan"]["offload_optimizer"], p["short"]
        assert p["plan"]["offload_params"] == (p["plan"]["zero"] == 3)
    assert not any(p["plan"]["offload_optimizer"] or p["plan"]["offload_params"] for p in none["plans"])
    both, _ = plan_json(capsys, "--fix", "offload=0|1")
    assert both["considered"] == every["considered"]


def test_offload_only_zero_options():
    c = load_cluster("h100-sxm-80gb:8")
    opts = zero_options(c, 1, 8, 1, SearchSpace(offload_only=True))
    assert opts and all(o[2] for o in opts)
    assert {(z, p) for z, _, _, p in opts} == {(1, False), (2, False), (3, False), (3, True)}
    assert zero_options(c, 1, 8, 1, SearchSpace(offload_only=True, zero=(0,))) == []
    assert zero_options(c, 1, 1, 1, SearchSpace(offload_only=True, zero=(0,))) == [(0, 0, True, False)]


def test_fix_offload_with_zero_1_only_is_refused_up_front(capsys):
    rc, _, err = run(capsys, *SMALL, "--fix", "offload=1,zero=1")
    one_line_error(rc, err, "--fix offload=1 without zero=3", "--allow-export-only", "zero=3")


# ---- [4] options the runtime does not run -------------------------------------------------------

@pytest.mark.parametrize("flag", ["--fused-loss", "--no-flash-attention"])
def test_flag_the_runtime_does_not_run_is_named_up_front(capsys, flag):
    rc, out, err = run(capsys, *SMALL, flag)
    one_line_error(rc, err, flag, "meshplan's runtime does not run it", "--allow-export-only", "megatron")
    assert "must divide" not in err and out == ""
    rc, out, err = run(capsys, *SMALL, flag, "--allow-export-only")
    assert rc == 0, err
    assert "[export only: megatron]" in out


def test_fp8_with_fixed_tp_is_named_up_front(capsys):
    rc, _, err = run(capsys, *SMALL, "--precision", "fp8", "--fix", "tp=2")
    one_line_error(rc, err, "--precision fp8 with --fix tp=2", "--allow-export-only")


def test_async_tp_turns_compile_on_and_is_off_where_tp_is_1(capsys):
    doc, err = plan_json(capsys, "--async-tp")
    assert err.count("\n") == 1 and "meshplan: note: --async-tp turns --compile on" in err
    assert any("--async-tp" in n for n in doc["notes"])
    assert doc["plans"]
    for p in doc["plans"]:
        assert p["plan"]["compile"]
        assert p["plan"]["async_tp"] == (p["plan"]["tp"] > 1), p["short"]
    rc, _, err = run(capsys, *SMALL, "--async-tp", "--fix", "compile=0")
    one_line_error(rc, err, "--async-tp with --fix compile=0", "inductor")


def test_enumeration_normalises_async_tp_and_p2p_where_they_change_nothing():
    m, c = load_model("tiny-llama"), load_cluster("h100-sxm-80gb:4")
    space = SearchSpace(base=Plan(async_tp=True, compile=True, p2p_sharded=False))
    cols = enumerate_space(m, c, Workload(global_batch=8, seq_len=64), space)
    tp = np.asarray(cols["tp"])
    assert (np.asarray(cols["async_tp"]) == (tp > 1)).all()
    pp = np.asarray(cols["pp"])
    assert (np.asarray(cols["p2p_sharded"]) == ((tp == 1) | (pp == 1))).all()


# ---- [9] at-risk plans under --no-headroom --------------------------------------------------------

@pytest.fixture(scope="module")
def risky_run():
    import contextlib
    import io

    from meshplan.cli.main import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", "--model", "llama3-70b", "--cluster", "h100-sxm-80gb:32", "--global-batch", "64",
                   "--no-headroom", "--top", "40"])  # the top 40 hold at-risk plans (P(OOM) > 5%)
    assert rc == 0
    return buf.getvalue()


def test_no_headroom_marks_plans_at_risk_in_the_table(risky_run):
    rows = [line for line in risky_run.splitlines() if line.lstrip()[:1].isdigit()]
    marked = [r for r in rows if "!" in r]
    assert marked, risky_run
    assert "! at risk: its chance of running out of memory is above 5% (accepted by --no-headroom)" in risky_run


def test_winner_line_says_at_risk():
    from meshplan.search.driver import search
    m, c = load_model("tiny-llama"), load_cluster("h100-sxm-80gb:4")
    result = search(m, c, Workload(global_batch=8, seq_len=64), top=2)
    assert "at risk" not in winner_line(result)
    b = result.plans[0]
    result.plans[0] = dataclasses.replace(b, report=dataclasses.replace(b.report, at_risk=True))
    assert "(at risk: its chance of running out of memory is above 5%)" in winner_line(result)


# ---- [6] zero=3 under a pipeline --------------------------------------------------------------------

def test_zero3_under_a_pipeline_says_why_it_needs_more_memory():
    hi = SimpleNamespace(peak_memory_gib=66.2)
    lo = SimpleNamespace(peak_memory_gib=63.5)
    z3, z1 = Plan(pp=4, dp=8, zero=3), Plan(pp=4, dp=8, zero=1)
    note = zero_memory_note(z3, hi, z1, lo)
    assert "zero=3 needs 2.7 GiB more than zero=1" in note
    assert "under a pipeline FSDP keeps the stage gathered and accumulates unsharded fp32 gradients" in note
    assert zero_memory_note(z1, lo, z3, hi) == note  # either order
    assert zero_memory_note(z3, lo, z1, hi) == ""  # zero=3 needs less: nothing to explain
    assert zero_memory_note(Plan(dp=8, zero=3), hi, Plan(dp=8, zero=1), lo) == ""  # no pipeline


def test_compare_line_explains_zero3_on_llama70b():
    m, c = load_model("llama3-70b"), load_cluster("h100-sxm-80gb:256")
    w = Workload(global_batch=512, seq_len=8192)
    mesh = "tp=4,pp=4,dp=8,cp=2,micro_batch=1,virtual_stages=4,schedule=interleaved-1f1b,sequence_parallel=1"
    p3, p1 = parse_plan(mesh + ",zero=3"), parse_plan(mesh + ",zero=1")
    r3, r1 = estimate(m, c, p3, w), estimate(m, c, p1, w)
    line = compare_line((p3, r3), (p1, r1), "#2")
    assert ("FSDP keeps the stage gathered" in line) == (r3.peak_memory_gib - r1.peak_memory_gib > 0.05), line


# ---- [14] conflicting flags ----------------------------------------------------------------------

def test_contradicting_stage_flags(capsys):
    rc, _, err = run(capsys, *SMALL, "--uneven-stages", "--even-stages-only")
    one_line_error(rc, err, "--even-stages-only", "not allowed with --uneven-stages")


def test_single_valued_flag_given_twice(capsys):
    rc, _, err = run(capsys, *SMALL, "--cluster", "h100-sxm-80gb:8")
    one_line_error(rc, err, "--cluster", "given twice", "h100-sxm-80gb:4", "h100-sxm-80gb:8")
    rc, _, err = run(capsys, *SMALL, "--seq-len", "64")  # the same value again is harmless
    assert rc == 0, err


def test_gpus_with_a_count_in_cluster_notes_it(capsys):
    rc, _, err = run(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:8", "--gpus", "1..4",
                     "--global-batch", "8", "--seq-len", "64")
    assert rc == 0
    assert "meshplan: note: --gpus 1..4 sets the cluster sizes: the count in --cluster h100-sxm-80gb:8 is not used" \
        in err


def test_fix_sequence_parallel_off(capsys):
    doc, _ = plan_json(capsys, "--fix", "sequence_parallel=0,tp=2")
    assert doc["plans"] and any(p["plan"]["pp"] > 1 for p in doc["plans"])
    assert not any(p["plan"]["sequence_parallel"] for p in doc["plans"])
    for p in doc["plans"]:  # the runtime's sends carry the sequence-parallel shard only with it
        assert p["plan"]["p2p_sharded"] == (p["plan"]["pp"] == 1)
    on, _ = plan_json(capsys, "--fix", "sequence_parallel=1")
    assert all(p["plan"]["sequence_parallel"] == (p["plan"]["tp"] > 1) for p in on["plans"])


def test_fix_non_searched_field_takes_one_value(capsys):
    rc, _, err = run(capsys, *SMALL, "--fix", "grad_sync=auto|all-reduce")
    one_line_error(rc, err, "--fix grad_sync: give one value")


# ---- [17] formatting --------------------------------------------------------------------------------

def test_gib_need_shows_that_it_is_over():
    assert gib_need(75.63, 75.6) == "75.63 GiB per GPU of 75.60 usable (over by 0.03 GiB)"
    assert gib_need(93.1, 75.6) == "93.1 GiB per GPU of 75.6 usable (over by 17.5 GiB)"
    assert gib_need(60.0, 75.6) == "60.0 GiB per GPU of 75.6 usable"
    assert gib_need(75.58, 75.6) == "75.58 GiB per GPU of 75.60 usable"


def test_size_reason_keeps_the_over_by():
    ex = "closest to fitting on 8 GPUs: tp=1 needs 75.63 GiB per GPU of 75.60 usable (over by 0.03 GiB)"
    r = SimpleNamespace(rejected={"out of memory": 3}, reject_examples={"out of memory": ex})
    assert size_reason(r) == "no plan fits in memory (closest needs 75.63 GiB per GPU of 75.60 usable (over by " \
                             "0.03 GiB))"


def test_explanations_print_no_python_none():
    d = plan_differences(Plan(pp=3), Plan(pp=3, stage_layers=(13, 13, 6)))
    assert d == ["stage_layers even->13:13:6"]
    d = plan_differences(Plan(recompute="full"), Plan(recompute="full", recompute_layers=24))
    assert d == ["recompute_layers all->24"]
    d = plan_differences(Plan(pp=32, stage_layers=(4,) * 31 + (2,)), Plan(pp=32))
    assert d == ["stage_layers 4x31:2->even"]


def test_stage_layers_run_length_form():
    p = Plan(pp=32, stage_layers=(4,) * 31 + (2,))
    assert p.short().endswith("stage_layers=4x31:2")
    assert parse_plan(p.short()) == p
    assert parse_stage_layers("2:4x3;1") == (2, 4, 4, 4, 1)
    assert format_stage_layers((15, 17)) == "15:17" and format_stage_layers((13, 13)) == "13:13"
    assert format_stage_layers((7, 7, 7)) == "7x3" and format_stage_layers((1, 1, 1, 2)) == "1x3:2"
    for bad, words in (("4x0", "at least 1"), ("1:x", "'x'"), ("4x", "'4x'")):
        with pytest.raises(Exception, match=words):
            parse_stage_layers(bad)


def test_plan_files_accept_the_run_length_form(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"plan": {"pp": 32, "stage_layers": "4x31:2"}}))
    assert load_plan(str(f)).stage_layers == (4,) * 31 + (2,)
    t = tmp_path / "p.toml"
    t.write_text('pp = 3\nstage_layers = "5x2:3"\n')
    assert load_plan(str(t)).stage_layers == (5, 5, 3)


@st.composite
def plans_with_runs(draw) -> Plan:
    p = draw(plans())
    layers: list[int] = []
    while len(layers) < p.pp:
        layers += [draw(st.integers(0, 120))] * draw(st.integers(1, p.pp - len(layers)))
    return p.replace(stage_layers=tuple(layers))


@settings(max_examples=300, deadline=None)
@given(plans_with_runs())
def test_run_length_stage_layers_round_trip(plan):
    text = plan.short()
    assert parse_plan(text) == plan
    assert parse_stage_layers(format_stage_layers(plan.stage_layers)) == plan.stage_layers
    assert len(format_stage_layers(plan.stage_layers)) <= len(":".join(map(str, plan.stage_layers)))


def test_405b_table_rows_fit_200_columns(capsys):
    rc, out, err = run(capsys, "plan", "--model", "llama3.1-405b", "--cluster", "h100-sxm-80gb:16384",
                       "--global-batch", "2048")
    assert rc == 0, err
    table = out.split("\n\n")[1]
    assert "stage_layers=4x31:2" in table or "stage_layers" not in table
    assert max(len(line) for line in table.splitlines()) <= 200


# ---- [13] sequences past the model's positions ----------------------------------------------------

def test_learned_positions_refuse_a_longer_sequence(capsys):
    rc, _, err = run(capsys, "plan", "--model", "tiny-gpt2", "--cluster", "h100-sxm-80gb:4", "--global-batch", "8",
                     "--seq-len", "128")
    one_line_error(rc, err, "--seq-len 128 exceeds the 64 positions of tiny-gpt2", "--seq-len <= 64")


def test_rotary_positions_note_a_longer_sequence(capsys):
    rc, out, err = run(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:4", "--global-batch", "8",
                       "--seq-len", "128")
    assert rc == 0 and out
    assert err == ("meshplan: note: --seq-len 128 exceeds tiny-llama's trained context (64 tokens); priced for "
                   "128-token sequences as asked (the model may not train well past its context)\n")


# ---- [20] more GPUs than the batch can use ----------------------------------------------------------

def test_more_gpus_than_the_batch_can_use(capsys):
    rc, _, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:1000000000",
                     "--global-batch", "64")
    one_line_error(rc, err, "a global batch of 64 cannot use 1,000,000,000 GPUs", "at most 131,072",
                   "--cluster h100-sxm-80gb:512")


def test_most_gpus():
    m = load_model("llama3-8b")
    n, d = most_gpus(m, load_cluster("h100-sxm-80gb:8"), Workload(global_batch=64, seq_len=8192))
    assert (n, d) == (131072, {"tp": 8, "cp": 8, "pp": 32, "dp": 64})


# ---- [15] error wording ---------------------------------------------------------------------------

@pytest.mark.parametrize("cluster", ["h100-sxm-80gb:0", "h100-sxm-80gb:-8"])
def test_cluster_count_must_be_positive(capsys, cluster):
    rc, _, err = run(capsys, "plan", "--model", "tiny-llama", "--cluster", cluster, "--global-batch", "8")
    one_line_error(rc, err, "the GPU count must be a positive integer")


@pytest.mark.parametrize("argv", [["--train-tokens", "-5T"], ["--train-tokens=-5T"]])
def test_negative_train_tokens(capsys, argv):
    rc, _, err = run(capsys, *SMALL, *argv)
    one_line_error(rc, err, "--train-tokens must be positive", "'-5T'")


def test_global_batch_error_names_the_flag_once(capsys):
    rc, _, err = run(capsys, *SMALL[:-4], "--global-batch", "0")
    one_line_error(rc, err, "argument --global-batch: must be a positive integer")
    assert err.count("--global-batch") == 1


ESTIMATE = ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "8"]


def test_plan_arguments_that_are_not_plans(capsys, tmp_path):
    png = tmp_path / "l70.png"
    png.write_bytes(b"\x89PNG")
    rc, _, err = run(capsys, *ESTIMATE, "--plan", str(png))
    one_line_error(rc, err, "is not a plan file", ".json or .toml")
    rc, _, err = run(capsys, *ESTIMATE, "--plan", str(tmp_path))
    one_line_error(rc, err, "is a directory, not a plan file")
    empty = tmp_path / "empty.json"
    empty.write_text("")
    rc, _, err = run(capsys, *ESTIMATE, "--plan", str(empty))
    one_line_error(rc, err, "the file is empty: it holds no plan")
    obj = tmp_path / "obj.json"
    obj.write_text("{}")
    rc, _, err = run(capsys, *ESTIMATE, "--plan", str(obj))
    one_line_error(rc, err, "the file holds no plan")
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"kind": "model", "name": "m", "num_layers": 2}))
    rc, _, err = run(capsys, *ESTIMATE, "--plan", str(model))
    one_line_error(rc, err, "this is a model file, not a plan file")
    rc, _, err = run(capsys, *ESTIMATE, "--plan", "dp=8,micro_batch=3")
    one_line_error(rc, err, "8 over dp=8 leaves 1 sequence per replica, so micro_batch must be 1")


def test_a_plan_file_given_as_model(capsys, tmp_path):
    out = tmp_path / "plan.json"
    rc, _, err = run(capsys, *SMALL, "--out", str(out))
    assert rc == 0, err
    rc, _, err = run(capsys, "plan", "--model", str(out), "--cluster", "h100-sxm-80gb:4", "--global-batch", "8")
    one_line_error(rc, err, "this is a plan file", "not a model file", "--model tiny-llama", f"--plan {out}")


def test_fix_tp_larger_than_a_node(capsys):
    rc, _, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "64",
                     "--fix", "tp=16")
    one_line_error(rc, err, "tp=16 is more than the 8 GPUs of the cluster")
    assert "no mesh" not in err
    rc, _, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:32", "--global-batch", "64",
                     "--fix", "tp=12")
    one_line_error(rc, err, "tp=12 is larger than a node (8 GPUs) and not a whole number of nodes")


def test_nearest_names_the_rule_that_rejects_the_corner():
    from meshplan.search.nearest import corner_reason
    m, c, w = load_model("tiny-llama"), load_cluster("h100-sxm-80gb:4"), Workload(global_batch=8, seq_len=64)
    assert corner_reason(m, c, w, SearchSpace(base=Plan(fused_loss=True))) == "; most often: fused loss"
    assert "fused loss" not in corner_reason(m, c, w, SearchSpace(base=Plan(fused_loss=True), allow_export_only=True))
