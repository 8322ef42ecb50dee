"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint directory holds ``step-NNNNNNNN/`` DCP folders, ``meta.json`` (model, plan, last
step; written by rank 0 after a save completes) and nothing else. The same for every model: a
preset (``model`` in meta.json is its ModelSpec) or an ingested one (``{"name", "source"}``: its
``hf:``/``module:`` source); the model's own part is ``train.TrainModel.logical`` (names and values
of its tensors in the single-process model). State is keyed by clean
parameter names (no wrapper prefixes) with a flattened optimizer state, so DCP reshards it on
load: a run saved under one plan resumes under another (other world size, TP, PP, FSDP).
Saved: model, optimizer, data position (the step: batches are a pure function of it) and the
torch RNG state of rank 0 (restored on every rank; ranks are seeded alike).

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
  their zeros. So a run resumes under any tp (any padding), pp and data parallelism.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshplan.errors import MeshplanError
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
    from meshplan.runtime.parallelize import VOCAB_PARAMS
    from meshplan.runtime.train import clean_fqn
    vocab = model.vocab_rows
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
        out.append((key, prefix + name + suffix, value))
    return out


def _rows_below(value: torch.Tensor, rows: int) -> torch.Tensor:
    """A stand-in for ``value`` (a tensor or DTensor whose dim 0 is padded past ``rows``) that DCP
    saves and loads as the [rows, ...] tensor: this rank's shard cut at ``rows``, a view of the
    same memory (loading writes into ``value``). DCP's protocol for objects that place their own
    chunks (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, the
    global ``size()``), set on an alias of the view; ``_original`` is ``value``."""
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
                               f"padded vocabulary tensor {list(value.shape)}")
        start = offset[0]
    else:
        local, start = value, 0
    keep = max(0, min(local.shape[0], rows - start))
    view = local[:keep]
    size = torch.Size([rows, *value.shape[1:]])
    offsets = torch.Size([start, *([0] * (value.dim() - 1))])
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


def _entries(trainer: Any) -> list[tuple[list[Entry], list[Entry]]]:
    """Per part: (model entries, optimizer entries) under their checkpoint keys."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    m = trainer.model
    return [(_logical(m, part, get_model_state_dict(part, options=_options()), False),
             _logical(m, part, get_optimizer_state_dict(part, opt, options=_options()), True))
            for part, opt in zip(trainer.par.parts, trainer.optimizers)]


def _state(trainer: Any, entries: list[tuple[list[Entry], list[Entry]]] | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for m, o in entries if entries is not None else _entries(trainer):
        model.update({logical: value for _, logical, value in m})  # a tied copy under zbv: one of
        optim.update({logical: value for _, logical, value in o})  # the two ends (equal), loaded into both
    extra = {"step": torch.tensor(trainer.step), "rng": torch.get_rng_state()}
    return {"model": model, "optim": optim, "extra": extra}


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
    _init_optimizer_state(trainer)
    entries = _entries(trainer)
    state = _state(trainer, entries)
    dcp.load(state, checkpoint_id=str(Path(directory) / meta.get("path", f"step-{step:08d}")))
    for part, opt, (m, o) in zip(trainer.par.parts, trainer.optimizers, entries):
        set_model_state_dict(part, _part_state(m, state["model"]), options=_options().__class__(strict=False))
        set_optimizer_state_dict(part, opt, _part_state(o, state["optim"]), options=_options())
    trainer.step = int(state["extra"]["step"])
    torch.set_rng_state(state["extra"]["rng"])
    return trainer.step
