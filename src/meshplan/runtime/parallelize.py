"""Apply a Plan to a model from outside, in one fixed order (torchtitan's parallelize_llama).

The pieces every model shares (presets and ingested models alike: runtime/generic.py applies them
to an ingested module in the same order) are here: the pipeline split (``split_pipeline``: which
layers each stage holds, from ``spec.stages.stage_layer_ranges``; the model cuts itself), the
schedule (``build_schedule``), recomputation (``apply_ac``), data parallelism (``apply_fsdp``,
``apply_data_parallel``: DDP, FSDP2/HSDP or a manual all-reduce, the ZeRO levels below), precision
(``DTYPES``, ``autocast_dtype``) and ``Parallelized``, what the trainer runs. The steps for a
preset Transformer (``parallelize``):

0. vocab padding    tp not dividing the vocabulary: the embedding and output projection get zero
                    rows up to a multiple of tp (Megatron's make-vocab-size-divisible-by); the
                    padded logit columns are set to -inf in each rank's shard of the logits
                    (``models.drop_padded_columns``), so they are out of the loss exactly and
                    padded rows get no gradient (``Transformer.pad_vocab``; checkpoints and
                    ``full_weights`` hold the unpadded rows);
1. pipeline split   the full model is built (same seed on every rank), then each pipeline
                    stage keeps its blocks (plan.stage_layers, virtual stages; the embedding with
                    the first stage, final norm and output with the last) and drops the rest;
                    tied embeddings (Megatron's way): the first stage keeps the input embedding,
                    the last the output projection, a copy initialised identically; after each
                    step's backward the trainer sums the two copies' gradients (``sync_tied``:
                    an all-reduce between pipeline ranks 0 and pp-1 of each (dp, cp, tp)
                    coordinate, or a local sum under zbv, whose V puts both ends on rank 0), so
                    both get the same update; the gradient norm counts the tied one once;
2. EP               ep > 1: each MoE layer keeps this rank's experts and dispatches tokens to the
                    others with all-to-all (``expert_parallel``);
3. TP / SP          DTensor parallelize_module: Megatron column/row split of attention and MLP
                    (and of every local expert), sequence-sharded norms with sequence_parallel;
                    vocabulary-parallel embedding (``VocabParallelEmbedding``: its gradient is
                    sharded like the table, [vocab/tp, hidden]) and output projection, whose
                    logits stay sharded on the vocabulary: the loss runs under
                    ``loss_parallel()`` (torchtitan's; ``Parallelized.loss_context``, the whole
                    pipeline schedule step under PP), never gathering the logits;
4. CP               cp > 1: global positions and all-gather attention (``context_parallel``);
                    bucket plans: switchable per micro-batch (``Parallelized.sequence``), a
                    process group per unit of every bucket cp;
5. recompute        checkpoint_wrapper per block (full, first recompute_layers of each stage),
                    around the core attention (selective), or op-level SAC (op); it wraps the
                    TP-annotated modules so recomputation replays their collectives;
6. compile          torch.compile per block (fullgraph), after TP and recomputation;
7. data parallel    over dp x cp. zero=0: DDP (a manual, flattened gradient all-reduce when
                    params are DTensors, which DDP cannot hold, under PP, or with EP); zero 1-3:
                    FSDP2 fully_shard per block then per stage, on a 2-D (replicate, shard) mesh
                    for HSDP, experts first on their own (replicas-only) mesh; last, because it
                    shards whatever the earlier steps produced; CPUOffloadPolicy for offload on GPUs;
8. precision        FSDP2 MixedPrecisionPolicy (bf16/fp16 params, fp32 reduce), else autocast;
                    fp8: torchao float8 linears where the GPU and torchao allow, else bf16 (noted).

ZeRO levels (what the cost model charges; pp = 1, m micro-batches per step, ``micro_batch``):

=====  ===========================================================================================
zero   what runs
=====  ===========================================================================================
0      DDP: gradients all-reduced once per step (``no_sync`` on the first m-1 micro-batches; the
       manual all-reduce runs once, after the last)
1      Megatron's distributed optimizer: parameters all-gathered once per step and kept gathered
       over the micro-batches (``reshard_after_forward=False``; ``set_reshard_after_backward(False)``
       on the first m-1), gradients accumulated unsharded (fp32: FSDP2 keeps the accumulation in
       its ``reduce_dtype``) with ``set_requires_gradient_sync(False)`` and reduce-scattered once, in
       the last micro-batch's backward (both flags True again); AdamW states sharded
2      DeepSpeed ZeRO-2: parameters gathered once per step and kept (as zero=1), gradients
       reduce-scattered in every micro-batch's backward (sync stays on): they stay sharded
3      FSDP: blocks reshard after forward (not the last block nor the root, whose backward comes
       first) and all-gather again in backward, reduce-scatter every micro-batch
=====  ===========================================================================================

The flags are set on every FSDP module of the parts (``set_*`` recurse from the root: blocks,
experts on their own mesh, the root); with HSDP ``set_requires_gradient_sync`` switches the
reduce-scatter and the all-reduce over replicas together. zero=0 with offload on a GPU (FSDP2's
CPUOffloadPolicy) runs as zero=1: one gradient reduction per step, as DDP. Under pipeline
parallelism the schedule does this itself (torch 2.13 ``PipelineStage.backward_maybe_with_nosync``
turns sync and reshard-after-backward off for every backward of an FSDP stage, and the
REDUCE_GRAD action after a stage's last backward turns them on and runs FSDP's post-backward
once): zero 1, 2 and 3 all run as "gathered once, unsharded accumulation, reduce-scatter once"
(blocks do not reshard after forward under PP; the planner refuses zero=2 with pp > 1).

Tied copies under every data-parallel mode: the embedding (first stage) and its copy (last stage)
have the same shape and are parallelised alike (TP: both vocab-sharded, ``Shard(0)``; FSDP/HSDP:
both in their stage's root group on the same (replicate, shard) mesh, sharded on dim 0), so the
gradient shards of the two ranks of a pair cover the same rows (checked once, on the first sync)
and summing them is summing the full gradients. The sum comes after the data-parallel reduction
(FSDP's reduce-scatter, the manual all-reduce): both are linear, so the result is the
single-process gradient averaged over dp x cp.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.errors import MeshplanError
from meshplan.runtime.context_parallel import apply_bucket_cp, apply_cp, bucket_sequence
from meshplan.runtime.expert_parallel import shard_experts
from meshplan.runtime.mesh import RuntimeMesh
from meshplan.runtime.models import Transformer, loss_fn
from meshplan.runtime.periodic import compression_of, fp8_reduce_scatter
from meshplan.spec.axes import AX
from meshplan.spec.plan import Plan
from meshplan.spec.stages import stage_ids_for_rank, stage_layer_ranges

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "fp32": torch.float32}
"""Compute dtype per plan precision (fp8: the dtype around torchao's float8 linears, or the fallback)."""


def autocast_dtype(plan: Plan, dp_mode: str) -> torch.dtype | None:
    """The dtype forward runs under autocast: none for fp32, nor under FSDP (its
    MixedPrecisionPolicy casts the parameters instead)."""
    return None if plan.precision == "fp32" or dp_mode == "fsdp" else DTYPES[plan.precision]


@dataclass
class Parallelized:
    """This rank's share of the model and how to run it."""

    parts: list[nn.Module]
    """Model chunks held by this rank (one, or virtual_stages under interleaving); raw modules."""
    run_modules: list[nn.Module]
    """What forward runs: the parts, or their DDP wrappers."""
    stage_ids: list[int] = field(default_factory=lambda: [0])
    schedule: Any = None
    """A torch.distributed.pipelining schedule when pp > 1."""
    dp_mode: str = "none"
    """none | ddp | manual (all-reduce by hand) | fsdp."""
    autocast: torch.dtype | None = None
    notes: list[str] = field(default_factory=list)
    """Plan fields this hardware cannot honour, and what runs instead (one line each)."""
    zero: int = 0
    """The plan's ZeRO level: what ``micro_batch`` does between micro-batches under FSDP."""
    tied: list[nn.Parameter] = field(default_factory=list)
    """Tied embeddings under a pipeline: this rank's ends of the tie (the first stage's input
    embedding and/or the last stage's output copy), after TP/FSDP replaced the parameters."""
    tied_copies: list[nn.Parameter] = field(default_factory=list)
    """The last stage's copies among ``tied``: left out of the gradient norm (counted once)."""
    tied_group: Any = None
    """The process group of pipeline ranks 0 and pp-1 of this rank's (dp, cp, tp) coordinate (None
    under zbv, where both ends are on this rank, and on ranks holding neither end)."""
    vocab_parallel: bool = False
    """The logits are vocabulary-sharded DTensors (tp > 1): forward and backward of a step run
    under ``loss_context``."""
    has_first: bool = True
    """This rank holds the first pipeline stage (it feeds the schedule the inputs)."""
    has_last: bool = True
    """This rank holds the last pipeline stage (it computes the loss)."""
    gather_during_step: bool = False
    """FSDP with zero 2/3 on replicas that run different numbers of micro-batches (uneven
    dp_shares): the parameters stay gathered and the gradients unsharded from the first
    micro-batch's forward to the last one's backward (zero=1's flags, no reshard after forward),
    so that every replica issues the same collectives (one all-gather, one reduce-scatter) per
    step; zero=3's memory holds between steps only."""
    unit_groups: dict[int, Any] = field(default_factory=dict)
    """Bucket plans: this rank's unit group per bucket cp degree above 1 (``RuntimeMesh.unit_groups``)."""
    _tied_checked: bool = False

    def sequence(self, cp: int, rank: int, width: int,
                 device: torch.device | None = None) -> contextlib.AbstractContextManager[Any]:
        """A bucket plan's micro-batch (its forward and backward inside): cp 1, the whole sequence;
        cp > 1, this rank's chunks (index ``rank`` in its unit) of a sequence of ``width`` tokens,
        attention over its unit's group (``context_parallel.bucket_sequence``)."""
        return bucket_sequence(self.parts[0], self.unit_groups.get(cp), cp, rank, width, device)

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        """Where a step's forward and backward run (the pipeline schedule's step as a whole):
        ``loss_parallel()`` when the logits are vocabulary-sharded (``models.loss_fn``), else
        nothing."""
        return _loss_parallel() if self.vocab_parallel else contextlib.nullcontext()

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-batch's forward and backward without a pipeline schedule
        (which does its own): DDP's ``no_sync`` on all but the last; under FSDP the ZeRO level's
        flags (``set_fsdp_accumulation``). Gradient sync is on again for the last micro-batch."""
        if self.dp_mode == "ddp" and not last:
            return self.run_modules[0].no_sync()  # type: ignore[operator]
        if self.dp_mode == "fsdp":
            if self.gather_during_step:
                for part in self.parts:
                    part.set_reshard_after_forward(False)  # type: ignore[operator]
            set_fsdp_accumulation(self.parts, 1 if self.gather_during_step else self.zero, last)
        return contextlib.nullcontext()

    def sync_tied(self) -> None:
        """Sum the gradients of the two copies of tied embeddings (both get the sum), after the
        data-parallel reduction; a no-op without tied embeddings under a pipeline."""
        if not self.tied:
            return
        if any(p.grad is None for p in self.tied):
            raise RuntimeError("tied embeddings: a copy has no gradient after backward")
        for p in self.tied:  # both ends' gradients in their parameter's placements (they are, with
            g = p.grad       # VocabParallelEmbedding; a safeguard: the shards of both ends must align)
            if hasattr(g, "placements") and g.placements != p.placements:  # type: ignore[union-attr]
                p.grad = g.redistribute(g.device_mesh, p.placements)  # type: ignore[union-attr]
        grads = [p.grad for p in self.tied]
        local = [_local(g) for g in grads]  # type: ignore[arg-type]
        if not self._tied_checked:
            self._check_tied_layout(grads)  # type: ignore[arg-type]
            self._tied_checked = True
        if self.tied_group is None:  # zbv: both ends on this rank
            total = local[0] + local[1]
            for t in local:
                t.copy_(total)
            return
        import torch.distributed as dist
        for t in local:  # one tensor per end (one end per rank here)
            dev = _device_of(t)
            buf = t if t.device == dev else t.to(dev)  # offloaded gradients: reduce on the device
            dist.all_reduce(buf, group=self.tied_group)
            if buf is not t:
                t.copy_(buf)

    def _check_tied_layout(self, grads: list[torch.Tensor]) -> None:
        """Both ends' local gradients must cover the same rows of the same global shape (the
        sum is elementwise on the shards); raise if not."""
        rows = [_chunk(g) for g in grads]
        if self.tied_group is None:
            same = rows[0] == rows[1]
        else:
            import torch.distributed as dist
            mine = torch.tensor(rows[0], dtype=torch.int64, device=_device_of(_local(grads[0])))
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine, group=self.tied_group)
            same = bool(torch.equal(both[0], both[1]))
        if not same:
            raise RuntimeError("tied embeddings: the two copies are sharded differently; their gradient "
                               f"shards cannot be summed elementwise (shape, offset, local shape: {rows[0]})")



@contextlib.contextmanager
def _loss_parallel() -> Any:
    """torch's ``loss_parallel()``, left also when the body raises (torch 2.13's leaves its
    cross-entropy handlers installed then)."""
    from torch.distributed.tensor.parallel import loss_parallel
    cm = loss_parallel()
    cm.__enter__()
    try:
        yield
    finally:
        cm.__exit__(None, None, None)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _device_of(t: torch.Tensor) -> torch.device:
    """Where collectives on ``t`` run: its device, or the current CUDA device for host tensors
    when CUDA is used (NCCL groups; FSDP offload keeps gradients in host memory)."""
    if t.device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def _chunk(t: torch.Tensor) -> list[int]:
    """[global shape..., offset..., local shape...] of this rank's shard of ``t``."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return [*t.shape, *offset, *shape]
    return [*t.shape, *([0] * t.dim()), *t.shape]


VOCAB_PARAMS = ("embed.tok.weight", "output.weight")
"""Parameters (clean names) with one row per vocabulary entry: padded by ``pad_vocab``."""


def is_tied_copy(part: nn.Module) -> bool:
    """A pipeline stage's output projection that is the copy of a tied embedding held elsewhere."""
    return bool(getattr(part, "spec", None) is not None and part.spec.tied_embeddings  # type: ignore[union-attr]
                and part.embed is None and part.output is not None)


def logical_name(part: nn.Module, name: str) -> str:
    """The name of a parameter (clean name) in the single-process model: a stage's tied output
    copy is the embedding (``embed.tok.weight``), what checkpoints and comparisons key it by."""
    return "embed.tok.weight" if name == "output.weight" and is_tied_copy(part) else name


# ---- 1. pipeline split (every model) ---------------------------------------------------------
def split_pipeline(model: nn.Module, plan: Plan, pp_rank: int, kinds: list[str],
                   cut: Any) -> tuple[list[nn.Module], list[int]]:
    """This pipeline rank's stages of ``model`` (the full model, the same weights on every rank) and
    their global stage ids. ``kinds`` are the model's layers in execution order (LayerGraph kinds:
    ``block`` for the repeated blocks); ``spec.stages.stage_layer_ranges`` gives each stage's
    [start, end) of them (``stage_layers`` and the even split count blocks; the layers around them
    go with their neighbours). ``cut(module, start, end)`` makes a stage of a module (a copy of
    ``model`` for every stage of the rank but the last, which gets ``model`` itself)."""
    ranges = stage_layer_ranges(kinds, plan)
    stage_ids = stage_ids_for_rank(pp_rank, plan)
    parts = []
    for k, s in enumerate(stage_ids):
        m = model if k == len(stage_ids) - 1 else copy.deepcopy(model)
        parts.append(cut(m, *ranges[s]))
    return parts, stage_ids


def transformer_kinds(model: Transformer) -> list[str]:
    """A Transformer's layers in execution order: the embedding, the blocks, the final norm and the
    output projection (the layers of its LayerGraph)."""
    return ["embedding", *["block"] * len(model.layers), "head", "head"]


def cut_transformer(model: Transformer, start: int, end: int) -> Transformer:
    """``model`` keeping only layers [start, end) of ``transformer_kinds`` (blocks are layers 1..L)."""
    n = len(model.layers)
    keep = {str(i - 1) for i in range(max(start, 1), min(end, n + 1))}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if start > 0:
        model.embed = None
    if end < n + 3:
        model.norm = None
        model.output = None
    return model


# ---- 2. tensor + sequence parallel -------------------------------------------------------------
def vocab_parallel_output(input_layout: Any) -> Any:
    """The output projection's style: column-wise (vocabulary-sharded weight) with the logits left
    a DTensor sharded on the vocabulary (torchtitan's loss_parallel layout), for ``models.loss_fn``
    under ``loss_parallel()``: no rank ever holds the full logits."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel
    return ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)


def _vocab_parallel_lookup(self: nn.Embedding, tokens: Any) -> Any:
    """``VocabParallelEmbedding``'s forward: tokens (a replicated DTensor) looked up in this rank's
    rows of the table (Megatron's VocabParallelEmbedding): tokens outside the rows read row 0 and
    are zeroed, the output is a Partial sum over the ranks (reduced by the style's output hook).
    Autograd sees the local lookup, so the table's gradient is this rank's rows only (``to_local``'s
    backward makes it a DTensor in the parameter's placement, ``Shard(0)``)."""
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    w = self.weight
    mesh = w.device_mesh  # type: ignore[attr-defined]
    local = w.to_local()  # type: ignore[attr-defined]
    _, offset = compute_local_shape_and_global_offset(w.shape, mesh, w.placements)  # type: ignore[attr-defined]
    start, rows = offset[0], local.shape[0]
    tok = tokens.to_local() if isinstance(tokens, DTensor) else tokens
    outside = (tok < start) | (tok >= start + rows)
    pad = self.padding_idx  # its row gets no gradient (nn.Embedding's padding_idx; ingested models: BERT)
    pad = pad - start if pad is not None and start <= pad < start + rows else None
    out = F.embedding((tok - start).masked_fill(outside, 0), local, padding_idx=pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


@functools.cache
def _vocab_parallel_embedding_style() -> type:
    from torch.distributed.tensor.parallel import RowwiseParallel

    class VocabParallelEmbedding(RowwiseParallel):
        """RowwiseParallel for ``nn.Embedding`` (table sharded on the vocabulary, ``Shard(0)``;
        the output reduced to ``output_layouts``) whose backward leaves the gradient sharded like
        the table. DTensor's own embedding backward (torch 2.13) has no vocabulary-sharded strategy:
        it computes the full [vocab, hidden] gradient, replicated, on every tensor-parallel rank
        (tp x the gradient memory, and with a manual data-parallel all-reduce tp x its traffic).
        Here the lookup runs on the local rows (``_vocab_parallel_lookup``): the gradient is
        [vocab/tp, hidden] from the start. Same forward, to the bit."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            module = super()._apply(module, device_mesh)
            module.forward = types.MethodType(_vocab_parallel_lookup, module)  # type: ignore[method-assign]
            return module
    return VocabParallelEmbedding


def vocab_parallel_embedding(**kwargs: Any) -> Any:
    """A ``VocabParallelEmbedding`` style (``_vocab_parallel_embedding_style``: the class is made
    on first use, as torch.distributed is imported only inside functions here)."""
    return _vocab_parallel_embedding_style()(**kwargs)


def apply_tp(part: Transformer, tp_mesh: Any, sp: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    resid = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    top: dict[str, Any] = {}
    if part.embed is not None:
        top["embed.tok"] = vocab_parallel_embedding(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            top["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if part.output is not None:
        if sp:
            top["norm"] = SequenceParallel()
        top["output"] = vocab_parallel_output(resid)
    tied = part.embed is not None and part.output is not None and part.output.weight is part.embed.tok.weight
    if tied:  # both shard the vocab dim of the one matrix: parallelize the output, then re-tie
        top.pop("output")
    parallelize_module(part, tp_mesh, top)
    if tied:
        parallelize_module(part.output, tp_mesh, vocab_parallel_output(resid))
        part.output.weight = part.embed.tok.weight
    for block in part.layers.values():
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=resid)}
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                   desired_input_layouts=(Replicate(), None, None),
                                                   use_local_output=True)
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),),
                                                      use_local_output=True)
        ff = block.feed_forward
        mlps = [(f"feed_forward.experts.{e}", m) for e, m in ff.experts.items()] if hasattr(ff, "experts") \
            else [("feed_forward", ff)]
        moe = hasattr(ff, "experts")
        for prefix, mlp in mlps:
            plan[f"{prefix}.w1"] = ColwiseParallel()
            plan[f"{prefix}.w2"] = RowwiseParallel(output_layouts=Replicate() if moe else resid)
            if mlp.w3 is not None:
                plan[f"{prefix}.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)
        if moe and sp:  # experts return the replicated sum; the residual stream is sequence-sharded
            parallelize_module(block.feed_forward, tp_mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)))


# ---- 4. activation recomputation ---------------------------------------------------------------
def _op_sac_context() -> Any:
    """torchtitan's op-level selective AC: keep matmul outputs every other time and attention
    outputs; recompute everything else (elementwise ops, norms)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    mm = {aten.mm.default, aten.addmm.default}
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in mm:
            counts[mode] += 1
        keep = func in save and not (func in mm and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def resolve(root: nn.Module, path: str) -> nn.Module:
    """The sub-module at ``path`` ("" is the root)."""
    return root.get_submodule(path) if path else root


def replace(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at ``path`` (an item of a ModuleList/ModuleDict/Sequential, or an attribute)."""
    parent, _, leaf = path.rpartition(".")
    holder = resolve(root, parent)
    if isinstance(holder, (nn.ModuleList, nn.Sequential)) and leaf.isdigit():
        holder[int(leaf)] = module
    elif isinstance(holder, nn.ModuleDict):
        holder[leaf] = module
    else:
        setattr(holder, leaf, module)


def apply_ac(part: nn.Module, blocks: list[str], plan: Plan) -> list[str]:
    """Activation recomputation of the blocks at ``blocks`` (paths in ``part``, model order): full,
    a checkpoint_wrapper per block (the first ``recompute_layers`` of the stage); selective, around
    each block's core attention (``attention.core``: preset Transformers); op, op-level SAC per
    block. Returns the paths whose block was wrapped (the wrapper takes the block's place)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    if plan.recompute == "none":
        return []
    if plan.recompute == "selective":
        for path in blocks:
            attn = resolve(part, path).attention
            attn.core = checkpoint_wrapper(attn.core, preserve_rng_state=False)
        return []
    n = len(blocks) if plan.recompute != "full" or plan.recompute_layers is None \
        else min(plan.recompute_layers, len(blocks))
    extra = {} if plan.recompute == "full" else {"context_fn": _op_sac_context}
    for path in blocks[:n]:
        replace(part, path, checkpoint_wrapper(resolve(part, path), preserve_rng_state=False, **extra))
    return blocks[:n]


def block_paths(part: Transformer) -> list[str]:
    """The paths of a Transformer part's blocks."""
    return [f"layers.{name}" for name in part.layers]


# ---- 5. torch.compile --------------------------------------------------------------------------
def _inner(module: nn.Module) -> nn.Module:
    """The module under checkpoint_wrapper / torch.compile wrappers."""
    for attr in ("_checkpoint_wrapped_module", "_orig_mod"):
        while hasattr(module, attr):
            module = getattr(module, attr)
    return module


def apply_compile(part: Transformer, plan: Plan) -> None:
    """torch.compile per block, fullgraph (after TP and recomputation, before FSDP, whose hooks
    stay outside the compiled code: torchtitan's order). Where a whole block cannot be one graph,
    its attention and MLP (or each expert) are compiled and the rest runs eagerly: MoE blocks
    (data-dependent routing and collectives) and TP blocks under recomputation (torch 2.13's
    AOTAutograd fails on DTensor meshes saved inside a compiled checkpoint region; the checkpoint
    then stays outside the compiled parts)."""
    split = plan.tp > 1 and plan.recompute != "none"
    for name in list(part.layers.keys()):
        block = part.layers[name]
        inner = _inner(block)
        ff = inner.feed_forward
        if not (split or hasattr(ff, "experts")):
            part.layers[name] = torch.compile(block, fullgraph=True)
            continue
        if not (split and plan.recompute == "selective"):
            inner.attention = torch.compile(inner.attention, fullgraph=True)
        if hasattr(ff, "experts"):
            for key in list(ff.experts.keys()):
                ff.experts[key] = torch.compile(ff.experts[key], fullgraph=True)
        else:
            inner.feed_forward = torch.compile(ff, fullgraph=True)


# ---- 6/7. data parallel and precision ----------------------------------------------------------
def _offload_policy(plan: Plan, device: torch.device) -> Any:
    """FSDP2 CPUOffloadPolicy for offload_params / offload_optimizer on an accelerator, else None.
    FSDP2 has no optimizer-only offload: its policy keeps the sharded parameters, gradients and
    AdamW states in host memory and steps on the CPU, which covers both fields."""
    if device.type == "cpu" or not (plan.offload_params or plan.offload_optimizer):
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy
    return CPUOffloadPolicy(pin_memory=True)


def apply_fsdp(parts: list[nn.Module], blocks: list[list[str]], plan: Plan, mesh: RuntimeMesh,
               device: torch.device) -> None:
    """FSDP2 ``fully_shard`` per block (``blocks``: paths in each part; blocks without parameters
    are left to the root), then per part (the root: embeddings, norms, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
    dtype = DTYPES[plan.precision]
    reduce = fsdp_reduce_dtype(plan)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce) if dtype != torch.float32 \
        else MixedPrecisionPolicy(reduce_dtype=None if reduce == torch.float32 else reduce)  # fp32: no casts
    kw = {"mp_policy": mp, "offload_policy": _offload_policy(plan, device) or OffloadPolicy()}
    reshard = plan.zero == 3 and plan.pp == 1
    dp_mesh = mesh.fsdp_mesh()
    fp8 = plan.grad_compression == "fp8" and not plan.periodic

    def shard(module: nn.Module, **kwargs: Any) -> None:
        fully_shard(module, **kwargs)
        if fp8:  # fp8 on the wire: FSDP2's custom reduce-scatter, on every module it shards
            module.set_custom_reduce_scatter(fp8_reduce_scatter())  # type: ignore[operator]
    for part, paths in zip(parts, blocks):
        mods = [m for m in (resolve(part, p) for p in paths) if next(m.parameters(), None) is not None]
        for i, block in enumerate(mods):
            # zero=3: reshard after forward, but not the last block, whose backward comes first
            # (FSDP would gather it again at once: torchtitan's choice)
            rs = reshard and i < len(mods) - 1
            for experts in (expert_modules(block) if plan.ep > 1 else []):  # experts: over their replicas
                shard(experts, mesh=mesh.expert_fsdp_mesh(), reshard_after_forward=rs, **kw)  # only; FSDP
                # averages over those, the trainer divides by ep (not set_gradient_divide_factor: gloo has no
                # PREMUL_SUM, and with a one-rank shard group torch 2.13 divides twice when forced to sums)
            shard(block, mesh=dp_mesh, reshard_after_forward=rs, **kw)
        # the root (embedding, final norm, output) is kept gathered from forward to backward: its
        # output projection's backward comes first (FSDP2's default for the root module)
        shard(part, mesh=dp_mesh, reshard_after_forward=False, **kw)


def expert_modules(block: nn.Module) -> list[nn.Module]:
    """The expert-parallel experts in ``block`` (marked ``meshplan_ep`` by expert_parallel: a
    preset MoE's experts, an ingested model's fused experts or experts container)."""
    return [m for m in block.modules() if getattr(m, "meshplan_ep", False)]


def fsdp_reduce_dtype(plan: Plan) -> torch.dtype:
    """The dtype FSDP2 reduce-scatters gradients in: fp32, or bf16 for a synchronous plan's
    grad_compression=bf16 (and PowerSGD, which FSDP2 cannot run: rule "PowerSGD under FSDP2"); fp8
    is FSDP2's custom reduce-scatter on fp32 input (``apply_fsdp``). A periodic plan's compression
    is its outer sync's (runtime/periodic.py): its inner groups reduce in fp32."""
    if plan.grad_compression in ("bf16", "powersgd") and not plan.periodic:
        return torch.bfloat16
    return torch.float32


def set_fsdp_accumulation(parts: list[nn.Module], zero: int, last: bool) -> None:
    """FSDP2 flags for the next micro-batch (pp = 1): zero 0/1 accumulate unsharded and
    reduce-scatter in the last micro-batch only, zero 1/2 keep the parameters gathered until the
    last backward, zero 3 keeps FSDP's defaults (reshard after backward, reduce every micro-batch).
    Called on the root of each part: ``set_*`` recurse into every FSDP module under it (blocks,
    experts on their own mesh); for HSDP the sync flag covers the all-reduce over replicas too."""
    if zero >= 3:
        return
    for part in parts:
        part.set_reshard_after_backward(last)  # type: ignore[operator]
        if zero <= 1:
            part.set_requires_gradient_sync(last)  # type: ignore[operator]


def _has_dtensor(parts: list[nn.Module]) -> bool:
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for part in parts for p in part.parameters())


def apply_data_parallel(parts: list[nn.Module], blocks: list[list[str]], plan: Plan, mesh: RuntimeMesh,
                        device: torch.device, *, unused: Any = None,
                        notes: list[str] | None = None) -> tuple[list[nn.Module], str]:
    """Gradient averaging over dp x cp: FSDP2 (zero >= 1, or offload on an accelerator; ``blocks``:
    the paths of each part's blocks), DDP, or a manual all-reduce (DTensor parameters, pipeline
    stages, expert parallelism: ``Trainer._manual_dp_sync``). ``unused``: a callable saying why DDP
    must look for parameters without a gradient (``find_unused_parameters``), None when none can
    lack one; its answer goes to ``notes``."""
    offload = _offload_policy(plan, device) is not None
    if mesh.sync_ndp == 1 and not offload:  # (a periodic plan's inner group of one rank: no per-step sync)
        return parts, "none"
    if plan.zero > 0 or offload:  # offload: FSDP2 over dp x cp, one rank included
        apply_fsdp(parts, blocks, plan, mesh, device)
        if notes is not None and plan.grad_compression == "powersgd" and not plan.periodic:
            from meshplan.spec.support import RULES
            why = RULES["PowerSGD under FSDP2"].why(plan, 1, None)
            notes.append(why or "grad_compression=powersgd: FSDP2 reduces in bf16")
        return parts, "fsdp"
    if _has_dtensor(parts) or plan.pp > 1 or plan.ep > 1:  # DDP holds no DTensors; under PP its reducer
        return parts, "manual"                            # asserts on stages with few parameters (torch 2.13)
    from torch.nn.parallel import DistributedDataParallel as DDP

    why = unused() if unused is not None else None
    if why and notes is not None:
        notes.append(f"DDP with find_unused_parameters=True: {why}")
    # no buffer broadcast: the rotary tables are the same on every rank (or per cp rank, by design)
    ddps = [DDP(p, process_group=mesh.sync_group, find_unused_parameters=why is not None, **ddp_no_buffer_sync())
            for p in parts]
    comp = compression_of(plan)  # bf16/fp8/PowerSGD: DDP's communication hook
    if comp is not None:
        for d in ddps:
            comp.register(d, mesh.sync_group)
    return ddps, "ddp"


def ddp_no_buffer_sync() -> dict[str, bool]:
    """DDP's argument for 'do not broadcast buffers before each forward'. torch 2.13 deprecates
    ``broadcast_buffers`` (a FutureWarning on every rank) for ``forward_sync_buffers``, which still
    broadcasts them once at construction: harmless here, buffers are equal on every rank then (the
    same seed; the per-cp-rank rotary tables are plain attributes, see context_parallel.apply_cp).
    Older torch: ``broadcast_buffers=False``."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


# ---- features that need hardware this run may lack --------------------------------------------
def hardware_notes(plan: Plan, device: torch.device) -> list[str]:
    """One line per plan field this run cannot honour on ``device`` (printed once, recorded in
    the metrics): the run goes on with the equivalent that gives the same numbers."""
    notes = []
    if device.type == "cpu":
        if plan.offload_params or plan.offload_optimizer:
            notes.append("offload: no-op on CPU devices (host memory is the device memory)")
        if plan.async_tp and plan.tp > 1:
            notes.append("async_tp: needs CUDA symmetric memory; TP communication runs without overlap")
        if plan.precision == "fp8":
            notes.append("precision=fp8: no fp8 matmuls on CPU; running bf16")
        return notes
    if plan.offload_optimizer and not plan.offload_params:
        notes.append("offload_optimizer: FSDP2's CPUOffloadPolicy also keeps the sharded parameters in host memory")
    if plan.precision == "fp8" and _fp8_unavailable(plan, device):
        notes.append(f"precision=fp8: {_fp8_unavailable(plan, device)}; running bf16")
    return notes


def _fp8_unavailable(plan: Plan, device: torch.device) -> str | None:
    """Why torchao float8 linears cannot be used here, or None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return "fp8 matmuls need a CUDA GPU of compute capability >= 8.9"
    if plan.tp > 1:
        return "fp8 with tp>1 is not wired in this runtime (torchao's Float8 TP styles)"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao is not installed (pip install torchao)"
    return None


def apply_fp8(model: Transformer) -> None:
    """torchao float8 training linears (dynamic scaling) for every projection but the output."""
    from torchao.float8 import convert_to_float8_training

    def keep(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and not fqn.endswith(("output", "gate")) \
            and module.in_features % 16 == 0 and module.out_features % 16 == 0
    convert_to_float8_training(model, module_filter_fn=keep)


def enable_async_tp(mesh: RuntimeMesh) -> None:
    """torchtitan's async TP: symmetric memory on the TP group and inductor's micro-pipeline
    pass, which overlaps the TP all-gather / reduce-scatter with the matmuls of compiled blocks."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(mesh.sub(AX.TP).get_group().group_name)


# ---- the whole ---------------------------------------------------------------------------------
def parallelize(model: Transformer, plan: Plan, mesh: RuntimeMesh | None, device: torch.device,
                *, microbatches: int, seq_len: int | None = None) -> Parallelized:
    """Apply ``plan`` to ``model`` (the full model, same weights on every rank) for this rank."""
    notes = hardware_notes(plan, device)
    fp8 = plan.precision == "fp8" and device.type == "cuda" and _fp8_unavailable(plan, device) is None
    if fp8:
        apply_fp8(model)
    compile_blocks = plan.compile
    async_tp = plan.async_tp and plan.tp > 1 and device.type == "cuda"
    if async_tp and not plan.compile:
        notes.append("async_tp: blocks are compiled (the overlap is an inductor pass) although compile=0")
        compile_blocks = True
    if mesh is None or plan.num_gpus == 1:
        if _offload_policy(plan, device) is not None:
            notes.append("offload: not applied to a one-process run (FSDP2's CPUOffloadPolicy needs a "
                         "process group)")
        model.to(device)
        if plan.buckets:
            apply_bucket_cp(model)
        apply_ac(model, block_paths(model), plan)
        if compile_blocks:
            apply_compile(model, plan)
        return Parallelized(parts=[model], run_modules=[model], autocast=autocast_dtype(plan, "none"), notes=notes)
    if plan.tp > 1 and model.spec.vocab_size % plan.tp:  # before the split: both tied copies alike
        model.pad_vocab(plan.tp)
    tied = plan.pp > 1 and model.spec.tied_embeddings
    # collective on every rank, before anything rank-dependent: the groups of the tied pairs
    tied_group = mesh.end_stage_group() if tied and plan.schedule != "zbv" else None
    parts: list[nn.Module] = [model]
    stage_ids = [0]
    if plan.pp > 1:
        parts, stage_ids = split_pipeline(model, plan, mesh.pp_rank, transformer_kinds(model), cut_transformer)
    if async_tp:
        enable_async_tp(mesh)
    for part in parts:
        part.to(device)
        if plan.ep > 1:
            for block in part.layers.values():
                shard_experts(block.feed_forward, mesh.ep_group, plan.ep, mesh.ep_rank)
        if plan.tp > 1:
            apply_tp(part, mesh.sub(AX.TP), plan.sequence_parallel)
        if plan.buckets:  # cp per micro-batch (Parallelized.sequence)
            apply_bucket_cp(part)
        elif plan.cp > 1:
            apply_cp(part, mesh.cp_group, plan.cp, mesh.cp_rank, seq_len or model.spec.seq_len, device)
        apply_ac(part, block_paths(part), plan)
        if compile_blocks:
            apply_compile(part, plan)
    run_modules, dp_mode = apply_data_parallel(parts, [block_paths(p) for p in parts], plan, mesh, device,
                                               notes=notes)
    out = Parallelized(parts=parts, run_modules=run_modules, stage_ids=stage_ids, dp_mode=dp_mode,
                       autocast=autocast_dtype(plan, dp_mode), notes=notes, zero=plan.zero,
                       vocab_parallel=plan.tp > 1, has_first=any(p.embed is not None for p in parts),
                       has_last=any(p.output is not None for p in parts))
    if plan.buckets:  # collective on every rank: every unit's group
        out.unit_groups = mesh.unit_groups([b.cp for b in plan.bucket_specs])
    if tied:  # the parameters as TP / FSDP left them (FSDP2 registers new sharded Parameters)
        out.tied = [p.embed.tok.weight for p in parts if p.embed is not None] \
            + [p.output.weight for p in parts if is_tied_copy(p)]
        out.tied_copies = [p.output.weight for p in parts if is_tied_copy(p)]
        out.tied_group = tied_group if out.tied else None
        if out.tied and tied_group is None and len(out.tied) != 2:
            raise MeshplanError(f"plan: tied embeddings under zbv expect both ends on pipeline rank 0, "
                                f"got {len(out.tied)} on rank {mesh.pp_rank}")
    if plan.pp > 1:
        out.schedule = build_schedule(run_modules, stage_ids, plan, mesh, device, microbatches, loss_fn)
    return out


SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def build_schedule(modules: list[nn.Module], stage_ids: list[int], plan: Plan, mesh: RuntimeMesh,
                   device: torch.device, microbatches: int, loss: Any) -> Any:
    """The torch.distributed.pipelining schedule of this rank's stages (``modules``, global ids
    ``stage_ids``); ``loss(output, target)`` runs on the last stage's output of each micro-batch."""
    from torch.distributed import pipelining
    num_stages = plan.pp * plan.virtual_stages
    stages = [pipelining.PipelineStage(m, s, num_stages, device, group=mesh.pp_group)
              for m, s in zip(modules, stage_ids)]
    name = SCHEDULES[plan.schedule]
    if plan.schedule in ("gpipe", "1f1b") and len(stages) > 1:
        name = "ScheduleInterleaved1F1B" if plan.schedule == "1f1b" else "ScheduleLoopedBFS"
    cls = getattr(pipelining, name)
    single = name in ("ScheduleGPipe", "Schedule1F1B")
    if single:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss)
    if microbatches < plan.pp and name != "ScheduleLoopedBFS":
        raise MeshplanError(f"plan: schedule={plan.schedule} needs at least pp={plan.pp} micro-batches "
                            f"per step, got {microbatches}", hint="raise --global-batch or lower micro_batch")
    return cls(stages, n_microbatches=microbatches, loss_fn=loss)
