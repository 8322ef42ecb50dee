"""Weak links: local SGD and DiLoCo (inner groups, an outer sync every ``sync_every`` steps) and
gradient compression (bf16, fp8, PowerSGD), on stock torch.distributed.

Groups (runtime/mesh.py). A periodic plan (grad_sync=local-sgd or diloco) splits the dp ranks into
``workers`` inner groups of ``inner_dp`` consecutive dp ranks (``inner_dp_of``: spec.sync.inner_dp on
the run's topology: sync_scope=all 1, node LOCAL_WORLD_SIZE / (tp*cp), dc --nodes-per-dc nodes'
worth). Inside a group the plan's data parallelism runs every step as usual, over inner dp x cp
(DDP, the manual all-reduce, or FSDP2 sharded over inner dp x cp); the outer group of a rank is the
ranks at its coordinate (pp, position in its inner group, cp, tp) in every inner group, ``workers``
of them. Both come from one unflattening of the dp x cp mesh dim: (dp_replicate = workers,
dp_shard = inner dp x cp).

The outer sync (``OuterSync``, every ``sync_every`` optimizer steps, after the inner step) runs on
each rank's local tensors of its parameters (FSDP2/TP shards: the DTensors' local shards; the
same shard on every rank of an outer group, since the inner meshes are alike):

- local-sgd, no compression: the parameters averaged over the outer group (one all-reduce of the
  flattened fp32 parameters, divided by ``workers``; torch's model_averaging does the same);
- local-sgd with compression: the last averaged parameters are kept (the anchor, fp32), the
  deltas anchor - params are averaged compressed, and params = anchor = anchor - mean delta
  (uncompressed this equals the average);
- diloco (Douillard et al. 2023): outer gradient delta = anchor - params, averaged over the outer
  group (compressed per grad_compression, dequantised before use), then outer SGD with Nesterov
  momentum on the fp32 anchor (torch.optim.SGD(nesterov=True)'s arithmetic: v = mu v + delta,
  anchor -= lr (delta + mu v); v starts at 0), and params = anchor on every rank. The inner
  optimizer's state stays each worker's own (the paper's).

Compression (``Compression``): the per-step gradient sync of synchronous plans (DDP's comm hook:
``torch``'s bf16_compress_hook on NCCL, the same arithmetic in ``bf16_hook`` on gloo, which torch's
refuses by name; ``fp8_hook``; PowerSGD's ``powerSGD_hook``; the manual all-reduce under TP/PP/EP
calls the same hooks on a flat buffer, ``FlatBucket``; FSDP2: bf16 as its reduce_dtype, fp8 as its
custom reduce-scatter, ``fp8_reduce_scatter``), or the outer sync of periodic plans. fp8:
values scaled per block of ``FP8_BLOCK`` elements (amax / 448), cast to float8_e4m3fn, all-gathered
as bytes with their fp32 scales (one all_gather of uint8: no collective sums fp8), dequantised and
averaged in fp32 in rank order (every rank gets the same numbers).
"""
from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshplan.errors import MeshplanError
from meshplan.spec.plan import Plan

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
"""448: the largest float8_e4m3fn; a block's amax is scaled to it."""
FP8_BLOCK = 1024
"""Elements per fp8 scale (4 bytes of scale per 1,024 bytes of values)."""
OUTER_BUCKET = 1 << 24
"""Elements per flattened buffer of the outer sync (64 MiB in fp32): its transient memory."""
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
"""DiLoCo's outer Nesterov SGD defaults (the paper's)."""
POWERSGD_START = 2
"""PowerSGD's start_powerSGD_iter: the first steps all-reduce plainly (torch needs > 1 with error
feedback and warm start)."""
POWERSGD_EPSILON = 1e-8
"""PowerSGD's orthogonalization_epsilon (torch's default is 0): a gradient matrix that is all zeros
(a vocabulary-parallel embedding shard of tokens no batch holds, a parameter without a gradient)
makes P = 0, whose Gram-Schmidt divides 0 by 0: NaN in every gradient from then on (found on
tiny-llama tp=2,dp=2: the byte corpus never uses tokens 128-255, tp rank 1's embedding shard)."""


# ---- groups ------------------------------------------------------------------------------------
def inner_dp_of(plan: Plan, procs_per_node: int, nodes_per_dc: int | None = None) -> int:
    """Data-parallel ranks per inner group of ``plan`` on this run's topology (``plan.dp`` for
    synchronous plans): spec.sync.inner_dp with a node of ``procs_per_node`` processes and a
    datacenter of ``nodes_per_dc`` nodes (needed for sync_scope=dc)."""
    if not plan.periodic:
        return plan.dp
    if plan.sync_scope == "dc" and not nodes_per_dc:
        raise MeshplanError("sync_scope=dc: the runtime does not know which nodes share a datacenter",
                            hint="pass --nodes-per-dc N (nodes per datacenter), or use sync_scope=node or all")
    from meshplan.spec.sync import inner_dp
    topo = types.SimpleNamespace(gpus_per_node=procs_per_node, gpus_per_dc=procs_per_node * (nodes_per_dc or 1))
    n = int(inner_dp(plan.dp, plan.tp, plan.cp, plan.sync_scope, topo))
    if plan.dp % n or plan.dp // n < 2:
        raise MeshplanError(f"sync_scope={plan.sync_scope}: {n} data-parallel ranks per {plan.sync_scope} leave "
                            f"{plan.dp / n:g} inner groups of dp={plan.dp} (needs a whole number, at least 2)",
                            hint="use a narrower sync_scope, or more nodes")
    return n


# ---- compression of a flat buffer --------------------------------------------------------------
def fp8_quantize(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D) as bytes: float8_e4m3fn values scaled per block of FP8_BLOCK (zero-padded to whole
    blocks), then the blocks' fp32 scales."""
    n = x.numel()
    blocks = max(1, math.ceil(n / FP8_BLOCK))
    v = torch.zeros(blocks * FP8_BLOCK, dtype=torch.float32, device=x.device)
    v[:n] = x.reshape(-1)
    v = v.view(blocks, FP8_BLOCK)
    scale = v.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (v / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([q.view(torch.uint8).reshape(-1), scale.view(torch.uint8)])


def fp8_dequantize(payload: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 values (``n`` of them) of one ``fp8_quantize`` payload."""
    blocks = max(1, math.ceil(n / FP8_BLOCK))
    q = payload[:blocks * FP8_BLOCK].view(FP8).float().view(blocks, FP8_BLOCK)
    scale = payload[blocks * FP8_BLOCK:].view(torch.float32)
    return (q * scale[:, None]).reshape(-1)[:n]


def _fp8_mean(gathered: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of the dequantised rows of ``gathered`` (one payload per rank), summed in rank order."""
    return fp8_sum_rows(gathered, n).div_(gathered.shape[0])


def _fp8_gather(x: torch.Tensor, group: Any, async_op: bool) -> tuple[Any, torch.Tensor]:
    payload = fp8_quantize(x)
    world = dist.get_world_size(group)
    out = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
    work = dist.all_gather_into_tensor(out, payload, group=group, async_op=async_op)
    return work, out.view(world, -1)


def mean_over(x: torch.Tensor, group: Any, compression: str) -> torch.Tensor:
    """The mean of the 1-D fp32 ``x`` over ``group``, sent as ``compression`` (none, bf16, fp8);
    returns ``x`` (overwritten) or a new tensor. bf16: cast, divided by the group size, summed in
    bf16 (bf16_compress_hook's arithmetic); fp8: ``fp8_quantize``d, all-gathered, averaged in fp32."""
    world = dist.get_world_size(group)
    if compression == "fp8":
        _, gathered = _fp8_gather(x, group, async_op=False)
        return x.copy_(_fp8_mean(gathered, x.numel()))
    if compression == "bf16":
        c = x.to(torch.bfloat16).div_(world)
        dist.all_reduce(c, group=group)
        return x.copy_(c)
    dist.all_reduce(x, group=group)
    return x.div_(world)


# ---- DDP communication hooks -------------------------------------------------------------------
def bf16_hook(group, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP inspects the annotations
    """torch's bf16_compress_hook (bucket cast to bf16 and divided by the group size, all-reduced,
    cast back into the bucket), under another name: DDP refuses the torch hook by its name unless
    NCCL >= 2.10 runs it, although gloo all-reduces bf16."""
    buf = bucket.buffer()
    c = buf.to(torch.bfloat16).div_(dist.get_world_size(group))

    def back(fut: Any) -> torch.Tensor:
        return buf.copy_(fut.value()[0])
    return dist.all_reduce(c, group=group, async_op=True).get_future().then(back)


def fp8_hook(group, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP inspects the annotations
    """The bucket quantised to fp8 per block (``fp8_quantize``), all-gathered as bytes with the
    scales, dequantised and averaged in fp32 into the bucket."""
    buf = bucket.buffer()
    work, gathered = _fp8_gather(buf, group, async_op=True)

    def done(_: Any) -> torch.Tensor:
        return buf.copy_(_fp8_mean(gathered, buf.numel()))
    return work.get_future().then(done)


def fp8_sum_rows(gathered: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of the dequantised rows of ``gathered`` (one payload per rank), in rank order."""
    total = torch.zeros(n, dtype=torch.float32, device=gathered.device)
    for row in gathered:
        total += fp8_dequantize(row, n)
    return total


def fp8_reduce_scatter():  # type: ignore[no-untyped-def]
    """FSDP2's reduce-scatter with fp8 on the wire (``FSDPModule.set_custom_reduce_scatter``): each
    rank's chunk for rank j quantised (``fp8_quantize``), exchanged by one all_to_all of bytes,
    the chunks this rank receives dequantised and summed in fp32 (averaged for ReduceOp.AVG), then
    written in FSDP's reduce dtype. What goes over the wire: (world-1)/world x (1 + 4/FP8_BLOCK)
    bytes per element of the unsharded gradient, a quarter of an fp32 reduce-scatter."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class Fp8ReduceScatter(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> None:
            world, n = dist.get_world_size(group), output_tensor.numel()
            send = torch.stack([fp8_quantize(c) for c in input_tensor.view(world, n).float()])
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            total = fp8_sum_rows(recv, n)
            if op == dist.ReduceOp.AVG:
                total /= world
            elif op != dist.ReduceOp.SUM:
                raise RuntimeError(f"fp8 reduce-scatter: FSDP2 asked for {op}; only SUM and AVG are run")
            output_tensor.copy_(total)
            return None
    return Fp8ReduceScatter()


class FlatBucket:
    """What a DDP communication hook reads of a ``dist.GradBucket`` (not constructible from
    Python), for the manual all-reduce: a flat buffer and its per-parameter views."""

    def __init__(self, buffer: torch.Tensor, shapes: list[torch.Size], index: int = 0) -> None:
        self._buffer, self._index = buffer, index
        self._grads, at = [], 0
        for s in shapes:
            n = math.prod(s)
            self._grads.append(buffer[at:at + n].view(s))
            at += n

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return []


@dataclass
class Compression:
    """The per-step gradient compression of a synchronous plan over one group: a DDP hook and its
    state (``register``), or the same hook on a flat buffer (``mean``, the manual all-reduce)."""

    kind: str
    """bf16, fp8 or powersgd."""
    rank: int = 1
    """PowerSGD's matrix_approximation_rank."""
    states: dict[Any, Any] = field(default_factory=dict)
    """PowerSGD state per (process group, bucket key)."""

    def hook(self) -> Callable[..., Any]:
        if self.kind == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook
            return powerSGD_hook
        if self.kind == "bf16":
            if dist.get_backend() == "nccl":
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
                return bf16_compress_hook
            return bf16_hook
        return fp8_hook

    def state(self, group: Any, key: Any = 0) -> Any:
        """The hook's state: the process group, or a PowerSGDState (one per group and key)."""
        if self.kind != "powersgd":
            return group
        if (id(group), key) not in self.states:
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
            self.states[(id(group), key)] = PowerSGDState(
                process_group=group, matrix_approximation_rank=self.rank, start_powerSGD_iter=POWERSGD_START,
                min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0,
                orthogonalization_epsilon=POWERSGD_EPSILON)
        return self.states[(id(group), key)]

    def register(self, ddp: Any, group: Any) -> None:
        ddp.register_comm_hook(self.state(group, id(ddp)), self.hook())

    def mean(self, grads: list[torch.Tensor], group: Any, key: Any = 0) -> None:
        """Average ``grads`` (local tensors) over ``group`` through the hook, in place."""
        from torch._utils import _flatten_dense_tensors
        flat = _flatten_dense_tensors(grads)
        bucket = FlatBucket(flat, [g.shape for g in grads])
        out = self.hook()(self.state(group, key), bucket).wait()
        at = 0
        for g in grads:
            n = g.numel()
            g.copy_(out[at:at + n].view_as(g))
            at += n


def compression_of(plan: Plan) -> Compression | None:
    """The per-step compression of a synchronous plan (None: none, or a periodic plan, whose
    compression is the outer sync's)."""
    if plan.periodic or plan.grad_compression == "none":
        return None
    return Compression(plan.grad_compression, plan.compression_rank)


# ---- the outer sync ----------------------------------------------------------------------------
def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return p.to_local() if isinstance(p, DTensor) else p


def _buckets(tensors: list[torch.Tensor], size: int = OUTER_BUCKET) -> Iterator[list[int]]:
    """Indices of ``tensors`` in runs of at most ``size`` elements (one tensor alone if larger)."""
    run: list[int] = []
    n = 0
    for i, t in enumerate(tensors):
        if run and n + t.numel() > size:
            yield run
            run, n = [], 0
        run.append(i)
        n += t.numel()
    if run:
        yield run


class OuterSync:
    """The outer synchronisation of a local-sgd or diloco run on this rank (module doc): the anchor
    and outer momentum (fp32, shaped like this rank's local shards, on their device), the step of
    the last sync (``last_sync``: the position in the outer period)."""

    def __init__(self, plan: Plan, params: list[torch.Tensor], group: Any, device: torch.device, *,
                 lr: float = OUTER_LR, momentum: float = OUTER_MOMENTUM) -> None:
        self.method, self.every, self.compression = plan.grad_sync, plan.sync_every, plan.grad_compression
        self.params, self.group, self.device = params, group, device
        self.workers = dist.get_world_size(group)
        self.lr, self.mu = lr, momentum
        self.last_sync = 0
        self.syncs = 0
        """Outer syncs done by this process (not saved; for tests and notes)."""
        self.anchor: list[torch.Tensor] | None = None
        self.momentum: list[torch.Tensor] | None = None
        if self.method == "diloco" or self.compression != "none":
            self.anchor = [_local(p).detach().float().clone() for p in params]
        if self.method == "diloco":
            self.momentum = [torch.zeros_like(a) for a in self.anchor]  # type: ignore[union-attr]

    def due(self, step: int) -> bool:
        return step - self.last_sync >= self.every

    @torch.no_grad()
    def reset(self, step: int) -> None:
        """The anchor set to the current parameters, momentum to 0, the period starting at ``step``
        (a run resumed from a synchronous checkpoint: every worker holds the same model)."""
        if self.anchor is not None:
            for a, p in zip(self.anchor, self.params):
                a.copy_(_local(p))
        if self.momentum is not None:
            for v in self.momentum:
                v.zero_()
        self.last_sync = step

    @torch.no_grad()
    def sync(self, step: int) -> None:
        """The outer step (module doc), on every rank of the job (collective over the outer group)."""
        local = [_local(p) for p in self.params]
        if self.anchor is None:  # local SGD, uncompressed: average the parameters
            for idx in _buckets(local):
                flat = torch.cat([local[i].reshape(-1).float() for i in idx]).to(self.device)
                flat = mean_over(flat, self.group, "none")
                self._scatter(flat, [local[i] for i in idx])
        else:
            for idx in _buckets(local):
                anchors = [self.anchor[i] for i in idx]
                delta = torch.cat([(a - p.float()).reshape(-1) for a, p in zip(anchors, (local[i] for i in idx))])
                delta = mean_over(delta.to(self.device), self.group, self.compression)
                deltas = self._views(delta, anchors)
                if self.momentum is None:  # local SGD: anchor - mean delta = the average
                    torch._foreach_sub_(anchors, deltas)
                else:  # DiLoCo: outer SGD, Nesterov momentum
                    vs = [self.momentum[i] for i in idx]
                    torch._foreach_mul_(vs, self.mu)
                    torch._foreach_add_(vs, deltas)
                    step_dir = torch._foreach_add(deltas, vs, alpha=self.mu)
                    torch._foreach_add_(anchors, step_dir, alpha=-self.lr)
                for a, i in zip(anchors, idx):
                    local[i].copy_(a)
        self.last_sync = step
        self.syncs += 1

    @staticmethod
    def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        out, at = [], 0
        for t in like:
            out.append(flat[at:at + t.numel()].view_as(t).to(t.device))
            at += t.numel()
        return out

    def _scatter(self, flat: torch.Tensor, into: list[torch.Tensor]) -> None:
        for t, v in zip(into, self._views(flat, into)):
            t.copy_(v)

    def state_bytes_per_param(self) -> int:
        """Bytes this rank keeps per element of its local shards: anchor and momentum, fp32."""
        return 4 * ((self.anchor is not None) + (self.momentum is not None))
