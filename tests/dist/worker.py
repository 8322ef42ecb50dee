"""Runs inside torchrun: several plans, one after another, each compared with the single-process
runs on the same global batch (losses and gradient norms per step, final weights). Writes one JSON
result per rank and case to OUT_DIR; the pytest side checks every rank's marker and the tolerances.

Single-process references per model: the fp32 run on the whole batch (what the distributed run
must reproduce), the same with gradient accumulation over 2 and over B micro-batches (the same sums
in other orders: together they show how far correct fp32 arithmetic strays on this CPU), and the
float64 run from the same fp32 initial weights (the exact result, to rounding far below fp32's).
The distributed and the single-process errors are both measured against float64
(test_parity.check_errors explains the bound).

A case with ``"resume": {"plan", "steps"}`` trains its first steps under that plan, saves a
checkpoint (runtime.checkpoint), and the rest under ``plan`` from that checkpoint (same process
count): the whole must still equal the single-process run.

Also recorded: the largest magnitude of padded vocabulary rows (weights and gradients; tp not
dividing the vocabulary) and the largest difference between the two copies of tied embeddings
under a pipeline, gathered on the first pipeline rank (both must be 0).

usage: torchrun --nproc-per-node N tests/dist/worker.py OUT_DIR CASES_JSON
CASES_JSON: [{"name", "model", "overrides": {...}, "plan", "global_batch", "steps", "resume"?}, ...]
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from worker_main import main

from meshplan.runtime.mesh import build_mesh, check_supported
from meshplan.runtime.parallelize import VOCAB_PARAMS
from meshplan.runtime.train import RunConfig, Trainer, clean_fqn
from meshplan.spec.io import load_model, parse_plan
from meshplan.spec.plan import Plan

Ref = tuple[list[float], list[float], dict[str, torch.Tensor]]
_REF_CACHE: dict[str, tuple[list[Ref], Ref]] = {}


NOISE_ONLY = (".attention.wk.bias",)
"""Parameters whose gradient is analytically zero (a key bias shifts every score of a query by
the same amount; softmax ignores it): Adam turns their rounding noise into full-size updates,
so they are compared with an absolute tolerance instead."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def single_run(cfg: RunConfig, micro_batch: int, fp64: bool = False) -> Ref:
    """One process, the whole global batch in micro-batches of ``micro_batch`` rows: losses,
    gradient norms, final weights. ``fp64``: the fp32 initial weights cast exactly to float64 (the
    same starting point), then every op, the loss (models.loss_fn keeps float64) and AdamW in
    float64; the gradient norm goes through the trainer's fp32 accumulator (rounding 6e-8)."""
    t = Trainer(dataclasses.replace(cfg, plan=Plan(micro_batch=micro_batch, precision="fp32")),
                None, torch.device("cpu"))
    if fp64:
        for part in t.par.parts:
            part.double()  # replaces param.data: the optimizer and the trainer keep the same Parameters
    losses, norms = [], []
    for _ in range(cfg.steps):
        losses.append(t.train_step())
        norms.append(float(t.grad_norm))  # type: ignore[arg-type]
    weights = {clean_fqn(n): p.detach().clone() for part in t.par.parts for n, p in part.named_parameters()}
    return losses, norms, weights


def references(cfg: RunConfig) -> tuple[list[Ref], Ref]:
    """fp32 runs with 1, 2 and B micro-batches (the first is ``train.reference_run``'s), float64."""
    b = cfg.global_batch
    return [single_run(cfg, mb) for mb in dict.fromkeys((b, max(b // 2, 1), 1))], single_run(cfg, b, fp64=True)


class CommCounter:
    """Counts FSDP2's collectives (it calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single``
    at run time) while the trainer's forward/backward runs: per step, [all-gathers, reduce-scatters]."""

    def __init__(self, trainer: Trainer) -> None:
        self.steps: list[list[int]] = []
        self._on = False
        self._orig = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
        for i, name in enumerate(self._orig):
            setattr(dist, name, self._wrap(self._orig[name], i))
        fb = trainer._forward_backward

        def counted(*args: Any) -> torch.Tensor:
            self.steps.append([0, 0])
            self._on = True
            try:
                return fb(*args)
            finally:
                self._on = False
        trainer._forward_backward = counted  # type: ignore[method-assign]

    def _wrap(self, fn: Any, i: int) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self._on:
                self.steps[-1][i] += 1
            return fn(*args, **kwargs)
        return wrapped

    def close(self) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def fsdp_groups(trainer: Trainer) -> int:
    """FSDP parameter groups of this rank that communicate (a one-rank shard group, as experts'
    with ep = dp, all-gathers and reduce-scatters nothing): one all-gather / reduce-scatter each."""
    from torch.distributed.fsdp import FSDPModule
    return sum(g.mesh_info.shard_mesh_size > 1 for part in trainer.par.parts for m in part.modules()
               if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups)


def padding_abs_max(trainer: Trainer) -> float:
    """Largest |value| of padded vocabulary rows, weights and gradients (collective over dp/tp)."""
    from torch.distributed.tensor import DTensor
    vocab, worst = trainer.cfg.model.vocab_size, 0.0
    for part in trainer.par.parts:
        for name, p in part.named_parameters():
            if clean_fqn(name) not in VOCAB_PARAMS:
                continue
            for t in (p, p.grad):
                if t is None:
                    continue
                full = t.full_tensor() if isinstance(t, DTensor) else t
                if full.shape[0] > vocab:
                    worst = max(worst, float(full[vocab:].abs().max()))
    return worst


def tied_copies_diff(trainer: Trainer) -> float:
    """Largest |difference| between the two copies of tied embeddings under a pipeline (0 on ranks
    holding neither). Collective over the ranks of a stage's meshes and the tied pair."""
    from torch.distributed.tensor import DTensor
    par = trainer.par
    if not par.tied:  # the same on every rank of this pipeline rank's dp/tp meshes
        return 0.0
    full = [(t.full_tensor() if isinstance(t, DTensor) else t).detach() for t in par.tied]
    if len(full) == 1:  # one end here, the other on the paired pipeline rank
        mine = full[0].contiguous()
        full = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(full, mine, group=par.tied_group)
    return float((full[0] - full[1]).abs().max())


def train(cfg: RunConfig, steps: int, device: torch.device, resume: dict | None) -> tuple[Trainer, Any, list, list,
                                                                                      CommCounter]:
    """``steps`` steps of ``cfg`` (with ``resume``: the first under its plan, then a checkpoint,
    then the rest under ``cfg.plan`` from it); the trainer and mesh of the last part."""
    losses: list[float] = []
    norms: list[float] = []
    if resume is not None:
        import tempfile

        from meshplan.runtime import checkpoint
        first = dataclasses.replace(cfg, plan=parse_plan(resume["plan"]))
        check_supported(first.model, first.plan, dist.get_world_size(), cfg.seq_len)
        t = Trainer(first, build_mesh(first.plan, device.type), device)
        for _ in range(resume["steps"]):
            losses.append(t.train_step())
            norms.append(float(t.grad_norm))  # type: ignore[arg-type]
        where = [tempfile.mkdtemp(prefix="meshplan-resume-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(where)
        checkpoint.save(t, where[0])
        del t
    mesh = build_mesh(cfg.plan, device.type)
    trainer = Trainer(cfg, mesh, device)
    if resume is not None:
        from meshplan.runtime import checkpoint
        assert checkpoint.load(trainer, where[0]) == len(losses)
        dist.barrier()
        if dist.get_rank() == 0:
            import shutil
            shutil.rmtree(where[0], ignore_errors=True)
    counter = CommCounter(trainer)
    try:
        while len(losses) < steps:
            losses.append(trainer.train_step())
            norms.append(float(trainer.grad_norm))  # type: ignore[arg-type]
    finally:
        counter.close()
    return trainer, mesh, losses, norms, counter


def run_case(case: dict, device: torch.device) -> dict:
    model = load_model(case["model"]).replace(**case.get("overrides", {}))
    plan = parse_plan(case["plan"])
    cfg = RunConfig(model=model, plan=plan, global_batch=case["global_batch"],
                    seq_len=case.get("seq_len", 32), steps=case["steps"])
    check_supported(model, plan, dist.get_world_size(), cfg.seq_len)
    key = json.dumps([case["model"], case.get("overrides", {}), case["global_batch"], cfg.seq_len,
                      case["steps"], plan.precision, plan.recompute != "none"])
    if key not in _REF_CACHE:
        _REF_CACHE[key] = references(cfg)
    singles, (x_losses, x_norms, x_w) = _REF_CACHE[key]
    ref_losses, ref_norms, ref_w = singles[0]
    t0 = time.perf_counter()
    trainer, mesh, losses, norms, counter = train(cfg, cfg.steps, device, case.get("resume"))
    weights = trainer.full_weights()
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    norm_err = max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms))
    dense = [k for k in weights if k in ref_w and not k.endswith(NOISE_ONLY)]
    w_err = max(rel(weights[k], ref_w[k]) for k in dense)
    noise_err = max([float((weights[k] - ref_w[k]).abs().max()) for k in weights if k.endswith(NOISE_ONLY)],
                    default=0.0)
    missing = [k for k in weights if k not in ref_w]
    per_param = {k: rel(weights[k], ref_w[k]) for k in dense}
    worst = sorted(per_param, key=per_param.get)[-3:]
    return {"name": case["name"], "ok": True, "losses": losses, "ref_losses": ref_losses,
            "loss_rel_err": loss_err, "grad_norm_rel_err": norm_err, "norms": norms, "ref_norms": ref_norms,
            "weight_rel_err": w_err, "noise_param_abs_err": noise_err,
            # against float64: the distributed run ("dist") and the single-process fp32 run ("single")
            "exact_losses": x_losses, "exact_norms": x_norms,
            "single_losses": [s[0] for s in singles], "single_norms": [s[1] for s in singles],
            "w_err_dist": {k: rel(weights[k], x_w[k]) for k in dense},
            "w_err_single": {k: max(rel(s[2][k], x_w[k]) for s in singles) for k in dense},
            "w_numel": {k: weights[k].numel() for k in dense},
            "params": sorted(weights),
            "ref_params": sorted(ref_w), "unknown_params": missing,
            "worst": {k: per_param[k] for k in worst}, "notes": trainer.par.notes,
            "comms": counter.steps, "fsdp_groups": fsdp_groups(trainer), "micro_batches": trainer.n_micro,
            "dp_mode": trainer.par.dp_mode, "padding_abs_max": padding_abs_max(trainer),
            "tied_copies_diff": tied_copies_diff(trainer), "tied_ends": len(trainer.par.tied),
            "padded_vocab": max([p.padded_vocab for p in trainer.par.parts], default=0),
            "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    sys.exit(main(run_case))
