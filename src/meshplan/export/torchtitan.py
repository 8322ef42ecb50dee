"""A plan as a torchtitan job config: TOML for ``--job.config_file`` plus the same settings as
``--section.key value`` overrides (torchtitan 0.2.x JobConfig / ConfigManager; 0.3 replaced TOML
files by Python config registries).

torchtitan's mesh is pp x dp_replicate x dp_shard x cp x tp; FSDP shards over dp_shard x cp (cp is
always inside the FSDP group), DDP (dp_replicate alone) cannot be combined with TP/PP/CP, and TP
always comes with sequence parallelism. meshplan's runtime follows the same conventions."""
from __future__ import annotations

from typing import Any

from meshplan.export.common import (
    ExportInput,
    ExportResult,
    compression_words,
    describe,
    optimizer_unsupported,
    placement_unsupported,
    recompute_layers_per_chunk,
    require,
    stage_layer_counts,
    sync_groups,
    sync_overlap,
    sync_words,
)
from meshplan.spec.model import ModelSpec
from meshplan.spec.export_limits import torchtitan_dp_split
from meshplan.spec.plan import Plan

TARGET = "torchtitan"

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
             "zero-bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble"}
"""meshplan schedule -> torch.distributed.pipelining schedule name (the runtime's choice)."""

FLAVORS: dict[tuple[str, str], dict[str, int]] = {
    ("llama3", "8B"): {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn": 14336},
    ("llama3", "70B"): {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn": 28672},
    ("llama3", "405B"): {"dim": 16384, "n_layers": 126, "n_heads": 128, "n_kv_heads": 8, "ffn": 53248},
}
"""torchtitan 0.2.x model flavors (torchtitan/models/llama3/__init__.py, llama3_args) by shape;
ffn is the SwiGLU width torchtitan derives from dim, ffn_dim_multiplier and multiple_of.
tests/export checks this table against the installed torchtitan's source."""
LLAMA3_VOCAB = 128256
"""TransformerModelArgs.vocab_size default (the Llama 3 tokenizer)."""

FP8_CONVERTER = "quantize.linear.float8"

FT_CONFIG_MODULE = "torchtitan.components.ft.config"
"""torchtitan 0.2.x's JobConfig extension with the semi-synchronous (torchft) settings: sync_steps,
should_quantize, fragment_sync_delay, ... (torchtitan/components/ft/config/job_config.py); the base
JobConfig's [fault_tolerance] has only enable, process_group, replica_id, group_size,
min_replica_size and semi_sync_method."""
FT_TRAINER = "torchtitan.experiments.ft.train"
"""The trainer that runs torchft (FTTrainer: FTManager, maybe_semi_sync_training); torchtitan.train
ignores [fault_tolerance]."""
SEMI_SYNC = {"local-sgd": "local_sgd", "diloco": "diloco"}
"""meshplan grad_sync -> fault_tolerance.semi_sync_method (torchtitan/components/ft/manager.py,
maybe_semi_sync_training: torchft's local_sgd.LocalSGD / local_sgd.DiLoCo)."""


TORCHTITAN_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}
"""optimizer.name values torchtitan's build_optimizers accepts (torch.optim Adam and AdamW; its
default AdamW is not written)."""

def schedule_name(p: Plan) -> str:
    """The torch.distributed.pipelining schedule: an interleaved schedule needs >= 2 stages per rank,
    so interleaved-1f1b with one stage per rank is plain 1F1B (the same schedule), and GPipe over
    several stages per rank is LoopedBFS (as the runtime does)."""
    if p.schedule == "interleaved-1f1b" and p.virtual_stages == 1:
        return "1F1B"
    if p.schedule == "gpipe" and p.virtual_stages > 1:
        return "LoopedBFS"
    return SCHEDULES[p.schedule]


def _llama_like(m: ModelSpec) -> bool:
    return (m.position == "rotary" and m.norm == "rmsnorm" and m.mlp_type == "swiglu" and not m.bias
            and not m.tied_embeddings and not m.embedding_norm and m.causal and not m.is_moe
            and m.head_dim in (None, m.hidden_size // m.num_attention_heads))


def flavor(m: ModelSpec) -> tuple[str, str] | None:
    """The torchtitan (model name, flavor) with exactly this shape, or None."""
    if not _llama_like(m):
        return None
    shape = {"dim": m.hidden_size, "n_layers": m.num_layers, "n_heads": m.num_attention_heads,
             "n_kv_heads": m.kv_heads, "ffn": m.ffn_hidden_size}
    if m.vocab_size != LLAMA3_VOCAB:
        return None
    for key, s in FLAVORS.items():
        if s == shape:
            return key
    return None


def _fqns(counts: list[int]) -> list[list[str]]:
    """Module names per model part for torchtitan's Llama-family models (tok_embeddings,
    layers.N, norm, output), ``counts`` blocks per global stage in model order."""
    parts, layer = [], 0
    for i, n in enumerate(counts):
        names = ["tok_embeddings"] if i == 0 else []
        names += [f"layers.{j}" for j in range(layer, layer + n)]
        layer += n
        if i == len(counts) - 1:
            names += ["norm", "output"]
        parts.append(names)
    return parts


def build(inp: ExportInput) -> ExportResult:
    require(inp, TARGET, model=True, seq_len=True)
    p, m = inp.plan, inp.model
    assert m is not None and inp.global_batch is not None and inp.seq_len is not None
    uns: list[str] = []
    notes: list[str] = []

    # ---- model -------------------------------------------------------------------------------
    fl = flavor(m)
    model: dict[str, Any] = {}
    if fl is not None:
        model["name"], model["flavor"] = fl
    else:
        family = "llama3" if _llama_like(m) else m.name
        model["name"], model["flavor"] = family, m.name
        shape = (f"dim={m.hidden_size}, n_layers={m.num_layers}, n_heads={m.num_attention_heads}, "
                 f"n_kv_heads={m.kv_heads}, vocab_size={m.vocab_size}, SwiGLU width {m.ffn_hidden_size}")
        if _llama_like(m):
            uns.append(f"model {m.name}: torchtitan has no flavor of this shape; add one to "
                       f"torchtitan/models/llama3/__init__.py llama3_args[{m.name!r}] = TransformerModelArgs("
                       f"{shape}) (model.flavor is set to {m.name!r})")
        else:
            uns.append(f"model {m.name}: not one of torchtitan's model families (it has "
                       f"{m.position} positions, {m.norm}, {m.mlp_type}, bias={m.bias}, "
                       f"tied embeddings={m.tied_embeddings}, experts={m.num_experts}); register a TrainSpec "
                       f"named {m.name!r} for it (model.name/flavor are set to {m.name!r})")

    # ---- periodic sync (torchft): one torchtitan job per inner group --------------------------
    ft, groups = _fault_tolerance(inp, uns, notes)
    group_plan = p.replace(dp=p.dp // groups) if groups > 1 else p

    # ---- data parallel / FSDP ------------------------------------------------------------------
    par: dict[str, Any] = {}
    rep, shard = torchtitan_dp_split(group_plan, uns)
    par["data_parallel_replicate_degree"] = rep
    par["data_parallel_shard_degree"] = shard
    fsdp = shard > 1 or p.cp > 1
    if fsdp:
        par["fsdp_reshard_after_forward"] = "default" if p.zero == 3 else "never"
    par["tensor_parallel_degree"] = p.tp
    par["pipeline_parallel_degree"] = p.pp
    par["context_parallel_degree"] = p.cp
    uns += placement_unsupported("torchtitan", p, "its world mesh pp, dp_replicate, dp_shard, cp, tp, outermost first "
                                 "(ParallelDims) = mesh_order=pp:dp:cp:tp")
    if p.ep > 1:
        par["expert_parallel_degree"] = p.ep
        par["expert_tensor_parallel_degree"] = p.tp
    if p.tp > 1:
        if not p.sequence_parallel:
            uns.append("sequence_parallel=0 with tp>1: torchtitan's tensor parallelism always shards norms "
                       "and dropout along the sequence (sequence parallel on)")
        if p.async_tp:
            par["enable_async_tensor_parallel"] = True
            if not p.compile:
                uns.append("async_tp without compile: torchtitan overlaps TP communication only under "
                           "torch.compile; set compile.enable = true (or drop async_tp)")
    elif p.async_tp:
        notes.append("async_tp has no effect with tp=1")
    if p.pp > 1 and p.tp > 1 and not p.p2p_sharded:
        uns.append("p2p_sharded=0: torchtitan pipeline sends carry the sequence-parallel shard, never "
                   "the whole activation on every TP rank")

    # ---- pipeline --------------------------------------------------------------------------------
    counts = stage_layer_counts(m.num_layers, p)
    if p.pp > 1:
        par["pipeline_parallel_schedule"] = schedule_name(p)
        par["pipeline_parallel_microbatch_size"] = p.micro_batch
        if p.schedule == "zero-bubble" and p.virtual_stages == 1:
            uns.append("schedule=zero-bubble with virtual_stages=1: torchtitan's zero-bubble schedules "
                       "(InterleavedZeroBubble, ZBVZeroBubble) are tested with >= 2 stages per rank; "
                       "exported as InterleavedZeroBubble with one stage per rank")
        if len(set(counts)) == 1 and not (p.schedule == "zero-bubble" and p.virtual_stages == 1):
            par["pipeline_parallel_layers_per_stage"] = counts[0]
            par["pipeline_parallel_first_stage_less_layers"] = 0
            par["pipeline_parallel_last_stage_less_layers"] = 0
        else:
            par["module_fqns_per_model_part"] = _fqns(counts)
            if fl is None:
                notes.append("module_fqns_per_model_part names the modules of torchtitan's Llama models "
                             "(tok_embeddings, layers.N, norm, output); rename them for another model")
    # ---- batch -----------------------------------------------------------------------------------
    training: dict[str, Any] = {
        # Under PP one step runs all micro-batches through the pipeline (no extra accumulation);
        # otherwise each rank runs micro_batch sequences and torchtitan accumulates gradients.
        "local_batch_size": inp.global_batch // p.dp if p.pp > 1 else p.micro_batch,
        "global_batch_size": inp.global_batch,
        "seq_len": inp.seq_len,
    }
    # ---- precision, offload --------------------------------------------------------------------
    if p.precision == "fp32":
        training["mixed_precision_param"] = "float32"
    else:
        training["mixed_precision_param"] = "bfloat16"
        if p.precision == "fp16":
            uns.append("precision=fp16: torchtitan trains in bf16 or fp32 only; exported as bf16")
        if p.precision == "fp8":
            model["converters"] = [FP8_CONVERTER]
            notes.append("fp8 linears (model.converters = quantize.linear.float8) need torchao and an "
                         "fp8 GPU (H100 or newer)")
    if not fsdp and p.precision != "fp32" and (p.tp > 1 or p.pp > 1):
        uns.append(f"precision={p.precision} with TP/PP and no data parallelism: torchtitan applies mixed "
                   "precision through FSDP (or autocast for DDP/single-device runs only), so this run computes "
                   "in fp32; set training.dtype = \"bfloat16\" for pure bf16 training")
    if p.offload_params:
        training["enable_cpu_offload"] = True
        if not p.offload_optimizer:
            notes.append("training.enable_cpu_offload keeps parameters, gradients and the optimizer step on "
                         "the CPU (FSDP CPUOffloadPolicy), more than offload_params alone")
    elif p.offload_optimizer:
        uns.append("offload_optimizer without offload_params: torchtitan offloads only all together "
                   "(training.enable_cpu_offload: parameters, gradients and optimizer states); not exported")
    if p.grad_sync == "all-reduce" and fsdp:
        uns.append("grad_sync=all-reduce: torchtitan's FSDP always reduce-scatters gradients")
    if not p.periodic and p.grad_compression in ("bf16", "fp8"):
        uns.append(f"grad_compression={p.grad_compression}: torchtitan 0.2.x reduces gradients in float32 only "
                   "(training.mixed_precision_reduce accepts only \"float32\"); not exported")
    elif p.grad_compression == "powersgd":
        uns.append(f"{compression_words(p)}: torchtitan has no setting for a DDP communication hook (PowerSGD "
                   "is torch's powerSGD_hook, registered in training code); not exported")

    # ---- recompute -----------------------------------------------------------------------------
    ac: dict[str, Any] = {}
    chunk_counts = [c for c in counts if c > 0] or [0]
    if p.recompute == "none":
        ac["mode"] = "none"
    elif p.recompute == "op":
        ac["mode"], ac["selective_ac_option"] = "selective", "op"
    elif p.recompute == "selective":
        ac["mode"], ac["selective_ac_option"] = "selective", "op"
        uns.append("recompute=selective (attention core only, Megatron's): torchtitan has no such mode; "
                   "exported as op-level selective AC (selective_ac_option = \"op\"), which also recomputes "
                   "norms and activations")
    else:
        k = recompute_layers_per_chunk(p, chunk_counts)
        n = chunk_counts[0]
        if k is None:
            ac["mode"] = "full"
        elif k == 0:
            ac["mode"] = "none"
        elif len(set(chunk_counts)) == 1 and n % k == 0:
            ac["mode"], ac["selective_ac_option"] = "selective", str(n // k)
            notes.append(f"recompute_layers={k}: torchtitan recomputes every {n // k}-th block "
                         f"({k} of the {n} blocks per model chunk), not the first {k}")
        else:
            ac["mode"] = "full"
            uns.append(f"recompute_layers={k}: torchtitan recomputes all blocks or every n-th block; "
                       f"{k} of {'/'.join(map(str, sorted(set(chunk_counts))))} blocks per chunk is neither; "
                       "exported as full recompute of every block")

    # ---- kernels ---------------------------------------------------------------------------------
    compile_tbl = {"enable": p.compile}
    if p.fused_loss:
        uns.append("fused_loss: torchtitan has no fused cross-entropy (with TP it computes the loss "
                   "vocabulary-parallel)")
    if not p.flash_attention:
        uns.append("flash_attention=0: torchtitan always uses fused attention (SDPA / FlexAttention)")

    uns += optimizer_unsupported("torchtitan", inp, TORCHTITAN_OPTIMIZERS)
    job: dict[str, Any] = {"description": f"meshplan export: {p.short()}"}
    if ft:
        job["custom_config_module"] = FT_CONFIG_MODULE
    tables: dict[str, dict[str, Any]] = {
        "job": job,
        "model": model,
        **({"optimizer": {"name": TORCHTITAN_OPTIMIZERS[inp.optimizer]}}
           if inp.optimizer in TORCHTITAN_OPTIMIZERS and inp.optimizer != "adamw" else {}),
        "training": training,
        "parallelism": par,
        "activation_checkpoint": ac,
        "compile": compile_tbl,
    }
    if ft:
        tables["fault_tolerance"] = ft
        n = p.num_gpus // groups
        notes.append(f"launch {groups} replica group(s) of {n} GPUs, each its own torchtitan job with "
                     f"--fault_tolerance.replica_id 0..{groups - 1}: NGPU={n} TRAIN_FILE={FT_TRAINER} "
                     "CONFIG_FILE=<this file> ./run_train.sh --fault_tolerance.replica_id=I (torchrun ... "
                     f"-m {FT_TRAINER} --job.config_file <this file>), after starting the torchft lighthouse "
                     "(torchft_lighthouse --min_replicas 1; TORCHFT_LIGHTHOUSE=http://HOST:29510 on every job)")
    else:
        notes.append(f"launch on {p.num_gpus} GPUs, e.g. NGPU={p.num_gpus} CONFIG_FILE=<this file> ./run_train.sh "
                     "(torchrun --nnodes N --nproc-per-node G ... -m torchtitan.train --job.config_file <this file>)")
    return ExportResult(target=TARGET, config=tables, overrides=overrides(tables), unsupported=uns,
                        notes=notes, title="\n".join(describe(inp)))


def _fault_tolerance(inp: ExportInput, uns: list[str], notes: list[str]) -> tuple[dict[str, Any], int]:
    """The [fault_tolerance] table of a local-sgd/diloco plan (torchft semi-synchronous training,
    torchtitan 0.2.x) and the number of replica groups (torchtitan jobs); ({}, 1) for a synchronous plan.

    Each inner group is a torchft replica group: a torchtitan job of its own whose parallelism
    covers one group (data-parallel degree dp / groups), with ``group_size`` = the number of groups
    (FTManager.get_dp_info: the batch is split over dp x groups) and ``sync_steps`` = sync_every."""
    p = inp.plan
    if not p.periodic:
        return {}, 1
    split = sync_groups(inp)
    if split is None:
        unit = "node" if p.sync_scope == "node" else "datacenter"
        uns.append(f"sync_scope={p.sync_scope}: the replica groups (one per {unit}) depend on the cluster, which the "
                   "export was not given; exported as one replica group of all data-parallel ranks "
                   "(fault_tolerance.group_size = 1): launch one job per group of the data-parallel ranks of a "
                   f"{unit} instead, with fault_tolerance.group_size = the number of groups and the "
                   "data-parallel degrees of one group")
        groups = 1
    else:
        groups = split[1]
    ft: dict[str, Any] = {"enable": True, "process_group": "nccl", "group_size": groups,
                          "semi_sync_method": SEMI_SYNC[p.grad_sync], "sync_steps": p.sync_every}
    if p.ep > 1 and groups > 1 and ((p.dp // groups) * p.cp) % p.ep:
        uns.append(f"ep={p.ep} with {sync_words(p)}: a replica group holds {p.dp // groups}*{p.cp} ranks "
                   "(dp x cp) for its experts, which ep does not divide; experts cannot span replica groups")
    overlap = sync_overlap(p)
    if overlap and p.grad_sync == "diloco":
        ft["fragment_sync_delay"] = overlap  # streaming DiLoCo's tau: steps before blocking on the sync
    elif overlap:
        uns.append(f"sync_overlap={overlap} with grad_sync=local-sgd: torchtitan's LocalSGD blocks on every "
                   "sync (fault_tolerance.fragment_sync_delay is DiLoCo's); exported without overlap")
    if p.grad_compression == "fp8" and p.grad_sync == "diloco":
        ft["should_quantize"] = True  # torchft allreduce_quantized: the outer sync in fp8
        notes.append("fault_tolerance.should_quantize sends DiLoCo's outer sync in fp8 (torchft's "
                     "allreduce_quantized, Triton kernels)")
    elif p.grad_compression != "none":
        how = ("torchtitan's LocalSGD takes no quantization (fault_tolerance.should_quantize, fp8, is "
               "DiLoCo's)" if p.grad_compression == "fp8" else
               "torchft sends the outer sync in the parameters' dtype, or in fp8 with fault_tolerance."
               "should_quantize (DiLoCo only)")
        uns.append(f"{compression_words(p)} of the outer sync of grad_sync={p.grad_sync}: {how}; not exported")
    notes.append(f"{sync_words(p)} runs on torchft (pip install torchft-nightly): semi_sync_method = "
                 f"{SEMI_SYNC[p.grad_sync]!r} via {FT_CONFIG_MODULE} and {FT_TRAINER}"
                 + ("; DiLoCo's outer optimizer is SGD(lr=0.7, momentum=0.9, nesterov=True), fixed in "
                    "torchtitan/components/ft/manager.py" if p.grad_sync == "diloco" else ""))
    return ft, groups


def _cli_value(v: Any) -> list[str]:
    if isinstance(v, list):
        if v and isinstance(v[0], list):  # list[list[str]]: one comma-separated argument per inner list
            return [",".join(x) for x in v]
        return [",".join(str(x) for x in v)]  # list[str]: torchtitan's comma-separated rule
    return [str(v)]


def overrides(tables: dict[str, dict[str, Any]]) -> list[str]:
    """The TOML settings as torchtitan command-line overrides (``--section.key value``)."""
    out: list[str] = []

    def walk(prefix: str, table: dict[str, Any]) -> None:
        for k, v in table.items():
            name = f"{prefix}.{k}"
            if isinstance(v, dict):
                walk(name, v)
            elif isinstance(v, bool):
                out.append(f"--{name}" if v else f"--{prefix}.no-{k}")
            else:
                out.append(f"--{name}")
                out.extend(_cli_value(v))

    for section, table in tables.items():
        walk(section, table)
    return out
