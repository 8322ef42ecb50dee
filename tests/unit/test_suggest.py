"""Unknown GPU, cluster and model names say "did you mean" (spec.io.suggest), from the command line and
from files; the known names still load."""
from __future__ import annotations

import pytest
from clirun import one_line_error, run

from meshplan.errors import MeshplanError
from meshplan.spec.io import load_cluster, suggest

EST = ["estimate", "--model", "llama3-8b", "--plan", "dp=8,zero=3", "--global-batch", "16"]


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
