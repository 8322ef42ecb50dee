"""Pre-flight checks of `meshplan train`: requests that cannot run, refused in one line before any
process starts (a bad learning rate, an output path in a missing directory, a sequence longer than
the model's positions, a run that would not fit in memory).

No torch here (the CLI imports this module before it launches anything); the cost model is numpy.

Memory. The estimate is meshplan's own cost model (``meshplan.cost.estimate``) for the plan, per
process: weights, gradients and AdamW states (16 bytes per parameter held, in fp32 or the mixed-
precision equivalent, sharded by ZeRO), the activations of a micro-batch at that sequence length,
and the transients (logits at the loss, FSDP's gathered layers, DDP buckets). Two corrections for
what this runtime does differently from the GPU training the cost model was fitted on:

- precision=fp32: activations are 4-byte, the cost model counts 16-bit ones (x 2);
- on CPU, the cost model's framework overhead (CUDA context, NCCL buffers: 1 GiB) is replaced by
  the host memory of one idle rank (``CPU_PROCESS_GIB``); offload flags are no-ops (host memory
  is the device memory) and fp8 runs as bf16, so the estimate is of the plan without them.

On CPU all the ranks of a node share its memory: the need is the sum over this node's processes,
compared with ``MemAvailable`` of /proc/meminfo. On GPUs each rank's estimate is compared with its
device's memory. Checked against measurements on this runtime (CPU, fp32, peak RSS): tiny-llama at
32k tokens 0.82 GiB measured vs 0.64 estimated; GPT-3 125M, micro-batch 4 x 512: 4.3 vs 4.8. It
is an order-of-magnitude guard: only runs the estimate puts above what is there are refused.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

CPU_PROCESS_GIB = 0.25
"""Host memory of one rank before training (Python, torch, torch.distributed, meshplan): peak RSS
0.22-0.31 GiB measured on torch 2.13 / Linux. Replaces the cost model's GPU framework overhead."""
FP32_ACTIVATION_SCALE = 2.0
"""fp32 activations over the cost model's 16-bit ones."""
MEMINFO = "/proc/meminfo"
GiB = 2.0**30


# ---- arguments -----------------------------------------------------------------------------------
def check_lr(lr: float) -> float:
    """A learning rate AdamW can use: finite and > 0, or a one-line MeshplanError."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise MeshplanError(f"--lr must be a finite number > 0, got {lr!r}", hint="e.g. --lr 1e-3")
    return float(lr)


def learning_rate(text: str) -> float:
    """argparse type of --lr: a float, finite and > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lr must be a number, got {text!r}") from None
    try:
        return check_lr(value)
    except MeshplanError as e:
        raise argparse.ArgumentTypeError(f"--lr must be a finite number > 0, got {text!r}") from e


def check_output_file(flag: str, path: str | None) -> str | None:
    """A file to write (--metrics): its directory must exist (nothing is created but the file) and
    the path must not be a directory. Returns the path."""
    if not path:
        return path
    p = Path(path).expanduser()
    if p.is_dir():
        raise MeshplanError(f"{flag} {path} is a directory", hint=f"give a file, e.g. {flag} {p / 'metrics.jsonl'}")
    parent = p.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise MeshplanError(f"{flag} {path}: the directory {parent} {what}",
                            hint=f"create it first, or give a {flag} path in an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MeshplanError(f"{flag} {path}: the directory {parent} is not writable",
                            hint=f"give a {flag} path in a directory you can write")
    return path


def check_output_dir(flag: str, path: str | None) -> str | None:
    """A directory to create or reuse (--checkpoint-dir): it, or its parent, must exist (no
    mkdir -p of arbitrary paths)."""
    if not path:
        return path
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise MeshplanError(f"{flag} {path} is a file, not a directory", hint=f"give a directory to {flag}")
    if not p.exists() and not p.parent.is_dir():
        raise MeshplanError(f"{flag} {path}: the directory {p.parent} does not exist",
                            hint=f"create it first, or give a {flag} in an existing directory")
    return path


def check_seq_len(model: ModelSpec, seq_len: int) -> None:
    """The sequence against the model's maximum positions, where it has one (a learned position
    table: GPT-2/GPT-3 presets). Rotary models have no table to run out of."""
    limit = model.max_position_embeddings
    if model.position == "learned" and limit and seq_len > limit:
        raise MeshplanError(f"--seq-len {seq_len} exceeds the {limit} positions of {model.name} "
                            "(learned position table)", hint=f"use --seq-len <= {limit}")


# ---- memory ------------------------------------------------------------------------------------
def mem_available_gib(path: str = MEMINFO) -> float | None:
    """MemAvailable of /proc/meminfo in GiB, None where there is none (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_cluster(nproc: int, tflops: float = 1.0, memory_gib: float | None = None) -> Any:
    """A ClusterSpec of this machine's CPU as ``nproc`` 'GPUs' (one process each) for the cost
    model: fp32 matmul rate ``tflops`` (memory estimates do not depend on it), host memory."""
    from meshplan.spec.cluster import ClusterSpec, GPUSpec, default_links
    from meshplan.runtime.launch import CPU_MEMORY_BANDWIDTH_GBPS, LOOPBACK_GBPS
    if memory_gib is None:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    gpu = GPUSpec(name="local-cpu", vendor_name="this machine's CPU, one core per process",
                  peak_tflops={"fp32": tflops, "bf16": tflops, "fp16": tflops}, memory_gib=memory_gib,
                  hbm_bandwidth_gbps=CPU_MEMORY_BANDWIDTH_GBPS, intra_node_bandwidth_gbps=LOOPBACK_GBPS,
                  intra_node_link="pcie", default_nic_gbps=LOOPBACK_GBPS, gemm_efficiency=1.0,
                  source="measured fp32 matmul rate of one thread")
    intra, inter = default_links(gpu)
    return ClusterSpec(name=f"local-cpu:{nproc}", gpu=gpu, num_nodes=1, gpus_per_node=nproc,
                       intra_node=intra, inter_node=inter)


@dataclass(frozen=True)
class MemoryEstimate:
    """The cost model's memory per process of one run on this runtime, GiB."""

    per_process_gib: float
    """The fullest rank (the first pipeline stage, usually)."""
    mean_gib: float
    """The mean over pipeline stages (every stage has as many ranks)."""
    parts: dict[str, float] = field(default_factory=dict)
    """The fullest rank by part: weights, grads, optimizer, activations, transient, overhead."""


def memory_estimate(model: ModelSpec, plan: Plan, global_batch: int, seq_len: int,
                    device_type: str = "cpu") -> MemoryEstimate | None:
    """Memory per process of ``plan`` on this runtime (see the module docstring); None when the
    cost model does not price the plan (the runtime's own checks speak for it)."""
    from meshplan.cost import estimate
    run_plan = plan
    if device_type != "cuda":  # offload: no-op on CPU; fp8: bf16 on CPU (parallelize.hardware_notes)
        run_plan = plan.replace(offload_optimizer=False, offload_params=False,
                                precision="bf16" if plan.precision == "fp8" else plan.precision)
    try:
        r = estimate(model, cpu_cluster(plan.num_gpus), run_plan, Workload(global_batch=global_batch, seq_len=seq_len))
    except (MeshplanError, ValueError, ZeroDivisionError, OverflowError):
        return None
    parts = {k: v for k, v in r.memory.items() if k != "total"}
    extra = 0.0
    if run_plan.precision == "fp32":
        extra += (FP32_ACTIVATION_SCALE - 1.0) * parts.get("activations", 0.0)
        parts["activations"] = parts.get("activations", 0.0) * FP32_ACTIVATION_SCALE
    if device_type != "cuda":
        extra += CPU_PROCESS_GIB - parts.get("overhead", 0.0)
        parts["overhead"] = CPU_PROCESS_GIB
    stages = r.memory_per_stage or [r.peak_memory_gib]
    peak = r.peak_memory_gib + extra
    mean = sum(stages) / len(stages) + extra
    if not all(math.isfinite(x) for x in (peak, mean)):
        return None
    return MemoryEstimate(per_process_gib=peak, mean_gib=min(mean, peak), parts=parts)


def _fmt(gib: float) -> str:
    if gib >= 1e6:
        return f"{gib:.2e} GiB"
    return f"{gib:,.1f} GiB" if gib >= 10 else f"{gib:.2f} GiB"


def _node_need(est: MemoryEstimate, nproc_per_node: int, nnodes: int, device_type: str) -> float:
    """GiB the fullest node needs (CPU: its processes share host memory) or the fullest rank (GPU)."""
    if device_type == "cuda":
        return est.per_process_gib
    # one node holds every stage's ranks alike: the mean; over several, assume the fullest stage
    return (est.mean_gib if nnodes == 1 else est.per_process_gib) * nproc_per_node


def _seq_options(seq_len: int, cp: int) -> list[int]:
    """Shorter sequence lengths to try, longest first: the powers of two below ``seq_len`` down to
    16 (or 2 cp: context parallelism cuts a sequence into 2 cp chunks)."""
    out, s = [], 1 << max(0, (seq_len - 1).bit_length() - 1)
    while s >= max(16, 2 * cp):
        out.append(s)
        s //= 2
    return out


def _plan_text(plan: Plan) -> str:
    """plan.short() without its one-valued defaults: 'dp=2,zero=3', or 'one process'."""
    keep = [kv for kv in plan.short().split(",") if kv not in ("tp=1", "pp=1", "dp=1", "micro_batch=1")]
    return ",".join(keep) if keep else "one process"


def fit_options(model: ModelSpec, plan: Plan, global_batch: int, seq_len: int, nproc_per_node: int,
                nnodes: int, device_type: str, available_gib: float) -> list[tuple[str, float, bool]]:
    """(change, estimated need in GiB, fits) for single changes that shrink the need: zero=3,
    full recomputation, micro_batch=1, a shorter --seq-len (the longest that fits), one process
    (CPU: ranks share host memory)."""
    def need(change: Any, s: int = seq_len, nproc: int = nproc_per_node, nodes: int = nnodes) -> float | None:
        try:
            p = change() if callable(change) else change
        except MeshplanError:  # the change makes no valid plan
            return None
        e = memory_estimate(model, p, global_batch, s, device_type)
        return None if e is None else _node_need(e, nproc, nodes, device_type)

    out: list[tuple[str, float, bool]] = []

    def add(label: str, gib: float | None) -> None:
        if gib is not None:
            out.append((label, gib, gib <= available_gib))

    ndp = plan.dp * plan.cp
    if ndp > 1 and plan.zero < 3:
        add("zero=3", need(lambda: plan.replace(zero=3)))
    if plan.recompute != "full":
        add("recompute=full", need(lambda: plan.replace(recompute="full", recompute_layers=None)))
    if plan.micro_batch > 1:
        add("micro_batch=1", need(lambda: plan.replace(micro_batch=1)))
    shorter = [(s, need(plan, s)) for s in _seq_options(seq_len, plan.cp)]
    fitting = [(s, g) for s, g in shorter if g is not None and g <= available_gib]
    if fitting:
        add(f"--seq-len {fitting[0][0]}", fitting[0][1])
    elif shorter and shorter[-1][1] is not None:
        add(f"--seq-len {shorter[-1][0]}", shorter[-1][1])
    if device_type != "cuda" and plan.num_gpus > 1:
        def one() -> Plan:
            return Plan(micro_batch=plan.micro_batch, precision=plan.precision, recompute=plan.recompute,
                        recompute_layers=plan.recompute_layers, flash_attention=plan.flash_attention,
                        fused_loss=plan.fused_loss, compile=plan.compile)
        add("one process", need(one, nproc=1, nodes=1))
    return out


def state_gib(model: ModelSpec) -> float:
    """fp32 weights, gradients and AdamW m, v of the whole model (16 bytes per parameter), GiB."""
    return 16.0 * model.num_params() / GiB


def check_memory(model: ModelSpec, plan: Plan, global_batch: int, seq_len: int, *, nproc_per_node: int,
                 nnodes: int = 1, device_type: str = "cpu", available_gib: float | None = None,
                 device_name: str = "") -> MemoryEstimate | None:
    """Refuse (one line) a run whose estimated memory exceeds what there is: host memory on CPU
    (``available_gib``, default MemAvailable; every process of the node counted), the device's
    memory on GPUs (``available_gib`` must be given). Returns the estimate (None: not priced, or
    nothing known of the memory available)."""
    est = memory_estimate(model, plan, global_batch, seq_len, device_type)
    if device_type != "cuda" and available_gib is None:
        available_gib = mem_available_gib()
    if est is None or available_gib is None:
        return est
    need = _node_need(est, nproc_per_node, nnodes, device_type)
    if need <= available_gib:
        return est
    p = est.parts
    states = p.get("weights", 0) + p.get("grads", 0) + p.get("optimizer", 0)
    what = (f"weights, gradients and AdamW states {_fmt(states)}"
            f", activations {_fmt(p.get('activations', 0))} for a micro-batch of {plan.micro_batch} x {seq_len} tokens"
            f", transients {_fmt(p.get('transient', 0))}")
    subject = f"{model.name} with {_plan_text(plan)}"
    if device_type == "cuda":
        head = (f"not enough GPU memory for {subject}: the cost model estimates {_fmt(need)} per GPU ({what}), "
                f"but {device_name or 'the GPU'} has {_fmt(available_gib)}")
    else:
        per = est.mean_gib if nnodes == 1 else est.per_process_gib
        procs = (f" x {nproc_per_node} processes sharing this machine's memory = {_fmt(need)}"
                 if nproc_per_node > 1 else "")
        head = (f"not enough host memory for {subject}: the cost model estimates {_fmt(per)} per process "
                f"({what}){procs}, but {_fmt(available_gib)} is available (MemAvailable)")
    options = fit_options(model, plan, global_batch, seq_len, nproc_per_node, nnodes, device_type, available_gib)
    fits = [f"{label} ({_fmt(g)})" for label, g, ok in options if ok]
    whole = state_gib(model)
    if fits:
        hint = "would fit: " + ", ".join(fits)
    else:
        tried = ", ".join(f"{label} {_fmt(g)}" for label, g, _ in options)
        hint = "a smaller model"
        if whole > available_gib:
            hint += f" ({model.name}'s fp32 weights, gradients and AdamW states alone are {_fmt(whole)})"
        if device_type == "cuda":
            hint += "; or more GPUs with zero=3, a shorter --seq-len, recompute=full together"
        else:
            hint += "; or fewer processes, a shorter --seq-len, zero=3, recompute=full together"
        if tried:
            hint += f" (alone, none fits: {tried})"
    raise MeshplanError(head, hint=hint)
