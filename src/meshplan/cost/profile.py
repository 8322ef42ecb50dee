"""Implementation profiles: what differs between training codebases, as cost-model settings.

A profile names a codebase (Megatron-LM/NeMo, DeepSpeed, torchtitan, ...) and the CostParams
fields its choices set: the attention kernel, elementwise fusion, data-parallel gradient sync,
gradient buffers, logits/loss precision and chunking, optimizer temporaries, communication
buffers and the CUDA context. Profiles set only codebase choices, never fitted hardware numbers
(those come from a calibration), so the two compose in either order.

    get_profile(None)          -> meshplan's own runtime (the default)
    get_profile("torchtitan")  -> a built-in profile
    get_profile("my.toml")     -> a profile file (see docs/profiles.md)

A profile file is TOML: an optional ``name``, ``label`` and ``base`` (a built-in profile whose
settings it starts from), and the CostParams fields of PROFILE_FIELDS, at the top level or
under ``[settings]``. Each built-in profile's settings cite the codebase's default they follow.
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from meshplan.cost.compute import ATTENTION_KERNELS, ELEMENTWISE_KERNELS, LOSS_KERNELS
from meshplan.cost.memory import MAIN_GRAD_BYTES
from meshplan.cost.params import COLLECTIVES_ALGORITHMS, DEFAULT_PARAMS, P2P_OVERLAP, CostParams
from meshplan.cost.reserved import NCCL_GROUPS
from meshplan.errors import MeshplanError

DEFAULT_PROFILE = "meshplan"

#: The CostParams fields a profile may set (codebase choices), with their allowed values
#: (a tuple of strings), or their type and lower bound.
PROFILE_FIELDS: dict[str, Any] = {
    "attention_kernel": ATTENTION_KERNELS,
    "elementwise_kernels": ELEMENTWISE_KERNELS,
    "dp_overlap": bool,
    "param_gather_overlap": bool,
    "dp_bucket_mib": (float, 0.0),
    "dp_bucket_buffers": (float, 0.0),
    "main_grads": ("auto", *MAIN_GRAD_BYTES),
    "fsdp_reduce_bytes": (float, 1.0),
    "fsdp_prefetch_layers": (int, 0),
    "loss_kernel": LOSS_KERNELS,
    "logits_fp32": bool,
    "optimizer_temp_bytes": (float, 0.0),
    "cuda_context_gib": (float, 0.0),
    "expandable_segments": bool,
    "nccl_buffer_gib": (float, 0.0),
    "nccl_groups": NCCL_GROUPS,
    "optimizer_init_cache": bool,
    "framework_overhead_gib": (float, 0.0),
    "pipeline_variable_shapes": bool,
    "pp_p2p_overlap": P2P_OVERLAP,
    "collectives": COLLECTIVES_ALGORITHMS,
    "moe_capacity_factor": (float, 0.0),
    "moe_pad_to_capacity": bool,
    "moe_probs_in_activation": bool,
}

#: What each value means, for Profile.describe().
_SAYS: dict[str, Any] = {
    "attention_kernel": lambda v: {
        "flash1": "FlashAttention 1 (half FA2's throughput)", "flash2": "FlashAttention-2",
        "flash3": "FlashAttention-3 (1.5x FA2 on Hopper)", "sdpa": "PyTorch SDPA (FlashAttention-2 backend)",
        "cudnn": "cuDNN attention (1.75x FA2 on Hopper)",
        "triton": "Triton FlashAttention (FA2 is 1.3x faster)",
        "eager": "eager/math (s x s scores materialised, separate fp32 softmax)",
        "fused-softmax": "Megatron's fused scale-mask-softmax (s x s scores materialised)"}[v],
    "elementwise_kernels": lambda v: {
        "eager": "eager PyTorch ops (fused only with compile)",
        "hand-fused": "hand-fused kernels (norms, bias-GeLU/SwiGLU, bias-dropout-add, RoPE)",
        "compiled": "torch.compile'd (fused)"}[v],
    "dp_overlap": lambda v: ("overlapped with the backward (last bucket exposed)" if v
                             else "after the backward (not overlapped)"),
    "param_gather_overlap": lambda v: ("ZeRO-1/2 parameter gather under the next forward" if v
                                       else "ZeRO-1/2 parameter gather after the optimizer step"),
    "nccl_groups": lambda v: {"axes": "one NCCL communicator per parallel axis plus the default group",
                              "deepspeed-pipe": "DeepSpeed PipelineEngine's grid groups beside Megatron's "
                                                "tensor-parallel and the default group"}[v],
    "optimizer_init_cache": lambda v: ("the fp16 optimizer's start-up buffers stay reserved (no empty_cache)" if v
                                       else "start-up buffers released or reused"),
    "dp_bucket_mib": lambda v: f"{v:g} MiB buckets",
    "dp_bucket_buffers": lambda v: f"{v:g} bucket buffer(s) held" if v else "buckets are views of the gradient buffer",
    "main_grads": lambda v: {"auto": "16-bit (DDP) / fp32 (ZeRO-1/2)", "fp32": "fp32 main grads",
                             "bf16": "16-bit", "bf16+fp32": "bf16 .grad + unsharded fp32 accumulation"}[v],
    "fsdp_reduce_bytes": lambda v: "fp32" if v >= 4 else "16-bit",
    "fsdp_prefetch_layers": lambda v: f"{v} layer(s) gathered ahead",
    "loss_kernel": lambda v: {"torch": "torch cross_entropy on the full logits (fused only with fused_loss)",
                              "inplace": "vocabulary-parallel cross-entropy in place on one copy of the logits "
                                         "(Megatron; fused only with fused_loss)",
                              "fused": "fused in-place cross-entropy",
                              "chunked": "chunked fused linear + CE (Liger)"}[v],
    "logits_fp32": lambda v: "upcast to fp32" if v else "16-bit",
    "pp_p2p_overlap": lambda v: {
        "none": "blocking (exposed) sends and receives",
        "interleaved": "sends/receives under compute in the interleaved schedule (virtual stages > 1) only",
        "all": "sends/receives under compute in every schedule"}[v],
    "collectives": lambda v: {"nccl": "NCCL: rings/trees within a site, hierarchical across sites",
                              "flat-ring": "one flat ring at the slowest link (gloo-like)"}[v],
    "pipeline_variable_shapes": lambda v: ("each micro-batch of a pipeline at its own length" if v else
                                           "a pipeline's micro-batches padded to the longest length"),
    "optimizer_temp_bytes": lambda v: f"{v:g} B/param temporaries (foreach)" if v else "fused (no temporaries)",
    "cuda_context_gib": lambda v: f"{v:g} GiB" if v else "0.5 GiB (lazy module loading)",
    "expandable_segments": lambda v: ("expandable segments (no fragmentation of cached blocks)" if v
                                      else "caching allocator without expandable segments (fragmentation)"),
    "nccl_buffer_gib": lambda v: f"{v:g} GiB extra" if v else "4 MiB per channel and peer per communicator",
    "framework_overhead_gib": lambda v: f"{v:g} GiB",
    "moe_capacity_factor": lambda v: f"tokens past {v:g} x an expert's mean load dropped" if v else "dropless",
    "moe_pad_to_capacity": lambda v: ("every expert's buffer padded to its capacity" if v
                                      else "experts run the tokens they get"),
    "moe_probs_in_activation": lambda v: ("routing probabilities applied in the experts' activation (no expert "
                                          "outputs kept for the combine)" if v
                                          else "the combine weights the expert outputs (and keeps them)"),
}
_TOPIC = {"attention_kernel": "attention", "elementwise_kernels": "elementwise", "dp_overlap": "DP gradient sync",
          "param_gather_overlap": "DP parameter gather",
          "dp_bucket_mib": "DP buckets", "dp_bucket_buffers": "DP bucket memory", "main_grads": "gradients (ZeRO 0-2)",
          "fsdp_reduce_bytes": "FSDP reduce-scatter", "fsdp_prefetch_layers": "FSDP prefetch",
          "loss_kernel": "loss", "logits_fp32": "logits at the loss", "optimizer_temp_bytes": "optimizer step",
          "cuda_context_gib": "CUDA context", "expandable_segments": "CUDA allocator",
           "nccl_buffer_gib": "NCCL buffers", "nccl_groups": "NCCL communicators",
           "optimizer_init_cache": "optimizer start-up",
          "framework_overhead_gib": "framework overhead", "pipeline_variable_shapes": "pipeline shapes",
          "pp_p2p_overlap": "pipeline sends", "collectives": "collectives",
          "moe_capacity_factor": "MoE capacity", "moe_pad_to_capacity": "MoE expert buffers",
          "moe_probs_in_activation": "MoE combine"}


@dataclass(frozen=True)
class Profile:
    """One codebase's implementation choices."""

    name: str
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)
    """CostParams field -> value."""
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """CostParams field -> the codebase default it follows (a short citation)."""
    builtin: bool = True
    """A built-in profile (validated on the development runs of its codebase where it has any); False for
    a profile file: a codebase meshplan has no evidence for, whose step band is the unknown codebase's
    (CostParams.band_basis) until a calibration on its runs narrows it."""

    def apply(self, params: CostParams) -> CostParams:
        extra = {} if self.builtin else {"band_basis": "unknown"}
        return params.replace(**self.overrides, profile=self.name, **extra)

    def describe(self, params: CostParams = DEFAULT_PARAMS) -> list[str]:
        """One line per choice, as applied to ``params``: 'attention: PyTorch SDPA ... [source]'."""
        p = self.apply(params)
        lines = []
        for key in PROFILE_FIELDS:
            v = getattr(p, key)
            src = self.sources.get(key)
            lines.append(f"{_TOPIC[key]}: {_SAYS[key](v)}" + (f" [{src}]" if src else ""))
        return lines


def _profile(name: str, label: str, **settings: tuple[Any, str]) -> Profile:
    overrides = {k: v for k, (v, _) in settings.items()}
    _check(overrides, f"built-in profile {name!r}")
    return Profile(name, label, overrides, {k: s for k, (_, s) in settings.items()})


def _check(overrides: dict[str, Any], where: str) -> dict[str, Any]:
    """The overrides, validated (types coerced); MeshplanError naming the bad key or value."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in PROFILE_FIELDS:
            close = get_close_matches(key, list(PROFILE_FIELDS), n=1)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise MeshplanError(f"{where}: unknown setting {key!r}{guess}",
                                hint="profile settings: " + ", ".join(PROFILE_FIELDS))
        rule = PROFILE_FIELDS[key]
        if isinstance(rule, tuple) and all(isinstance(x, str) for x in rule):
            if not isinstance(value, str) or value not in rule:
                raise MeshplanError(f"{where}: {key} = {value!r} is not understood",
                                    hint=f"{key} is one of: " + ", ".join(rule))
        elif rule is bool:
            if not isinstance(value, bool):
                raise MeshplanError(f"{where}: {key} = {value!r} is not true or false", hint=f"write {key} = true")
        else:
            typ, low = rule
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (typ is int and value != int(value)):
                raise MeshplanError(f"{where}: {key} = {value!r} is not a {'whole ' if typ is int else ''}number",
                                    hint=f"{key} is a number >= {low:g}")
            if not value >= low or value != value or value in (float("inf"),):
                raise MeshplanError(f"{where}: {key} = {value!r} is out of range", hint=f"{key} is a number >= {low:g}")
            value = typ(value)
        out[key] = value
    return out


# Each setting: (value, the codebase default it follows). Only what differs from CostParams'
# defaults needs saying, but every profile states its attention, elementwise, DP sync and loss.
PROFILES: dict[str, Profile] = {p.name: p for p in (
    _profile(
        DEFAULT_PROFILE, "meshplan's own runtime (FSDP2, DTensor TP, SDPA)",
        attention_kernel=("sdpa", "runtime/models.py: F.scaled_dot_product_attention"),
        elementwise_kernels=("eager", "runtime: fused only with compile=1 (torch.compile)"),
        dp_overlap=(True, "runtime: torch DDP (bucketed all-reduce under the backward)"),
        dp_bucket_mib=(25.0, "torch DDP bucket_cap_mb=25"),
        loss_kernel=("torch", "runtime/models.py: F.cross_entropy(logits.float())"),
        logits_fp32=(True, "runtime/models.py: logits upcast with .float()"),
        pp_p2p_overlap=("none", "runtime: torch.distributed.pipelining schedules wait on each receive right "
                                "before the stage's compute"),
    ),
    _profile(
        "megatron", "Megatron-LM / NeMo (megatron-core)",
        attention_kernel=("cudnn", "Transformer Engine's DotProductAttention (--attention-backend auto) gives "
                                   "its cuDNN FusedAttention preference on Hopper+ ('Disabling FlashAttention to give "
                                   "FusedAttention preference on Hopper+ for performance reasons', TE attention "
                                   "utils); FlashAttention-2 elsewhere (cudnn is priced as flash2 off Hopper)"),
        elementwise_kernels=("hand-fused", "--bias-gelu-fusion, --bias-swiglu-fusion, --bias-dropout-fusion, "
                                           "--apply-rope-fusion on by default; TE/apex fused norms"),
        dp_overlap=(False, "--overlap-grad-reduce off by default (DistributedDataParallelConfig."
                           "overlap_grad_reduce=False)"),
        dp_bucket_buffers=(0.0, "buckets are views into the param-and-grad buffer (param_and_grad_buffer.py)"),
        main_grads=("fp32", "bf16 sets accumulate_allreduce_grads_in_fp32: fp32 main_grad buffer, "
                            "18 B/param without --use-distributed-optimizer"),
        loss_kernel=("inplace", "--cross-entropy-loss-fusion off by default: megatron-core's vocab-parallel "
                                "cross-entropy, in place on the fp32 copy (tensor_parallel/cross_entropy.py)"),
        logits_fp32=(True, "--fp16-lm-cross-entropy off by default: the loss upcasts the logits"),
        optimizer_temp_bytes=(0.0, "apex/TE FusedAdam (multi-tensor apply)"),
        moe_probs_in_activation=(True, "megatron-core TEGroupedMLP multiplies the routing probabilities in the "
                                       "activation (weighted_bias_swiglu_impl) and unpermutes without them "
                                       "(moe/README.md: 'Memory efficient token permutation')"),
        pp_p2p_overlap=("interleaved", "overlap_p2p_comm on by default (--no-overlap-p2p-communication turns it "
                                       "off), forced off without virtual stages ('non-interleaved schedule does not "
                                       "support overlapping p2p communication', arguments.py validate_args)"),
    ),
    _profile(
        "nemo", "NeMo 2.0 recipes (megatron-core underneath)",
        attention_kernel=("cudnn", "Transformer Engine's DotProductAttention (--attention-backend auto) gives "
                                   "its cuDNN FusedAttention preference on Hopper+ ('Disabling FlashAttention to give "
                                   "FusedAttention preference on Hopper+ for performance reasons', TE attention "
                                   "utils); FlashAttention-2 elsewhere (cudnn is priced as flash2 off Hopper)"),
        elementwise_kernels=("hand-fused", "megatron-core's fusions (bias-activation, bias-dropout-add, RoPE)"),
        param_gather_overlap=(True, "recipes' overlap_param_gather=True with the distributed optimizer"),
        dp_overlap=(True, "recipes' DistributedDataParallelConfig(overlap_grad_reduce=True, "
                          "overlap_param_gather=True)"),
        dp_bucket_buffers=(0.0, "megatron-core buckets are views into the param-and-grad buffer"),
        main_grads=("fp32", "recipes' grad_reduce_in_fp32=True (bf16_mixed plugin)"),
        loss_kernel=("inplace", "megatron-core vocab-parallel cross-entropy, in place on the fp32 copy"),
        logits_fp32=(True, "megatron-core upcasts the logits for the loss"),
        optimizer_temp_bytes=(0.0, "TE/apex FusedAdam"),
        moe_probs_in_activation=(True, "megatron-core TEGroupedMLP multiplies the routing probabilities in the "
                                       "activation (weighted_bias_swiglu_impl) and unpermutes without them "
                                       "(moe/README.md: 'Memory efficient token permutation')"),
        pp_p2p_overlap=("interleaved", "MegatronCommOverlapCallback: overlap_p2p_comm=True (batch_p2p_comm=False) "
                                       "when pp > 1 and virtual stages > 1, else False"),
    ),
    _profile(
        "megatron-deepspeed", "Megatron-DeepSpeed (BigScience / Microsoft fork)",
        attention_kernel=("fused-softmax", "FlashAttention only with --use-flash-attn; default "
                                           "FusedScaleMaskSoftmax (BLOOM-176B trained with it, ALiBi)"),
        elementwise_kernels=("hand-fused", "apex fused LayerNorm, bias-GeLU and bias-dropout-add fusions"),
        dp_overlap=(False, "DeepSpeed zero_optimization.overlap_comm=false by default"),
        main_grads=("auto", "bf16 runs use DeepSpeed's BF16_Optimizer: fp32 gradient accumulation"),
        loss_kernel=("inplace", "Megatron's vocab-parallel cross-entropy (mpu/cross_entropy.py), in place on "
                                "the fp32 copy"),
        logits_fp32=(True, "--fp16-lm-cross-entropy off by default"),
        optimizer_temp_bytes=(0.0, "DeepSpeed FusedAdam"),
        pp_p2p_overlap=("none", "DeepSpeed's PipelineEngine: runtime/pipe/p2p.py send/recv are blocking "
                                "dist.send/dist.recv (assert async_op == False)"),
        nccl_groups=("deepspeed-pipe", "deepspeed.initialize hands a PipelineModule's PipelineParallelGrid to the "
                                       "engine as its mpu; the grid creates its own data/model/pipe/slice groups "
                                       "(runtime/pipe/topology.py@2151c787a) beside Megatron's mpu groups"),
        optimizer_init_cache=(True, "DeepSpeed fp16 ZeRO-0/1/2 (fused_optimizer.py, zero/stage_1_and_2.py@2151c787a) "
                                    "flatten the 16-bit parameters and free the originals and temporaries; no "
                                    "torch.cuda.empty_cache() in DeepSpeed's runtime or Megatron-DeepSpeed@541b967f"),
        moe_capacity_factor=(1.0, "--moe-train-capacity-factor 1.0 by default, tokens dropped unless "
                                  "--disable-moe-token-dropping (deepspeed/moe/sharded_moe.py: capacity = "
                                  "ceil(tokens / E x capacity_factor))"),
        moe_pad_to_capacity=(True, "deepspeed/moe/sharded_moe.py: MOELayer dispatches einsum('sec,sm->ecm'), "
                                   "an [E, capacity, hidden] buffer, and all-to-alls it whole"),
    ),
    _profile(
        "deepspeed", "DeepSpeed ZeRO (HF model code, DeepSpeed engine)",
        attention_kernel=("sdpa", "transformers' default attn_implementation='sdpa'"),
        elementwise_kernels=("eager", "HF modeling code: eager PyTorch ops"),
        dp_overlap=(False, "zero_optimization.overlap_comm=false by default"),
        dp_bucket_mib=(953.7, "zero_optimization.reduce_bucket_size=5e8 elements of 2 B"),
        dp_bucket_buffers=(1.0, "one IPG bucket (contiguous_gradients, no overlap_comm)"),
        main_grads=("bf16", "ZeRO-1/2 keep and reduce gradients in the 16-bit model dtype"),
        loss_kernel=("torch", "HF ForCausalLMLoss"),
        logits_fp32=(True, "HF ForCausalLMLoss: logits.float()"),
        optimizer_temp_bytes=(0.0, "DeepSpeed FusedAdam"),
        pp_p2p_overlap=("none", "PipelineEngine: runtime/pipe/p2p.py send/recv are blocking dist.send/dist.recv "
                                "(assert async_op == False)"),
        optimizer_init_cache=(True, "DeepSpeed fp16 ZeRO-0/1/2 (fused_optimizer.py, zero/stage_1_and_2.py@2151c787a) "
                                    "flatten the 16-bit parameters and free the originals and temporaries without "
                                    "torch.cuda.empty_cache()"),
    ),
    _profile(
        "torchtitan", "torchtitan (FSDP2, DTensor TP, SDPA)",
        attention_kernel=("sdpa", "model attention: F.scaled_dot_product_attention (flex only if asked)"),
        elementwise_kernels=("eager", "[compile] enable=false by default"),
        dp_overlap=(True, "FSDP2 reduce-scatter per block under the backward; DDP: torch defaults"),
        fsdp_reduce_bytes=(4.0, "[training] mixed_precision_reduce='float32'"),
        loss_kernel=("torch", "cross_entropy_loss on pred.float()"),
        logits_fp32=(True, "cross_entropy_loss: pred.flatten(0, 1).float()"),
        optimizer_temp_bytes=(0.0, "[optimizer] implementation='fused'"),
        expandable_segments=(True, "run_train.sh@47f63f4: "
                                   "PYTORCH_CUDA_ALLOC_CONF=\"expandable_segments:True\" torchrun ..."),
        pp_p2p_overlap=("none", "torch.distributed.pipelining: batched isend/irecv, but each receive is waited "
                                "right before its stage's compute (1F1B fuses the forward send with the backward "
                                "receive and waits on both)"),
    ),
    _profile(
        "llm-foundry", "llm-foundry (Composer, FSDP)",
        attention_kernel=("flash2", "MPT attn_config.attn_impl='flash' (flash-attn 2)"),
        elementwise_kernels=("eager", "Composer does not compile by default"),
        dp_overlap=(True, "FSDP FULL_SHARD, backward_prefetch BACKWARD_POST"),
        fsdp_reduce_bytes=(4.0, "fsdp_config.mixed_precision='DEFAULT': reduce_dtype fp32"),
        loss_kernel=("fused", "loss_fn='fused_crossentropy' (flash-attn xentropy, in place)"),
        logits_fp32=(True, "used only without the fused loss"),
        optimizer_temp_bytes=(0.0, "Composer DecoupledAdamW steps one tensor at a time"),
    ),
    _profile(
        "hf-accelerate", "Hugging Face Trainer / Accelerate (FSDP or DDP)",
        attention_kernel=("sdpa", "transformers' default attn_implementation='sdpa'"),
        elementwise_kernels=("eager", "torch_compile=False by default"),
        dp_overlap=(True, "torch DDP / FSDP defaults"),
        dp_bucket_mib=(25.0, "torch DDP bucket_cap_mb=25 (ddp_bucket_cap_mb unset)"),
        fsdp_reduce_bytes=(2.0, "Accelerate's FSDP mixed precision: reduce_dtype = the bf16 compute dtype"),
        loss_kernel=("torch", "ForCausalLMLoss"),
        logits_fp32=(True, "ForCausalLMLoss: logits.float()"),
        optimizer_temp_bytes=(4.0, "optim='adamw_torch': torch AdamW, foreach on CUDA (sqrt(v) temporaries)"),
    ),
    _profile(
        "nanotron", "nanotron (Hugging Face)",
        attention_kernel=("flash2", "flash_attn_varlen_func (flash-attn 2)"),
        elementwise_kernels=("hand-fused", "TritonRMSNorm and flash-attn's fused rotary"),
        dp_overlap=(True, "DDP with bucketed gradient all-reduce under the backward"),
        main_grads=("fp32", "optimizer.accumulate_grad_in_fp32=true in the example configs"),
        loss_kernel=("torch", "sharded_cross_entropy"),
        logits_fp32=(True, "sharded_cross_entropy(..., dtype=torch.float)"),
        optimizer_temp_bytes=(0.0, "torch_adam_is_fused=true in the example configs"),
    ),
)}

#: Framework names as validate.frameworks detects them (and common spellings) -> profile.
_FRAMEWORK_PROFILES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("megatron-deepspeed", ("megatron-deepspeed", "megatron_deepspeed", "megatron deepspeed", "bigscience")),
    ("torchtitan", ("torchtitan",)),
    ("llm-foundry", ("llm-foundry", "llmfoundry", "llm_foundry", "composer", "mosaic")),
    ("nanotron", ("nanotron",)),
    ("hf-accelerate", ("hf-accelerate", "accelerate", "hf trainer", "transformers", "huggingface", "hugging face",
                       "hf")),
    ("nemo", ("nemo",)),
    ("megatron", ("megatron", "mcore")),
    ("deepspeed", ("deepspeed",)),
    (DEFAULT_PROFILE, ("meshplan",)),
)


def get_profile(name_or_path: str | None) -> Profile:
    """A built-in profile by name, or a profile file; None gives meshplan's runtime."""
    key = DEFAULT_PROFILE if name_or_path is None else str(name_or_path).strip()
    if key in PROFILES:
        return PROFILES[key]
    if key.lower() in PROFILES:
        return PROFILES[key.lower()]
    path = Path(key)
    if path.suffix.lower() == ".toml" or path.is_file():
        return load_profile(path)
    close = get_close_matches(key.lower(), list(PROFILES), n=1)
    raise MeshplanError(f"unknown profile {name_or_path!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                        hint="built-in profiles: " + ", ".join(PROFILES) + "; or a .toml profile file")


def load_profile(path: str | Path) -> Profile:
    """A profile file (TOML): name, label, base (a built-in profile) and CostParams settings."""
    p = Path(path)
    where = f"profile file {str(p)[:80]}"
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MeshplanError(f"{where} not found",
                            hint="give a built-in profile (" + ", ".join(PROFILES) + ") or an existing .toml file",
                            ) from None
    except OSError as e:
        raise MeshplanError(f"cannot read {where}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise MeshplanError(f"{where} is not valid TOML: {e}", hint="see docs/profiles.md for the format") from None
    data = dict(data)
    name = data.pop("name", p.stem)
    label = data.pop("label", f"profile file {p.name}")
    base_name = data.pop("base", None)
    settings = data.pop("settings", {})
    if not isinstance(settings, dict):
        raise MeshplanError(f"{where}: [settings] must be a table", hint="write [settings] then key = value lines")
    for k, v in data.items():
        if isinstance(v, dict):
            raise MeshplanError(f"{where}: unknown table [{k}]", hint="only [settings] is a table in a profile file")
    if set(settings) & set(data):
        raise MeshplanError(f"{where}: {sorted(set(settings) & set(data))[0]} is set twice",
                            hint="set each key once, at the top or under [settings]")
    if not isinstance(name, str) or not isinstance(label, str):
        raise MeshplanError(f"{where}: name and label must be strings", hint='write name = "my-profile"')
    base = Profile(DEFAULT_PROFILE, "", {})
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in PROFILES:
            raise MeshplanError(f"{where}: base = {base_name!r} is not a built-in profile",
                                hint="base is one of: " + ", ".join(PROFILES))
        base = PROFILES[base_name]
    own = _check({**data, **settings}, where)
    sources = {**base.sources, **{k: f"{p.name}" for k in own}}
    return Profile(name, label, {**base.overrides, **own}, sources, builtin=False)


def profile_for_framework(fw: str) -> str:
    """The built-in profile of a framework name as validate.frameworks detects it (megatron,
    torchtitan, llm-foundry, deepspeed, ...) or as people write it (NeMo, Megatron-Core, HF
    Trainer, Accelerate, Composer, nanotron, Megatron-DeepSpeed); meshplan's own otherwise."""
    text = (fw or "").strip().lower()
    if text in PROFILES:
        return text
    for name, keys in _FRAMEWORK_PROFILES:
        if any(k == text or (len(k) > 2 and k in text) for k in keys):
            return name
    return DEFAULT_PROFILE


def profile_fields() -> list[str]:
    """The CostParams fields a profile may set."""
    return list(PROFILE_FIELDS)


assert all(f in {x.name for x in dataclasses.fields(CostParams)} for f in PROFILE_FIELDS)
