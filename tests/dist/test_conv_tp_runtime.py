"""Tensor parallelism on convolutions (issue 29) through `meshplan train`'s trainer, on CPU
(torchrun, gloo, 2 processes, fp32): the tiny ResNet-50 (bottlenecks: conv1 -> bn1 -> conv2 split as
a column -> row pair, conv3 and the shortcut whole, BatchNorm after the row convolution whole) and the
tiny Wide-ResNet (pre-activation basic blocks: conv1 -> bn2 -> conv2; tests/data/modules) under tp=2,
one of them with full recomputation, one resumed from a tp=2 checkpoint under FSDP (dp=2, zero=3).

Every reference runs the distributed run's micro-batches (BatchNorm normalises each with its own
statistics): the single-process fp32 run and the float64 run from the same initial weights (the exact
result). Tolerance, from the dtype and the computation (test_parity.check_errors): per step, the
distributed loss's and gradient norm's relative error against float64 is at most FACTOR (8) x the
single-process fp32 run's own error, never below float32's epsilon; per tensor, the final weights
alike (with test_ingested.check_weights' floor for tensors whose single-process error is luckily
small). Splitting the channel sums of the convolutions changes only the order of fp32 roundings; a
wrong collective (a missing all-reduce of the row convolution's partial outputs or of the column
convolution's input gradient, a doubled bias, BatchNorm statistics of the wrong channels) is off by
1e-3 or more.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT, meshplan_train, run_env, torchrun_worker
from test_ingested import check_weights as check_ingested_weights
from test_parity import check_errors

pytest.importorskip("torch")

MODULES = ROOT / "tests" / "data" / "modules"
WORKER = Path(__file__).with_name("conv_worker.py")
RESNET, WRN = "module:resnet50:make_resnet50_tiny", "module:wide_resnet:make_wrn_tiny"
BATCH, STEPS = 4, 3
WEIGHT_SANE = 1e-2
"""The fp32 run's weights must track float64 this closely per tensor (test_parity.SANE is 1e-3): AdamW
divides a gradient by its own running root mean square, so a parameter whose gradient is nearly zero
moves by rounding noise at full step size. BatchNorm biases feeding another BatchNorm through one
convolution are such parameters: measured up to 1.1e-3 (ResNet) and 4.5e-3 (Wide-ResNet, 4 rows a
micro-batch) from float64 in the fp32 single-process run, while the distributed runs stay within 3.4x
of the single-process error on every tensor."""
CASES = [("resnet_tp", RESNET, "tp=2,micro_batch=2", None),
         ("wrn_tp", WRN, "tp=2,micro_batch=4", None),
         ("wrn_tp_recompute", WRN, "tp=2,micro_batch=1,recompute=full", None),
         ("wrn_tp_to_fsdp", WRN, "dp=2,zero=3,micro_batch=1", {"plan": "tp=2,micro_batch=1,precision=fp32", "steps": 1})]


def modules_env() -> dict[str, str]:
    return run_env(PYTHONPATH=f"{MODULES}:{ROOT / 'src'}")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("conv_tp")
    cases = []
    for name, src, plan, resume in CASES:
        c = {"name": name, "source": src, "plan": plan + ",precision=fp32", "global_batch": BATCH, "steps": STEPS}
        if resume:
            c["resume"] = resume
        cases.append(c)
    return torchrun_worker(tmp, 2, cases, WORKER, modules_env())


def check_weights(r: dict) -> None:
    """test_ingested's check, with this file's sanity bound on the fp32 reference (WEIGHT_SANE)."""
    check_ingested_weights(r, sane=WEIGHT_SANE)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_matches_single_process(results: dict[str, list[dict]], name: str) -> None:
    ranks = results[name]
    log = results["__log__"][0]
    assert len(ranks) == 2, f"{len(ranks)}/2 ranks reported; torchrun rc={log['rc']}\n{log['stderr']}"
    for r in ranks:
        assert r["ok"], f"rank {r['rank']}: {r.get('error')}\n{r.get('trace', '')[-2000:]}"
        assert r["exact_fp32_ops"] == [], r["exact_fp32_ops"]  # the float64 reference is float64 throughout
        check_errors(f"{name} rank {r['rank']} losses", r["losses"], r["single_losses"], r["exact_losses"])
        check_errors(f"{name} rank {r['rank']} gradient norms", r["norms"], r["single_norms"], r["exact_norms"])
        check_weights(r)
        assert r["params"] == r["ref_params"]


@pytest.mark.parametrize("name, column, row, norm", [("resnet_tp", "conv1", "conv2", "bn1"),
                                                     ("wrn_tp", "conv1", "conv2", "bn2")])
def test_split_convolutions_are_sharded(results: dict[str, list[dict]], name: str, column: str, row: str,
                                        norm: str) -> None:
    """The column convolution's weight is sharded on output channels (Shard(0)), the row convolution's
    on input channels (Shard(1)), the BatchNorm between them on channels (parameters and running
    statistics); what is outside the pair stays a plain tensor (the ResNet's conv3, bn3, shortcut)."""
    for r in results[name]:
        assert r["ok"], r.get("error")
        p = r["placements"]
        assert p[f"{column}.weight"] == "(Shard(dim=0),)" and p[f"{row}.weight"] == "(Shard(dim=1),)", p
        for k in ("weight", "bias", "running_mean", "running_var"):
            assert p[f"{norm}.{k}"] == "(Shard(dim=0),)", p
        if name == "resnet_tp":
            assert all(p[k] == "plain" for k in ("conv3.weight", "bn3.weight", "bn2.weight",
                                                 "downsample.0.weight")), p
        assert r["dp_mode"] == ("fsdp" if name.endswith("fsdp") else "none")


def test_meshplan_train_wide_resnet_tp(tmp_path: Path) -> None:
    """`meshplan train --model module:wide_resnet:make_wrn_tiny --plan tp=2`: every step's loss is
    the single-process run's (same micro-batches) within test_examples.TOLERANCE (fp32; measured
    differences in the worker cases above are far below it), with the cost model's estimate."""
    from test_examples import TOLERANCE

    from meshplan.runtime.train import RunConfig, reference_run
    from meshplan.spec.plan import parse_plan
    sys.path.insert(0, str(MODULES))
    try:
        ref, _, _ = reference_run(RunConfig(model=WRN, plan=parse_plan("precision=fp32"), global_batch=BATCH,
                                            steps=STEPS), STEPS, micro_batch=2)
    finally:
        sys.path.remove(str(MODULES))
    m = tmp_path / "m.jsonl"
    p = meshplan_train("--model", WRN, "--global-batch", str(BATCH), "--metrics", str(m), "--pg-timeout", "60",
                       "--plan", "tp=2,micro_batch=2,precision=fp32", "--steps", str(STEPS), env=modules_env())
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in m.read_text().splitlines()]
    losses = [r["loss"] for r in rows if "step" in r]
    assert len(losses) == STEPS and all(abs(a - b) <= TOLERANCE["fp32"] * abs(b) for a, b in zip(losses, ref)), \
        (losses, ref)
    assert rows[-1]["kind"] == "summary" and rows[-1]["estimate"]["step_time_s"] > 0
