"""`meshplan train`: start torchrun (or run inside it), train, checkpoint, measure, compare.

``launch`` runs ``python -m torch.distributed.run ... -m meshplan.cli.train_cmd ARGS`` with the
same arguments; inside torchrun ``worker_main`` trains on every rank. A one-process plan runs
in the calling process (no torchrun, no process group).
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

log = logging.getLogger(__name__)

CPU_MEMORY_BANDWIDTH_GBPS = 20.0
"""Assumed DRAM bandwidth of the local CPU 'device' (one socket, a few channels); order of magnitude."""
LOOPBACK_GBPS = 2.0
"""Assumed gloo-over-loopback bandwidth between local processes, GB/s; order of magnitude."""
CUDA_PRESETS = (("H200", "h200-sxm-141gb"), ("H100", "h100-sxm-80gb"), ("A100-SXM4-40GB", "a100-sxm-40gb"),
                ("A100", "a100-sxm-80gb"), ("B200", "b200-sxm-192gb"), ("L40S", "l40s-48gb"),
                ("V100", "v100-sxm-32gb"))
"""CUDA device-name fragments -> GPU presets for the estimate printed beside the measurement."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything `meshplan train` was asked to do."""

    model_arg: str
    plan_arg: str
    model: ModelSpec
    plan: Plan
    global_batch: int
    seq_len: int
    steps: int
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    metrics: str | None = None
    lr: float = 1e-3
    seed: int = 0
    data: str = "corpus"
    pg_timeout_s: float = 300.0
    extra_argv: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def check_job(job: Job) -> None:
    """Bad input, caught before anything starts: one-line MeshplanErrors."""
    from meshplan.runtime import mesh as mesh_mod  # imports torch; only reached by `train`
    mesh_mod.check_supported(job.model, job.plan, job.world_size, job.seq_len)
    if job.seq_len > (job.model.max_position_embeddings or job.seq_len) and job.model.position == "learned":
        raise MeshplanError(f"--seq-len {job.seq_len} exceeds the model's "
                            f"{job.model.max_position_embeddings} positions")
    from meshplan.runtime.train import RunConfig, microbatches
    microbatches(RunConfig(model=job.model, plan=job.plan, global_batch=job.global_batch,
                           seq_len=job.seq_len, steps=job.steps))
    if job.resume:
        if not job.checkpoint_dir:
            raise MeshplanError("--resume needs --checkpoint-dir")
        from meshplan.runtime.checkpoint import check_resumable
        check_resumable(job.checkpoint_dir, job.model)
    if job.checkpoint_every and not job.checkpoint_dir:
        raise MeshplanError("--checkpoint-every needs --checkpoint-dir")


def torchrun_argv(job: Job, worker_argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={job.nproc_per_node}",
           f"--nnodes={job.nnodes}", f"--max-restarts={job.max_restarts}"]
    if job.nnodes == 1 and not job.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={job.rdzv_endpoint}", f"--node-rank={job.node_rank}"]
    return cmd + ["-m", "meshplan.cli.train_cmd"] + worker_argv


def launch(job: Job, worker_argv: list[str]) -> int:
    """Run the job: in this process for one process, else under torchrun. Returns an exit code."""
    check_job(job)
    if job.world_size == 1:
        return worker_main(job)
    return run_torchrun(torchrun_argv(job, worker_argv), job.pg_timeout_s)


def run_torchrun(argv: list[str], pg_timeout_s: float) -> int:
    """Run a torchrun command line (one thread per process, the process-group timeout passed on);
    a failure raises. Shared by this runtime and runtime.generic."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MESHPLAN_PG_TIMEOUT"] = str(pg_timeout_s)
    rc = subprocess.call(argv, env=env)
    if rc != 0:
        raise MeshplanError(f"training failed (torchrun exit code {rc}); see the rank errors above")
    return 0


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


# ---- inside a rank ---------------------------------------------------------------------------
def local_cluster(nproc: int, device_type: str) -> Any:
    """A ClusterSpec of this machine for the cost model: a GPU preset on CUDA, a measured CPU
    'GPU' (one process = one device) otherwise."""
    from meshplan.spec.cluster import ClusterSpec, GPUSpec, default_links
    from meshplan.spec.io import parse_cluster_shorthand
    if device_type == "cuda":
        import torch
        name = torch.cuda.get_device_name()
        for frag, preset in CUDA_PRESETS:
            if frag in name:
                return parse_cluster_shorthand(f"{preset}:1x{nproc}")
    flops = cpu_tflops()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = GPUSpec(name="local-cpu", vendor_name="this machine's CPU, one core per process",
                  peak_tflops={"fp32": flops, "bf16": flops, "fp16": flops}, memory_gib=mem,
                  hbm_bandwidth_gbps=CPU_MEMORY_BANDWIDTH_GBPS, intra_node_bandwidth_gbps=LOOPBACK_GBPS,
                  intra_node_link="pcie", default_nic_gbps=LOOPBACK_GBPS, gemm_efficiency=1.0,
                  source="measured fp32 matmul rate of one thread")
    intra, inter = default_links(gpu)
    return ClusterSpec(name=f"local-cpu:{nproc}", gpu=gpu, num_nodes=1, gpus_per_node=nproc,
                       intra_node=intra, inter_node=inter)


def cpu_tflops(seconds: float = 0.2) -> float:
    """fp32 matmul TFLOP/s of one thread (256x256), measured for ``seconds``."""
    import torch
    a = torch.randn(256, 256)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        n += 1
    return 2 * 256**3 * n / (time.perf_counter() - t0) / 1e12


def estimate_for(job: Job, device_type: str) -> dict[str, Any]:
    from meshplan.cost import estimate
    try:
        cluster = local_cluster(job.world_size, device_type)
        r = estimate(job.model, cluster, job.plan, Workload(global_batch=job.global_batch, seq_len=job.seq_len))
    except MeshplanError as e:
        return {"error": str(e)}
    return {"cluster": cluster.name, "step_time_s": r.step_time_s, "peak_memory_gib": r.peak_memory_gib,
            "tokens_per_s": r.tokens_per_s}


def _write(path: str | None, record: dict[str, Any]) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def summary_text(measured: dict[str, Any], est: dict[str, Any]) -> str:
    lines = ["", f"{'':24}{'measured':>14}{'estimated':>14}"]
    if "error" in est:
        lines.append(f"estimate unavailable: {est['error']}")
        est = {}
    for key, label, fmt in (("step_time_s", "step time (s)", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                            ("peak_memory_gib", "peak memory/rank (GiB)", "{:.3f}")):
        m, e = measured.get(key), est.get(key)
        lines.append(f"{label:24}{fmt.format(m) if m is not None else '-':>14}"
                     f"{fmt.format(e) if e is not None else '-':>14}")
    if est.get("cluster"):
        lines.append(f"(estimate on cluster {est['cluster']}; measured step time: median after the first step;"
                     f" CPU memory is the process's peak RSS)")
    return "\n".join(lines)


def measured_summary(records: list[Any], tokens: int) -> dict[str, Any]:
    """Median step time (the first step left out when there are others), tokens/s and peak memory
    over a run's StepRecords; empty without records."""
    times = [r.step_time_s for r in records[1:]] or [r.step_time_s for r in records]
    if not times:
        return {}
    st = statistics.median(times)
    return {"step_time_s": st, "tokens_per_s": tokens / st, "peak_memory_gib": max(r.peak_memory_gib for r in records)}


def run_step(trainer: Any, job: Job, rank0: bool) -> Any:
    """One step of `meshplan train` on this rank: fault hook, timed step, log line and metrics
    record (rank 0), checkpoint when due. Returns the StepRecord."""
    from meshplan.runtime import checkpoint as ckpt
    from meshplan.runtime.train import maybe_fail, timed_step
    maybe_fail(trainer.step)
    rec = timed_step(trainer)
    if rank0:
        print(f"step {rec.step:>5}/{job.steps}  loss {rec.loss:.6f}  {rec.step_time_s:.4f} s  "
              f"{rec.tokens_per_s:,.0f} tok/s  {rec.peak_memory_gib:.3f} GiB", file=sys.stderr, flush=True)
        _write(job.metrics, rec.to_dict())
    if job.checkpoint_dir and job.checkpoint_every and trainer.step % job.checkpoint_every == 0:
        ckpt.save(trainer, job.checkpoint_dir)
    return rec


def worker_main(job: Job) -> int:
    """Train on this rank (or alone): resume if asked (or after a restart), log, checkpoint."""
    import torch
    import torch.distributed as dist

    from meshplan.runtime import checkpoint as ckpt
    from meshplan.runtime.mesh import build_mesh, check_supported
    from meshplan.runtime.train import RunConfig, Trainer, init_distributed
    if in_torchrun():
        device = init_distributed(float(os.environ.get("MESHPLAN_PG_TIMEOUT", job.pg_timeout_s)))
        check_supported(job.model, job.plan, dist.get_world_size(), job.seq_len)
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    mesh = build_mesh(job.plan, device.type) if dist.is_initialized() and dist.get_world_size() > 1 else None
    cfg = RunConfig(model=job.model, plan=job.plan, global_batch=job.global_batch, seq_len=job.seq_len,
                    steps=job.steps, lr=job.lr, seed=job.seed, data=job.data)
    trainer = Trainer(cfg, mesh, device)
    if rank0:  # plan fields this hardware cannot honour: said once, and kept with the metrics
        for note in trainer.par.notes:
            print(f"meshplan: warning: {note}", file=sys.stderr, flush=True)
            _write(job.metrics, {"kind": "warning", "message": note})
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if job.checkpoint_dir and (job.resume or (restarted and ckpt.read_meta(job.checkpoint_dir))):
        ckpt.load(trainer, job.checkpoint_dir)
        if rank0:
            print(f"meshplan: resumed from {job.checkpoint_dir} at step {trainer.step}", file=sys.stderr, flush=True)
    records = []
    while trainer.step < job.steps:
        records.append(run_step(trainer, job, rank0))
    if job.checkpoint_dir and not (job.checkpoint_every and trainer.step % job.checkpoint_every == 0):
        if not records and ckpt.read_meta(job.checkpoint_dir):
            pass  # nothing new to save
        else:
            ckpt.save(trainer, job.checkpoint_dir)
    measured = measured_summary(records, job.global_batch * job.seq_len)
    if rank0:
        est = estimate_for(job, device.type)
        print(summary_text(measured, est), flush=True)
        _write(job.metrics, {"kind": "summary", "plan": job.plan.short(), "model": job.model.name,
                             "world_size": job.world_size, "measured": measured, "estimate": est,
                             "warnings": trainer.par.notes})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def metrics_path(path: str | None) -> str | None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    return path
