"""Heterogeneous hardware and data in `meshplan train` (runtime/hetero.py): uneven data-parallel
shares, GPU pools as placement, variable-length batches (padded, bucketed, packed).

Every comparison is of per-step losses (~5.5, fp32) between two runs that train on the same
samples of the same global batch, only grouped differently (other replicas, other micro-batches,
one process): the exact arithmetic is the same mean, so they differ by fp32 rounding alone. The
loss is a mean over 512 (fixed length) to ~800 (variable lengths) tokens; regrouping changes the
order of its sums and of the gradient's (all-reduce, micro-batch accumulation), a few ulps of
fp32 at 5.5 (1 ulp = 4.8e-7), and AdamW over 4 steps does not amplify that past ~1e-6 on the
loss. TOL = 1e-5 absolute (~21 ulps, 1.8e-6 relative) leaves 10x room; measured at most 9.5e-7.
Any weighting error is far beyond it: the unweighted variants (a mean of the replicas' means, a
mean of micro-batch means) are 5e-4 to 7.5e-4 away at step 1 already (``test_unweighted_would_differ``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import losses_close, meshplan_train, one_error_line, train_losses

TOL = 1e-5
STEPS = 4
BASE = ["--model", "tiny-llama", "--global-batch", "8", "--steps", str(STEPS), "--pg-timeout", "60"]
LENGTHS = "64:0.6,128:0.3,256:0.1"


def train(tmp: Path, name: str, plan: str, *extra: str, nproc: int = 2) -> tuple[list[float], str]:
    return train_losses(BASE, tmp, name, plan, *extra, nproc=nproc)


def close(a: list[float], b: list[float], tol: float = TOL) -> float:
    return losses_close(a, b, tol, STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fixed-length runs the tests compare: even DDP (the baseline) and dp_shares=3:1."""
    d = tmp_path_factory.mktemp("hetero")
    even, _ = train(d, "even", "dp=2,precision=fp32")
    shares, err = train(d, "shares", "dp=2,dp_shares=3:1,precision=fp32")
    return {"dir": d, "even": even, "shares": shares, "shares_err": err}


def test_dp_shares_equal_even_shares(runs: dict) -> None:
    """The done-when command: replica 0 trains on 6 samples (6 micro-batches), replica 1 on 2, the
    same 8 samples as the even run; the losses are the global batch's (weighted by 2/8 per
    micro-batch, not by 1/6 and 1/2)."""
    close(runs["even"], runs["shares"])
    assert "samples per replica 0: 6 (6 micro-batches), 1: 2 (2 micro-batches)" in runs["shares_err"]


def test_dp_shares_fsdp(runs: dict) -> None:
    """zero=3 with replicas of 3 and 1 micro-batches (micro_batch=2): FSDP keeps the parameters
    gathered through the step (the same collectives on both replicas; said once)."""
    got, err = train(runs["dir"], "fsdp", "dp=2,zero=3,micro_batch=2,dp_shares=3:1,precision=fp32")
    close(runs["even"], got)
    assert "zero=3 with uneven dp_shares" in err


def test_pools_are_placement(runs: dict) -> None:
    """pool_dp (with dp_shares) and pool_pp plans run, say which ranks stand for which pool, and
    train exactly as the plan without pools (pipeline stages: the same math as dp=2)."""
    got, err = train(runs["dir"], "pool_dp", "dp=2,dp_shares=3:1,pools=h100:a100,pool_dp=1:1,precision=fp32")
    assert got == runs["shares"]  # placement only: the same arithmetic
    assert "h100: rank 0 (replica 0); a100: rank 1 (replica 1)" in err and "emulated only by the cost model" in err
    got, err = train(runs["dir"], "pool_pp", "pp=2,stage_layers=1:1,pools=h100:a100,pool_pp=1:1,precision=fp32")
    close(runs["even"], got)
    assert "h100: rank 0 (stage 0); a100: rank 1 (stage 1)" in err
    assert err.count("pools (placement only)") == 1  # once, on rank 0


@pytest.fixture(scope="module")
def varlen(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process (dp=1, micro-batches of one sample: no padding at all) on the variable-length
    global batch, padded and packed."""
    d = tmp_path_factory.mktemp("varlen")
    padded, err = train(d, "one", "precision=fp32", "--seq-len", LENGTHS, nproc=1)
    packed, _ = train(d, "one_packed", "precision=fp32", "--seq-len", LENGTHS, "--packing", "packed", nproc=1)
    return {"dir": d, "padded": padded, "packed": packed, "err": err}


def test_variable_lengths_padded_and_bucketed(varlen: dict) -> None:
    """dp=2 with micro-batches of 2 samples padded to their longest (DDP), and bucketed under FSDP:
    the loss is the mean over the real tokens of the global batch, the one-process number (right
    padding is masked and causal attention never looks ahead, so grouping changes only rounding)."""
    got, err = train(varlen["dir"], "padded", "dp=2,micro_batch=2,precision=fp32", "--seq-len", LENGTHS)
    close(varlen["padded"], got)
    assert "--packing padded: each micro-batch padded to its longest sample" in err
    got, err = train(varlen["dir"], "bucketed", "dp=2,zero=3,micro_batch=2,precision=fp32", "--seq-len", LENGTHS,
                     "--packing", "bucketed")
    close(varlen["padded"], got)
    assert "--packing bucketed" in err


def test_variable_lengths_packed(varlen: dict) -> None:
    got, _ = train(varlen["dir"], "packed", "dp=2,precision=fp32", "--seq-len", LENGTHS, "--packing", "packed")
    close(varlen["packed"], got)
    assert abs(varlen["packed"][0] - varlen["padded"][0]) > 1e-4  # other data: windows of 256 tokens


def test_unweighted_would_differ() -> None:
    """What the tolerance must catch, at step 1 (initial weights): the logged loss of an unweighted
    run (the mean of the replicas' means; the mean of micro-batch means) is far from the weighted
    one. Computed in this process from the runtime's own batches and loss."""
    import torch

    from meshplan.runtime.train import RunConfig, Trainer
    from meshplan.spec.io import load_model
    from meshplan.spec.lengths import parse_lengths
    from meshplan.spec.plan import parse_plan

    def mb_losses(cfg: RunConfig) -> list[tuple[float, int]]:
        t = Trainer(cfg, None, torch.device("cpu"))
        b = t.model.rank_batch(0, None, torch.device("cpu"))
        with torch.no_grad():
            return [(float(t.model.loss(t.par.run_modules[0], mb)), int((mb.targets != -100).sum()))
                    for mb in (t.model.micro(b, i, cfg.plan.micro_batch, t.rows) for i in range(t.n_micro))]
    model = load_model("tiny-llama")
    per = [x for x, _ in mb_losses(RunConfig(model=model, plan=parse_plan("precision=fp32"), global_batch=8,
                                             steps=1))]
    weighted, unweighted = sum(per) / 8, (sum(per[:6]) / 6 + sum(per[6:]) / 2) / 2
    assert abs(unweighted - weighted) > 20 * TOL, (weighted, unweighted)
    mbs = mb_losses(RunConfig(model=model, plan=parse_plan("micro_batch=2,precision=fp32"), global_batch=8, steps=1,
                              seq_len=256, lengths=parse_lengths(LENGTHS)))
    tokens = sum(n for _, n in mbs)
    weighted = sum(x * n for x, n in mbs) / tokens
    unweighted = sum(x for x, _ in mbs) / len(mbs)
    assert len({n for _, n in mbs}) > 1  # the micro-batches do hold different numbers of real tokens
    assert abs(unweighted - weighted) > 20 * TOL, (weighted, unweighted)


def test_layouts() -> None:
    """spec/lengths.py's micro-batch formation, exactly: padded takes each replica's block in data
    order; bucketed sorts the step's samples by length and deals micro-batch j to replica j mod dp
    (round-robin over the replicas with room under dp_shares); packed documents fill the windows."""
    import numpy as np

    from meshplan.runtime import hetero
    from meshplan.spec.lengths import parse_lengths
    from meshplan.spec.plan import parse_plan
    dist = parse_lengths(LENGTHS)
    plan = parse_plan("dp=2,micro_batch=2")
    pad = hetero.step_layout(dist, plan, 8, 3, 0)
    assert pad.replicas == (((0, 1), (2, 3)), ((4, 5), (6, 7)))
    buck = hetero.step_layout(dist.with_packing("bucketed"), plan, 8, 3, 0)
    order = [i for mbs in zip(*buck.replicas) for mb in mbs for i in mb]  # j = 0, 1, 2, 3 in turn
    assert list(pad.lengths[order]) == sorted(pad.lengths)
    assert pad.total_tokens == buck.total_tokens == int(pad.lengths.sum())
    uneven = hetero.step_layout(dist.with_packing("bucketed"), parse_plan("dp=2,dp_shares=3:1"), 8, 3, 0)
    assert [len(r) for r in uneven.replicas] == [6, 2]
    assert [mb[0] for mb in uneven.replicas[1]] == [int(np.argsort(pad.lengths, kind="stable")[j]) for j in (1, 3)]
    docs = hetero.packed_documents(dist, 8 * 256 + 1, 3, 0)
    assert docs.sum() >= 8 * 256 + 1 > docs[:-1].sum()


def test_bad_input() -> None:
    """Refused before any rank starts, in one line with a hint."""
    one_error_line(meshplan_train(*BASE[:2], "--global-batch", "6", "--steps", "1", "--plan", "dp=2,dp_shares=3:1"),
                   "replica 0's share of --global-batch 6 is 4.5 samples", "multiple of 4")
    one_error_line(meshplan_train(*BASE[:2], "--global-batch", "4", "--steps", "1",
                                  "--plan", "dp=2,dp_shares=3:1,micro_batch=2"),
                   "not a whole number of micro-batches of micro_batch=2", "multiple of 8")
    one_error_line(meshplan_train(*BASE[:2], "--global-batch", "4", "--steps", "1", "--plan", "dp=2,cp=2",
                                  "--seq-len", LENGTHS), "context parallelism", "--packing packed")
