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
from worker_main import main, resume_from, run_steps, save_first_part

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


class LossProbe:
    """How the loss meets the logits on this rank: the layout of the last stage's logits (the
    output projection's forward output: a DTensor sharded on the vocabulary under tp > 1) and the
    widths of the local logits that loss_parallel's sharded log-softmax reduced (none when the loss
    ran on whole logits)."""

    def __init__(self, trainer: Trainer) -> None:
        from torch.distributed.tensor.parallel import loss as lp
        self.logits: list[dict] = []
        self.softmax_widths: set[int] = set()
        self._lp, self._orig = lp, lp._log_softmax

        def log_softmax(x: torch.Tensor, *args: Any) -> torch.Tensor:
            self.softmax_widths.add(int(x.shape[-1]))
            return self._orig(x, *args)
        lp._log_softmax = log_softmax
        self._handles = [part.output.register_forward_hook(self._hook) for part in trainer.par.parts
                         if getattr(part, "output", None) is not None]

    def _hook(self, module: Any, args: Any, out: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor
        if not self.logits:
            dt = isinstance(out, DTensor)
            norm = [f"Shard({p.dim % out.dim()})" if p.is_shard() else str(p) for p in out.placements] if dt else []
            self.logits.append({"dtensor": dt, "placements": norm,
                                "local_vocab": int((out.to_local() if dt else out).shape[-1]),
                                "vocab": int(out.shape[-1])})

    def close(self) -> dict:
        self._lp._log_softmax = self._orig
        for h in self._handles:
            h.remove()
        return {"logits": self.logits[0] if self.logits else None, "softmax_widths": sorted(self.softmax_widths)}


def grad_layout_mismatch(trainer: Trainer) -> dict[str, str]:
    """Parameters whose gradient (after the step) is not laid out like the parameter: another
    local shape or other placements (DTensor's vocabulary-sharded embedding left a replicated,
    full-size gradient under TP without FSDP; the manual data-parallel all-reduce moves the local
    gradients)."""
    from torch.distributed.tensor import DTensor
    bad = {}
    for part in trainer.par.parts:
        for name, p in part.named_parameters():
            g = p.grad
            if g is None:
                continue
            pl = list(p.placements) if isinstance(p, DTensor) else None
            gl = list(g.placements) if isinstance(g, DTensor) else None
            ps = (p.to_local() if isinstance(p, DTensor) else p).shape
            gs = (g.to_local() if isinstance(g, DTensor) else g).shape
            if pl != gl or ps != gs:
                bad[clean_fqn(name)] = f"param {pl} {list(ps)}, grad {gl} {list(gs)}"
    return bad


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
        first = dataclasses.replace(cfg, plan=parse_plan(resume["plan"]))
        check_supported(first.model, first.plan, dist.get_world_size(), cfg.seq_len)
        t = Trainer(first, build_mesh(first.plan, device.type), device)
        where = [save_first_part(t, resume["steps"], losses, norms)]
        del t
    mesh = build_mesh(cfg.plan, device.type)
    trainer = Trainer(cfg, mesh, device)
    if resume is not None:
        resume_from(trainer, where[0], len(losses))  # type: ignore[arg-type]
    counter = CommCounter(trainer)
    probe = LossProbe(trainer)
    try:
        run_steps(trainer, steps, losses, norms)
    finally:
        counter.close()
        counter.loss = probe.close()  # type: ignore[attr-defined]
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
            "has_last": trainer.par.has_last, "tp": cfg.plan.tp, "loss": counter.loss,
            "grad_layout_mismatch": grad_layout_mismatch(trainer),
            "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    sys.exit(main(run_case))
