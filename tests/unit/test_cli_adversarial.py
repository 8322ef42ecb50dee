"""Adversarial inputs to `meshplan presets | estimate | plan | validate`.

Every bad input is one line `meshplan: error: ...` on stderr with exit code 2 (no traceback),
--json output is strict JSON (no NaN/Infinity), and nothing is written where it was not asked.
"""
from __future__ import annotations

import importlib.util
import json
import math

import pytest
from clirun import one_line_error, run

EST = ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8",
       "--plan", "dp=8,zero=3", "--global-batch", "16"]
PLAN = ["plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:8", "--global-batch", "16"]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None




def strict_json(text):
    def bad(token):
        raise ValueError(f"non-standard JSON token {token}")
    obj = json.loads(text, parse_constant=bad)
    json.dumps(obj, allow_nan=False)
    return obj


def with_arg(argv, flag, value):
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


# ---- numbers too large for the cost model's fixed-width arithmetic ----------------------------

@pytest.mark.parametrize("argv", [
    with_arg(EST, "--seq-len", "9" * 400),
    with_arg(PLAN, "--global-batch", "9" * 400),
    with_arg(PLAN, "--seq-len", "9" * 400),
    with_arg(PLAN, "--global-batch", "1000000000000"),
])
def test_huge_batch_or_sequence_is_a_clear_error(capsys, argv):
    rc, _, err = run(capsys, *argv)
    one_line_error(rc, err, "at most")


def test_huge_cluster_file_does_not_hang_the_search(capsys, tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"gpu": "h100-sxm-80gb", "num_nodes": 10**20}))
    rc, _, err = run(capsys, *with_arg(PLAN, "--cluster", str(f)))
    one_line_error(rc, err, "GPUs")


# ---- file paths -----------------------------------------------------------------------------

def test_validate_runs_with_a_file_name_too_long(capsys):
    rc, _, err = run(capsys, "validate", "--runs", "9" * 400)
    one_line_error(rc, err, "--runs")


@pytest.mark.parametrize("content", ["", "row_id,source_id,model\n"])
def test_validate_runs_without_rows_is_an_error(capsys, tmp_path, content):
    f = tmp_path / "runs.csv"
    f.write_text(content)
    rc, _, err = run(capsys, "validate", "--runs", str(f))
    one_line_error(rc, err, "no runs")


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_empty_output_path_is_an_error(capsys, flag):
    if flag == "--plot" and not HAS_MPL:
        pytest.skip("matplotlib not installed")
    rc, _, err = run(capsys, *PLAN, flag, "")
    one_line_error(rc, err, flag)


@pytest.mark.slow  # validate runs every published row first
def test_empty_report_path_is_an_error(capsys):
    rc, _, err = run(capsys, "validate", "--report", "")
    one_line_error(rc, err, "--report")


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed")
def test_plot_to_a_directory_is_an_error_and_writes_nothing_else(capsys, tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    rc, _, err = run(capsys, *PLAN, "--plot", str(d))
    one_line_error(rc, err, "--plot")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed")
def test_plot_writes_exactly_the_given_path(capsys, tmp_path):
    path = tmp_path / "pareto"
    rc, _, err = run(capsys, *PLAN, "--plot", str(path))
    assert rc == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["pareto"]
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed")
def test_plot_format_is_checked_before_the_search(capsys, tmp_path):
    rc, out, err = run(capsys, *PLAN, "--plot", str(tmp_path / "p.md"))
    one_line_error(rc, err, "--plot", "png")
    assert out == "" and not list(tmp_path.iterdir())


def test_empty_gpus_is_an_error(capsys):
    rc, _, err = run(capsys, *with_arg(PLAN, "--cluster", "h100-sxm-80gb"), "--gpus", "")
    one_line_error(rc, err, "--gpus")


# ---- non-finite numbers in spec files -------------------------------------------------------

@pytest.mark.parametrize("extra", [
    "price_per_gpu_hour_usd = inf\n",
    "[intra_node]\nlatency_us = inf\n",
    "[inter_node]\nbandwidth_gbps = inf\n",
])
def test_infinite_numbers_in_a_cluster_file_are_rejected(capsys, tmp_path, extra):
    f = tmp_path / "c.toml"
    f.write_text('gpu = "h100-sxm-80gb"\nnum_nodes = 2\n' + extra)
    rc, _, err = run(capsys, *with_arg(PLAN, "--cluster", str(f)), "--json")
    one_line_error(rc, err, "finite")


def test_plan_json_is_strict_even_when_dollars_overflow(capsys, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('gpu = "h100-sxm-80gb"\nnum_nodes = 2\nprice_per_gpu_hour_usd = 1e308\n')
    rc, out, err = run(capsys, *with_arg(PLAN, "--cluster", str(f)), "--json")
    assert rc == 0 and all(line.startswith("meshplan: note: ") for line in err.splitlines()), err
    strict_json(out)


# ---- plan files ---------------------------------------------------------------------------

@pytest.mark.parametrize("body", [{"plan": None}, {"plan": [1, 2]}, {"plan": "dp=8"}])
def test_plan_file_whose_plan_is_not_an_object(capsys, tmp_path, body):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(body))
    rc, _, err = run(capsys, *with_arg(EST, "--plan", str(f)))
    one_line_error(rc, err, "plan", "object")


def test_schema_version_as_a_string_is_read(capsys, tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"schema_version": "1", "plan": {"dp": 8, "zero": 3}}))
    rc, out, err = run(capsys, *with_arg(EST, "--plan", str(f)), "--json")
    assert rc == 0, err
    strict_json(out)


# ---- infeasible requests say what would make them feasible ----------------------------------

def test_too_many_gpus_for_the_batch_names_fewer_gpus(capsys):
    rc, _, err = run(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:16384",
                     "--global-batch", "16")
    one_line_error(rc, err, "fewer GPUs")
    assert "larger clusters" not in err


# ---- things that work -----------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["estimate", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:1", "--plan", "dp=1",
     "--global-batch", "1", "--seq-len", "1", "--json"],
    ["estimate", "--model", "mixtral-8x7b", "--cluster", "h100-sxm-80gb:8",
     "--plan", "dp=8,ep=8,zero=3", "--global-batch", "16", "--json"],
    ["plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:1", "--global-batch", "1",
     "--seq-len", "1", "--json"],
])
def test_edge_requests_give_strict_json(capsys, argv):
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    d = strict_json(out)
    assert d


def test_plan_out_then_estimate_is_the_same_prediction(capsys, tmp_path):
    f = tmp_path / "plan.json"
    rc, _, err = run(capsys, *PLAN, "--out", str(f))
    assert rc == 0, err
    doc = json.loads(f.read_text())
    rc, out, err = run(capsys, "estimate", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:8",
                       "--plan", str(f), "--global-batch", "16", "--json")
    assert rc == 0, err
    d = strict_json(out)
    assert math.isclose(d["step_time_s"], doc["predicted"]["step_time_s"], rel_tol=1e-12)


# ---- --fix ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fix, words", [
    ("micro_batch=0", "micro_batch must be between 1"),
    ("micro_batch=" + "9" * 30, "micro_batch must be between 1"),
    ("tp=0", "tp must be between 1"),
    ("pp=-2", "pp must be between 1"),
    ("tp=1,tp=2", "given twice"),
])
def test_bad_fix_values(capsys, fix, words):
    rc, _, err = run(capsys, *PLAN, "--fix", fix)
    one_line_error(rc, err, words)
