"""Pre-flight checks of `meshplan train`: requests that cannot run, refused in one line before any
process starts (a bad learning rate, an output path in a missing directory, a sequence longer than
the model's positions, a run that would not fit in memory). Presets (``check_memory``) and ingested
models (``check_graph_memory``: hf:/module: sources, the traced LayerGraph) go through the same
checks, once, in the launcher.

No torch here (the CLI imports this module before it launches anything); the cost models are numpy.

Memory (presets). The estimate is meshplan's own cost model (``meshplan.cost.estimate``) for the
plan, per process: weights, gradients and AdamW states (16 bytes per parameter held, in fp32 or the
mixed-precision equivalent, sharded by ZeRO), the activations of a micro-batch at that sequence
length, and the transients (logits at the loss, FSDP's gathered layers, DDP buckets). Two
corrections for what this runtime does differently from the GPU training the cost model was fitted
on:

- precision=fp32: activations are 4-byte, the cost model counts 16-bit ones (x 2);
- on CPU, the cost model's framework overhead (CUDA context, NCCL buffers: 1 GiB) is replaced by
  the host memory of one idle rank (``CPU_PROCESS_GIB``); offload flags are no-ops (host memory
  is the device memory) and fp8 runs as bf16, so the estimate is of the plan without them.

Memory (ingested models). The cost model (``meshplan.cost.estimate``, the one path) on the
LayerGraph traced on the meta device at the run's sequence length: the same parts, from the bytes
the trace saw autograd keep (fp32 activations at 4 bytes, as for every model); the same
CPU corrections, with ``HF_PROCESS_GIB`` for an idle rank of an hf: source (transformers imported).

On CPU all the ranks of a node share its memory: the need is the sum over this node's processes,
compared with ``MemAvailable`` of /proc/meminfo. On GPUs each rank's estimate is compared with its
device's memory. Checked against measurements on this runtime (CPU, fp32, peak RSS): tiny-llama at
32k tokens 0.82 GiB measured vs 0.64 estimated; GPT-3 125M, micro-batch 4 x 512: 4.3 vs 4.8 (the
ingested figures: docs/runtime.md). It is an order-of-magnitude guard: only runs the estimate puts
above what is there are refused.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan import paths
from meshplan.errors import MeshplanError
from meshplan.runtime.hetero import check_batch, micro_counts
from meshplan.runtime.local import cpu_cluster, run_plan
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload

CPU_PROCESS_GIB = 0.25
"""Host memory of one rank before training (Python, torch, torch.distributed, meshplan): peak RSS
0.22-0.31 GiB measured on torch 2.13 / Linux. Replaces the cost model's GPU framework overhead."""
HF_PROCESS_GIB = 0.35
"""Host memory of one idle rank of an ingested hf: model (CPU_PROCESS_GIB plus transformers and the
model class): peak RSS 0.34 GiB measured on torch 2.13 / transformers 5.24, before the weights."""
MEMINFO = "/proc/meminfo"
GiB = 2.0**30


# ---- arguments -----------------------------------------------------------------------------------
def check_lr(lr: float) -> float:
    """A learning rate AdamW can use: finite and > 0, or a one-line MeshplanError."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise MeshplanError(f"--lr must be a finite number > 0, got {lr!r}", hint="e.g. --lr 1e-3")
    return float(lr)


def check_rendezvous(*, nnodes: int, node_rank: int, rdzv_endpoint: str | None, nproc_per_node: int,
                     world_size: int, plan_gpus: int) -> None:
    """A multi-node launch that can run: the rendezvous endpoint (HOST:PORT) every node connects to,
    this node's rank among --nnodes, and nodes x processes per node = the plan's GPUs. Without this,
    `train --nnodes 2` with no endpoint waited about 2 minutes for a rendezvous that could not
    happen and ended in a torch traceback (issue 29)."""
    if nnodes == 1 and node_rank:
        raise MeshplanError(f"--node-rank {node_rank} with one node", hint="drop --node-rank, or give --nnodes")
    if node_rank >= nnodes:
        raise MeshplanError(f"--node-rank {node_rank} is not one of the {nnodes} node(s) of --nnodes {nnodes} "
                            f"(ranks 0 to {nnodes - 1})", hint="give each node its own --node-rank, 0 on the first")
    if rdzv_endpoint is not None:
        host, sep, port = rdzv_endpoint.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MeshplanError(f"--rdzv-endpoint {rdzv_endpoint!r} is not HOST:PORT (a port 1 to 65535)",
                                hint="e.g. --rdzv-endpoint node0.example:29500, the same on every node")
    elif nnodes > 1:
        raise MeshplanError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: the rendezvous every node "
                            "connects to (without it no node can find the others)",
                            hint="run the same command on every node with --rdzv-endpoint FIRST_NODE:29500 and "
                                 "--node-rank 0 .. " + str(nnodes - 1))
    if world_size != plan_gpus:
        raise MeshplanError(f"--nnodes {nnodes} x --nproc-per-node {nproc_per_node} = {world_size} processes, but "
                            f"the plan runs on {plan_gpus} GPUs",
                            hint=f"give --nproc-per-node {plan_gpus // nnodes}" if plan_gpus % nnodes == 0 else
                            "give --nnodes and --nproc-per-node whose product is the plan's GPU count")


@contextmanager
def node_lock(endpoint: str, node_rank: int, flags: str) -> Iterator[None]:
    """What the pre-flight can see on this host of two nodes given the same node rank (``meshplan train
    --site S --site-node I`` twice, or flags that map two nodes to one rank): one launcher at a time holds
    node rank ``node_rank`` of the rendezvous at ``endpoint`` here (an flock on a file in the temporary
    folder, released when the launcher ends, however it ends). A second is refused in one line at once,
    instead of both waiting for the process group to time out. Nodes on other hosts are checked when the
    ranks meet (train.claim_rank)."""
    import fcntl
    import tempfile
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", endpoint)
    path = Path(tempfile.gettempdir()) / f"meshplan-node-{name}-{node_rank}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        other = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise MeshplanError(f"{flags}: node rank {node_rank} of the rendezvous at {endpoint} is already held by "
                            f"another meshplan train on this host ({other}): two nodes with one node rank would hold "
                            "the same ranks and wait for the missing ones until the process group times out",
                            hint="give each node its own --site / --site-node; each launcher prints the node rank "
                                 "its flags map to") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}, {flags}".encode())
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def check_weak_links(plan: Plan, *, nnodes: int, nodes_per_dc: int | None, outer_lr: float | None,
                     outer_momentum: float | None) -> None:
    """The flags of periodic syncs (runtime/periodic.py): --nodes-per-dc against --nnodes (and
    needed by sync_scope=dc), --outer-lr/--outer-momentum only with grad_sync=diloco."""
    if nodes_per_dc is not None and (nodes_per_dc < 1 or nnodes % nodes_per_dc):
        raise MeshplanError(f"--nodes-per-dc {nodes_per_dc} does not divide --nnodes {nnodes}",
                            hint="give the nodes of one datacenter, a divisor of --nnodes")
    if plan.periodic and plan.sync_scope == "dc" and not nodes_per_dc:
        raise MeshplanError("sync_scope=dc: the runtime does not know which nodes share a datacenter",
                            hint="pass --nodes-per-dc N (nodes per datacenter), or use sync_scope=node or all")
    for flag, value in (("--outer-lr", outer_lr), ("--outer-momentum", outer_momentum)):
        if value is not None and plan.grad_sync != "diloco":
            raise MeshplanError(f"{flag} is DiLoCo's outer optimizer setting, but the plan has "
                                f"grad_sync={plan.grad_sync}", hint=f"add grad_sync=diloco to the plan, or drop {flag}")


def check_output_file(flag: str, path: str | None) -> str | None:
    """A file to write (--metrics): meshplan.paths.check_output_file (its directory must exist:
    nothing is created but the file; not a directory). Returns the path."""
    return paths.check_output_file(flag, path or None, "metrics.jsonl") if path else path


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


CHECKPOINT_META = "meta.json"
"""What marks a meshplan checkpoint directory (runtime.checkpoint.META)."""
STEP_DIR = re.compile(r"step-\d{8}")
"""The DCP folders of a checkpoint directory (runtime.checkpoint.save)."""


def checkpoint_contents(path: str | Path) -> tuple[str, list[Path]] | None:
    """What a --checkpoint-dir already holds: (words for it, the checkpoint's own entries: meta.json
    and the step-NNNNNNNN folders), or None when it holds no checkpoint."""
    d = Path(path).expanduser()
    if not d.is_dir():
        return None
    steps = sorted(x for x in d.iterdir() if x.is_dir() and STEP_DIR.fullmatch(x.name))
    meta_path = d / CHECKPOINT_META
    if not meta_path.is_file():
        if not steps:
            return None
        return (f"checkpoint folders ({', '.join(x.name for x in steps[:3])}{' ...' if len(steps) > 3 else ''}) "
                f"but no {CHECKPOINT_META} (an unfinished save)", steps)
    try:
        meta = json.loads(meta_path.read_text())
        step = int(meta["step"])
        model = meta.get("model", {}).get("name")
        plan = meta.get("plan")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"a {CHECKPOINT_META} that cannot be read", [meta_path, *steps]
    what = f"a checkpoint at step {step}" + (f" of {model}" if model else "") + (f" (plan {plan})" if plan else "")
    return what, [meta_path, *steps]


def check_new_checkpoint_dir(path: str | None, *, overwrite: bool = False) -> None:
    """Without --resume: --checkpoint-dir must be a directory or not exist yet (``check_output_dir``),
    and hold no checkpoint (a new run would reset meta.json and mix its step folders with the old
    ones), unless ``overwrite`` (--overwrite: ``clear_checkpoint_dir`` before launch)."""
    check_output_dir("--checkpoint-dir", path)
    if not path or overwrite:
        return
    found = checkpoint_contents(path)
    if found is not None:
        raise MeshplanError(f"--checkpoint-dir {path} already holds {found[0]}; a new run would overwrite it",
                            hint="pass --resume to continue it, give a new --checkpoint-dir, or pass --overwrite "
                                 "to delete it and start again")


def clear_checkpoint_dir(path: str | None) -> list[str]:
    """--overwrite: delete the checkpoint in ``path`` (meta.json and the step-NNNNNNNN folders; nothing
    else in the directory is touched). Returns the names deleted."""
    found = checkpoint_contents(path) if path else None
    if found is None:
        return []
    gone = []
    for entry in found[1]:
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)
        gone.append(entry.name)
    (Path(path).expanduser() / (CHECKPOINT_META + ".tmp")).unlink(missing_ok=True)  # type: ignore[arg-type]
    return gone


def check_seq_len(model: ModelSpec, seq_len: int) -> None:
    """The sequence against the model's maximum positions, where it has one (a learned position
    table: GPT-2/GPT-3 presets). Rotary models have no table to run out of."""
    limit = model.max_position_embeddings
    if model.position == "learned" and limit and seq_len > limit:
        raise MeshplanError(f"--seq-len {seq_len} exceeds the {limit} positions of {model.name} "
                            "(learned position table)", hint=f"use --seq-len <= {limit}")


# ---- the planner's constraints ---------------------------------------------------------------------
NOT_PLAN_CHECKS = ("gpu count mismatch", "tp larger than a node", "precision unsupported", "invalid site order")
"""spec.constraints checks the launcher does not run: the process count (mesh.check_supported says it
in the runtime's words), tp across nodes (it runs, only slower), fp8 without fp8 hardware (runs as
bf16, noted) and a site order against the sites (a launch need not name them; the rank grid reads only
the plan). Every other constraint is a property of the plan on the model and batch."""
MODEL_FREE_CHECKS = ("batch not divisible", "schedule incompatible", "invalid hybrid sharding", "invalid offload",
                     "zero=2 under a pipeline")
"""spec.constraints checks that read only the plan and the batch: what is left for an ingested model
that cannot be traced on the meta device (no LayerGraph)."""


def refuse(bad: list[tuple[str, str]]) -> None:
    """Raise the planner's constraint violations ``bad`` (name, reason) as one MeshplanError."""
    if bad:
        raise MeshplanError("plan cannot run: " + "; ".join(reason for _, reason in bad),
                            hint="the planner's constraints: `meshplan estimate` refuses this plan too")


def check_plan(model: ModelSpec, plan: Plan, global_batch: int, seq_len: int, *, nodes: int = 1,
               nodes_per_dc: int | None = None) -> None:
    """The planner's own constraints (spec.constraints, as `meshplan estimate` runs them) on a preset
    model's plan, but for ``NOT_PLAN_CHECKS``: stages against the layers, batch, schedule, tp against
    heads and ffn, cp against the sequence, ep, hybrid sharding, offload, zero=2 under a pipeline,
    recompute_layers, a periodic sync's groups on ``nodes`` (of ``nodes_per_dc`` per datacenter). One
    line naming every reason, or nothing."""
    from meshplan.spec.constraints import violations
    cluster = cpu_cluster(plan.num_gpus, memory_gib=1.0, nodes=nodes, nodes_per_dc=nodes_per_dc)
    bad: list[tuple[str, str]] = []
    per = per_replica(plan)
    for work in replica_workloads(plan, global_batch, seq_len):
        bad += [v for v in violations(model, cluster, per, work, skip=NOT_PLAN_CHECKS) if v not in bad]
    refuse(bad)


def per_replica(plan: Plan) -> Plan:
    """The plan checked against each replica's workload (replica_workloads): its shares already
    checked (hetero.check_batch), each workload is one replica's micro-batch count on every replica."""
    return plan.replace(dp_shares=None) if plan.dp_shares is not None else plan


def replica_workloads(plan: Plan, global_batch: int, seq_len: int) -> list[Workload]:
    """The workloads the planner's constraints check a run with: its own; with uneven dp_shares
    (runtime/hetero.py, which checks the shares first) one per distinct micro-batch count of the
    replicas, as if every replica ran that many (dp x micro_batch x count sequences): the
    schedule's rules hold per replica, and the batch is cut by the shares, not by dp."""
    if plan.dp_shares is None:
        return [Workload(global_batch=global_batch, seq_len=seq_len)]
    check_batch(plan, global_batch)
    return [Workload(global_batch=plan.dp * plan.micro_batch * n, seq_len=seq_len)
            for n in micro_counts(plan, global_batch)]


def check_graph_plan(graph: Any, plan: Plan, global_batch: int, *, nodes: int = 1,
                     nodes_per_dc: int | None = None) -> None:
    """The planner's constraints (spec.constraints, but NOT_PLAN_CHECKS) on an ingested model's LayerGraph;
    ``graph`` None (not traceable): the constraints that read only the plan and the batch."""
    from meshplan.spec import constraints
    cluster = cpu_cluster(plan.num_gpus, memory_gib=1.0, nodes=nodes, nodes_per_dc=nodes_per_dc)
    if graph is None:
        bad: list[tuple[str, str]] = []
        for work in replica_workloads(plan, global_batch, 1):
            ctx = constraints.Context(None, cluster, per_replica(plan), work)  # type: ignore[arg-type]
            bad += [(name, why) for name in MODEL_FREE_CHECKS if (why := constraints.CHECKS[name](ctx))
                    and (name, why) not in bad]
        refuse(bad)
        return
    bad: list[tuple[str, str]] = []
    for work in replica_workloads(plan, global_batch, graph.sample_tokens):
        bad += [v for v in constraints.violations(graph, cluster, per_replica(plan), work, skip=NOT_PLAN_CHECKS)
                if v not in bad]
    refuse(bad)


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


@dataclass(frozen=True)
class MemoryEstimate:
    """The cost model's memory per process of one run on this runtime, GiB."""

    per_process_gib: float
    """The fullest rank (the first pipeline stage, usually)."""
    mean_gib: float
    """The mean over pipeline stages (every stage has as many ranks)."""
    parts: dict[str, float] = field(default_factory=dict)
    """The fullest rank by part: weights, grads, optimizer, activations, transient, overhead."""


def _corrected(r: Any, *, activation_scale: float, device_type: str, process_gib: float) -> MemoryEstimate | None:
    """A CostReport's memory with this runtime's corrections (module docstring): activations x
    ``activation_scale``; on CPU the framework overhead replaced by ``process_gib``."""
    parts = {k: v for k, v in r.memory.items() if k != "total"}
    extra = (activation_scale - 1.0) * parts.get("activations", 0.0)
    parts["activations"] = parts.get("activations", 0.0) * activation_scale
    if device_type != "cuda":
        extra += process_gib - parts.get("overhead", 0.0)
        parts["overhead"] = process_gib
        # no CUDA caching allocator, CUDA context or NCCL on CPU/gloo (cost.reserved)
        for k in ("allocator", "outside"):
            extra -= parts.pop(k, 0.0)
    stages = r.memory_per_stage or [r.peak_memory_gib]
    peak = r.peak_memory_gib + extra
    mean = sum(stages) / len(stages) + extra
    if not all(math.isfinite(x) for x in (peak, mean)):
        return None
    return MemoryEstimate(per_process_gib=peak, mean_gib=min(mean, peak), parts=parts)


def memory_estimate(model: ModelSpec, plan: Plan, global_batch: int, seq_len: int,
                    device_type: str = "cpu", *, nodes: int = 1, nodes_per_dc: int | None = None,
                    optimizer: str = "adamw") -> MemoryEstimate | None:
    """Memory per process of ``plan`` on this runtime (see the module docstring); None when the
    cost model does not price the plan (the runtime's own checks speak for it)."""
    from meshplan.cost import estimate
    as_run = run_plan(plan, device_type)
    cluster = cpu_cluster(plan.num_gpus, nodes=nodes, nodes_per_dc=nodes_per_dc)
    try:
        if plan.buckets is not None:  # the heaviest bucket: its micro-batch at its limit (cost.buckets)
            from meshplan.cost.buckets import sub_plan
            reports = [estimate(model, cluster, sub_plan(as_run, b, b.micro_batch),
                                Workload(global_batch=as_run.dp * as_run.cp // b.cp * b.micro_batch,
                                         seq_len=min(b.max_len, seq_len), optimizer=optimizer))
                       for b in as_run.bucket_specs]
            r = max(reports, key=lambda x: x.peak_memory_gib)
        else:
            r = estimate(model, cluster, as_run, Workload(global_batch=global_batch, seq_len=seq_len,
                                                          optimizer=optimizer))
    except (MeshplanError, ValueError, ZeroDivisionError, OverflowError):
        return None
    # the cost model counts fp32 activations at 4 bytes itself (cost.layer.act_scale)
    return _corrected(r, activation_scale=1.0, device_type=device_type, process_gib=CPU_PROCESS_GIB)


def graph_memory_estimate(graph: Any, plan: Plan, global_batch: int, device_type: str = "cpu",
                          process_gib: float = CPU_PROCESS_GIB, *, nodes: int = 1,
                          nodes_per_dc: int | None = None, optimizer: str = "adamw") -> MemoryEstimate | None:
    """Memory per process of ``plan`` on an ingested model's LayerGraph (traced at the run's sequence
    length): ``cost.estimate`` with this runtime's CPU corrections (module docstring). None when
    the cost model does not price the plan (the runtime's own checks speak for it)."""
    from meshplan.cost import estimate
    as_run = run_plan(plan, device_type)
    try:
        r = estimate(graph, cpu_cluster(plan.num_gpus, nodes=nodes, nodes_per_dc=nodes_per_dc), as_run,
                     Workload(global_batch=global_batch, seq_len=graph.sample_tokens, optimizer=optimizer))
    except (MeshplanError, ValueError, ZeroDivisionError, OverflowError):
        return None
    # the cost model counts activations at the plan's width (cost.layer.act_scale)
    return _corrected(r, activation_scale=1.0, device_type=device_type, process_gib=process_gib)


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


Estimator = Callable[[Plan, int], "MemoryEstimate | None"]
"""(plan, seq_len) -> the memory estimate of one run of the same model and batch (None: not priced)."""


def _options(estimator: Estimator, plan: Plan, seq_len: int | None, nproc_per_node: int, nnodes: int,
             device_type: str, available_gib: float) -> list[tuple[str, float, bool]]:
    """fit_options for any model: ``estimator`` prices a changed plan or sequence length; no
    sequence options when ``seq_len`` is None (a model without one: images, a module: source
    without --seq-len). The sequence options assume the need grows with the length (bisection:
    a few estimates, which matters where each one traces the model again)."""
    def need(change: Any, s: int | None = seq_len, nproc: int = nproc_per_node, nodes: int = nnodes) -> float | None:
        try:
            p = change() if callable(change) else change
        except MeshplanError:  # the change makes no valid plan
            return None
        e = estimator(p, s)  # type: ignore[arg-type]
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
    shorter = _seq_options(seq_len, plan.cp) if seq_len else []
    if shorter:
        known: dict[int, float | None] = {}

        def at(i: int) -> float | None:
            if i not in known:
                known[i] = need(plan, shorter[i])
            return known[i]

        def fits(i: int) -> bool:
            g = at(i)
            return g is not None and g <= available_gib

        lo, hi = 0, len(shorter) - 1  # longest first: the longest that fits
        if fits(lo) or fits(hi):
            while not fits(lo) and hi - lo > 1:  # lo does not fit, hi does
                mid = (lo + hi) // 2
                if fits(mid):
                    hi = mid
                else:
                    lo = mid
            best = lo if fits(lo) else hi
            add(f"--seq-len {shorter[best]}", at(best))
        elif at(hi) is not None:
            add(f"--seq-len {shorter[hi]}", at(hi))
    if device_type != "cuda" and plan.num_gpus > 1:
        def one() -> Plan:
            return Plan(micro_batch=plan.micro_batch, precision=plan.precision, recompute=plan.recompute,
                        recompute_layers=plan.recompute_layers, flash_attention=plan.flash_attention,
                        fused_loss=plan.fused_loss, compile=plan.compile)
        add("one process", need(one, nproc=1, nodes=1))
    return out


def fit_options(model: ModelSpec, plan: Plan, global_batch: int, seq_len: int, nproc_per_node: int,
                nnodes: int, device_type: str, available_gib: float) -> list[tuple[str, float, bool]]:
    """(change, estimated need in GiB, fits) for single changes that shrink the need: zero=3,
    full recomputation, micro_batch=1, a shorter --seq-len (the longest that fits), one process
    (CPU: ranks share host memory)."""
    def estimator(p: Plan, s: int) -> MemoryEstimate | None:
        return memory_estimate(model, p, global_batch, s, device_type)
    return _options(estimator, plan, seq_len, nproc_per_node, nnodes, device_type, available_gib)


def state_gib(model: ModelSpec) -> float:
    """fp32 weights, gradients and AdamW m, v of the whole model (16 bytes per parameter), GiB."""
    return 16.0 * model.num_params() / GiB


def check_memory(model: ModelSpec, plan: Plan, global_batch: int, seq_len: int, *, nproc_per_node: int,
                 nnodes: int = 1, device_type: str = "cpu", available_gib: float | None = None,
                 device_name: str = "", nodes_per_dc: int | None = None,
                 optimizer: str = "adamw") -> MemoryEstimate | None:
    """Refuse (one line) a run whose estimated memory exceeds what there is: host memory on CPU
    (``available_gib``, default MemAvailable; every process of the node counted), the device's
    memory on GPUs (``available_gib`` must be given). Returns the estimate (None: not priced, or
    nothing known of the memory available)."""
    def estimator(p: Plan, s: int) -> MemoryEstimate | None:
        return memory_estimate(model, p, global_batch, s, device_type, nodes=nnodes, nodes_per_dc=nodes_per_dc,
                               optimizer=optimizer)
    return _check(model.name, estimator, plan, seq_len, f"{plan.micro_batch} x {seq_len} tokens", state_gib(model),
                  nproc_per_node=nproc_per_node, nnodes=nnodes, device_type=device_type,
                  available_gib=available_gib, device_name=device_name)


def check_graph_memory(graph: Any, plan: Plan, global_batch: int, *, nproc_per_node: int, nnodes: int = 1,
                       device_type: str = "cpu", available_gib: float | None = None, device_name: str = "",
                       name: str | None = None, seq_len: int | None = None,
                       retrace: Callable[[int], Any] | None = None,
                       process_gib: float = CPU_PROCESS_GIB, nodes_per_dc: int | None = None,
                       optimizer: str = "adamw") -> MemoryEstimate | None:
    """check_memory for an ingested model: ``graph`` is its LayerGraph traced at the run's sequence
    length ``seq_len`` (None: the model has none, e.g. images); ``retrace(s)`` traces it at another
    length, for the "would fit: --seq-len" hint (only called when the run does not fit). Returns the
    estimate (None: not priced, or nothing known of the memory available)."""
    graphs: dict[int | None, Any] = {seq_len: graph}

    def estimator(p: Plan, s: int | None) -> MemoryEstimate | None:
        if s not in graphs:
            try:
                graphs[s] = retrace(s) if retrace is not None and s is not None else None
            except MeshplanError:
                graphs[s] = None
        g = graphs[s]
        return None if g is None else graph_memory_estimate(g, p, global_batch, device_type, process_gib,
                                                            nodes=nnodes, nodes_per_dc=nodes_per_dc,
                                                            optimizer=optimizer)

    tokens = f"{plan.micro_batch} x {graph.sample_tokens} tokens" if seq_len else \
        f"{plan.micro_batch} sample{'s' if plan.micro_batch > 1 else ''}"
    return _check(name or graph.name, estimator, plan, seq_len if retrace is not None else None, tokens,
                  16.0 * graph.params / GiB, nproc_per_node=nproc_per_node, nnodes=nnodes,
                  device_type=device_type, available_gib=available_gib, device_name=device_name)


def _check(name: str, estimator: Estimator, plan: Plan, seq_len: int | None, tokens: str, whole: float, *,
           nproc_per_node: int, nnodes: int, device_type: str, available_gib: float | None,
           device_name: str) -> MemoryEstimate | None:
    """The memory check of check_memory / check_graph_memory; ``tokens``: what a micro-batch is
    ('8 x 4096 tokens'), ``whole``: the model's fp32 states in GiB."""
    est = estimator(plan, seq_len)  # type: ignore[arg-type]
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
            f", activations {_fmt(p.get('activations', 0))} for a micro-batch of {tokens}"
            f", transients {_fmt(p.get('transient', 0))}")
    subject = f"{name} with {_plan_text(plan)}"
    if device_type == "cuda":
        head = (f"not enough GPU memory for {subject}: the cost model estimates {_fmt(need)} per GPU ({what}), "
                f"but {device_name or 'the GPU'} has {_fmt(available_gib)}")
    else:
        per = est.mean_gib if nnodes == 1 else est.per_process_gib
        procs = (f" x {nproc_per_node} processes sharing this machine's memory = {_fmt(need)}"
                 if nproc_per_node > 1 else "")
        head = (f"not enough host memory for {subject}: the cost model estimates {_fmt(per)} per process "
                f"({what}){procs}, but {_fmt(available_gib)} is available (MemAvailable)")
    options = _options(estimator, plan, seq_len, nproc_per_node, nnodes, device_type, available_gib)
    fits = [f"{label} ({_fmt(g)})" for label, g, ok in options if ok]
    if fits:
        hint = "would fit: " + ", ".join(fits)
    else:
        tried = ", ".join(f"{label} {_fmt(g)}" for label, g, _ in options)
        hint = "a smaller model"
        if whole > available_gib:
            hint += f" ({name}'s fp32 weights, gradients and AdamW states alone are {_fmt(whole)})"
        shorter = ", a shorter --seq-len" if seq_len else ""
        if device_type == "cuda":
            hint += f"; or more GPUs with zero=3{shorter}, recompute=full together"
        else:
            hint += f"; or fewer processes{shorter}, zero=3, recompute=full together"
        if tried:
            hint += f" (alone, none fits: {tried})"
    raise MeshplanError(head, hint=hint)


# ---- what the user is told before launch ---------------------------------------------------------
def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def oversubscription_warning(nproc_per_node: int, device_type: str, cores: int | None = None) -> str | None:
    """A CPU run with more processes on this node than CPU cores: each rank runs one thread and
    waits for the others at every collective, so ranks time-share the cores. A warning, not an
    error: it runs, slowly. None when it fits (or on GPUs)."""
    cores = cpu_cores() if cores is None else cores
    if device_type == "cuda" or nproc_per_node <= cores:
        return None
    return (f"{nproc_per_node} processes on this node's {cores} CPU core{'s' if cores != 1 else ''}: the ranks "
            "share the cores, so the run will be slow and its timings (step time, tokens/s) meaningless; "
            f"use at most {cores} processes per node for measurements")


def duration_text(seconds: float) -> str:
    """'0.012 s', '3.4 s', '12 min', '5.2 h', '3.1 days'."""
    if not math.isfinite(seconds):
        return "unknown"
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds < 0.1 else f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.1f} days"


def step_time_note(est: dict[str, Any], steps: int) -> str | None:
    """The cost model's step time before launch (``est``: launch.estimate_for's dict), with its
    label: what a user is in for. None when the cost model did not price the run."""
    st = est.get("step_time_s")
    if st is None or not math.isfinite(st):
        return None
    basis = est.get("basis") or f"cost model for {est.get('cluster')}"
    total = f", about {duration_text(st * steps)} for {steps} step{'s' if steps != 1 else ''}" if steps > 1 else ""
    return f"the cost model estimates {duration_text(st)} a step{total} ({basis})"


def memory_text(est: MemoryEstimate | None, nproc_per_node: int) -> str:
    """What a rank killed by SIGKILL is told about memory: the pre-flight estimate for this node's
    processes beside what was available at launch ('' when neither is known)."""
    parts = []
    if est is not None:
        parts.append(f"the cost model estimated {est.mean_gib * nproc_per_node:.1f} GiB for the "
                     f"{nproc_per_node} processes of this node")
    avail = mem_available_gib()
    if avail is not None:
        parts.append(f"{avail:.1f} GiB was available at launch")
    return ", ".join(parts)
