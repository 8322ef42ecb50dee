"""Issue 29's rough edges, each with a test that failed before its fix."""
from __future__ import annotations

import json

import pytest

from clirun import run
from meshplan.errors import MeshplanError
from meshplan.spec.plan import parse_plan


@pytest.mark.parametrize("text", ["dp=8,,zero=3", "dp=8,zero=3,,", ",dp=8"])
def test_an_empty_item_in_a_plan_string_is_an_error(text):
    """Edge 8: 'dp=8,,zero=3' was silently accepted."""
    with pytest.raises(MeshplanError, match="empty item"):
        parse_plan(text)


def test_cost_ties_at_a_price_of_zero_go_to_time(capsys):
    """Edge 2: with --price-per-gpu-hour 0 every plan costs $0 and the tie fell to less memory, so a
    slower plan won; the README says time comes second."""
    rc, out, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "16",
                       "--objective", "cost", "--price-per-gpu-hour", "0", "--json")
    assert rc == 0, err
    times = [p["cost"]["step_time_s"] for p in json.loads(out)["plans"]]
    assert times == sorted(times)


@pytest.mark.parametrize("argv,command", [
    (["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--plan", "dp=8,zero=3",
      "--global-batch", "16"], "estimate"),
    (["plan", "--model", "gpt2-medium", "--cluster", "h100-sxm-80gb:8", "--global-batch", "16"], "plan"),
    (["simulate", "--model", "gpt2-medium", "--cluster", "h100-sxm-80gb:8", "--plan", "dp=8",
      "--global-batch", "16"], "simulate"),
    (["presets"], "presets"),
])
def test_json_documents_carry_a_schema_version(capsys, argv, command):
    """Edge 12: `plan --json` and `estimate --json` carried no schema_version."""
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["schema_version"] == 1 and d["command"] == command
    assert list(d)[:2] == ["schema_version", "command"]


def test_nothing_fits_exits_3_not_2(capsys):
    """Edge 10: exit code 2 meant both bad usage and "no plan fits"."""
    rc, out, err = run(capsys, "plan", "--model", "llama3-70b", "--cluster", "h100-sxm-80gb:2", "--global-batch", "16")
    assert rc == 3 and "no plan fits" in err and err.count("\n") == 1
    rc, _, err = run(capsys, "plan", "--model", "llama3-70b", "--cluster", "h100-sxm-80gb:2", "--global-batch", "x")
    assert rc == 2


def test_a_config_with_no_layers_is_refused(capsys, tmp_path):
    """Edge 8: an HF config with 0 layers was planned as an embedding and a head."""
    pytest.importorskip("transformers")
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 0, "hidden_size": 512,
                             "num_attention_heads": 8, "intermediate_size": 1024, "vocab_size": 1000}))
    rc, _, err = run(capsys, "estimate", "--model", f"hf:{f}", "--cluster", "h100-sxm-80gb:8", "--plan", "dp=8",
                     "--global-batch", "16")
    assert rc == 2 and "num_hidden_layers = 0 is not a whole number >= 1" in err and err.count("\n") == 1


def test_plan_says_what_it_wrote(capsys, tmp_path):
    """Edge 11: `plan --out` and `--plot` wrote silently."""
    out, svg = tmp_path / "p.json", tmp_path / "p.svg"
    rc, _, err = run(capsys, "plan", "--model", "gpt2-medium", "--cluster", "h100-sxm-80gb:8", "--global-batch", "16",
                     "--out", str(out), "--plot", str(svg), "--json")
    assert rc == 0 and out.exists() and svg.exists()
    assert f"wrote {out}" in err and f"wrote {svg}" in err


@pytest.mark.parametrize("argv,needle", [
    (["--shots", "1"], "--shots needs --cross-validate"),
    (["--blind"], "--blind needs --shots"),
    (["--cross-validate", "--shots", "0,,3"], "not a list of whole numbers"),
    (["--cross-validate", "--shots", "-1"], "counts must be 0 to 50"),
])
def test_few_shot_flags_are_checked_before_any_fit(capsys, argv, needle):
    rc, _, err = run(capsys, "validate", *argv)
    assert rc == 2 and needle in err and err.count("\n") == 1


def test_gpu_budgets_on_a_cluster_of_sites_keep_the_links_of_the_sites_kept():
    """Review: `plan --gpus 64` on three-region-h100 failed on a site link to a site the budget drops."""
    from meshplan.search.sizes import resized
    from meshplan.spec.io import load_cluster
    c = load_cluster("three-region-h100")
    two = resized(c, 64)
    assert two.num_dcs == 2 and [t.sites for t in two.site_links] == [(0, 1)]
    assert resized(c, 32).num_dcs == 1 and not resized(c, 32).site_links
    assert resized(c, 96).site_links == c.site_links


@pytest.mark.parametrize("cluster,order", [("three-region-h100", "0:1"), ("h100-sxm-80gb:8", "0:1")])
def test_a_site_order_in_order_is_checked_too(capsys, cluster, order):
    """Review: site_order=0:1 (in order, but the wrong count of sites) was dropped silently."""
    rc, _, err = run(capsys, "estimate", "--model", "llama3-8b", "--cluster", cluster, "--global-batch", "256",
                     "--plan", f"tp=1,pp=1,dp=8,site_order={order}" if cluster.endswith(":8") else
                     f"tp=1,pp=3,dp=32,stage_layers=11:11:10,site_order={order}")
    assert rc == 2 and "names 2 sites but the cluster has" in err


def test_placement_line_says_a_pipeline_crosses_what_some_of_its_groups_cross():
    """Review: pp=3 under dp:pp:cp:tp on 8-GPU nodes was said to be 'inside a node', though groups such
    as ranks 6, 7, 8 cross nodes (and 31, 32, 33 sites)."""
    from meshplan.search.explain import axis_tiers
    from meshplan.spec.io import load_cluster
    c = load_cluster("three-region-h100")
    tiers = axis_tiers(c, parse_plan("tp=1,pp=3,dp=32,stage_layers=11:11:10,mesh_order=dp:pp:cp:tp"))
    assert tiers["pp"] == "across sites" and tiers["dp"] == "across sites"
    assert axis_tiers(c, parse_plan("tp=8,pp=12,dp=1"))["tp"] == "inside a node"


def test_plan_checks_its_out_path_before_searching(capsys):
    """Review: `plan --out /nonexistent/dir/p.json` printed the whole plan, then the error."""
    rc, out, err = run(capsys, "plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "16",
                       "--out", "/nonexistent/dir/p.json")
    assert rc == 2 and not out and "does not exist" in err
