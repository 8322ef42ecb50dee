"""`meshplan plan` on the command line: output, --json, --out round trip, bad input."""
from __future__ import annotations

import importlib.util
import json

import pytest
from clirun import run

from meshplan.cli.plan_cmd import Progress

SMALL = ["plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:4", "--global-batch", "8",
         "--seq-len", "64"]



def test_table_explanation_and_histogram(capsys):
    code, out, err = run(capsys, *SMALL, "--top", "3")
    assert code == 0, err
    assert "step time" in out and "tokens/s" in out and "$/M tok" in out and "dominant" in out
    assert "winner " in out and "rejected " in out and "Pareto front" in out
    assert err == ""  # no progress bar when stderr is not a terminal


def test_json_document(capsys):
    code, out, _ = run(capsys, *SMALL, "--json", "--top", "2", "--train-tokens", "1B")
    doc = json.loads(out)
    assert code == 0
    for key in ("plans", "considered", "feasible", "rejected", "search_time_s", "pareto", "explanation"):
        assert key in doc
    assert len(doc["plans"]) == 2 and doc["plans"][0]["cost"]["fits"]
    assert set(doc["plans"][0]) >= {"plan", "cost"}
    assert doc["considered"] == doc["feasible"] + sum(doc["rejected"].values())
    assert doc["train"][0]["days"] > 0 and doc["train"][0]["usd"] > 0


def test_out_round_trips_through_estimate(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, _ = run(capsys, *SMALL, "--json", "--out", str(path))
    assert code == 0
    winner = json.loads(out)["plans"][0]
    doc = json.loads(path.read_text())
    assert doc["kind"] == "plan" and doc["schema_version"] == 1 and doc["plan"] == winner["plan"]
    code, out, err = run(capsys, "estimate", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:4",
                         "--plan", str(path), "--global-batch", "8", "--seq-len", "64", "--json")
    assert code == 0, err
    assert json.loads(out)["step_time_s"] == doc["predicted"]["step_time_s"]


def test_cluster_range_and_objective(capsys):
    code, out, err = run(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb",
                         "--gpus", "1..4", "--objective", "cost", "--global-batch", "8", "--seq-len", "64")
    assert code == 0, err
    assert "best per cluster size" in out and "GPUs" in out


@pytest.mark.parametrize("argv, words", [
    (["--model", "no-such-model"], "unknown model"),
    (["--gpus", "10..5"], "range is empty"),
    (["--global-batch", "0"], "argument --global-batch: must be a positive integer"),
    (["--precision", "fp8", "--cluster", "a100-sxm-80gb:4"], "no fp8"),
    (["--fix", "dp=2"], "cannot be fixed"),
    (["--fix", "bogus=1"], "unknown key"),
    (["--fix", "tp=3"], "no mesh"),
    (["--train-tokens", "lots"], "--train-tokens"),
])
def test_bad_input_is_one_line(capsys, argv, words):
    args = list(SMALL)
    for i in range(0, len(argv), 2):  # override or append
        if argv[i] in args:
            args[args.index(argv[i]) + 1] = argv[i + 1]
        else:
            args += argv[i:i + 2]
    code, _, err = run(capsys, *args)
    assert code == 2
    assert err.startswith("meshplan: error: ") and words in err and err.count("\n") == 1
    assert "Traceback" not in err


def test_over_restricted_space_says_what_to_relax(capsys):
    args = [a if a != "h100-sxm-80gb:4" else "h100-sxm-80gb:8" for a in SMALL]
    code, out, err = run(capsys, *args, "--fix", "tp=2,recompute=none,zero=0,micro_batch=8,offload=0")
    assert code == 3 and "without the --fix restrictions it fits" in err
    assert "batch not divisible" in out


def test_model_too_big_for_one_gpu_names_what_would_fit(capsys):
    code, out, err = run(capsys, "plan", "--model", "llama3-70b", "--cluster", "h100-sxm-80gb:1",
                         "--global-batch", "8", "--seq-len", "8192")
    assert code == 3 and err.count("\n") == 1
    assert "no plan fits" in err and "needs at least" in err and "x h100-sxm-80gb" in err
    assert "out of memory" in out  # the rejection histogram still goes to stdout


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib installed")
def test_plot_without_matplotlib_is_a_clear_error(capsys, tmp_path):
    code, _, err = run(capsys, *SMALL, "--plot", str(tmp_path / "p.png"))
    assert code == 2 and "matplotlib" in err and err.count("\n") == 1


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_plot_writes_an_image(capsys, tmp_path):
    path = tmp_path / "p.png"
    code, _, err = run(capsys, *SMALL, "--plot", str(path))
    assert code == 0, err
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_progress_bar_waits_then_draws_and_clears():
    import io
    s = io.StringIO()
    bar = Progress(s, delay_s=0.0)
    bar(5, 10)
    bar(10, 10)
    bar.close()
    assert "searching [" in s.getvalue() and "100%" in s.getvalue()
    quiet = io.StringIO()
    late = Progress(quiet, delay_s=60)
    late(1, 2)
    late.close()
    assert quiet.getvalue() == ""


def test_progress_steps_name_what_runs_and_fit_the_terminal():
    import io
    s = io.StringIO()
    bar = Progress(s, delay_s=0.0, columns=40)
    with bar.step("searching 64 GPUs (1/3)"):
        assert s.getvalue().endswith("searching 64 GPUs (1/3) ...")
        bar(1, 4)
    assert "\rsearching 64 GPUs (1/3) [" in s.getvalue()
    assert all(len(part) <= 39 for part in s.getvalue().split("\r"))  # cut, never wrapped
    bar.close()
    assert s.getvalue().endswith("\r")
    bar(4, 4)  # after close: nothing more
    assert s.getvalue().endswith("\r")
    quiet = io.StringIO()
    late = Progress(quiet, delay_s=60)
    with late.step("a short step"):  # shown only once the command has run delay_s
        late(1, 2)
    late.close()
    assert quiet.getvalue() == ""


def test_multi_size_search_shows_progress_per_size(capsys, monkeypatch):
    import sys

    from meshplan.cli import plan_cmd
    monkeypatch.setattr(plan_cmd, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb", "--gpus", "1..4",
                         "--global-batch", "8", "--seq-len", "64")
    assert code == 0 and "winner " in out
    for label in ("searching 1 GPU (1/3)", "searching 2 GPUs (2/3)", "searching 4 GPUs (3/3)"):
        assert label in err
    assert "plans" in err and "%" in err  # the bar of the search's own progress
    assert err.endswith("\r")  # cleared before the output


def test_single_size_has_no_size_lines_and_prints_the_price(capsys):
    code, out, _ = run(capsys, *SMALL)
    assert code == 0 and "best per cluster size" not in out
    assert "price: $2.50 per GPU-hour (from GPU preset h100-sxm-80gb" in out
