"""`meshplan export --to deepspeed` against DeepSpeed's own config class.

Each exported JSON is given to ``deepspeed.runtime.config.DeepSpeedConfig`` (as a file path, the
way deepspeed.initialize reads it), with an ``mpu`` whose data-parallel size is the plan's, so its
batch check (train_batch_size = micro batch x accumulation x data-parallel size) runs for real. Its
pydantic sections (zero_optimization, bf16/fp16, tensor_parallel) reject unknown keys themselves;
for the sections DeepSpeed reads with ``dict.get`` (top level, activation_checkpointing, pipeline,
expert_parallel) the test records which keys DeepSpeed actually looked up and fails on any key it
never reads, so a misspelled key cannot pass silently. AutoEP sections also go through DeepSpeed's
``validate_autoep_config``.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from export_cases import inputs, random_inputs

from meshplan.export import export, render

CASES = {**inputs("deepspeed"), **random_inputs(30, seed=30)}
OURS = ("_meshplan", "_meshplan_unsupported", "_meshplan_notes")


class _Keys:
    def __init__(self, d: _Recorder) -> None:
        self.d = d

    def __contains__(self, key: object) -> bool:
        self.d.read.add(key)
        return dict.__contains__(self.d, key)

    def __iter__(self) -> Any:
        return iter(dict.keys(self.d))


class _Recorder(dict):
    """A dict that records the keys it is asked for (get, [], in, keys() membership)."""

    def __init__(self, *args: Any, read: set | None = None) -> None:
        super().__init__(*args)
        self.read: set = set() if read is None else read

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def keys(self) -> Any:  # type: ignore[override]
        return _Keys(self)

    def __copy__(self) -> _Recorder:
        return _Recorder(self, read=self.read)  # DeepSpeedConfig copies the dict: keep one record


class _MPU:
    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def _config(ds: Any, doc: dict[str, Any], dp: int, monkeypatch: Any, path: Any = None, cp: int | None = None) -> Any:
    """DeepSpeedConfig with a data-parallel size of ``dp``: from an mpu (Megatron-DeepSpeed's way), or,
    given ``cp``, from a world of dp*cp ranks divided by sequence_parallel_size (the Ulysses way)."""
    monkeypatch.setattr(ds.config.dist, "get_rank", lambda *a, **k: 0)
    if cp is not None:
        monkeypatch.setattr(ds.config.dist, "get_world_size", lambda *a, **k: dp * cp)
    return ds.config.DeepSpeedConfig(str(path) if path is not None else doc, mpu=_MPU(dp) if cp is None else None)


def unread_keys(ds: Any, doc: dict[str, Any], dp: int, monkeypatch: Any) -> list[str]:
    """Keys of the config (top level and the dict-read sections) that DeepSpeed never looks up."""
    rec = _Recorder({k: v for k, v in doc.items()})
    sections = {}
    for name in ("activation_checkpointing", "expert_parallel"):
        if name in doc:
            sections[name] = rec_section = _Recorder(doc[name])
            dict.__setitem__(rec, name, rec_section)
    _config(ds, rec, dp, monkeypatch, cp=doc.get("sequence_parallel_size", 1))
    missing = [k for k in doc if k not in rec.read and k not in OURS]
    for name, r in sections.items():
        missing += [f"{name}.{k}" for k in doc[name] if k not in r.read]
    known_pipe = set(ds.config.get_pipeline_config({})) | {"use_reentrant"}  # the engine's defaults
    missing += [f"pipeline.{k}" for k in doc.get("pipeline", {}) if k not in known_pipe]
    return missing


@pytest.mark.parametrize("name", list(CASES))
def test_export_builds_a_deepspeed_config(name: str, deepspeed: Any, tmp_path: Any, monkeypatch: Any) -> None:
    inp = CASES[name]
    p = inp.plan
    res = export("deepspeed", inp)
    path = tmp_path / "ds_config.json"
    path.write_text(render(res))
    doc = json.loads(path.read_text())
    assert doc["_meshplan_unsupported"] == res.unsupported
    cfg = _config(deepspeed, doc, p.dp, monkeypatch, path)  # read from the file, like deepspeed.initialize
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
        (inp.global_batch, p.micro_batch, inp.microbatches)
    assert cfg.zero_optimization_stage == p.zero
    assert cfg.bfloat16_config.enabled == (p.precision in ("bf16", "fp8"))
    assert cfg.float16_config.enabled == (p.precision == "fp16")
    bf16_comm = p.grad_compression == "bf16" and not p.periodic
    assert cfg.communication_data_type == (torch.bfloat16 if bf16_comm else None)
    if p.periodic:
        assert any(u.startswith(f"grad_sync={p.grad_sync} (sync_every={p.sync_every}") for u in res.unsupported)
    z = cfg.zero_config
    assert (z.offload_optimizer is not None) == (p.offload_optimizer and p.zero > 0)
    assert (z.offload_param is not None) == p.offload_params
    if p.zero in (1, 2):
        assert z.reduce_scatter == (p.grad_sync != "all-reduce")
    assert cfg.tensor_parallel_config.autotp_size == (p.tp if p.tp > 1 else 0)
    assert cfg.tensor_parallel_config.tp_overlap_comm == (p.async_tp and p.tp > 1)
    assert doc.get("sequence_parallel_size", 1) == p.cp
    assert cfg.expert_parallel_config.enabled == (p.ep > 1)
    if p.ep > 1:
        assert cfg.expert_parallel_config.autoep_size == p.ep
        deepspeed.validate_autoep(cfg.expert_parallel_config, world_size=p.num_gpus, pp_size=p.pp, tp_size=p.tp,
                                  sp_size=p.cp, zero_stage=p.zero)
    if p.pp > 1:
        full = p.recompute == "full" and p.recompute_layers != 0
        assert cfg.pipeline["activation_checkpoint_interval"] == (1 if full else 0)
        if p.tp > 1:
            assert cfg.pipeline["pipe_partitioned"] == cfg.pipeline["grad_partitioned"] == p.p2p_sharded
    assert unread_keys(deepspeed, doc, p.dp, monkeypatch) == []


def test_sequence_parallel_size_is_the_key_deepspeed_reads(deepspeed: Any, monkeypatch: Any) -> None:
    """Without an mpu DeepSpeed divides the world by sequence_parallel_size (its Ulysses setting)."""
    inp = CASES["zbv-cp-partial"]
    doc = export("deepspeed", inp).config
    monkeypatch.setattr(deepspeed.config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(deepspeed.config.dist, "get_world_size", lambda *a, **k: inp.plan.dp * inp.plan.cp)
    cfg = deepspeed.config.DeepSpeedConfig(doc)
    assert cfg.world_size == inp.plan.dp


def test_misspelled_keys_are_rejected(deepspeed: Any, monkeypatch: Any) -> None:
    """DeepSpeed (and the unread-key check) reject typos at every level the exporter writes."""
    inp = CASES["tp-pp-vpp-sp-async"]
    doc = export("deepspeed", inp).config
    dp = inp.plan.dp
    _config(deepspeed, doc, dp, monkeypatch)  # the real export passes
    assert unread_keys(deepspeed, doc, dp, monkeypatch) == []
    with pytest.raises(Exception, match="stagee"):  # pydantic: extra keys are forbidden
        _config(deepspeed, {**doc, "zero_optimization": {"stagee": 1}}, dp, monkeypatch)
    with pytest.raises(Exception, match="enabeld"):
        _config(deepspeed, {**doc, "bf16": {"enabeld": True}}, dp, monkeypatch)
    with pytest.raises(Exception, match="autotp_sise"):
        _config(deepspeed, {**doc, "tensor_parallel": {"autotp_sise": 8}}, dp, monkeypatch)
    renamed = {("train_micro_batch_size_per_gp" if k == "train_micro_batch_size_per_gpu" else k): v
               for k, v in doc.items()}
    assert unread_keys(deepspeed, renamed, dp, monkeypatch) == ["train_micro_batch_size_per_gp"]
    bad = {**doc, "activation_checkpointing": {"partition_activation": True}}
    assert unread_keys(deepspeed, bad, dp, monkeypatch) == ["activation_checkpointing.partition_activation"]
    bad = {**doc, "pipeline": {"activation_checkpoint_intervall": 1}}
    assert unread_keys(deepspeed, bad, dp, monkeypatch) == ["pipeline.activation_checkpoint_intervall"]
    assert unread_keys(deepspeed, {**doc, "communication_data_type": "bf16"}, dp, monkeypatch) == []
    assert unread_keys(deepspeed, {**doc, "communication_dtype": "bf16"}, dp, monkeypatch) == ["communication_dtype"]
    with pytest.raises(ValueError, match="Invalid communication_data_type"):  # fp8 is not one of its types
        _config(deepspeed, {**doc, "communication_data_type": "fp8"}, dp, monkeypatch)
    bad = {**doc, "expert_parallel": {"enabled": True, "autoep_sise": 4}}
    assert unread_keys(deepspeed, bad, dp, monkeypatch) == ["expert_parallel.autoep_sise"]
    with pytest.raises(AssertionError, match="Check batch related parameters"):  # the batch identity
        _config(deepspeed, {**doc, "gradient_accumulation_steps": doc["gradient_accumulation_steps"] + 1}, dp,
                monkeypatch)
