"""Reserved memory: what a GPU really holds beyond the live (allocated) tensors.

Three quantities per rank, each a superset of the one before:

- **allocated** (``torch.cuda.max_memory_allocated``): the live tensors, cost.memory's model
  states, activations and transients, plus the framework's own state (``framework_overhead_gib``);
- **reserved** (``torch.cuda.max_memory_reserved``): allocated + what PyTorch's caching allocator
  keeps beyond it: block rounding, cached free blocks that the sizes requested later cannot reuse
  (fragmentation), and cuBLAS's workspace, which torch allocates through the caching allocator;
- **device** (what ``nvidia-smi`` shows, and what must fit in HBM): reserved + memory outside the
  caching allocator: the CUDA context and NCCL's communication buffers.

The verdict and P(out of memory) use the device peak; each measured row is compared with the
quantity it measured (validate: allocated, reserved or nvidia-smi).

Terms, each named, bounded and cited:

- Block rounding (c10/cuda/CUDACachingAllocator.cpp, constants kMinBlockSize..kRoundLarge and
  round_size / get_allocation_size; PyTorch docs "CUDA memory management"): every request is
  rounded up to 512 B; requests <= 1 MiB come from the small pool's 2 MiB segments, requests
  below 10 MiB from 20 MiB segments of the large pool, larger ones get their own segment rounded
  up to 2 MiB. :func:`round_size` and :func:`segment_size` implement the rules (unit-tested).
  For the tensors of an LLM step (>= MiBs each) the rounding is below 1 MiB per tensor: it is
  charged as half a 2 MiB granule for each live large block (``ROUNDING_BLOCKS_PER_LAYER``).
- Fragmentation without ``expandable_segments`` (PyTorch docs, "Optimizing memory usage with
  PYTORCH_CUDA_ALLOC_CONF": "If allocation sizes vary a lot ... the allocator ... may end up with
  fragmentation"; ``expandable_segments:True`` maps pages into one growing segment instead, so a
  freed range can serve any later size): ``CostParams.segment_fragmentation`` of the churning
  allocations (activations and transients, the ones freed and re-allocated every step), doubled
  where their sizes vary within the step (a pipeline's several in-flight micro-batches of
  different lifetimes; MoE's token-dependent expert buffers), capped at MAX_FRAGMENTATION. None
  with expandable segments (the profile's ``expandable_segments``); the fitted
  ``allocator_fragmentation`` (0.0 on torchtitan's expandable-segments rows) stays on top.
- cuBLAS workspace (aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize: the default
  CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8" = 4096 KiB x 2 + 16 KiB x 8 before Hopper, ":4096:8" =
  32 MiB on Hopper and later), one per stream that runs GEMMs (the compute stream), inside the
  caching allocator since torch 1.11.
- NCCL buffers (NCCL user guide, Environment Variables: NCCL_BUFFSIZE "the size of the buffer
  used by NCCL when communicating data between pairs of GPUs", default 4 MiB; NCCL_LL128_BUFFSIZE
  about the same; NCCL_LL_BUFFSIZE 256 KiB): per communicator, per channel, per peer, per protocol
  (Simple and LL128: NCCL_PROTOCOL_BUFFERS). Counted per process group the plan creates (one per
  parallel axis with degree > 1, plus the default group), allocated by NCCL with cudaMalloc/cuMem,
  outside the caching allocator. Pipeline send/receive pairs get their own two-rank communicators
  (torch's ProcessGroupNCCL creates one per peer pair) with NCCL_P2P_CHANNELS_PER_PEER channels.
- CUDA context: ``CostParams.cuda_context_gib`` (a row's measured one where it states it:
  1573 MiB on an A100 with eager module loading, bigscience tr11 chronicles), else
  CUDA_CONTEXT_GIB (lazy module loading, CUDA_MODULE_LOADING=LAZY, torch's default since 2.1).

Pure numpy: no torch.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from meshplan.units import GiB

MiB = 2 ** 20

# c10/cuda/CUDACachingAllocator.cpp (namespace c10::CachingAllocator, CUDAAllocatorConfig.h in torch >= 2.1)
K_MIN_BLOCK_SIZE = 512
"""All sizes are rounded to at least 512 bytes (kMinBlockSize)."""
K_SMALL_SIZE = 1 * MiB
"""Largest 'small' allocation is 1 MiB (kSmallSize)."""
K_SMALL_BUFFER = 2 * MiB
"""'Small' allocations are packed in 2 MiB segments (kSmallBuffer)."""
K_LARGE_BUFFER = 20 * MiB
"""'Large' allocations may be packed in 20 MiB segments (kLargeBuffer)."""
K_MIN_LARGE_ALLOC = 10 * MiB
"""Allocations between 1 and 10 MiB may use kLargeBuffer (kMinLargeAlloc)."""
K_ROUND_LARGE = 2 * MiB
"""Round up large allocations to 2 MiB (kRoundLarge)."""
EXPANDABLE_PAGE = 2 * MiB
"""With expandable_segments the allocator maps physical memory in 2 MiB pages (the CUDA VMM
granularity on current GPUs, cuMemGetAllocationGranularity; ExpandableSegment in the same file)."""

ROUNDING_BLOCKS_PER_LAYER = 8.0
"""Live large blocks per layer a rank holds (weights, gradients and optimizer states: a few
tensors each, or one flat buffer per layer under FSDP): each wastes on average half a 2 MiB
rounding granule (K_ROUND_LARGE / 2). Bounded: 1-20 tensors per layer."""

MAX_FRAGMENTATION = 0.3
"""Upper bound of the fragmentation fraction (calibration.space's bound for allocator_fragmentation)."""

CUBLAS_WORKSPACE_BYTES = {"hopper": 32 * MiB, "blackwell": 32 * MiB}
"""cuBLAS workspace per handle on Hopper and later (CublasHandlePool.cpp: ':4096:8')."""
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
"""Before Hopper: ':4096:2:16:8' = 2 x 4096 KiB + 8 x 16 KiB."""

NCCL_BUFFSIZE = 4 * MiB
"""NCCL_BUFFSIZE default (NCCL user guide, Environment Variables)."""
NCCL_PROTOCOL_BUFFERS = 2.0
"""Protocols whose buffers are about NCCL_BUFFSIZE each: Simple and LL128 (LL's 256 KiB left out)."""
NCCL_CHANNELS = 16
"""Channels of a collective communicator within a node of NVLink/NVSwitch GPUs (NCCL picks 2 to
MAXCHANNELS=32 by topology; 16 is typical of 8-GPU A100/H100 nodes in NCCL_DEBUG=INFO logs).
Bounded 2-32: an assumption, not fitted."""
NCCL_RING_PEERS = 2.0
"""Peers a rank keeps receive buffers for in a collective communicator: its ring predecessor, and
its tree parent/children (connected lazily, NCCL_RUNTIME_CONNECT, NCCL >= 2.22): counted as 2."""
NCCL_P2P_CHANNELS_PER_PEER = 2
"""NCCL_NCHANNELS_PER_NET_PEER / p2p channels per peer default (NCCL user guide): 2."""

CUDA_CONTEXT_GIB = 0.5
"""CUDA context and module images per GPU with lazy module loading (CUDA_MODULE_LOADING=LAZY,
torch's default since 2.1); eager loading (older stacks) takes ~1.5 GiB (1573 MiB measured on an
A100, bigscience tr11 chronicles). Bounded 0.3-1.6 GiB; a row or profile that states its own
(CostParams.cuda_context_gib > 0) replaces it."""


def round_size(n: Any) -> np.ndarray:
    """The block size the caching allocator serves for a request of ``n`` bytes (round_size):
    at least 512 B, in multiples of 512 B."""
    n = np.asarray(n, dtype=np.int64)
    return np.maximum(K_MIN_BLOCK_SIZE, -(-n // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)


def segment_size(n: Any) -> np.ndarray:
    """The cudaMalloc size the allocator asks for when no cached block fits a request of ``n``
    bytes (get_allocation_size): 2 MiB for small requests (<= 1 MiB), 20 MiB below 10 MiB, else
    the rounded size rounded up to 2 MiB."""
    r = round_size(n)
    big = -(-r // K_ROUND_LARGE) * K_ROUND_LARGE
    return np.where(r <= K_SMALL_SIZE, K_SMALL_BUFFER, np.where(r < K_MIN_LARGE_ALLOC, K_LARGE_BUFFER, big))


def expandable_size(n: Any) -> np.ndarray:
    """Bytes mapped for a request of ``n`` bytes with expandable segments: the rounded size, in
    whole 2 MiB pages (small requests share the small pool's pages, as without)."""
    r = round_size(n)
    return np.where(r <= K_SMALL_SIZE, r, -(-r // EXPANDABLE_PAGE) * EXPANDABLE_PAGE)


def cublas_workspace_bytes(family: str) -> float:
    return float(CUBLAS_WORKSPACE_BYTES.get(str(family).lower(), CUBLAS_WORKSPACE_DEFAULT))


def fragmentation_fraction(p: Any, varying: Any) -> np.ndarray:
    """Fraction of the churning bytes cached but not reusable: 0 with expandable segments, else
    segment_fragmentation (doubled where the allocation sizes vary within the step), at most
    MAX_FRAGMENTATION."""
    if bool(getattr(p, "expandable_segments", False)):
        return np.zeros(np.shape(varying))
    base = float(getattr(p, "segment_fragmentation", 0.0))
    return np.minimum(MAX_FRAGMENTATION, base * np.where(np.asarray(varying, dtype=bool), 2.0, 1.0))


def allocator_bytes(churn: Any, layers_held: Any, varying: Any, family: str, p: Any) -> np.ndarray:
    """Reserved minus allocated bytes per rank: rounding, fragmentation of the churning bytes
    ``churn``, cuBLAS's workspace. Never negative; 0 fragmentation with expandable segments."""
    churn = np.maximum(np.asarray(churn, dtype=float), 0.0)
    rounding = ROUNDING_BLOCKS_PER_LAYER * np.maximum(np.asarray(layers_held, dtype=float), 0.0) * K_ROUND_LARGE / 2
    return fragmentation_fraction(p, varying) * churn + rounding + cublas_workspace_bytes(family)


def nccl_communicators(tp: Any, dp: Any, cp: Any, ep: Any) -> np.ndarray:
    """Collective communicators a rank is a member of: the default group and one per parallel
    axis of degree > 1 (tp, the data-parallel/sharding group, cp, ep)."""
    axes = [np.asarray(x) > 1 for x in (tp, dp, cp, ep)]
    return 1.0 + np.sum(axes, axis=0)


NCCL_GROUPS = ("axes", "deepspeed-pipe")
"""CostParams.nccl_groups: how a codebase's communicators are counted (nccl_communicators or
deepspeed_pipe_communicators)."""


def deepspeed_pipe_communicators(tp: Any, dp: Any, pp: Any) -> np.ndarray:
    """Collective communicators a rank of Megatron-DeepSpeed's PipelineEngine initializes (each
    process group NCCL is used on gets its own communicator, with its own buffers), from the code
    that ran (microsoft/DeepSpeed@2151c787a, 2022-02-18; bigscience-workshop/Megatron-DeepSpeed
    @541b967f, 2022-02-17):

    * the default group (torch.distributed.barrier() in Megatron's initialize and checkpointing);
    * Megatron's tensor-parallel group (mpu layers' all-reduces), tp > 1;
    * PipelineParallelGrid (deepspeed/runtime/pipe/topology.py), which deepspeed.initialize hands
      the engine as its mpu (``mpu=model.mpu()``), creates its own groups beside Megatron's:
      the data-parallel group (ZeRO's reduce and all-gather, the loss average), dp > 1; the model
      group of one replica's pp x tp ranks (get_model_parallel_group: ZeRO's overflow and
      gradient-norm all-reduces), pp x tp > 1; the pipeline group (_aggregate_total_loss
      broadcasts the loss), pp > 1; the tensor-slice group (PartitionedTensor's all-gather of the
      partitioned pipeline activations), tp > 1 with pp > 1;
    * the tied-embedding group of the first and last stage (PipelineModule._index_tied_modules:
      allreduce_tied_weight_gradients), pp > 1: counted for every stage (the stages holding the
      embedding are the fullest).

    Its send/receive pairs (runtime/pipe/p2p.py: dist.send/dist.recv with torch >= 1.8) are the
    two-rank communicators nccl_bytes adds for pp > 1."""
    tp, dp, pp = (np.asarray(x) for x in (tp, dp, pp))
    default, megatron_tp, ds_dp = 1.0, tp > 1, dp > 1
    ds_model, ds_pipe, ds_slice, tied = (tp * pp) > 1, pp > 1, (tp > 1) & (pp > 1), pp > 1
    return default + sum(np.asarray(x, dtype=float) for x in (megatron_tp, ds_dp, ds_model, ds_pipe, ds_slice, tied))


def nccl_bytes(tp: Any, dp: Any, cp: Any, ep: Any, pp: Any, channels: float = NCCL_CHANNELS,
               groups: str = "axes") -> np.ndarray:
    """NCCL buffer bytes per rank (outside the caching allocator): collective communicators x
    channels x peers x protocols x NCCL_BUFFSIZE, plus the pipeline's two-rank send/receive
    communicators (a stage talks to its predecessor and successor). ``groups`` (CostParams.
    nccl_groups): which communicators a rank initializes: axes (nccl_communicators) or
    deepspeed-pipe (deepspeed_pipe_communicators)."""
    count = (deepspeed_pipe_communicators(tp, dp, pp) if groups == "deepspeed-pipe"
             else nccl_communicators(tp, dp, cp, ep))
    coll = count * channels * NCCL_RING_PEERS * NCCL_PROTOCOL_BUFFERS * NCCL_BUFFSIZE
    p2p = np.where(np.asarray(pp) > 1, 2.0 * NCCL_P2P_CHANNELS_PER_PEER * 2.0 * NCCL_BUFFSIZE, 0.0)
    return coll + p2p


def outside_bytes(tp: Any, dp: Any, cp: Any, ep: Any, pp: Any, p: Any) -> np.ndarray:
    """Device memory outside the caching allocator per rank: the CUDA context and NCCL's buffers
    (plus a profile's own extra, nccl_buffer_gib: e.g. Megatron's userbuffers)."""
    ctx = float(p.cuda_context_gib) if float(p.cuda_context_gib) > 0 else CUDA_CONTEXT_GIB
    groups = str(getattr(p, "nccl_groups", "axes"))
    return ctx * GiB + float(p.nccl_buffer_gib) * GiB + nccl_bytes(tp, dp, cp, ep, pp, groups=groups)


def deepspeed_init_reserved_bytes(params: Any, shard: Any, zero: Any, state_bytes: float) -> np.ndarray:
    """Bytes PyTorch's caching allocator holds once DeepSpeed's fp16 optimizer wrapper has been
    built (CostParams.optimizer_init_cache), for ``params`` 16-bit parameters on the rank, its
    optimizer states (``state_bytes`` per parameter, Adam's 8) sharded over ``shard`` ranks at
    ZeRO >= 1 (``zero``: the level memory sees, cost.memory.effective_zero). Neither DeepSpeed's
    runtime nor Megatron-DeepSpeed calls torch.cuda.empty_cache() (none at microsoft/DeepSpeed
    @2151c787a or bigscience-workshop/Megatron-DeepSpeed@541b967f), so what the start-up freed
    stays reserved, and the reserved peak is at least this:

    * ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__):
      move_to_cpu(bit16_groups) frees the model's per-parameter 16-bit tensors (2 B/param,
      cached) and flatten_dense_tensors_aligned(...).cuda() allocates the flat 16-bit buffer
      (2 B/param) the parameters become views of; the fp32 master partition is
      ``partition.clone().float()`` (a 16-bit clone, 2 B per sharded parameter, freed; the
      master 4 B); initialize_optimizer_states gives it an fp32 zero gradient (4 B, freed after
      the optimizer's first step) and the optimizer creates its states: 4 P + (10 + S) P / shard.
    * ZeRO-0 (deepspeed/runtime/fp16/fused_optimizer.py, FP16_Optimizer.__init__, the wrapper of a
      fused Adam): _flatten_dense_tensors([p.clone() for p in group]) holds the originals, their
      clones and the flat buffer at once (6 B/param; the originals and clones are freed), the
      master is ``fp16_groups_flat.clone().float()`` (2 B freed, 4 B kept) and
      initialize_optimizer_states' fp32 zero gradients (4 B, freed): (16 + S) P.

    An upper estimate of the start-up mark: a later allocation of the start-up (the next param
    group's) may reuse a block an earlier one freed."""
    params = np.asarray(params, dtype=float)
    shard = np.maximum(np.asarray(shard, dtype=float), 1.0)
    sharded = np.asarray(zero) >= 1
    z12 = 4.0 * params + (10.0 + state_bytes) * params / shard
    z0 = (16.0 + state_bytes) * params
    return np.where(sharded, z12, z0)
