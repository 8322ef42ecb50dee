"""Named modelling constants of the cost model, with units and sources.

Per-GPU numbers (peaks, bandwidths) live in the GPU data files. What is here is
hardware-independent behaviour of kernels, collectives and frameworks. Entries marked FITTED
take their value from the built-in calibration (meshplan/data/calibration.json, written by
``meshplan calibrate --runs <development runs> --prior physics``: a handful of named, bounded
parameters, not per row); the class default of each is its first-principles prior
(meshplan.calibration.space), used only where no calibration gives it. The others are
measured constants or first-principles values with their source. ``DEFAULT_PARAMS`` is the
class defaults with the built-in calibration applied.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.builtin_calibration import builtin_values
from meshplan.errors import MeshplanError


@dataclass(frozen=True, kw_only=True)
class CostParams:
    """Kernel, collective and framework constants. Override with dataclasses.replace()."""

    gemm_half_dim: float = 128.0
    """FITTED (prior 128: a 128-wide cuBLAS/CUTLASS tile). GEMM dimension (elements) at which a
    dimension alone halves throughput; efficiency multiplier per dim d is d/(d+gemm_half_dim).
    Models tile/wave under-use of thin matrices (cf. NVIDIA 'Matrix Multiplication Background' guide)."""
    gemm_half_tokens: float = 128.0
    """FITTED (prior 128). The same for the token (row) dimension m of activations x weights, which tiles
    differently from the weight dimensions."""
    flash_fwd_efficiency: float = 0.50
    """FlashAttention forward throughput relative to the GPU's large-GEMM efficiency, used when
    the GPU file gives no attention_efficiency. 0.5 = the ratio of the fitted attention and
    GEMM efficiencies on A100 (0.53) and the 500 W H100 (0.40), rounded."""
    flash_bwd_efficiency: float = 0.8
    """FITTED (prior 0.8). FlashAttention backward throughput relative to its forward (FA2 paper: bwd
    reaches 50-60% of peak on A100 where fwd reaches ~70%)."""
    attn_headdim_half: float = 16.0
    """Head dimension at which FlashAttention's per-head throughput would halve; gives ~10%
    less throughput at head_dim 64 than 128 (FA2 paper benchmarks)."""
    attn_half_seq: float = 512.0
    """FITTED (prior 512). Keys per attention kernel call at which FlashAttention's throughput halves
    (FA2 paper, A100 causal hdim 128: ~60% of the long-sequence rate at 512 tokens). With
    context parallelism each ring step sees s/cp keys. attention_efficiency is the
    long-sequence limit."""
    flash_bwd_flop_ratio: float = 2.5
    """Backward/forward matmul FLOPs of FlashAttention (5 matmuls vs 2; Dao 2023)."""
    hbm_efficiency: float = 0.85
    """FITTED (prior 0.85). Achieved fraction of HBM bandwidth by elementwise kernels (STREAM-like copies
    reach ~85-90% on A100/H100; norm and activation kernels less)."""
    fp8_cast_bytes_per_elem: float = 3.0
    """Bytes moved to cast one GEMM input element to fp8 with delayed/dynamic scaling
    (read bf16 2 B + write fp8 1 B), forward inputs and weights, backward grads."""
    optimizer_bytes_per_param: float = 32.0
    """HBM bytes an Adam step moves per parameter: read fp32 param, grad, m, v (16 B), write
    param, m, v (12 B), write the bf16 copy (2 B) plus grad-norm pass (~2 B)."""
    tp_exposed_async: float = 0.35
    """FITTED (prior 0.35). Fraction of TP communication left exposed when it is overlapped with
    the GEMMs (async TP, Transformer Engine userbuffers): the GEMMs run in tp chunks and only the
    first chunk's transfer and the slowdown of the rest stay exposed."""
    overlap_slowdown: float = 0.15
    """FITTED (prior 0.15). Slowdown of compute while a collective runs under it, as a fraction
    of the time they share: NCCL kernels hold SMs and HBM bandwidth, so overlapped communication
    is not free (Rashidi et al., ISCA 2021: compute slows 1.1-1.4x under concurrent
    collectives). A collective of c seconds under compute of k seconds adds
    max(c - k, slowdown x min(c, k)), booked as exposed communication."""
    dp_bucket_mib: float = 25.0
    """DDP gradient bucket size, MiB (PyTorch default bucket_cap_mb=25): the last bucket's
    all-reduce is exposed after the backward pass."""
    fsdp_reduce_bytes: float = 4.0
    """Bytes per gradient element in FSDP's reduce-scatter (fp32 reduce_dtype: torchtitan's
    and FSDP's mixed-precision default)."""
    host_adam_params_per_s: float = 1.0e9
    """Parameters per second one GPU's share of host CPU cores updates with a vectorised CPU
    Adam (DeepSpeed CPUAdam reports ~1e9/s on a 2-socket server shared by 8 GPUs)."""
    pcie_gbps: float = 25.0
    """Host-device bandwidth per GPU for offload, GB/s (PCIe 4.0 x16 ~25 GB/s achieved)."""
    fsdp_prefetch_layers: int = 1
    """Layers whose parameters FSDP gathers ahead (FSDP2 default implicit prefetch = 1)."""
    pp_p2p_exposed: float = 1.0
    """Fraction of pipeline point-to-point transfer time on the critical path where the runtime
    does not overlap its sends (blocking sends in DeepSpeed's pipeline engine and Megatron's
    non-interleaved schedule; torch.distributed.pipelining also waits on recv before compute).
    Where the profile's ``pp_p2p_overlap`` covers the plan's schedule the sends are hidden
    instead: the fraction in effect is :func:`p2p_exposed` (the one place that decides)."""
    collectives: str = "nccl"
    """How the codebase's collectives run: nccl (rings within a site, one per NIC, NCCL's tree
    where shorter, hierarchical across sites: cost.comm.Group) or flat-ring (one ring over every
    member at the slowest link it crosses: gloo, or a runtime without hierarchical collectives)."""
    pp_p2p_overlap: str = "none"
    """Which pipeline schedules run their sends and receives asynchronously under compute (an
    implementation profile's choice, one of P2P_OVERLAP): none (every send costs
    pp_p2p_exposed of its time), interleaved (only plans with virtual stages > 1: Megatron-LM's
    overlap_p2p_comm, on by default but forced off without virtual stages) or all (every
    schedule: runtimes that post receives ahead, as decentralized-training systems do). An
    overlapped send is costed as hidden (exposed fraction 0)."""
    allocator_fragmentation: float = 0.05
    """FITTED to the memory rows measured by torch's allocator (prior 0.05), which all run with
    expandable segments (torchtitan's): extra memory over the live tensors that those rows show
    (fraction of activations and transient buffers), for every codebase. Without expandable
    segments segment_fragmentation comes on top (cost.reserved)."""
    segment_fragmentation: float = 0.05
    """Reserved over allocated bytes of the churning allocations (activations, transients) that
    PyTorch's caching allocator keeps cached but cannot reuse without expandable segments
    (cost.reserved; doubled where the sizes vary within the step: pipelines, MoE; at most 0.3).
    Not fitted: no development row measured allocated and reserved memory without expandable
    segments. 0.05: the first-principles prior of allocator_fragmentation (calibration.space),
    0.10 where sizes vary (PyTorch's CUDA-semantics notes give varying sizes as the cause of the
    fragmentation expandable_segments removes); bounded 0-0.3, the range calibration.space
    allows allocator_fragmentation."""
    expandable_segments: bool = False
    """The codebase runs PyTorch's caching allocator with PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True (an implementation profile's choice: torchtitan's run_train.sh sets
    it): freed ranges serve any later size, so segment_fragmentation does not apply."""
    codebase_memory: float = 1.0
    """The codebase's allocated memory relative to what the model counts for it (states,
    activations, transients, framework state): 1 for the codebases the model describes. Fitted
    only by `meshplan calibrate` on one codebase's measured peaks (calibration.space.CODEBASE:
    buffers of its engine the model does not name scale with what it does); never in the pooled
    fit of the development sources."""
    framework_overhead_gib: float = 1.0
    """FITTED (prior 1.0) to the memory rows measured by torch's allocator. Memory the framework
    holds in torch's allocator beyond the model states, activations and transients (state, small
    buffers, the allocator's slack not otherwise modelled), GiB (measured: ~0.5-1.5 GiB in
    torch.cuda.memory_reserved() on an idle trained step). NCCL's buffers and the CUDA context are
    outside the allocator: cost.reserved.outside_bytes."""
    memory_margin: float = 0.05
    """A plan 'fits' when predicted peak <= (1 - memory_margin) x HBM: the margin is memory the
    job cannot use (CUDA context, allocator limits, other processes' reservations)."""
    max_oom_risk: float = 0.05
    """POLICY: the largest chance of running out of memory (cost.uncertainty.oom_probability, from
    the memory model's out-of-sample errors) at which a plan is still recommended; a plan that
    fits but exceeds it is 'at-risk' (`meshplan plan --max-oom-risk`)."""
    sync_method_min_gain: float = 0.03
    """POLICY: the least gain, a fraction of the objective (time to target, step time or $), a plan
    with a gradient-sync method (grad_compression bf16/fp8/powersgd, local-sgd, diloco) must show over
    one that syncs every full-precision gradient every step to rank above it: smaller predicted gains
    are within what the cost model resolves between two near-identical plans and do not pay for the
    method's numerical risk (the search ranks such a plan as if it took 1/(1 - gain) longer)."""
    headroom_gib: float = 0.0
    """POLICY: memory a recommended plan must leave free below the usable memory, GiB
    (`meshplan plan --headroom`); a plan that fits with less is 'at-risk'."""
    band_scale: float = 1.0
    """How much a calibration of the user's own runs shrinks the out-of-sample bands
    (cost.uncertainty): 1 for the built-in calibration. Used only where the calibration carries
    no knowledge bands (band_basis)."""
    band_basis: str = "profile"
    """How well meshplan knows the codebase the step band is for (cost.uncertainty.KNOWLEDGE):
    'profile' (a built-in profile, or meshplan's runtime: the leave-one-source-out band of the
    named codebases), 'unknown' (a codebase it has no evidence for: a profile file, runs whose
    framework it does not recognise: the spread across codebases, measured blind and leave one
    source out), or 'k1'/'k3'/'k5' (calibrated on that many of the codebase's own runs: the blind
    few-shot band at that K)."""
    profile: str = "meshplan"
    """The implementation profile these numbers follow (set by cost.profile.Profile.apply): the
    memory band uses that codebase's out-of-sample errors."""
    step_overhead_s: float = 0.0
    """Fixed per-step host overhead (data loading, logging, launch), seconds."""
    launch_blocking: bool = False
    """The run sets CUDA_LAUNCH_BLOCKING=1 (a run setting, read from the row by validate): every
    kernel launch waits for the kernel to finish, so the host's time between two kernels (Python,
    the dispatcher, the launch, the wake-up from the wait) is GPU idle time, launch_gap_s per
    kernel (cost.layer.kernel_counts: the kernels of each layer's forward, input-gradient and
    weight-gradient passes, and of the recomputed forward), in every micro-batch of every layer;
    it does not shrink with a larger micro-batch. BigScience ran its Jean Zay A100 jobs of 320+
    GPUs this way to avoid NCCL hangs (bigscience train/tr11-176B-ml/chronicles-prequel.md,
    'dealing with JZ hanging on the large model'; tr11-200B-ml.slurm@1a13e1f: 'do not remove or
    the training will hang')."""
    launch_gap_s: float = 45e-6
    """FITTED (prior 45e-6) where rows run with launch_blocking. Host seconds per counted kernel
    when launches are synchronous. Prior: BigScience's own A/B (chronicles-prequel 'dealing with JZ
    hanging': 200B, 80 layers x 14400, TP8 PP10 DP1 on 80 A100, MBS 1, GBS 512: 97.20 TFLOPs async,
    91.04 with CUDA_LAUNCH_BLOCKING=1): 6.8% of a ~215 s iteration = 14.6 s over (512 + 9) x 8 block
    passes = 3.5 ms per block per micro-batch, over the 78 kernels cost.layer.kernel_counts gives a
    Megatron block with full recompute = 45 us (PyTorch's per-op host time from Python, ~10-30 us,
    the launch, ~5 us, the synchronous wait's wake-up, and the small kernels the count leaves out:
    casts, fills, AccumulateGrad, the checkpoint's RNG handling)."""
    pipeline_variable_shapes: bool = False
    """Under a sample-length distribution, whether a pipeline runs each micro-batch at its own
    padded length (an implementation profile's choice: Megatron-LM with --variable-seq-lengths,
    which sends each micro-batch's shape first). False (meshplan's runtime, torchtitan, DeepSpeed's
    pipeline engine, Megatron's default): a schedule has one shape, every micro-batch of a pipeline
    is padded to the longest length (cost.lengths then prices it as that one length)."""
    attention_kernel: str = "flash2"
    """The attention kernel a plan with ``flash_attention`` runs (an implementation profile's
    choice): flash1, flash2, flash3, sdpa, cudnn; or, regardless of the plan's flag, an unfused
    kernel: eager (math: scores materialised, separate softmax) or fused-softmax (Megatron's
    scaled-masked-softmax: scores materialised, softmax fused). See cost.compute.attention_kind."""
    elementwise_kernels: str = "eager"
    """The elementwise kernels (norms, activations, residual adds, rotary, dropout) of a plan
    without ``compile`` (an implementation profile's choice): eager (one PyTorch kernel per op:
    the eager bytes), hand-fused (Megatron/Transformer Engine/apex fused kernels: the fused
    bytes without torch.compile) or compiled (the codebase compiles by default: the fused bytes).
    A plan with ``compile`` always runs the fused bytes (inductor)."""
    dp_overlap: bool = True
    """Data-parallel gradient sync (DDP, ZeRO-1/2) overlapped with the last backward, bucket by
    bucket, leaving the last bucket exposed (torch DDP; Megatron --overlap-grad-reduce). False:
    the whole sync runs after the backward (Megatron-LM's default, DeepSpeed's overlap_comm=false)."""
    dp_bucket_buffers: float = 2.0
    """Gradient buckets of dp_bucket_mib alive at once for DDP / ZeRO-1/2 (memory): torch DDP
    keeps its bucket copies (2: the one filling, the one reducing); Megatron's buckets are views
    into the main-gradient buffer (0); DeepSpeed's ZeRO-1/2 IPG buffer is one bucket without
    overlap_comm, two with it."""
    param_gather_overlap: bool = False
    """ZeRO-1/2 (distributed optimizer): the all-gather of the updated parameters runs bucket by
    bucket under the next step's first forward (megatron-core's overlap_param_gather) instead
    of after the optimizer step."""
    main_grads: str = "auto"
    """Gradient bytes per parameter held without ZeRO-3 (ZeRO-0/1/2; ZeRO-2 shards them): auto
    (2 B for ZeRO-0, 4 B fp32 for ZeRO-1/2), fp32 (Megatron's main_grad buffer, also under DDP:
    2 + 4 + 12 = 18 B/param), or bf16 (DeepSpeed ZeRO-1/2 with bf16/fp16: 16-bit gradients,
    reduced in 16 bit). With fp32 or bf16 the data-parallel reduction moves those bytes."""
    loss_kernel: str = "torch"
    """The cross-entropy a plan without ``fused_loss`` runs: torch (F.cross_entropy on the full
    logits), inplace (Megatron's vocabulary-parallel cross-entropy, in place on one fp32 copy of
    the logits: 6 B per logit), fused (an in-place fused CE: flash-attn's xentropy, llm-foundry's
    fused_crossentropy) or chunked (a fused linear + CE over vocabulary-sized chunks: Liger's
    FusedLinearCrossEntropy; the full logits never exist). A plan with ``fused_loss`` runs fused
    unless the profile chunks."""
    logits_fp32: bool = True
    """The torch cross-entropy runs on logits upcast to fp32 (torchtitan, Hugging Face,
    Megatron's default without --fp16-lm-cross-entropy): 14 B per logit alive at the loss;
    False: on the 16-bit logits (6 B)."""
    optimizer_temp_bytes: float = 0.0
    """Bytes per (sharded) parameter of temporaries the optimizer step allocates: 0 for fused
    Adam kernels (apex/TE FusedAdam, torch fused=True); 4 for torch's foreach AdamW (one fp32
    tensor per parameter for sqrt(v) + eps). They live after the backward, so they count against
    the activations and transients, not on top of them."""
    cuda_context_gib: float = 0.0
    """CUDA context and module images per GPU, GiB, counted in the 'outside' part (outside torch's
    allocator: nvidia-smi shows it, max_memory_reserved does not). 0: cost.reserved.CUDA_CONTEXT_GIB
    (lazy module loading); a row that measured its own (BLOOM: 1573 MiB) sets it."""
    nccl_buffer_gib: float = 0.0
    """NCCL buffers per GPU beyond those cost.reserved counts per communicator, GiB (outside
    torch's allocator; e.g. Megatron's --tp-comm-overlap userbuffers). In the 'outside' part."""
    nccl_groups: str = "axes"
    """Which NCCL communicators a rank initializes (cost.reserved.nccl_communicators; an
    implementation profile's choice): axes (the default group and one per parallel axis of
    degree > 1) or deepspeed-pipe (DeepSpeed's PipelineEngine under Megatron-DeepSpeed: its
    PipelineParallelGrid's data-parallel, model-parallel, pipeline and tensor-slice groups and
    the tied-embedding group beside Megatron's own tensor-parallel group and the default group:
    cost.reserved.deepspeed_pipe_communicators)."""
    optimizer_init_cache: bool = False
    """The codebase's optimizer wrapper builds its flat buffers at start-up and frees the
    per-parameter tensors and temporaries it replaced without torch.cuda.empty_cache(), so the
    caching allocator keeps them reserved (an implementation profile's choice: DeepSpeed's fp16
    ZeRO-0/1/2 optimizers, cost.reserved.deepspeed_init_reserved_bytes). The reserved peak is then
    at least that start-up high-water mark."""

    moe_expert_load_cv: float = 0.1
    """Coefficient of variation of the per-expert token loads of a trained, auxiliary-loss-balanced
    router over many tokens (the skew that finite batches add to: cost.moe). Bounded 0-1 (cost.moe.
    CV_BOUNDS). Prior 0.1 from Switch Transformer's capacity convention (Fedus, Zoph and Shazeer,
    JMLR 2022, sec. 2.2 and Table 1: capacity factor 1.0-1.25, i.e. buffers sized so that the busiest
    of E = 128 experts seldom exceeds 1.25 x the mean): 1 + c e(128) = 1.25 with e(128) = 2.59 the
    expected maximum of 128 standard normals gives c = 0.096. Not fitted: the development MoE rows
    run force-balanced routers (validate sets 0 for them: validate.plans.cost_settings)."""
    moe_capacity_factor: float = 0.0
    """Expert capacity as a multiple of the mean load per expert, past which the codebase drops
    tokens (GShard/Switch/DeepSpeed-MoE ``capacity_factor``; Megatron-core's
    ``--moe-expert-capacity-factor``): the busiest rank's load is capped there. 0: dropless
    (Hugging Face, torchtitan, Megatron-core's default, meshplan's runtime)."""
    moe_pad_to_capacity: bool = False
    """With a capacity factor, every expert's buffer is padded to its capacity (DeepSpeed-MoE's
    einsum dispatch of [E, capacity, hidden]; Megatron-core's --moe-pad-expert-input-to-capacity):
    every rank runs capacity-sized GEMMs and all-to-alls, the load factor is the capacity factor."""
    moe_probs_in_activation: bool = False
    """The experts multiply each token copy by its routing probability inside their activation
    (before the second GEMM) and the combine only sums the copies, so no expert output is kept for
    the probabilities' gradient (LayerOps.saved_combine_rep is not kept). Megatron-core's
    TEGroupedMLP ("Memory efficient token permutation by moving the probs multiplication from
    unpermutation to activation function of GroupedMLP", megatron/core/transformer/moe/README.md;
    experts.py ``weighted_bias_swiglu_impl(fc1_output, bias, permuted_probs)``, token_dispatcher.py
    ``combine_postprocess``: ``unpermute`` without probabilities). False: the combine weights the
    outputs and keeps them (Hugging Face, torchtitan, meshplan's runtime)."""

    token_efficiency_file: str = ""
    """POLICY: a TOML/JSON file of token-efficiency factors replacing the defaults of
    cost.convergence (`meshplan plan --token-efficiency`); "" = the defaults."""
    powersgd_bytes_per_param: float = 24.0
    """HBM bytes PowerSGD moves per gradient element each step on top of the sync: the error
    feedback added (read 4, write 4), the matrix read twice for P = M Q and Q = M^T P (8), the
    approximation written back (4) and the new error (4) (torch's powerSGD_hook, fp32 grads)."""
    outer_step_bytes_per_param: float = 20.0
    """HBM bytes per parameter of a local-SGD/DiLoCo outer step: read the parameters and the
    anchor for the delta, the momentum read and written, the anchor and the parameters written
    (fp32), as memory-bound elementwise kernels."""

    def replace(self, **changes: object) -> CostParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


COLLECTIVES_ALGORITHMS = ("nccl", "flat-ring")
"""The values of CostParams.collectives."""


def flat_collectives(p: CostParams) -> bool:
    """The profile's collectives run as one flat ring (CostParams.collectives)."""
    if p.collectives not in COLLECTIVES_ALGORITHMS:
        raise MeshplanError(f"collectives = {p.collectives!r} is not understood",
                            hint="collectives is one of: " + ", ".join(COLLECTIVES_ALGORITHMS))
    return p.collectives == "flat-ring"


#: The values of CostParams.pp_p2p_overlap: which schedules overlap their pipeline sends.
P2P_OVERLAP = ("none", "interleaved", "all")


def p2p_exposed(p: CostParams, virtual_stages: Any = 1) -> Any:
    """The fraction of each pipeline send's time on the critical path, for plans with
    ``virtual_stages`` (a number or an array of them, one per plan): 0 where the profile's
    pp_p2p_overlap covers the schedule (``all``; ``interleaved`` with virtual stages > 1),
    p.pp_p2p_exposed elsewhere. The cost model reads the exposed fraction only through here."""
    if p.pp_p2p_overlap not in P2P_OVERLAP:
        raise MeshplanError(f"pp_p2p_overlap = {p.pp_p2p_overlap!r} is not understood",
                            hint="pp_p2p_overlap is one of: " + ", ".join(P2P_OVERLAP))
    base = float(p.pp_p2p_exposed)
    if p.pp_p2p_overlap == "none":
        return base if np.ndim(virtual_stages) == 0 else np.full(np.shape(virtual_stages), base)
    if p.pp_p2p_overlap == "all":
        return 0.0 if np.ndim(virtual_stages) == 0 else np.zeros(np.shape(virtual_stages))
    out = np.where(np.asarray(virtual_stages) > 1, 0.0, base)
    return float(out) if out.ndim == 0 else out


def _builtin_params() -> CostParams:
    """CostParams with the built-in calibration's fitted values (meshplan/data/calibration.json):
    the class defaults above are the priors, the calibration fitted to the development runs
    replaces the fitted ones."""
    vals = {k: v for k, v in builtin_values().items() if "@" not in k}
    return CostParams().replace(**vals) if vals else CostParams()


DEFAULT_PARAMS = _builtin_params()

#: How each number was obtained: "fitted" to the published runs, "measured" (a constant
#: measured or published elsewhere), or "derived" (first principles / framework defaults).
PARAM_KINDS: dict[str, str] = {
    "gemm_half_dim": "fitted", "gemm_half_tokens": "fitted", "flash_fwd_efficiency": "derived",
    "flash_bwd_efficiency": "fitted",
    "attn_headdim_half": "measured", "attn_half_seq": "fitted", "flash_bwd_flop_ratio": "derived",
    "hbm_efficiency": "fitted",
    "fp8_cast_bytes_per_elem": "derived", "optimizer_bytes_per_param": "derived",
    "tp_exposed_async": "fitted", "overlap_slowdown": "fitted", "dp_bucket_mib": "derived",
    "fsdp_reduce_bytes": "derived",
    "host_adam_params_per_s": "measured", "pcie_gbps": "measured", "fsdp_prefetch_layers": "derived",
    "pp_p2p_exposed": "derived", "pp_p2p_overlap": "derived", "collectives": "derived",
    "allocator_fragmentation": "fitted", "segment_fragmentation": "derived", "expandable_segments": "derived",
    "framework_overhead_gib": "fitted", "codebase_memory": "derived", "memory_margin": "derived",
    "max_oom_risk": "derived", "headroom_gib": "derived", "sync_method_min_gain": "derived", "band_scale": "derived", "band_basis": "derived",
    "profile": "derived",
    "step_overhead_s": "derived", "launch_blocking": "derived", "launch_gap_s": "fitted",
    "pipeline_variable_shapes": "derived",
    "attention_kernel": "derived", "elementwise_kernels": "derived",
    "dp_overlap": "derived", "param_gather_overlap": "derived", "dp_bucket_buffers": "derived", "main_grads": "derived",
    "loss_kernel": "derived", "logits_fp32": "derived", "optimizer_temp_bytes": "derived",
    "cuda_context_gib": "derived", "nccl_buffer_gib": "derived", "nccl_groups": "derived",
    "optimizer_init_cache": "derived", "token_efficiency_file": "derived",
    "powersgd_bytes_per_param": "derived", "outer_step_bytes_per_param": "derived",
    "moe_expert_load_cv": "measured", "moe_capacity_factor": "derived", "moe_pad_to_capacity": "derived",
    "moe_probs_in_activation": "derived",
}
#: Per-GPU numbers in the GPU data files that are fitted (the rest are datasheet values).
GPU_FITTED_FIELDS = ("gemm_efficiency", "attention_efficiency")
