"""Ingested models (``hf:config.json``, ``module:pkg.mod:factory``) in the runtime: what is particular
to them. Everything else (the training loop, data-parallel sync, clipping, pipeline schedules,
FSDP/DDP, precision, metrics, checkpoints, the launcher) is the presets' (train.py, parallelize.py,
checkpoint.py, launch.py).

``IngestedModel`` is the trainer's view (run_config.TrainModel): the real module of
``meshplan.ingest.build`` (random weights, the same seed on every rank), its synthetic batches and
loss; its layers are ingestion's units (``ingest.layers.find_units``: the repeated blocks, kind
"block", and outside them the embeddings, stem, final norm and head). The plan is applied in the
presets' order with the shared pieces of parallelize.py:

1. pipeline split   pp > 1, where the forward is a plain sequence of units (checked): the units in
                    execution order are the LayerGraph's layers; ``stage_layers`` and the even split
                    count the blocks (``spec.stages.stage_layer_ranges``: the units before the first
                    block go with the first stage, one between blocks with the block before it, those
                    after the last block with the last stage). A stage (``StageModule``) runs the
                    model's own forward: units before its range return the received activation (their
                    parameters dropped; code between units runs on it, as it did on the unit's
                    output), and the forward stops after its last unit (that unit's output is sent
                    on). Refused, with the reason: encoder-decoders (T5: the decoder reads the
                    encoder's output at every block), tied weights across units, a unit called twice
                    (``ingest.layers.pipeline_refusal``: the graph's ``no pipeline:`` note, the same
                    words), a forward whose result changes when cut at a stage boundary (side values
                    passed between units);
1b. EP              ep > 1 (ep divides dp x cp and every MoE layer's experts): on the whole model,
                    before the pipeline split, ``expert_parallel.shard_ingested``: transformers' fused
                    experts (Mixtral, Qwen-MoE, DeepSeek-V2/V3 ...) keep this rank's rows of their
                    [E, ...] parameters and a ``gate`` + ``experts`` list + ``top_k`` module keeps its
                    rank's experts; tokens go to their experts' owners by all-to-all and come back in
                    the single-process order (the router, shared experts and their gates run on every
                    rank). Refused: a model without such experts, ep not dividing a layer's experts, a
                    list module whose routing is not softmax top-k renormalised (checked on a random
                    input). Checkpoints save each rank's rows of the fused experts as chunks of the
                    [E, ...] tensors (runtime/checkpoint.py): they resume under any ep;
2. TP               tp > 1: what ``ingest.tp.model_tp`` says (ingestion marks the LayerOps from the
                    same function): in each block the column/row pairs whose matrices are all
                    non-fused nn.Linear (q/k/v, gate/up, fc1 ... column-wise; o, down, fc2 ... row-wise),
                    head counts of the attention modules divided by tp (a per-head relative-position
                    table split by heads); fused matrices (gate_up, MoE experts' 3-D parameters) stay
                    whole, and a model whose attention projections are fused or not nn.Linear (qkv_proj,
                    GPT-2's Conv1D c_attn) is not split at all (refused). The LM head of a language
                    model (``get_output_embeddings()``) is vocabulary-parallel: ColwiseParallel with its
                    logits a DTensor sharded on the vocabulary, the loss under ``loss_parallel()``
                    (``Parallelized.vocab_parallel``, as for presets), and the nn.Embedding tables of its
                    vocabulary ``VocabParallelEmbedding`` (a tied head re-tied to its table: both
                    ``Shard(0)``). Classification heads stay whole. Convolution pairs
                    (``ingest.tp.conv_pairs``: conv -> BatchNorm/activation -> conv in a block, e.g.
                    ResNet's conv1 -> conv2) are split by ``shard_convs``: DTensor parameters (column
                    ``Shard(0)``, row ``Shard(1)``, the BatchNorm between them ``Shard(0)``) whose
                    forwards run on the local shards with explicit collectives (the column input's
                    gradient and the row output all-reduced), DTensor's styles taking nn.Linear only.
                    Checked on one sample against the unsplit model (pp = 1);
3. recompute        full: ``checkpoint_wrapper`` per block (the first ``recompute_layers`` of each stage);
4. data parallel    parallelize.apply_data_parallel: DDP (``find_unused_parameters`` only for a model
                    with parameters that get no gradient: ``unused_parameters``), the manual
                    all-reduce under TP or PP, FSDP2 per block then per stage (HSDP), the ZeRO levels;
5. precision        FSDP2 MixedPrecisionPolicy, else autocast (fp32: nothing).

Not run (one-line refusal before anything starts): cp > 1, sequence_parallel,
recompute=selective/op, fp8 (what the graph cost model does not price either), zero-bubble
schedules with dp > 1.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from meshplan.errors import MeshplanError
from meshplan.ingest.batch import Batch, class_logits
from meshplan.ingest.builder import Built, build
from meshplan.ingest.layers import Unit, find_units, pipeline_refusal
from meshplan.ingest.tp import ModelTP, TPInfo, model_tp
from meshplan.runtime import preflight as pre
from meshplan.runtime.data import take
from meshplan.runtime.expert_parallel import ep_refusal, shard_ingested
from meshplan.runtime.hetero import check_batch, replica_span
from meshplan.runtime.local import cpu_memory, estimate_basis, local_cluster
from meshplan.runtime.mesh import RuntimeMesh
from meshplan.runtime.parallelize import (
    Parallelized,
    apply_ac,
    apply_data_parallel,
    autocast_dtype,
    build_schedule,
    hardware_notes,
    resolve,
    split_pipeline,
    vocab_parallel_embedding,
    vocab_parallel_output,
)
from meshplan.runtime.run_config import RunConfig, TrainModel
from meshplan.spec.axes import AX
from meshplan.spec.plan import Plan
from meshplan.spec.stages import stage_layer_counts, stage_layer_ranges

SIZE_ATTRS = ("inner_dim", "all_head_size")
"""Attention attributes that are heads x head size (divided by tp with the head counts)."""
STAGE = "inner"
"""The attribute of a pipeline stage (``StageModule``) holding the model: parameter names start
with ``inner.`` (train.clean_fqn removes it)."""


# ---- what runs ---------------------------------------------------------------------------------
def plan_refusal(plan: Plan) -> str | None:
    """Why the runtime cannot run ``plan`` on any ingested model (None: it may, model permitting):
    the traced-model rules of spec.support (the table the search applies too), then the schedules."""
    from meshplan.spec.support import traced_refusal
    why = traced_refusal(plan)
    if why:
        return "plan: " + why
    if plan.schedule in ("zero-bubble", "zbv") and plan.pp > 1 and plan.dp > 1:
        return (f"plan: schedule={plan.schedule} with dp>1 gives wrong gradients on torch 2.13 (zero-bubble + "
                "FSDP/DDP); use interleaved-1f1b or dp=1")
    if plan.schedule == "zbv" and plan.pp > 1 and plan.virtual_stages != 2:
        return "plan: schedule=zbv needs virtual_stages=2"
    return None


def data_refusal(source: str) -> str:
    """Why --data is refused for an ingested model."""
    return f"--data: ingested models ({source}) train on synthetic batches of their example inputs"


def plan_notes(plan: Plan, device: torch.device) -> list[str]:
    """The plan fields this run does not honour on an ingested model (parallelize.hardware_notes,
    and what only presets run)."""
    notes = hardware_notes(plan, device)
    if plan.compile:
        notes.append("compile=1: ingested models run eagerly")
    if plan.async_tp and plan.tp > 1 and device.type != "cpu":
        notes.append("async_tp: not applied to ingested models; TP communication runs without overlap")
    return notes


def stage_problem(kinds: list[str], plan: Plan, name: str) -> str | None:
    """Why ``plan``'s pipeline stages do not fit a model whose layers have ``kinds`` (None: they do):
    ``stage_layers`` and the even split count the blocks (spec.stages.stage_layer_ranges), and every
    stage needs one."""
    if plan.pp == 1:
        return None
    blocks = sum(k == "block" for k in kinds)
    chunks = plan.pp * plan.virtual_stages
    if plan.stage_layers is not None and sum(plan.stage_layers) != blocks:
        return (f"plan: stage_layers sum to {sum(plan.stage_layers)} but {name} has {blocks} blocks "
                "(stage_layers count the repeated blocks; the layers around them go with their neighbours)")
    if plan.stage_layers is None and chunks > blocks:
        return f"plan: pp*virtual_stages = {chunks} exceeds the {blocks} blocks of {name}"
    if any(c < 1 for c in stage_layer_counts(blocks, plan)):
        return "plan: every pipeline stage needs at least one block (stage_layers entries >= virtual_stages)"
    return None


# ---- batches -----------------------------------------------------------------------------------
def make_batch(built: Built, n: int, seed: int) -> Batch:
    """``built.make_inputs`` without touching the global RNG (module: sources reseed it)."""
    with torch.random.fork_rng(devices=[]):
        return built.make_inputs(n, seed=seed)


def primary(out: Any) -> torch.Tensor:
    """The tensor a stage hands on / the loss reads: the output itself, its logits, or its first
    floating tensor."""
    if isinstance(out, torch.Tensor):
        return out
    try:
        return class_logits(out)
    except TypeError:
        pass
    t = next((x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
    if t is None:
        raise MeshplanError(f"a unit returned {type(out).__name__} with no floating tensor to pass on")
    return t



# ---- structure -----------------------------------------------------------------------------------
def unit_paths(model: nn.Module) -> tuple[list[Unit], list[str]]:
    """ingest's units and the paths of those in containers (the repeated blocks)."""
    units = find_units(model)
    return units, [u.name for u in units if u.in_container and u.name]


def execution_order(model: nn.Module, units: list[Unit], batch: Batch) -> list[Unit]:
    """Units in the order one forward calls them (one entry per call: the LayerGraph's layers). Run
    in eval mode without touching the global RNG (no dropout draw, no BatchNorm statistics update:
    training starts where a one-process run starts)."""
    calls: list[Unit] = []
    hooks = [u.module.register_forward_pre_hook(lambda m, a, u=u: calls.append(u)) for u in units]
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*batch.args, **batch.kwargs)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return calls


def unit_kinds(order: list[Unit]) -> list[str]:
    """The layer kinds spec.stages counts: ``block`` for the repeated blocks (units in a container)."""
    return ["block" if u.in_container else "other" for u in order]


def stage_bounds(order: list[Unit], plan: Plan) -> list[tuple[int, int]]:
    """[start, end) over the units in execution order of each global pipeline stage."""
    return stage_layer_ranges(unit_kinds(order), plan)


def pp_refusal(built: Built, units: list[Unit], calls: list[Unit] | None = None) -> str | None:
    """Why ``built`` cannot be pipeline-split, before any value is computed (None: try it):
    ``ingest.layers.pipeline_refusal``, the reason ingestion writes into the LayerGraph as its
    ``no pipeline:`` note (so the planner and the runtime refuse with the same words)."""
    why = pipeline_refusal(built.name, built.task, units, calls)
    if why is None:
        return None
    hint = "use pp=1 with dp/zero (FSDP) and tp" if built.task == "seq2seq-lm" else "use pp=1"
    return f"pp>1: {why}; {hint}"


# ---- pipeline stages ------------------------------------------------------------------------------
class _Stop(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value


class _Holder:
    """Where a stage's received activation waits while the model's forward runs."""

    h: torch.Tensor | None = None


def _feed(holder: Any) -> Any:
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        assert holder.h is not None
        return holder.h
    return forward


def _stop(module: nn.Module, args: tuple, out: Any) -> None:
    raise _Stop(primary(out))


def _strip(module: nn.Module) -> None:
    """Drop a unit's parameters and buffers (kept as plain meta tensors, so code reading their dtype
    or shape runs): another stage holds them (and its BatchNorm statistics, which a checkpoint
    saves once)."""
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, p in list(table.items()):
                if p is None:
                    continue
                delattr(sub, name)
                setattr(sub, name, torch.empty(p.shape, dtype=p.dtype, device="meta"))


def install(model: nn.Module, order: list[str], start: int, end: int, holder: Any, *,
            hooks: bool = True) -> list[Any]:
    """Make ``model``'s forward compute units start..end-1 of ``order`` from ``holder.h``; returns
    undo callables. Units before ``start`` return ``holder.h`` (so what runs between the previous
    unit and the first, e.g. ViT's ``[:, 0]`` before its classifier, runs here on it); with
    ``hooks``, the forward stops after the last unit (not on the last stage)."""
    undo: list[Any] = []
    if start > 0:
        for path in dict.fromkeys(order[:start]):
            m = resolve(model, path)
            m.forward = _feed(holder)
            undo.append(lambda m=m: m.__dict__.pop("forward", None))
    if hooks:
        undo += [h.remove for h in stage_hooks(model, order, start, end, holder)]
    return undo


def stage_hooks(model: nn.Module, order: list[str], start: int, end: int, holder: Any) -> list[Any]:
    """The hook ending a stage's forward after its last unit (registered last: FSDP's run first)."""
    out = []
    if end < len(order):
        out.append(resolve(model, order[end - 1]).register_forward_hook(_stop))
    return out


def run_stage(model: nn.Module, holder: Any, first: bool, inputs: Any, dummy: Any) -> torch.Tensor:
    """One stage's forward: ``inputs`` (a Batch) on the first stage, else the received activation."""
    if first:
        batch = inputs
    else:
        holder.h = inputs
        batch = dummy(inputs)
    try:
        out = model(*batch.args, **batch.kwargs)
    except _Stop as s:
        out = s.value
    finally:
        holder.h = None
    return primary(out)


class StageModule(nn.Module):
    """A pipeline stage: the model's own forward over this stage's units (see ``install``); the
    model is its ``inner`` (``STAGE``)."""

    def __init__(self, model: nn.Module, built: Built, order: list[str], start: int, end: int,
                 template: Batch) -> None:
        super().__init__()
        self.inner = model
        self.order, self.start, self.end = order, start, end
        self.first, self.last = start == 0, end == len(order)
        self._built = built
        leaves, self._spec = tree_flatten((template.args, template.kwargs))
        n = _batch_size(template)
        self._slots = [i for i, t in enumerate(leaves) if _is_rows(t, n)]
        self._leaves = leaves
        self._dummies: dict[tuple, Batch] = {}
        self.h: torch.Tensor | None = None
        if not self.first:
            for path in dict.fromkeys(order[:start]):
                _strip(resolve(model, path))
        for path in dict.fromkeys(order[end:]):
            _strip(resolve(model, path))
        install(model, order, start, end, self, hooks=False)

    def tensors(self, b: Batch) -> list[torch.Tensor]:
        """The first stage's inputs as the positional tensors a pipeline schedule splits."""
        leaves = tree_flatten((b.args, b.kwargs))[0]
        return [leaves[i] for i in self._slots]

    def _batch(self, xs: tuple) -> Batch:
        leaves = list(self._leaves)
        for i, x in zip(self._slots, xs):
            leaves[i] = x
        args, kwargs = tree_unflatten(leaves, self._spec)
        return Batch(args=args, kwargs=kwargs)

    def _dummy(self, h: torch.Tensor) -> Batch:
        key = (h.shape[0], str(h.device))
        if key not in self._dummies:
            self._dummies[key] = make_batch(self._built, h.shape[0], 0).to(h.device)
        return self._dummies[key]

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        inputs = self._batch(xs) if self.first else xs[0]
        return run_stage(self.inner, self, self.first, inputs, self._dummy)


def _batch_size(b: Batch) -> int:
    for t in tree_flatten((b.args, b.kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return t.shape[0]
    raise MeshplanError("the model's example inputs hold no tensor with a batch dimension")


def _is_rows(t: Any, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == n


def check_sequence(built: Built, order: list[Unit], bounds: list[tuple[int, int]], sample: Batch) -> None:
    """Cut the forward at every stage boundary on one sample and compare with the uncut forward:
    a model passing other values between units (a position bias, an encoder output) differs."""
    model, names = built.module, [u.name for u in order]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            ref = primary(model(*sample.args, **sample.kwargs)).float()
            h: Any = sample
            holder = _Holder()
            for start, end in bounds:
                undo = install(model, names, start, end, holder)
                try:
                    h = run_stage(model, holder, start == 0, h, lambda x: sample)
                except Exception as e:  # noqa: BLE001 - any failure means: not a sequence here
                    raise MeshplanError(f"pp>1: {built.name} cannot be cut before unit {names[start]}: "
                                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                        hint="use pp=1 (its forward is not a plain sequence of its units)") from None
                finally:
                    for u in reversed(undo):
                        u()
            got = h.float()
    finally:
        model.train(was)
    if got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-4, atol=1e-5):
        cut = ", ".join(names[s] for s, _ in bounds[1:])
        raise MeshplanError(f"pp>1: cutting {built.name} before {cut} changes its output: its units pass other "
                            "values along (not a plain sequence)", hint="use pp=1 with dp/zero and tp")


# ---- tensor parallel ----------------------------------------------------------------------------
def split_of(built: Built, model: nn.Module | None = None) -> ModelTP:
    """What TP splits in ``built``: ``ingest.tp.model_tp``, the function ingestion marks the
    LayerOps with (split GEMMs, tp_allreduces, the vocabulary-parallel head and tables), so the
    graph cost model prices what runs here."""
    model = model if model is not None else built.module
    units, blocks = unit_paths(model)
    return model_tp(model, [(p, resolve(model, p)) for p in blocks], built.heads, built.task, built.name)


@dataclass
class TPPlan:
    """What TP splits in one block (paths relative to the block)."""

    styles: dict[str, str] = field(default_factory=dict)
    """module path -> column | row | heads (a per-head table split like a column)."""
    attention: list[str] = field(default_factory=list)
    """Attention modules whose head counts are divided."""
    kept: list[str] = field(default_factory=list)
    """Why some recognised matrices stay whole (notes)."""
    tp_max: int = 1


def tp_plan(block: nn.Module, info: TPInfo, heads: tuple[int | None, int | None]) -> TPPlan:
    """The split of one block: its nn.Linear pairs (``info``: ingest.tp.analyse), the head counts of
    the attention modules, and a per-head table (T5's relative-position bias) split by heads."""
    from meshplan.ingest import tp as tpi
    out = TPPlan(styles=dict(info.modules), attention=list(info.attention_scopes), kept=list(info.kept),
                 tp_max=info.tp_max)
    if info.style != "megatron":
        out.styles = {}
        return out
    mods = dict(block.named_modules())
    for scope in out.attention:
        att = mods.get(scope)
        n = next((getattr(att, a) for a in tpi.HEAD_ATTRS if isinstance(getattr(att, a, None), int)), None) \
            or heads[0]
        for name, sub in (att.named_children() if att is not None else ()):
            if isinstance(sub, nn.Embedding) and n and sub.embedding_dim == n:
                out.styles[f"{scope}.{name}" if scope else name] = "heads"
    return out


def apply_tp(model: nn.Module, blocks: list[str], built: Built, tp_mesh: Any, tp: int, notes: list[str],
             split: ModelTP) -> int:
    """Split ``blocks`` (paths in ``model``) by tensor parallel as ``split`` says (ingest.tp.model_tp,
    blocks by module identity); returns how many blocks were split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshplan.ingest import tp as tpi
    n = 0
    for k in split.notes:
        if f"tp: {k}" not in notes:
            notes.append(f"tp: {k}")
    for path in blocks:
        block = resolve(model, path)
        info = split.blocks.get(path.removeprefix(f"{STAGE}."), TPInfo())
        plan = tp_plan(block, info, built.heads)
        if info.convs:  # convolution pairs: explicit shards (DTensor's styles take nn.Linear only)
            shard_convs(block, info, tp_mesh, tp, path)
            n += not plan.styles
        if not plan.styles:
            continue
        if plan.tp_max % tp:
            raise MeshplanError(f"plan: tp={tp} does not divide {path}'s heads/width (tp_max={plan.tp_max})",
                                hint="use a tp that divides the attention heads")
        for scope in plan.attention:
            att = resolve(block, scope)
            for a in (*tpi.HEAD_ATTRS, *tpi.KV_ATTRS, *SIZE_ATTRS):
                v = getattr(att, a, None)
                if isinstance(v, int) and not isinstance(v, bool):
                    if v % tp:
                        raise MeshplanError(f"plan: tp={tp} does not divide {path}.{scope}.{a}={v}")
                    setattr(att, a, v // tp)
        present = dict(block.named_modules())  # (expert parallelism keeps only this rank's experts)
        styles = {p: RowwiseParallel() if s == "row" else ColwiseParallel() for p, s in plan.styles.items()
                  if p in present}
        parallelize_module(block, tp_mesh, styles)
        n += 1
    return n


# ---- tensor parallel: convolutions (issue 29) ------------------------------------------------------
class _ToTP(torch.autograd.Function):
    """Enter a column convolution: identity forward, the input gradient all-reduced over TP backward
    (each rank's gradient comes from its output channels only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_reduce(g, ctx.group), None


class _FromTP(torch.autograd.Function):
    """Leave a row convolution: its partial outputs (each rank's input channels) all-reduced forward,
    identity backward (the gradient is the same on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g, None


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _column_forward(m: Any, group: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return m._conv_forward(_ToTP.apply(x, group), _local(m.weight), _local(m.bias))
    return forward


def _row_forward(m: Any, group: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = _FromTP.apply(m._conv_forward(x, _local(m.weight), None), group)
        if m.bias is None:
            return y
        return y + _local(m.bias).reshape(1, -1, *([1] * (y.dim() - 2)))  # once, after the sum
    return forward


def _norm_forward(m: Any) -> Any:
    """nn.BatchNorm*d's forward on the local channels of its (sharded) parameters and statistics."""
    import torch.nn.functional as F

    def forward(x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if m.momentum is None else m.momentum
        if m.training and m.track_running_stats and m.num_batches_tracked is not None:
            m.num_batches_tracked.add_(1)
            factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
        batch_stats = m.training or (m.running_mean is None and m.running_var is None)
        keep = not m.training or m.track_running_stats
        return F.batch_norm(x, _local(m.running_mean) if keep else None, _local(m.running_var) if keep else None,
                            _local(m.weight), _local(m.bias), batch_stats, factor, m.eps)
    return forward


def shard_convs(block: nn.Module, info: TPInfo, tp_mesh: Any, tp: int, path: str) -> None:
    """Split ``block``'s convolution pairs (``info.convs``: ingest.tp.conv_pairs) over ``tp_mesh``:
    a column convolution's weight and bias ``Shard(0)`` (output channels), a row convolution's weight
    ``Shard(1)`` (input channels) and its bias replicated, added once after the all-reduce; the
    BatchNorms between them ``Shard(0)``, running statistics included. The parameters are DTensors
    (clipping, FSDP2, the checkpoints and ``full_weights`` see them as for nn.Linear pairs); the
    forwards run on their local shards with explicit collectives (``_ToTP``, ``_FromTP``):
    DTensor's ColwiseParallel/RowwiseParallel take nn.Linear and nn.Embedding only (torch 2.13)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if info.tp_max % tp:
        raise MeshplanError(f"plan: tp={tp} does not divide the channels of {path}'s split convolutions "
                            f"(tp_max={info.tp_max})", hint="use a tp that divides the channels")
    group = tp_mesh

    def place(m: nn.Module, name: str, placement: Any, buffer: bool = False) -> None:
        table = m._buffers if buffer else m._parameters
        t = table.get(name)
        if t is None:
            return
        d = distribute_tensor(t.detach(), tp_mesh, [placement], src_data_rank=None)  # same weights everywhere
        table[name] = d if buffer else nn.Parameter(d, requires_grad=t.requires_grad)

    for sub, role in info.convs.items():
        m = resolve(block, sub)
        if role == "column":
            place(m, "weight", Shard(0))
            place(m, "bias", Shard(0))
            m.forward = _column_forward(m, group)
        elif role == "row":
            place(m, "weight", Shard(1))
            place(m, "bias", Replicate())
            m.forward = _row_forward(m, group)
        else:
            for name in ("weight", "bias"):
                place(m, name, Shard(0))
            for name in ("running_mean", "running_var"):
                place(m, name, Shard(0), buffer=True)
            m.forward = _norm_forward(m)


def _owned(m: nn.Module) -> bool:
    """This stage holds the module's weight (``StageModule`` strips the units of other stages)."""
    return isinstance(getattr(m, "weight", None), nn.Parameter) and not m.weight.is_meta


def apply_vocab_parallel(model: nn.Module, prefix: str, split: ModelTP, tp_mesh: Any) -> bool:
    """The vocabulary-parallel LM head and embedding tables of ``split`` (paths under ``prefix`` in
    ``model``), as for presets (parallelize.apply_tp): each table a ``VocabParallelEmbedding``
    (rows sharded, ``Shard(0)``; its gradient sharded like it), the head column-wise with its logits
    left a DTensor sharded on the vocabulary (``Shard(-1)``, the loss under ``loss_parallel``). A
    tied head is parallelised like its table (both ``Shard(0)`` of the one matrix), then re-tied;
    every other alias of their parameters (BERT's ``predictions.bias``, the decoder's bias) is
    pointed at the new ones. Returns whether this part holds the head."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    mods = [resolve(model, prefix + p) for p in split.tables]
    head = resolve(model, prefix + split.head) if split.head is not None else None
    owned = [m for m in mods if _owned(m)] + ([head] if head is not None and _owned(head) else [])
    if not owned:
        return False
    old = {id(p): (m, name) for m in owned for name, p in m._parameters.items() if p is not None}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None and id(p) in old:
                holders.setdefault(id(p), []).append((m, name))
    for m in owned:
        if m is head:
            parallelize_module(m, tp_mesh, vocab_parallel_output(Replicate()))
        else:
            parallelize_module(m, tp_mesh, vocab_parallel_embedding(input_layouts=Replicate(),
                                                                    output_layouts=Replicate()))
    for pid, (first, name) in old.items():  # the first owner's new parameter replaces every alias
        new = first._parameters[name]
        for m, attr in holders.get(pid, []):
            if m._parameters.get(attr) is not new:
                m._parameters[attr] = new
    return head is not None and _owned(head)


def _compare_output(model: nn.Module, sample: Batch) -> torch.Tensor:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = primary(model(*sample.args, **sample.kwargs))
    finally:
        model.train(was)
    from torch.distributed.tensor import DTensor
    return (out.full_tensor() if isinstance(out, DTensor) else out).detach().float().clone()



# ---- data parallel -----------------------------------------------------------------------------
def unused_parameters(built: Built) -> str | None:
    """Why DDP must look for parameters without a gradient after every backward
    (``find_unused_parameters``), None when every parameter gets one in every step.

    DDP's reducer waits for a gradient of every parameter; with ``find_unused_parameters=True`` it
    walks the autograd graph after each forward to mark the missing ones ready (and warns when it
    finds none: the walk was for nothing). Which parameters get no gradient is a property of the
    model, seen without running it: the model is built again on the meta device and one forward,
    loss and backward run there (ingest's trace, every block traced); parameters left without a
    gradient are unused (a pooler a task's head skips, a branch a config turns off). Routing that
    depends on the data cannot be seen there: MoE layers with one module per expert (an expert may
    get no token in a step) count as unused parameters. A model that cannot be traced on the meta
    device keeps the safe setting."""
    from meshplan.ingest import moe
    from meshplan.ingest.measure import measure
    routed = next((n for n, m in built.module.named_modules() if moe.is_expert_list(m)), None)
    if routed is not None:
        return f"the experts of {routed} are chosen per token (an expert may get no token in a step)"
    try:
        with torch.random.fork_rng(devices=[]):  # a module: source's example inputs may draw from it
            meta = build(built.source, device="meta", seq_len=built.seq_len, dtype=built.dtype)
            measure(meta, copy_blocks=False)
    except MeshplanError as e:
        return f"whether every parameter gets a gradient is unknown ({e.message})"
    unused = [n for n, p in meta.module.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
        return f"{unused[0]}{more} get no gradient"
    return None



# ---- pipeline loss ------------------------------------------------------------------------------
def pp_loss(built: Built) -> Any:
    """The schedule's loss(output, target): ``built.loss_fn`` on a Batch of the micro-batch's target
    (a module: source's own loss gets it as its inputs)."""
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return plain_loss(built.loss_fn(out, Batch(targets=target, raw=target)))
    return loss


def plain_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: on vocabulary-sharded logits (under ``loss_parallel``) the
    cross-entropy is a replicated DTensor; its local value, a clone (as ``models.loss_fn``: the
    zero-bubble schedules ``detach_()`` the loss, which a view refuses)."""
    from torch.distributed.tensor import DTensor
    return loss.to_local().clone() if isinstance(loss, DTensor) else loss


def pp_target(built: Built, b: Batch) -> torch.Tensor:
    """The tensor the schedule splits into micro-batches for the loss: the labels; a module:
    source's own loss gets its example inputs (one tensor); the default loss needs nothing."""
    from meshplan.ingest.batch import default_loss
    if isinstance(b.targets, torch.Tensor):
        return b.targets
    if built.loss_fn is default_loss:
        return torch.zeros(_batch_size(b), dtype=torch.long, device=_first_tensor(b).device)
    if isinstance(b.raw, torch.Tensor):
        return b.raw
    raise MeshplanError(f"pp>1: {built.name}'s loss reads its example inputs, which are a {type(b.raw).__name__}: "
                        "a pipeline hands the loss one tensor per micro-batch",
                        hint="return one tensor from example_inputs, or use pp=1")


def _first_tensor(b: Batch) -> torch.Tensor:
    return next(t for t in tree_flatten((b.args, b.kwargs))[0] if isinstance(t, torch.Tensor))


# ---- the trainer's view --------------------------------------------------------------------------
class IngestedModel(TrainModel):
    """An ingested model for train.Trainer: built (``ingest.build``, the run's seed, on the run's
    device) and parallelised in ``parallelize``; batch number ``step`` is ``built.make_inputs`` of
    the global batch with seed ``seed * 1_000_003 + step`` (a pure function of the step, as the
    presets' data), each data-parallel rank taking its rows."""

    def __init__(self, cfg: RunConfig) -> None:
        assert isinstance(cfg.model, str)
        self.cfg, self.source = cfg, cfg.model
        self.name = cfg.model
        self.built: Built | None = None

    @property
    def sample_tokens(self) -> int:  # type: ignore[override]
        assert self.built is not None, "IngestedModel.parallelize builds the model"
        return self.built.sample_tokens

    def parallelize(self, plan: Plan, mesh: RuntimeMesh | None, device: torch.device,
                    microbatches: int) -> Parallelized:
        torch.manual_seed(self.cfg.seed)
        self.built = build(self.source, device=str(device), seq_len=self.cfg.seq_len)
        self.name = self.built.name
        self.expert_rows = {}
        return parallelize_ingested(self.built, plan, mesh, device, microbatches=microbatches,
                                    expert_rows=self.expert_rows)

    def rank_batch(self, step: int, mesh: RuntimeMesh | None, device: torch.device) -> Batch:
        assert self.built is not None
        c = self.cfg
        b = make_batch(self.built, c.global_batch, c.seed * 1_000_003 + step)
        dp_rank, dp = (mesh.dp_rank, mesh.dp) if mesh else (0, 1)
        if c.plan.dp_shares is not None:  # uneven shares: this replica's block (runtime/hetero.py)
            lo, hi = replica_span(c.plan, c.global_batch, dp_rank)
            return take(b, lo, hi, c.global_batch)
        per = c.global_batch // dp
        return take(b, dp_rank * per, (dp_rank + 1) * per, c.global_batch)

    def loss(self, module: nn.Module, b: Batch) -> torch.Tensor:
        assert self.built is not None
        return plain_loss(self.built.loss_fn(module(*b.args, **b.kwargs), b))

    def pp_inputs(self, par: Parallelized, b: Batch) -> tuple:
        first = next(p for p in par.parts if p.first)  # type: ignore[attr-defined]
        return tuple(first.tensors(b))

    def pp_target(self, b: Batch) -> torch.Tensor:
        assert self.built is not None
        return pp_target(self.built, b)


def parallelize_ingested(built: Built, plan: Plan, mesh: RuntimeMesh | None, device: torch.device, *,
                         microbatches: int, expert_rows: dict[str, tuple[int, int]] | None = None) -> Parallelized:
    """Apply ``plan`` to ``built.module`` (the full model, the same weights on every rank).
    ``expert_rows``: filled with the fused expert parameters EP keeps in part (TrainModel.expert_rows)."""
    why = plan_refusal(plan)
    if why:
        raise MeshplanError(why)
    notes = plan_notes(plan, device)
    model = built.module
    units, blocks = unit_paths(model)
    if mesh is None or plan.num_gpus == 1:
        apply_ac(model, blocks, plan)
        return Parallelized(parts=[model], run_modules=[model], autocast=autocast_dtype(plan, "none"), notes=notes)
    stage_ids = [0]
    parts: list[nn.Module] = [model]
    part_blocks = [blocks]
    sample = make_batch(built, 1, 0)
    split = split_of(built) if plan.tp > 1 else None  # on the whole model, before the pipeline split
    if split is not None and split.refusal:
        raise MeshplanError(split.refusal)
    if plan.ep > 1:  # on the whole model (every rank runs the checks below alike: their forwards exchange)
        rows = shard_ingested(model, built.name, mesh.ep_group, plan.ep, mesh.ep_rank)
        if expert_rows is not None:
            expert_rows.update(rows)
    if plan.pp > 1:
        why = pp_refusal(built, units)
        if why:
            raise MeshplanError(why)
        order = execution_order(model, units, sample)
        why = pp_refusal(built, units, order)
        if why:
            raise MeshplanError(why)
        why = stage_problem(unit_kinds(order), plan, built.name)
        if why:
            raise MeshplanError(why, hint="take stage_layers from `meshplan plan` on this model, or leave them unset")
        check_sequence(built, order, stage_bounds(order, plan), sample)
        names = [u.name for u in order]
        template = make_batch(built, 2, 0)  # 2 rows: tells the batch dimension from constant size-1 ones

        def cut(m: nn.Module, start: int, end: int) -> StageModule:
            return StageModule(m, built, names, start, end, template)
        parts, stage_ids = split_pipeline(model, plan, mesh.pp_rank, unit_kinds(order), cut)
        part_blocks = [[f"{STAGE}.{p}" for p in names[st.start:st.end] if p in blocks] for st in parts]
    vocab_parallel = False
    if split is not None:
        ref = _compare_output(model, sample) if plan.pp == 1 else None
        for part, paths in zip(parts, part_blocks):
            apply_tp(part, paths, built, mesh.sub(AX.TP), plan.tp, notes, split)
            prefix = f"{STAGE}." if plan.pp > 1 else ""
            vocab_parallel |= apply_vocab_parallel(part, prefix, split, mesh.sub(AX.TP))
        if ref is not None:
            got = _compare_output(model, sample)
            err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
            if err > 1e-4:
                raise MeshplanError(f"plan: tp={plan.tp} changes {built.name}'s output (relative error {err:.1e}): "
                                    "its attention reshapes with a head count this runtime does not adjust, or "
                                    "a split convolution's channels are read by something other than its pair",
                                    hint="use tp=1 for this model")
    for part, paths in zip(parts, part_blocks):
        apply_ac(part, paths, plan)  # the wrapper takes the block's place: same paths
    run, dp_mode = apply_data_parallel(parts, part_blocks, plan, mesh, device,
                                       unused=lambda: unused_parameters(built), notes=notes)
    out = Parallelized(parts=parts, run_modules=run, stage_ids=stage_ids, dp_mode=dp_mode,
                       autocast=autocast_dtype(plan, dp_mode), notes=notes, zero=plan.zero,
                       vocab_parallel=split is not None and split.head is not None)
    if plan.pp > 1:
        for st in parts:
            assert isinstance(st, StageModule)
            stage_hooks(st.inner, st.order, st.start, st.end, st)
        out.has_first = any(st.first for st in parts)  # type: ignore[attr-defined]
        out.has_last = any(st.last for st in parts)  # type: ignore[attr-defined]
        out.schedule = build_schedule(parts, stage_ids, plan, mesh, device, microbatches, pp_loss(built))
    return out


# ---- the launcher's checks and estimate ------------------------------------------------------------
def preflight(job: Any) -> tuple[Any, Any]:
    """The pre-flight checks particular to an ingested model (job.check_job runs them after the
    learning rate and --metrics): the process count, what the runtime runs, then the model built on
    the meta device (its config, --seq-len against its positions: ingest.hf.check_seq_len), its
    pipeline and TP structure, the stages against its blocks, the planner's constraints on the
    traced LayerGraph (preflight.check_graph_plan: schedule, hybrid sharding, offload, zero=2 under a
    pipeline ...) and last the memory pre-flight check on it (``check_memory``). Returns (the memory
    estimate, preflight.MemoryEstimate or None: not priced; the LayerGraph, None where the model
    cannot be traced on the meta device)."""
    plan = job.plan
    if plan.num_gpus != job.world_size:
        raise MeshplanError(f"plan needs {plan.num_gpus} processes (tp={plan.tp} x pp={plan.pp} x dp={plan.dp} x "
                            f"cp={plan.cp}) but {job.world_size} would be started",
                            hint=f"use --nproc-per-node {plan.num_gpus} (x --nnodes) or change the plan")
    why = plan_refusal(plan)
    if why:
        raise MeshplanError(why)
    check_batch(plan, job.global_batch)  # dp x micro_batch, or the dp_shares
    if plan.zero and plan.shard_group and (plan.dp * plan.cp) % plan.effective_shard:
        raise MeshplanError(f"plan: shard_group={plan.shard_group} does not divide dp={plan.dp}")
    built = build(job.model, device="meta", seq_len=job.seq_len)
    units, blocks = unit_paths(built.module)
    graph = trace(built)
    topo = {"nodes": job.nnodes, "nodes_per_dc": getattr(job, "nodes_per_dc", None)}
    if graph is not None:  # the planner's tables on the traced graph first: their reasons are the search's
        pre.check_graph_plan(graph, plan, job.global_batch, **topo)
        from meshplan.spec.plan import microbatches
        from meshplan.spec.support import runtime_violations
        micro = microbatches(job.global_batch, plan.dp, plan.micro_batch)
        refused = [why for rule, why in runtime_violations(plan, micro, graph) if rule.kind == "refused"]
        if refused:
            raise MeshplanError("plan: " + "; ".join(refused))
    if plan.pp > 1:
        why = pp_refusal(built, units)
        if why:
            raise MeshplanError(why)
    why = ep_refusal(built.module, built.name, plan.ep)
    if why:
        raise MeshplanError(why, hint="use ep=1")
    if plan.tp > 1:
        split = split_of(built)
        if split.refusal:
            raise MeshplanError(split.refusal)
        bad = next((p for p in split.blocks.values() if p.style == "megatron" and p.tp_max % plan.tp), None)
        if bad is not None:
            raise MeshplanError(f"plan: tp={plan.tp} does not divide the model's attention heads / widths "
                                f"(tp_max={bad.tp_max})", hint="use a tp that divides it")
    if graph is not None:
        why = stage_problem([x.kind for x in graph.layers], plan, built.name)
        if why:
            raise MeshplanError(why, hint="take stage_layers from `meshplan plan` on this model, or leave them unset")
    pre.check_graph_plan(graph, plan, job.global_batch, **topo)  # the planner's constraints (the plan's alone untraced)
    return (None if graph is None else check_memory(job, built, graph)), graph


def trace(built: Built) -> Any:
    """The LayerGraph of ``built`` (a meta model) at the run's sequence length; None, said once as a
    warning, for a model that cannot be traced on the meta device (value reads in its forward: it
    may still train, without a memory check)."""
    from meshplan.ingest.measure import measure
    try:
        return measure(built)
    except MeshplanError as e:
        print(f"meshplan: warning: no memory check before launch: {e.message}", file=sys.stderr, flush=True)
        return None


def process_gib(job: Any) -> float:
    """Host memory of one idle rank of this job (preflight: hf: ranks import transformers)."""
    from meshplan.ingest.source import parse_source
    return pre.HF_PROCESS_GIB if parse_source(job.model).kind == "hf" else pre.CPU_PROCESS_GIB


def check_memory(job: Any, built: Built, graph: Any) -> Any:
    """preflight.check_graph_memory for this job on this machine: the graph cost model on ``graph``
    (``built``, a meta model, traced at the run's sequence length), against host memory (every
    process of the node counted) or device 0's memory."""
    from meshplan.ingest import ingest
    kw: dict[str, Any] = {"nproc_per_node": job.nproc_per_node, "nnodes": job.nnodes, "name": built.name,
                          "seq_len": built.seq_len, "process_gib": process_gib(job),
                          "retrace": lambda s: ingest(job.model, seq_len=s),
                          "nodes_per_dc": getattr(job, "nodes_per_dc", None),
                          "optimizer": getattr(job, "optimizer", "adamw")}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return pre.check_graph_memory(graph, job.plan, job.global_batch, device_type="cuda",
                                            available_gib=props.total_memory / 2**30, device_name=props.name, **kw)
    return pre.check_graph_memory(graph, job.plan, job.global_batch, device_type="cpu", **kw)


def estimate(job: Any, device_type: str, graph: Any = None) -> dict[str, Any]:
    """The graph cost model's prediction of this run on this machine (launch.estimate_for), on
    ``graph`` (the LayerGraph at the run's sequence length; traced here when None). On CPU the peak
    memory is the pre-flight check's CPU-corrected figure (local.cpu_memory)."""
    from meshplan.cost import estimate as cost_estimate
    from meshplan.ingest import ingest
    from meshplan.spec.plan import Workload
    try:
        if graph is None:
            graph = ingest(job.model, seq_len=job.seq_len)
        cluster = local_cluster(job.world_size, device_type, job.nnodes, getattr(job, "nodes_per_dc", None))
        work = Workload(global_batch=job.global_batch, seq_len=graph.sample_tokens,
                        optimizer=getattr(job, "optimizer", "adamw"))
        r = cost_estimate(graph, cluster, job.plan, work)
    except MeshplanError as e:
        return {"error": str(e)}
    out = {"cluster": cluster.name, "basis": estimate_basis(cluster.name), "step_time_s": r.step_time_s,
           "peak_memory_gib": r.peak_memory_gib, "tokens_per_s": r.tokens_per_s,
           "activations_gib": r.memory.get("activations")}
    if device_type != "cuda":
        return cpu_memory(out, pre.graph_memory_estimate(graph, job.plan, job.global_batch, "cpu", process_gib(job),
                                                     nodes=job.nnodes, nodes_per_dc=getattr(job, "nodes_per_dc", None),
                                                     optimizer=getattr(job, "optimizer", "adamw")))
    return out


T5_VIEW_WARNING = r"FSDP2-wrapped module \(FSDP\w*T5Block\) returned a view tensor"
"""FSDP2's warning for T5-family blocks (T5, MT5, UMT5, LongT5, Switch), a false positive. The view is
the relative-position bias the block hands on (its second output, checked: the first output, the
hidden states, is not a view): transformers' ``T5Attention.compute_bias`` returns
``values.permute([2, 0, 1]).unsqueeze(0)``, a view of the bias table's lookup, and every later block
returns the bias it was given. FSDP2 warns because an in-place op on a returned view would drop its
pre-backward hook; transformers reads the bias only out of place (``eager_attention_forward``:
``attn_weights = attn_weights + position_bias``, transformers 5.x) and nothing writes to it, so the
hook runs and the gradients are right: T5 under dp=2 zero=3 (FSDP per block) matches the exact run
(tests/dist/test_ingested.py). Cloning the bias in every block to
silence it would cost heads x s x s per block that the graph cost model does not count."""


def quiet_false_positives() -> None:
    """Filter the warnings proven false positives for ingested models (``T5_VIEW_WARNING``), that
    one message only."""
    import warnings
    warnings.filterwarnings("ignore", message=T5_VIEW_WARNING, category=UserWarning)


def search_space(source: str, *, seq_len: int | None = None, base: Plan | None = None) -> Any:
    """A ``search.space.SearchSpace`` holding only what this runtime runs on ``source``: no cp,
    sequence parallelism nor selective/op recompute on any ingested model (``plan_refusal``); pp=1
    when the model cannot be pipeline-split (pp_refusal), tp=1 when TP splits nothing of it
    (``split_of``), ep=1 when it has no experts the runtime splits (expert_parallel.find_moe; else
    the search's divisors of the expert counts)."""
    from meshplan.runtime.expert_parallel import find_moe
    from meshplan.search.space import SearchSpace
    built = build(source, device="meta", seq_len=seq_len)
    units, blocks = unit_paths(built.module)
    pp = (1,) if pp_refusal(built, units) else None
    splittable = split_of(built).refusal is None
    return SearchSpace(base=base or Plan(), pp=pp, tp=None if splittable else (1,), cp=(1,),
                       ep=None if find_moe(built.module) else (1,), sequence_parallel=False,
                       recompute=("none", "full"))
