"""Runs inside torchrun: ingested models (hf:/module:) under several plans, each compared with the
single-process runs of the same global batch (losses, gradient norms per step, final weights).
Writes one JSON result per rank and case to OUT_DIR.

References per model (as worker.py's for presets, test_parity.check_errors explains the bound):
three single-process fp32 runs that differ only in order (1, 2 and B micro-batches: how far
correct fp32 arithmetic strays on this CPU), and the float64 run from the same fp32 initial
weights (the exact result). Library code casts to float32 on its own (Hugging Face's RMSNorm,
rotary tables, router softmax, and the losses' ``.float()``), so the float64 run goes through
``Float64``, which turns every conversion to float32 into one to float64, and ``Float32Ops``
records any aten op that still returns a float32 tensor there (reported; the test wants none).

usage: torchrun --nproc-per-node N tests/dist/ingested_worker.py OUT_DIR CASES_JSON
CASES_JSON: [{"name", "source", "plan", "global_batch", "steps", "seq_len"}, ...]
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from worker_main import main, run_steps

from meshplan.runtime.mesh import build_mesh
from meshplan.runtime.train import RunConfig, Trainer, clean_fqn, reference_run
from meshplan.spec.io import parse_plan
from meshplan.spec.plan import Plan

NOISE_ONLY = ("k_proj.bias", "key.bias", ".k.bias")
"""Key biases: their gradient is analytically zero (a per-query shift softmax ignores), so Adam turns
rounding noise into full-size updates; compared with an absolute tolerance."""
Ref = tuple[list[float], list[float], dict[str, torch.Tensor]]
_REF: dict[str, tuple[list[Ref], Ref, dict[str, Any]]] = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


FLOAT_FACTORIES = (torch.zeros, torch.ones, torch.empty, torch.linspace)
"""Factories that make the default floating dtype, float32, unless told (the trainer's loss accumulator)."""
VALUE_FACTORIES = (torch.full, torch.tensor, torch.as_tensor, torch.arange)
"""Factories that make float32 from Python floats unless told."""
DRAWS = ("aten.randn", "aten.rand", "aten.normal", "aten.uniform", "aten.randint")
"""Random draws: made in float32 as in the fp32 runs (the same numbers), then cast exactly."""


class Float64(TorchFunctionMode):
    """Conversions to float32 become conversions to float64: ``Tensor.float()``, ``.to(torch.float32)``
    (positional or ``dtype=``), ``.type(torch.float32)``, any ``dtype=torch.float32`` argument
    (``softmax(dtype=torch.float)``), and factories that would make float32 by default. Random draws
    stay float32 (the fp32 runs' numbers) and are cast exactly where the model casts its inputs."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].double()
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if "dtype" not in kwargs and (func in FLOAT_FACTORIES or (
                func in VALUE_FACTORIES and any(isinstance(x, float) for x in tree_flatten(args)[0]))):
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


class Float32Ops(TorchDispatchMode):
    """The aten ops (forward and backward) that return a float32 tensor, random draws aside: none in
    an exact float64 run."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not str(func).startswith(DRAWS) and any(isinstance(t, torch.Tensor) and t.dtype == torch.float32
                                                   for t in tree_flatten(out)[0]):
            self.seen.add(str(func))
        return out


def single_run(cfg: RunConfig, micro_batch: int, fp64: bool = False) -> tuple[Ref, list[str]]:
    """One process, the whole global batch in micro-batches of ``micro_batch`` rows (the first is
    ``train.reference_run``'s): losses, gradient norms, final weights. ``fp64``: the fp32 initial
    weights cast exactly to float64, every op, the loss and AdamW in float64 (``Float64``); also
    returns the ops that still made float32 tensors."""
    plan = Plan(micro_batch=micro_batch, precision=cfg.plan.precision)
    t = Trainer(dataclasses.replace(cfg, plan=plan), None, torch.device("cpu"))
    if fp64:
        for part in t.par.parts:
            part.double()  # replaces param.data: the optimizer and the trainer keep the same Parameters
            for m in part.modules():  # transformers' grouped-GEMM experts take no float64: its plain loop does
                conf = getattr(m, "config", None)
                if getattr(conf, "_experts_implementation", None) not in (None, "eager"):
                    conf._experts_implementation = "eager"
    leaks = Float32Ops()
    losses, norms = [], []
    with (contextlib.ExitStack() if not fp64 else _fp64(leaks)):
        for _ in range(cfg.steps):
            losses.append(t.train_step())
            norms.append(float(t.grad_norm))  # type: ignore[arg-type]
    weights = {clean_fqn(n): p.detach().clone() for part in t.par.parts for n, p in part.named_parameters()}
    return (losses, norms, weights), sorted(leaks.seen)


@contextlib.contextmanager
def _fp64(leaks: Float32Ops) -> Any:
    with Float64(), leaks:
        yield


def references(cfg: RunConfig) -> tuple[list[Ref], Ref, dict[str, Any]]:
    """fp32 runs with B, B/2 and 1 micro-batches, the float64 run on B, and how exact it is: the
    float64 run on 1 micro-batch differs from it only by float64 rounding ("spread"), and no op of
    it made a float32 tensor ("fp32_ops")."""
    b = cfg.global_batch
    singles = [single_run(cfg, mb)[0] for mb in dict.fromkeys((b, max(b // 2, 1), 1))]
    exact, leaks = single_run(cfg, b, fp64=True)
    other, leaks1 = single_run(cfg, 1, fp64=True)
    dense = [k for k in exact[2] if not k.endswith(NOISE_ONLY)]
    spread = max([abs(x - y) / abs(y) for i in (0, 1) for x, y in zip(other[i], exact[i])]
                 + [rel(other[2][k], exact[2][k]) for k in dense])
    return singles, exact, {"spread": spread, "fp32_ops": sorted(set(leaks) | set(leaks1))}


def vocab_case(case: dict, device: torch.device) -> dict:
    """tp under the vocabulary-parallel LM head and tables: per-step losses and gradient norms and
    the final weights of the distributed run and of the single-process run on the same micro-batches
    (``train.reference_run``), and how the head's and the input embedding's weights are held."""
    from torch.distributed.tensor import DTensor
    plan = parse_plan(case["plan"])
    cfg = RunConfig(model=case["source"], plan=plan, global_batch=case["global_batch"], steps=case["steps"],
                    seq_len=case.get("seq_len"))
    trainer = Trainer(cfg, build_mesh(plan, device.type), device)
    losses: list[float] = []
    norms: list[float] = []
    run_steps(trainer, cfg.steps, losses, norms)
    weights = trainer.full_weights()
    module = trainer.model.built.module  # type: ignore[attr-defined]
    head, table = module.get_output_embeddings(), module.get_input_embeddings()

    def held(p: torch.Tensor) -> str:
        return str(tuple(p.placements)) if isinstance(p, DTensor) else type(p).__name__
    ref_losses, ref_norms, ref_w = reference_run(cfg, cfg.steps, plan.micro_batch)
    return {"name": case["name"], "ok": True, "losses": losses, "ref_losses": ref_losses, "norms": norms,
            "ref_norms": ref_norms,  # key biases: rounding noise Adam makes full-size (NOISE_ONLY)
            "weights_err": {k: rel(weights[k], ref_w[k]) for k in ref_w if k in weights and not k.endswith(NOISE_ONLY)},
            "missing": sorted(set(ref_w) ^ set(weights)), "head": held(head.weight), "table": held(table.weight),
            "tied": head.weight is table.weight, "vocab_parallel": trainer.par.vocab_parallel,
            "head_bias": held(head.bias) if head.bias is not None else None}


def run_case(case: dict, device: torch.device) -> dict:
    if case.get("kind") == "vocab":
        return vocab_case(case, device)
    plan = parse_plan(case["plan"])
    cfg = RunConfig(model=case["source"], plan=plan, global_batch=case["global_batch"], steps=case["steps"],
                        seq_len=case.get("seq_len"))
    key = json.dumps([case["source"], case["global_batch"], case["steps"], case.get("seq_len"), plan.precision])
    if key not in _REF:
        _REF[key] = references(cfg)
    singles, (x_losses, x_norms, x_w), exactness = _REF[key]
    ref_losses, ref_norms, ref_w = singles[0]
    t0 = time.perf_counter()
    trainer = Trainer(cfg, build_mesh(plan, device.type), device)
    losses: list[float] = []
    norms: list[float] = []
    run_steps(trainer, cfg.steps, losses, norms)
    weights = trainer.full_weights()
    dense = [k for k in weights if k in ref_w and not k.endswith(NOISE_ONLY)]
    per = {k: rel(weights[k], ref_w[k]) for k in dense}
    worst = sorted(per, key=per.get)[-3:]
    return {"name": case["name"], "ok": True, "losses": losses, "ref_losses": ref_losses, "norms": norms,
            "ref_norms": ref_norms,
            # against float64: the distributed run ("dist") and the single-process fp32 runs ("single")
            "exact_losses": x_losses, "exact_norms": x_norms,
            "single_losses": [s[0] for s in singles], "single_norms": [s[1] for s in singles],
            "w_err_dist": {k: rel(weights[k], x_w[k]) for k in dense},
            "w_err_single": {k: max(rel(s[2][k], x_w[k]) for s in singles) for k in dense},
            "exact_spread": exactness["spread"], "exact_fp32_ops": exactness["fp32_ops"],
            "noise_param_abs_err": max((float((weights[k] - ref_w[k]).abs().max()) for k in weights
                                        if k in ref_w and k.endswith(NOISE_ONLY)), default=0.0),
            "worst": {k: per[k] for k in worst}, "params": sorted(weights), "ref_params": sorted(ref_w),
            "unknown_params": [k for k in weights if k not in ref_w],
            "notes": trainer.par.notes, "dp_mode": trainer.par.dp_mode, "seconds": time.perf_counter() - t0,
            "expert_rows": {k: list(v) for k, v in trainer.model.expert_rows.items()},
            "local_params": sorted(clean_fqn(n) for part in trainer.par.parts for n, _ in part.named_parameters())}


if __name__ == "__main__":
    sys.exit(main(run_case))
