"""Runs inside torchrun: convolutional models under tensor parallelism (issue 29), each against
single-process runs of the same global batch in the same micro-batches (BatchNorm normalises each
micro-batch with its own statistics, so every reference must see the distributed run's
micro-batches): the fp32 run (``ingested_worker.single_run``: how far correct fp32 arithmetic
strays) and the float64 run from the same fp32 initial weights (the exact result;
``ingested_worker.Float64``). Also reports how the split convolutions and the BatchNorm between them
are held (DTensor placements of the first block's parameters and running statistics). A case with
``"resume": {"plan", "steps"}`` trains its first steps under that plan, saves a checkpoint and goes on
under ``plan`` from it (examples_worker.train).

usage: torchrun --nproc-per-node N tests/dist/conv_worker.py OUT_DIR CASES_JSON
CASES_JSON: [{"name", "source", "plan", "global_batch", "steps", "resume"?}, ...]
"""
from __future__ import annotations

import sys

import torch
from examples_worker import train
from ingested_worker import rel, single_run
from worker_main import main

from meshplan.runtime.train import RunConfig, Trainer
from meshplan.spec.io import parse_plan


def placements(trainer: Trainer) -> dict[str, str]:
    """Parameter and buffer name -> its DTensor placements (plain tensors: 'plain'), in blocks.0."""
    from torch.distributed.tensor import DTensor
    module = trainer.model.built.module  # type: ignore[attr-defined]
    block = module.blocks[0]
    items = list(block.named_parameters()) + [(n, b) for n, b in block.named_buffers() if b.is_floating_point()]
    return {n: str(tuple(t.placements)) if isinstance(t, DTensor) else "plain" for n, t in items}


def run_case(case: dict, device: torch.device) -> dict:
    plan = parse_plan(case["plan"])
    cfg = RunConfig(model=case["source"], plan=plan, global_batch=case["global_batch"], steps=case["steps"])
    (s_losses, s_norms, s_w), _ = single_run(cfg, plan.micro_batch)
    (x_losses, x_norms, x_w), fp32_ops = single_run(cfg, plan.micro_batch, fp64=True)
    trainer, losses, norms = train(cfg, device, case.get("resume"))
    weights = trainer.full_weights()
    return {"name": case["name"], "ok": True, "losses": losses, "norms": norms,
            "single_losses": [s_losses], "single_norms": [s_norms], "exact_losses": x_losses,
            "exact_norms": x_norms, "exact_fp32_ops": fp32_ops,
            "w_err_dist": {k: rel(weights[k], x_w[k]) for k in weights if k in x_w},
            "w_err_single": {k: rel(s_w[k], x_w[k]) for k in weights if k in x_w},
            "params": sorted(weights), "ref_params": sorted(x_w), "placements": placements(trainer),
            "notes": trainer.par.notes, "dp_mode": trainer.par.dp_mode}


if __name__ == "__main__":
    sys.exit(main(run_case))
