"""`meshplan calibrate --bench`: micro-benchmarks of this machine's accelerators, through torch.

    raw = run_bench(BenchRequest())        # measures; returns the raw results (JSON-able dict)

What is measured (one record per measurement, each with an ``id`` the calibration cites):

- GEMM throughput by shape and dtype (``torch.mm``): square shapes, and sweeps of the token
  dimension m and the weight dimensions n, k with the others large, so that the cost model's
  size-dependent factor (gemm_half_tokens, gemm_half_dim) can be told from its large-GEMM
  efficiency.
- Attention kernels by sequence length (``scaled_dot_product_attention``, causal, forward; the
  FlashAttention backend on CUDA, whatever torch picks on CPU), at a fixed number of tokens.
- HBM bandwidth of elementwise ops (copy, add, scale) on tensors far larger than the caches.
- Collectives by message size: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv,
  in a worker started with torchrun (``python -m meshplan.runtime.launch ... -m
  meshplan.runtime.bench --worker OUT``, as `meshplan train` starts its ranks), one process per
  device: within a node (every node's ranks, concurrently), and, launched on several nodes
  (``nnodes``), across nodes (one rank per node). NCCL on GPUs, gloo on CPU. A collective the
  backend lacks (gloo builds without reduce-scatter or all-to-all) is recorded as not measured.

The single-device kernels run in the calling process on device 0 (on CPU with one thread: the
cost model's ``local-cpu`` device is one core per process). On CPU everything is small (the run
takes seconds) and labelled ``device_kind: "cpu"``: it tests the pipeline end to end; its numbers
are not GPU numbers. The reference the numbers are compared with (peaks, HBM and link bandwidths)
is the GPU preset of the CUDA device (or ``--gpu``), on CPU the ``local-cpu`` device with a
measured single-thread matmul rate (runtime.local.cpu_cluster), recorded in the results as a
cluster (``reference.cluster``) so that calibration.bench_fit needs no torch.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.runtime.launch import exit_worker, in_torchrun, run_reporting_lost_peers, run_torchrun
from meshplan.runtime.local import CUDA_PRESETS, cpu_cluster, cpu_tflops

BENCH_SCHEMA_VERSION = 1
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PG_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Sizes:
    """What one kind of device is measured on, and how long each measurement runs."""

    gemm: tuple[tuple[str, tuple[tuple[int, int, int], ...]], ...]
    """(dtype, ((m, n, k), ...)) per dtype."""
    attention_dtype: str
    attention_heads: int
    attention_head_dim: int
    attention_tokens: int
    """batch x sequence length of every attention measurement (the batch shrinks as s grows)."""
    attention_seqs: tuple[int, ...]
    elementwise_dtype: str
    elementwise_bytes: tuple[int, ...]
    """Bytes of each tensor of an elementwise op."""
    collective_dtype: str
    collective_bytes: tuple[int, ...]
    """Message sizes (the cost model's convention: the full tensor as each rank sees it after the
    collective; the all-gather output, the reduce-scatter input)."""
    warmup: int
    trials: int
    min_trial_s: float
    """Each trial repeats the kernel until it has run about this long (single device)."""
    collective_iters: Callable[[int], int] = field(default=lambda size: 5)
    """Back-to-back collectives per trial for a message of ``size`` bytes (the same on every rank)."""


MiB = 1 << 20


def _gpu_gemm() -> tuple[tuple[str, tuple[tuple[int, int, int], ...]], ...]:
    big = 8192
    squares = tuple((d, d, d) for d in (1024, 2048, 4096, 8192))
    m_sweep = tuple((m, big, big) for m in (128, 256, 512, 1024, 2048))
    n_sweep = tuple((big, n, big) for n in (128, 256, 512, 1024, 2048))
    k_sweep = tuple((big, big, k) for k in (256, 1024))
    return (("bf16", squares + m_sweep + n_sweep + k_sweep),
            ("fp16", ((4096, 4096, 4096), (8192, 8192, 8192))),
            ("fp32", ((4096, 4096, 4096), (8192, 8192, 8192))))


GPU_SIZES = Sizes(
    gemm=_gpu_gemm(),
    attention_dtype="bf16", attention_heads=16, attention_head_dim=128, attention_tokens=16384,
    attention_seqs=(256, 512, 1024, 2048, 4096, 8192, 16384),
    elementwise_dtype="bf16", elementwise_bytes=(64 * MiB, 256 * MiB, 1024 * MiB),
    collective_dtype="bf16",
    collective_bytes=(64 * 1024, MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB),
    warmup=3, trials=5, min_trial_s=0.02,
    collective_iters=lambda size: 20 if size <= 16 * MiB else 5,
)
"""CUDA: shapes where the tensor cores can reach their sustained rate, messages up to 1 GiB."""

CPU_SIZES = Sizes(
    gemm=(("fp32", tuple((d, d, d) for d in (64, 128, 256, 512))
           + tuple((m, 256, 256) for m in (16, 32, 64, 128))
           + tuple((256, n, 256) for n in (16, 32, 64, 128))),),
    attention_dtype="fp32", attention_heads=4, attention_head_dim=64, attention_tokens=1024,
    attention_seqs=(64, 128, 256, 512, 1024),
    elementwise_dtype="fp32", elementwise_bytes=(8 * MiB, 32 * MiB),
    collective_dtype="fp32", collective_bytes=(64 * 1024, MiB, 4 * MiB),
    warmup=1, trials=3, min_trial_s=0.01,
    collective_iters=lambda size: 4 if size <= MiB else 2,
)
"""CPU (gloo): small, so that the whole run takes seconds; it tests the pipeline, not the CPU."""


@dataclass(frozen=True, kw_only=True)
class BenchRequest:
    """What `meshplan calibrate --bench` was asked to measure."""

    gpu: str | None = None
    """GPU preset whose peaks and bandwidths the numbers are compared with (None: the preset that
    matches the CUDA device's name). Not on CPU."""
    nproc_per_node: int | None = None
    """Processes per node for the collectives (None: the CUDA device count; 2 on CPU)."""
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    pg_timeout_s: float = PG_TIMEOUT_S


def size_label(nbytes: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if nbytes >= div and nbytes % div == 0:
            return f"{int(nbytes // div)}{unit}"
    return f"{int(nbytes)}B"


def _torch_dtype(name: str) -> Any:
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def device_kind() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(kind: str) -> str:
    if kind == "cuda":
        import torch
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def check_request(req: BenchRequest, kind: str) -> None:
    """Bad --bench options, before anything is measured (one-line MeshplanErrors)."""
    if req.gpu is not None and kind != "cuda":
        raise MeshplanError(f"--gpu {req.gpu}: this machine has no CUDA device, so there is no GPU to compare "
                            "with a preset",
                            hint="drop --gpu: on CPU --bench compares with this CPU's measured matmul rate "
                                 "(the numbers are labelled CPU)")
    for flag, v, least in (("--nproc-per-node", req.nproc_per_node, 1), ("--nnodes", req.nnodes, 1),
                           ("--node-rank", req.node_rank, 0)):
        if v is not None and v < least:
            raise MeshplanError(f"{flag} must be at least {least}; got {v}")
    if req.node_rank >= req.nnodes:
        raise MeshplanError(f"--node-rank {req.node_rank} is not below --nnodes {req.nnodes}",
                            hint="node ranks run from 0 to nnodes-1")
    if req.nnodes > 1 and not req.rdzv_endpoint:
        raise MeshplanError(f"--nnodes {req.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address)",
                            hint="run the same command on every node with its own --node-rank")
    if kind == "cuda" and req.nproc_per_node is not None:
        import torch
        n = torch.cuda.device_count()
        if req.nproc_per_node > n:
            raise MeshplanError(f"--nproc-per-node {req.nproc_per_node}: this node has {n} CUDA device"
                                f"{'s' * (n != 1)}", hint=f"use at most {n}")


def gpu_preset(req: BenchRequest, kind: str) -> str | None:
    """The GPU preset the numbers are compared with (None on CPU)."""
    if kind != "cuda":
        return None
    from meshplan.spec.io import preset_names, suggest
    if req.gpu is not None:
        name = req.gpu.strip().lower()
        if name not in preset_names("gpus"):
            close = suggest(name, preset_names("gpus"))
            raise MeshplanError(f"--gpu {req.gpu}: unknown GPU preset"
                                + (f"; did you mean {', '.join(close)}?" if close else ""),
                                hint="`meshplan presets` lists the GPU presets")
        return name
    dev = device_name(kind)
    for frag, preset in CUDA_PRESETS:
        if frag in dev:
            return preset
    raise MeshplanError(f"--bench: no GPU preset matches this device ({dev}), so there are no peaks to compare "
                        "the measurements with",
                        hint="name the closest preset with --gpu PRESET (`meshplan presets` lists them)")


def reference_cluster(req: BenchRequest, kind: str, nproc: int) -> Any:
    """The ClusterSpec the measurements are compared with: the GPU preset at nnodes x nproc, or
    on CPU the `local-cpu` device (one core per process, a measured fp32 matmul rate)."""
    preset = gpu_preset(req, kind)
    if preset is not None:
        from meshplan.spec.io import parse_cluster_shorthand
        return parse_cluster_shorthand(f"{preset}:{req.nnodes}x{nproc}")
    c = cpu_cluster(nproc, cpu_tflops())
    return c.replace(name=f"local-cpu:{req.nnodes}x{nproc}", num_nodes=req.nnodes)


# ---- timing ------------------------------------------------------------------------------------
def _sync(kind: str) -> Callable[[], None]:
    if kind == "cuda":
        import torch
        return torch.cuda.synchronize
    return lambda: None


def timed(fn: Callable[[], Any], sync: Callable[[], None], sizes: Sizes) -> float:
    """Seconds per call of ``fn``: after ``warmup`` calls, the median over ``trials`` of back-to-back
    runs long enough (``min_trial_s``) that the clock and launch overheads do not count."""
    for _ in range(sizes.warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-7)
    return median_trials(fn, int(min(10_000, max(1, sizes.min_trial_s / one))), sizes, sync)


def median_trials(fn: Callable[[], Any], iters: int, sizes: Sizes, sync: Callable[[], None],
                  before: Callable[[], Any] = lambda: None, per_call: Callable[[float], float] = lambda x: x,
                  ) -> float:
    """The median over ``sizes.trials`` of the seconds per call of ``iters`` back-to-back calls of
    ``fn`` (``fn`` warmed up by the caller): ``before`` each trial (e.g. a barrier), then the
    device synchronised on both sides; ``per_call`` maps each trial's mean (e.g. the slowest
    rank's, or half a round trip)."""
    times = []
    for _ in range(sizes.trials):
        before()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        times.append(per_call((time.perf_counter() - t0) / iters))
    return statistics.median(times)


def _not_measured(mid: str, kind: str, why: str, **extra: Any) -> dict[str, Any]:
    return {"id": mid, "kind": kind, "not_measured": why, **extra}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


# ---- single-device kernels -------------------------------------------------------------------
def bench_gemm(kind: str, sizes: Sizes, peak_tflops: dict[str, float]) -> list[dict[str, Any]]:
    import torch
    dev, sync = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu"), _sync(kind)
    out = []
    for dt, shapes in sizes.gemm:
        for m, n, k in shapes:
            mid = f"gemm/{dt}/{m}x{n}x{k}"
            try:
                a = torch.randn(m, k, device=dev).to(_torch_dtype(dt))
                b = torch.randn(k, n, device=dev).to(_torch_dtype(dt))
                c = torch.empty(m, n, device=dev, dtype=_torch_dtype(dt))
                t = timed(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), sync, sizes)
            except (RuntimeError, MemoryError) as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
                out.append(_not_measured(mid, "gemm", _first_line(e), dtype=dt, m=m, n=n, k=k))
                continue
            finally:
                a = b = c = None  # type: ignore[assignment]
            tf = 2.0 * m * n * k / t / 1e12
            peak = peak_tflops.get(dt)
            out.append({"id": mid, "kind": "gemm", "dtype": dt, "m": m, "n": n, "k": k, "seconds": t,
                        "tflops": tf, **({"fraction_of_peak": tf / peak} if peak else {})})
    return out


def bench_attention(kind: str, sizes: Sizes) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    dev, sync = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu"), _sync(kind)
    dt, h, d = sizes.attention_dtype, sizes.attention_heads, sizes.attention_head_dim
    out = []
    for s in sizes.attention_seqs:
        b = max(1, sizes.attention_tokens // s)
        mid = f"attention/{dt}/s{s}"
        try:
            q, k, v = (torch.randn(b, h, s, d, device=dev).to(_torch_dtype(dt)) for _ in range(3))
            backend, t = _sdpa_time(kind, q, k, v, sync, sizes, F)
        except (RuntimeError, MemoryError) as e:
            out.append(_not_measured(mid, "attention", _first_line(e), dtype=dt, seq=s, batch=b))
            continue
        finally:
            q = k = v = None  # type: ignore[assignment]
        flops = 4.0 * b * s * s * h * d * 0.5  # causal: the cost model's FlashAttention FLOPs
        out.append({"id": mid, "kind": "attention", "dtype": dt, "batch": b, "seq": s, "heads": h, "head_dim": d,
                    "causal": True, "backend": backend, "seconds": t, "tflops": flops / t / 1e12})
    return out


def _sdpa_time(kind: str, q: Any, k: Any, v: Any, sync: Callable[[], None], sizes: Sizes,
               F: Any) -> tuple[str, float]:
    """(backend, seconds) of a causal SDPA forward: FlashAttention on CUDA where torch has it
    (the kernel the cost model's attention_efficiency describes), else torch's choice."""
    def run() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if kind == "cuda":
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return "flash", timed(run, sync, sizes)
        except (ImportError, RuntimeError):
            pass  # no FlashAttention kernel for this part or dtype (or an older torch): torch's default
    return ("default" if kind == "cuda" else "cpu"), timed(run, sync, sizes)


def _elementwise_ops(x: Any, y: Any, z: Any) -> tuple[tuple[str, Callable[[], Any], int], ...]:
    """(name, kernel, tensors it moves) of each elementwise op measured."""
    import torch
    return (("copy", lambda: z.copy_(x), 2),                  # read x, write z
            ("add", lambda: torch.add(x, y, out=z), 3),       # read x, y, write z
            ("scale", lambda: torch.mul(x, 1.5, out=z), 2))   # read x, write z


def bench_elementwise(kind: str, sizes: Sizes, hbm_gbps: float) -> list[dict[str, Any]]:
    import torch
    dev, sync = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu"), _sync(kind)
    dt = sizes.elementwise_dtype
    es = DTYPE_BYTES[dt]
    out = []
    for nbytes in sizes.elementwise_bytes:
        n = nbytes // es
        try:
            x = torch.ones(n, device=dev, dtype=_torch_dtype(dt))
            y = torch.ones(n, device=dev, dtype=_torch_dtype(dt))
            z = torch.empty(n, device=dev, dtype=_torch_dtype(dt))
        except (RuntimeError, MemoryError) as e:
            out.append(_not_measured(f"elementwise/{size_label(nbytes)}", "elementwise", _first_line(e),
                                     dtype=dt, tensor_bytes=nbytes))
            continue
        for op, fn, tensors in _elementwise_ops(x, y, z):
            mid = f"elementwise/{op}/{dt}/{size_label(nbytes)}"
            try:
                t = timed(fn, sync, sizes)
            except (RuntimeError, MemoryError) as e:
                out.append(_not_measured(mid, "elementwise", _first_line(e), op=op, dtype=dt, tensor_bytes=nbytes))
                continue
            moved = tensors * n * es
            gbps = moved / t / 1e9
            out.append({"id": mid, "kind": "elementwise", "op": op, "dtype": dt, "tensor_bytes": n * es,
                        "bytes_moved": moved, "seconds": t, "gbps": gbps, "fraction_of_peak": gbps / hbm_gbps})
        x = y = z = None  # type: ignore[assignment]
    return out


# ---- collectives (inside torchrun) -------------------------------------------------------------
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "send_recv": lambda n: 1.0}
"""nccl-tests' bus bandwidth factors (the same ring terms as cost.comm)."""
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _collective_fn(op: str, size_elems: int, n: int, group: Any, dev: Any, dtype: Any) -> Callable[[], Any]:
    import torch
    import torch.distributed as dist
    per = max(1, size_elems // n)
    if op == "all_reduce":
        t = torch.ones(per * n, device=dev, dtype=dtype)
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather":
        inp, out = torch.ones(per, device=dev, dtype=dtype), torch.empty(per * n, device=dev, dtype=dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        return lambda: gather(out, inp, group=group)
    if op == "reduce_scatter":
        inp, out = torch.ones(per * n, device=dev, dtype=dtype), torch.empty(per, device=dev, dtype=dtype)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp, group=group)
    if op == "all_to_all":
        inp, out = torch.ones(per * n, device=dev, dtype=dtype), torch.empty(per * n, device=dev, dtype=dtype)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    raise ValueError(op)


def _group_max(x: float, group: Any, dev: Any) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([x], device=dev, dtype=torch.float64 if dev.type == "cpu" else torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _time_collective(fn: Callable[[], Any], iters: int, sizes: Sizes, sync: Callable[[], None],
                     group: Any, dev: Any) -> float:
    """Seconds per collective: the median over trials of the slowest rank's mean."""
    import torch.distributed as dist
    for _ in range(sizes.warmup):
        fn()
    sync()
    return median_trials(fn, iters, sizes, sync, before=lambda: dist.barrier(group=group),
                         per_call=lambda s: _group_max(s, group, dev))


def _record(op: str, tier: str, n: int, stride: int, nbytes: int, t: float, backend: str) -> dict[str, Any]:
    algbw = nbytes / t / 1e9
    return {"id": f"{op}/{tier}/n{n}/{size_label(nbytes)}", "kind": "collective", "op": op, "tier": tier,
            "n": n, "stride": stride, "bytes": nbytes, "backend": backend, "seconds": t, "algbw_gbps": algbw,
            "busbw_gbps": algbw * BUS_FACTOR[op](n)}


def _collectives(group: Any, n: int, stride: int, tier: str, sizes: Sizes, dev: Any, backend: str,
                 ) -> list[dict[str, Any]]:
    """Every collective of COLLECTIVES at every message size on ``group`` (n ranks, ``stride`` apart)."""
    sync, dtype = _sync(dev.type), _torch_dtype(sizes.collective_dtype)
    es = DTYPE_BYTES[sizes.collective_dtype]
    out: list[dict[str, Any]] = []
    for op in COLLECTIVES:
        for nbytes in sizes.collective_bytes:
            elems = nbytes // es // n * n
            try:
                fn = _collective_fn(op, elems, n, group, dev, dtype)
                t = _time_collective(fn, sizes.collective_iters(nbytes), sizes, sync, group, dev)
            except (RuntimeError, NotImplementedError, ValueError, MemoryError) as e:
                # the backend lacks it (gloo: reduce-scatter, all-to-all on some builds): say so, go on
                out.append(_not_measured(f"{op}/{tier}/n{n}", "collective", f"{backend}: {_first_line(e)}",
                                         op=op, tier=tier, n=n, stride=stride, backend=backend))
                break
            out.append(_record(op, tier, n, stride, elems * es, t, backend))
    return out


def _send_recv(a: int, b: int, tier: str, sizes: Sizes, dev: Any, backend: str) -> list[dict[str, Any]]:
    """One-way send/recv between global ranks ``a`` and ``b`` (a ping-pong, halved). Only they take
    part; rank ``a`` records."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    if rank not in (a, b):
        return []
    sync, dtype = _sync(dev.type), _torch_dtype(sizes.collective_dtype)
    es = DTYPE_BYTES[sizes.collective_dtype]
    out: list[dict[str, Any]] = []
    for nbytes in sizes.collective_bytes:
        t_ = torch.ones(nbytes // es, device=dev, dtype=dtype)
        peer = b if rank == a else a

        def ping(t_: Any = t_, peer: int = peer) -> None:
            if rank == a:
                dist.send(t_, peer)
                dist.recv(t_, peer)
            else:
                dist.recv(t_, peer)
                dist.send(t_, peer)
        try:
            for _ in range(sizes.warmup):
                ping()
            sync()
            one_way = median_trials(ping, sizes.collective_iters(nbytes), sizes, sync, per_call=lambda s: s / 2)
        except (RuntimeError, NotImplementedError, ValueError, MemoryError) as e:
            out.append(_not_measured(f"send_recv/{tier}/n2", "collective", f"{backend}: {_first_line(e)}",
                                     op="send_recv", tier=tier, n=2, stride=b - a, backend=backend))
            break
        out.append(_record("send_recv", tier, 2, b - a, nbytes, one_way, backend))
    return out


def worker_main(out_path: str) -> int:
    """One rank of the collectives benchmark (started by torchrun). Rank 0 writes the results."""
    import torch.distributed as dist

    from meshplan.runtime.train import init_distributed
    dev = init_distributed(float(os.environ.get("MESHPLAN_PG_TIMEOUT", PG_TIMEOUT_S)))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // local)
    backend = str(dist.get_backend())
    sizes = GPU_SIZES if dev.type == "cuda" else CPU_SIZES
    res: list[dict[str, Any]] = []
    # within a node: each node's ranks (new_group is called by every rank, for every group, in order)
    if nodes > 1:
        groups = [dist.new_group(list(range(i * local, (i + 1) * local))) for i in range(nodes)]
        intra = groups[rank // local]
    else:
        intra = None  # the default group
    if local > 1:
        res += _collectives(intra, local, 1, "intra_node", sizes, dev, backend)
        res += _send_recv(0, 1, "intra_node", sizes, dev, backend) if rank // local == 0 else []
    else:
        res.append(_not_measured("intra_node", "collective", "one process per node: no link within a node to "
                                 "measure", tier="intra_node"))
    dist.barrier()
    if nodes > 1:
        heads = [i * local for i in range(nodes)]
        inter = dist.new_group(heads)
        if rank in heads:
            res += _collectives(inter, nodes, local, "inter_node", sizes, dev, backend)
        res += _send_recv(0, local, "inter_node", sizes, dev, backend)
    else:
        res.append(_not_measured("inter_node", "collective",
                                 "one node: inter-node links were not measured (run --bench on every node with "
                                 "--nnodes, --node-rank and --rdzv-endpoint to measure them)", tier="inter_node"))
    dist.barrier()
    if rank == 0:
        Path(out_path).write_text(json.dumps({"backend": backend, "world_size": world, "local_world_size": local,
                                              "nodes": nodes, "measurements": res}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def torchrun_argv(req: BenchRequest, nproc: int, out_path: str) -> list[str]:
    """The collectives worker's torchrun command line (through launch.torchrun_main, as `meshplan
    train` starts its ranks)."""
    cmd = [sys.executable, "-m", "meshplan.runtime.launch", f"--nproc-per-node={nproc}", f"--nnodes={req.nnodes}",
           "--max-restarts=0"]
    if req.nnodes == 1 and not req.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        # static rendezvous: the node ranks as given (c10d would number the nodes by arrival), so that
        # node 0 holds global rank 0, which writes the results its launcher reads
        cmd += ["--rdzv-backend=static", f"--rdzv-endpoint={req.rdzv_endpoint}", f"--node-rank={req.node_rank}"]
    return cmd + ["-m", "meshplan.runtime.bench", "--worker", out_path]


def run_collectives(req: BenchRequest, nproc: int, progress: Callable[[str], None]) -> dict[str, Any] | None:
    """Start the collectives worker under torchrun; its results (None on a node other than 0)."""
    with tempfile.TemporaryDirectory(prefix="meshplan-bench-") as tmp:
        path = str(Path(tmp) / "collectives.json")
        progress(f"collectives: {nproc * req.nnodes} processes under torchrun")
        try:
            run_torchrun(torchrun_argv(req, nproc, path), req.pg_timeout_s)
        except MeshplanError as e:
            raise MeshplanError(str(e).replace("training failed", "--bench: the collectives benchmark failed", 1),
                                hint="the ranks' errors are printed above") from None
        if not Path(path).is_file():
            return None
        return json.loads(Path(path).read_text())


def require_torch() -> None:
    """--bench measures through torch: a one-line MeshplanError where it is not installed."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise MeshplanError("--bench needs torch (it measures through torch)",
                            hint="install torch (scripts/setup.sh), or fit --runs / --metrics only") from None


def run_bench(req: BenchRequest, progress: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Measure; the raw results (None on a node other than node 0, which only takes part in the
    collectives). Bad options raise MeshplanError before anything runs."""
    import torch

    from meshplan.spec.base import to_dict
    say = progress or (lambda s: None)
    kind = device_kind()
    check_request(req, kind)
    nproc = req.nproc_per_node or (torch.cuda.device_count() if kind == "cuda" else 2)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    if kind == "cpu":
        torch.set_num_threads(1)  # one core per process: the `local-cpu` device
    try:
        cluster = reference_cluster(req, kind, nproc)
        gpu = cluster.gpu
        out: dict[str, Any] = {
            "schema_version": BENCH_SCHEMA_VERSION, "kind": "bench", "device_kind": kind,
            "device_name": device_name(kind), "device_count": torch.cuda.device_count() if kind == "cuda" else 0,
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "nproc_per_node": nproc, "nnodes": req.nnodes,
            "reference": {"gpu": gpu.name, "cluster": to_dict(cluster),
                          "basis": (f"GPU preset {gpu.name}" if kind == "cuda" else
                                    "this CPU as the `local-cpu` device: one core per process, its measured "
                                    "single-thread fp32 matmul rate as the peak, an assumed DRAM and loopback "
                                    "bandwidth")},
            "measurements": []}
        ms: list[dict[str, Any]] = out["measurements"]
        if req.node_rank == 0:
            say(f"GEMMs on {out['device_name']}")
            ms += bench_gemm(kind, CPU_SIZES if kind == "cpu" else GPU_SIZES,
                             {d: gpu.peak_tflops[d] for d in ("fp32", "bf16", "fp16") if d in gpu.peak_tflops})
            say("attention")
            ms += bench_attention(kind, CPU_SIZES if kind == "cpu" else GPU_SIZES)
            say("elementwise (memory bandwidth)")
            ms += bench_elementwise(kind, CPU_SIZES if kind == "cpu" else GPU_SIZES, gpu.hbm_bandwidth_gbps)
            if kind == "cuda":
                torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)
    if nproc * req.nnodes > 1:
        coll = run_collectives(req, nproc, say)
        if coll is None:
            return None
        out["backend"] = coll["backend"]
        ms += coll["measurements"]
    else:
        out["backend"] = None
        ms.append(_not_measured("collectives", "collective", "one device: no collective to measure (a node with "
                                "several devices, or --nproc-per-node, measures them)"))
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def worker_cli(argv: list[str]) -> int:
    """``python -m meshplan.runtime.bench --worker OUT``: one rank of the collectives benchmark."""
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m meshplan.runtime.bench --worker OUT.json (started by torchrun)", file=sys.stderr)
        return 2
    return run_reporting_lost_peers(worker_main, argv[1])


if __name__ == "__main__":
    _rc = worker_cli(sys.argv[1:])
    if in_torchrun():
        exit_worker(int(_rc or 0))
    sys.exit(_rc)
