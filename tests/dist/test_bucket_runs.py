"""Data-aware bucket plans in `meshplan train` (``Plan.buckets``, spec/buckets.py; runtime/train.py
``Trainer._bucket_forward_backward``): per length bucket a micro-batch size and a cp degree, the
micro-batches dealt to units of ranks by load, cp switched per micro-batch.

Every comparison is of per-step losses (~5.5, fp32) between a bucket run and the one-process run on
the same global batch (the same samples, lengths and tokens, one micro-batch): the exact arithmetic
is the same mean over the real tokens of the global batch, only grouped differently (micro-batches,
ranks, sequence chunks whose attention is split over ranks), so they differ by fp32 rounding alone,
as in test_hetero.py: TOL = 1e-5 absolute (~21 ulps of fp32 at 5.5) over 4 AdamW steps. Measured
at most 9.5e-7 here (and with tp=2; docs/runtime.md, "Data-aware bucket plans"). A mistake is
far beyond it: rotary positions of the cp shards left at 0..s-1 move step 2's loss by 2.2e-4; the
unweighted mean of the micro-batches' means is 5.2e-4 away at step 1 (``test_unweighted_would_differ``).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, losses_close, meshplan_train, one_error_line, train_losses

TOL = 1e-5
STEPS = 4
LENGTHS = "16:0.5,32:0.3,64:0.2"
BASE = ["--model", "tiny-llama", "--global-batch", "8", "--steps", str(STEPS), "--pg-timeout", "60",
        "--seq-len", LENGTHS]


def train(tmp: Path, name: str, plan: str, *extra: str, nproc: int) -> tuple[list[float], str]:
    return train_losses(BASE, tmp, name, plan, *extra, nproc=nproc)


def close(a: list[float], b: list[float], tol: float = TOL) -> float:
    return losses_close(a, b, tol, STEPS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process, the whole global batch in one micro-batch padded to its longest sample."""
    d = tmp_path_factory.mktemp("buckets")
    ref, _ = train(d, "one", "precision=fp32,micro_batch=8", nproc=1)
    return {"dir": d, "losses": ref}


def layout(plan_text: str, step: int) -> object:
    from meshplan.runtime import hetero
    from meshplan.spec.buckets import model_knee
    from meshplan.spec.io import load_model
    from meshplan.spec.lengths import parse_lengths
    from meshplan.spec.plan import parse_plan
    return hetero.bucket_step(parse_lengths(LENGTHS), parse_plan(plan_text), 8, step, 0,
                              model_knee(load_model("tiny-llama")))


def exercised(plan_text: str) -> None:
    """The steps of a run do what the test says they do: micro-batches of several cp degrees, and
    ranks with different micro-batch counts (the closing pass is what keeps them in step)."""
    cps, uneven = set(), False
    for step in range(STEPS):
        lay = layout(plan_text, step)
        cps |= {mb.cp for mb in lay.micro_batches}  # type: ignore[attr-defined]
        uneven |= len({len(r) for r in lay.ranks}) > 1  # type: ignore[attr-defined]
    assert len(cps) > 1 and uneven, (cps, uneven)


def test_cp2_ddp(reference: dict) -> None:
    """cp=2 on 2 processes: samples up to 32 tokens 2 per micro-batch on one rank (the two ranks act
    as data-parallel ranks), longer ones one per micro-batch over both; DDP."""
    plan = "cp=2,buckets=32x2cp1:64x1cp2,precision=fp32"
    exercised(plan)
    got, err = train(reference["dir"], "cp2", plan, nproc=2)
    close(reference["losses"], got)
    assert "buckets=32x2cp1:64x1cp2: <= 32 tokens: 2 per micro-batch without context parallelism" in err
    assert "whose backward carries DDP's all-reduce" in err and err.count("one-token pass") == 1


def test_dp2_cp2_fsdp(reference: dict) -> None:
    """dp=2 x cp=2 (4 processes), three buckets of cp 1, 2, 2, FSDP zero=3 (kept gathered through
    the step, said once)."""
    plan = "dp=2,cp=2,zero=3,buckets=16x2cp1:32x1cp2:64x1cp2,precision=fp32"
    exercised(plan)
    got, err = train(reference["dir"], "dp2cp2", plan, nproc=4)
    close(reference["losses"], got)
    assert "FSDP's reduce-scatter (zero=3: parameters kept gathered" in err


def test_cp4_nested_units(reference: dict) -> None:
    """cp=4 (4 processes): buckets of cp 1, 2 and 4, so units of 2 ranks inside the cp group of 4
    (process groups of their own) and of 1 rank; recompute=full replays the cp attention in backward."""
    plan = "cp=4,buckets=16x2cp1:32x1cp2:64x1cp4,recompute=full,precision=fp32"
    exercised(plan)
    assert any(mb.cp == 2 for s in range(STEPS) for mb in layout(plan, s).micro_batches)  # type: ignore[attr-defined]
    got, _ = train(reference["dir"], "cp4", plan, nproc=4)
    close(reference["losses"], got)


def test_one_process(reference: dict) -> None:
    """buckets of cp 1 on one process (in this process): micro-batches of 2 and 1 samples, weighted."""
    import torch

    from meshplan.runtime.train import RunConfig, Trainer
    from meshplan.spec.io import load_model
    from meshplan.spec.lengths import parse_lengths
    from meshplan.spec.plan import parse_plan
    cfg = RunConfig(model=load_model("tiny-llama"), plan=parse_plan("buckets=16x4:32x2:64x1,precision=fp32"),
                    global_batch=8, steps=STEPS, seq_len=64, lengths=parse_lengths(LENGTHS))
    t = Trainer(cfg, None, torch.device("cpu"))
    close(reference["losses"], [t.train_step() for _ in range(STEPS)])


def test_runs_shard_the_padded_samples() -> None:
    """``PresetModel.bucket_runs``: a rank's rows of a cp micro-batch are its chunks (index, 2c-1-index)
    of the samples padded to a multiple of 2c (x tp with sequence parallelism); the unit's shards put
    together are the padded samples. A shard of padding only (a wide rounding) gets one target token
    0 and real=0 (weight 0), not an all-ignored loss (NaN)."""
    import torch

    from meshplan.runtime import data as data_mod
    from meshplan.runtime.context_parallel import shard_sequence
    from meshplan.runtime.hetero import IGNORE
    from meshplan.runtime.train import PresetModel, RunConfig
    from meshplan.spec.io import load_model
    from meshplan.spec.lengths import parse_lengths
    from meshplan.spec.plan import parse_plan
    cpu = torch.device("cpu")
    for text, sp_tp in (("cp=2,buckets=32x2cp1:64x1cp2", 1),
                        ("cp=2,tp=16,sequence_parallel=1,buckets=16x2cp2:64x1cp2", 16)):
        plan = parse_plan(text)
        cfg = RunConfig(model=load_model("tiny-llama"), plan=plan, global_batch=8, steps=1, seq_len=64,
                        lengths=parse_lengths(LENGTHS))
        model = PresetModel(cfg)
        lay = layout(text, 0)
        tokens = data_mod.global_batch(0, batch=8, seq_len=64, vocab=model.spec.vocab_size)
        runs = [model.bucket_runs(0, SimpleNamespace(dp_rank=0, cp=2, cp_rank=r), cpu) for r in range(2)]
        assert model.step_tokens == int(lay.lengths.sum())  # type: ignore[attr-defined]
        empty = 0
        for r in range(2):
            for run, j in zip(runs[r], lay.ranks[r]):  # type: ignore[attr-defined]
                mb = lay.micro_batches[j]  # type: ignore[attr-defined]
                mult = (2 * mb.cp if mb.cp > 1 else 1) * sp_tp
                assert run.width % mult == 0 and mb.width <= run.width < mb.width + mult
                x, y = data_mod.padded_rows(tokens, lay.lengths, list(mb.samples), run.width)  # type: ignore[attr-defined]
                if mb.cp > 1:
                    x, y = (shard_sequence(t, 2, r) for t in (x, y))
                assert torch.equal(run.batch.args[0], x)
                assert run.real == int((y != IGNORE).sum())
                if run.real == 0:
                    empty += 1
                    assert (run.batch.targets != IGNORE).sum() == 1
                else:
                    assert torch.equal(run.batch.targets, y)
        assert (empty > 0) == (sp_tp > 1), empty


def test_unweighted_would_differ() -> None:
    """What the tolerance must catch, at step 1: the mean of the bucket micro-batches' means (no
    real-token weights) is far from the global batch's mean over real tokens."""
    import torch

    from meshplan.runtime.models import build_model, loss_fn
    from meshplan.runtime.train import PresetModel, RunConfig
    from meshplan.spec.io import load_model
    from meshplan.spec.lengths import parse_lengths
    from meshplan.spec.plan import parse_plan
    cfg = RunConfig(model=load_model("tiny-llama"), plan=parse_plan("buckets=16x2:32x2:64x1,precision=fp32"),
                    global_batch=8, steps=1, seq_len=64, lengths=parse_lengths(LENGTHS))
    model = PresetModel(cfg)
    net = build_model(model.spec, 64)
    with torch.no_grad():
        per = [(float(loss_fn(net(*r.batch.args), r.batch.targets)), r.real)
               for r in model.bucket_runs(0, None, torch.device("cpu"))]
    weighted = sum(x * n for x, n in per) / sum(n for _, n in per)
    unweighted = sum(x for x, _ in per) / len(per)
    assert abs(weighted - unweighted) > 20 * TOL, (weighted, unweighted)


def test_refused() -> None:
    """Refused before any rank starts, in one line with a hint: packed or one-length workloads, a
    sample longer than the last bucket, local SGD / DiLoCo, ingested models."""
    plan = "cp=2,buckets=32x2cp1:64x1cp2"
    base = ["--model", "tiny-llama", "--global-batch", "8", "--steps", "1", "--plan"]
    for extra in (["--seq-len", LENGTHS, "--packing", "packed"], ["--seq-len", "64"], []):
        one_error_line(meshplan_train(*base, plan, *extra), "needs samples of several lengths that are not packed",
                       "drop buckets")
    one_error_line(meshplan_train(*base, plan, "--seq-len", "16:0.5,128:0.5"),
                   "the last limit 64 is below the longest sample (128)", "--seq-len")
    one_error_line(meshplan_train(*base, "dp=2," + plan + ",grad_sync=diloco,sync_every=2", "--seq-len", LENGTHS),
                   "grad_sync=diloco", "synchronous grad_sync")
    hf = ROOT / "tests" / "data" / "hf" / "llama-tiny.json"
    one_error_line(meshplan_train("--model", f"hf:{hf}", *base[2:], plan), "on an ingested model", "drop buckets")


def test_refused_in_process() -> None:
    """The same checks where the ranks meet them (hetero.check_buckets, Trainer)."""
    from meshplan.errors import MeshplanError
    from meshplan.runtime import hetero
    from meshplan.spec.lengths import parse_lengths
    from meshplan.spec.plan import parse_plan
    plan = parse_plan("cp=2,buckets=32x2cp1:64x1cp2")
    hetero.check_buckets(plan, parse_lengths(LENGTHS))
    hetero.check_lengths(plan, parse_lengths(LENGTHS))  # cp > 1 with varied lengths: allowed with buckets
    with pytest.raises(MeshplanError, match="ingested"):
        hetero.check_buckets(plan, None, ingested=True)
    with pytest.raises(MeshplanError, match="context parallelism splits"):  # without buckets: still refused
        hetero.check_lengths(parse_plan("cp=2"), parse_lengths(LENGTHS))
    with pytest.raises(MeshplanError, match="not packed"):
        hetero.check_lengths(plan, parse_lengths(LENGTHS, "packed"))


def test_pipeline_with_cp_pads_to_the_longest(reference: dict) -> None:
    """One-shape cp=2 under a pipeline (pp=2 x cp=2, 4 processes): every micro-batch is padded to the
    longest length (the schedule needs one shape), so it splits into 2 x cp chunks as one length
    does; a rank's chunks of two short samples hold no real target token (a 16-token sample's chunks
    1 and 2 of 4 are padding), which gives a finite loss weighted 0."""
    from meshplan.runtime import hetero
    from meshplan.spec.lengths import parse_lengths
    from meshplan.spec.plan import parse_plan
    plan = "pp=2,cp=2,micro_batch=2,precision=fp32"
    lay = [hetero.step_layout(parse_lengths(LENGTHS), parse_plan(plan), 8, s, 0) for s in range(STEPS)]
    assert any(int(x.lengths[list(mb)].max()) <= 16 for x in lay for mb in x.replicas[0])
    got, _ = train(reference["dir"], "pp2cp2", plan, nproc=4)
    close(reference["losses"], got)
