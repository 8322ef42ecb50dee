"""Published runs -> validation cases, and the validation report."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshplan.errors import MeshplanError
from meshplan.spec.constraints import violations
from meshplan.spec.io import preset_names
from meshplan.units import parse_count
from meshplan.validate import default_runs_path, load_runs, to_markdown, to_text, validate
from meshplan.cases import RunCase
from meshplan.validate.runs import (
    case_from_row,
    flops_kor22_hardware,
    flops_kor22_model,
    flops_meg21,
)

SOURCES = {"MEG_SC21_T1": 10, "KOR22_T5": 8, "TT_2024_A100": 8, "TT_2412_H100": 18,
           "MOSAIC_LLMFOUNDRY": 139, "BLOOM176B": 3,
           # added after the shared/data copy (row_ids from 2000, see src/meshplan/data/README.md)
           "BLOOM_PREQ_0228": 20, "BLOOM_PREQ_0225": 25, "NEMO_2407_H100": 12,
           "NEMO_LONGSEQ_H100": 9,
           # issue 27's out-of-memory and measured-memory rows (row_ids from 2100)
           "BIGS_TR3M_V100": 16, "BIGS_GPT2_52B_V100": 2, "TT_2506_H200_TRAINY": 2, "BLOOM_PREQ_0221": 21,
           "MCORE_FT_H100": 2, "MCORE_FT_H100_SMALL": 31, "MCORE_FT_A100": 2, "MEG_ISSUE_525": 1, "DS_TUT_ZERO": 3,
           "TT_2024_PERF_OOM": 1,
           # issue 27 item 5 (row_ids from 4000): the A100 golden values of the small Megatron-Core test cases,
           # and DeepSpeed issue #477's out-of-memory run
           "MCORE_FT_A100_SMALL": 30, "DS_ISSUE_477": 1, "MEGATRON_JZ_V100_16GB": 2,
           # issue 28: Megatron-Bridge performance summaries, all releases one source (row_ids from 3000)
           "MBRIDGE_PERF": 34}
#: Sources whose trained rows may carry no step time: measured memory only (Megatron-LM's functional-test
#: goldens of small test models, whose iteration times are overhead) or the outcome only (DeepSpeed's tutorial).
MEMORY_ONLY_SOURCES = {"MCORE_FT_H100", "MCORE_FT_H100_SMALL", "MCORE_FT_A100", "MCORE_FT_A100_SMALL", "DS_TUT_ZERO"}
N_SHARED = 186
"""Rows of the shared/data copy; the shipped file starts with them byte for byte."""


@pytest.fixture(scope="module")
def dev_path() -> Path:
    return default_runs_path()


@pytest.fixture(scope="module")
def cases(dev_path: Path) -> list[RunCase]:
    return load_runs(dev_path)


@pytest.fixture(scope="module")
def by_id(cases: list[RunCase]) -> dict[str, RunCase]:
    return {c.row_id: c for c in cases}


@pytest.fixture(scope="module")
def dev_rows(dev_path: Path) -> list[dict[str, str]]:
    with dev_path.open(newline="") as f:
        return list(csv.DictReader(f))


# ---- the shipped development set ---------------------------------------------------------
def test_default_path_is_the_packaged_copy(dev_path: Path) -> None:
    assert dev_path.name == "published_runs_dev.csv"
    assert dev_path.parent.name == "data" and dev_path.parent.parent.name == "meshplan"
    shared = Path(__file__).resolve().parents[3] / "shared" / "data" / "published_runs_dev.csv"
    if shared.is_file():  # the shipped copy = the shared rows, then the rows added here; the header may
        # end with optional columns added later (num_experts, ..., head_dim: issue 28), blank in the shared rows
        our_head, our_body = dev_path.read_bytes().split(b"\n", 1)
        head, body = shared.read_bytes().split(b"\n", 1)
        extra = our_head.rstrip(b"\r")[len(head.rstrip(b"\r")):]
        assert our_head.rstrip(b"\r").startswith(head.rstrip(b"\r")) and our_body.startswith(body)
        assert extra in (b"", b",num_experts,experts_per_token,expert_ffn_hidden_size,head_dim")


def test_all_dev_rows_load(cases: list[RunCase], dev_rows: list[dict[str, str]]) -> None:
    assert len(cases) == len(dev_rows) == sum(SOURCES.values()) >= N_SHARED
    assert [c.row_id for c in cases] == [r["row_id"] for r in dev_rows]
    counts: dict[str, int] = {}
    for c in cases:
        counts[c.source_id] = counts.get(c.source_id, 0) + 1
    assert counts == SOURCES


def test_every_dev_row_is_ok_or_explained(cases: list[RunCase]) -> None:
    unsupported = [(c.row_id, c.source_id, c.reason) for c in cases if c.status != "ok"]
    for row in unsupported:
        print("unsupported:", *row)
    assert all(reason for _, _, reason in unsupported)
    assert not unsupported, unsupported  # all dev rows are expressible today


def test_ok_cases_are_complete_and_feasible(cases: list[RunCase]) -> None:
    for c in cases:
        assert c.status == "ok"
        assert c.model and c.cluster and c.plan and c.work
        assert violations(c.model, c.cluster, c.plan, c.work) == []
        assert c.cluster.num_gpus == int(c.raw["num_gpus"])
        assert c.work.global_batch == int(c.raw["global_batch_seqs"])
        assert c.work.seq_len == int(c.raw["seq_len"])
        if c.run_status == "oom":  # a configuration its source reports out of memory
            assert c.measured_fits is False and c.measured_step_time_s is None, c.row_id
            continue
        assert c.run_status == "ok" and c.measured_fits is True
        if c.measured_step_time_s is None:  # issue 27's memory-only rows, or a run that trained, nothing timed
            assert c.raw["source_id"] in MEMORY_ONLY_SOURCES, c.row_id
            continue
        assert c.measured_step_time_s > 0, c.row_id
        assert c.measured_from


def test_gpu_mapping(cases: list[RunCase]) -> None:
    for c in cases:
        gt, mem = c.raw["gpu_type"], c.raw["gpu_memory_gb"]
        if c.row_id.isdigit() and int(c.row_id) >= 2000:  # the added sources: 80 GB H100 SXM, V100 16/32 GB, H200
            want = ("h100-sxm-96gb-500w" if gt.startswith("H100") and mem == "96"
                    else "h100-sxm-80gb" if gt.startswith("H100") else f"v100-sxm-{mem}gb" if gt.startswith("V100")
                    else "h200-sxm-141gb" if gt.startswith("H200") else "gb200-nvl72-186gb" if gt.startswith("GB200")
                    else "b200-sxm-192gb" if gt.startswith("B200") else f"a100-sxm-{mem}gb")
        else:
            want = ("h100-sxm-96gb-500w" if gt.startswith("H100")
                    else f"a100-sxm-{mem}gb")
        assert c.gpu_preset == want and c.cluster.gpu.name == want


def test_architecture_inference(by_id: dict[str, RunCase]) -> None:
    meg = by_id["1"].model
    assert (meg.position, meg.norm, meg.bias, meg.tied_embeddings) == (
        "learned", "layernorm", True, True)
    llama = by_id["66"].model
    assert (llama.position, llama.norm, llama.bias, llama.tied_embeddings, llama.mlp_type) == (
        "rotary", "rmsnorm", False, False, "swiglu")
    assert llama.kv_heads == 8
    bloom = by_id["1312"].model
    assert (bloom.position, bloom.bias, bloom.tied_embeddings, bloom.embedding_norm) == (
        "alibi", True, True, True)
    assert any("BLOOM family" in a for a in by_id["1312"].assumptions)
    # MPT: the row's text says biases and learned positions for these runs, which beats the
    # family default (ALiBi, no bias); tied output is the family default and is recorded.
    mpt = by_id["186"].model
    assert (mpt.position, mpt.norm, mpt.bias, mpt.tied_embeddings) == (
        "learned", "layernorm", True, True)
    assert any("MPT family" in a and "tied_embeddings=True" in a for a in by_id["186"].assumptions)


def test_mosaic_parameter_counts_match_reported(cases: list[RunCase]) -> None:
    # llm-foundry reports n_params exactly; the inferred MPT spec must reproduce it.
    for c in cases:
        if c.source_id == "MOSAIC_LLMFOUNDRY":
            assert c.model.num_params() == int(parse_count(c.raw["params_reported"])), c.row_id


def test_plan_mapping(by_id: dict[str, RunCase]) -> None:
    p = by_id["1"].plan  # Megatron, DDP, full recompute, fp16
    assert (p.tp, p.pp, p.dp, p.zero, p.micro_batch, p.recompute, p.precision) == (
        1, 1, 32, 0, 16, "full", "fp16")
    p = by_id["7"].plan  # interleaved, virtual stages 2
    assert (p.tp, p.pp, p.dp, p.schedule, p.virtual_stages) == (8, 8, 24, "interleaved-1f1b", 2)
    p = by_id["14"].plan  # selective + sequence parallel
    assert (p.recompute, p.sequence_parallel, p.schedule, p.virtual_stages) == (
        "selective", True, "interleaved-1f1b", 3)
    p = by_id["66"].plan  # torchtitan 'selective (layer)': half the blocks, full recompute
    assert (p.zero, p.recompute, p.recompute_layers) == (3, "full", 16)
    assert any("selective_ac_option=2" in a for a in by_id["66"].assumptions)
    assert by_id["67"].plan.recompute == "op"  # torchtitan 'selective (op)': op-level SAC
    p = by_id["79"].plan
    assert (p.precision, p.compile, p.async_tp) == ("fp8", True, False)
    p = by_id["88"].plan
    assert (p.tp, p.sequence_parallel, p.async_tp, p.compile) == (8, True, True, True)
    p = by_id["82"].plan
    assert (p.dp, p.cp) == (2, 4)
    p = by_id["186"].plan
    assert (p.zero, p.dp, p.micro_batch, p.recompute, p.precision) == (3, 64, 8, "full", "bf16")
    p = by_id["1312"].plan  # ZeRO-1 equivalent, 70 layers over 12 stages (DeepSpeed split)
    assert (p.zero, p.tp, p.pp, p.dp, p.schedule) == (1, 4, 12, 8, "1f1b")
    assert p.stage_layers is not None and sum(p.stage_layers) == 70 and len(p.stage_layers) == 12


def test_torchtitan_pipeline_defaults(by_id: dict[str, RunCase]) -> None:
    # 405B, pp=8, local batch 32: torchtitan defaults to n_microbatches = number of stages.
    c = by_id["89"]
    assert (c.plan.pp, c.plan.micro_batch, c.plan.schedule) == (8, 4, "1f1b")
    assert c.plan.stage_layers == (15, 16, 16, 16, 16, 16, 16, 15)
    assert any("n_microbatches" in a for a in c.assumptions)
    c = by_id["90"]  # interleaved, virtual stages not stated -> 2
    assert (c.plan.schedule, c.plan.virtual_stages, c.plan.micro_batch) == (
        "interleaved-1f1b", 2, 2)
    assert any("virtual_stages not stated" in a and "assumed 2" in a for a in c.assumptions)
    assert all(n % 2 == 0 for n in c.plan.stage_layers) and sum(c.plan.stage_layers) == 126


# ---- step-time conversions, hand-checked -------------------------------------------------
def test_kor22_step_time_is_reported(by_id: dict[str, RunCase]) -> None:
    c = by_id["14"]
    assert c.measured_step_time_s == pytest.approx(13.75)
    assert c.measured_from == "reported_step_time_s"
    # And the paper's MFU/HFU are reproduced by the KOR22 formulas from that step time.
    B, s, l, h, V, n = 64, 2048, 96, 12288, 51200, 64
    mfu = flops_kor22_model(B, s, l, h, V) / (13.75 * n * 312e12) * 100
    hfu = flops_kor22_hardware(B, s, l, h, V, "selective") / (13.75 * n * 312e12) * 100
    assert mfu == pytest.approx(51.4, abs=0.2) and hfu == pytest.approx(52.8, abs=0.2)


def test_mosaic_step_time_from_tokens_per_gpu(by_id: dict[str, RunCase]) -> None:
    c = by_id["186"]
    assert c.measured_step_time_s == pytest.approx(2048 * 2048 / (64 * 410))
    assert c.measured_from.startswith("reported_tokens_per_s_per_gpu")


def test_meg21_step_time_from_tflops_eq3(by_id: dict[str, RunCase]) -> None:
    c = by_id["1"]
    B, s, l, h, V, n = 512, 2048, 24, 2304, 51200, 32
    F = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert flops_meg21(B, s, l, h, V) == pytest.approx(F)
    assert c.measured_step_time_s == pytest.approx(F / (n * 137e12))
    assert "F_MEG21" in c.measured_from
    # the table's 44% (of 312) is consistent with that step time
    assert F / (c.measured_step_time_s * n * 312e12) == pytest.approx(0.44, abs=0.005)


def test_torchtitan_and_bloom_step_times(by_id: dict[str, RunCase]) -> None:
    assert by_id["89"].measured_step_time_s == pytest.approx(256 * 8192 / (512 * 100))
    assert by_id["89"].measured_peak_mem_gib == pytest.approx(82.5)
    assert by_id["66"].measured_step_time_s == pytest.approx(64 * 8192 / (64 * 2904))
    assert by_id["1312"].measured_step_time_s == pytest.approx(104.7)
    # 1314 has only "73 TFLOP/s" (hardware, Megatron-DeepSpeed formula, recompute factor 4)
    B, s, l, h, V = 192, 2048, 70, 14336, 250880
    F = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert by_id["1314"].measured_step_time_s == pytest.approx(F / (384 * 73e12))
    assert "F_BLOOM" in by_id["1314"].measured_from


def _only(row: dict[str, str], keep: str) -> dict[str, str]:
    """The row with every measurement blanked except ``keep``."""
    meas = [k for k in row if k.startswith("reported_") and k != "reported_peak_mem_gib"]
    return {k: ("" if k in meas and k != keep else v) for k, v in row.items()}


@pytest.mark.parametrize("col,tol", [
    ("reported_mfu_pct", 0.005), ("reported_hfu_pct", 0.012),
    ("reported_tokens_per_s_total", 0.005),
    ("reported_aggregate_pflops", 0.005)])
def test_formulas_agree_across_columns(dev_rows: list[dict[str, str]], by_id: dict[str, RunCase],
                                       col: str, tol: float) -> None:
    """Each source's other metrics (MFU, HFU, ...) convert to the same step time (rounding)."""
    checked = 0
    for r in dev_rows:
        if not r.get(col):
            continue
        c = case_from_row(_only(r, col))
        ref = by_id[r["row_id"]].measured_step_time_s
        assert c.measured_step_time_s == pytest.approx(ref, rel=tol), (r["row_id"], c.measured_from)
        checked += 1
    assert checked > 0


# ---- robustness on other CSVs ------------------------------------------------------------
def _write(tmp_path: Path, rows: list[dict[str, str]], drop: tuple[str, ...] = ()) -> Path:
    cols = [k for k in rows[0] if k not in drop]
    p = tmp_path / "runs.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return p


def test_odd_csv_loads_with_reasons(tmp_path: Path, dev_rows: list[dict[str, str]]) -> None:
    base = {r["row_id"]: r for r in dev_rows}
    unknown_gpu = dict(base["1"], row_id="u1", gpu_type="Gaudi2", gpu_memory_gb="96")
    blank_tp = dict(base["87"], row_id="u2", tp="")           # 256 GPUs, dp=32 -> tp=8 derived
    blank_tp_dp = dict(base["186"], row_id="u3", tp="", dp="not stated")
    oom = dict(base["188"], row_id="u4", status="OOM", micro_batch="4", global_batch_seqs="672",
               reported_mfu_pct="", reported_hfu_pct="", reported_tokens_per_s_per_gpu="",
               reported_tokens_per_s_total="", reported_samples_per_s="")
    h200 = dict(base["77"], row_id="u5", gpu_type="H200", gpu_memory_gb="141")
    v100 = dict(base["1"], row_id="u6", gpu_type="V100", gpu_memory_gb="32")
    a100_40 = dict(base["186"], row_id="u7", gpu_type="A100", gpu_memory_gb="40")
    bad_heads = dict(base["1"], row_id="u8", tp="5", dp="", num_gpus="40")
    unknown_things = dict(base["12"], row_id="u9", sharding="unknown", recompute="not stated",
                          precision="", pp_schedule="", sequence_parallel="")
    garbage = {k: "" for k in base["1"]}
    garbage["row_id"] = "u10"
    p = _write(tmp_path, [unknown_gpu, blank_tp, blank_tp_dp, oom, h200, v100, a100_40, bad_heads,
                          unknown_things, garbage], drop=("cp", "virtual_stages", "notes"))
    cases = {c.row_id: c for c in load_runs(p)}
    assert len(cases) == 10  # nothing dropped

    c = cases["u1"]
    assert c.status == "unsupported" and "Gaudi2" in c.reason
    assert c.plan is not None and c.cluster is None  # the plan is still read
    assert c.measured_step_time_s is not None  # still converted from its TFLOP/s

    c = cases["u2"]
    assert c.status == "ok", c.reason
    assert (c.plan.tp, c.plan.dp, c.plan.cp) == (8, 32, 1)
    assert any("tp not stated: derived" in a for a in c.assumptions)
    assert any("cp" in a and "assumed 1" in a for a in c.assumptions)  # missing column

    c = cases["u3"]
    assert c.status == "ok" and (c.plan.tp, c.plan.dp) == (1, 64)
    assert any("dp not stated: derived" in a for a in c.assumptions)
    assert any(a.startswith("tp") and "assumed 1" in a for a in c.assumptions)

    c = cases["u4"]
    assert c.status == "ok" and c.run_status == "oom" and c.measured_fits is False
    assert c.measured_step_time_s is None and "oom" in c.measured_from

    c = cases["u5"]
    assert c.gpu_preset == "h200-sxm-141gb"
    if "h200-sxm-141gb" in preset_names("gpus"):
        assert c.status == "ok", c.reason
    else:
        assert c.status == "unsupported" and "h200-sxm-141gb" in c.reason

    c = cases["u6"]
    assert c.gpu_preset == "v100-sxm-32gb"
    assert any("SXM2" in a for a in c.assumptions)
    if "v100-sxm-32gb" not in preset_names("gpus"):
        assert c.status == "unsupported" and "v100-sxm-32gb" in c.reason

    c = cases["u7"]
    assert c.status == "ok" and c.cluster.gpu.name == "a100-sxm-40gb"

    c = cases["u8"]  # tp=5 does not divide 24 heads nor a node
    assert c.status == "unsupported" and "tp" in c.reason

    c = cases["u9"]  # Megatron defaults filled in and recorded
    assert c.status == "ok", c.reason
    assert (c.plan.zero, c.plan.recompute, c.plan.precision, c.plan.sequence_parallel) == (
        0, "none", "bf16", False)
    text = " ".join(c.assumptions)
    for word in ("sharding", "recompute", "precision", "sequence_parallel"):
        assert word in text

    c = cases["u10"]
    assert c.status == "unsupported" and c.reason
    for c in cases.values():
        assert c.status in ("ok", "unsupported")
        assert (c.status == "ok") == (c.reason == "")


def test_hybrid_sharding_and_interleaved_default(tmp_path: Path,
                                                 dev_rows: list[dict[str, str]]) -> None:
    base = {r["row_id"]: r for r in dev_rows}
    hsdp = dict(base["84"], row_id="h1", sharding="HSDP (shard 8, replicate 16)")
    hsdp_blank = dict(base["84"], row_id="h2", sharding="HYBRID_SHARD")
    zb = dict(base["10"], row_id="h3", pp_schedule="zero bubble (ZB-H1)")
    gp = dict(base["10"], row_id="h4", pp_schedule="GPipe")
    inter = dict(base["7"], row_id="h5", virtual_stages="")
    uneven = dict(base["188"], row_id="h6", micro_batch="2", grad_accum="11")  # local batch 21
    p = _write(tmp_path, [hsdp, hsdp_blank, zb, gp, inter, uneven])
    cases = {c.row_id: c for c in load_runs(p)}
    assert (cases["h1"].plan.zero, cases["h1"].plan.shard_group) == (3, 8)
    assert cases["h2"].plan.shard_group == 8 and any("HYBRID_SHARD default" in a
                                                     for a in cases["h2"].assumptions)
    assert cases["h3"].plan.schedule == "zero-bubble"
    assert cases["h4"].plan.schedule == "gpipe"
    assert (cases["h5"].plan.schedule, cases["h5"].plan.virtual_stages) == ("interleaved-1f1b", 2)
    assert any("assumed 2" in a for a in cases["h5"].assumptions)
    assert cases["h6"].status == "ok" and cases["h6"].plan.micro_batch == 1
    assert any("uneven" in a for a in cases["h6"].assumptions)


def test_load_runs_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MeshplanError):
        load_runs(tmp_path / "nope.csv")


# ---- validate() and the renderers --------------------------------------------------------
@dataclass
class FakeEstimate:
    step_time_s: float
    peak_memory_gib: float
    fits: bool


def _fake(scale_t: float, mem: float = 70.0, fail_rows: frozenset[str] = frozenset()):
    def estimate(model, cluster, plan, work):
        if model.name in fail_rows:
            raise MeshplanError(f"cannot estimate {model.name}")
        # a step time that depends only on the inputs: 6*N*tokens at 40% of 312 TFLOP/s
        t = 6 * model.num_params() * work.tokens / (cluster.num_gpus * 312e12 * 0.4) * scale_t
        return FakeEstimate(step_time_s=t, peak_memory_gib=mem, fits=mem < cluster.gpu.memory_gib)
    return estimate


def test_validate_errors_and_summary(cases: list[RunCase]) -> None:
    est = _fake(1.0, mem=80.0, fail_rows=frozenset({"BLOOM-176B"}))
    res = validate(cases, est)
    rows, s = res["rows"], res["summary"]
    assert set(res) == {"rows", "summary"}
    assert set(rows[0]) == {
        "row_id", "source_id", "model", "status", "reason", "assumptions", "measured_step_time_s",
        "predicted_step_time_s", "step_time_error_pct", "measured_peak_memory_gib",
        "predicted_peak_memory_gib", "memory_error_pct", "memory_measure", "predicted_fits", "measured_fits",
        "measured_from", "verdict", "oom_probability", "predicted_step_time_s_low", "predicted_step_time_s_high",
        "predicted_peak_memory_gib_high"}
    assert set(s) == {"rows", "ok", "unsupported", "step_time_mape_pct", "step_time_max_abs_pct",
                      "memory_mape_pct", "memory_rows", "memory_mape_pct_by_measure", "memory_rows_by_measure",
                      "fit_verdicts", "by_source"}
    assert s["rows"] == len(cases) and s["unsupported"] == 3 and s["ok"] == len(cases) - 3
    for r in rows:
        if r["model"] == "BLOOM-176B":
            assert r["status"] == "unsupported" and "cannot estimate" in r["reason"]
            assert r["predicted_step_time_s"] is None and r["step_time_error_pct"] is None
    # errors recomputed independently
    errs, merrs = [], []
    for c, r in zip(cases, rows):
        if r["status"] != "ok":
            continue
        pred = est(c.model, c.cluster, c.plan, c.work)
        if c.measured_step_time_s is not None:  # None: an 'oom' row, or a memory-only row
            want = (pred.step_time_s - c.measured_step_time_s) / c.measured_step_time_s * 100
            assert r["step_time_error_pct"] == pytest.approx(want)
            assert r["predicted_fits"] == pred.fits
            errs.append(want)
        elif c.measured_peak_mem_gib is None:
            continue
        if c.measured_peak_mem_gib is not None:
            mw = (80.0 - c.measured_peak_mem_gib) / c.measured_peak_mem_gib * 100
            assert r["memory_error_pct"] == pytest.approx(mw)
            merrs.append(mw)
        else:
            assert r["memory_error_pct"] is None
    assert s["step_time_mape_pct"] == pytest.approx(sum(map(abs, errs)) / len(errs))
    assert s["step_time_max_abs_pct"] == pytest.approx(max(map(abs, errs)))
    assert s["memory_rows"] == len(merrs) == sum(
        c.measured_peak_mem_gib is not None for c, r in zip(cases, rows) if r["status"] == "ok")
    assert s["memory_mape_pct"] == pytest.approx(sum(map(abs, merrs)) / len(merrs))
    bs = s["by_source"]
    assert set(bs) == set(SOURCES)
    assert {k: v["rows"] for k, v in bs.items()} == SOURCES
    assert bs["BLOOM176B"]["mape_pct"] is None and bs["BLOOM176B"]["memory_mape_pct"] is None
    tt = [e for c, e in zip([c for c, r in zip(cases, rows) if r["status"] == "ok"
                             and c.measured_peak_mem_gib is not None], merrs)
          if c.source_id == "TT_2412_H100"]
    assert len(tt) == 18
    assert bs["TT_2412_H100"]["memory_mape_pct"] == pytest.approx(sum(map(abs, tt)) / len(tt))
    meg = [e for c, e in zip([c for c, r in zip(cases, rows) if r["status"] == "ok"], errs)
           if c.source_id == "MEG_SC21_T1"]
    assert bs["MEG_SC21_T1"]["mape_pct"] == pytest.approx(sum(map(abs, meg)) / len(meg))


def test_validate_exact_scale_and_signs(cases: list[RunCase]) -> None:
    sub = [c for c in cases if c.source_id == "KOR22_T5"]

    def exact(scale):
        def est(model, cluster, plan, work):
            c = next(c for c in sub if c.work is work)
            return FakeEstimate(step_time_s=c.measured_step_time_s * scale, peak_memory_gib=1.0,
                                fits=True)
        return est

    res = validate(sub, exact(1.1))
    assert all(r["step_time_error_pct"] == pytest.approx(10.0) for r in res["rows"])
    assert res["summary"]["step_time_mape_pct"] == pytest.approx(10.0)
    res = validate(sub, exact(0.8))
    assert all(r["step_time_error_pct"] == pytest.approx(-20.0) for r in res["rows"])
    assert res["summary"]["step_time_max_abs_pct"] == pytest.approx(20.0)
    assert res["summary"]["memory_rows"] == 0 and res["summary"]["memory_mape_pct"] is None


def test_unsupported_rows_are_not_estimated(tmp_path: Path, dev_rows: list[dict[str, str]]) -> None:
    row = dict(dev_rows[0], gpu_type="Gaudi2", row_id="x")
    cases = load_runs(_write(tmp_path, [row, dev_rows[1]]))
    calls = []

    def est(model, cluster, plan, work):
        calls.append(model.name)
        return FakeEstimate(step_time_s=math.inf, peak_memory_gib=10.0, fits=False)

    res = validate(cases, est)
    assert calls == [dev_rows[1]["model"]]
    r0, r1 = res["rows"]
    assert r0["status"] == "unsupported" and "Gaudi2" in r0["reason"]
    assert r1["predicted_step_time_s"] is None and r1["step_time_error_pct"] is None  # inf ignored
    assert r1["predicted_fits"] is False
    assert res["summary"]["step_time_mape_pct"] is None


def test_renderers(cases: list[RunCase]) -> None:
    res = validate(cases, _fake(1.2, fail_rows=frozenset({"BLOOM-176B"})))
    md = to_markdown(res)
    assert "| source |" in md and "| row |" in md
    for src in SOURCES:
        assert src in md
    assert md.count("\n| ") >= len(cases) + len(SOURCES)
    assert "cannot estimate BLOOM-176B" in md
    import re
    for block in md.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln.startswith("| ")]
        if lines:  # every line of a table has the same number of unescaped cell separators
            assert len({len(re.findall(r"(?<!\\)\|", ln)) for ln in lines}) == 1
    txt = to_text(res)
    lines = txt.splitlines()
    assert any(line.startswith("source") for line in lines)
    row_lines = [line for line in lines if line.startswith(("row ", "---"))]
    assert row_lines
    # aligned: every data line of the per-row table starts its 'status' column at one offset
    hdr = next(line for line in lines if line.startswith("row "))
    col = hdr.index("status")
    n = len(cases)
    body = lines[lines.index(hdr) + 2:lines.index(hdr) + 2 + n]
    assert lines[lines.index(hdr) + 2 + n] == ""  # the source table and summary follow
    assert all(line[col:col + 2] in ("ok", "un") for line in body)


def test_garbled_rows_never_raise(dev_rows: list[dict[str, str]]) -> None:
    import random

    rnd = random.Random(7)
    junk = ["", "not stated", "unknown", "0", "-3", "1e400", "abc", "2.5", "1,024", "yes", "none",
            "nan", "12 (approx)", "100000"]
    for _ in range(300):
        r = dict(rnd.choice(dev_rows))
        for k in rnd.sample(list(r), rnd.randint(1, 6)):
            r[k] = rnd.choice(junk)
        if rnd.random() < 0.2:
            del r[rnd.choice(list(r))]
        c = case_from_row(r)
        assert c.status in ("ok", "unsupported")
        assert (c.status == "ok") == (not c.reason)
        assert "could not read the row" not in c.reason, c.reason
        if c.status == "ok":
            assert violations(c.model, c.cluster, c.plan, c.work) == []


def test_implementation_details_mapped(by_id):
    # Megatron 2021 used the unfused softmax; llm-foundry a fused cross-entropy; GPT-style
    # Megatron models train with dropout; BLOOM ran on Jean Zay's Omni-Path links.
    assert by_id["1"].plan.flash_attention is False and by_id["1"].model.dropout is True
    assert by_id["186"].plan.fused_loss is True and by_id["186"].plan.flash_attention is True
    assert by_id["66"].plan.fused_loss is False and by_id["66"].model.dropout is False
    c = by_id["1312"].cluster
    assert c.inter_node.bandwidth_gbps == 6.25 and c.num_gpus == 384
    assert any("jean-zay-a100" in a for a in by_id["1312"].assumptions)


def test_fit_verdicts_count_oom_rows(tmp_path: Path) -> None:
    """A run that trained and one that ran out of memory: the summary says which verdicts
    the model got right, by row."""
    import csv
    src = default_runs_path()
    rows = list(csv.DictReader(src.open()))
    ok = dict(next(r for r in rows if r["source_id"] == "MOSAIC_LLMFOUNDRY"))
    oom = dict(ok, row_id="9001", status="oom", reported_mfu_pct="", reported_hfu_pct="",
               reported_tokens_per_s_per_gpu="", reported_tokens_per_s_total="")
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows([ok, oom])
    res = validate(load_runs(path), _fake(1.0, mem=10.0))  # predicts both fit
    v = res["summary"]["fit_verdicts"]
    assert v["runs_that_fit"] == 1 and v["runs_that_fit_predicted_oom"] == []
    assert v["oom_runs"] == 1 and v["oom_runs_predicted_to_fit"] == ["9001"]
    assert v["accuracy"] == 0.5
    assert "0/1 out-of-memory runs predicted not to fit (predicted to fit: row 9001)" in to_text(res)


def test_default_peak_follows_the_source_convention() -> None:
    """Composer divides fp8 runs by the fp8 peak; torchtitan and Megatron quote the 16-bit one."""
    from meshplan.validate.runs import default_peak_tflops
    assert default_peak_tflops("h100-sxm-80gb", "H100-SXM", "fp8", "llm-foundry")[0] == 1979.0
    assert default_peak_tflops("h100-sxm-80gb", "H100-SXM", "bf16", "llm-foundry")[0] == 989.0
    assert default_peak_tflops("h100-sxm-80gb", "H100-SXM", "fp8", "torchtitan")[0] == 989.0
    assert default_peak_tflops("h100-pcie-80gb", "H100 PCIe", "bf16", "megatron")[0] == 756.0
    assert default_peak_tflops("a100-sxm-80gb", "A100-SXM", "bf16", "llm-foundry")[0] == 312.0


def test_fused_kernels_assumed_for_megatron_and_deepspeed(by_id: dict[str, RunCase]) -> None:
    """Megatron-LM and Megatron-DeepSpeed run hand-fused norms, bias-GeLU and
    bias-dropout-add without torch.compile: costed on the fused path, and said so. Other
    frameworks stay eager unless the row says torch.compile."""
    for rid in ("1", "14", "1312"):  # SC'21, Korthikanti et al., BLOOM
        c = by_id[rid]
        assert c.plan.compile, rid
        assert any("hand-fused kernels" in a for a in c.assumptions), rid
    c = by_id["66"]  # torchtitan without compile
    assert not c.plan.compile and not any("hand-fused" in a for a in c.assumptions)
    c = next(c for c in by_id.values() if c.source_id == "MOSAIC_LLMFOUNDRY")
    assert not c.plan.compile


@pytest.mark.parametrize("status,fits", [
    ("oom", False), ("OOM", False), ("failed (OOM)", False), ("failed: CUDA out of memory", False),
    ("memory limit exceeded", False), ("ok", True), ("completed", True), ("failed (NCCL timeout)", None),
    ("zoom", None), ("ok (no OOM)", True), ("OOM-free", None), ("ok; memory limited to 70GB", True),
    ("killed: host OOM", None), ("failed: cpu oom killer", None)])
def test_status_column_variants(status: str, fits: bool | None) -> None:
    rows = list(csv.DictReader(default_runs_path().open()))
    c = case_from_row(dict(rows[0], status=status))
    assert c.measured_fits is fits


def test_grace_hopper_and_h100_nvl_rows_are_expressible() -> None:
    rows = list(csv.DictReader(default_runs_path().open()))
    r = next(r for r in rows if r["source_id"] == "MOSAIC_LLMFOUNDRY" and r["num_gpus"] == "64")
    c = case_from_row(dict(r, gpu_type="GH200", gpu_memory_gb="96"))
    assert c.ok and c.cluster.gpu.name == "gh200-96gb" and c.cluster.gpus_per_node == 4
    assert any("nodes of 4 GPUs" in a for a in c.assumptions)
    c = case_from_row(dict(r, gpu_type="GH200 (HBM3e)", gpu_memory_gb="144"))
    assert c.cluster.gpu.name == "gh200-144gb"
    c = case_from_row(dict(r, gpu_type="H100 NVL", gpu_memory_gb="94"))
    assert c.ok and c.cluster.gpu.name == "h100-nvl-94gb"
    c = case_from_row(dict(r, gpu_type="GB200"))  # one 72-GPU NVLink domain holds the 64 GPUs
    assert c.ok and c.cluster.gpu.name == "gb200-nvl72-186gb" and c.cluster.num_nodes == 1


def test_fused_kernels_only_for_megatron_code(by_id: dict[str, RunCase]) -> None:
    """Plain DeepSpeed (HF Trainer + ZeRO) rows stay eager; Megatron-DeepSpeed rows are fused."""
    raw = dict(by_id["1312"].raw)  # BLOOM, Megatron-DeepSpeed
    plain = {k: v for k, v in raw.items()}
    for k in ("source", "source_id", "model", "other_settings", "notes", "source_locator",
              "metric_formula_id", "tflops_kind", "arch_family", "attention_impl"):
        plain[k] = ""
    plain.update(source_id="HF_DS", source="HF Trainer with DeepSpeed ZeRO-3", model="GPT-like",
                 arch_family="GPT", sharding="DeepSpeed ZeRO-3")
    c = case_from_row(plain)
    assert c.framework == "deepspeed" and not c.plan.compile, c.assumptions
    assert by_id["1312"].plan.compile


def test_gh200_rows_name_their_peak_and_memory() -> None:
    from meshplan.validate.runs import default_peak_tflops, gpu_preset_for
    peak, how = default_peak_tflops("gh200-96gb", "GH200", "bf16", "megatron")
    assert peak == 989.0 and how.startswith("GH200")
    assert gpu_preset_for("GH200 HBM3e", None, lambda s: None) == "gh200-144gb"


def test_named_settings_and_cost_overrides(dev_rows: list[dict[str, str]]) -> None:
    """Cells naming framework settings reach the Plan (async_tp) and the case's CostParams overrides."""
    from meshplan.validate.plans import named_setting

    assert named_setting("overlap_p2p_comm=true", r"overlap[\s_-]*p2p[\s_-]*comm") is True
    assert named_setting("overlap_p2p_comm: False", r"overlap[\s_-]*p2p[\s_-]*comm") is False
    assert named_setting("no overlap_p2p_comm", r"overlap[\s_-]*p2p[\s_-]*comm") is False
    assert named_setting("--overlap-p2p-comm", r"overlap[\s_-]*p2p[\s_-]*comm") is True
    assert named_setting("batch_p2p_comm=True", r"overlap[\s_-]*p2p[\s_-]*comm") is None
    nemo = next(r for r in dev_rows if r["source_id"] == "NEMO_2407_H100")
    base = dict(nemo, tp="4", pp="4", cp="1", num_gpus="64", dp="4", virtual_stages="5",
                pp_schedule="interleaved", global_batch_seqs="128", micro_batch="1", grad_accum="32",
                num_layers="80", hidden_size="8192", num_attention_heads="64", num_kv_heads="8",
                ffn_hidden_size="28672", mlp_type="swiglu")
    on = case_from_row(dict(base, other_settings="NeMo; tp_comm_overlap=True; overlap_p2p_comm=True"))
    assert on.ok and on.plan.async_tp and on.overrides.get("pp_p2p_exposed") == 0.0
    off = case_from_row(dict(base, other_settings="NeMo; ub_tp_comm_overlap: False; overlap_p2p_comm=False"))
    assert off.ok and not off.plan.async_tp and "pp_p2p_exposed" not in off.overrides
    flat = case_from_row(dict(base, virtual_stages="1", pp_schedule="1F1B", other_settings="overlap_p2p_comm=True"))
    assert "pp_p2p_exposed" not in flat.overrides  # only the interleaved schedule overlaps them
    grad = case_from_row(dict(base, other_settings="NeMo; overlap_grad_reduce=False"))
    assert grad.overrides.get("dp_overlap") is False
    # megatron-core's DistributedDataParallelConfig.grad_reduce_in_fp32: the gradient buffer's dtype
    bf = case_from_row(dict(base, other_settings="NeMo; grad_reduce_in_fp32=False"))
    assert bf.overrides.get("main_grads") == "bf16"
    assert "main_grads" not in case_from_row(dict(base, other_settings="NeMo")).overrides
    bloom = next(r for r in dev_rows if r["source_id"] == "BLOOM_PREQ_0225")
    c = case_from_row(bloom)
    assert c.ok and c.plan.precision == "fp16" and c.overrides["main_grads"] == "bf16"
    assert abs(c.overrides["cuda_context_gib"] - 1573 / 1024) < 1e-3
    assert c.plan.zero == 1 and c.plan.recompute == "full"
    plain = case_from_row(dict(bloom, precision="fp16", other_settings="Megatron-DeepSpeed"))
    assert "main_grads" not in plain.overrides and "cuda_context_gib" not in plain.overrides
