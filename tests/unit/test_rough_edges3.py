"""Issue 29: the rough edges left after test_rough_edges.py and test_rough_edges2.py, each with a test that
failed before its fix."""
from __future__ import annotations

import json

import pytest

from clirun import run

OFFLOAD = "tp=1,dp=8,zero=3,offload_params=1,offload_optimizer=1,recompute=full"


# ---- edge 7: host memory for offload is the cluster's, not a DGX A100's everywhere ----------------

def _estimate(capsys, *argv):
    rc, out, err = run(capsys, "estimate", *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_host_memory_for_offload_is_the_clusters(capsys, tmp_path):
    """Edge 7: every cluster was given a DGX A100's 128 GiB of host memory per GPU. A DGX H100 has 2 TiB
    (256 per GPU): Llama 3 70B fully offloaded over 8 (131 GiB per GPU) fits its host; a DGX-1 has 512 GiB
    (64 per GPU): a 39B model fully offloaded over 8 V100s (73 GiB per GPU) does not."""
    h100 = _estimate(capsys, "--model", "llama3-70b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "8",
                     "--seq-len", "8192", "--plan", OFFLOAD)
    assert h100["host_memory_gib"] == pytest.approx(131.4, abs=0.1)
    assert h100["host_memory_per_gpu_gib"] == 256 and h100["host_fits"] and h100["verdict"] == "fits"
    v100 = _estimate(capsys, "--model", "megatron-39b", "--cluster", "v100-sxm-32gb:8", "--global-batch", "8",
                     "--seq-len", "2048", "--plan", OFFLOAD + ",precision=fp16")
    assert 64 < v100["host_memory_gib"] < 128
    assert v100["host_memory_per_gpu_gib"] == 64 and not v100["host_fits"]
    assert v100["fits"] and v100["verdict"] == "does-not-fit"  # the GPU has room; the host has not
    rc, out, _ = run(capsys, "estimate", "--model", "megatron-39b", "--cluster", "v100-sxm-32gb:8", "--global-batch",
                     "8", "--seq-len", "2048", "--plan", OFFLOAD + ",precision=fp16")
    line = next(x for x in out.splitlines() if x.startswith("host memory"))
    assert "of 64 per GPU (a node's 512 GiB over 8 GPUs: the typical v100-sxm-32gb system's)" in line
    assert "DOES NOT FIT" in line
    # a cluster file's host_memory_gib (per node) overrides the preset: 1 TiB over 8 makes the H100 plan not fit
    f = tmp_path / "c.toml"
    f.write_text('gpu = "h100-sxm-80gb"\nnum_nodes = 1\ngpus_per_node = 8\nhost_memory_gib = 1024\n')
    small = _estimate(capsys, "--model", "llama3-70b", "--cluster", str(f), "--global-batch", "8", "--seq-len", "8192",
                      "--plan", OFFLOAD)
    assert small["host_memory_per_gpu_gib"] == 128 and not small["host_fits"]
    rc, _, err = run(capsys, "plan", "--model", "llama3-70b", "--cluster", str(f), "--global-batch", "8",
                     "--seq-len", "8192", "--fix", "tp=1,pp=1,offload=1")
    assert rc == 3 and err.count("\n") == 1, err
    assert "its offload needs 131 GiB of host memory per GPU (of 128, the node's 1,024 GiB over 8)" in err


def test_host_memory_per_node_defaults_and_checks():
    from meshplan.errors import MeshplanError
    from meshplan.spec.io import cluster_from_dict, load_cluster
    assert load_cluster("dgx-a100").host_memory_per_node_gib == 2048
    assert load_cluster("a100-sxm-40gb:16").host_memory_per_gpu_gib == 128  # a DGX A100 320GB's 1 TiB
    gh = load_cluster("gh200-96gb:8")  # 4 superchips a node, each its own LPDDR5X
    assert gh.gpus_per_node == 4 and gh.host_memory_per_node_gib == 4 * 480
    assert load_cluster("h100-sxm-80gb:4x2").host_memory_per_node_gib == 2 * 256  # nodes of 2: their share
    with pytest.raises(MeshplanError, match="host_memory_gib"):
        cluster_from_dict({"gpu": "h100-sxm-80gb", "num_nodes": 1, "host_memory_gib": -1})
