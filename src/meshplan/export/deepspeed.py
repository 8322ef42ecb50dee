"""A plan as a DeepSpeed config (the JSON given to deepspeed.initialize(config=...)).

DeepSpeed's config carries the batch (train_batch_size = micro batch x accumulation x data-parallel
size), ZeRO (stage, offload, hpZ), precision, AutoTP (tensor_parallel.autotp_size), AutoEP
(expert_parallel), Ulysses sequence parallelism (sequence_parallel_size) and the pipeline engine's
knobs. The pipeline stage count, the layer split and activation checkpointing calls live in the
training code (PipelineModule, deepspeed.checkpointing); the notes say so."""
from __future__ import annotations

from typing import Any

from meshplan.export.common import (
    ExportInput,
    ExportResult,
    compression_words,
    describe,
    optimizer_unsupported,
    placement_unsupported,
    require,
    stage_layer_counts,
    sync_unsupported,
)

TARGET = "deepspeed"


DEEPSPEED_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "lion": "Lion", "sgd": "SGD", "adafactor": "Adafactor"}
"""optimizer.type values DeepSpeed builds: its own Adam, AdamW and Lion (FusedAdam, FusedLion), and
any other name as torch.optim.<type> (engine._configure_basic_optimizer's fallback: SGD,
Adafactor). Not bitsandbytes' 8-bit Adam (a client optimizer in the training code). AdamW, the
training code's usual client optimizer, is not written."""

def build(inp: ExportInput) -> ExportResult:
    require(inp, TARGET, model=False, seq_len=False)
    p, m = inp.plan, inp.model
    assert inp.global_batch is not None
    uns: list[str] = []
    notes: list[str] = []
    cfg: dict[str, Any] = {
        "train_batch_size": inp.global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch,
        "gradient_accumulation_steps": inp.microbatches,
    }

    uns += placement_unsupported("DeepSpeed", p, "pipe, data, model, outermost first: "
                                 "deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology = mesh_order=pp:dp:cp:tp")

    # ---- precision -----------------------------------------------------------------------------
    if p.precision in ("bf16", "fp8"):
        cfg["bf16"] = {"enabled": True}
        if p.precision == "fp8":
            uns.append("precision=fp8: the DeepSpeed config has no fp8 setting; fp8 linears come from the model "
                       "code (Transformer Engine); exported as bf16")
    elif p.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0}

    # ---- ZeRO ----------------------------------------------------------------------------------
    zero: dict[str, Any] = {"stage": p.zero}
    if p.zero in (1, 2) and p.grad_sync == "all-reduce":
        zero["reduce_scatter"] = False
    if p.offload_optimizer:
        if p.zero == 0:
            uns.append("offload_optimizer with zero=0: DeepSpeed offloads optimizer states only under ZeRO "
                       "(stage >= 1; with dp=1 stage 1 shards nothing); not exported")
        else:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if p.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if p.zero >= 1 and 0 < p.shard_group < p.dp * p.cp:
        if p.zero == 3:
            zero["zero_hpz_partition_size"] = p.shard_group
            uns.append(f"shard_group={p.shard_group} (hybrid sharding): DeepSpeed has no HSDP (MiCS was removed); "
                       "exported as ZeRO++ hpZ (zero_hpz_partition_size), which keeps a secondary parameter "
                       "shard per group (parameter all-gathers stay in the group) while optimizer states and "
                       "gradients stay sharded over all data-parallel ranks")
        else:
            uns.append(f"shard_group={p.shard_group} with zero={p.zero}: DeepSpeed shards ZeRO-1/2 states over "
                       "all data-parallel ranks; not exported")
    cfg["zero_optimization"] = zero

    # ---- gradient sync: periodic, compression ------------------------------------------------
    uns += sync_unsupported("DeepSpeed", p)
    if not p.periodic and p.grad_compression == "bf16":
        cfg["communication_data_type"] = "bf16"  # gradients cast to bf16 for their all-reduce / reduce-scatter
    elif not p.periodic and p.grad_compression == "fp8":
        uns.append("grad_compression=fp8: DeepSpeed's communication_data_type takes fp16, bf16 or fp32 (ZeRO++ "
                   "zero_quantized_gradients is int4, ZeRO-3 only); not exported")
    elif not p.periodic and p.grad_compression == "powersgd":
        uns.append(f"{compression_words(p)}: DeepSpeed has no PowerSGD (torch's powerSGD_hook is a DDP "
                   "communication hook; DeepSpeed's engine reduces gradients itself); not exported")

    # ---- tensor / sequence / expert parallel ---------------------------------------------------
    if p.tp > 1:
        tp: dict[str, Any] = {"autotp_size": p.tp}
        if p.async_tp:
            tp["tp_overlap_comm"] = True
        cfg["tensor_parallel"] = tp
        notes.append("tensor_parallel.autotp_size is DeepSpeed's AutoTP (Hugging Face models); with "
                     "Megatron-DeepSpeed the TP degree comes from its own --tensor-model-parallel-size instead")
        if p.sequence_parallel:
            uns.append("sequence_parallel: DeepSpeed AutoTP has no Megatron-style sequence parallelism (norm "
                       "activations stay replicated over the TP group)")
    if p.cp > 1:
        cfg["sequence_parallel_size"] = p.cp
        uns.append(f"cp={p.cp} (ring attention): DeepSpeed's sequence parallelism is Ulysses (all-to-all over "
                   "attention heads, needs heads divisible by cp); exported as sequence_parallel_size, which also "
                   "needs the model's attention wrapped (UlyssesSPAttentionHF / DistributedAttention)")
        if m is not None and m.kv_heads % p.cp and p.cp % m.kv_heads:
            notes.append(f"Ulysses needs cp={p.cp} to divide the {m.kv_heads} key/value heads (or be a multiple)")
    if p.ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": p.ep}
        notes.append("expert_parallel is DeepSpeed AutoEP: it recognises supported Hugging Face MoE models "
                     "(else set preset_model or the *_pattern keys)")

    # ---- pipeline ------------------------------------------------------------------------------
    if p.pp > 1:
        pipe: dict[str, Any] = {}
        if p.tp > 1:
            pipe["pipe_partitioned"] = p.p2p_sharded
            pipe["grad_partitioned"] = p.p2p_sharded
        notes.append(f"pipeline: build the model as deepspeed.pipe.PipelineModule(layers, num_stages={p.pp}, "
                     "partition_method='uniform'); the stage count is not a config setting")
        if p.zero >= 2:
            uns.append(f"zero={p.zero} with pp>1: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only")
        if p.schedule != "1f1b" and not (p.schedule == "interleaved-1f1b" and p.virtual_stages == 1):
            uns.append(f"schedule={p.schedule}: DeepSpeed's pipeline engine runs 1F1B only (no interleaving, "
                       "zero-bubble or GPipe schedule)")
        if p.virtual_stages > 1:
            uns.append(f"virtual_stages={p.virtual_stages}: DeepSpeed's pipeline engine has one model chunk per "
                       "stage")
        if p.stage_layers is not None and m is not None and len(set(stage_layer_counts(m.num_layers, p))) > 1:
            uns.append(f"stage_layers={':'.join(map(str, p.stage_layers))}: PipelineModule partitions by "
                       "'uniform', 'parameters' or 'type:REGEX', not by explicit counts")
        if p.recompute == "full":
            if p.recompute_layers is None:
                pipe["activation_checkpoint_interval"] = 1
            elif p.recompute_layers > 0:
                pipe["activation_checkpoint_interval"] = 1
                uns.append(f"recompute_layers={p.recompute_layers}: the pipeline engine checkpoints every "
                           "activation_checkpoint_interval layers, not the first k per stage; exported as every layer")
        if pipe:
            cfg["pipeline"] = pipe
    elif p.recompute == "full":
        notes.append("full recompute: wrap each block with deepspeed.checkpointing.checkpoint (or "
                     "model.gradient_checkpointing_enable() for Hugging Face models)"
                     + (f", the first {p.recompute_layers} blocks only" if p.recompute_layers is not None else ""))
    if p.recompute == "full" and (p.recompute_layers is None or p.recompute_layers > 0):
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
    if p.recompute in ("selective", "op"):
        uns.append(f"recompute={p.recompute}: DeepSpeed checkpoints whole blocks only (activation_checkpointing); "
                   "selective recomputation is model code")

    # ---- kernels -------------------------------------------------------------------------------
    if p.compile:
        uns.append("compile: torch.compile is a code call in DeepSpeed (engine.compile()), not a config setting")
    if p.flash_attention:
        notes.append("flash attention is chosen in the model code (e.g. attn_implementation="
                     "'flash_attention_2' for Hugging Face models)")
    else:
        uns.append("flash_attention=0: the attention kernel is chosen in the model code, not the DeepSpeed config")
    if p.fused_loss:
        uns.append("fused_loss: the loss is model code (e.g. Liger's fused cross-entropy), not a DeepSpeed setting")
    if p.async_tp and p.tp == 1:
        notes.append("async_tp has no effect with tp=1")

    uns += optimizer_unsupported("DeepSpeed", inp, DEEPSPEED_OPTIMIZERS)
    if inp.optimizer in DEEPSPEED_OPTIMIZERS and inp.optimizer != "adamw":
        cfg["optimizer"] = {"type": DEEPSPEED_OPTIMIZERS[inp.optimizer]}
        name = DEEPSPEED_OPTIMIZERS[inp.optimizer]
        notes.append(f"optimizer.type {name}"
                     + (f" (DeepSpeed builds torch.optim.{name} by name)" if inp.optimizer in ("sgd", "adafactor")
                        else "") + ": give its params (lr, ...) in optimizer.params")
    notes.append(f"run on exactly {p.num_gpus} GPUs: DeepSpeed checks train_batch_size = "
                 f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size ({p.dp})")
    cfg["_meshplan"] = {"plan": p.short(), "model": m.name if m is not None else None,
                        "global_batch": inp.global_batch, "seq_len": inp.seq_len, "num_gpus": p.num_gpus}
    cfg["_meshplan_unsupported"] = list(uns)
    cfg["_meshplan_notes"] = list(notes)
    return ExportResult(target=TARGET, config=cfg, unsupported=uns, notes=notes, title="\n".join(describe(inp)))
