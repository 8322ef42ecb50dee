"""`meshplan train` without starting a rank (torchrun and the in-process worker are
stubbed): the planner's constraints in the launcher's pre-flight [2], an existing checkpoint without
--resume [3], the CPU-corrected memory beside the measurement [12], more processes than CPU cores [19],
the step-time estimate before launch [13b], and the one FSDP2 view warning filtered as a false
positive (T5's position bias) [11]. The multi-process halves are in tests/dist/test_train_cli.py."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from clirun import error_line

from meshplan.cli.main import main
from meshplan.errors import MeshplanError
from meshplan.runtime import local, preflight
from meshplan.spec.graph import LayerGraph, LayerSpec
from meshplan.spec.io import load_model, load_plan

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "data" / "hf"
TINY = ["train", "--model", "tiny-llama", "--global-batch", "8", "--seq-len", "32", "--steps", "3"]



@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list:
    """Nothing starts: torchrun and the in-process workers are replaced by a recorder (exit 0)."""
    pytest.importorskip("torch")
    from meshplan.runtime import launch
    calls: list = []

    def record(*a: object, **k: object) -> int:
        calls.append(a)
        return 0
    monkeypatch.setattr(launch, "run_torchrun", record)
    monkeypatch.setattr(launch, "worker_main", record)
    return calls


# ---- [2] the planner's constraints before launch ----------------------------------------------------
@pytest.mark.parametrize("plan,needle", [
    ("pp=2,dp=1,schedule=zbv,virtual_stages=2,precision=fp32", "pp*virtual_stages = 4 exceeds the 2 layers"),
    ("pp=2,schedule=interleaved-1f1b,virtual_stages=2,precision=fp32", "pp*virtual_stages = 4 exceeds the 2 layers"),
    ("pp=2,dp=2,zero=2", "zero=2 with pp > 1"),
    ("pp=2,recompute=full,recompute_layers=3", "recompute_layers=3 exceeds the 1 blocks"),
    ("dp=2,offload_params=1", "offload_params needs zero=3"),
    ("dp=2,shard_group=2", "shard_group (hybrid sharding) needs zero >= 1"),
    ("dp=2,sequence_parallel=1", "sequence_parallel needs tp > 1"),
])
def test_plans_the_planner_refuses_are_refused_before_launch(capsys: pytest.CaptureFixture[str], launched: list,
                                                             plan: str, needle: str) -> None:
    line = error_line(capsys, [*TINY, "--plan", plan])
    assert line.startswith("meshplan: error: plan cannot run: ") and needle in line, line
    assert "meshplan estimate" in line
    assert launched == []


def test_check_plan_is_the_planners_check_but_for_the_hardware() -> None:
    """Every reason `estimate` gives on a cluster of the run's size is the launcher's, but the process
    count (said in the runtime's words), tp across nodes and fp8 without fp8 hardware."""
    from meshplan.cost.step import check
    model = load_model("tiny-llama")
    for text in ("dp=2", "tp=2", "pp=2", "pp=2,dp=2,zero=3", "dp=2,zero=3,offload_params=1", "cp=2,tp=2",
                 "pp=2,virtual_stages=2,schedule=zbv", "pp=2,dp=2,zero=2", "dp=2,offload_params=1", "precision=fp8"):
        plan = load_plan(text)
        try:
            check(model, local.cpu_cluster(plan.num_gpus, memory_gib=1.0), plan, _work(8, 32))
            planner = None
        except MeshplanError as e:
            planner = str(e)
        try:
            preflight.check_plan(model, plan, 8, 32)
            mine = None
        except MeshplanError as e:
            mine = e.message
        if planner is None or text == "precision=fp8":  # fp8: runs as bf16 on CPU, noted
            assert mine is None, (text, mine)
        else:
            assert mine == planner, (text, mine, planner)


def _work(batch: int, seq: int):  # noqa: ANN202
    from meshplan.spec.plan import Workload
    return Workload(global_batch=batch, seq_len=seq)


def toy_graph(blocks: int = 2, seq: int = 16) -> LayerGraph:
    def layer(name: str, kind: str, params: int) -> LayerSpec:
        return LayerSpec(name=name, kind=kind, block=kind, params=params, fwd_flops=2.0 * seq * params,
                         bwd_flops=4.0 * seq * params, saved_bytes=1e3, output_bytes=1e3,
                         extra={"gemm_dim": 64.0})
    return LayerGraph(name="toy", source="module:toy:make", sample_tokens=seq, layers=(
        layer("embed", "embedding", 1000), *(layer(f"layers.{i}", "block", 4000) for i in range(blocks)),
        layer("head", "head", 1000)))


def test_graph_plans_get_the_graph_models_constraints() -> None:
    g = toy_graph()  # 4 layers, 2 of them blocks (what pipeline stages count)
    preflight.check_graph_plan(g, load_plan("pp=2"), 4)
    with pytest.raises(MeshplanError, match="pp\\*virtual_stages = 8 exceeds the 2 layers"):
        preflight.check_graph_plan(g, load_plan("pp=4,virtual_stages=2,schedule=interleaved-1f1b"), 8)
    with pytest.raises(MeshplanError, match="zero=2 with pp > 1"):
        preflight.check_graph_plan(g, load_plan("pp=2,dp=2,zero=2"), 4)
    with pytest.raises(MeshplanError, match="divisible by pp=2"):
        preflight.check_graph_plan(g, load_plan("pp=2,virtual_stages=2,schedule=interleaved-1f1b"), 3)
    # not traceable (no graph): what reads only the plan and the batch
    preflight.check_graph_plan(None, load_plan("pp=4,virtual_stages=2,schedule=interleaved-1f1b"), 8)
    with pytest.raises(MeshplanError, match="offload_params needs zero=3"):
        preflight.check_graph_plan(None, load_plan("dp=2,offload_params=1"), 4)


def test_ingested_plans_the_planner_refuses_are_refused_before_launch(capsys: pytest.CaptureFixture[str],
                                                                      launched: list) -> None:
    pytest.importorskip("transformers")
    line = error_line(capsys, ["train", "--model", f"hf:{HF / 'llama-tiny.json'}", "--plan",
                               "pp=4,virtual_stages=2,schedule=interleaved-1f1b,precision=fp32",
                               "--global-batch", "8", "--seq-len", "16", "--steps", "1"])
    assert "pp*virtual_stages = 8 exceeds the 4 layers" in line  # stages count blocks (issue 12), the planner's words
    line = error_line(capsys, ["train", "--model", f"hf:{HF / 'llama-tiny.json'}", "--plan", "pp=2,dp=2,zero=2",
                               "--global-batch", "8", "--seq-len", "16", "--steps", "1"])
    assert "zero=2 with pp > 1" in line
    assert launched == []


# ---- [3] an existing checkpoint without --resume -------------------------------------------------
def fake_checkpoint(d: Path, step: int = 6, model: str = "tiny-llama") -> Path:
    from meshplan.spec.base import to_dict
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"schema_version": 1, "model": to_dict(load_model(model)),
                                             "plan": "dp=2,zero=3", "step": step, "path": f"step-{step:08d}"}))
    for s in (3, step):
        (d / f"step-{s:08d}").mkdir()
        (d / f"step-{s:08d}" / "__0_0.distcp").write_text("x")
    (d / "notes.txt").write_text("mine")
    return d


def test_an_existing_checkpoint_is_not_overwritten_without_resume(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path, launched: list) -> None:
    ck = fake_checkpoint(tmp_path / "ck")
    before = sorted(p.name for p in ck.iterdir())
    line = error_line(capsys, [*TINY, "--plan", "dp=2", "--checkpoint-dir", str(ck)])
    assert f"--checkpoint-dir {ck} already holds a checkpoint at step 6 of tiny-llama" in line
    assert "--resume" in line and "new --checkpoint-dir" in line and "--overwrite" in line
    assert sorted(p.name for p in ck.iterdir()) == before and launched == []
    # folders of an unfinished first save (no meta.json) are a checkpoint too
    half = tmp_path / "half"
    (half / "step-00000002").mkdir(parents=True)
    line = error_line(capsys, [*TINY, "--plan", "dp=2", "--checkpoint-dir", str(half)])
    assert "step-00000002" in line and "no meta.json" in line
    # an empty or unrelated directory is fine
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme").write_text("x")
    assert main([*TINY, "--plan", "dp=2", "--checkpoint-dir", str(tmp_path / "empty")]) == 0
    assert len(launched) == 1


def test_overwrite_deletes_the_old_checkpoint_and_nothing_else(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path, launched: list) -> None:
    ck = fake_checkpoint(tmp_path / "ck")
    assert main([*TINY, "--plan", "dp=2", "--checkpoint-dir", str(ck), "--overwrite"]) == 0
    assert sorted(p.name for p in ck.iterdir()) == ["notes.txt"]
    assert "--overwrite: deleted the checkpoint" in capsys.readouterr().err
    assert len(launched) == 1
    argv = launched[0][0]
    assert "--overwrite" not in argv  # the ranks never delete: a torchrun restart resumes
    # refused combinations, nothing deleted
    ck2 = fake_checkpoint(tmp_path / "ck2")
    line = error_line(capsys, [*TINY, "--plan", "dp=2", "--checkpoint-dir", str(ck2), "--overwrite", "--resume",
                               "--steps", "9"])
    assert "--overwrite and --resume" in line and (ck2 / "meta.json").is_file()
    line = error_line(capsys, [*TINY, "--plan", "dp=2", "--overwrite"])
    assert "--overwrite needs --checkpoint-dir" in line


def test_overwrite_of_ingested_models_needs_a_checkpoint_dir(capsys: pytest.CaptureFixture[str],
                                                             launched: list) -> None:
    """Ingested models are checkpointed like presets (issue 12): the same --overwrite rules."""
    line = error_line(capsys, ["train", "--model", f"hf:{HF / 'llama-tiny.json'}", "--plan", "dp=2",
                               "--global-batch", "4", "--steps", "1", "--overwrite"])
    assert "--overwrite needs --checkpoint-dir" in line


def test_checkpoint_contents() -> None:
    assert preflight.checkpoint_contents("/nonexistent/x") is None
    assert preflight.clear_checkpoint_dir(None) == []


# ---- [12] the CPU-corrected memory beside the measurement --------------------------------------------
def test_the_summary_memory_is_the_cpu_corrected_figure() -> None:
    pytest.importorskip("torch")
    from meshplan.runtime.launch import Job, estimate_for, summary_text
    from meshplan.runtime.local import CPU_MEMORY_BASIS
    model, plan = load_model("tiny-llama"), load_plan("dp=2,zero=3,precision=fp32")
    job = Job(model_arg="tiny-llama", plan_arg="", model=model, plan=plan, global_batch=8, seq_len=64, steps=20,
              nproc_per_node=2)
    est = estimate_for(job, "cpu")
    pre = preflight.memory_estimate(model, plan, 8, 64, "cpu")
    assert est["peak_memory_gib"] == pytest.approx(pre.per_process_gib)
    assert est["peak_memory_basis"] == CPU_MEMORY_BASIS
    # the raw figure carries the 1 GiB GPU framework overhead: about 3x the measured 0.31 GiB
    assert est["cost_model_peak_memory_gib"] > 0.9 > 0.5 > est["peak_memory_gib"]
    text = summary_text({"step_time_s": 0.1, "tokens_per_s": 10.0, "peak_memory_gib": 0.31}, est)
    row = next(x for x in text.splitlines() if x.startswith("peak memory/rank"))
    assert row.split()[-1] == f"{pre.per_process_gib:.3f}"
    assert "estimated memory: the pre-flight check's CPU-corrected figure" in text


def test_the_ingested_summary_memory_is_the_cpu_corrected_figure() -> None:
    pytest.importorskip("transformers")
    from meshplan.ingest import ingest
    from meshplan.runtime.launch import Job, estimate_for
    src, plan = f"hf:{HF / 'llama-tiny.json'}", load_plan("dp=2,precision=fp32")
    job = Job(model=src, plan=plan, global_batch=4, steps=1, seq_len=32, nproc_per_node=2)
    g = ingest(src, seq_len=32)
    est = estimate_for(job, "cpu", g)
    pre = preflight.graph_memory_estimate(g, plan, 4, "cpu", preflight.HF_PROCESS_GIB)
    assert est["peak_memory_gib"] == pytest.approx(pre.per_process_gib) and "CPU-corrected" in est["peak_memory_basis"]


# ---- [19] more processes than cores; [13b] the step time before launch --------------------------------
def test_oversubscription_is_a_warning() -> None:
    msg = preflight.oversubscription_warning(64, "cpu", cores=2)
    assert msg is not None and msg.startswith("64 processes on this node's 2 CPU cores") and "slow" in msg
    assert "meaningless" in msg and "\n" not in msg
    assert preflight.oversubscription_warning(2, "cpu", cores=2) is None
    assert preflight.oversubscription_warning(64, "cuda", cores=2) is None


def test_launch_warns_and_estimates_before_starting(capsys: pytest.CaptureFixture[str], launched: list,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "cpu_cores", lambda: 2)
    assert main([*TINY, "--plan", "dp=4,precision=fp32"]) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(launched) == 1
    assert err[0].startswith("meshplan: warning: 4 processes on this node's 2 CPU cores"), err
    assert err[1].startswith("meshplan: note: the cost model estimates ") and " a step, about " in err[1]
    assert "for 3 steps" in err[1] and "indicative only on CPU" in err[1], err
    assert main([*TINY, "--plan", "dp=2,precision=fp32"]) == 0  # as many processes as cores: no warning
    assert "warning" not in capsys.readouterr().err


def test_a_long_run_is_announced(capsys: pytest.CaptureFixture[str], launched: list) -> None:
    """The review's --seq-len 100000 run took over 10 minutes without a word beforehand."""
    assert main(["train", "--model", "tiny-llama", "--plan", "dp=2", "--global-batch", "8", "--seq-len", "100000",
                 "--steps", "3"]) == 0
    note = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("meshplan: note:"))
    assert (" min a step" in note or " h a step" in note), note
    assert "indicative only on CPU" in note


def test_resumed_runs_count_the_steps_left(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          launched: list) -> None:
    ck = fake_checkpoint(tmp_path / "ck", step=6)
    assert main([*TINY[:-1], "8", "--plan", "dp=2", "--checkpoint-dir", str(ck), "--resume"]) == 0
    assert "for 2 steps" in capsys.readouterr().err


def test_step_time_note_and_durations() -> None:
    assert preflight.step_time_note({"error": "x"}, 3) is None
    note = preflight.step_time_note({"step_time_s": 2.0, "basis": "B"}, 1)
    assert note == "the cost model estimates 2.0 s a step (B)"
    assert [preflight.duration_text(s) for s in (0.0123, 3.45, 45, 700, 9000, 2e5)] == \
        ["0.012 s", "3.5 s", "45 s", "12 min", "2.5 h", "2.3 days"]


def test_cpu_rate_is_measured_on_one_thread() -> None:
    torch = pytest.importorskip("torch")
    from meshplan.runtime.local import cpu_tflops
    threads = torch.get_num_threads()
    assert cpu_tflops(0.02) > 0 and torch.get_num_threads() == threads


# ---- [11] FSDP2's view warning ---------------------------------------------------------------------
def test_only_t5s_view_warning_is_filtered() -> None:
    pytest.importorskip("torch")
    from meshplan.runtime.generic import quiet_false_positives

    def warned(cls: str) -> bool:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            quiet_false_positives()
            warnings.warn(f"FSDP2-wrapped module ({cls}) returned a view tensor. An in-place op ...", UserWarning,
                          stacklevel=1)
        return bool(got)
    assert not warned("FSDPT5Block") and not warned("FSDPMT5Block")
    assert warned("FSDPTransformer") and warned("FSDPLlamaDecoderLayer")
