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

Overlapped (sync_overlap = tau >= 1, < sync_every; streaming DiLoCo's delayed outer step): at the
sync step t the local parameters are copied (the snapshot, fp32, shaped and placed like them) and
the outer sync above runs on that snapshot on a thread (``OuterSync.launch``: its own process
group, the outer group's ranks, since the main thread goes on issuing collectives; one bucket at a
time; the anchor and momentum updated exactly as the blocking sync would at t; the snapshot then
overwritten by the correction new_anchor - params_at_t), while inner steps t+1 .. t+tau run as if
no sync happened. After inner step t+tau the main thread joins the thread and adds the correction:
params = params_now + (new_anchor - params_at_t), keeping the tau steps' local progress; the next
sync's delta is anchor - params as before. tau = 0 is the blocking sync, unchanged.

Compression (``Compression``): the per-step gradient sync of synchronous plans (DDP's comm hook:
``torch``'s bf16_compress_hook on NCCL, the same arithmetic in ``bf16_hook`` on gloo, which torch's
refuses by name; ``fp8_hook``; PowerSGD's ``powerSGD_hook``; the manual all-reduce under TP/PP/EP
calls the same hooks on a flat buffer, ``FlatBucket``; FSDP2: bf16 as its reduce_dtype, fp8 as its
custom reduce-scatter, ``fp8_reduce_scatter``), or the outer sync of periodic plans. fp8:
values scaled per block of ``FP8_BLOCK`` elements (amax / 448), cast to float8_e4m3fn, and averaged
by a two-shot all-reduce of bytes (``fp8_all_reduce``; no collective sums fp8): the buffer cut into
``world`` slices of whole blocks (zero-padded), slice j of every rank sent to rank j (one
all_to_all of the quantised slices with their fp32 scales), rank j dequantises and sums them in
fp32 in rank order and divides by ``world``, quantises its summed slice again, and every slice is
all-gathered and dequantised (every rank gets the same numbers). Per rank that moves
2 (world-1)/world x (1 + 4/FP8_BLOCK) bytes per element, the ring's volume at one byte a value.
"""
from __future__ import annotations

import math
import threading
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
    if plan.mesh_order is not None:  # a placement: each inner group must still lie in one scope unit
        unit = topo.gpus_per_node if plan.sync_scope == "node" else topo.gpus_per_dc
        grid = plan.dims.rank_grid()  # (pp, dp, cp, tp): inner group = n consecutive dp x all cp
        for block in grid.reshape(plan.pp, plan.dp // n, n * plan.cp, plan.tp).transpose(0, 1, 3, 2).reshape(
                -1, n * plan.cp):
            if len({int(r) // unit for r in block}) > 1:
                ranks = ",".join(str(int(r)) for r in block)
                raise MeshplanError(
                    f"sync_scope={plan.sync_scope} with mesh_order={':'.join(plan.mesh_order)}: the inner group of "
                    f"ranks {ranks} spans several {plan.sync_scope}s of {unit} processes under this placement",
                    hint="put dp and cp innermost (e.g. mesh_order=pp:tp:dp:cp), use sync_scope=all, or the default "
                         "mesh_order")
    return n


# ---- compression of a flat buffer --------------------------------------------------------------
def fp8_quantize(x: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """``x`` (1-D) as bytes: float8_e4m3fn values scaled per block of FP8_BLOCK, zero-padded to
    ``size`` elements (a multiple of FP8_BLOCK; default: whole blocks, at least one), then the
    blocks' fp32 scales (amax / 448; 1 for a block of zeros)."""
    n = x.numel()
    size = size if size is not None else max(1, math.ceil(n / FP8_BLOCK)) * FP8_BLOCK
    assert size % FP8_BLOCK == 0 and size >= n, (size, n)
    blocks = size // FP8_BLOCK
    v = torch.zeros(size, dtype=torch.float32, device=x.device)
    v[:n] = x.reshape(-1)
    v = v.view(blocks, FP8_BLOCK)
    scale = v.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (v / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([q.view(torch.uint8).reshape(-1), scale.view(torch.uint8)])


def fp8_dequantize(payload: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 values (the first ``n``) of one ``fp8_quantize`` payload."""
    blocks = payload.numel() // (FP8_BLOCK + 4)
    q = payload[:blocks * FP8_BLOCK].view(FP8).float().view(blocks, FP8_BLOCK)
    scale = payload[blocks * FP8_BLOCK:].view(torch.float32)
    return (q * scale[:, None]).reshape(-1)[:n]


def fp8_sum_rows(gathered: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of the dequantised rows of ``gathered`` (one payload per rank), in rank order."""
    total = torch.zeros(n, dtype=torch.float32, device=gathered.device)
    for row in gathered:
        total += fp8_dequantize(row, n)
    return total


# The two-shot fp8 all-reduce (``fp8_all_reduce``), in three local pieces around its two collectives.
def fp8_chunk(n: int, world: int) -> int:
    """Elements of each rank's slice of an ``n``-element buffer: ceil(n / world), rounded up to whole
    FP8_BLOCKs (so the first quantisation's blocks never straddle two slices)."""
    return max(1, math.ceil(n / (world * FP8_BLOCK))) * FP8_BLOCK


def fp8_pack(x: torch.Tensor, world: int, chunk: int) -> torch.Tensor:
    """(world, payload) bytes: slice j of ``x`` (elements j*chunk ..; the last ones zero-padded,
    whole slices of padding past the end) quantised on its own, row j for rank j."""
    flat = x.reshape(-1)
    return torch.stack([fp8_quantize(flat[j * chunk:(j + 1) * chunk], chunk) for j in range(world)])


def fp8_reduce_slice(received: torch.Tensor, chunk: int, divide: int = 1) -> torch.Tensor:
    """This rank's slice reduced: the received payloads (one per rank, rank order) dequantised and
    summed in fp32, divided by ``divide`` (the group size for a mean), quantised again."""
    total = fp8_sum_rows(received, chunk)
    if divide != 1:
        total /= divide
    return fp8_quantize(total, chunk)


def fp8_unpack(gathered: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    """The fp32 buffer (``n`` values) from every rank's reduced slice (rows in rank order)."""
    return torch.cat([fp8_dequantize(row, chunk) for row in gathered])[:n]


def fp8_all_reduce(x: torch.Tensor, group: Any, divide: int = 1) -> tuple[torch.Tensor, Any, torch.Tensor, int]:
    """Start the two-shot fp8 all-reduce of the 1-D ``x`` over ``group`` (module doc): quantise per
    slice, all_to_all (waited: the next collective needs its result; on NCCL the wait only orders
    streams), sum this rank's slice in fp32 (divided by ``divide``), quantise it, launch the
    all_gather. Returns (the gathered bytes, the all_gather's work, its input: keep it until the
    wait, chunk); ``fp8_unpack`` the bytes after the wait. Both collectives are issued here, by the
    caller's thread, in one order on every rank."""
    world = dist.get_world_size(group)
    chunk = fp8_chunk(x.numel(), world)
    send = fp8_pack(x, world, chunk)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group, async_op=True).wait()
    del send
    mine = fp8_reduce_slice(recv, chunk, divide)
    del recv
    out = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)  # flat: gloo's
    work = dist.all_gather_into_tensor(out, mine, group=group, async_op=True)
    return out.view(world, -1), work, mine, chunk


def fp8_mean(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The mean of the 1-D fp32 ``x`` over ``group`` by the two-shot fp8 all-reduce, into ``x``."""
    out, work, _, chunk = fp8_all_reduce(x, group, dist.get_world_size(group))
    work.wait()
    return x.copy_(fp8_unpack(out, chunk, x.numel()))


def mean_over(x: torch.Tensor, group: Any, compression: str) -> torch.Tensor:
    """The mean of the 1-D fp32 ``x`` over ``group``, sent as ``compression`` (none, bf16, fp8);
    returns ``x`` (overwritten) or a new tensor. bf16: cast, divided by the group size, summed in
    bf16 (bf16_compress_hook's arithmetic); fp8: the two-shot fp8 all-reduce (``fp8_mean``)."""
    world = dist.get_world_size(group)
    if compression == "fp8":
        return fp8_mean(x, group)
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
    """The bucket averaged by the two-shot fp8 all-reduce (``fp8_all_reduce``: all_to_all of fp8
    slices, fp32 sum of this rank's slice, fp8 all_gather), dequantised into the bucket when the
    all_gather completes. The all_to_all is waited inside the hook: the all_gather needs its
    result, and a collective issued from a future's callback would run on the backend's thread,
    where it could be issued before or after the next bucket's on different ranks."""
    buf = bucket.buffer()
    out, work, sent, chunk = fp8_all_reduce(buf, group, dist.get_world_size(group))

    def done(_: Any, keep: torch.Tensor = sent) -> torch.Tensor:  # (the all_gather's input lives until now)
        return buf.copy_(fp8_unpack(out, chunk, buf.numel()))
    return work.get_future().then(done)


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


class _Background:
    """One function run on a daemon thread (the overlapped outer sync): ``wait`` joins it and
    raises what it raised. Daemon: a rank that fails elsewhere does not hang at exit on it."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised by wait, on the main thread
                self.error = e
        self.thread = threading.Thread(target=run, name="meshplan-outer-sync", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _own_groups(group: Any) -> Any:
    """A process group of the same ranks as ``group`` (this rank's outer group) that nothing else
    uses: the overlapped sync's thread issues its collectives there while the main thread issues
    others (the outer group can be the default group itself: dp=4 with sync_scope=all). Collective
    over the job: every rank learns every outer group (all_gather_object) and creates them all in
    one order; the timeout is the default group's."""
    mine = dist.get_process_group_ranks(group)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    lists = [list(r) for r in sorted({tuple(r) for r in every})]
    timeout = None
    try:
        default = dist.distributed_c10d._get_default_group()
        timeout = default._get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private API: the default timeout then
        timeout = None
    own, _ = dist.new_subgroups_by_enumeration(lists, timeout=timeout)
    return own


class OuterSync:
    """The outer synchronisation of a local-sgd or diloco run on this rank (module doc): the anchor
    and outer momentum (fp32, shaped like this rank's local shards, on their device), the step of
    the last sync (``last_sync``: the position in the outer period) and, with sync_overlap = tau > 0,
    the sync in flight (``launched``: its step; ``snapshot``: the parameters at it, then the
    correction new anchor - those parameters)."""

    def __init__(self, plan: Plan, params: list[torch.Tensor], group: Any, device: torch.device, *,
                 lr: float = OUTER_LR, momentum: float = OUTER_MOMENTUM) -> None:
        self.method, self.every, self.compression = plan.grad_sync, plan.sync_every, plan.grad_compression
        self.overlap = plan.sync_overlap
        """tau: inner steps the sync runs under before it is applied (0: blocking)."""
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
        self.launched: int | None = None
        """sync_overlap > 0: the step of the sync in flight (launched, not applied yet), else None."""
        self.snapshot: list[torch.Tensor] | None = None
        """While a sync is in flight: fp32 copies of the local parameters at ``launched`` (shaped
        and placed like them); once the thread is done, the correction new anchor - them."""
        self._job: _Background | None = None
        self._group: Any = _own_groups(group) if self.overlap else None
        self._stream: Any = torch.cuda.Stream(device) if self.overlap and device.type == "cuda" else None

    def due(self, step: int) -> bool:
        return step - self.last_sync >= self.every

    def after_step(self, step: int) -> None:
        """After inner step ``step``: apply the sync in flight once its tau steps are done, then
        sync (or launch the sync) when due."""
        if self.launched is not None and step >= self.launched + self.overlap:
            self.apply()
        if self.due(step):
            self.sync(step)

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
        """The outer step (module doc), on every rank of the job (collective over the outer group):
        blocking (sync_overlap=0), or launched on a thread (``launch``)."""
        if self.overlap:
            self.launch(step)
            return
        local = [_local(p) for p in self.params]

        def into_params(idx: list[int], values: list[torch.Tensor]) -> None:
            for v, i in zip(values, idx):
                local[i].copy_(v)
        self._outer(local, self.group, into_params)
        self.last_sync = step
        self.syncs += 1

    @torch.no_grad()
    def launch(self, step: int) -> None:
        """The overlapped sync (sync_overlap = tau): snapshot the parameters, run the outer sync of
        that snapshot on a thread (its own process group, one bucket at a time: the collectives and
        the outer step on the anchor, exactly the blocking sync's arithmetic; the snapshot becomes
        the correction new anchor - snapshot), while the main thread goes on with the inner steps;
        ``apply`` adds the correction after inner step step + tau."""
        if self.launched is not None:  # (tau < sync_every: only after a resume under another plan)
            self.apply()
        self.snapshot = [_local(p).detach().to(torch.float32, copy=True) for p in self.params]
        self.launched, self.last_sync = step, step
        self.syncs += 1
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # the snapshot, on the main stream
        self._job = _Background(lambda: self._run(ready))

    def _run(self, ready: Any) -> None:
        snap = self.snapshot
        assert snap is not None

        def correct(idx: list[int], values: list[torch.Tensor]) -> None:
            for v, i in zip(values, idx):
                snap[i].sub_(v).neg_()  # new - snapshot (exactly: IEEE subtraction is odd)
        with torch.no_grad():
            if self._stream is None:
                self._outer(snap, self._group, correct)
                return
            torch.cuda.set_device(self.device)  # (the current device is per thread)
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                self._outer(snap, self._group, correct)
            self._stream.synchronize()

    def wait(self) -> None:
        """Join the sync in flight (the anchor, momentum and correction are then final); it stays
        pending until ``apply``."""
        if self._job is not None:
            job, self._job = self._job, None
            job.wait()

    @torch.no_grad()
    def apply(self) -> None:
        """Params += the correction: new anchor + the progress of the tau inner steps since the
        snapshot (params_now + (new_anchor - params_at_t))."""
        self.wait()
        assert self.snapshot is not None
        for p, c in zip(self.params, self.snapshot):
            _local(p).add_(c)
        self.snapshot, self.launched = None, None

    def expect_pending(self, launched: int) -> list[torch.Tensor]:
        """A resume with a sync in flight (checkpoint.load): the correction's tensors to load into."""
        self.snapshot = [torch.zeros(_local(p).shape, dtype=torch.float32, device=_local(p).device)
                         for p in self.params]
        self.launched = launched
        return self.snapshot

    def _outer(self, sources: list[torch.Tensor], group: Any,
               finish: Callable[[list[int], list[torch.Tensor]], None]) -> None:
        """The outer sync of ``sources`` (the local parameters, or their snapshot) bucket by bucket
        over ``group``; ``finish(indices, values)`` takes each bucket's result: the average
        (local SGD without anchor) or the new anchor tensors."""
        if self.anchor is None:  # local SGD, uncompressed: average the parameters
            for idx in _buckets(sources):
                flat = torch.cat([sources[i].reshape(-1).float() for i in idx]).to(self.device)
                flat = mean_over(flat, group, "none")
                finish(idx, self._views(flat, [sources[i] for i in idx]))
            return
        for idx in _buckets(sources):
            anchors = [self.anchor[i] for i in idx]
            delta = torch.cat([(a - p.float()).reshape(-1) for a, p in zip(anchors, (sources[i] for i in idx))])
            delta = mean_over(delta.to(self.device), group, self.compression)
            deltas = self._views(delta, anchors)
            if self.momentum is None:  # local SGD: anchor - mean delta = the average
                torch._foreach_sub_(anchors, deltas)
            else:  # DiLoCo: outer SGD, Nesterov momentum
                vs = [self.momentum[i] for i in idx]
                torch._foreach_mul_(vs, self.mu)
                torch._foreach_add_(vs, deltas)
                step_dir = torch._foreach_add(deltas, vs, alpha=self.mu)
                torch._foreach_add_(anchors, step_dir, alpha=-self.lr)
            finish(idx, anchors)

    @staticmethod
    def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        out, at = [], 0
        for t in like:
            out.append(flat[at:at + t.numel()].view_as(t).to(t.device))
            at += t.numel()
        return out

    def state_bytes_per_param(self) -> int:
        """Bytes this rank keeps per element of its local shards: anchor and momentum, fp32 (and,
        with sync_overlap > 0, the snapshot: 4 more while a sync is in flight)."""
        return 4 * ((self.anchor is not None) + (self.momentum is not None) + bool(self.overlap))
