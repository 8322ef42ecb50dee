"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint directory holds ``step-NNNNNNNN/`` DCP folders, ``meta.json`` (model, plan, last
step; written by rank 0 after a save completes) and nothing else. The same for every model: a
preset (``model`` in meta.json is its ModelSpec) or an ingested one (``{"name", "source"}``: its
``hf:``/``module:`` source); the model's own part is ``run_config.TrainModel.logical`` (names and values
of its tensors in the single-process model). State is keyed by clean
parameter names (no wrapper prefixes) with a flattened optimizer state, so DCP reshards it on
load: a run saved under one plan resumes under another (other world size, TP, PP, FSDP).
Saved: model, optimizer, data position (the step: batches are a pure function of it) and the
torch RNG state of rank 0 (restored on every rank; ranks are seeded alike).

Periodic plans (grad_sync=local-sgd/diloco, runtime/periodic.py): every inner group trains its own
model between outer syncs, so the model and (inner) optimizer are saved once per inner group, under
``worker<g>/<name>`` (``state.worker<g>/<name>.exp_avg`` ...); the outer state once, under
``outer``: the fp32 anchor (``anchor/<name>``: diloco, or local-sgd with compression) and the outer
Nesterov momentum (``momentum/<name>``: diloco), as DTensors shaped like the parameters (FSDP2/TP
shards), and in ``extra`` the step of the last outer sync (``last_sync``: the position in the outer
period). meta.json records ``outer`` = {grad_sync, workers, sync_every, anchor}. An overlapped sync
(sync_overlap = tau) in flight at a save is waited for, and saved as it will be applied: the anchor
and momentum it made, and the correction new anchor - the parameters at its launch
(``correction/worker<g>/<name>``: each inner group's own, placed like its parameters); meta.json's ``outer`` then says
``in_flight``: its step (= last_sync). A resume adds the correction after inner step in_flight + tau,
as the uninterrupted run does (at once if the resumed plan's tau is already past). Such a checkpoint
resumes under a plan with the same grad_sync, the same number of inner groups and the same anchor
(any inner parallelism, sync_every, sync_scope giving that count); a synchronous checkpoint resumes
under a periodic plan too (every inner group from the one model; anchor = it, momentum 0, the
period starting at the checkpoint's step), not the other way round.

The checkpoint holds the single-process model's logical tensors, whatever the plan:

- tied embeddings are one tensor, ``embed.tok.weight`` (and its AdamW state): under a pipeline
  the last stage's output copy is saved and loaded under that name (both ends write the same
  shards, which DCP deduplicates; under zbv rank 0 loads it into both of its parts), and with
  pp = 1 the tied ``output.weight`` alias is not saved (loaded through the embedding);
- a pipeline stage of an ingested model saves its parameters under their names in the whole
  model (no ``inner.`` prefix) and only the parameters and buffers of its own units (the others are
  stripped from the stage);
- a vocabulary padded for tp (``Transformer.pad_vocab``) is saved unpadded: each rank writes the
  rows of its shard below ``vocab_size`` (a shard of padding only writes nothing) as chunks of
  the [vocab_size, hidden] tensor, and reads them back the same way, the padded rows keeping
  their zeros. So a run resumes under any tp (any padding), pp and data parallelism;
- an ingested model's fused experts under expert parallelism (``TrainModel.expert_rows``: an ep
  rank holds rows [first, first + E/ep) of each [E, ...] expert parameter, FSDP-sharded or not) are
  saved the same way: each rank writes its rows, and their AdamW state, as chunks of the [E, ...]
  tensor at their offset (ranks holding the same rows, the expert's replicas, write the same chunk,
  which DCP deduplicates), and reads its rows back from whatever chunks the checkpoint holds. So a
  checkpoint saved under ep = 2 resumes under ep = 1, another ep, or one process, and back.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshplan.errors import MeshplanError
from meshplan.runtime.parallelize import VOCAB_PARAMS
from meshplan.runtime.train import clean_fqn
from meshplan.spec.base import to_dict

META = "meta.json"


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=True)


Entry = tuple[str, str, Any]
"""(key in the part's state dict, key in the checkpoint, the part's own value)."""


def _param_of(key: str, optim: bool) -> tuple[str, str, str]:
    """(prefix, parameter name, suffix) of a state-dict key: model keys are parameter names;
    flattened optimizer keys are ``state.<param>.<name>`` / ``param_groups.<param>.<name>``."""
    if not optim:
        return "", key, ""
    prefix, rest = key.split(".", 1)
    param, _, suffix = rest.rpartition(".")
    return prefix + ".", param, "." + suffix


def _logical(model: Any, part: Any, sd: dict[str, Any], optim: bool) -> list[Entry]:
    """The entries of one part's state dict under their checkpoint keys (see the module doc);
    ``model``: the trainer's TrainModel."""
    vocab = model.vocab_rows
    experts = model.expert_rows
    out = []
    for key, value in sd.items():
        prefix, param, suffix = _param_of(key, optim)
        param = clean_fqn(param)
        name, value = model.logical(part, param, value)
        if name is None:  # an alias (pp = 1 tied output.weight: the embedding)
            continue
        if vocab is not None and param in VOCAB_PARAMS and isinstance(value, torch.Tensor) and value.dim() >= 1 \
                and value.shape[0] > vocab:
            value = _rows_below(value, vocab)
        elif param in experts and isinstance(value, torch.Tensor) and value.dim() >= 1:
            rows, first = experts[param]  # this ep rank's rows [first, first + local) of the [rows, ...] tensor
            value = _rows_below(value, value.shape[0], rows=rows, first=first)
        out.append((key, prefix + name + suffix, value))
    return out


def _rows_below(value: torch.Tensor, keep_rows: int, *, rows: int | None = None, first: int = 0) -> torch.Tensor:
    """A stand-in for ``value`` (a tensor or DTensor) that DCP saves and loads as a chunk of the
    [rows, ...] tensor, ``value``'s dim 0 placed at row ``first`` of it and cut at ``keep_rows`` (a
    vocabulary padded past ``keep_rows`` = rows; an ep rank's fused experts: rows ``first`` ... of
    all the experts' ``rows``): this rank's shard, a view of the same memory (loading writes into
    ``value``). DCP's protocol for objects that place their own chunks (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``, the global ``size()``), set on an alias of
    the view; ``_original`` is ``value``."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor import DTensor
    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        local = value.to_local()
        if list(local.shape) != list(shape) or any(offset[1:]):
            raise RuntimeError(f"checkpoint: unexpected shard {list(local.shape)} at {list(offset)} of a "
                               f"row-placed tensor {list(value.shape)}")
        start = offset[0]
    else:
        local, start = value, 0
    keep = max(0, min(local.shape[0], keep_rows - start))
    view = local[:keep]
    size = torch.Size([keep_rows if rows is None else rows, *value.shape[1:]])
    offsets = torch.Size([first + start, *([0] * (value.dim() - 1))])
    chunk = ChunkStorageMetadata(offsets=offsets, sizes=view.shape)

    def write_items(fqn: str, obj: Any) -> list[Any]:
        if keep == 0:
            return []
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(view),
                                                      size=size))]
    shell = view.view(view.shape)
    shell.__create_write_items__ = write_items  # type: ignore[attr-defined]
    shell.__create_chunk_list__ = lambda: [chunk] if keep else []  # type: ignore[attr-defined]
    shell.__get_tensor_shard__ = lambda index: view  # type: ignore[attr-defined]
    shell.size = lambda *dim: size if not dim else size[dim[0]]  # type: ignore[method-assign]
    shell._original = value  # type: ignore[attr-defined]
    return shell


def _worker_key(logical: str, worker: int, optim: bool) -> str:
    """``logical`` under inner group ``worker``'s prefix: ``worker<g>/<name>``, or for optimizer keys
    ``state.worker<g>/<name>.<state>``."""
    if not optim:
        return f"worker{worker}/{logical}"
    prefix, rest = logical.split(".", 1)
    return f"{prefix}.worker{worker}/{rest}"


def _entries(trainer: Any, per_worker: bool = False) -> list[tuple[list[Entry], list[Entry]]]:
    """Per part: (model entries, optimizer entries) under their checkpoint keys (``per_worker``:
    under this rank's inner group's prefix, ``_worker_key``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    m = trainer.model
    out = [(_logical(m, part, get_model_state_dict(part, options=_options()), False),
            _logical(m, part, get_optimizer_state_dict(part, opt, options=_options()), True))
           for part, opt in zip(trainer.par.parts, trainer.optimizers)]
    if per_worker:
        g = trainer.mesh.worker
        out = [([(k, _worker_key(lg, g, False), v) for k, lg, v in me],
                [(k, _worker_key(lg, g, True), v) for k, lg, v in op]) for me, op in out]
    return out


OuterEntry = tuple[str, Any, torch.Tensor]
"""(key in the checkpoint's ``outer``, the value DCP saves and loads, this rank's own tensor)."""


def _outer_entries(trainer: Any) -> list[OuterEntry]:
    """The outer sync's anchor and momentum (periodic.OuterSync) under ``anchor/<name>`` and
    ``momentum/<name>`` (the same in every inner group: saved once), and with a sync in flight
    (sync_overlap) its correction, which is each inner group's own, under
    ``correction/worker<g>/<name>``: each as a DTensor placed like its parameter (its local shard is
    this rank's tensor), so DCP reshards it like the model."""
    outer = trainer.outer
    if outer is None:
        return []
    from torch.distributed.tensor import DTensor
    index = {id(p): i for i, p in enumerate(outer.params)}
    out: list[OuterEntry] = []
    pending = outer.snapshot if outer.launched is not None else None
    for kind, tensors in (("anchor", outer.anchor), ("momentum", outer.momentum), ("correction", pending)):
        if tensors is None:
            continue
        for part in trainer.par.parts:
            sd: dict[str, Any] = {}
            own: dict[str, torch.Tensor] = {}
            for name, p in part.named_parameters():
                t = tensors[index[id(p)]]
                sd[name] = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                              stride=p.stride()) if isinstance(p, DTensor) else t
                own[name] = t
            for key, logical, value in _logical(trainer.model, part, sd, False):
                if kind == "correction":  # new anchor - this group's parameters at the sync
                    logical = _worker_key(logical, trainer.mesh.worker, False)
                out.append((f"{kind}/{logical}", value, own[key]))
    return out


def _state(trainer: Any, entries: list[tuple[list[Entry], list[Entry]]] | None = None,
           outer: list[OuterEntry] | None = None) -> dict[str, Any]:
    if trainer.outer is not None:
        trainer.outer.wait()  # a sync in flight finished: its anchor, momentum and correction saved as they end
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for m, o in entries if entries is not None else _entries(trainer, per_worker=trainer.outer is not None):
        model.update({logical: value for _, logical, value in m})  # a tied copy under zbv: one of
        optim.update({logical: value for _, logical, value in o})  # the two ends (equal), loaded into both
    extra = {"step": torch.tensor(trainer.step), "rng": torch.get_rng_state()}
    state = {"model": model, "optim": optim, "extra": extra}
    if trainer.outer is not None:
        outer = _outer_entries(trainer) if outer is None else outer
        state["outer"] = {key: value for key, value, _ in outer}
        extra["last_sync"] = torch.tensor(trainer.outer.last_sync)
    return state


def outer_meta(trainer: Any) -> dict[str, Any] | None:
    """What meta.json records of a periodic run's outer sync (None: synchronous)."""
    o = trainer.outer
    if o is None:
        return None
    meta = {"grad_sync": o.method, "workers": o.workers, "sync_every": o.every, "anchor": o.anchor is not None}
    if o.launched is not None:  # a sync in flight (sync_overlap): launched at that step, not applied yet
        meta["in_flight"] = o.launched
    return meta


def check_outer(directory: str | Path, meta: dict[str, Any], plan: Any, workers: int) -> None:
    """Refuse (one line) resuming the checkpoint of ``meta`` under ``plan`` with ``workers`` inner
    groups when the state does not carry over (module doc): a periodic checkpoint under a
    synchronous plan, another grad_sync, number of inner groups or anchor."""
    saved = meta.get("outer")
    if not saved:
        return  # synchronous: resumes under any plan (periodic: every group from the one model)
    anchor = plan.grad_sync == "diloco" or plan.grad_compression != "none"
    mine = {"grad_sync": plan.grad_sync, "workers": workers if plan.periodic else 1, "anchor": anchor}
    theirs = {k: saved.get(k) for k in mine}
    if plan.periodic and mine == theirs:
        return
    what = f"grad_sync={saved.get('grad_sync')} with {saved.get('workers')} inner groups"
    if saved.get("grad_sync") == "local-sgd":
        what += " and an anchor (grad_compression)" if saved.get("anchor") else " and no anchor (grad_compression=none)"
    raise MeshplanError(f"--resume: the checkpoint in {directory} holds one model per inner group ({what}); this plan "
                        f"has {mine['workers']} group{'s' if mine['workers'] > 1 else ''} (grad_sync={plan.grad_sync})",
                        hint="resume it with the same grad_sync, number of inner groups (dp / inner dp) and "
                             "compression, or start a new run")


def _part_state(entries: list[Entry], loaded: dict[str, Any]) -> dict[str, Any]:
    """One part's state dict after a load: its own tensors, holding what was loaded (copied when
    the loaded one is another part's: the other end of a tie on the same rank)."""
    out = {}
    for key, logical, own in entries:
        got = loaded[logical]
        if not isinstance(own, torch.Tensor):
            out[key] = got
            continue
        own, got = getattr(own, "_original", own), getattr(got, "_original", got)
        if got is not own:
            with torch.no_grad():
                own.copy_(got)
        out[key] = own
    return out


def _init_optimizer_state(trainer: Any) -> None:
    """Give AdamW its state tensors (a zero-gradient step with lr=0) so DCP can load into them."""
    for part, opt in zip(trainer.par.parts, trainer.optimizers):
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
        lrs = [g["lr"] for g in opt.param_groups]
        wds = [g["weight_decay"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        opt.step()
        for g, lr, wd in zip(opt.param_groups, lrs, wds):
            g["lr"], g["weight_decay"] = lr, wd
        opt.zero_grad(set_to_none=True)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def read_meta(directory: str | Path) -> dict[str, Any] | None:
    p = Path(directory) / META
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise MeshplanError(f"checkpoint {directory}: cannot read {META}: {e}") from None


def identity(model: Any) -> dict[str, Any]:
    """What meta.json records of a run's model (RunConfig.model): a preset's ModelSpec, an ingested
    model's source."""
    if isinstance(model, str):
        return {"name": model, "source": model}
    return to_dict(model)


def check_resumable(directory: str | Path, model_spec: Any, steps: int | None = None) -> int:
    """The step to resume from, or a one-line MeshplanError (missing dir, other model, and with
    ``steps``, the run's --steps, a checkpoint already at or past them: nothing left to train).
    ``model_spec``: the run's model (a ModelSpec, or an ingested model's source)."""
    d = Path(directory)
    if not d.is_dir():
        raise MeshplanError(f"--resume: checkpoint directory {d} does not exist",
                            hint="give the --checkpoint-dir of an earlier run, or drop --resume")
    meta = read_meta(d)
    if meta is None:
        raise MeshplanError(f"--resume: {d} holds no meshplan checkpoint (no {META})",
                            hint="give the --checkpoint-dir of an earlier run")
    mine = identity(model_spec)
    theirs = meta.get("model", {})
    if theirs != mine:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise MeshplanError(f"--resume: checkpoint in {d} is of model {theirs.get('name')!r}, not "
                            f"{mine.get('name')!r} (differs in {', '.join(diff)})",
                            hint="resume with the model it was saved from, or use a new --checkpoint-dir")
    try:
        step = int(meta["step"])
    except (KeyError, TypeError, ValueError):
        raise MeshplanError(f"checkpoint {d}: {META} has no step", hint="use a new --checkpoint-dir") from None
    if steps is not None and steps <= step:
        asks = "fewer" if steps < step else "no more"
        raise MeshplanError(f"--resume: the checkpoint in {d} is at step {step}, --steps {steps} asks for {asks}",
                            hint=f"pass --steps > {step} (--steps counts all the steps, the resumed ones included)")
    return step


def save(trainer: Any, directory: str | Path) -> Path:
    """Save this rank's state (collective); rank 0 then records the step in meta.json."""
    import torch.distributed.checkpoint as dcp
    d = Path(directory)
    path = d / f"step-{trainer.step:08d}"
    if _rank0():
        d.mkdir(parents=True, exist_ok=True)
    dcp.save(_state(trainer), checkpoint_id=str(path))
    if dist.is_initialized():
        dist.barrier()
    if _rank0():
        meta = {"schema_version": 1, "model": identity(trainer.cfg.model), "plan": trainer.cfg.plan.short(),
                "step": trainer.step, "path": path.name}
        if outer_meta(trainer):
            meta["outer"] = outer_meta(trainer)
        tmp = d / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, d / META)  # atomic: a crash mid-save leaves the previous checkpoint in force
    if dist.is_initialized():
        dist.barrier()  # every rank returns with meta.json written (a load may follow at once)
    return path


def load(trainer: Any, directory: str | Path) -> int:
    """Load the latest checkpoint in ``directory`` into ``trainer`` (any plan); returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    step = check_resumable(directory, trainer.cfg.model)
    meta = read_meta(directory) or {}
    workers = trainer.mesh.workers if trainer.mesh is not None else 1
    check_outer(directory, meta, trainer.cfg.plan, workers)
    periodic = bool(meta.get("outer"))  # saved per inner group, with the outer state
    _init_optimizer_state(trainer)
    entries = _entries(trainer, per_worker=periodic)
    in_flight = (meta.get("outer") or {}).get("in_flight")
    if trainer.outer is not None and in_flight is not None:
        trainer.outer.expect_pending(int(in_flight))
    outer = _outer_entries(trainer) if periodic else []
    state = _state(trainer, entries, outer)
    if not periodic:
        state.pop("outer", None)
        state["extra"].pop("last_sync", None)
    dcp.load(state, checkpoint_id=str(Path(directory) / meta.get("path", f"step-{step:08d}")))
    for part, opt, (m, o) in zip(trainer.par.parts, trainer.optimizers, entries):
        set_model_state_dict(part, _part_state(m, state["model"]), options=_options().__class__(strict=False))
        set_optimizer_state_dict(part, opt, _part_state(o, state["optim"]), options=_options())
    trainer.step = int(state["extra"]["step"])
    torch.set_rng_state(state["extra"]["rng"])
    if trainer.outer is not None:
        if periodic:
            _load_outer(outer, state["outer"])
            trainer.outer.last_sync = int(state["extra"]["last_sync"])
            o = trainer.outer
            if o.launched is not None and trainer.step >= o.launched + o.overlap:
                o.apply()  # resumed under a smaller sync_overlap: its tau steps are done
        else:  # from a synchronous checkpoint: every inner group starts from its model
            trainer.outer.reset(trainer.step)
    return trainer.step


def _load_outer(entries: list[OuterEntry], loaded: dict[str, Any]) -> None:
    """The loaded anchor and momentum into the outer sync's own tensors (DCP loads in place into
    the DTensors' local shards, which are them; copied where not)."""
    from torch.distributed.tensor import DTensor
    for key, _, own in entries:
        got = getattr(loaded[key], "_original", loaded[key])
        got = got.to_local() if isinstance(got, DTensor) else got
        if got.data_ptr() != own.data_ptr() or got.shape != own.shape:
            with torch.no_grad():
                own.copy_(got)
