"""Plan files are the source of truth (cli/planfile.py): `meshplan plan --out` records the plan with
its model, cluster, global batch and seq len; estimate, simulate, report, train and export read them
back; a command-line value that disagrees is an error unless --override."""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import one_line_error, run

from meshplan.cli.main import main
from meshplan.cli.planfile import Loaded, resolve, resolve_into, resolved_args
from meshplan.errors import MeshplanError
from meshplan.spec.graph import LayerGraph, LayerSpec
from meshplan.spec.io import dump_json, plan_document
from meshplan.spec.plan import parse_plan

ROOT = Path(__file__).resolve().parents[2]
PLAN_8B = ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "16",
           "--seq-len", "2048"]




@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """llama3-8b on 8 H100s planned at --seq-len 2048 (the model's default is 8192)."""
    path = tmp_path_factory.mktemp("pf") / "p.json"
    assert main([*PLAN_8B, "--out", str(path)]) == 0
    return path


def estimate_json(capsys, *argv) -> tuple[dict, str]:
    rc, out, err = run(capsys, "estimate", *argv, "--json")
    assert rc == 0, err
    return json.loads(out), err


# ---- what the file holds ----------------------------------------------------------------------

def test_plan_out_records_the_whole_problem(plan_file):
    doc = json.loads(plan_file.read_text())
    assert doc["kind"] == "plan" and doc["schema_version"] == 1
    assert doc["model"] == "llama3-8b" and doc["cluster"] == "h100-sxm-80gb:8"
    assert doc["global_batch"] == 16 and doc["seq_len"] == 2048
    assert doc["model_spec"]["num_layers"] == 32 and doc["model_spec"]["hidden_size"] == 4096
    assert doc["cluster_spec"]["num_nodes"] == 1 and doc["cluster_spec"]["gpu"]["name"] == "h100-sxm-80gb"
    assert "step_time_s" in doc["predicted"]


# ---- estimate / simulate / export / report read it --------------------------------------------

def test_estimate_needs_only_the_plan_file_and_keeps_its_seq_len(capsys, plan_file):
    d, err = estimate_json(capsys, "--plan", str(plan_file))
    doc = json.loads(plan_file.read_text())
    assert not err
    assert d["seq_len"] == 2048 and d["global_batch"] == 16 and d["model"] == "llama3-8b"
    assert d["fits"] and d["step_time_s"] == doc["predicted"]["step_time_s"]
    rc, out, _ = run(capsys, "estimate", "--plan", str(plan_file))
    assert rc == 0 and "x 2048 tokens" in out and "DOES NOT FIT" not in out


def test_agreeing_flags_are_accepted_without_a_note(capsys, plan_file):
    d, err = estimate_json(capsys, "--plan", str(plan_file), "--model", "llama3-8b", "--cluster",
                           "h100-sxm-80gb:1x8", "--global-batch", "16", "--seq-len", "2048")
    assert not err and d["seq_len"] == 2048


@pytest.mark.parametrize("flag,value,theirs", [
    ("--model", "llama3-70b", "llama3-8b"),
    ("--cluster", "h100-sxm-80gb:16", "h100-sxm-80gb:8"),
    ("--global-batch", "32", "16"),
    ("--seq-len", "8192", "2048"),
])
@pytest.mark.parametrize("command", ["estimate", "simulate", "export", "report"])
def test_a_disagreeing_flag_is_an_error_naming_both_values(capsys, tmp_path, plan_file, command, flag, value,
                                                           theirs):
    if command == "export" and flag == "--cluster":
        pytest.skip("export has no --cluster")
    extra = {"export": ["--to", "deepspeed"], "report": ["--out", str(tmp_path / "r.html")]}.get(command, [])
    rc, out, err = run(capsys, command, "--plan", str(plan_file), flag, value, *extra)
    one_line_error(rc, err, f"{flag} {value} disagrees with the plan file's {theirs}",
                   f"drop {flag} or pass --override")
    assert not out and not (tmp_path / "r.html").exists()


def test_override_lets_the_flag_win_with_one_note(capsys, plan_file):
    d, err = estimate_json(capsys, "--plan", str(plan_file), "--seq-len", "4096", "--global-batch", "32",
                           "--override")
    assert d["seq_len"] == 4096 and d["global_batch"] == 32
    assert err.count("\n") == 1 and err.startswith("meshplan: note: --override:"), err
    assert "--seq-len 4096 replaces the plan file's 2048" in err and "--global-batch 32" in err
    d, err = estimate_json(capsys, "--plan", str(plan_file), "--model", "llama3-70b", "--override")
    assert d["model"] == "llama3-70b" and d["seq_len"] == 2048  # the file's seq len still holds
    assert "--model llama3-70b replaces the plan file's llama3-8b" in err


def test_several_disagreements_in_one_line(capsys, plan_file):
    rc, _, err = run(capsys, "estimate", "--plan", str(plan_file), "--model", "llama3-70b", "--global-batch", "8")
    one_line_error(rc, err, "--model llama3-70b disagrees with the plan file's llama3-8b",
                   "--global-batch 8 with its 16", "drop --model and --global-batch or pass --override")


def test_simulate_needs_only_the_plan_file(capsys, plan_file):
    rc, out, err = run(capsys, "simulate", "--plan", str(plan_file), "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["seq_len"] == 2048 and d["global_batch"] == 16 and d["model"] == "llama3-8b"


def test_export_needs_only_the_plan_file(capsys, plan_file):
    rc, out, err = run(capsys, "export", "--plan", str(plan_file), "--to", "megatron")
    assert rc == 0, err
    assert "--seq-length 2048" in out and "--global-batch-size 16" in out


def test_report_needs_only_the_plan_file(capsys, tmp_path, plan_file):
    out_html = tmp_path / "r.html"
    rc, out, err = run(capsys, "report", "--plan", str(plan_file), "--out", str(out_html))
    assert rc == 0, err
    text = out_html.read_text()
    assert "llama3-8b" in text and "--plan" in text  # the command that reproduces the page
    rc, _, err = run(capsys, "report", "--plan", "dp=8", "--out", str(out_html))
    one_line_error(rc, err, "report takes a plan file")


def test_without_a_plan_file_the_flags_are_required(capsys, tmp_path):
    rc, _, err = run(capsys, "estimate", "--plan", "dp=8")
    one_line_error(rc, err, "--model, --cluster, --global-batch are required", "meshplan plan --out")
    rc, _, err = run(capsys, "simulate", "--plan", "dp=8", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8")
    one_line_error(rc, err, "--global-batch is required")
    rc, _, err = run(capsys, "report", "--model", "llama3-8b", "--out", str(tmp_path / "r.html"))
    one_line_error(rc, err, "--cluster, --global-batch are required")
    bare = tmp_path / "bare.json"  # a plan file of plan fields only records no problem
    bare.write_text(json.dumps(plan_document(parse_plan("dp=8"))))
    rc, _, err = run(capsys, "estimate", "--plan", str(bare), "--model", "llama3-8b")
    one_line_error(rc, err, "--cluster, --global-batch are required")
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(plan_document(parse_plan("dp=8"), model="llama3-8b", global_batch=16)))
    rc, _, err = run(capsys, "estimate", "--plan", str(partial))
    one_line_error(rc, err, "--cluster is required", "does not record the cluster")


# ---- files without the specs, files elsewhere, bad files ---------------------------------------

def test_an_older_file_without_specs_reads_its_names(capsys, tmp_path):
    f = tmp_path / "old.json"
    f.write_text(json.dumps(plan_document(parse_plan("dp=8,zero=3,micro_batch=2"), model="llama3-8b",
                                          cluster="h100-sxm-80gb:8", global_batch=16, seq_len=2048)))
    d, _ = estimate_json(capsys, "--plan", str(f))
    assert d["seq_len"] == 2048 and d["fits"]
    rc, _, err = run(capsys, "estimate", "--plan", str(f), "--cluster", "a100-sxm-80gb:8")
    one_line_error(rc, err, "--cluster a100-sxm-80gb:8 disagrees with the plan file's h100-sxm-80gb:8")


def test_a_cluster_file_is_recorded_whole(capsys, tmp_path):
    """A cluster from a .toml (its name is no preset) and a model from a ModelSpec file reload
    from the plan file alone, moved elsewhere, with the files gone."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "docs" / "cluster-example.toml", work / "c.toml")
    model = work / "m.toml"
    model.write_text((ROOT / "src" / "meshplan" / "presets" / "models" / "llama3-8b.toml").read_text()
                     .replace('name = "llama3-8b"', 'name = "my-8b"'))
    p = work / "p.json"
    rc, _, err = run(capsys, "plan", "--model", str(model), "--cluster", str(work / "c.toml"),
                     "--global-batch", "512", "--seq-len", "2048", "--out", str(p))
    assert rc == 0, err
    doc = json.loads(p.read_text())
    assert doc["cluster"] == "two-dc-h100" and doc["cluster_spec"]["nodes_per_dc"] == 32
    # the same cluster, named by its file, agrees; so does the preset the model file copies
    d, err = estimate_json(capsys, "--plan", str(p), "--cluster", str(work / "c.toml"), "--model", "llama3-8b")
    assert not err and d["step_time_s"] == doc["predicted"]["step_time_s"]
    moved = tmp_path / "elsewhere.json"
    shutil.copy(p, moved)
    shutil.rmtree(work)
    d, err = estimate_json(capsys, "--plan", str(moved))
    assert not err and d["step_time_s"] == doc["predicted"]["step_time_s"] and d["cluster"] == "two-dc-h100"


@pytest.mark.parametrize("extra,needle", [
    ({"model": 7}, "'model' must be a model name"),
    ({"cluster": ""}, "'cluster' must be a cluster name"),
    ({"global_batch": "sixteen"}, "'global_batch' must be a positive integer"),
    ({"seq_len": 0}, "'seq_len' must be a positive integer"),
    ({"seq_len": True}, "'seq_len' must be a positive integer"),
    ({"cluster_spec": [1]}, "'cluster_spec' must be an object"),
    ({"model_spec": {"name": "x", "num_layers": -1}}, "model_spec"),
    ({"model": "no-such-model"}, "the plan file's model 'no-such-model' cannot be loaded"),
])
def test_a_bad_context_in_the_file_is_one_line(capsys, tmp_path, extra, needle):
    ctx = {"model": "llama3-8b", "cluster": "h100-sxm-80gb:8", "global_batch": 16, "seq_len": 2048} | extra
    f = tmp_path / "p.json"
    f.write_text(json.dumps(plan_document(parse_plan("dp=8"), **ctx)))
    rc, _, err = run(capsys, "estimate", "--plan", str(f))
    one_line_error(rc, err, needle)


def test_a_typo_on_the_command_line_still_says_did_you_mean(capsys, plan_file):
    rc, _, err = run(capsys, "estimate", "--plan", str(plan_file), "--model", "llama3-8bb")
    one_line_error(rc, err, "Did you mean llama3-8b")


# ---- layer graphs ------------------------------------------------------------------------------

def toy_graph(s: int = 512, blocks: int = 4, h: int = 512) -> LayerGraph:
    lin = 12 * h * h
    body = tuple(LayerSpec(name=f"layers.{i}", block="block", params=lin, fwd_flops=2.0 * s * lin,
                           bwd_flops=4.0 * s * lin, saved_bytes=34.0 * s * h, output_bytes=2.0 * s * h,
                           tp_style="megatron", tp_fraction=1.0, tp_max=8, tp_allreduces=2)
                 for i in range(blocks))
    return LayerGraph(name="toy", source="module:toy:decoder", sample_tokens=s, trace_dtype="bfloat16", layers=body)


def test_a_layer_graph_is_recorded_and_plans_without_torch(tmp_path):
    g = tmp_path / "g.json"
    g.write_text(dump_json(toy_graph()))
    p = tmp_path / "p.json"
    assert main(["plan", "--model", str(g), "--cluster", "h100-sxm-80gb:8", "--global-batch", "16",
                 "--out", str(p)]) == 0
    doc = json.loads(p.read_text())
    assert doc["seq_len"] == 512 and len(doc["model_spec"]["layers"]) == 4
    g.unlink()  # the plan file alone: the graph it holds, no tracing (module:toy:decoder does not exist)
    code = ("import sys, json; from meshplan.cli.main import main; "
            f"rc = main(['estimate', '--plan', {str(p)!r}, '--json']); "
            "assert rc == 0 and 'torch' not in sys.modules, rc")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["step_time_s"] == doc["predicted"]["step_time_s"] and d["seq_len"] == 512


# ---- the shared logic, directly ----------------------------------------------------------------

def ns(**kw) -> argparse.Namespace:
    base = {"plan": None, "model": None, "cluster": None, "global_batch": None, "seq_len": None, "override": False}
    return argparse.Namespace(**(base | kw))


def test_resolve_sources_and_lazy_loading(plan_file):
    inputs = resolve(ns(plan=str(plan_file), global_batch=16))
    assert inputs.source == {"model": "file", "cluster": "file", "global_batch": "file", "seq_len": "file",
                             "optimizer": "file"}
    assert inputs.model().num_layers == 32 and inputs.seq_len == 2048 and inputs.cluster().num_gpus == 8
    assert inputs.plan.dp * inputs.plan.tp * inputs.plan.pp == 8
    inputs = resolve(ns(plan="dp=8", model="llama3-8b"))
    assert inputs.source == {"model": "cli"} and inputs.plan.dp == 8 and inputs.file is None
    with pytest.raises(MeshplanError, match="--cluster is required"):
        resolve(ns(plan="dp=8", model="llama3-8b"), required=("model", "cluster"))


def test_resolve_into_writes_back_for_the_train_workers(capsys, plan_file):
    args = ns(plan=str(plan_file), global_batch=64, override=True)
    resolve_into(args, fields=("model", "global_batch", "seq_len"), required=("model", "global_batch"), quiet=True)
    assert (args.model, args.global_batch, args.seq_len) == ("llama3-8b", 64, 2048)
    assert capsys.readouterr().err == ""  # quiet: torchrun's workers say nothing


def test_resolved_args_carry_the_loaded_specs(plan_file):
    from meshplan.cli.model_arg import load_model_arg
    from meshplan.spec.io import load_cluster
    args = resolved_args(ns(plan=str(plan_file)))
    assert isinstance(args.model, Loaded) and args.model == "llama3-8b"
    assert load_model_arg(args.model).num_layers == 32 and load_cluster(args.cluster).num_gpus == 8
    assert args.seq_len == 2048 and args.global_batch == 16


def test_train_parser_takes_the_plan_file(plan_file):
    from meshplan.cli.main import build_parser
    from meshplan.cli.train_cmd import worker_argv
    args = build_parser().parse_args(["train", "--plan", str(plan_file), "--steps", "1", "--global-batch", "8",
                                      "--override"])
    assert args.model is None and args.override
    resolve_into(args, fields=("model", "global_batch", "seq_len"), required=("model", "global_batch"), quiet=True)
    argv = worker_argv(args)
    assert argv[argv.index("--model") + 1] == "llama3-8b" and argv[argv.index("--seq-len") + 1] == "2048"
    assert argv[argv.index("--global-batch") + 1] == "8" and "--override" in argv


def test_a_distribution_for_a_file_planned_at_one_length_needs_override(capsys, plan_file):
    """--seq-len DIST against a file planned at one length is a clash like any other recorded input:
    an error naming both, unless --override (then one note); a distribution of the file's length alone
    agrees with it."""
    rc, _, err = run(capsys, "estimate", "--plan", str(plan_file), "--seq-len", "1024:0.5,2048:0.5")
    one_line_error(rc, err, "1024:0.5,2048:0.5", "sequence length 2048", "--override")
    d, err = estimate_json(capsys, "--plan", str(plan_file), "--seq-len", "1024:0.5,2048:0.5", "--override")
    assert "replaces the plan file's sequence length 2048" in err and d["seq_len"] == 2048
    d, err = estimate_json(capsys, "--plan", str(plan_file), "--seq-len", "2048:1")
    assert not err and d["seq_len"] == 2048
