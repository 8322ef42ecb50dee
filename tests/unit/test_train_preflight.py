"""`meshplan train` pre-flight checks and one-line failure reports, without starting any process:
learning rate, --metrics / --checkpoint-dir paths, the memory estimate against what there is,
positions, resuming past --steps, ranks killed by a signal, the label of the CPU estimate, the DDP
deprecation warning; ingested models (hf:/module:) through the same checks, once, in the launcher
(the graph cost model on the traced LayerGraph), and DDP's find_unused_parameters only where a
parameter gets no gradient."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import error_line

from meshplan.errors import MeshplanError
from meshplan.runtime import local, preflight
from meshplan.spec.graph import LayerGraph, LayerSpec
from meshplan.spec.io import load_model, load_plan

TRAIN = ["train", "--model", "tiny-llama", "--global-batch", "8", "--seq-len", "32", "--steps", "2"]



# ---- 1. learning rate -----------------------------------------------------------------------------
@pytest.mark.parametrize("lr", ["-1", "0", "nan", "inf", "-inf", "abc"])
def test_bad_learning_rate_is_one_line(capsys: pytest.CaptureFixture[str], lr: str) -> None:
    line = error_line(capsys, [*TRAIN, "--plan", "dp=2", f"--lr={lr}"])
    assert "--lr" in line and repr(lr) in line


def test_learning_rate_type_and_check() -> None:
    from meshplan.cli.train_cmd import learning_rate
    assert learning_rate("3e-4") == pytest.approx(3e-4)
    for bad in (-1.0, 0.0, math.nan, math.inf, True):
        with pytest.raises(MeshplanError, match="--lr must be a finite number > 0"):
            preflight.check_lr(bad)


def test_check_job_refuses_a_bad_lr_given_programmatically() -> None:
    pytest.importorskip("torch")
    from meshplan.runtime.job import Job, check_job
    job = Job(model_arg="tiny-llama", plan_arg="dp=1", model=load_model("tiny-llama"), plan=load_plan("dp=1"),
              global_batch=8, seq_len=32, steps=1, nproc_per_node=1, lr=-1.0)
    with pytest.raises(MeshplanError, match="--lr"):
        check_job(job)


# ---- 5. output paths --------------------------------------------------------------------------------
def test_metrics_in_a_missing_directory_is_refused_and_nothing_is_created(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "no" / "such" / "m.jsonl"
    line = error_line(capsys, [*TRAIN, "--plan", "dp=2", "--metrics", str(target)])
    assert "does not exist" in line and str(tmp_path / "no" / "such") in line
    assert not (tmp_path / "no").exists()
    line = error_line(capsys, [*TRAIN, "--plan", "dp=2", "--metrics", str(tmp_path)])
    assert "is a directory" in line


def test_output_paths() -> None:
    assert preflight.check_output_file("--metrics", None) is None
    assert preflight.check_output_file("--metrics", "m.jsonl") == "m.jsonl"  # the working directory
    with pytest.raises(MeshplanError, match="/nonexistent does not exist"):
        preflight.check_output_file("--metrics", "/nonexistent/m.jsonl")
    with pytest.raises(MeshplanError, match="does not exist"):
        preflight.check_output_dir("--checkpoint-dir", "/nonexistent/ck")


def test_checkpoint_dir_under_a_missing_directory_is_refused(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    pytest.importorskip("torch")
    line = error_line(capsys, [*TRAIN, "--plan", "dp=1,micro_batch=8", "--checkpoint-dir",
                               str(tmp_path / "missing" / "ck")])
    assert "--checkpoint-dir" in line and "does not exist" in line
    assert not (tmp_path / "missing").exists()


# ---- 2. memory and positions ----------------------------------------------------------------------
@pytest.fixture
def host_24gib(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as the bug report's: 24 GiB of host memory available, whatever is really there."""
    monkeypatch.setattr(preflight, "mem_available_gib", lambda path=preflight.MEMINFO: 24.0)


def test_llama3_8b_on_two_cpu_processes_is_refused_before_launch(
        capsys: pytest.CaptureFixture[str], host_24gib: None) -> None:
    pytest.importorskip("torch")
    line = error_line(capsys, ["train", "--model", "llama3-8b", "--plan", "dp=2", "--global-batch", "2",
                               "--steps", "1"])
    assert "not enough host memory for llama3-8b with dp=2" in line
    assert "per process" in line and "x 2 processes" in line and "24.0 GiB is available (MemAvailable)" in line
    assert "weights, gradients and AdamW states" in line and "activations" in line
    assert "a smaller model" in line and "fewer processes" in line and "zero=3" in line


def test_a_huge_seq_len_is_refused_with_the_length_that_fits(capsys: pytest.CaptureFixture[str],
                                                             host_24gib: None) -> None:
    pytest.importorskip("torch")
    line = error_line(capsys, ["train", "--model", "tiny-llama", "--plan", "micro_batch=8", "--global-batch", "8",
                               "--steps", "1", "--seq-len", "10000000"])
    assert "not enough host memory" in line and "8 x 10000000 tokens" in line
    assert "would fit: --seq-len " in line


def test_memory_estimate_counts_every_process_of_the_node() -> None:
    model, plan = load_model("gpt3-125m"), load_plan("dp=2,micro_batch=4,precision=fp32")
    est = preflight.memory_estimate(model, plan, 8, 2048)
    assert est is not None and est.per_process_gib > 1.0
    assert est.parts["overhead"] == preflight.CPU_PROCESS_GIB
    need = 2 * est.mean_gib
    assert preflight.check_memory(model, plan, 8, 2048, nproc_per_node=2, available_gib=need * 1.01) == est
    with pytest.raises(MeshplanError) as e:
        preflight.check_memory(model, plan, 8, 2048, nproc_per_node=2, available_gib=need * 0.99)
    msg = str(e.value)
    assert "\n" not in msg and "would fit:" in msg and "one process" in msg
    # fp32 activations are twice the cost model's 16-bit ones
    bf16 = preflight.memory_estimate(model, plan.replace(precision="bf16"), 8, 2048)
    assert est.parts["activations"] == pytest.approx(2 * bf16.parts["activations"])


def test_small_runs_pass_and_unpriced_plans_are_left_to_the_runtime() -> None:
    tiny = load_model("tiny-llama")
    assert preflight.check_memory(tiny, load_plan("dp=2,precision=fp32"), 8, 32, nproc_per_node=2,
                                  available_gib=1.0) is not None
    # seq_len not divisible by 2 cp: the cost model does not price it, mesh.check_supported says why
    assert preflight.memory_estimate(tiny, load_plan("cp=2"), 8, 33) is None


def test_gpu_memory_is_per_device() -> None:
    model = load_model("llama3-8b")
    assert preflight.check_memory(model, load_plan("dp=8,zero=3,recompute=full"), 8, 8192, nproc_per_node=8,
                                  device_type="cuda", available_gib=80.0, device_name="NVIDIA H100") is not None
    with pytest.raises(MeshplanError, match="not enough GPU memory for llama3-8b .* NVIDIA H100 has 24.0 GiB"):
        preflight.check_memory(model, load_plan("dp=1"), 8, 8192, nproc_per_node=1, device_type="cuda",
                               available_gib=24.0, device_name="NVIDIA H100")


def test_mem_available_reads_meminfo(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       25165824 kB\nMemFree:  1 kB\nMemAvailable:   24117248 kB\n")
    assert preflight.mem_available_gib(str(f)) == pytest.approx(23.0)
    assert preflight.mem_available_gib(str(tmp_path / "none")) is None


def test_seq_len_beyond_learned_positions(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    line = error_line(capsys, ["train", "--model", "tiny-gpt2", "--plan", "micro_batch=8", "--global-batch", "8",
                               "--steps", "1", "--seq-len", "128"])
    assert "exceeds the 64 positions of tiny-gpt2" in line and "--seq-len <= 64" in line
    preflight.check_seq_len(load_model("tiny-llama"), 10**6)  # rotary: no table to run out of


# ---- 4. resuming past --steps ------------------------------------------------------------------
def fake_checkpoint(d: Path, model_name: str, step: int) -> Path:
    from meshplan.spec.base import to_dict
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"schema_version": 1, "model": to_dict(load_model(model_name)),
                                             "plan": "dp=1", "step": step, "path": f"step-{step:08d}"}))
    return d


def test_resume_with_fewer_steps_than_the_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("torch")
    ck = fake_checkpoint(tmp_path / "ck", "tiny-llama", 10)
    line = error_line(capsys, ["train", "--model", "tiny-llama", "--plan", "micro_batch=8", "--global-batch", "8",
                               "--seq-len", "32", "--steps", "5", "--resume", "--checkpoint-dir", str(ck)])
    assert f"the checkpoint in {ck} is at step 10, --steps 5 asks for fewer" in line
    assert "pass --steps > 10" in line
    from meshplan.runtime.checkpoint import check_resumable
    with pytest.raises(MeshplanError, match="asks for no more"):
        check_resumable(ck, load_model("tiny-llama"), steps=10)
    assert check_resumable(ck, load_model("tiny-llama"), steps=11) == 10


# ---- 3. a rank killed by a signal ------------------------------------------------------------------
def test_failure_messages() -> None:
    pytest.importorskip("torch")
    from meshplan.runtime.launch import failure_message
    killed = [{"rank": 1, "exitcode": -signal.SIGKILL}, {"rank": 0, "exitcode": -signal.SIGTERM}]
    msg = failure_message(killed, 1, "the cost model estimated 361.3 GiB for the 2 processes of this node")
    assert msg.startswith("training failed: rank 1 was killed (SIGKILL; 1 other rank stopped with it), "
                          "most likely out of host memory")
    assert "361.3 GiB" in msg and "\n" not in msg
    assert "crashed (SIGSEGV)" in failure_message([{"rank": 3, "exitcode": -signal.SIGSEGV}], 1)
    assert "terminated from outside (SIGTERM)" in failure_message([{"rank": 0, "exitcode": -signal.SIGTERM}], 1)
    assert "rank 2 exited with code 2" in failure_message([{"rank": 2, "exitcode": 2}], 1)
    # the killed rank is named even when a peer that lost it exited first (code 2), or was SIGTERMed
    lost = [{"rank": 0, "exitcode": 2}, {"rank": 2, "exitcode": -signal.SIGTERM},
            {"rank": 1, "exitcode": -signal.SIGKILL}]
    assert failure_message(lost, 1).startswith("training failed: rank 1 was killed (SIGKILL; 2 other ranks")
    assert "torchrun exit code 1" in failure_message(None, 1)


def test_a_rank_losing_its_peer_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from meshplan.runtime.launch import lost_peer_message
    err = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                       "peer [127.0.0.1]:27544. This is typically caused by a remote worker crashing.")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert lost_peer_message(err) is None  # not a rank: the traceback stays
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    assert lost_peer_message(err) == ("rank 0 stopped: another rank of the job is gone (RuntimeError: "
                                      "Connection closed by peer [127.0.0.1]:27544)")
    assert lost_peer_message(ValueError("a bug")) is None


def test_torchrun_goes_through_the_reporting_wrapper() -> None:
    pytest.importorskip("torch")
    from meshplan.runtime.launch import Job, torchrun_argv
    job = Job(model_arg="tiny-llama", plan_arg="dp=2", model=load_model("tiny-llama"), plan=load_plan("dp=2"),
              global_batch=8, seq_len=32, steps=1, nproc_per_node=2)
    argv = torchrun_argv(job, ["--steps", "1"])
    assert argv[1:3] == ["-m", "meshplan.runtime.launch"] and "--nproc-per-node=2" in argv


# ---- 6. the CPU estimate is labelled --------------------------------------------------------------
def test_cpu_estimate_is_labelled() -> None:
    pytest.importorskip("torch")
    from meshplan.runtime.launch import summary_text
    from meshplan.runtime.local import estimate_basis
    basis = estimate_basis("local-cpu:2")
    assert basis.startswith("cost model for a `local-cpu` device; indicative only on CPU")
    text = summary_text({"step_time_s": 0.1, "tokens_per_s": 10.0, "peak_memory_gib": 0.3},
                        {"cluster": "local-cpu:2", "basis": basis, "step_time_s": 0.3, "tokens_per_s": 3.0,
                         "peak_memory_gib": 1.0})
    assert "indicative only on CPU: gloo and Python overheads are not modelled" in text
    assert "GPU preset" in estimate_basis("h100-sxm-80gb:1x8")


# ---- 7. no DDP deprecation warning ------------------------------------------------------------------
def test_ddp_is_built_without_the_deprecated_argument() -> None:
    torch = pytest.importorskip("torch")
    import inspect

    from meshplan.runtime.parallelize import ddp_no_buffer_sync
    kw = ddp_no_buffer_sync()
    assert list(kw.values()) == [False]
    ddp_params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in ddp_params:
        assert kw == {"forward_sync_buffers": False}


# ---- data for sequences longer than the corpus ------------------------------------------------------
def test_corpus_batches_longer_than_the_corpus() -> None:
    pytest.importorskip("torch")
    from meshplan.runtime.data import CORPUS_BYTES, global_batch
    rows = global_batch(0, batch=2, seq_len=CORPUS_BYTES + 10, vocab=256)
    assert tuple(rows.shape) == (2, CORPUS_BYTES + 11)


def test_preflight_does_not_import_torch() -> None:
    code = ("import sys, meshplan.runtime.preflight as p; from meshplan.spec.io import load_model, load_plan; "
            "p.memory_estimate(load_model('tiny-llama'), load_plan('dp=2'), 8, 32); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- 8. ingested models: the same pre-flight, on the traced LayerGraph ------------------------------
ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "data" / "hf"


def toy_graph(seq: int, hidden: int = 512, vocab: int = 32000, blocks: int = 4) -> LayerGraph:
    """A transformer-like LayerGraph traced at ``seq`` tokens (fp32): what ingest returns, without torch."""
    def layer(name: str, kind: str, params: int, saved: float, out: float) -> LayerSpec:
        return LayerSpec(name=name, kind=kind, block=kind, params=params, fwd_flops=2.0 * seq * params,
                         bwd_flops=4.0 * seq * params, saved_bytes=saved, output_bytes=out,
                         extra={"gemm_dim": float(hidden)})
    h = 4.0 * seq * hidden
    return LayerGraph(name="toy", source="module:toy:make", sample_tokens=seq, layers=(
        layer("embed", "embedding", vocab * hidden, 0.0, h),
        *(layer(f"layers.{i}", "block", 12 * hidden * hidden, 16 * h, h) for i in range(blocks)),
        layer("head", "head", vocab * hidden, h, 4.0 * seq * vocab)))


def test_graph_memory_estimate_is_the_graph_cost_model_with_the_cpu_corrections() -> None:
    from meshplan.cost import estimate
    from meshplan.spec.plan import Workload
    g, plan = toy_graph(2048), load_plan("dp=2,micro_batch=2,precision=fp32")
    est = preflight.graph_memory_estimate(g, plan, 8, "cpu", preflight.HF_PROCESS_GIB)
    r = estimate(g, local.cpu_cluster(2), plan, Workload(global_batch=8, seq_len=g.sample_tokens))
    assert est is not None and est.parts["overhead"] == preflight.HF_PROCESS_GIB
    # activations as the graph model counts them (already 4-byte for fp32: no x 2 as for presets)
    assert est.parts["activations"] == pytest.approx(r.memory["activations"])
    # on CPU: no caching allocator, CUDA context or NCCL (the 'allocator' and 'outside' parts)
    assert est.per_process_gib == pytest.approx(r.peak_memory_gib - r.memory["overhead"] - r.memory["allocator"]
                                                - r.memory["outside"] + preflight.HF_PROCESS_GIB)
    bf16 = preflight.graph_memory_estimate(g, plan.replace(precision="bf16"), 8)
    assert bf16.parts["activations"] == pytest.approx(est.parts["activations"] / 2)
    # offload is a no-op on CPU: estimated as the plan without it
    off = preflight.graph_memory_estimate(g, plan.replace(zero=3, offload_params=True), 8)
    assert off == preflight.graph_memory_estimate(g, plan.replace(zero=3), 8)
    assert preflight.graph_memory_estimate(g, load_plan("cp=2"), 8) is None  # not priced: the runtime refuses


def test_graph_memory_counts_every_process_and_offers_a_shorter_sequence() -> None:
    g, plan = toy_graph(8192), load_plan("dp=2,precision=fp32")
    est = preflight.graph_memory_estimate(g, plan, 4)
    need = 2 * est.mean_gib
    traced: list[int] = []

    def retrace(s: int) -> LayerGraph:
        traced.append(s)
        return toy_graph(s)
    kw = {"nproc_per_node": 2, "seq_len": 8192, "retrace": retrace}
    assert preflight.check_graph_memory(g, plan, 4, available_gib=need * 1.01, **kw) == est
    assert traced == []  # a run that fits is never traced again
    with pytest.raises(MeshplanError) as e:
        preflight.check_graph_memory(g, plan, 4, available_gib=need * 0.6, name="llama-tiny", **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("not enough host memory for llama-tiny with dp=2")
    assert "x 2 processes" in msg and "a micro-batch of 1 x 8192 tokens" in msg
    fits = next(s for s in (4096, 2048, 1024, 512)  # the longest power-of-two length that fits
                if 2 * preflight.graph_memory_estimate(toy_graph(s), plan, 4).mean_gib <= need * 0.6)
    assert "would fit: " in msg and f"--seq-len {fits} " in msg and "one process" in msg
    assert traced[0] == 4096 and len(traced) <= 6  # the longest shorter length first, then bisection
    traced.clear()
    with pytest.raises(MeshplanError) as e:
        preflight.check_graph_memory(g, plan, 4, available_gib=sum(
            2 * preflight.graph_memory_estimate(toy_graph(s), plan, 4).mean_gib for s in (512, 1024)) / 2, **kw)
    assert "--seq-len 512 " in str(e.value) and 2 < len(traced) <= 6, traced
    # no sequence (images, a module: source without --seq-len): no --seq-len to offer
    with pytest.raises(MeshplanError) as e:
        preflight.check_graph_memory(g, plan, 4, nproc_per_node=2, available_gib=0.01)
    assert "--seq-len" not in str(e.value) and "a micro-batch of 1 sample" in str(e.value)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list:
    """Nothing may start: the launcher's torchrun and the in-process worker fail the test if called."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from meshplan.runtime import launch
    calls: list = []

    def refuse(*a: object, **k: object) -> int:
        calls.append(a)
        raise AssertionError("a process was started")
    monkeypatch.setattr(launch, "run_torchrun", refuse)
    monkeypatch.setattr(launch, "worker_main", refuse)
    return calls


def test_ingested_dp_only_bad_seq_len_is_refused_once_before_launch(
        capsys: pytest.CaptureFixture[str], no_launch: list) -> None:
    """dp-only plans used to skip the launcher's build: each rank said it. Now the launcher does."""
    line = error_line(capsys, ["train", "--model", f"hf:{HF / 'gpt2-tiny.json'}", "--plan", "dp=2",
                               "--global-batch", "4", "--steps", "1", "--seq-len", "256"])
    assert "seq_len 256 exceeds the model's 128 positions (n_positions)" in line and "--seq-len <= 128" in line
    assert no_launch == []


def test_ingested_bad_config_is_refused_before_launch(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                      no_launch: list) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
                               "num_attention_heads": 7, "vocab_size": 1000}))
    line = error_line(capsys, ["train", "--model", f"hf:{bad}", "--plan", "dp=2", "--global-batch", "4",
                               "--steps", "1"])
    assert str(bad) in line or "config" in line
    assert no_launch == []


def test_ingested_run_that_cannot_fit_is_refused_before_launch(
        capsys: pytest.CaptureFixture[str], host_24gib: None, no_launch: list) -> None:
    line = error_line(capsys, ["train", "--model", f"hf:{HF / 'llama-tiny.json'}", "--plan", "dp=2",
                               "--global-batch", "2", "--steps", "1", "--seq-len", "10000000"])
    assert "not enough host memory for llama-tiny with dp=2" in line and "x 2 processes" in line
    assert "a micro-batch of 1 x 10000000 tokens" in line and "24.0 GiB is available (MemAvailable)" in line
    assert "would fit: --seq-len " in line
    assert no_launch == []


def test_ingested_check_job(monkeypatch: pytest.MonkeyPatch, host_24gib: None) -> None:
    """Programmatic jobs get the lr check; a run that fits returns the estimate (hf: an idle rank
    with transformers imported)."""
    pytest.importorskip("transformers")
    from meshplan.runtime.job import Job, check_job
    job = Job(model=f"hf:{HF / 'llama-tiny.json'}", plan=load_plan("dp=2,precision=fp32"),
              global_batch=4, steps=1, seq_len=32, nproc_per_node=2)
    est = check_job(job)
    assert est is not None and est.parts["overhead"] == preflight.HF_PROCESS_GIB
    assert 0.35 < est.per_process_gib < 1.0
    with pytest.raises(MeshplanError, match="--lr"):
        check_job(Job(**{**job.__dict__, "lr": math.inf}))


UNUSED_MODULES = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, spare: bool, value_read: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 8) if spare else None  # built, never called
        self.value_read = value_read

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        if self.value_read and x.sum().item() > 0:  # a value read: not traceable on the meta device
            x = x * 1.0
        return self.head(x)


def example_inputs(batch_size, seq_len):
    return torch.randn(batch_size, 8)


def plain():
    return Net(spare=False)


def with_spare():
    return Net(spare=True)


def reads_values():
    return Net(spare=False, value_read=True)
'''


@pytest.fixture
def nets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pytest.importorskip("torch")
    name = "preflight_nets"
    (tmp_path / f"{name}.py").write_text(UNUSED_MODULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_ddp_looks_for_unused_parameters_only_where_there_are_some(nets: str) -> None:
    """find_unused_parameters=True made DDP walk the graph every step and warn that it found
    nothing; it is now set from the meta-device trace."""
    from meshplan.ingest import build
    from meshplan.runtime.generic import unused_parameters
    assert unused_parameters(build(f"module:{nets}:plain", device="cpu")) is None
    why = unused_parameters(build(f"module:{nets}:with_spare", device="cpu"))
    assert why is not None and why.startswith("spare.weight and 1 more get no gradient")
    why = unused_parameters(build(f"module:{nets}:reads_values", device="cpu"))
    assert why is not None and "unknown" in why  # not traceable: the safe setting


def test_ddp_unused_parameters_of_hf_models() -> None:
    pytest.importorskip("transformers")
    import torch

    from meshplan.ingest import build
    from meshplan.runtime.generic import unused_parameters
    state = torch.random.get_rng_state()
    for name in ("llama-tiny", "vit-tiny", "bert-tiny"):
        assert unused_parameters(build(f"hf:{HF / (name + '.json')}", device="meta", seq_len=16)) is None, name
    assert torch.equal(state, torch.random.get_rng_state())  # the trace leaves the global RNG alone


def test_untraceable_model_is_launched_without_a_memory_check(nets: str, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from meshplan.runtime.job import Job, check_job
    job = Job(model=f"module:{nets}:reads_values", plan=load_plan("dp=2,precision=fp32"),
              global_batch=4, steps=1, seq_len=None, nproc_per_node=2)
    assert check_job(job) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshplan: warning: no memory check before launch: cannot trace"), err
