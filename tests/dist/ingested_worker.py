"""Runs inside torchrun: ingested models (hf:/module:) under several plans, each compared with the
single-process run of the same global batch (losses, gradient norms per step, final weights).
Writes one JSON result per rank and case to OUT_DIR.

usage: torchrun --nproc-per-node N tests/dist/ingested_worker.py OUT_DIR CASES_JSON
CASES_JSON: [{"name", "source", "plan", "global_batch", "steps", "seq_len"}, ...]
"""
from __future__ import annotations

import json
import sys
import time

import torch
from worker_main import main

from meshplan.runtime.generic import GenericConfig, GenericTrainer, reference_run
from meshplan.runtime.mesh import build_mesh
from meshplan.spec.io import parse_plan

NOISE_ONLY = ("k_proj.bias", "key.bias", ".k.bias")
"""Key biases: their gradient is analytically zero (a per-query shift softmax ignores), so Adam turns
rounding noise into full-size updates; compared with an absolute tolerance."""
_REF: dict[str, tuple[list[float], list[float], dict[str, torch.Tensor]]] = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def run_case(case: dict, device: torch.device) -> dict:
    plan = parse_plan(case["plan"])
    cfg = GenericConfig(source=case["source"], plan=plan, global_batch=case["global_batch"], steps=case["steps"],
                        seq_len=case.get("seq_len"))
    key = json.dumps([case["source"], case["global_batch"], case["steps"], case.get("seq_len"), plan.precision])
    if key not in _REF:
        _REF[key] = reference_run(cfg, cfg.steps)
    ref_losses, ref_norms, ref_w = _REF[key]
    t0 = time.perf_counter()
    trainer = GenericTrainer(cfg, build_mesh(plan, device.type), device)
    losses, norms = [], []
    for _ in range(cfg.steps):
        losses.append(trainer.train_step())
        norms.append(float(trainer.grad_norm))
    weights = trainer.full_weights()
    per = {k: rel(weights[k], ref_w[k]) for k in weights if k in ref_w}
    worst = sorted(per, key=per.get)[-3:]
    return {"name": case["name"], "ok": True, "losses": losses, "ref_losses": ref_losses, "norms": norms,
            "ref_norms": ref_norms,
            "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "grad_norm_rel_err": max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms)),
            "weight_rel_err": max((v for k, v in per.items() if not k.endswith(NOISE_ONLY)), default=0.0),
            "noise_param_abs_err": max((float((weights[k] - ref_w[k]).abs().max()) for k in per
                                        if k.endswith(NOISE_ONLY)), default=0.0),
            "worst": {k: per[k] for k in worst}, "params": sorted(weights), "ref_params": sorted(ref_w),
            "unknown_params": [k for k in weights if k not in ref_w],
            "notes": trainer.par.notes, "dp_mode": trainer.par.dp_mode, "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    sys.exit(main(run_case))
