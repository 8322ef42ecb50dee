"""The Plan and Workload of a published run.

``plan_from_row`` reads the plan in named steps, each filling what the row leaves out with the
framework's usual setting and recording it in the assumptions:

1. ``parallel_degrees``: tp, pp, dp, cp, ep and the number of GPUs (one unstated degree absorbs
   num_gpus);
2. ``batch_sizes``: global batch, micro-batch and gradient accumulation;
3. ``parse_schedule`` and ``pipeline_micro_batch``: the pipeline schedule, virtual stages and the
   micro-batch a pipeline splits the local batch into; ``reconcile_micro_batch``;
4. ``sharding``: ZeRO stage and the hybrid shard group;
5. ``parse_recompute``: activation recomputation (and how many blocks per stage);
6. ``sequence_parallel``, ``parse_precision``, ``kernels`` (compile, async TP, offload,
   the attention kernel (``attention_kernel``: every common spelling of attention_impl, else the
   profile's default, said in the assumptions), fused loss); ``cost_settings``: the CostParams
   settings the cells name (overlap_p2p_comm, overlap_grad_reduce, 16-bit/fp32 gradients, a
   measured CUDA context), the case's overrides;
7. ``stage_split``: blocks per pipeline stage when they do not divide evenly.

The order of the steps is the order of the assumption lines (and of the first reason a row is
unsupported), so it is part of the output.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import NamedTuple

from meshplan.cost.compute import FLASH_KERNELS
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.profile import DEFAULT_PROFILE, get_profile
from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload
from meshplan.validate.frameworks import DEFAULT_RECOMPUTE, DEFAULT_ZERO, FRAMEWORK_LABEL, source_year
from meshplan.validate.rows import Row, Unsupported, bool_cell

Assume = Callable[[str], None]

ROW_AXES = (AX.TP, AX.PP, AX.DP, AX.CP)
"""The mesh axes (spec.plan.AXES) in the order a published row, and the assumption lines, name
them."""
FREE_AXIS_ORDER = (AX.DP, AX.TP, AX.PP, AX.CP)
"""Which unstated degree absorbs num_gpus, first choice first."""


def parse_sharding(text: str | None, fw: str,
                   assume: Assume) -> tuple[int, bool, int | None]:
    """(zero stage, hybrid?, stated shard group) from the `sharding` cell."""
    if text is None:
        z = DEFAULT_ZERO[fw]
        assume(f"sharding not stated: assumed zero={z} ({FRAMEWORK_LABEL[fw]} default)")
        return z, False, None
    t = text.lower()
    hybrid = bool(re.search(r"hsdp|hybrid", t))
    m = re.search(r"(?:shard(?:ing)?[\s_-]*(?:group|degree|size)?|shard)\s*[=:]?\s*(\d+)", t)
    group = int(m.group(1)) if (hybrid and m) else None
    m = re.search(r"zero[\s_-]*(?:stage[\s_-]*)?[=:]?\s*(\d)", t)
    if m and int(m.group(1)) in (0, 1, 2, 3) and not t.startswith("none"):
        z = int(m.group(1))
        return (3 if hybrid and z == 0 else z), hybrid, group
    if "shard_grad_op" in t or "grad_op" in t or "zero2" in t:
        return 2, hybrid, group
    if "distributed optimizer" in t or "distributed-optimizer" in t or "distributed_optimizer" in t:
        return 1, hybrid, group
    if hybrid or "full_shard" in t or "fully shard" in t or "fsdp2" in t or "fully_shard" in t:
        return 3, hybrid, group
    if "no_shard" in t or t.startswith("none") or "ddp" in t or t in ("no", "off", "false"):
        return 0, False, None
    if "fsdp" in t:
        assume(f"sharding {text!r}: assumed FSDP's default FULL_SHARD (zero=3)")
        return 3, False, None
    if "zero" in t:
        assume(f"sharding {text!r} names no ZeRO stage: assumed ZeRO-1")
        return 1, False, None
    raise Unsupported(f"sharding {text!r} not understood")


def parse_schedule(text: str | None, pp: int, vs: int | None, fw: str,
                   assume: Assume) -> tuple[str, int]:
    """(schedule, virtual_stages)."""
    t = (text or "").lower()
    if text is None or t == "none":
        if pp > 1:
            sched = "interleaved-1f1b" if (vs or 1) > 1 else "1f1b"
            assume(f"pp_schedule not stated with pp={pp}: assumed {sched} "
                   f"({FRAMEWORK_LABEL[fw]} default)")
        else:
            sched = "1f1b"
    elif "dualpipe" in t:
        raise Unsupported(f"pipeline schedule {text!r} is not modelled")
    elif "zbv" in t or "zero bubble v" in t or "zero-bubble-v" in t or "zb-v" in t:
        sched = "zbv"
    elif re.search(r"zero[\s_-]*bubble|\bzb\b|zb-?h1|zbh1", t):
        sched = "zero-bubble"
    elif "interleav" in t or "looped" in t or "virtual" in t:
        sched = "interleaved-1f1b"
    elif "gpipe" in t or "fill-drain" in t or "fill drain" in t:
        sched = "gpipe"
    elif "1f1b" in t or "pipedream-flush" in t or pp == 1:
        sched = "1f1b"
    else:
        raise Unsupported(f"pipeline schedule {text!r} not understood")
    if pp == 1:
        return "1f1b", 1
    if sched == "zbv":
        if vs not in (None, 2):
            raise Unsupported(f"schedule ZBV uses 2 virtual stages, row says {vs}")
        return sched, 2
    if sched == "interleaved-1f1b":
        if vs is None:
            assume("virtual_stages not stated for the interleaved schedule: assumed 2 "
                   "(the smallest interleaving; torchtitan's default stages per rank)")
            vs = 2
        return sched, vs
    if vs is not None and vs > 1:
        assume(f"virtual_stages={vs} with schedule {text!r}: treated as interleaved-1f1b "
               "(Megatron interleaves whenever virtual stages > 1)")
        return "interleaved-1f1b", vs
    return sched, 1


def parse_recompute(text: str | None, fw: str, layers_per_stage: int,
                    assume: Assume) -> tuple[str, int | None]:
    """(recompute, recompute_layers)."""
    if text is None:
        text = DEFAULT_RECOMPUTE[fw]
        assume(f"recompute not stated: assumed {text!r} ({FRAMEWORK_LABEL[fw]} default)")
    t = text.lower()
    if t.startswith(("none", "no", "off", "false", "disabled")):
        return "none", None
    if "selective" in t and "layer" in t:
        m = re.search(r"(?:every|period|freq\w*|ac[\s_]*option)\s*[=:]?\s*(\d+)", t)
        period = int(m.group(1)) if m else 2
        if not m:
            assume("'selective (layer)' period not stated: assumed torchtitan's default "
                   "selective_ac_option=2 (every 2nd block checkpointed) -> full recompute of "
                   f"{layers_per_stage // 2} of {layers_per_stage} blocks per stage")
        return "full", layers_per_stage // period
    if "selective" in t and re.search(r"\bop\b", t):
        return "op", None  # torchtitan op-level SAC: every other matmul recomputed
    if "selective" in t or "attention core" in t:
        return "selective", None
    if t.startswith("full") or "checkpoint" in t or "every" in t or t in ("yes", "true", "on"):
        m = re.search(r"(\d+)\s*(?:of\s*\d+\s*)?(?:layers|blocks)", t)
        if m and "every" not in t:
            n = int(m.group(1))
            return "full", min(n, layers_per_stage)
        return "full", None
    raise Unsupported(f"recompute {text!r} not understood")


def parse_precision(text: str | None, fw: str, assume: Assume) -> str:
    if text is None:
        assume("precision not stated: assumed bf16")
        return "bf16"
    t = text.lower()
    if "fp8" in t or "float8" in t or "e4m3" in t:
        return "fp8"
    if "fp16" in t or "float16" in t or "half" in t:
        return "fp16"
    if "bf16" in t or "bfloat16" in t:
        return "bf16"
    if "fp32" in t or "float32" in t or "tf32" in t:
        return "fp32"
    if "16-bit" in t or "16 bit" in t or "mixed" in t:
        assume(f"precision {text!r}: assumed bf16 (fp16 and bf16 have the same tensor-core peak)")
        return "bf16"
    assume(f"precision {text!r} not understood: assumed bf16")
    return "bf16"


def split_layers(L: int, pp: int, vs: int, fw: str, notes: str) -> tuple[int, ...]:
    """Blocks per pipeline rank when L is not divisible by pp*vs, as the framework splits them."""
    if fw == "deepspeed" and "embedding" in notes and vs == 1:
        # DeepSpeed partition_method 'type:transformer|embedding': the two embedding layers
        # count as one unit each, so the first and last stages get one block fewer.
        units = L + 2
        base, extra = divmod(units, pp)
        per = [base + (1 if i < extra else 0) for i in range(pp)]
        per[0] -= 1
        per[-1] -= 1
        if min(per) >= 0 and sum(per) == L:
            return tuple(per)
    if vs == 1:
        # torchtitan generate_split_points: stage 0 gets base, middle stages base+1 while
        # extra layers remain, the last stage the rest.
        base, extra = divmod(L, pp)
        per = [base]
        for _ in range(1, pp - 1):
            if extra > 0:
                per.append(base + 1)
                extra -= 1
            else:
                per.append(base)
        per.append(L - sum(per))
        return tuple(per)
    # Interleaved: each rank's count must be a multiple of vs; spread chunks of vs blocks.
    if L % vs:
        raise Unsupported(f"{L} layers cannot be split into pp={pp} stages of whole "
                           f"virtual_stages={vs} chunks")
    units = L // vs
    base, extra = divmod(units, pp)
    return tuple(vs * (base + (1 if i < extra else 0)) for i in range(pp))


#: attention_impl spellings -> the kernel (cost.compute.ATTENTION_KERNELS), first match wins;
#: (pattern, kernel, note: an assumption line when the kernel is costed as another's).
_ATTENTION_SPELLINGS: tuple[tuple[str, str, str], ...] = (
    (r"(?<!un)fused[\s_-]*(scale[\s_-]*)?(masked[\s_-]*)?softmax|scaled[\s_-]*masked[\s_-]*softmax", "fused-softmax", ""),
    (r"flash[\s_-]*(attn|attention)?[\s_-]*(v|version)?[\s_-]*3|\bfa[\s_-]*3\b|fav3", "flash3", ""),
    (r"flash[\s_-]*(attn|attention)?[\s_-]*(v|version)?[\s_-]*2|\bfa[\s_-]*2\b|fav2", "flash2", ""),
    (r"flash[\s_-]*(attn|attention)?[\s_-]*(v|version)?[\s_-]*1\b|\bfa[\s_-]*1\b|fav1", "flash1", ""),
    (r"\bsdpa\b|scaled[\s_-]*dot[\s_-]*product|pytorch[\s_-]*(native[\s_-]*)?attention", "sdpa", ""),
    # megatron-core's --attention-backend names: flash, fused (TE's cuDNN FusedAttention), unfused, local
    (r"cudnn|(?<!un)fused[\s_-]*attn|(?<!un)fused[\s_-]*attention|^fused$", "cudnn", ""),
    (r"triton", "triton", "Triton FlashAttention kernel: FlashAttention-2 is 1.3-2.5x faster (FA2 paper); costed at "
                          "1/1.3 of its rate"),
    (r"xformers|memory[\s_-]*efficient|mem[\s_-]*eff", "flash2",
     "memory-efficient attention (xformers) costed at FlashAttention-2's rate (no published ratio)"),
    (r"\bflex", "flash2", "FlexAttention costed at FlashAttention-2's rate (no published ratio)"),
    (r"transformer[\s_-]*engine|\bte\b", "cudnn",
     "Transformer Engine attention: its cuDNN FusedAttention on Hopper+ (TE's backend selection gives it "
     "preference there), FlashAttention-2's rate elsewhere"),
    (r"flash", "flash2", ""),  # unversioned flash-attn / flash_attention: the current major version, 2
    (r"pre-flash|unfused|eager|\bmath\b|\btorch\b|naive|vanilla|standard|baseline|manual", "eager", ""),
)


def attention_kernel(text: str, default: str, assume: Assume) -> str:
    """The attention kernel an ``attention_impl`` cell names (cost.compute.ATTENTION_KERNELS):
    every common spelling (eager/math/torch, sdpa, fused softmax, flash v1/v2/v3, FA1-3,
    flash_attention_2, flash-attn, triton, cudnn, xformers, ...); a blank cell gives the
    profile's ``default``, said in the assumptions, and so does a cell not understood."""
    t = " ".join(text.lower().split())
    if not t:
        assume(f"attention kernel not stated: assumed the profile's default {default}")
        return default
    for pattern, kernel, note in _ATTENTION_SPELLINGS:
        if re.search(pattern, t):
            if note:
                assume(note)
            return kernel
    assume(f"attention_impl {text!r} not understood: assumed the profile's default {default}")
    return default


def attention_is_flash(text: str, assume: Assume, default: str = "flash2") -> bool:
    """FlashAttention-style kernel or the unfused softmax path (Megatron before 2022)."""
    return attention_kernel(text, default, assume) in FLASH_KERNELS


# ======================================================================================
# The steps of plan_from_row, in order
# ======================================================================================
class Degrees(NamedTuple):
    """The parallel degrees of a row and its number of GPUs (tp*pp*dp*cp)."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    n: int
    dp_as_stated: int
    """The row's own dp before it was made consistent with num_gpus (hybrid sharding reads it)."""


def parallel_degrees(row: Row, assume: Assume) -> Degrees:
    """tp, pp, dp, cp, ep and num_gpus: one unstated degree absorbs num_gpus (dp first, then tp,
    pp, cp), the others are 1; a dp inconsistent with num_gpus is recomputed from it."""
    stated: dict[str, int] = {}
    for ax in (*ROW_AXES, AX.EP):
        v = row.integer(ax)
        if v is not None:
            if v <= 0:
                raise Unsupported(f"{ax}={v} must be positive")
            stated[ax] = v
    n = row.integer("num_gpus")
    if n is not None and n <= 0:
        raise Unsupported(f"num_gpus={n} must be positive")
    missing = [ax for ax in ROW_AXES if ax not in stated]
    free = next((ax for ax in FREE_AXIS_ORDER if ax in missing), None) if n else None
    deg = {ax: stated.get(ax, 1) for ax in (*ROW_AXES, AX.EP)}
    ones = [ax for ax in missing + ([AX.EP] if AX.EP not in stated else []) if ax != free]
    if ones:
        assume(f"{', '.join(ones)} not stated: assumed 1")
    if free is not None:
        assert n is not None
        rest = math.prod(deg[a] for a in ROW_AXES if a != free)
        if n % rest:
            raise Unsupported(f"num_gpus={n} is not divisible by the stated degrees ({rest})")
        deg[free] = n // rest
        others = "*".join(a for a in ROW_AXES if a != free)
        assume(f"{free} not stated: derived num_gpus/({others}) = {deg[free]}")
    tp, pp, dp, cp, ep = (deg[a] for a in (*ROW_AXES, AX.EP))
    if n is None:
        if AX.DP not in stated:
            raise Unsupported("neither num_gpus nor dp is stated")
        n = tp * pp * dp * cp
        assume(f"num_gpus not stated: derived tp*pp*dp*cp = {n}")
    dp_as_stated = dp
    if n != tp * pp * dp * cp:
        if n % (tp * pp * cp) == 0:
            new = n // (tp * pp * cp)
            assume(f"dp={dp} inconsistent with num_gpus={n}: used dp = num_gpus/(tp*pp*cp) = {new}")
            dp = new
        else:
            raise Unsupported(f"tp*pp*dp*cp = {tp * pp * dp * cp} does not match num_gpus={n}")
    return Degrees(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, n=n, dp_as_stated=dp_as_stated)


def batch_sizes(row: Row, fw: str, dp: int, assume: Assume) -> tuple[int, int, int | None]:
    """(global batch, micro-batch, gradient accumulation or None when not stated): a missing
    global batch is micro_batch*dp*grad_accum, a missing micro-batch global/(dp*grad_accum)."""
    B = row.integer("global_batch_seqs")
    mb = row.integer("micro_batch")
    ga = row.integer("grad_accum")
    for name, v in (("global_batch_seqs", B), ("micro_batch", mb), ("grad_accum", ga)):
        if v is not None and v <= 0:
            raise Unsupported(f"{name}={v} must be positive")
    if B is None:
        if mb is None:
            raise Unsupported("neither global_batch_seqs nor micro_batch is stated")
        if ga is None:
            ga = 1
            assume("grad_accum not stated: assumed 1")
        B = mb * dp * ga
        assume(f"global_batch_seqs not stated: derived micro_batch*dp*grad_accum = {B}")
    if mb is None:
        if ga is not None and B % (dp * ga) == 0:
            mb = B // (dp * ga)
            assume(f"micro_batch not stated: derived global_batch/(dp*grad_accum) = {mb}")
        elif fw == "torchtitan" and B % dp == 0:
            mb = B // dp
            assume(f"micro_batch not stated: torchtitan local batch = global_batch/dp = {mb}")
        else:
            mb = 1
            assume("micro_batch not stated: assumed 1")
    return B, mb, ga


def pipeline_micro_batch(fw: str, B: int, dp: int, pp: int, vs: int, mb: int, ga: int | None,
                         assume: Assume) -> int:
    """The micro-batch under a pipeline whose micro-batch count the row does not state:
    torchtitan's default n_microbatches = pp*stages_per_rank splits the local batch."""
    if not (pp > 1 and ga is None):
        return mb
    if fw == "torchtitan" and B % dp == 0:
        local = B // dp
        m = pp * vs
        if local % m == 0:
            mb = local // m
            note = (f"PP micro-batch count not stated: assumed torchtitan's default "
                    f"n_microbatches = pp*stages_per_rank = {m}, so the local batch "
                    f"{local} gives micro_batch={mb}")
        else:
            note = (f"PP micro-batch count not stated: torchtitan default {m} does "
                    f"not divide the local batch {local}; assumed "
                    f"global_batch/(dp*micro_batch) = {B / (dp * mb):g}")
    else:
        note = ("micro-batch count for PP not stated: assumed "
                f"global_batch/(dp*micro_batch) = {B / (dp * mb):g}")
    assume(note)
    return mb


def reconcile_micro_batch(B: int, dp: int, mb: int, ga: int | None, assume: Assume) -> int:
    """A micro-batch consistent with the global batch: a stated grad_accum wins; otherwise an
    uneven split becomes the largest divisor of the per-rank batch <= micro_batch."""
    if ga is not None and dp * mb * ga != B and B % (dp * ga) == 0:
        # grad_accum is micro-batches per step per data-parallel rank: trust it and the batch.
        new = B // (dp * ga)
        assume(f"micro_batch*dp*grad_accum = {mb}*{dp}*{ga} != global batch {B}: used "
               f"micro_batch = global_batch/(dp*grad_accum) = {new}")
        return new
    if B % (dp * mb) and B % dp == 0:
        # Uneven micro-batching (Composer splits the local batch into ceil(local/mb) pieces):
        # the nearest even split uses the largest divisor of the local batch <= micro_batch.
        local = B // dp
        new = max(d for d in range(1, min(mb, local) + 1) if local % d == 0)
        assume(f"micro_batch={mb} does not divide the per-rank batch {local} "
               f"(uneven micro-batches): assumed micro_batch={new}")
        return new
    return mb


def sharding(row: Row, fw: str, deg: Degrees, assume: Assume) -> tuple[int, int]:
    """(zero stage, shard_group): hybrid sharding shards within a group (the row's own dp, or
    FSDP HYBRID_SHARD's default of one node), 0 when the group spans all of dp*cp."""
    zero, hybrid, group = parse_sharding(row.text("sharding"), fw, assume)
    sg = row.integer("shard_group") or row.integer("dp_shard") or group
    if not hybrid:
        return zero, 0
    dp, stated = deg.dp, deg.dp_as_stated
    if sg is None and stated != dp and dp % stated == 0:
        sg = stated
        assume(f"hybrid sharding: the row's dp={stated} read as the shard group "
               f"(replicated {dp // stated} times)")
    if sg is None:
        per_node = row.integer("gpus_per_node") or min(8, deg.n)
        sg = max(1, per_node // deg.tp)
        assume(f"hybrid sharding group not stated: assumed FSDP HYBRID_SHARD default "
               f"(shard within a node) = {sg} ranks")
    return zero, (sg if sg < dp * deg.cp else 0)


def sequence_parallel(row: Row, fw: str, tp: int, assume: Assume) -> bool:
    """Stated, or torchtitan's default (its TP plan shards the norms); never with tp=1."""
    sp = bool_cell(row.text("sequence_parallel"))
    if sp is None:
        sp = fw == "torchtitan" and tp > 1
        why = " TP plan shards norms" if sp else " default"
        assume(f"sequence_parallel not stated: assumed {'yes' if sp else 'no'} "
               f"({FRAMEWORK_LABEL[fw]}{why})")
    if sp and tp == 1:
        assume("sequence_parallel=yes with tp=1 has no effect: set to no")
        sp = False
    return sp


class Kernels(NamedTuple):
    """Implementation choices that change cost (Plan fields)."""

    compile: bool
    async_tp: bool
    offload_optimizer: bool
    offload_params: bool
    flash_attention: bool
    fused_loss: bool
    attention_kernel: str = "flash2"
    """The kernel attention_impl names (or the profile's default): the row's CostParams override."""


def _compiled(row: Row, fw: str, other: str, assume: Assume) -> bool:
    """torch.compile stated, or Megatron's hand-fused elementwise kernels (costed as compiled)."""
    if ("torch.compile" in other or "torch_compile" in other
            or bool_cell(row.text("compile")) is True):
        return True
    # Megatron-LM / NeMo (Transformer Engine or apex fused LayerNorm/RMSNorm, bias-GeLU and
    # bias-SwiGLU fusions, fused bias-dropout-add, fused RoPE) and Megatron-DeepSpeed (apex
    # fused LayerNorm, bias-GeLU, bias-dropout-add) run hand-fused elementwise kernels
    # without torch.compile; plain DeepSpeed (e.g. HF Trainer + ZeRO) does not.
    megatron_code = fw == "megatron" or (fw == "deepspeed" and re.search(
        r"megatron|bloom|bigscience", " ".join(row.lower(c) for c in (
            "source", "source_id", "model", "other_settings", "notes", "framework"))))
    if megatron_code and bool_cell(row.text("compile")) is None:
        assume(f"elementwise ops: {FRAMEWORK_LABEL[fw]}'s hand-fused kernels (fused norms, "
               "bias-GeLU/SwiGLU, bias-dropout-add, RoPE): the fused bytes, as its profile's "
               "elementwise_kernels='hand-fused'")
        return True  # the cost model's fused-elementwise path (Plan.compile)
    return False


def kernels(row: Row, fw: str, zero: int, assume: Assume, profile: str = DEFAULT_PROFILE) -> Kernels:
    """compile, async TP, optimizer/parameter offload, FlashAttention and the fused loss, from
    the other_settings and sharding text and their own columns."""
    other = " ".join(row.lower(c) for c in ("other_settings", "sharding"))
    compile_ = _compiled(row, fw, other, assume)
    async_tp = bool(re.search(r"async[\s_-]*tp|tp[\s_-]*comm[\s_-]*overlap", other)) or \
        bool_cell(row.text("async_tp")) is True
    if async_tp and named_setting(other, _TP_COMM_OVERLAP) is False:
        async_tp = False  # 'tp_comm_overlap=False' names the setting, off
    offload_opt = bool(re.search(r"offload[\s_-]*(optim|opt\b)|optimizer[\s_-]*offload"
                                 r"|zero[\s_-]*offload|cpu[\s_-]*adam", other))
    offload_par = bool(re.search(r"param\w*[\s_-]*offload|offload[\s_-]*param|cpuoffload"
                                 r"|cpu[\s_-]*offload", other))
    if offload_par:
        if zero != 3:
            raise Unsupported("parameter offload needs FSDP/ZeRO-3 sharding")
        offload_opt = True
    default_kernel = get_profile(profile).apply(DEFAULT_PARAMS).attention_kernel
    att = attention_kernel(row.text("attention_impl") or "", default_kernel, assume)
    flash = att in FLASH_KERNELS
    fused_loss = fw == "llm-foundry" or bool(re.search(r"fused[\s_-]*(cross|ce\b|loss)|liger", other))
    if fw == "llm-foundry":
        assume("loss: llm-foundry's default fused_crossentropy (in-place logits gradient)")
    return Kernels(compile=compile_, async_tp=async_tp, offload_optimizer=offload_opt,
                   offload_params=offload_par, flash_attention=flash, fused_loss=fused_loss,
                   attention_kernel=att)


_TP_COMM_OVERLAP = r"(?:ub[\s_-]*)?tp[\s_-]*comm[\s_-]*overlap"
_P2P_OVERLAP = r"overlap[\s_-]*p2p[\s_-]*comm\w*"
_GRAD_OVERLAP = r"overlap[\s_-]*grad[\s_-]*(?:reduce|sync)"


def named_setting(text: str, name: str) -> bool | None:
    """A boolean setting a cell names in a framework's own spelling (``name`` a regex):
    'name=True', 'name: false', 'name on/off/yes/no', '--name' or a bare name (True); 'no name' /
    'without name' (False); None when the cell does not name it."""
    m = re.search(rf"(no[\s_-]+|without[\s_-]+|--no-)?(?:--)?\b{name}\b\s*(?:[=:]\s*)?(\w+)?", text)
    if m is None:
        return None
    if m.group(1):
        return False
    v = bool_cell(m.group(2)) if m.group(2) else None
    return True if v is None else v


_LAUNCH_BLOCKING = re.compile(r"(#\s*)?(?:export\s+)?cuda_launch_blocking\s*=\s*(\d)([^;]{0,40})")


def launch_blocking(text: str) -> bool:
    """The cell sets CUDA_LAUNCH_BLOCKING=1 for the run: named =1, not commented out ('#export',
    'commented out' right after it) and not =0."""
    for m in _LAUNCH_BLOCKING.finditer(text.lower()):
        if m.group(2) == "1" and not m.group(1) and "comment" not in m.group(3):
            return True
    return False


def cost_settings(row: Row, fw: str, pp: int, vs: int, profile: str, assume: Assume) -> dict:
    """CostParams settings beyond the profile that the row's cells name (the case's overrides),
    each said in the assumptions:

    * ``overlap_p2p_comm`` (Megatron-Core / NeMo): the interleaved schedule's pipeline sends and
      receives run asynchronously under the next micro-batch's compute -> pp_p2p_exposed=0
      (no effect without virtual stages: Megatron overlaps them only in the interleaved schedule);
      off ('overlap_p2p_comm=False', '--no-overlap-p2p-communication') where the profile
      overlaps -> pp_p2p_overlap='none'; not named, in a source from before 2023, where the
      profile overlaps -> pp_p2p_overlap='none' (the flag came to Megatron in 2023, with
      NVIDIA/apex#1616: the SC'21 and Korthikanti 2022 runs waited on their sends);
    * ``overlap_grad_reduce`` / ``overlap_grad_sync`` on or off -> dp_overlap;
    * 16-bit gradient accumulation ('grads accumulated in fp16', 'fp16 gradients': DeepSpeed
      ZeRO-1/2 with fp16) -> main_grads='bf16' (16-bit buffers); fp32 gradient accumulation
      ('fp32 grad accumulation', 'fp32 main grads') -> main_grads='fp32'; megatron-core's
      grad_reduce_in_fp32=False / True (its gradient buffer in the parameters' dtype / fp32) -> bf16 / fp32;
    * a measured CUDA context ('CUDA context 1573 MiB': the measured memory is nvidia-smi's, which
      includes it) -> cuda_context_gib;
    * a MoE router forced to balance ('moe_router_force_load_balancing=True', 'force-balanced':
      megatron-core's benchmarking router, random logits) -> moe_expert_load_cv=0 (no effect on a
      dense model);
    * ``CUDA_LAUNCH_BLOCKING=1`` set for the run ('export CUDA_LAUNCH_BLOCKING=1'; not where the cell
      says it was commented out, '#export ...', or =0) -> launch_blocking (synchronous launches:
      CostParams.launch_blocking)."""
    other = " ".join(row.lower(c) for c in ("other_settings", "sharding", "precision"))
    base = get_profile(profile).apply(DEFAULT_PARAMS)
    out: dict = {}
    p2p = named_setting(other, _P2P_OVERLAP)
    if p2p is True and pp > 1 and vs > 1:
        out["pp_p2p_exposed"] = 0.0
        assume("overlap_p2p_comm: pipeline sends/receives overlapped with compute in the interleaved "
               "schedule: costed as hidden (pp_p2p_exposed=0)")
    elif p2p is True and pp > 1:
        assume("overlap_p2p_comm acts only in the interleaved schedule (virtual stages > 1): ignored")
    elif pp > 1 and (base.pp_p2p_overlap == "all" or (base.pp_p2p_overlap == "interleaved" and vs > 1)):
        year = source_year(row)
        if p2p is False:
            out["pp_p2p_overlap"] = "none"
            assume("overlap_p2p_comm off as the row states: pipeline sends exposed (pp_p2p_overlap='none')")
        elif year is not None and year < 2023:
            out["pp_p2p_overlap"] = "none"
            assume(f"pipeline sends exposed: the source ({year}) predates Megatron's overlap_p2p_comm (2023), "
                   f"the profile's default {base.pp_p2p_overlap!r} does not apply (pp_p2p_overlap='none')")
    grad = named_setting(other, _GRAD_OVERLAP)
    if grad is not None and grad != base.dp_overlap:
        out["dp_overlap"] = grad
        assume(f"data-parallel gradient reduction {'overlapped with' if grad else 'after'} the backward "
               f"(the row's overlap_grad_reduce={grad}; the profile's default is {base.dp_overlap})")
    if re.search(r"bf16[\s_-]*optimizer|bf16_optimizer", other):
        grads = "bf16+fp32"  # DeepSpeed BF16_Optimizer: bf16 .grad + an unsharded fp32 accumulation buffer
    elif re.search(r"grad_reduce_in_fp32\s*=\s*false", other):
        grads = "bf16"  # megatron-core DistributedDataParallelConfig: the grad buffer in the param dtype
    elif re.search(r"grad_reduce_in_fp32\s*=\s*true", other):
        grads = "fp32"
    elif re.search(r"grad\w*\s+(?:accumulat\w*\s+)?in\s+(?:fp16|bf16|16[\s-]*bit)"
                 r"|(?:fp16|bf16|16[\s-]*bit)\s+grad\w*\s+accumulat", other):
        grads = "bf16"
    elif re.search(r"grad\w*\s+(?:accumulat\w*\s+)?in\s+fp32|fp32\s+(?:main\s+)?grad\w*", other):
        grads = "fp32"
    else:
        grads = None
    if grads is not None and grads != base.main_grads:
        out["main_grads"] = grads
        how = {"bf16": "16 bit", "fp32": "fp32", "bf16+fp32": "16 bit plus an unsharded fp32 accumulation buffer "
               "(DeepSpeed BF16_Optimizer)"}[grads]
        assume(f"gradients held and reduced in {how} as the row states "
               f"(main_grads={grads!r})")
    if re.search(r"moe_router_force_load_balancing\s*=\s*true|force[\s-]*balanced", other):
        # megatron-core's router.py: moe_router_force_load_balancing replaces the logits with random
        # ones ("Apply force load balancing with random logits for benchmark"): no persistent skew
        out["moe_expert_load_cv"] = 0.0
        assume("MoE router forced to balance (moe_router_force_load_balancing=True: random logits, as the row "
               "states): no persistent expert skew (moe_expert_load_cv=0), only the finite-token spread")
    if launch_blocking(row.lower("other_settings")) and not base.launch_blocking:
        out["launch_blocking"] = True
        assume("CUDA_LAUNCH_BLOCKING=1 as the row states: every kernel launch waits for the kernel, each kernel "
               "costs the host's gap before it (launch_blocking, launch_gap_s per kernel)")
    m = re.search(r"cuda[\s_-]*context\D{0,40}?(\d+(?:\.\d+)?)\s*(mib|gib|mb|gb)\b", other)
    if m:
        gib = float(m.group(1)) / (1024.0 if m.group(2) in ("mib", "mb") else 1.0)
        if gib != base.cuda_context_gib:
            out["cuda_context_gib"] = round(gib, 3)
            assume(f"measured memory includes the CUDA context ({m.group(1)} {m.group(2)} as the row states): "
                   f"cuda_context_gib={round(gib, 3)}")
    return out


def stage_split(row: Row, fw: str, L: int, pp: int, vs: int, rec_layers: int | None,
                assume: Assume) -> tuple[tuple[int, ...] | None, int | None]:
    """(stage_layers, recompute_layers): the framework's uneven split when pp*virtual_stages does
    not divide the blocks (None when it does), and recompute_layers capped at the largest stage."""
    stage_layers = None
    if L % (pp * vs) and pp > 1:
        stage_layers = split_layers(L, pp, vs, fw, row.lower("notes"))
        assume(f"{L} layers are not divisible by pp*virtual_stages = {pp}*{vs}: assumed "
               f"{FRAMEWORK_LABEL[fw]}'s uneven split, blocks per stage {list(stage_layers)}")
    if rec_layers is not None and stage_layers is not None:
        rec_layers = min(rec_layers, max(stage_layers))
    return stage_layers, rec_layers


def plan_from_row(row: Row, fw: str, model: ModelSpec, assume: Assume, profile: str = DEFAULT_PROFILE,
                  overrides: dict | None = None) -> tuple[Plan, Workload, int]:
    """(plan, workload, number of GPUs); the caller builds the cluster. The steps run in the
    module docstring's order. ``profile``: the row's implementation profile (its defaults fill
    the attention kernel); ``overrides`` (when given) receives the row's CostParams settings
    beyond the profile (the attention kernel its attention_impl names)."""
    deg = parallel_degrees(row, assume)
    tp, pp, dp = deg.tp, deg.pp, deg.dp
    B, mb, ga = batch_sizes(row, fw, dp, assume)
    sched, vs = parse_schedule(row.text("pp_schedule"), pp, row.integer("virtual_stages"), fw, assume)
    mb = pipeline_micro_batch(fw, B, dp, pp, vs, mb, ga, assume)
    mb = reconcile_micro_batch(B, dp, mb, ga, assume)
    zero, shard_group = sharding(row, fw, deg, assume)
    L = model.num_layers
    recompute, rec_layers = parse_recompute(row.text("recompute"), fw, max(1, L // pp), assume)
    sp = sequence_parallel(row, fw, tp, assume)
    precision = parse_precision(row.text("precision"), fw, assume)
    k = kernels(row, fw, zero, assume, profile)
    if overrides is not None and k.attention_kernel != get_profile(profile).apply(DEFAULT_PARAMS).attention_kernel:
        overrides["attention_kernel"] = k.attention_kernel
    settings = cost_settings(row, fw, pp, vs, profile, assume)
    if overrides is not None:
        overrides.update(settings)
    stage_layers, rec_layers = stage_split(row, fw, L, pp, vs, rec_layers, assume)
    try:
        plan = Plan(tp=tp, pp=pp, dp=dp, cp=deg.cp, ep=deg.ep, zero=zero, shard_group=shard_group,
                    micro_batch=mb, virtual_stages=vs, schedule=sched, recompute=recompute,
                    recompute_layers=rec_layers, sequence_parallel=sp,
                    offload_optimizer=k.offload_optimizer, offload_params=k.offload_params,
                    precision=precision, compile=k.compile, async_tp=k.async_tp,
                    flash_attention=k.flash_attention, fused_loss=k.fused_loss,
                    # sends carry 1/tp of the activation: Megatron's scatter-gather, and DeepSpeed's
                    # PipelineEngine too (is_pipe_partitioned = is_grad_partitioned = is_model_parallel:
                    # PartitionedTensor sends each TP rank's part, the receiver all-gathers it;
                    # deepspeed/runtime/pipe/engine.py@2151c78)
                    stage_layers=stage_layers, p2p_sharded=True,
                    grad_sync="all-reduce" if fw == "deepspeed" else "auto")
        work = Workload(global_batch=B, seq_len=model.seq_len)
    except MeshplanError as e:
        raise Unsupported(str(e)) from None
    return plan, work, deg.n
