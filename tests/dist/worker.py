"""Runs inside torchrun: several plans, one after another, each compared with the single-process
reference on the same global batch (losses per step and final weights). Writes one JSON result
per rank and case to OUT_DIR; the pytest side checks every rank's marker.

usage: torchrun --nproc-per-node N tests/dist/worker.py OUT_DIR CASES_JSON
CASES_JSON: [{"name", "model", "overrides": {...}, "plan", "global_batch", "steps"}, ...]
"""
from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from worker_main import main

from meshplan.runtime.mesh import build_mesh, check_supported
from meshplan.runtime.train import RunConfig, Trainer, reference_run
from meshplan.spec.io import load_model, parse_plan

_REF_CACHE: dict[str, tuple[list[float], list[float], dict[str, torch.Tensor]]] = {}


NOISE_ONLY = (".attention.wk.bias",)
"""Parameters whose gradient is analytically zero (a key bias shifts every score of a query by
the same amount; softmax ignores it): Adam turns their rounding noise into full-size updates,
so they are compared with an absolute tolerance instead."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def run_case(case: dict, device: torch.device) -> dict:
    model = load_model(case["model"]).replace(**case.get("overrides", {}))
    plan = parse_plan(case["plan"])
    cfg = RunConfig(model=model, plan=plan, global_batch=case["global_batch"],
                    seq_len=case.get("seq_len", 32), steps=case["steps"])
    check_supported(model, plan, dist.get_world_size(), cfg.seq_len)
    key = json.dumps([case["model"], case.get("overrides", {}), case["global_batch"], cfg.seq_len,
                      case["steps"], plan.precision, plan.recompute != "none"])
    if key not in _REF_CACHE:
        _REF_CACHE[key] = reference_run(cfg, cfg.steps)
    ref_losses, ref_norms, ref_w = _REF_CACHE[key]
    mesh = build_mesh(plan, device.type)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, mesh, device)
    losses, norms = [], []
    for _ in range(cfg.steps):
        losses.append(trainer.train_step())
        norms.append(float(trainer.grad_norm))
    weights = trainer.full_weights()
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    norm_err = max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms))
    w_err = max(rel(weights[k], ref_w[k]) for k in weights if not k.endswith(NOISE_ONLY))
    noise_err = max([float((weights[k] - ref_w[k]).abs().max()) for k in weights if k.endswith(NOISE_ONLY)],
                    default=0.0)
    missing = [k for k in weights if k not in ref_w]
    per_param = {k: rel(weights[k], ref_w[k]) for k in weights if k in ref_w and not k.endswith(NOISE_ONLY)}
    worst = sorted(per_param, key=per_param.get)[-3:]
    return {"name": case["name"], "ok": True, "losses": losses, "ref_losses": ref_losses,
            "loss_rel_err": loss_err, "grad_norm_rel_err": norm_err, "norms": norms, "ref_norms": ref_norms,
            "weight_rel_err": w_err, "noise_param_abs_err": noise_err,
            "params": sorted(weights),
            "ref_params": sorted(ref_w), "unknown_params": missing,
            "worst": {k: per_param[k] for k in worst}, "notes": trainer.par.notes,
            "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    sys.exit(main(run_case))
