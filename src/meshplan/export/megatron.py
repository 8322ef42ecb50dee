"""A plan as Megatron-LM arguments (pretrain_gpt.py / megatron.training.arguments).

Megatron's data-parallel size is implicit (world size / (tp*pp*cp)); its distributed optimizer is
ZeRO-1, Megatron-FSDP (``--use-megatron-fsdp``) gives ZeRO-2/3, and a "partial" distributed
optimizer (``--num-distributed-optimizer-instances``) is hybrid sharding. Model shape goes in as
arguments; the tokenizer and data are left to the caller."""
from __future__ import annotations

from meshplan.export.common import (
    ExportInput,
    ExportResult,
    compression_words,
    describe,
    optimizer_unsupported,
    placement_is,
    placement_words,
    recompute_layers_per_chunk,
    require,
    stage_ids_for_rank,
    stage_layer_counts,
    sync_unsupported,
)
from meshplan.spec.axes import AX
from meshplan.spec.export_limits import MEGATRON_ORDER, MEGATRON_TP_PP_DP_ORDER

TARGET = "megatron"

POSITIONS = {"rotary": "rope", "learned": "learned_absolute", "none": "none"}
NORMS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}


MEGATRON_OPTIMIZERS = {"adamw": "adam", "adam": "adam", "sgd": "sgd"}
"""--optimizer values of Megatron-LM (adam: apex/TE FusedAdam with decoupled weight decay, its
default, not written for adamw; sgd with momentum)."""

def layout(counts: list[int]) -> str:
    """--pipeline-model-parallel-layout: blocks per global stage in model order (Megatron's order:
    virtual stage major), E = the embedding on the first stage, L = the loss on the last."""
    parts = []
    for i, n in enumerate(counts):
        s = ("E" if i == 0 else "") + (f"t*{n}" if n > 1 else "t" * n) + ("L" if i == len(counts) - 1 else "")
        parts.append(s)
    return "|".join(parts)


def build(inp: ExportInput) -> ExportResult:
    require(inp, TARGET, model=True, seq_len=True)
    p, m = inp.plan, inp.model
    assert m is not None and inp.global_batch is not None and inp.seq_len is not None
    args: list[str] = []
    uns: list[str] = []
    notes: list[str] = []
    env: dict[str, str] = {}

    def add(flag: str, *values: object) -> None:
        args.append(flag)
        args.extend(str(v) for v in values)

    # ---- parallelism -------------------------------------------------------------------------
    add("--tensor-model-parallel-size", p.tp)
    add("--pipeline-model-parallel-size", p.pp)
    add("--context-parallel-size", p.cp)
    if p.cp > 1:
        add("--cp-comm-type", "p2p")  # ring attention
    if p.ep > 1:
        add("--expert-model-parallel-size", p.ep)
    if p.tp > 1 and p.sequence_parallel:
        add("--sequence-parallel")
    if p.pp > 1 and p.tp > 1 and p.p2p_sharded and not p.sequence_parallel:
        uns.append("p2p_sharded=1 without sequence_parallel: Megatron-core pipelines send the whole "
                   "activation from every TP rank unless --sequence-parallel is on")
    if not placement_is(p, MEGATRON_ORDER):
        if placement_is(p, MEGATRON_TP_PP_DP_ORDER):
            add("--use-tp-pp-dp-mapping")
            if p.cp > 1:
                notes.append("--use-tp-pp-dp-mapping with cp>1 needs a Megatron-LM whose order is tp-cp-ep-pp-dp "
                             "(2025); older releases map tp-pp-dp and have no context-parallel axis in it")
        else:
            uns.append(f"{placement_words(p)}: Megatron-LM lays out the ranks tp innermost, then cp, then dp and pp "
                       "(tp-cp-ep-dp-pp = mesh_order=pp:dp:cp:tp) or pp and dp (--use-tp-pp-dp-mapping: "
                       "tp-cp-ep-pp-dp = mesh_order=dp:pp:cp:tp); exported with its default order, so its groups "
                       "hold other ranks than the plan places together")
    counts = stage_layer_counts(m.num_layers, p)
    if p.pp > 1:
        if p.schedule == "zbv":
            uns.append("schedule=zbv (V-shaped zero bubble): Megatron-LM has no such schedule; exported as "
                       "interleaved 1F1B with 2 virtual stages per rank")
        elif p.schedule == "zero-bubble":
            uns.append("schedule=zero-bubble: Megatron-LM has no zero-bubble schedule; exported as "
                       + ("interleaved 1F1B" if p.virtual_stages > 1 else "1F1B"))
        elif p.schedule == "gpipe":
            uns.append("schedule=gpipe: Megatron-LM runs 1F1B (same bubble, fewer micro-batches in flight); "
                       "exported as 1F1B")
        if p.schedule == "zbv":  # Megatron's interleaving is looped: rank r holds stages r and r+pp
            per_rank = [sum(counts[i] for i in stage_ids_for_rank(r, p)) for r in range(p.pp)]
            counts = [n // 2 + (n % 2 if v == 0 else 0) for v in range(2) for n in per_rank]
        if len(set(counts)) > 1:
            add("--pipeline-model-parallel-layout", layout(counts))
        elif len(counts) > p.pp:
            add("--num-layers-per-virtual-pipeline-stage", counts[0])

    # ---- batch ---------------------------------------------------------------------------------
    add("--micro-batch-size", p.micro_batch)
    add("--global-batch-size", inp.global_batch)
    add("--seq-length", inp.seq_len)

    # ---- model ---------------------------------------------------------------------------------
    add("--num-layers", m.num_layers)
    add("--hidden-size", m.hidden_size)
    add("--ffn-hidden-size", m.ffn_hidden_size)
    add("--num-attention-heads", m.num_attention_heads)
    if m.kv_heads != m.num_attention_heads:
        add("--group-query-attention")
        add("--num-query-groups", m.kv_heads)
    if m.head_dim is not None:
        add("--kv-channels", m.head_dim)
    add("--max-position-embeddings", max(m.max_position_embeddings or m.seq_len, inp.seq_len))
    if m.position in POSITIONS:
        add("--position-embedding-type", POSITIONS[m.position])
    else:
        uns.append(f"position={m.position}: Megatron-LM has no ALiBi; exported with its default "
                   "(learned absolute positions)")
    add("--normalization", NORMS[m.norm])
    if m.mlp_type == "swiglu":
        add("--swiglu")
    elif m.mlp_type == "squared_relu":
        add("--squared-relu")
    elif m.mlp_type == "relu_4h":
        uns.append("mlp_type=relu_4h: Megatron-LM has no plain-ReLU argument; exported with its default GeLU")
    if not m.bias:
        add("--disable-bias-linear")
    if not m.tied_embeddings:
        add("--untie-embeddings-and-output-weights")
    if not m.dropout:
        add("--attention-dropout", 0.0)
        add("--hidden-dropout", 0.0)
    add("--vocab-size", m.vocab_size)
    if m.vocab_size % (128 * p.tp):
        notes.append(f"Megatron pads the vocabulary ({m.vocab_size}) to a multiple of 128*tp = {128 * p.tp} "
                     "(--make-vocab-size-divisible-by 128); the padded rows add a little memory and compute")
    if m.is_moe:
        add("--num-experts", m.num_experts)
        add("--moe-router-topk", m.experts_per_token)
        add("--moe-ffn-hidden-size", m.expert_ffn)
    if m.embedding_norm:
        uns.append("embedding_norm (a norm after the token embedding, BLOOM): no Megatron-LM argument")
    if not m.causal:
        uns.append("causal=0 (encoder): pretrain_gpt.py trains causal decoders; use pretrain_bert.py")

    # ---- precision -----------------------------------------------------------------------------
    if p.precision in ("bf16", "fp8"):
        add("--bf16")
    elif p.precision == "fp16":
        add("--fp16")
        if p.ep > 1:
            uns.append("precision=fp16 with ep>1: Megatron-LM refuses fp16 with expert parallelism")
    if p.precision == "fp8":
        add("--fp8-format", "hybrid")
        notes.append("fp8 (--fp8-format hybrid) needs Transformer Engine and an fp8 GPU")

    # ---- data parallel / ZeRO ------------------------------------------------------------------
    dist_opt = p.zero >= 1 or p.offload_optimizer
    if p.zero >= 2:
        add("--use-megatron-fsdp")
        add("--data-parallel-sharding-strategy", "optim_grads_params" if p.zero == 3 else "optim_grads")
        add("--no-gradient-accumulation-fusion")
    if dist_opt:
        add("--use-distributed-optimizer")
        if p.zero == 0:
            notes.append("offload_optimizer needs Megatron's distributed optimizer; with dp=1 it shards nothing")
    if p.zero >= 2:
        add("--ckpt-format", "fsdp_dtensor")
    if p.zero >= 1 and 0 < p.shard_group < p.dp * p.cp:
        add("--num-distributed-optimizer-instances", (p.dp * p.cp) // p.shard_group)
    if p.offload_optimizer:
        add("--optimizer-cpu-offload")
        add("--use-precision-aware-optimizer")
        notes.append("--optimizer-cpu-offload runs the optimizer step on the CPU (Transformer Engine's "
                     "precision-aware optimizer path)")
    if p.offload_params:
        uns.append("offload_params: Megatron-LM keeps parameters on the GPU (no parameter offload argument)")
    if p.grad_sync == "all-reduce" and p.zero >= 1:
        uns.append("grad_sync=all-reduce: Megatron's distributed optimizer and FSDP always reduce-scatter gradients")
    uns += sync_unsupported("Megatron-LM", p)
    if not p.periodic and p.grad_compression == "bf16":
        if p.precision in ("bf16", "fp8"):
            add("--grad-reduce-in-bf16")  # validate_args: accumulate_allreduce_grads_in_fp32 = False
        else:
            uns.append(f"grad_compression=bf16 with precision={p.precision}: --grad-reduce-in-bf16 acts only with "
                       f"--bf16; Megatron reduces {p.precision} gradients in {p.precision}"
                       + (" (also 16 bits)" if p.precision == "fp16" else "") + "; not exported")
    elif not p.periodic and p.grad_compression == "fp8":
        uns.append("grad_compression=fp8: Megatron-LM reduces gradients in fp32, bf16 (--grad-reduce-in-bf16) or "
                   "the parameters' dtype, never fp8; not exported")
    elif not p.periodic and p.grad_compression == "powersgd":
        uns.append(f"{compression_words(p)}: Megatron-LM has no PowerSGD (its gradient buffers are all-reduced or "
                   "reduce-scattered whole); not exported")
    if (p.tp > 1 or p.cp > 1) and p.zero < 2:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron-LM asserts it with TP/CP before Blackwell

    # ---- recompute -----------------------------------------------------------------------------
    if p.recompute == "full":
        k = recompute_layers_per_chunk(p, [c for c in counts if c > 0] or [0])
        if k is None:
            add("--recompute-granularity", "full")
            add("--recompute-method", "uniform")
            add("--recompute-num-layers", 1)
        elif k > 0:
            add("--recompute-granularity", "full")
            add("--recompute-method", "block")
            add("--recompute-num-layers", k)
    elif p.recompute == "selective":
        add("--recompute-granularity", "selective")
    elif p.recompute == "op":
        add("--recompute-granularity", "selective")
        uns.append("recompute=op (op-level selective AC, torchtitan's): Megatron-LM has no such mode; exported "
                   "as --recompute-granularity selective (attention core only), which keeps more activations")

    # ---- kernels -------------------------------------------------------------------------------
    add("--attention-backend", "flash" if p.flash_attention else "unfused")
    if p.cp > 1 and not p.flash_attention:
        uns.append(f"cp={p.cp} with flash_attention=0: Megatron-core's context parallelism runs inside Transformer "
                   "Engine's flash or fused attention (its ring exchange is part of those kernels); the unfused "
                   "backend has no context parallelism, so the exported run fails at its first attention")
    if p.fused_loss:
        add("--cross-entropy-loss-fusion")
    if p.async_tp and p.tp > 1:
        if p.sequence_parallel:
            add("--tp-comm-overlap")
            notes.append("--tp-comm-overlap needs Transformer Engine (userbuffers)")
        else:
            uns.append("async_tp without sequence_parallel: Megatron's --tp-comm-overlap needs "
                       "--sequence-parallel; not exported")
    if p.compile:
        notes.append("compile: Megatron fuses elementwise ops with its own kernels (on by default), "
                     "not torch.compile")

    uns += optimizer_unsupported("Megatron-LM", inp, MEGATRON_OPTIMIZERS)
    if inp.optimizer in ("adam", "sgd"):
        add("--optimizer", MEGATRON_OPTIMIZERS[inp.optimizer])
        if inp.optimizer == "adam":
            notes.append("--optimizer adam: Megatron's Adam decays weights decoupled (AdamW); give --weight-decay 0 "
                         "for plain Adam without decay")
        else:
            notes.append("--optimizer sgd: Megatron's SGD with --sgd-momentum (default 0.9)")
    notes.append(f"run on exactly {p.num_gpus} GPUs (Megatron infers data-parallel size "
                 f"{p.dp} = world size / (tp*pp*cp)), e.g. torchrun --nnodes N --nproc-per-node G "
                 "pretrain_gpt.py \"${MEGATRON_ARGS[@]}\" plus tokenizer, data, optimizer and schedule arguments")
    return ExportResult(target=TARGET, config=args, overrides=list(args), unsupported=uns, notes=notes,
                        env=env, title="\n".join(describe(inp)))
