"""Megatron-LM's command line, for the arguments `meshplan export --to megatron` writes.

The pip package megatron-core ships megatron/core only: Megatron-LM's argparse parser
(megatron/training/arguments.py) is not in it, nor in any other package on PyPI. So the test
checks each export in three layers:

1. ``parser()``: the ``add_argument`` calls of Megatron-LM's megatron/training/arguments.py
   (NVIDIA/Megatron-LM, commit 000c4ac24f61159c138b0975def722c65245983c, 2025), copied with the
   same flag, type, default, choices, action and dest, for every flag meshplan writes. An argument
   the table lacks (a typo) is an argparse error.
2. ``validate(ns, world_size)``: the checks and derived values of Megatron-LM's ``validate_args``
   that these arguments reach (data-parallel size, virtual pipeline size from the layout or layers
   per virtual stage, params dtype, defaults, the asserts), copied from the same file.
3. ``core_configs(ns)``: Megatron-LM's translation into megatron-core's configs
   (``core_transformer_config_from_args``; the DDP and optimizer configs built from the fields of
   the same name), then the REAL megatron-core dataclasses from the installed package validate:
   ``TransformerConfig`` (incl. ModelParallelConfig: an unknown field is a TypeError, and
   ``__post_init__`` checks pipeline/recompute/MoE/layout consistency, parsing the layout with
   ``PipelineParallelLayerLayout``), ``DistributedDataParallelConfig``, ``OptimizerConfig`` and
   ``ConstantNumMicroBatchesCalculator``.

Every ``dest`` of the table must be a field of one of those megatron-core configs or one of the
``LM_ONLY`` arguments that steps 2-3 consume, so a flag cannot parse without reaching megatron-core.
"""
from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace
from typing import Any
from unittest import mock

LM_ONLY = {
    "micro_batch_size", "global_batch_size", "seq_length", "max_position_embeddings", "position_embedding_type",
    "make_vocab_size_divisible_by", "swiglu", "squared_relu", "untie_embeddings_and_output_weights",
    "group_query_attention", "num_experts", "vocab_size", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank", "ckpt_format", "cp_comm_type", "grad_reduce_in_bf16",
    "use_tp_pp_dp_mapping",
}
"""Megatron-LM arguments that are not megatron-core config fields; validate/core_configs use each."""


def parser(attn_backend: Any) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False, exit_on_error=False)
    a = p.add_argument
    # _add_network_size_args
    a('--num-layers', type=int, default=None)
    a('--hidden-size', type=int, default=None)
    a('--ffn-hidden-size', type=int, default=None)
    a('--num-attention-heads', type=int, default=None)
    a('--attention-backend', type=lambda b: attn_backend[b], default=attn_backend.auto, choices=list(attn_backend))
    a('--kv-channels', type=int, default=None)
    a('--group-query-attention', action='store_true')
    a('--num-query-groups', type=int, default=1)
    a('--max-position-embeddings', type=int, default=None)
    a('--position-embedding-type', type=str, default='learned_absolute',
      choices=['learned_absolute', 'rope', 'mrope', 'relative', 'none'])
    a('--make-vocab-size-divisible-by', type=int, default=128)
    a('--normalization', default='LayerNorm', choices=['LayerNorm', 'RMSNorm'])
    a('--squared-relu', action='store_true')
    a('--swiglu', action='store_true')
    a('--untie-embeddings-and-output-weights', action='store_true')
    # _add_regularization_args
    a('--attention-dropout', type=float, default=0.1)
    a('--hidden-dropout', type=float, default=0.1)
    # _add_training_args
    a('--micro-batch-size', type=int, default=None)
    a('--global-batch-size', type=int, default=None)
    a('--recompute-granularity', type=str, default=None, choices=['full', 'selective'])
    a('--recompute-method', type=str, default=None, choices=['uniform', 'block'])
    a('--recompute-num-layers', type=int, default=None)
    a('--recompute-modules', nargs='*', type=str, default=None)
    a('--tp-comm-overlap', action='store_true')
    a('--cross-entropy-loss-fusion', action='store_true', dest='cross_entropy_loss_fusion')
    a('--disable-bias-linear', action='store_false', dest='add_bias_linear')
    a('--optimizer-cpu-offload', action='store_true')
    a('--sequence-parallel', action='store_true')
    a('--no-gradient-accumulation-fusion', action='store_false', dest='gradient_accumulation_fusion')
    # _add_mixed_precision_args
    a('--fp16', action='store_true')
    a('--bf16', action='store_true')
    a('--grad-reduce-in-bf16', action='store_true')
    # _add_distributed_args
    a('--tensor-model-parallel-size', type=int, default=1)
    a('--pipeline-model-parallel-size', type=int, default=1)
    a('--pipeline-model-parallel-layout', type=str, default=None)
    a('--num-layers-per-virtual-pipeline-stage', type=int, default=None)
    a('--num-virtual-stages-per-pipeline-rank', type=int, default=None)
    a('--use-distributed-optimizer', action='store_true')
    a('--use-megatron-fsdp', action='store_true')
    a('--data-parallel-sharding-strategy', type=str, default='no_shard',
      choices=['no_shard', 'optim', 'optim_grads', 'optim_grads_params'])
    a('--num-distributed-optimizer-instances', type=int, default=1)
    a('--context-parallel-size', type=int, default=1)
    a('--cp-comm-type', nargs='+', type=str, default=["p2p"])
    a('--use-tp-pp-dp-mapping', action='store_true', default=False)
    # _add_checkpointing_args
    a('--ckpt-format', default='torch_dist', choices=['torch', 'torch_dist', 'zarr', 'torch_dcp', 'fsdp_dtensor'])
    # _add_tokenizer_args
    a('--vocab-size', type=int, default=None)
    # _add_data_args
    a('--seq-length', type=int, default=None)
    # _add_moe_args
    a('--expert-model-parallel-size', type=int, default=1)
    a('--expert-tensor-parallel-size', type=int, default=None)
    a('--num-experts', type=int, default=None)
    a('--moe-ffn-hidden-size', type=int, default=None)
    a('--moe-router-topk', type=int, default=2)
    # _add_transformer_engine_args
    a('--fp8-format', default=None, choices=['e4m3', 'hybrid'], dest='fp8')
    # _add_experimental_args
    a('--use-precision-aware-optimizer', action='store_true')
    return p


def parse(args: list[str], attn_backend: Any) -> argparse.Namespace:
    """Parse like Megatron-LM's parse_args (no unknown arguments, no abbreviations)."""
    ns, unknown = parser(attn_backend).parse_known_args(args)
    if unknown:
        raise argparse.ArgumentError(None, f"unrecognized arguments: {' '.join(unknown)}")
    return ns


def validate(ns: argparse.Namespace, world_size: int, layout_cls: Any, env: dict[str, str]) -> argparse.Namespace:
    """The parts of Megatron-LM's validate_args these arguments reach (same order and messages)."""
    import torch
    ns.world_size = world_size
    model_size = ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size * ns.context_parallel_size
    assert ns.world_size % model_size == 0, f"world size ({world_size}) is not divisible by {model_size=}"
    ns.data_parallel_size = ns.world_size // model_size
    if ns.expert_tensor_parallel_size is None:
        ns.expert_tensor_parallel_size = ns.tensor_model_parallel_size
    assert ns.micro_batch_size is not None and ns.micro_batch_size > 0
    assert ns.global_batch_size is not None and ns.global_batch_size > 0
    assert (int(ns.num_layers_per_virtual_pipeline_stage is not None)
            + int(ns.num_virtual_stages_per_pipeline_rank is not None)
            + int(ns.pipeline_model_parallel_layout is not None)) <= 1
    pp = ns.pipeline_model_parallel_size
    if ns.pipeline_model_parallel_layout is not None:
        num_stages = layout_cls.get_num_stages_from_str(ns.pipeline_model_parallel_layout)
        assert num_stages % pp == 0
        ns.virtual_pipeline_model_parallel_size = num_stages // pp
        if ns.virtual_pipeline_model_parallel_size == 1:
            ns.virtual_pipeline_model_parallel_size = None
    elif ns.num_layers_per_virtual_pipeline_stage is not None or ns.num_virtual_stages_per_pipeline_rank is not None:
        if ns.num_virtual_stages_per_pipeline_rank is None:
            assert ns.num_layers % pp == 0, \
                "number of layers of the model must be divisible pipeline model parallel size"
            per_stage = ns.num_layers // pp
            assert per_stage % ns.num_layers_per_virtual_pipeline_stage == 0
            ns.virtual_pipeline_model_parallel_size = per_stage // ns.num_layers_per_virtual_pipeline_stage
        else:
            ns.virtual_pipeline_model_parallel_size = ns.num_virtual_stages_per_pipeline_rank
        if ns.virtual_pipeline_model_parallel_size == 1:
            ns.virtual_pipeline_model_parallel_size = None
    else:
        ns.virtual_pipeline_model_parallel_size = None
        assert ns.num_layers % pp == 0, "Number of layers should be divisible by the pipeline-model-parallel size"
    if ns.virtual_pipeline_model_parallel_size is not None:
        assert pp > 1  # overlap_p2p_comm is on by default
    if ns.use_megatron_fsdp:
        assert ns.ckpt_format == "fsdp_dtensor", "Megatron FSDP only supports fsdp_dtensor checkpoint format"
    ns.params_dtype = torch.float
    if ns.fp16:
        assert not ns.bf16
        ns.params_dtype = torch.half
    # --accumulate-allreduce-grads-in-fp32 and --main-grads-dtype (meshplan writes neither): their defaults
    ns.accumulate_allreduce_grads_in_fp32, ns.main_grads_dtype = False, torch.float32
    if ns.bf16:
        assert not ns.fp16
        ns.params_dtype = torch.bfloat16
        # bfloat16 requires gradient accumulation and all-reduce to be done in fp32 (unless --grad-reduce-in-bf16)
        if ns.grad_reduce_in_bf16:
            ns.accumulate_allreduce_grads_in_fp32 = False
        elif not ns.accumulate_allreduce_grads_in_fp32 and ns.main_grads_dtype == torch.float32:
            ns.accumulate_allreduce_grads_in_fp32 = True
    for req in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        assert getattr(ns, req) is not None, f"{req} argument is None"
    if ns.ffn_hidden_size is None:
        ns.ffn_hidden_size = int((4 * ns.hidden_size * 2 / 3) / 64) * 64 if ns.swiglu else 4 * ns.hidden_size
    if ns.kv_channels is None:
        assert ns.hidden_size % ns.num_attention_heads == 0
        ns.kv_channels = ns.hidden_size // ns.num_attention_heads
    if ns.seq_length is not None and ns.context_parallel_size > 1:
        assert ns.seq_length % (ns.context_parallel_size * 2) == 0, \
            "seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1."
    assert ns.max_position_embeddings >= ns.seq_length
    if ns.recompute_granularity == "selective":
        assert ns.recompute_method is None, \
            "recompute method is not yet supported for selective recomputing granularity"
    if ns.tensor_model_parallel_size == 1:
        ns.sequence_parallel = False
    if ns.tp_comm_overlap:
        assert ns.sequence_parallel, "Tensor parallel communication/GEMM overlap can happen only when sequence " \
                                     "parallelism is enabled"
    if (ns.tensor_model_parallel_size > 1 or ns.context_parallel_size > 1) and not ns.use_megatron_fsdp:
        assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", "Using tensor model parallelism or context " \
            "parallelism require setting the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1"
    if ns.num_experts == 0:
        ns.num_experts = None
    if ns.num_experts is not None and ns.moe_ffn_hidden_size is None:
        ns.moe_ffn_hidden_size = ns.ffn_hidden_size
    if ns.expert_model_parallel_size > 1:
        assert ns.num_experts is not None, "num_experts must be non None to use expert model parallelism"
        assert ns.num_experts % ns.expert_model_parallel_size == 0
        assert not ns.fp16, "Expert parallelism is not supported with fp16 training."
    if ns.optimizer_cpu_offload:
        assert ns.use_precision_aware_optimizer
    return ns


def core_configs(ns: argparse.Namespace, mc: SimpleNamespace) -> SimpleNamespace:
    """Megatron-LM's core_transformer_config_from_args (and the DDP / optimizer configs, built from
    the fields of the same name), then the real megatron-core configs validate."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu

    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(mc.TransformerConfig) if hasattr(ns, f.name)}
    kw["deallocate_pipeline_outputs"] = True
    kw["pipeline_dtype"] = ns.params_dtype
    kw["num_moe_experts"] = ns.num_experts
    if ns.swiglu:
        kw["activation_func"] = F.silu
        kw["gated_linear_unit"] = True
    if ns.squared_relu:
        assert not ns.swiglu
        kw["activation_func"] = squared_relu
    kw["num_query_groups"] = ns.num_query_groups if ns.group_query_attention else None
    if len(ns.cp_comm_type) == 1:
        kw["cp_comm_type"] = ns.cp_comm_type[0]
    transformer = mc.TransformerConfig(**kw)
    ddp_kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(mc.DDPConfig) if hasattr(ns, f.name)}
    ddp_kw["grad_reduce_in_fp32"] = ns.accumulate_allreduce_grads_in_fp32  # megatron/training/training.py get_model
    ddp = mc.DDPConfig(**ddp_kw)
    opt_kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(mc.OptimizerConfig) if hasattr(ns, f.name)}
    # The precision-aware optimizer (--optimizer-cpu-offload) is Transformer Engine's: OptimizerConfig asks
    # TE's version, and TE (CUDA only) is not installed here. Answer as if TE >= that version were present.
    with mock.patch("megatron.core.optimizer.optimizer_config.is_te_min_version", lambda *a, **k: True):
        opt = mc.OptimizerConfig(**opt_kw)
    calc = mc.Calculator(ns.global_batch_size, ns.micro_batch_size, ns.data_parallel_size, False, 1)
    # megatron/training/initialize.py: initialize_model_parallel(order=...), whose real RankGenerator
    # (megatron.core.parallel_state) gives each dense axis's rank groups
    from megatron.core.parallel_state import RankGenerator
    order = "tp-cp-ep-dp-pp" if not ns.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp"
    gen = RankGenerator(tp=ns.tensor_model_parallel_size, ep=1, dp=ns.data_parallel_size,
                        pp=ns.pipeline_model_parallel_size, cp=ns.context_parallel_size, order=order)
    groups = {token: gen.get_ranks(token) for token in ("tp", "cp", "dp", "pp")}
    return SimpleNamespace(transformer=transformer, ddp=ddp, optimizer=opt, microbatches=calc.get(), rank_order=order,
                           rank_groups=groups)


def dests_reach_core(mc: SimpleNamespace) -> set[str]:
    """Table dests that reach neither a megatron-core config field nor an LM_ONLY consumer (must be empty)."""
    fields = set()
    for cls in (mc.TransformerConfig, mc.DDPConfig, mc.OptimizerConfig):
        fields |= {f.name for f in dataclasses.fields(cls)}
    dests = {a.dest for a in parser(mc.AttnBackend)._actions if a.dest != "help"}
    return dests - fields - LM_ONLY
