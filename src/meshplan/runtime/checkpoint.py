"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint directory holds ``step-NNNNNNNN/`` DCP folders, ``meta.json`` (model, plan, last
step; written by rank 0 after a save completes) and nothing else. State is keyed by clean
parameter names (no wrapper prefixes) with a flattened optimizer state, so DCP reshards it on
load: a run saved under one plan resumes under another (other world size, TP, PP, FSDP).
Saved: model, optimizer, data position (the step: batches are a pure function of it) and the
torch RNG state of rank 0 (restored on every rank; ranks are seeded alike).
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


def _state(trainer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for part, opt in zip(trainer.par.parts, trainer.optimizers):
        model.update(get_model_state_dict(part, options=_options()))
        optim.update(get_optimizer_state_dict(part, opt, options=_options()))
    extra = {"step": torch.tensor(trainer.step), "rng": torch.get_rng_state()}
    return {"model": model, "optim": optim, "extra": extra}


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


def check_resumable(directory: str | Path, model_spec: Any, steps: int | None = None) -> int:
    """The step to resume from, or a one-line MeshplanError (missing dir, other model, and with
    ``steps``, the run's --steps, a checkpoint already at or past them: nothing left to train)."""
    d = Path(directory)
    if not d.is_dir():
        raise MeshplanError(f"--resume: checkpoint directory {d} does not exist",
                            hint="give the --checkpoint-dir of an earlier run, or drop --resume")
    meta = read_meta(d)
    if meta is None:
        raise MeshplanError(f"--resume: {d} holds no meshplan checkpoint (no {META})",
                            hint="give the --checkpoint-dir of an earlier run")
    mine = to_dict(model_spec)
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
        meta = {"schema_version": 1, "model": to_dict(trainer.cfg.model), "plan": trainer.cfg.plan.short(),
                "step": trainer.step, "path": path.name}
        tmp = d / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, d / META)  # atomic: a crash mid-save leaves the previous checkpoint in force
    return path


def load(trainer: Any, directory: str | Path) -> int:
    """Load the latest checkpoint in ``directory`` into ``trainer`` (any plan); returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    step = check_resumable(directory, trainer.cfg.model)
    meta = read_meta(directory) or {}
    _init_optimizer_state(trainer)
    state = _state(trainer)
    dcp.load(state, checkpoint_id=str(Path(directory) / meta.get("path", f"step-{step:08d}")))
    for part, opt in zip(trainer.par.parts, trainer.optimizers):
        set_model_state_dict(part, state["model"], options=_options().__class__(strict=False))
        set_optimizer_state_dict(part, opt, state["optim"], options=_options())
    trainer.step = int(state["extra"]["step"])
    torch.set_rng_state(state["extra"]["rng"])
    return trainer.step
