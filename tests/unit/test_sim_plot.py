"""`meshplan simulate --plot`: the path is checked before any work, the image has the format of its
extension, and the Gantt chart (sim.write_plot) is one artist and fast."""
from __future__ import annotations

import time

import pytest
from clirun import one_line_error, run

from meshplan.spec.io import load_cluster

SIM_70B = ["simulate", "--model", "llama3-70b", "--cluster", "h100-sxm-80gb:64", "--plan",
           "tp=8,pp=4,dp=2,micro_batch=1,schedule=1f1b,sequence_parallel=1,zero=1", "--global-batch", "64",
           "--seq-len", "8192"]


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
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: pytest.fail("simulated before checking --plot"))
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

    from meshplan.sim import simulate, write_plot
    from meshplan.spec.io import load_model, load_plan
    from meshplan.spec.plan import Workload
    res, _ = simulate(load_model("llama3-70b"), load_cluster("h100-sxm-80gb:64"),
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
