"""Plans on ingested models (issue 5): ``meshplan train --model hf:config.json | module:pkg.mod:factory``.

The model is the real module of ``meshplan.ingest.build`` (random weights, the same seed on every
rank), trained on the synthetic batches and with the loss of ``Built``; the units are ingestion's
(``ingest.layers.find_units``: the repeated blocks, and outside them the embeddings, final norm and
head). The plan is applied in the order of the transformer runtime (parallelize.py):

1. pipeline split   pp > 1, where the forward is a plain sequence of units (checked): the units run
                    in execution order (the LayerGraph's layers); ``stage_layers`` (or the even split)
                    counts them. A stage runs the model's own forward: units before its range return
                    the received activation (their parameters dropped; code between units runs on
                    it, as it did on the unit's output), and the forward stops after its last unit
                    (that unit's output is sent on). Refused, with the reason:
                    encoder-decoders (T5: the decoder reads the encoder's output at every block),
                    tied weights across stages, a unit called twice, a forward whose result changes
                    when cut at a stage boundary (side values passed between units);
2. TP               tp > 1: DTensor ``parallelize_module`` on the blocks ingest/tp.py recognises:
                    nn.Linear column matrices (q/k/v, gate/up, fc1 ...) column-wise, row matrices
                    (o, down, fc2 ...) row-wise, head counts of the attention modules divided by tp
                    (and a per-head relative-position table split by heads); fused matrices (qkv,
                    gate_up, MoE experts' 3-D parameters, GPT-2's Conv1D) and everything outside the
                    blocks stay replicated. Checked on one sample against the unsplit model (pp = 1);
3. recompute        full: ``checkpoint_wrapper`` per block (the first ``recompute_layers`` of each stage);
4. data parallel    zero=0: DDP (``find_unused_parameters`` only for a model with parameters that
                    get no gradient: ``unused_parameters``; a flattened manual all-reduce under TP or
                    PP); zero 1-3: FSDP2
                    ``fully_shard`` per block, then the model/stage, on the (replicate, shard) mesh for
                    HSDP; zero=3 reshards after forward (not under PP); gradient accumulation per
                    ZeRO level as in parallelize.py (zero=1: unsharded accumulation, one
                    reduce-scatter per step; zero=2: parameters kept gathered, reduce-scatter per
                    micro-batch);
5. precision        FSDP2 MixedPrecisionPolicy, else autocast (fp32: nothing).

Not run (one-line refusal before anything starts): cp > 1, ep > 1, sequence_parallel,
recompute=selective/op, fp8 (what the graph cost model does not price either), checkpoints.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from meshplan.errors import MeshplanError
from meshplan.ingest.batch import Batch, class_logits
from meshplan.ingest.builder import Built, build
from meshplan.ingest.layers import Unit, find_units
from meshplan.runtime.mesh import RuntimeMesh
from meshplan.runtime.parallelize import Parallelized
from meshplan.spec.plan import Plan, checked_microbatches
from meshplan.spec.stages import stage_ids_for_rank

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FUSED = frozenset({"qkv_proj", "c_attn", "qkv", "wqkv", "query_key_value", "gate_up_proj", "in_proj"})
"""Column matrices that hold several projections side by side: a column split would mix them."""
SIZE_ATTRS = ("inner_dim", "all_head_size")
"""Attention attributes that are heads x head size (divided by tp with the head counts)."""
_PREFIX = "inner."


# ---- requests ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class GenericConfig:
    """One training run of an ingested model (the same on every rank)."""

    source: str
    plan: Plan
    global_batch: int
    steps: int
    seq_len: int | None = None
    """Tokens per sequence for language models (None: ingestion's default); images: ignored."""
    lr: float = 1e-3
    seed: int = 0
    grad_clip: float = 1.0


def plan_refusal(plan: Plan) -> str | None:
    """Why the runtime cannot run ``plan`` on any ingested model (None: it may, model permitting)."""
    if plan.cp > 1:
        return f"plan: cp={plan.cp} is not run on ingested models (no known attention sequence axis); use cp=1"
    if plan.ep > 1:
        return f"plan: ep={plan.ep} is not run on ingested models (their experts are not split); use ep=1"
    if plan.sequence_parallel:
        return "plan: sequence_parallel is not run on ingested models (which norms to shard is unknown); drop it"
    if plan.recompute in ("selective", "op"):
        return (f"plan: recompute={plan.recompute} is not run on ingested models (a layer graph records whole "
                "units); use recompute=full or none")
    if plan.precision == "fp8":
        return ("plan: precision=fp8 is not run on ingested models (which matmuls are linear layers is unknown); "
                "use bf16")
    if plan.schedule in ("zero-bubble", "zbv") and plan.pp > 1 and plan.dp > 1:
        return (f"plan: schedule={plan.schedule} with dp>1 gives wrong gradients on torch 2.13 (zero-bubble + "
                "FSDP/DDP); use interleaved-1f1b or dp=1")
    if plan.schedule == "zbv" and plan.pp > 1 and plan.virtual_stages != 2:
        return "plan: schedule=zbv needs virtual_stages=2"
    return None


def plan_notes(plan: Plan, device: torch.device) -> list[str]:
    notes = []
    if plan.compile:
        notes.append("compile=1: ingested models run eagerly")
    if plan.async_tp and plan.tp > 1:
        notes.append("async_tp: not applied to ingested models; TP communication runs without overlap")
    if device.type == "cpu" and (plan.offload_params or plan.offload_optimizer):
        notes.append("offload: no-op on CPU devices (host memory is the device memory)")
    return notes


def microbatches(plan: Plan, global_batch: int) -> int:
    return checked_microbatches(plan, global_batch)


# ---- batches -----------------------------------------------------------------------------------
def rows(x: Any, lo: int, hi: int, n: int) -> Any:
    """Rows lo:hi of every tensor of ``x`` whose first dimension is the batch (n)."""
    return tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == n else t, x)


def take(b: Batch, lo: int, hi: int, n: int) -> Batch:
    return Batch(args=rows(b.args, lo, hi, n), kwargs=rows(b.kwargs, lo, hi, n), targets=rows(b.targets, lo, hi, n),
                 raw=rows(b.raw, lo, hi, n))


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
    """Units in the order one forward calls them (one entry per call: the LayerGraph's layers)."""
    calls: list[Unit] = []
    hooks = [u.module.register_forward_pre_hook(lambda m, a, u=u: calls.append(u)) for u in units]
    try:
        with torch.no_grad():
            model(*batch.args, **batch.kwargs)
    finally:
        for h in hooks:
            h.remove()
    return calls


def tied_units(units: list[Unit]) -> list[str]:
    """Names of parameters held by more than one unit (tied embeddings)."""
    owner: dict[int, str] = {}
    out = []
    for u in units:
        for name, p in u.module.named_parameters():
            if id(p) in owner and owner[id(p)] != u.name:
                out.append(f"{u.name}.{name}")
            owner.setdefault(id(p), u.name)
    return out


def pp_refusal(built: Built, units: list[Unit]) -> str | None:
    """Why ``built`` cannot be pipeline-split, before any value is computed (None: try it)."""
    name = built.name
    if built.task == "seq2seq-lm":
        return (f"pp>1: {name} is an encoder-decoder: every decoder block reads the encoder's output (and T5's "
                "first block hands its position bias to the others), so the forward is not a sequence of units; "
                "use pp=1 with dp/zero (FSDP) and tp")
    tied = tied_units(units)
    if tied:
        return (f"pp>1: {name} ties weights across units ({tied[0]}): the embedding and the output projection "
                "would live on different stages; use pp=1, or untie them (tie_word_embeddings=false)")
    return None


def chunk_bounds(n: int, plan: Plan) -> list[tuple[int, int]]:
    """[start, end) of each pipeline chunk over the ``n`` units in execution order."""
    from meshplan.cost.graph import even_split
    chunks = plan.pp * plan.virtual_stages
    if plan.stage_layers is not None:
        if plan.virtual_stages > 1:
            raise MeshplanError("plan: stage_layers with virtual_stages > 1 is ambiguous on an ingested model",
                                hint="leave stage_layers unset")
        if sum(plan.stage_layers) != n:
            raise MeshplanError(f"plan: stage_layers sum to {sum(plan.stage_layers)} but the model runs {n} layers "
                                "(ingested units)", hint="take stage_layers from `meshplan plan` on this model")
        counts = list(plan.stage_layers)
    else:
        if chunks > n:
            raise MeshplanError(f"plan: pp*virtual_stages = {chunks} exceeds the model's {n} layers")
        counts = list(even_split(n, chunks))
    if any(c < 1 for c in counts):
        raise MeshplanError("plan: every pipeline stage needs at least one layer (stage_layers entries >= 1)")
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


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


def _resolve(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path) if path else root


def _strip(module: nn.Module) -> None:
    """Drop a unit's parameters (kept as plain meta tensors, so code reading their dtype or shape runs)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
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
            m = _resolve(model, path)
            m.forward = _feed(holder)
            undo.append(lambda m=m: m.__dict__.pop("forward", None))
    if hooks:
        undo += [h.remove for h in stage_hooks(model, order, start, end, holder)]
    return undo


def stage_hooks(model: nn.Module, order: list[str], start: int, end: int, holder: Any) -> list[Any]:
    """The hook ending a stage's forward after its last unit (registered last: FSDP's run first)."""
    out = []
    if end < len(order):
        out.append(_resolve(model, order[end - 1]).register_forward_hook(_stop))
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
    """A pipeline stage: the model's own forward over this stage's units (see ``install``)."""

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
                _strip(_resolve(model, path))
        for path in dict.fromkeys(order[end:]):
            _strip(_resolve(model, path))
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


def tp_plan(block: nn.Module, heads: tuple[int | None, int | None]) -> TPPlan:
    """The split of one block: ingest/tp.py's pairs (regions), restricted to nn.Linear matrices."""
    from meshplan.ingest import tp as tpi
    info = tpi.analyse(block, heads)
    out = TPPlan(tp_max=info.tp_max)
    if info.style != "megatron":
        return out
    mods = dict(block.named_modules())
    mats = tpi._matrices(block)

    def inside(path: str, region: str) -> bool:
        return not region or path == region or path.startswith(region + ".")

    for region in info.regions:
        mine = [m for m in mats if inside(m.module, region)]
        bad = [m for m in mine if m.leaf.lower() in FUSED or m.leaf != m.module.rsplit(".", 1)[-1]
               or not isinstance(mods.get(m.module), nn.Linear)]
        if bad:
            why = ("fused" if bad[0].leaf.lower() in FUSED or bad[0].leaf != bad[0].module.rsplit(".", 1)[-1]
                   else type(mods.get(bad[0].module)).__name__)
            out.kept.append(f"{region or type(block).__name__}: {bad[0].leaf} is {why}; kept whole")
            continue
        roles = {m.role for m in mine}
        if roles != {"column", "row"}:
            continue
        for m in mine:
            out.styles[m.module] = m.role
        for m in mine:
            if m.role == "column" and m.leaf.lower() in tpi.ATTENTION:
                scope = m.module.rsplit(".", 1)[0] if "." in m.module else ""
                if scope not in out.attention:
                    out.attention.append(scope)
    for scope in out.attention:
        att = mods.get(scope)
        n = next((getattr(att, a) for a in tpi.HEAD_ATTRS if isinstance(getattr(att, a, None), int)), None) \
            or heads[0]
        for name, sub in (att.named_children() if att is not None else ()):
            if isinstance(sub, nn.Embedding) and n and sub.embedding_dim == n:
                out.styles[f"{scope}.{name}" if scope else name] = "heads"
    return out


def apply_tp(model: nn.Module, blocks: list[str], built: Built, tp_mesh: Any, tp: int, notes: list[str]) -> int:
    """Split ``blocks`` (paths in ``model``) by tensor parallel; returns how many blocks were split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshplan.ingest import tp as tpi
    split = 0
    seen_notes: set[str] = set()
    for path in blocks:
        block = _resolve(model, path)
        plan = tp_plan(block, built.heads)
        for k in plan.kept:
            key = k.split(":", 1)[-1]
            if key not in seen_notes:
                seen_notes.add(key)
                notes.append(f"tp: {k}")
        if not plan.styles:
            continue
        if plan.tp_max % tp:
            raise MeshplanError(f"plan: tp={tp} does not divide {path}'s heads/width (tp_max={plan.tp_max})",
                                hint="use a tp that divides the attention heads")
        for scope in plan.attention:
            att = _resolve(block, scope)
            for a in (*tpi.HEAD_ATTRS, *tpi.KV_ATTRS, *SIZE_ATTRS):
                v = getattr(att, a, None)
                if isinstance(v, int) and not isinstance(v, bool):
                    if v % tp:
                        raise MeshplanError(f"plan: tp={tp} does not divide {path}.{scope}.{a}={v}")
                    setattr(att, a, v // tp)
        styles = {p: RowwiseParallel() if s == "row" else ColwiseParallel() for p, s in plan.styles.items()}
        parallelize_module(block, tp_mesh, styles)
        split += 1
    return split


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


# ---- recompute, data parallel -------------------------------------------------------------------
def apply_ac(model: nn.Module, blocks: list[str], plan: Plan) -> list[str]:
    """checkpoint_wrapper around blocks (paths in ``model``, in order); returns the paths wrapped."""
    if plan.recompute != "full":
        return []
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    n = len(blocks) if plan.recompute_layers is None else min(plan.recompute_layers, len(blocks))
    for path in blocks[:n]:
        parent, _, leaf = path.rpartition(".")
        holder = _resolve(model, parent)
        wrapped = checkpoint_wrapper(_resolve(model, path), preserve_rng_state=False)
        if isinstance(holder, (nn.ModuleList, nn.Sequential)) and leaf.isdigit():
            holder[int(leaf)] = wrapped
        elif isinstance(holder, nn.ModuleDict):
            holder[leaf] = wrapped
        else:
            setattr(holder, leaf, wrapped)
    return blocks[:n]


def apply_fsdp(parts: list[nn.Module], blocks: list[list[str]], plan: Plan, mesh: RuntimeMesh,
               device: torch.device) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    dtype = DTYPES[plan.precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
        else MixedPrecisionPolicy()
    offload = device.type != "cpu" and (plan.offload_params or plan.offload_optimizer)
    kw = {"reshard_after_forward": plan.zero == 3 and plan.pp == 1, "mp_policy": mp,
          "offload_policy": CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()}
    dp_mesh = mesh.fsdp_mesh()
    for part, paths in zip(parts, blocks):
        for path in paths:
            m = _resolve(part, path)
            if next(m.parameters(), None) is not None:
                fully_shard(m, mesh=dp_mesh, **kw)
        fully_shard(part, mesh=dp_mesh, **kw)


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
    routed = next((n for n, m in built.module.named_modules() if moe._is_list(m)), None)
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


def _has_dtensor(parts: list[nn.Module]) -> bool:
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for part in parts for p in part.parameters())


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


# ---- the whole ----------------------------------------------------------------------------------
@dataclass
class GenericParallel(Parallelized):
    """Parallelized for an ingested model: whether this rank holds the first / last pipeline stage
    is set when splitting (the chunks are StageModules, not Transformers)."""

    has_first: bool = True  # type: ignore[assignment]
    has_last: bool = True  # type: ignore[assignment]


def parallelize_generic(built: Built, plan: Plan, mesh: RuntimeMesh | None, device: torch.device, *,
                        microbatches: int) -> GenericParallel:
    """Apply ``plan`` to ``built.module`` (the full model, the same weights on every rank)."""
    why = plan_refusal(plan)
    if why:
        raise MeshplanError(why)
    notes = plan_notes(plan, device)
    model = built.module
    units, blocks = unit_paths(model)
    autocast = None if plan.precision == "fp32" else DTYPES[plan.precision]
    if mesh is None or plan.num_gpus == 1:
        apply_ac(model, blocks, plan)
        return GenericParallel(parts=[model], run_modules=[model], autocast=autocast, notes=notes)
    stage_ids = [0]
    parts: list[nn.Module] = [model]
    part_blocks = [blocks]
    sample = make_batch(built, 1, 0)
    if plan.pp > 1:
        why = pp_refusal(built, units)
        if why:
            raise MeshplanError(why)
        order = execution_order(model, units, sample)
        if len({id(u) for u in order}) != len(order):
            twice = next(u.name for i, u in enumerate(order) if any(v is u for v in order[:i]))
            raise MeshplanError(f"pp>1: {built.name} calls unit {twice} more than once; use pp=1")
        bounds = chunk_bounds(len(order), plan)
        check_sequence(built, order, bounds, sample)
        names = [u.name for u in order]
        stage_ids = stage_ids_for_rank(mesh.pp_rank, plan)
        template = make_batch(built, 2, 0)  # 2 rows: tells the batch dimension from constant size-1 ones
        parts, part_blocks = [], []
        for k, s in enumerate(stage_ids):
            m = model if k == len(stage_ids) - 1 else copy.deepcopy(model)
            start, end = bounds[s]
            stage = StageModule(m, built, names, start, end, template)
            parts.append(stage)
            part_blocks.append([_PREFIX + p for p in names[start:end] if p in blocks])
    if plan.tp > 1:
        ref = _compare_output(model, sample) if plan.pp == 1 else None
        n = 0
        for part, paths in zip(parts, part_blocks):
            n += apply_tp(part, paths, built, mesh.sub("tp"), plan.tp, notes)
        if n == 0 and any(part_blocks):
            raise MeshplanError(f"plan: tp={plan.tp} but no block of {built.name} has attention/MLP matrices this "
                                "runtime can split (nn.Linear q/k/v/o, gate/up/down, fc1/fc2 ...)",
                                hint="use tp=1 for this model")
        if ref is not None:
            got = _compare_output(model, sample)
            err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
            if err > 1e-4:
                raise MeshplanError(f"plan: tp={plan.tp} changes {built.name}'s output (relative error {err:.1e}): "
                                    "its attention reshapes with a head count this runtime does not adjust",
                                    hint="use tp=1 for this model")
    for part, paths in zip(parts, part_blocks):
        apply_ac(part, paths, plan)  # the wrapper takes the block's place: same paths
    dp_mode, run = "none", parts
    if mesh.ndp > 1:
        if plan.zero > 0:
            apply_fsdp(parts, part_blocks, plan, mesh, device)
            dp_mode = "fsdp"
        elif _has_dtensor(parts) or plan.pp > 1:
            dp_mode = "manual"
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            from meshplan.runtime.parallelize import ddp_no_buffer_sync  # forward_sync_buffers on torch >= 2.13
            why = unused_parameters(built)
            if why:
                notes.append(f"DDP with find_unused_parameters=True: {why}")
            run = [DDP(p, process_group=mesh.dp_group, find_unused_parameters=why is not None, **ddp_no_buffer_sync())
                   for p in parts]
            dp_mode = "ddp"
    if dp_mode == "fsdp":
        autocast = None
    out = GenericParallel(parts=parts, run_modules=run, stage_ids=stage_ids, dp_mode=dp_mode, autocast=autocast,
                          notes=notes, zero=plan.zero)
    if plan.pp > 1:
        for st in parts:
            assert isinstance(st, StageModule)
            stage_hooks(st.inner, st.order, st.start, st.end, st)
        out.has_first = any(st.first for st in parts)  # type: ignore[attr-defined]
        out.has_last = any(st.last for st in parts)  # type: ignore[attr-defined]
        out.schedule = build_schedule(parts, stage_ids, plan, mesh, device, microbatches, built)
    return out


def pp_loss(built: Built) -> Any:
    """The schedule's loss(output, target): ``built.loss_fn`` on a Batch of the micro-batch's target
    (a module: source's own loss gets it as its inputs)."""
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return built.loss_fn(out, Batch(targets=target, raw=target))
    return loss


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


def build_schedule(parts: list[nn.Module], stage_ids: list[int], plan: Plan, mesh: RuntimeMesh,
                   device: torch.device, microbatches: int, built: Built) -> Any:
    from torch.distributed import pipelining

    from meshplan.runtime.parallelize import SCHEDULES
    num = plan.pp * plan.virtual_stages
    stages = [pipelining.PipelineStage(m, s, num, device, group=mesh.pp_group) for m, s in zip(parts, stage_ids)]
    name = SCHEDULES[plan.schedule]
    if plan.schedule in ("gpipe", "1f1b") and len(stages) > 1:
        name = "ScheduleInterleaved1F1B" if plan.schedule == "1f1b" else "ScheduleLoopedBFS"
    cls = getattr(pipelining, name)
    if name in ("ScheduleGPipe", "Schedule1F1B"):
        return cls(stages[0], n_microbatches=microbatches, loss_fn=pp_loss(built))
    if microbatches < plan.pp and name != "ScheduleLoopedBFS":
        raise MeshplanError(f"plan: schedule={plan.schedule} needs at least pp={plan.pp} micro-batches per step, "
                            f"got {microbatches}", hint="raise --global-batch or lower micro_batch")
    return cls(stages, n_microbatches=microbatches, loss_fn=pp_loss(built))


def clean_name(name: str) -> str:
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(junk, "")
    if name.startswith("module."):
        name = name[len("module."):]
    return name[len(_PREFIX):] if name.startswith(_PREFIX) else name


# ---- training -----------------------------------------------------------------------------------
ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class GenericTrainer:
    """Model, optimizer and data of one rank (or of the single-process reference)."""

    def __init__(self, cfg: GenericConfig, mesh: RuntimeMesh | None, device: torch.device) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.n_micro = microbatches(cfg.plan, cfg.global_batch)
        torch.manual_seed(cfg.seed)
        self.built = build(cfg.source, device=str(device), seq_len=cfg.seq_len)
        self.par = parallelize_generic(self.built, cfg.plan, mesh, device, microbatches=self.n_micro)
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=cfg.lr, **ADAMW) for p in self.par.parts]
        self.step = 0
        self.grad_norm: torch.Tensor | None = None

    @property
    def sample_tokens(self) -> int:
        return self.built.sample_tokens

    def _rows(self) -> Batch:
        c = self.cfg
        b = make_batch(self.built, c.global_batch, c.seed * 1_000_003 + self.step)
        dp_rank, dp = (self.mesh.dp_rank, self.mesh.dp) if self.mesh else (0, 1)
        per = c.global_batch // dp
        return take(b, dp_rank * per, (dp_rank + 1) * per, c.global_batch)

    def _autocast(self) -> Any:
        dt = self.par.autocast
        return torch.autocast(self.device.type, dtype=dt) if dt is not None else contextlib.nullcontext()

    def _forward_backward(self, b: Batch) -> torch.Tensor:
        n = self.cfg.global_batch // (self.mesh.dp if self.mesh else 1)
        if self.par.schedule is not None:
            losses: list[torch.Tensor] = []
            kwargs: dict[str, Any] = {}
            if self.par.has_last:
                kwargs = {"target": pp_target(self.built, b), "losses": losses}
            first = next((p for p in self.par.parts if p.first), None)  # type: ignore[attr-defined]
            args = first.tensors(b) if first is not None else []
            with self._autocast():
                self.par.schedule.step(*args, **kwargs)
            return torch.stack(losses).mean().detach() if losses else torch.zeros((), device=self.device)
        module = self.par.run_modules[0]
        total = torch.zeros((), device=self.device)
        mb = n // self.n_micro
        for i in range(self.n_micro):
            part = take(b, i * mb, (i + 1) * mb, n)
            # DDP: no_sync but on the last; FSDP: the ZeRO level's gather/reduce flags (parallelize.py)
            with self.par.micro_batch(last=i == self.n_micro - 1):
                with self._autocast():
                    loss = self.built.loss_fn(module(*part.args, **part.kwargs), part) / self.n_micro
                loss.backward()
            total += loss.detach()
        return total

    def _manual_dp_sync(self) -> None:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        mesh = self.mesh
        assert mesh is not None
        grads = []
        for part in self.par.parts:
            for p in part.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad.to_local() if _is_dtensor(p.grad) else p.grad)
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=mesh.dp_group)
        flat /= mesh.ndp
        for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(r)

    def _clip(self) -> torch.Tensor:
        """Global gradient norm (per mesh and placements, summed over the sharded dims and the
        pipeline ranks), then clip_grads_with_norm_ (as the transformer runtime)."""
        params: list[torch.Tensor] = []
        groups: dict[Any, list[torch.Tensor]] = {}
        for part in self.par.parts:
            for p in part.parameters():
                if p.grad is None:
                    continue
                params.append(p)
                g = p.grad
                key = (g.device_mesh, g.placements) if _is_dtensor(g) else None
                groups.setdefault(key, []).append(g.to_local() if _is_dtensor(g) else g)
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for key, grads in groups.items():
            sq = torch.nn.utils.get_total_norm(grads, foreach=False).to(self.device, torch.float32) ** 2
            if key is not None:
                dmesh, placements = key
                for dim, pl in enumerate(placements):
                    if not pl.is_replicate():
                        dist.all_reduce(sq, group=dmesh.get_group(dim))
            total += sq
        if self.mesh is not None and self.mesh.pp > 1:
            dist.all_reduce(total, group=self.mesh.pp_group)
        norm = total.sqrt()
        if self.cfg.grad_clip > 0 and params:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, norm, foreach=False)
        return norm

    def _global_loss(self, local: torch.Tensor) -> float:
        if self.mesh is None:
            return float(local)
        t = local.detach().float().clone()
        if self.mesh.pp > 1:
            dist.all_reduce(t, group=self.mesh.pp_group)
        if self.mesh.ndp > 1:
            dist.all_reduce(t, group=self.mesh.dp_group)
            t /= self.mesh.ndp
        return float(t)

    def train_step(self) -> float:
        """One optimizer step on global batch number ``self.step``; returns the global loss."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        local = self._forward_backward(self._rows())
        if self.par.dp_mode == "manual":
            self._manual_dp_sync()
        self.grad_norm = self._clip()
        for opt in self.optimizers:
            opt.step()
        self.step += 1
        return self._global_loss(local)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters this rank's stages hold, by clean name (collective over dp/tp)."""
        out: dict[str, torch.Tensor] = {}
        for part in self.par.parts:
            for name, p in part.named_parameters():
                t = p.full_tensor() if _is_dtensor(p) else p
                out[clean_name(name)] = t.detach().float().cpu().clone()
        return out


def reference_run(cfg: GenericConfig, steps: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The single-process run on the whole global batch: losses, gradient norms, final weights."""
    plan = Plan(micro_batch=cfg.global_batch, precision=cfg.plan.precision)
    t = GenericTrainer(GenericConfig(**{**cfg.__dict__, "plan": plan}), None, torch.device("cpu"))
    losses, norms = [], []
    for _ in range(steps):
        losses.append(t.train_step())
        norms.append(float(t.grad_norm))  # type: ignore[arg-type]
    return losses, norms, t.full_weights()


# ---- `meshplan train` ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class GenericJob:
    """`meshplan train` on an ingested model (the launcher's and every rank's view)."""

    source: str
    plan: Plan
    global_batch: int
    steps: int
    seq_len: int | None
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    metrics: str | None = None
    lr: float = 1e-3
    seed: int = 0
    pg_timeout_s: float = 300.0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def config(self) -> GenericConfig:
        return GenericConfig(source=self.source, plan=self.plan, global_batch=self.global_batch, steps=self.steps,
                             seq_len=self.seq_len, lr=self.lr, seed=self.seed)


def check_job(job: GenericJob) -> Any:
    """Bad input, caught once, in the launcher, before any process starts: learning rate, --metrics,
    the plan's process count and what the runtime runs, then the model built on the meta device (its
    config, --seq-len against its positions: ingest.hf.check_seq_len), pipeline and TP structure, the
    planner's constraints on the traced LayerGraph (preflight.check_graph_plan: stages against the
    layers, schedule, hybrid sharding, offload, zero=2 under a pipeline ...) and last the memory
    pre-flight check on it (``check_memory``). Returns the memory estimate
    (preflight.MemoryEstimate; None: not priced or not traceable)."""
    return preflight_job(job)[0]


def preflight_job(job: GenericJob) -> tuple[Any, Any]:
    """``check_job``; returns (the memory estimate, the LayerGraph traced on the meta device or None
    where the model cannot be traced there)."""
    from meshplan.runtime import preflight
    preflight.check_lr(job.lr)
    preflight.check_output_file("--metrics", job.metrics)
    plan = job.plan
    if plan.num_gpus != job.world_size:
        raise MeshplanError(f"plan needs {plan.num_gpus} processes (tp={plan.tp} x pp={plan.pp} x dp={plan.dp} x "
                            f"cp={plan.cp}) but {job.world_size} would be started",
                            hint=f"use --nproc-per-node {plan.num_gpus} (x --nnodes) or change the plan")
    why = plan_refusal(plan)
    if why:
        raise MeshplanError(why)
    microbatches(plan, job.global_batch)
    if plan.zero and plan.shard_group and (plan.dp * plan.cp) % plan.effective_shard:
        raise MeshplanError(f"plan: shard_group={plan.shard_group} does not divide dp={plan.dp}")
    built = build(job.source, device="meta", seq_len=job.seq_len)
    units, blocks = unit_paths(built.module)
    if plan.pp > 1:
        why = pp_refusal(built, units)
        if why:
            raise MeshplanError(why)
    if plan.tp > 1:
        plans = [tp_plan(_resolve(built.module, p), built.heads) for p in blocks]
        if not any(p.styles for p in plans):
            raise MeshplanError(f"plan: tp={plan.tp} but no block of {built.name} has attention/MLP matrices this "
                                "runtime can split (nn.Linear q/k/v/o, gate/up/down, fc1/fc2 ...)",
                                hint="use tp=1 for this model")
        bad = next((p for p in plans if p.styles and p.tp_max % plan.tp), None)
        if bad is not None:
            raise MeshplanError(f"plan: tp={plan.tp} does not divide the model's attention heads / widths "
                                f"(tp_max={bad.tp_max})", hint="use a tp that divides it")
    graph = trace(built)
    preflight.check_graph_plan(graph, plan, job.global_batch)  # the planner's constraints (the plan's alone untraced)
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


def process_gib(job: GenericJob) -> float:
    """Host memory of one idle rank of this job (preflight: hf: ranks import transformers)."""
    from meshplan.ingest.source import parse_source
    from meshplan.runtime import preflight
    return preflight.HF_PROCESS_GIB if parse_source(job.source).kind == "hf" else preflight.CPU_PROCESS_GIB


def check_memory(job: GenericJob, built: Built, graph: Any) -> Any:
    """preflight.check_graph_memory for this job on this machine: the graph cost model on ``graph``
    (``built``, a meta model, traced at the run's sequence length), against host memory (every
    process of the node counted) or device 0's memory."""
    from meshplan.ingest import ingest
    from meshplan.runtime import preflight
    kw: dict[str, Any] = {"nproc_per_node": job.nproc_per_node, "nnodes": job.nnodes, "name": built.name,
                          "seq_len": built.seq_len, "process_gib": process_gib(job),
                          "retrace": lambda s: ingest(job.source, seq_len=s)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return preflight.check_graph_memory(graph, job.plan, job.global_batch, device_type="cuda",
                                            available_gib=props.total_memory / 2**30, device_name=props.name, **kw)
    return preflight.check_graph_memory(graph, job.plan, job.global_batch, device_type="cpu", **kw)


def estimate_for(job: GenericJob, device_type: str, graph: Any = None) -> dict[str, Any]:
    """The graph cost model's prediction of this run on this machine (see launch.local_cluster), on
    ``graph`` (the LayerGraph at the run's sequence length; traced here when None). On CPU the peak
    memory is the pre-flight check's CPU-corrected figure (launch.cpu_memory)."""
    from meshplan.cost.graph import estimate_graph, graph_workload
    from meshplan.ingest import ingest
    from meshplan.runtime.launch import local_cluster
    try:
        if graph is None:
            graph = ingest(job.source, seq_len=job.seq_len)
        cluster = local_cluster(job.world_size, device_type)
        r = estimate_graph(graph, cluster, job.plan, graph_workload(graph, job.global_batch))
    except MeshplanError as e:
        return {"error": str(e)}
    from meshplan.runtime.launch import cpu_memory, estimate_basis
    out = {"cluster": cluster.name, "basis": estimate_basis(cluster.name), "step_time_s": r.step_time_s,
           "peak_memory_gib": r.peak_memory_gib, "tokens_per_s": r.tokens_per_s,
           "activations_gib": r.memory.get("activations")}
    if device_type != "cuda":
        from meshplan.runtime.preflight import graph_memory_estimate
        return cpu_memory(out, graph_memory_estimate(graph, job.plan, job.global_batch, "cpu", process_gib(job)))
    return out


def launch(job: GenericJob, worker_argv: list[str]) -> int:
    """Run the job: in this process for one process, else under torchrun."""
    from meshplan.runtime.launch import before_launch, memory_context, run_torchrun, this_device_type, torchrun_argv
    est, graph = preflight_job(job)
    dev = this_device_type()
    before_launch(job, estimate_for(job, dev, graph) if graph is not None else None, dev, job.steps)
    if job.world_size == 1:
        return worker_main(job)
    return run_torchrun(torchrun_argv(job, worker_argv), job.pg_timeout_s,  # type: ignore[arg-type]
                        memory=memory_context(job, est))


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


def worker_main(job: GenericJob) -> int:
    """Train on this rank (or alone), log each step, print the estimate beside the measurement."""
    quiet_false_positives()
    from meshplan.runtime.launch import _write, in_torchrun, measured_summary, summary_text
    from meshplan.runtime.mesh import build_mesh
    from meshplan.runtime.train import StepRecord, init_distributed, max_over_ranks, maybe_fail, peak_memory_gib
    if in_torchrun():
        device = init_distributed(float(os.environ.get("MESHPLAN_PG_TIMEOUT", job.pg_timeout_s)))
        if dist.get_world_size() != job.plan.num_gpus:
            raise MeshplanError(f"plan needs {job.plan.num_gpus} processes but {dist.get_world_size()} were started")
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    mesh = build_mesh(job.plan, device.type) if dist.is_initialized() and dist.get_world_size() > 1 else None
    trainer = GenericTrainer(job.config(), mesh, device)
    if rank0:
        for note in trainer.par.notes:
            print(f"meshplan: note: {note}", file=sys.stderr, flush=True)
    tokens = job.global_batch * trainer.sample_tokens
    records = []
    while trainer.step < job.steps:
        maybe_fail(trainer.step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = trainer.train_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = max_over_ranks(time.perf_counter() - t0, device)
        mem = max_over_ranks(peak_memory_gib(device), device)
        rec = StepRecord(step=trainer.step, loss=loss, step_time_s=dt, tokens_per_s=tokens / dt, peak_memory_gib=mem)
        records.append(rec)
        if rank0:
            print(f"step {rec.step:>5}/{job.steps}  loss {rec.loss:.6f}  {rec.step_time_s:.4f} s  "
                  f"{rec.tokens_per_s:,.0f} tok/s  {rec.peak_memory_gib:.3f} GiB", file=sys.stderr, flush=True)
            _write(job.metrics, rec.to_dict())
    measured = measured_summary(records, tokens)
    if rank0:
        est = estimate_for(job, device.type)
        print(summary_text(measured, est), flush=True)
        _write(job.metrics, {"kind": "summary", "plan": job.plan.short(), "model": job.source,
                             "world_size": job.world_size, "sample_tokens": trainer.sample_tokens,
                             "measured": measured, "estimate": est, "notes": trainer.par.notes})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def search_space(source: str, *, seq_len: int | None = None, base: Plan | None = None) -> Any:
    """A ``search.graph.GraphSpace`` holding only what this runtime runs on ``source``: pp=1 when the
    model cannot be pipeline-split (pp_refusal), tp=1 when no block has matrices it can split."""
    from meshplan.search.graph import GraphSpace
    built = build(source, device="meta", seq_len=seq_len)
    units, blocks = unit_paths(built.module)
    pp = (1,) if pp_refusal(built, units) else None
    splittable = any(tp_plan(_resolve(built.module, p), built.heads).styles for p in blocks)
    return GraphSpace(base=base or Plan(), pp=pp, tp=None if splittable else (1,))
