"""The `meshplan` command line for step 1: presets, estimate, validate; bad input; progress for slow steps;
no Python warnings from any command."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest
from clirun import run

GOOD = ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8",
        "--plan", "dp=8,zero=3,micro_batch=1,recompute=op", "--global-batch", "16", "--seq-len", "8192"]



def test_estimate_json_has_the_documented_fields(capsys):
    rc, out, err = run(capsys, *GOOD, "--json")
    assert rc == 0 and not err
    d = json.loads(out)
    for k in ("params", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu",
              "peak_memory_gib", "fits", "memory", "time"):
        assert k in d, k
    assert d["params"] == 8_030_261_248
    assert d["tokens_per_s"] == pytest.approx(16 * 8192 / d["step_time_s"])
    exposed = sum(v for k, v in d["time"].items() if not k.endswith("_overlapped"))
    assert exposed == pytest.approx(d["step_time_s"])


def test_estimate_table(capsys):
    rc, out, _ = run(capsys, *GOOD)
    assert rc == 0 and "step time" in out and "MFU" in out and "fits" in out


def test_plan_file_round_trip(capsys, tmp_path):
    from meshplan.spec.io import plan_document
    from meshplan.spec.plan import parse_plan
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan_document(parse_plan("dp=8,zero=3,micro_batch=1,recompute=op"))))
    argv = GOOD.copy()
    argv[argv.index("--plan") + 1] = str(f)
    rc1, out1, _ = run(capsys, *argv, "--json")
    rc2, out2, _ = run(capsys, *GOOD, "--json")
    assert rc1 == rc2 == 0 and json.loads(out1)["step_time_s"] == json.loads(out2)["step_time_s"]


@pytest.mark.parametrize("change,needle", [
    (("--model", "llama3-8bb"), "did you mean llama3-8b"),
    (("--cluster", "h100:8"), "known gpus"),
    (("--cluster", "h100-sxm-80gb:12"), "whole number of 8-gpu nodes"),
    (("--plan", "tp=8,pp"), "is not key=value"),
    (("--plan", "tp=8,pp=1,dp=1,micro_batch=1,bogus=2"), "unknown key"),
    (("--plan", "tp=3,dp=8"), "tp=3"),
    (("--plan", "tp=16,dp=1"), "tp*pp*dp*cp = 16"),
    (("--plan", "tp=1,dp=4"), "change dp to 8"),
    (("--global-batch", "0"), "positive integer"),
    (("--model", "missing.toml"), "file not found"),
])
def test_bad_input_is_one_clear_line(capsys, change, needle):
    argv = GOOD.copy()
    argv[argv.index(change[0]) + 1] = change[1]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and not out
    assert err.count("\n") == 1 and err.startswith("meshplan: error:"), err
    assert needle in err.lower(), err
    assert "Traceback" not in err


def test_validate_json_on_a_small_csv(capsys, tmp_path):
    from meshplan.validate.report import default_runs_path
    lines = default_runs_path().read_text().splitlines()
    f = tmp_path / "runs.csv"
    f.write_text("\n".join(lines[:4]) + "\n")
    rc, out, _ = run(capsys, "validate", "--runs", str(f), "--json", "--report", str(tmp_path / "r.md"))
    d = json.loads(out)
    assert rc == 0 and d["summary"]["rows"] == 3 and len(d["rows"]) == 3
    assert d["ranking"]["summary"]["sweeps"] == 0 and "pairs" in d["ranking"]["summary"]  # no sweep of 4 here
    row = d["rows"][0]
    for k in ("row_id", "status", "reason", "predicted_step_time_s", "predicted_peak_memory_gib",
              "predicted_fits"):
        assert k in row
    assert "Cost-model constants" in (tmp_path / "r.md").read_text()


def test_validate_missing_csv(capsys):
    rc, _, err = run(capsys, "validate", "--runs", "nope.csv")
    assert rc == 2 and "not found" in err


def test_presets_lists_models_and_gpus(capsys):
    rc, out, _ = run(capsys, "presets", "--json")
    d = json.loads(out)
    assert rc == 0 and "gpt3-175b" in d["models"] and "h100-sxm-80gb" in d["gpus"]


def test_planning_never_imports_torch():
    code = ("import sys; from meshplan.cli.main import main; "
            "main(['estimate','--model','gpt3-175b','--cluster','a100-sxm-80gb:64','--plan',"
            "'tp=8,pp=8,dp=1,micro_batch=1','--global-batch','64']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_python_dash_m_meshplan_is_the_meshplan_command():
    from meshplan import __version__
    r = subprocess.run([sys.executable, "-m", "meshplan", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == __version__, r.stderr
    r = subprocess.run([sys.executable, "-m", "meshplan", "presets", "--json"], capture_output=True, text=True)
    assert r.returncode == 0 and "llama3-8b" in json.loads(r.stdout)["models"], r.stderr
    r = subprocess.run([sys.executable, "-m", "meshplan", "estimate", "--model", "no-such-model"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("meshplan: error:") and "Traceback" not in r.stderr


def test_documented_cluster_file_loads_with_its_datacenter_tier():
    from pathlib import Path

    from meshplan.cost.comm import Group
    from meshplan.spec.io import load_cluster
    c = load_cluster(str(Path(__file__).resolve().parents[2] / "docs" / "cluster-example.toml"))
    assert c.num_gpus == 512 and c.inter_dc is not None and c.nodes_per_dc == 32
    assert float(Group.of(c, 2, 256).outer.bytes_per_s) == c.inter_dc.bytes_per_s  # crosses the DCs
    assert float(Group.of(c, 2, 128).bytes_per_s) == c.inter_node.bytes_per_s


def test_slow_steps_show_progress_quick_ones_do_not():
    from meshplan.cli.format import slow_step
    buf = io.StringIO()
    with slow_step("quick", after_s=5, stream=buf):
        pass
    assert buf.getvalue() == ""
    buf = io.StringIO()
    with slow_step("drawing the plot (9 events)", after_s=0.05, stream=buf):
        time.sleep(0.3)
    text = buf.getvalue()
    assert text.startswith("meshplan: drawing the plot (9 events) ...") and "done in" in text
    assert text.count("\n") == 1


# ---- no Python warnings from our code paths ----------------------------------------------------

def test_commands_print_no_python_warnings(tmp_path):
    pytest.importorskip("matplotlib")
    p = tmp_path / "p.json"
    script = f"""
import sys, warnings
warnings.simplefilter("error")  # any warning is a failure
from meshplan.cli.main import main
calls = [
    ["presets"], ["presets", "--json"],
    ["plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:4", "--global-batch", "8", "--seq-len", "64",
     "--out", {str(p)!r}],
    ["estimate", "--plan", {str(p)!r}],
    ["simulate", "--plan", {str(p)!r}, "--plot", {str(tmp_path / "s.png")!r}, "--trace", {str(tmp_path / "t.json")!r}],
    ["simulate", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:1", "--plan", "dp=1", "--global-batch", "1",
     "--seq-len", "1", "--plot", {str(tmp_path / "one.svg")!r}],
    ["export", "--plan", {str(p)!r}, "--to", "deepspeed", "--out", {str(tmp_path / "ds.json")!r}],
    ["report", "--plan", {str(p)!r}, "--out", {str(tmp_path / "r.html")!r}],
    ["estimate", "--plan", {str(p)!r}, "--global-batch", "16", "--override"],
]
for argv in calls:
    rc = main(argv)
    assert rc == 0, (argv, rc)
"""
    r = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Warning" not in r.stderr, r.stderr
