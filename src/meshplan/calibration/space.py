"""The cost model's fittable parameters: named, bounded, physically meaningful, each with a prior.

A calibration fits a handful of these to measured runs by maximum a posteriori: the runs' log
errors against a Gaussian prior on each parameter (in log space for positive rates, linear for
fractions that may be 0). A parameter the runs say nothing about stays at its prior, which is
a first-principles or published value, never a value fitted to the same runs; that is what
makes a leave-one-source-out fold honest (a GPU family no other source ran keeps its prior).

Kinds:
  param  a CostParams field (global: kernels, overlap, memory).
  gpu    a GPU family's efficiency (gemm_efficiency@hopper); each part gets value x clock_ratio.
  link   a link kind's achieved fraction of line rate (link_efficiency@inter_node:infiniband).
  codebase  the user's codebase against the ones the built-in calibration learned from: a speed
         factor per kind of work (codebase_speed@gemm, @attention, @memory, @comm) and one for all
         of them (codebase_speed@all), its fixed per-step overhead (step_overhead_s) and its
         allocated memory relative to the model's count (codebase_memory). Fitted
         only by `meshplan calibrate` on one codebase's own runs (never in the pooled fit of the
         development runs, where each source is another codebase): a slower codebase is not a
         slower GPU, so these take the difference and the GPU and link efficiencies keep their
         physical (or built-in) values.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.builtin_calibration import gpu_key, link_key


@dataclass(frozen=True)
class Fittable:
    """One parameter a calibration may fit."""

    name: str
    low: float
    high: float
    prior: float
    sigma: float
    """Prior standard deviation: of log(value) when ``log``, else of the value."""
    log: bool
    target: str
    """'time' (fitted to step times) or 'memory' (to peak memory and out-of-memory outcomes)."""
    meaning: str


#: Global CostParams fields. Priors: published kernel and collective behaviour.
GLOBAL: tuple[Fittable, ...] = (
    Fittable("gemm_half_dim", 8.0, 1024.0, 128.0, 0.7, True, "time",
             "GEMM weight dimension at which throughput halves (tile/wave quantisation; a 128-wide "
             "tile is the usual cuBLAS/CUTLASS tile)"),
    Fittable("gemm_half_tokens", 4.0, 1024.0, 128.0, 0.7, True, "time",
             "GEMM token dimension at which throughput halves"),
    Fittable("attn_half_seq", 16.0, 8192.0, 512.0, 0.7, True, "time",
             "keys per attention call at which FlashAttention's throughput halves (FA2 paper: "
             "~60% of the long-sequence rate at 512 keys)"),
    Fittable("hbm_efficiency", 0.5, 0.95, 0.85, 0.1, True, "time",
             "achieved fraction of HBM bandwidth by elementwise kernels (STREAM-like copies reach "
             "85-90% on A100/H100)"),
    Fittable("flash_bwd_efficiency", 0.5, 1.0, 0.8, 0.15, True, "time",
             "FlashAttention backward throughput relative to forward (FA2 paper: bwd 50-60% of "
             "peak where fwd reaches ~70%)"),
    Fittable("overlap_slowdown", 0.0, 0.6, 0.15, 0.1, False, "time",
             "slowdown of compute while a collective overlaps it (Rashidi et al. ISCA 2021: "
             "1.1-1.4x)"),
    Fittable("tp_exposed_async", 0.05, 1.0, 0.35, 0.25, False, "time",
             "fraction of tensor-parallel communication left exposed when it is overlapped with the "
             "GEMMs (async TP, Transformer Engine userbuffers): the GEMMs are split into tp chunks "
             "and only the first chunk's transfer and the slowdown of the rest stay exposed"),
    Fittable("launch_gap_s", 5e-6, 300e-6, 45e-6, 0.7, True, "time",
             "host seconds per kernel when CUDA_LAUNCH_BLOCKING=1 makes every launch wait for its kernel "
             "(runs that set it only: CostParams.launch_blocking). Prior from BigScience's A/B on 80 A100 "
             "(chronicles-prequel 'dealing with JZ hanging': 97.20 vs 91.04 TFLOPs, 3.5 ms per block per "
             "micro-batch over a Megatron block's 78 counted kernels); bounds: a bare launch and wake-up "
             "(5 us) to a slow Python host (300 us); loose (the same chronicles saw no difference at 160 GPUs)"),
    Fittable("allocator_fragmentation", 0.0, 0.3, 0.05, 0.05, False, "memory",
             "caching-allocator reserve over live activations and transients"),
    Fittable("framework_overhead_gib", 0.02, 3.0, 0.3, 1.0, True, "memory",
             "framework state in torch's allocator beyond the model states, activations and "
             "transients, GiB (a few hundred MiB: RNG and timer state, small buffers; NCCL buffers, "
             "cuBLAS workspaces and the CUDA context are cost.reserved's own terms)"),
)

#: Per GPU family. Priors: large cuBLAS GEMMs reach 70-80% of the dense peak at sustained clocks
#: (NVIDIA 'Matrix Multiplication Background' guide); FlashAttention-2's forward reaches about
#: half the GEMM rate on A100 and a third on H100 (FA2 paper), before causal masking and short
#: sequences (attn_half_seq).
GPU_FIELDS: dict[str, tuple[float, float, float, float]] = {  # field: (low, high, prior, log sigma)
    "gemm_efficiency": (0.3, 0.95, 0.75, 0.2),
    "attention_efficiency": (0.1, 0.8, 0.4, 0.35),
}

#: Links. Prior: NCCL rings reach ~80% of line rate as bus bandwidth (nccl-tests on DGX A100/H100).
LINK_BOUNDS = (0.15, 0.98)
LINK_PRIOR = (0.8, 0.3)
#: Link kinds whose NCCL bus bandwidth was measured apart from any training run (prior, log sigma).
#: Omni-Path: BigScience's all_reduce benchmark on Jean Zay's A100 nodes (bigscience repository,
#: experiments/bandwidth/all_reduce_bench-a100-n4.txt: 4 nodes x 8 GPUs, 4 GB fp32) ran NCCL's
#: ring through one 100 Gb/s HFI per node (NCCL_DEBUG: both channels send via NET/IB/3) at a steady
#: 40.5 Gb/s bus bandwidth: 0.405 of that HFI's line rate.
LINK_PRIORS: dict[str, tuple[float, float]] = {"omnipath": (0.405, 0.2)}


#: The codebase's software efficiency, relative to the codebases behind the built-in calibration
#: (torchtitan, Megatron-LM, NeMo, llm-foundry, Megatron-DeepSpeed): loose priors, so that a handful
#: of a new codebase's runs can move them far (issue 28: a fork with slower kernels or no overlap is
#: 10-30% off the tuned codebases). ``all`` scales every rate at once and has the loosest prior, so a
#: uniform slowdown lands there rather than on whichever kind dominates the runs at hand; each kind
#: then takes what differs. Applied by calibration.store.Calibration on top of the GPU and link
#: efficiencies (at most 1 of the peak).
CODEBASE_KINDS: dict[str, str] = {
    "all": "every rate below at once",
    "gemm": "matrix-multiply throughput (the GPU's gemm_efficiency)",
    "attention": "attention kernel throughput (attention_efficiency, or flash_fwd_efficiency)",
    "memory": "memory-bound kernels: elementwise, norms, optimizer (hbm_efficiency)",
    "comm": "collective and send bandwidth on every link (the links' efficiency)",
}
CODEBASE: tuple[Fittable, ...] = tuple(
    Fittable(f"codebase_speed@{k}", 0.3 if k == "all" else 0.5, 1.6 if k == "all" else 1.5, 1.0,
             0.3 if k == "all" else 0.15, True, "time",
             f"this codebase's speed relative to the built-in calibration's codebases: {what}")
    for k, what in CODEBASE_KINDS.items()) + (
    Fittable("step_overhead_s", 0.0, 30.0, 0.0, 0.1, False, "time",
             "fixed per-step host overhead of this codebase (data loading, logging, launch gaps), seconds"),
    Fittable("codebase_memory", 0.6, 1.6, 1.0, 0.15, True, "memory",
             "this codebase's allocated memory relative to what the model counts (its engine's own "
             "buffers scale with the states, activations and transients the model names)"),)


def codebase_factor(values: dict[str, float], kind: str) -> float:
    """The codebase speed factor of ``kind`` (its own times ``all``) in ``values``; 1 where absent."""
    return values.get("codebase_speed@all", 1.0) * values.get(f"codebase_speed@{kind}", 1.0)


def gpu_param(field: str, family: str) -> Fittable:
    lo, hi, prior, sigma = GPU_FIELDS[field]
    return Fittable(gpu_key(field, family), lo, hi, prior, sigma, True, "time",
                    f"{family} GPUs: {'large-GEMM' if field == 'gemm_efficiency' else 'FlashAttention forward'} "
                    "fraction of the dense peak (each part: x its clock_ratio)")


def link_param(tier: str, kind: str) -> Fittable:
    return Fittable(link_key(tier, kind), *LINK_BOUNDS, *LINK_PRIORS.get(kind, LINK_PRIOR), True, "time",
                    f"achieved fraction of {kind} line rate ({tier}) by NCCL collectives")


#: GPU families and link tiers/kinds a calibration may name (spec.cluster: GPUSpec.family,
#: LinkTier.name and LinkTier.kind).
FAMILIES = ("ampere", "hopper", "blackwell", "ada", "volta", "cdna3")
TIERS = ("intra_node", "inter_node", "inter_dc")
LINK_KINDS = ("nvlink", "nvswitch", "pcie", "xgmi", "infiniband", "roce", "ethernet", "omnipath", "wan")


def by_name(name: str) -> Fittable:
    """The Fittable called ``name`` (a global, gemm_efficiency@FAMILY or link_efficiency@TIER:KIND);
    KeyError for anything else, a misspelt family, tier or link kind included."""
    for f in GLOBAL + CODEBASE:
        if f.name == name:
            return f
    field, _, rest = name.partition("@")
    if field in GPU_FIELDS and rest in FAMILIES:
        return gpu_param(field, rest)
    if field == "link_efficiency" and ":" in rest:
        tier, _, kind = rest.partition(":")
        if tier in TIERS and kind in LINK_KINDS:
            return link_param(tier, kind)
    raise KeyError(name)


def all_names_help() -> str:
    return (", ".join(f.name for f in GLOBAL + CODEBASE) + ", gemm_efficiency@FAMILY, attention_efficiency@FAMILY "
            f"(FAMILY: {', '.join(FAMILIES)}), link_efficiency@TIER:KIND (TIER: {', '.join(TIERS)}; "
            f"KIND: {', '.join(LINK_KINDS)})")
