"""`meshplan calibrate --bench` end to end on CPU: the micro-benchmarks through torch, the
collectives under torchrun with gloo (2 processes), the fit, the calibration file labelled CPU,
and a planning command that uses it (and warns that it was measured on CPU). Then two 'nodes' on
this machine (two launches, static rendezvous on localhost): the inter-node path."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

from conftest import LAUNCH_TIMEOUT_S, run_env

from meshplan.calibration.space import by_name


def meshplan(*args: str, cwd=None, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    code = "import sys; from meshplan.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], env=run_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _check_calibration(doc: dict) -> None:
    assert doc["kind"] == "calibration" and doc["device_kind"] == "cpu" and "measured on CPU" in doc["note"]
    assert doc["values"] and set(doc["values"]) == set(doc["changes"])
    for name, v in doc["values"].items():
        f = by_name(name)
        assert f.low <= v <= f.high
        ch = doc["changes"][name]
        assert ch["to"] == v and ch["measurements"] and "from" in ch
    assert not any(n.startswith(("gemm_efficiency@", "attention_efficiency@")) for n in doc["values"])


def test_calibrate_bench_on_cpu_end_to_end(tmp_path):
    r = meshplan("calibrate", "--bench", "--out", "c.json", "--bench-out", "raw.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert raw["device_kind"] == "cpu" and raw["backend"] == "gloo" and raw["nproc_per_node"] == 2
    ms = {m["id"]: m for m in raw["measurements"]}
    kinds = {m["kind"] for m in ms.values() if "not_measured" not in m}
    assert kinds == {"gemm", "attention", "elementwise", "collective"}
    assert ms["all_reduce/intra_node/n2/1MiB"]["seconds"] > 0
    assert "inter-node links were not measured" in ms["inter_node"]["not_measured"]
    measured_ops = {m["op"] for m in ms.values() if m["kind"] == "collective" and "not_measured" not in m}
    assert {"all_reduce", "send_recv"} <= measured_ops  # the others: measured, or recorded as not measured
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert op in measured_ops or f"{op}/intra_node/n2" in ms
    doc = json.loads((tmp_path / "c.json").read_text())
    _check_calibration(doc)
    assert "hbm_efficiency" in doc["values"] and "link_efficiency@intra_node:pcie" in doc["values"]
    assert "labelled CPU" in r.stdout and "from which measurements" in r.stdout
    assert "not measured: inter_node" in r.stdout
    # a planning command takes it, and says it was measured on CPU
    e = meshplan("estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--plan", "dp=8,zero=3",
                 "--global-batch", "32", "--calibration", "c.json", "--json", cwd=tmp_path)
    assert e.returncode == 0, e.stderr
    assert "warning: --calibration c.json was measured on CPU" in e.stderr
    assert json.loads(e.stdout)["calibration"]["values"] == doc["values"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_calibrate_bench_across_two_nodes(tmp_path):
    """Two launches on this machine as two one-process nodes: node 0 measures and writes, the
    collectives cross 'nodes' (the inter-node link), node 1 only takes part."""
    port = _free_port()
    code = "import sys; from meshplan.cli.main import main; sys.exit(main(sys.argv[1:]))"
    common = ["calibrate", "--bench", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
              f"127.0.0.1:{port}"]
    node1 = subprocess.Popen([sys.executable, "-c", code, *common, "--node-rank", "1", "--out", "n1.json"],
                             env=run_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        r = meshplan(*common, "--node-rank", "0", "--out", "n0.json", cwd=tmp_path)
        out1, err1 = node1.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert r.returncode == 0, r.stderr[-3000:]
    assert node1.returncode == 0, err1[-3000:]
    assert "node 0 writes the calibration" in out1 and not (tmp_path / "n1.json").exists()
    doc = json.loads((tmp_path / "n0.json").read_text())
    _check_calibration(doc)
    assert "link_efficiency@inter_node:infiniband" in doc["values"]
    ids = doc["changes"]["link_efficiency@inter_node:infiniband"]["measurements"]
    assert ids and all("/inter_node/" in i for i in ids)
    assert doc["bench"]["nnodes"] == 2
