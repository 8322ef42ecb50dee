"""Runs inside torchrun: models beyond decoder transformers (tests/data/modules: ResNet-50, a ViT and a
GNN written as nn.Modules; Hugging Face BERT and ViT configs) under data-parallel, FSDP, pipeline and
tensor-parallel plans, each against the single-process run of the same global batch in the same
micro-batches (``train.reference_run`` with the plan's ``micro_batch``: BatchNorm normalises each
micro-batch with its own statistics, so the reference must see the distributed run's micro-batches).
Writes one JSON result per rank and case to OUT_DIR.

A case with ``"resume": {"plan", "steps"}`` trains its first steps under that plan, saves a checkpoint
(runtime.checkpoint: the same code as the presets'), and the rest under ``plan`` from it.

usage: torchrun --nproc-per-node N tests/dist/examples_worker.py OUT_DIR CASES_JSON
CASES_JSON: [{"name", "source", "plan", "global_batch", "steps", "lr"?, "seq_len"?, "resume"?}, ...]
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist
from worker_main import main, resume_from, run_steps, save_first_part

from meshplan.runtime.mesh import build_mesh
from meshplan.runtime.train import RunConfig, Trainer, reference_run
from meshplan.spec.io import parse_plan

Ref = tuple[list[float], list[float], dict[str, torch.Tensor]]
_REF: dict[str, Ref] = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def train(cfg: RunConfig, device: torch.device, resume: dict | None) -> tuple[Trainer, list[float], list[float]]:
    """``cfg.steps`` steps (with ``resume``: the first under its plan, then a checkpoint, then the
    rest under ``cfg.plan`` from it)."""
    losses: list[float] = []
    norms: list[float] = []
    where: list[str | None] = [None]
    if resume is not None:
        first = dataclasses.replace(cfg, plan=parse_plan(resume["plan"]))
        t = Trainer(first, build_mesh(first.plan, device.type), device)
        where = [save_first_part(t, resume["steps"], losses, norms)]
        del t
    trainer = Trainer(cfg, build_mesh(cfg.plan, device.type), device)
    if resume is not None:
        resume_from(trainer, where[0], len(losses))  # type: ignore[arg-type]
    run_steps(trainer, cfg.steps, losses, norms)
    return trainer, losses, norms


def run_case(case: dict, device: torch.device) -> dict:
    plan = parse_plan(case["plan"])
    cfg = RunConfig(model=case["source"], plan=plan, global_batch=case["global_batch"], steps=case["steps"],
                    seq_len=case.get("seq_len"), lr=case.get("lr", 1e-3))
    key = json.dumps([case["source"], case["global_batch"], case["steps"], case.get("seq_len"), cfg.lr,
                      plan.precision, plan.micro_batch])
    t_ref = time.perf_counter()
    if key not in _REF:
        _REF[key] = reference_run(cfg, cfg.steps, micro_batch=plan.micro_batch)
    t_ref = time.perf_counter() - t_ref
    ref_losses, ref_norms, ref_w = _REF[key]
    t0 = time.perf_counter()
    trainer, losses, norms = train(cfg, device, case.get("resume"))
    weights = trainer.full_weights()
    per = {k: rel(weights[k], ref_w[k]) for k in weights if k in ref_w}
    worst = sorted(per, key=per.get)[-3:]
    return {"name": case["name"], "ok": True, "losses": losses, "ref_losses": ref_losses, "norms": norms,
            "ref_norms": ref_norms, "worst_weights": {k: per[k] for k in worst}, "params": sorted(weights),
            "ref_params": sorted(ref_w), "unknown_params": [k for k in weights if k not in ref_w],
            "notes": trainer.par.notes, "dp_mode": trainer.par.dp_mode, "micro_batches": trainer.n_micro,
            "stage_ids": trainer.par.stage_ids, "seconds": time.perf_counter() - t0, "reference_seconds": t_ref}


if __name__ == "__main__":
    sys.exit(main(run_case))
