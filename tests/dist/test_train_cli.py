"""`meshplan train` end to end: metrics, estimate beside measurement, checkpoints, resume under
another plan, a killed rank recovered by torchrun --max-restarts, a rank killed by SIGKILL reported
in one line, DDP without its deprecation warning, and bad input (refused before launch)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import meshplan_train, run_env

COMMON = ["--model", "tiny-llama", "--global-batch", "8", "--seq-len", "32", "--pg-timeout", "60"]
FSDP = "dp=2,zero=3,micro_batch=2,precision=fp32"
STEPS = 6
TOL = 1e-5


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "step" in r}


def final_weights(ckpt: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    meta = json.loads((ckpt / "meta.json").read_text())
    out = ckpt / "full.pt"
    dcp_to_torch_save(ckpt / meta["path"], out)
    return torch.load(out, weights_only=False)["model"]


def ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: 6 steps of FSDP on 2 ranks, checkpoint at the end (offload_optimizer:
    a no-op on CPU, said once; the numbers are FSDP's)."""
    d = tmp_path_factory.mktemp("baseline")
    p = meshplan_train(*COMMON, "--plan", FSDP + ",offload_optimizer=1", "--steps", str(STEPS),
                       "--checkpoint-dir", str(d / "ck"), "--metrics", str(d / "m.jsonl"))
    ok(p)
    (d / "stderr.txt").write_text(p.stderr)
    (d / "stdout.txt").write_text(p.stdout)
    return d


def test_metrics_and_estimate(baseline: Path) -> None:
    rows = [json.loads(x) for x in (baseline / "m.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert {"loss", "step_time_s", "tokens_per_s", "peak_memory_gib"} <= set(r)
        assert r["step_time_s"] > 0 and r["peak_memory_gib"] > 0
    summary = rows[-1]
    assert summary["kind"] == "summary" and summary["world_size"] == 2
    assert summary["measured"]["step_time_s"] > 0 and summary["estimate"]["step_time_s"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"]  # it learns
    assert all(b["wall_time"] > a["wall_time"] and b["cpu_time"] > a["cpu_time"] for a, b in zip(steps, steps[1:]))
    note = "offload: no-op on CPU devices (host memory is the device memory)"
    assert [r for r in rows if r.get("kind") == "warning"] == [{"kind": "warning", "message": note}]
    assert summary["warnings"] == [note]
    assert (baseline / "stderr.txt").read_text().count("meshplan: warning: offload") == 1
    label = "cost model for a `local-cpu` device; indicative only on CPU: gloo and Python overheads are not modelled"
    assert summary["estimate"]["basis"] == label
    assert f"estimated: {label}" in (baseline / "stdout.txt").read_text()


def test_resume_under_other_plans(baseline: Path, tmp_path: Path) -> None:
    """FSDP on 2 ranks for 3 steps -> TP 2 to step 5 -> one process to step 6: same losses."""
    ck, m = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    ok(meshplan_train(*COMMON, "--plan", FSDP, "--steps", "3", "--checkpoint-dir", ck, "--metrics", m))
    ok(meshplan_train(*COMMON, "--plan", "tp=2,micro_batch=4,precision=fp32", "--steps", "5",
                      "--checkpoint-dir", ck, "--resume", "--metrics", m))
    p = meshplan_train(*COMMON, "--plan", "micro_batch=8,precision=fp32", "--steps", "6",
                       "--checkpoint-dir", ck, "--resume", "--metrics", m)
    ok(p)
    assert "resumed from" in p.stderr
    got, want = losses(Path(m)), losses(baseline / "m.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in want:
        assert abs(got[s] - want[s]) <= TOL * abs(want[s]), (s, got[s], want[s])


def test_killed_rank_recovers(baseline: Path, tmp_path: Path) -> None:
    """Rank 1 dies after step 5 (checkpoint at 4): torchrun restarts, the run resumes, ends equal."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    p = meshplan_train(*COMMON, "--plan", FSDP, "--steps", str(STEPS), "--checkpoint-dir", str(ck),
                       "--checkpoint-every", "2", "--max-restarts", "1", "--metrics", str(m),
                       env=run_env(MESHPLAN_FAIL_AT="1:5"))
    ok(p)
    assert "fault injection: rank 1" in p.stderr and "resumed from" in p.stderr
    got, want = losses(m), losses(baseline / "m.jsonl")
    for s in want:
        assert abs(got[s] - want[s]) <= TOL * abs(want[s]), (s, got[s], want[s])
    w, ref = final_weights(ck), final_weights(baseline / "ck")
    assert set(w) == set(ref)
    for k in ref:
        assert float((w[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)) < TOL, k


def one_error_line(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [x for x in p.stderr.splitlines() if x.startswith("meshplan: error:")]
    assert lines, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_input(baseline: Path, tmp_path: Path) -> None:
    one_error_line(meshplan_train(*COMMON, "--plan", "dp=4", "--nproc-per-node", "2", "--steps", "2"),
                   "the plan runs on 4 GPUs (give --nproc-per-node 4)")
    one_error_line(meshplan_train(*COMMON, "--plan", "dp=2", "--steps", "2", "--resume",
                                  "--checkpoint-dir", str(tmp_path / "missing")), "does not exist")
    one_error_line(meshplan_train("--model", "tiny-gpt2", "--global-batch", "8", "--plan", "dp=2", "--steps", "2",
                                  "--resume", "--checkpoint-dir", str(baseline / "ck")), "tiny-llama")
    one_error_line(meshplan_train(*COMMON, "--plan", "dp=2,micro_batch=3", "--steps", "2"), "not divisible")
    one_error_line(meshplan_train(*COMMON, "--plan", "dp=2", "--steps", "2", "--lr=-1"),
                   "--lr must be a finite number > 0")
    one_error_line(meshplan_train(*COMMON, "--plan", "dp=2", "--steps", "2", "--metrics",
                                  str(tmp_path / "none" / "m.jsonl")), "does not exist")
    assert not (tmp_path / "none").exists()
    ck = baseline / "ck"
    one_error_line(meshplan_train(*COMMON, "--plan", FSDP, "--steps", "5", "--resume", "--checkpoint-dir", str(ck)),
                   f"the checkpoint in {ck} is at step {STEPS}, --steps 5 asks for fewer", f"--steps > {STEPS}")


def test_runs_that_cannot_fit_are_refused_before_launch() -> None:
    """The estimate (every process on this machine counted) against MemAvailable: far beyond any host."""
    one_error_line(meshplan_train("--model", "llama3-70b", "--plan", "dp=2", "--global-batch", "2", "--steps", "1"),
                   "not enough host memory for llama3-70b with dp=2", "x 2 processes", "MemAvailable")
    one_error_line(meshplan_train(*COMMON[:4], "--seq-len", "16777216", "--plan", "dp=2", "--steps", "1"),
                   "not enough host memory", "x 16777216 tokens", "--seq-len")


def test_rank_killed_by_sigkill_is_one_line() -> None:
    """What the OOM killer does to a rank: SIGKILL. The launcher says so in one line, no traceback."""
    p = meshplan_train(*COMMON, "--plan", "dp=2,precision=fp32", "--steps", "3",
                       env=run_env(MESHPLAN_FAIL_AT="1:1:SIGKILL"))
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    last = [x for x in p.stderr.splitlines() if x.startswith("meshplan: error:")][-1]
    assert last.startswith("meshplan: error: training failed: rank 1 was killed (SIGKILL"), last
    assert "most likely out of host memory" in last and "GiB" in last


def test_ddp_has_no_deprecation_warning() -> None:
    """zero=0 (DDP) with Python's default warning filters: no FutureWarning from our DDP arguments."""
    p = meshplan_train(*COMMON, "--plan", "dp=2,precision=fp32", "--steps", "2", env=run_env(PYTHONWARNINGS="default"))
    ok(p)
    assert "FutureWarning" not in p.stderr and "broadcast_buffers" not in p.stderr, p.stderr[-3000:]
    assert "indicative only on CPU" in p.stdout


def test_tp_fsdp_returns_no_view() -> None:
    """TP x FSDP used to print FSDP2's "returned a view tensor" warning on every rank: the root module
    (FSDPTransformer) returned the replicated logits through DTensor.to_local(), which is a
    ``view_as`` of the local tensor. The output projection now keeps its logits a vocabulary-sharded
    DTensor (Shard(-1), use_local_output=False, the loss under loss_parallel): no view is returned.
    Python's default warning filters, 4 ranks, and an ingested T5 (whose warning is filtered as a
    false positive, generic.T5_VIEW_WARNING)."""
    p = meshplan_train(*COMMON, "--plan", "tp=2,dp=2,zero=3,precision=fp32", "--steps", "2",
                       env=run_env(PYTHONWARNINGS="default"))
    ok(p)
    assert "returned a view" not in p.stderr and "UserWarning" not in p.stderr, p.stderr[-3000:]
    pytest.importorskip("transformers")
    t5 = Path(__file__).resolve().parents[1] / "data" / "hf" / "t5-tiny-nodropout.json"
    p = meshplan_train("--model", f"hf:{t5}", "--plan", "dp=2,zero=3,precision=fp32", "--global-batch", "4",
                       "--seq-len", "32", "--steps", "2", "--pg-timeout", "60", env=run_env(PYTHONWARNINGS="default"))
    ok(p)
    assert "returned a view" not in p.stderr, p.stderr[-3000:]


def test_existing_checkpoint_needs_resume_or_overwrite(tmp_path: Path) -> None:
    """A run without --resume into a checkpoint directory is refused (it used to reset meta.json and
    mix its step folders with the old ones); --overwrite deletes the old checkpoint and starts again."""
    ck = tmp_path / "ck"
    ok(meshplan_train(*COMMON, "--plan", "dp=2,precision=fp32", "--steps", "3", "--checkpoint-dir", str(ck),
                      "--checkpoint-every", "1"))
    assert sorted(x.name for x in ck.iterdir()) == ["meta.json", "step-00000001", "step-00000002", "step-00000003"]
    one_error_line(meshplan_train(*COMMON, "--plan", "dp=2,precision=fp32", "--steps", "2", "--checkpoint-dir",
                                  str(ck)), "already holds a checkpoint at step 3 of tiny-llama", "--resume")
    p = meshplan_train(*COMMON, "--plan", "dp=2,precision=fp32", "--steps", "2", "--checkpoint-dir", str(ck),
                       "--overwrite")
    ok(p)
    assert sorted(x.name for x in ck.iterdir()) == ["meta.json", "step-00000002"]
    assert json.loads((ck / "meta.json").read_text())["step"] == 2


def test_wrong_world_size_inside_torchrun_does_not_hang() -> None:
    """Started by torchrun itself with the wrong process count: each rank says so and exits."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "meshplan.cli.train_cmd", *COMMON, "--plan", "dp=4", "--nproc-per-node", "4", "--steps", "2"]
    p = subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert p.stderr.count("meshplan: error: plan needs 4 processes") == 2, p.stderr[-3000:]


def test_train_cmd_does_not_import_torch() -> None:
    code = ("import sys, argparse, meshplan.cli.train_cmd as t; p = argparse.ArgumentParser(); "
            "t.add_train_parser(p.add_subparsers()); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
