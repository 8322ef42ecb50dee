"""Issue 28 (ranking): synchronous kernel launches (CUDA_LAUNCH_BLOCKING=1) and DeepSpeed's partitioned
pipeline sends, the two things the Megatron-DeepSpeed sweeps ran with that the cost model did not price.

BigScience's A100 runs of 320+ GPUs set CUDA_LAUNCH_BLOCKING=1 (chronicles-prequel 'dealing with JZ
hanging'): every kernel then waits for the host's gap before it, a cost per kernel and so per
micro-batch that a larger micro-batch does not shrink; the sweeps got faster up to micro-batch 4 where
the model (bubble only) said slower. DeepSpeed's PipelineEngine sends 1/tp of each activation
(is_pipe_partitioned = is_model_parallel) where the cases sent it whole."""
from __future__ import annotations

import dataclasses

import pytest

from meshplan.calibration.space import by_name
from meshplan.cases import case_params
from meshplan.cost.batch import layout
from meshplan.cost.layer import kernel_counts, quantities
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.step import estimate
from meshplan.validate import default_runs_path, load_runs
from meshplan.spec.transformer import as_graph
from meshplan.validate.plans import launch_blocking


@pytest.fixture(scope="module")
def by_id() -> dict:
    return {c.row_id: c for c in load_runs(default_runs_path())}


def _block(case):
    lay = layout(as_graph(case.model, case.work.seq_len))
    return next(o for o, b in zip(lay.ops, lay.is_block) if b)


@pytest.mark.parametrize("text, on", [
    ("export CUDA_LAUNCH_BLOCKING=1 ('do not remove or the training will hang', tr11-200B-ml.slurm)", True),
    ("...; CUDA_LAUNCH_BLOCKING=1; ...", True),
    ("cuda_launch_blocking = 1", True),
    ("CUDA_LAUNCH_BLOCKING=1 commented out in the script of these dates", False),
    ("#export CUDA_LAUNCH_BLOCKING=1", False),
    ("# export CUDA_LAUNCH_BLOCKING=1", False),
    ("CUDA_LAUNCH_BLOCKING=0", False),
    ("no launch setting named", False),
])
def test_launch_blocking_cell(text: str, on: bool) -> None:
    assert launch_blocking(text.lower()) is on


def test_rows_that_set_it_run_with_it(by_id: dict) -> None:
    # BLOOM_PREQ_0228: 'export CUDA_LAUNCH_BLOCKING=1' (tr11-200B-ml.slurm@1a13e1f); 0221: 'commented out'
    assert by_id["2000"].overrides.get("launch_blocking") is True
    assert case_params(by_id["2000"]).launch_blocking
    assert not case_params(by_id["2120"]).launch_blocking
    assert any("CUDA_LAUNCH_BLOCKING=1" in a for a in by_id["2000"].assumptions)
    # other codebases' rows never do
    assert not case_params(by_id["1"]).launch_blocking


def test_deepspeed_pipeline_sends_are_partitioned(by_id: dict) -> None:
    # DeepSpeed's PipelineEngine: is_pipe_partitioned = is_grad_partitioned = is_model_parallel
    for rid in ("2120", "2000", "1312"):
        p = by_id[rid].plan
        assert p.tp > 1 and p.pp > 1 and p.p2p_sharded


def test_kernel_counts_of_a_megatron_block(by_id: dict) -> None:
    f, bi, bw = kernel_counts(_block(by_id["2120"]), True, False, case_params(by_id["2120"]))
    assert (f, bi, bw) == (22, 22, 12)  # 4 GEMMs, unfused attention core, a block's memory-bound ops
    assert f + bi + bw + f == 78  # with full recompute: the count launch_gap_s's prior divides by


def test_gap_is_paid_per_kernel_not_per_token(by_id: dict) -> None:
    """The added seconds of a block's passes are launch_gap_s x its kernels at any micro-batch."""
    case = by_id["2120"]
    o = _block(case)
    p = case_params(case)
    on = p.replace(launch_blocking=True, launch_gap_s=40e-6)
    for mb in (1, 4):
        plan = dataclasses.replace(case.plan, micro_batch=mb)
        q0 = quantities(o, plan, case.work.seq_len, case.cluster.gpu, p)
        q1 = quantities(o, plan, case.work.seq_len, case.cluster.gpu, on)
        assert q1["f"] - q0["f"] == pytest.approx(22 * 40e-6)
        assert q1["bi"] - q0["bi"] == pytest.approx(22 * 40e-6)
        assert q1["bw"] - q0["bw"] == pytest.approx(12 * 40e-6)
        assert q1["rc"] - q0["rc"] == pytest.approx(22 * 40e-6)  # full recompute relaunches the forward


def test_off_by_default_changes_nothing(by_id: dict) -> None:
    assert CostParams().launch_blocking is False and DEFAULT_PARAMS.launch_blocking is False
    case = by_id["2120"]
    p = case_params(case)
    a = estimate(case.model, case.cluster, case.plan, case.work, p).step_time_s
    b = estimate(case.model, case.cluster, case.plan, case.work, p.replace(launch_gap_s=1e-3)).step_time_s
    assert a == b


def test_step_cost_counts_every_micro_batch_of_every_block(by_id: dict) -> None:
    """1F1B on even stages: the step grows by (m + pp - 1) x blocks per stage x 78 kernels x gap (the
    blocks' passes are on the critical path in the steady state and in the bubble alike)."""
    case = by_id["2120"]  # 72 blocks, pp = 12, dp = 4, B = 2048, mb = 1: m = 512
    p = case_params(case)
    gap = 30e-6
    base = estimate(case.model, case.cluster, case.plan, case.work, p).step_time_s
    on = estimate(case.model, case.cluster, case.plan, case.work,
                  p.replace(launch_blocking=True, launch_gap_s=gap)).step_time_s
    m, pp, per_stage = 512, 12, 72 // 12
    lay = layout(as_graph(case.model, case.work.seq_len))
    others = sum(sum(kernel_counts(o, False, False, p)) for o, b in zip(lay.ops, lay.is_block) if not b)
    assert 0 < others < 78  # the embedding, final norm and logits layers: a few kernels each
    # the critical (last) stage: its blocks, plus at most every non-block layer
    assert (m + pp - 1) * per_stage * 78 * gap <= on - base <= (m + pp - 1) * (per_stage * 78 + others) * gap + 1e-9


def test_micro_batch_order_of_the_bloom_sweep(by_id: dict) -> None:
    """BLOOM_PREQ_0221, pp = 12: measured 143.3 s at micro-batch 1 and 123.7 s at 4. Without the launch
    gaps the model ranks micro-batch 4 slower (a bigger bubble); with them (the prior) faster, as run."""
    mb1, mb4 = by_id["2120"], by_id["2122"]
    assert mb1.measured_step_time_s > mb4.measured_step_time_s

    def t(case, **kw) -> float:
        return estimate(case.model, case.cluster, case.plan, case.work, case_params(case).replace(**kw)).step_time_s

    assert t(mb4) > t(mb1)
    assert t(mb4, launch_blocking=True) < t(mb1, launch_blocking=True)


def test_fittable_prior_is_the_class_default() -> None:
    f = by_name("launch_gap_s")
    assert f.target == "time" and f.log
    assert f.low < f.prior < f.high
    assert f.prior == CostParams().launch_gap_s
    # the prior: 3.5 ms per block per micro-batch (BigScience's 80-GPU A/B) over a block's 78 kernels
    assert f.prior * 78 == pytest.approx(3.5e-3, rel=0.02)
