"""Command-line polish from a user's bug report: "did you mean" for GPU and cluster names, presets
with their specs, --plot checked up front and drawn fast, progress for slow steps, no warnings."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest
from clirun import one_line_error, run

from meshplan.errors import MeshplanError
from meshplan.spec.io import load_cluster, suggest

EST = ["estimate", "--model", "llama3-8b", "--plan", "dp=8,zero=3", "--global-batch", "16"]
SIM_70B = ["simulate", "--model", "llama3-70b", "--cluster", "h100-sxm-80gb:64", "--plan",
           "tp=8,pp=4,dp=2,micro_batch=1,schedule=1f1b,sequence_parallel=1,zero=1", "--global-batch", "64",
           "--seq-len", "8192"]




# ---- did you mean ------------------------------------------------------------------------------

@pytest.mark.parametrize("cluster,suggestions", [
    ("dgx-a10", ["dgx-a100"]),
    ("dgxa100", ["dgx-a100"]),
    ("h100:8", ["h100-sxm-80gb:8", "h100-pcie-80gb:8", "h100-nvl-94gb:8"]),
    ("h100", ["h100-sxm-80gb"]),
    ("a100:4x8", ["a100-sxm-80gb:4x8", "a100-sxm-40gb:4x8"]),
    ("mi300:8", ["mi300x-192gb:8"]),
    ("H100-SXM:16", ["h100-sxm-80gb:16"]),
    ("dgx-a100:16", ["a100-sxm-80gb:16", "cluster preset"]),
])
def test_unknown_cluster_names_say_did_you_mean(capsys, cluster, suggestions):
    rc, _, err = run(capsys, *EST, "--cluster", cluster)
    one_line_error(rc, err, "did you mean", *suggestions)


def test_unknown_gpu_without_a_close_name_still_lists_the_known_ones(capsys):
    rc, _, err = run(capsys, *EST, "--cluster", "tpu-v9:8")
    one_line_error(rc, err, "unknown gpu 'tpu-v9'", "known gpus", "h100-sxm-80gb")
    assert "did you mean" not in err


def test_suggest_prefers_the_names_it_begins():
    assert suggest("h100", ["a100-sxm-80gb", "h100-sxm-80gb", "h100-pcie-80gb", "v100-sxm-32gb"]) == [
        "h100-sxm-80gb", "h100-pcie-80gb"]
    assert suggest("llama3-8bb", ["llama3-8b", "llama3-70b", "gpt3-175b"])[0] == "llama3-8b"
    assert suggest("", ["a"]) == [] and suggest("zzz", ["a100"]) == []


def test_a_cluster_file_naming_an_unknown_gpu_says_did_you_mean(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('name = "x"\ngpu = "h100-sxm"\nnum_nodes = 1\n')
    with pytest.raises(MeshplanError, match="Did you mean h100-sxm-80gb"):
        load_cluster(str(f))


def test_known_names_still_load():
    assert load_cluster("dgx-a100").num_gpus == 8
    assert load_cluster("h100-sxm-80gb").num_gpus == 8
    assert load_cluster("H100-SXM-80GB:16").num_gpus == 16


# ---- presets with their specs ------------------------------------------------------------------

def test_presets_show_the_specs(capsys):
    rc, out, _ = run(capsys, "presets")
    assert rc == 0
    for head in ("params", "layers", "hidden", "heads", "seq len", "HBM GiB", "bf16 TFLOP/s", "fp8 TFLOP/s",
                 "HBM GB/s", "$/GPU-h", "GPUs/node", "intra-node", "inter-node"):
        assert head in out, head
    line = next(x for x in out.splitlines() if x.split() and x.split()[0] == "llama3-8b")
    assert line.split()[1:7] == ["8.03B", "32", "4096", "32", "8", "8192"]
    h100 = next(x for x in out.splitlines() if x.split() and x.split()[0] == "h100-sxm-80gb").split()
    assert h100[1:7] == ["79.6", "989", "1,979", "3,350", "2.50", "8"]
    a100 = next(x for x in out.splitlines() if x.split() and x.split()[0] == "a100-sxm-80gb").split()
    assert a100[3] == "-"  # no fp8
    jz = next(x for x in out.splitlines() if x.split() and x.split()[0] == "jean-zay-a100")
    assert "a100-sxm-80gb" in jz and "384 (48 x 8)" in jz and "omnipath 6.25 GB/s" in jz and "1.80" in jz
    assert "8 x top-2" in out  # mixtral's experts


def test_presets_json_is_complete(capsys):
    rc, out, _ = run(capsys, "presets", "--json")
    d = json.loads(out)
    assert rc == 0 and set(d) == {"models", "gpus", "clusters"}
    m = d["models"]["llama3-8b"]
    assert m["params"] == 8_030_261_248 and m["num_layers"] == 32 and m["seq_len"] == 8192
    assert m["meta"]["params_published"] == 8_030_261_248
    g = d["gpus"]["h100-sxm-80gb"]
    assert g["peak_tflops"]["fp8"] == pytest.approx(1978.9) and g["price_per_hour_usd"] == 2.5
    assert g["gpus_per_node"] == 8 and g["hbm_bandwidth_gbps"] == 3350
    c = d["clusters"]["jean-zay-a100"]
    assert c["num_gpus"] == 384 and c["inter_node"]["bandwidth_gbps"] == 6.25 and c["gpu"]["name"] == "a100-sxm-80gb"
    rc, out, _ = run(capsys, "presets", "gpus", "--json")
    assert set(json.loads(out)) == {"gpus"}


# ---- --plot ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,needle", [
    ("plot.xyz", "cannot draw a .xyz image"),
    ("/nonexistent-dir/p.png", "directory /nonexistent-dir does not exist"),
    (".", "is a directory"),
])
def test_simulate_plot_path_is_checked_before_any_work(capsys, monkeypatch, tmp_path, path, needle):
    pytest.importorskip("matplotlib")
    import meshplan.sim as sim
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sim, "simulate_plan", lambda *a, **k: pytest.fail("simulated before checking --plot"))
    rc, out, err = run(capsys, *SIM_70B, "--plot", path)
    one_line_error(rc, err, needle)
    assert not out


def test_simulate_plot_writes_the_format_of_its_extension(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    for name, magic in (("s.png", b"\x89PNG"), ("s.svg", b"<?xml"), ("s.pdf", b"%PDF"), ("noext", b"\x89PNG")):
        rc, _, err = run(capsys, "simulate", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:4",
                         "--plan", "pp=2,dp=2,micro_batch=1", "--global-batch", "8", "--plot", str(tmp_path / name))
        assert rc == 0, err
        assert (tmp_path / name).read_bytes().startswith(magic), name


def test_gantt_is_one_artist_and_fast():
    """5,640 events (llama3-70b, pp=4, 256 micro-batches) drew one artist each in ~8 s (quadratic
    autoscaling); one PolyCollection draws them in about a second."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from meshplan.sim import simulate_plan, write_plot
    from meshplan.spec.io import load_model, load_plan
    from meshplan.spec.plan import Workload
    res, _ = simulate_plan(load_model("llama3-70b"), load_cluster("h100-sxm-80gb:64"),
                           load_plan("tp=8,pp=4,dp=2,micro_batch=1,schedule=1f1b,sequence_parallel=1,zero=1"),
                           Workload(global_batch=512, seq_len=8192))
    assert len(res.events) > 5000
    made = []
    real_subplots = plt.subplots

    def spy(*a, **k):
        fig, axes = real_subplots(*a, **k)
        made.append(axes[0])
        return fig, axes
    plt.subplots = spy
    try:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            write_plot(res, f"{d}/g.png")
            took = time.perf_counter() - t0
    finally:
        plt.subplots = real_subplots
    assert len(made[0].collections) == 1
    assert took < 15, took  # ~1 s here; generous for a loaded machine


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
