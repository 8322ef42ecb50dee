"""Models beyond decoder transformers through `meshplan train`'s trainer, on CPU (torchrun, gloo, fp32):
ResNet-50 (BatchNorm), a vision transformer and a graph neural network written as nn.Modules
(tests/data/modules, ``module:`` factories), and Hugging Face BERT and ViT configs (``hf:``, tiny
configs written by the test). Each trains under data parallelism (zero=0, DDP), FSDP (zero=3), a
pipeline (pp=2: stages count the blocks, the stem/embeddings go with the first stage, the head with
the last) and, where its blocks have column/row linear pairs, tensor parallelism (tp=2; the ResNet's
convolution pairs: tests/dist/test_conv_tp_runtime.py); the losses
and gradient norms of every step must equal a single-process run of the same global batch in the
same micro-batches (train.reference_run: BatchNorm normalises each micro-batch with its own
statistics) within ``TOLERANCE`` of the precision. Also: a checkpoint saved under FSDP resumed under
a pipeline (ResNet, BatchNorm buffers included), and `meshplan train` itself on the ResNet (pp=2,
with a checkpoint) against the reference.

One torchrun launch holds every case (examples_worker.py).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCH_TIMEOUT_S, ROOT, meshplan_train, run_env, torchrun_worker

pytest.importorskip("torch")

MODULES = ROOT / "tests" / "data" / "modules"
WORKER = Path(__file__).with_name("examples_worker.py")
TOLERANCE = {"fp32": 1e-5}
"""Largest relative difference of a step's loss or gradient norm from the single-process run. fp32:
a few steps of rounding (eps 1.2e-7) in reductions of another order (data-parallel sums, pipeline
micro-batches, split GEMMs) stay below 1e-6 here (measured: at most 1.1e-7 on these models); a wrong
reduction (a gradient averaged twice, a rank's micro-batch missing) is off by far more than 1e-5."""
BATCH, STEPS = 4, 3
RESNET, VIT, GNN = "module:resnet50:make_resnet50_tiny", "module:vit:make_vit_tiny", "module:gnn:make_gnn_tiny"
BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 64, "type_vocab_size": 2,
        "vocab_size": 128, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "tie_word_embeddings": False}
"""A tiny BERT (masked LM), dropout off (one process's masks are not a distributed run's), output
projection untied from the embedding (tied weights cannot live on two pipeline stages)."""
HF_VIT = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "image_size": 16,
          "patch_size": 4, "num_channels": 3, "num_labels": 10, "hidden_dropout_prob": 0.0,
          "attention_probs_dropout_prob": 0.0}
PLANS = {"ddp": "dp=2,zero=0,micro_batch=1", "fsdp": "dp=2,zero=3,micro_batch=1", "pp": "pp=2,micro_batch=1",
         "tp": "tp=2,micro_batch=2"}
MODELS = {"resnet": (RESNET, ("ddp", "fsdp", "pp")), "vit": (VIT, ("ddp", "fsdp", "pp", "tp")),
          "gnn": (GNN, ("ddp", "fsdp", "pp", "tp")), "bert": ("bert", ("ddp", "fsdp", "pp")),
          "hf_vit": ("hf_vit", ("ddp", "fsdp", "pp"))}
RESUME = ("resnet_fsdp_to_pp", RESNET, PLANS["pp"], {"plan": PLANS["fsdp"] + ",precision=fp32", "steps": 1})
NAMES = [f"{m}_{p}" for m, (_, plans) in MODELS.items() for p in plans] + [RESUME[0]]


def modules_env() -> dict[str, str]:
    return run_env(PYTHONPATH=f"{MODULES}:{ROOT / 'src'}")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("hf")
    out = {}
    for name, config in (("bert", BERT), ("hf_vit", HF_VIT)):
        (d / f"{name}.json").write_text(json.dumps(config))
        out[name] = f"hf:{d / name}.json"
    return out


def case(name: str, source: str, plan: str, resume: dict | None = None) -> dict:
    c = {"name": name, "source": source, "plan": plan + ",precision=fp32", "global_batch": BATCH, "steps": STEPS}
    if source.startswith("hf:") and "bert" in source:
        c["seq_len"] = 16
    if resume:
        c["resume"] = resume
    return c


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, str]) -> dict[str, list[dict]]:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("examples")
    cases = [case(f"{m}_{p}", sources.get(src, src), PLANS[p]) for m, (src, plans) in MODELS.items() for p in plans]
    cases.append(case(RESUME[0], RESUME[1], RESUME[2], RESUME[3]))
    return torchrun_worker(tmp, 2, cases, WORKER, modules_env())


def close(got: list[float], ref: list[float], tol: float) -> bool:
    return len(got) == len(ref) and all(abs(a - b) <= tol * abs(b) for a, b in zip(got, ref))


@pytest.mark.parametrize("name", NAMES)
def test_matches_single_process(results: dict[str, list[dict]], name: str) -> None:
    ranks = results[name]
    log = results["__log__"][0]
    assert len(ranks) == 2, f"{len(ranks)}/2 ranks reported; torchrun rc={log['rc']}\n{log['stderr']}"
    tol = TOLERANCE["fp32"]
    for r in ranks:
        assert r["ok"], f"rank {r['rank']}: {r.get('error')}\n{r.get('trace', '')[-2000:]}"
        assert close(r["losses"], r["ref_losses"], tol), (r["losses"], r["ref_losses"])
        assert close(r["norms"], r["ref_norms"], tol), (r["norms"], r["ref_norms"])
        assert not r["unknown_params"], r["unknown_params"]
    held = set().union(*(r["params"] for r in ranks))  # pipeline stages together hold every parameter
    assert held == set(ranks[0]["ref_params"])
    expected = {"ddp": "ddp", "fsdp": "fsdp", "pp": "none", "tp": "none"}[name.rsplit("_", 1)[-1]]
    assert all(r["dp_mode"] == expected for r in ranks), [r["dp_mode"] for r in ranks]


def test_pipeline_stages_count_blocks(results: dict[str, list[dict]]) -> None:
    """pp=2 on the ResNet: 16 bottlenecks, 8 a stage; the stem with the first, the fc head with the last."""
    first, last = sorted((r for r in results["resnet_pp"]), key=lambda r: r["stage_ids"])
    blocks = [{int(p.split(".")[1]) for p in r["params"] if p.startswith("blocks.")} for r in (first, last)]
    assert blocks == [set(range(8)), set(range(8, 16))], blocks
    assert any(p.startswith("stem.") for p in first["params"]) and not any(p.startswith("fc.") for p in first["params"])
    assert any(p.startswith("fc.") for p in last["params"]) and not any(p.startswith("stem.") for p in last["params"])


def test_meshplan_train_resnet_pipeline(tmp_path: Path) -> None:
    """`meshplan train --model module:resnet50:make_resnet50_tiny` under pp=2 with a checkpoint: every
    step's loss is the single-process run's (same micro-batches) within the tolerance, and the
    checkpoint is the model's (resuming it under another plan: the worker's resnet_fsdp_to_pp; the
    launcher's resume path is the presets', tests/dist/test_train_cli.py)."""
    from meshplan.runtime.train import RunConfig, reference_run
    from meshplan.spec.plan import parse_plan
    sys.path.insert(0, str(MODULES))
    try:
        ref, _, _ = reference_run(RunConfig(model=RESNET, plan=parse_plan("precision=fp32"), global_batch=BATCH,
                                            steps=STEPS), STEPS, micro_batch=1)
    finally:
        sys.path.remove(str(MODULES))
    m, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    p = meshplan_train("--model", RESNET, "--global-batch", str(BATCH), "--metrics", str(m), "--checkpoint-dir",
                       str(ck), "--pg-timeout", "60", "--plan", PLANS["pp"] + ",precision=fp32", "--steps",
                       str(STEPS), env=modules_env())
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in m.read_text().splitlines()]
    losses = [r["loss"] for r in rows if "step" in r]
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3]
    assert close(losses, ref, TOLERANCE["fp32"]), (losses, ref)
    summary = rows[-1]
    assert summary["kind"] == "summary" and summary["model"] == "make_resnet50_tiny" and summary["source"] == RESNET
    assert summary["sample_tokens"] == 1
    assert summary["estimate"]["step_time_s"] > 0, summary
    meta = json.loads((ck / "meta.json").read_text())
    assert meta["step"] == STEPS and meta["model"]["source"] == RESNET


def test_refusals(sources: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans these models cannot run: one line, exit 2, before any process starts: tp on the small CNN
    (one convolution per block: no column -> row pair; the ResNet's pairs run, tests/dist/test_conv_tp_runtime.py),
    a pipeline of a BERT whose output projection is tied to its
    embedding, stage_layers that do not count the blocks."""
    pytest.importorskip("transformers")
    from meshplan.cli.main import main
    monkeypatch.syspath_prepend(str(MODULES))
    tied = tmp_path / "bert-tied.json"
    tied.write_text(json.dumps({**BERT, "tie_word_embeddings": True}))
    # (the planner's reasons, from the one table: spec.constraints on the traced graph)
    for model, plan, needle in (("module:small_cnn:make_cnn", "tp=2",
                                 "no layer of the model has linear layers tensor parallelism"),
                                (f"hf:{tied}", "pp=2", "ties weights across units"),
                                (RESNET, "pp=2,stage_layers=9:9", "stage_layers sum to 18 but the model has 16")):
        seq = ["--seq-len", "16"] if model.startswith("hf:") else []
        rc = main(["train", "--model", model, "--plan", plan + ",precision=fp32", "--global-batch", "4",
                   "--steps", "1", *seq])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("meshplan: error:") and needle in err[0], err
