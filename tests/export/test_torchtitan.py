"""`meshplan export --to torchtitan` against torchtitan's own config parser (torchtitan 0.2.x).

Each exported TOML goes through ``torchtitan.config.ConfigManager().parse_args(["--job.config_file",
path])`` (which rejects unknown sections/keys), its command-line overrides through the same
ConfigManager (tyro: unknown flags and values outside a Literal are rejected) and must give the same
JobConfig; the degrees through ``ParallelDims`` (torchtitan's mesh validation); the schedule name
through torch's ``get_schedule_class``; flavors and converter names against torchtitan's source.
"""
from __future__ import annotations

import ast
import math
import os
from typing import Any

import pytest
from export_cases import HAS_OVERLAP, inputs, random_inputs

from meshplan.export import export, render
from meshplan.export.common import sync_groups
from meshplan.export.torchtitan import (
    FLAVORS,
    FP8_CONVERTER,
    FT_CONFIG_MODULE,
    FT_TRAINER,
    LLAMA3_VOCAB,
    SEMI_SYNC,
    flavor,
)
from meshplan.spec.io import load_model

CASES = {**inputs("torchtitan"), **random_inputs(8, seed=8)}


def _parse_toml(tt: Any, text: str, tmp_path: Any) -> Any:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return tt.config.ConfigManager().parse_args(["--job.config_file", str(path)])


def _without_config_file(cfg: Any) -> dict[str, Any]:
    d = cfg.to_dict()
    d["job"].pop("config_file")
    return d


def _source(tt: Any, *parts: str) -> ast.Module:
    with open(os.path.join(tt.root, *parts)) as f:
        return ast.parse(f.read())


def _llama3_flavors(tt: Any) -> dict[str, dict[str, Any]]:
    """llama3_args in torchtitan/models/llama3/__init__.py: flavor -> TransformerModelArgs keywords,
    with the dataclass defaults (torchtitan/models/llama3/model/args.py) filled in."""
    defaults: dict[str, Any] = {}
    for node in ast.walk(_source(tt, "models", "llama3", "model", "args.py")):
        if isinstance(node, ast.ClassDef) and node.name == "TransformerModelArgs":
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                    try:
                        defaults[st.target.id] = ast.literal_eval(st.value)
                    except ValueError:
                        pass
    out = {}
    for node in ast.walk(_source(tt, "models", "llama3", "__init__.py")):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "llama3_args" for t in node.targets):
            assert isinstance(node.value, ast.Dict)
            for k, v in zip(node.value.keys, node.value.values):
                assert isinstance(k, ast.Constant) and isinstance(v, ast.Call)
                kw = dict(defaults)
                kw.update({a.arg: ast.literal_eval(a.value) for a in v.keywords if a.arg})
                out[k.value] = kw
    assert out, "llama3_args not found in torchtitan's source"
    return out


def _ffn(kw: dict[str, Any]) -> int:
    """torchtitan's FeedForward width (models/llama3/model/model.py)."""
    hidden = int(2 * 4 * kw["dim"] / 3)
    if kw.get("ffn_dim_multiplier") is not None:
        hidden = int(kw["ffn_dim_multiplier"] * hidden)
    m = kw["multiple_of"]
    return m * ((hidden + m - 1) // m)


def _registered_converters(tt: Any) -> set[str]:
    names = set()
    qdir = os.path.join(tt.root, "components", "quantization")
    for fname in os.listdir(qdir):
        if fname.endswith(".py"):
            for node in ast.walk(_source(tt, "components", "quantization", fname)):
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "register_model_converter":
                    names.add(ast.literal_eval(node.args[1]))
    return names


@pytest.mark.parametrize("name", list(CASES))
def test_export_parses_in_torchtitan(name: str, torchtitan: Any, tmp_path: Any) -> None:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    inp = CASES[name]
    p, m = inp.plan, inp.model
    assert m is not None and inp.global_batch is not None
    res = export("torchtitan", inp)
    cfg = _parse_toml(torchtitan, render(res), tmp_path)
    cli = torchtitan.config.ConfigManager().parse_args(res.overrides)
    assert _without_config_file(cli) == _without_config_file(cfg)

    par, tr, ft = cfg.parallelism, cfg.training, cfg.fault_tolerance
    # local-sgd/diloco: one torchtitan job per replica group (torchft), its degrees those of one group
    assert ft.enable == p.periodic
    groups = ft.group_size if p.periodic else 1
    if p.periodic:
        assert ft.semi_sync_method == SEMI_SYNC[p.grad_sync] and ft.sync_steps == p.sync_every
        split = sync_groups(inp)
        assert groups == (split[1] if split is not None else 1)
        assert ft.should_quantize == (p.grad_compression == "fp8" and p.grad_sync == "diloco")
        overlap = getattr(p, "sync_overlap", 0)
        assert ft.fragment_sync_delay == (overlap if p.grad_sync == "diloco" else 0)
        assert cfg.job.custom_config_module == FT_CONFIG_MODULE
    assert tr.mixed_precision_reduce == "float32"  # the only value torchtitan 0.2.x takes
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree) == (p.tp, p.pp, p.cp)
    assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree * groups == p.dp
    assert par.expert_parallel_degree == p.ep
    assert (tr.global_batch_size, tr.seq_len) == (inp.global_batch, inp.seq_len)
    # torchtitan's train.py; under torchft the batch degree is dp x group_size (FTManager.get_dp_info)
    accumulation = tr.global_batch_size // (tr.local_batch_size * p.dp)
    assert tr.global_batch_size == accumulation * tr.local_batch_size * p.dp
    if p.pp > 1:
        assert accumulation == 1
        assert tr.local_batch_size // par.pipeline_parallel_microbatch_size == inp.microbatches
        assert par.pipeline_parallel_microbatch_size == p.micro_batch
    else:
        assert (accumulation, tr.local_batch_size) == (inp.microbatches, p.micro_batch)
    torchtitan.ParallelDims(dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
                            cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                            pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                            etp=par.expert_tensor_parallel_degree, world_size=p.num_gpus // groups)
    assert cfg.compile.enable == p.compile
    assert par.enable_async_tensor_parallel == (p.async_tp and p.tp > 1)
    assert tr.enable_cpu_offload == p.offload_params

    if p.pp > 1:
        cls = get_schedule_class(par.pipeline_parallel_schedule)
        single = issubclass(cls, PipelineScheduleSingle)
        chunks = 2 if p.schedule == "zbv" else p.virtual_stages
        if par.module_fqns_per_model_part is not None:
            parts = par.module_fqns_per_model_part
            assert len(parts) == p.pp * chunks
            flat = [n for part in parts for n in part]
            assert flat == ["tok_embeddings", *(f"layers.{i}" for i in range(m.num_layers)), "norm", "output"]
        else:  # torchtitan's pipeline_llm: stages from layers per stage
            n = par.pipeline_parallel_layers_per_stage
            stages = math.ceil((m.num_layers + par.pipeline_parallel_first_stage_less_layers
                                + par.pipeline_parallel_last_stage_less_layers) / n)
            assert stages == p.pp * chunks and stages % p.pp == 0
            assert (stages // p.pp == 1) if single else (stages // p.pp >= 2)
    name_flavor = (cfg.model.name, cfg.model.flavor)
    if name_flavor in FLAVORS:
        tt = _llama3_flavors(torchtitan)[cfg.model.flavor]
        assert (tt["dim"], tt["n_layers"], tt["n_heads"], tt["n_kv_heads"] or tt["n_heads"], _ffn(tt),
                tt["vocab_size"]) == (m.hidden_size, m.num_layers, m.num_attention_heads, m.kv_heads,
                                      m.ffn_hidden_size, m.vocab_size)
    else:
        assert any(u.startswith(f"model {m.name}:") for u in res.unsupported)
    assert set(cfg.model.converters) <= _registered_converters(torchtitan)
    assert (FP8_CONVERTER in cfg.model.converters) == (p.precision == "fp8")


def test_fault_tolerance_names_match_torchtitan(torchtitan: Any) -> None:
    """The semi-sync method names, the config module and the trainer exist in the installed torchtitan."""
    import importlib
    from pathlib import Path
    root = Path(torchtitan.root)
    manager = (root / "components" / "ft" / "manager.py").read_text()
    for method in SEMI_SYNC.values():  # maybe_semi_sync_training: semi_sync_method.lower() == "..."
        assert f'semi_sync_method.lower() == "{method}"' in manager
    module = importlib.import_module(FT_CONFIG_MODULE)
    fields = {f for f in module.FaultTolerance.__dataclass_fields__}
    assert {"sync_steps", "should_quantize", "fragment_sync_delay"} <= fields
    train = root.joinpath(*FT_TRAINER.split(".")[1:]).with_suffix(".py").read_text()
    assert "maybe_semi_sync_training(" in train and "get_dp_info(" in train
    # an extended key without the config module is an error (the export always writes both)
    with pytest.raises(SystemExit):
        torchtitan.config.ConfigManager().parse_args(["--fault_tolerance.sync_steps", "7"])
    if HAS_OVERLAP:
        assert any(CASES[n].plan.grad_sync == "diloco" and getattr(CASES[n].plan, "sync_overlap", 0) for n in CASES)


def test_flavor_table_matches_torchtitan(torchtitan: Any) -> None:
    tt = _llama3_flavors(torchtitan)
    for (family, fl), shape in FLAVORS.items():
        assert family == "llama3" and fl in tt
        kw = tt[fl]
        assert shape == {"dim": kw["dim"], "n_layers": kw["n_layers"], "n_heads": kw["n_heads"],
                         "n_kv_heads": kw["n_kv_heads"] or kw["n_heads"], "ffn": _ffn(kw)}
        assert kw["vocab_size"] == LLAMA3_VOCAB
    for preset, fl in [("llama3-8b", "8B"), ("llama3.1-8b", "8B"), ("llama3-70b", "70B"),
                       ("llama3.1-70b", "70B"), ("llama3.1-405b", "405B")]:
        assert flavor(load_model(preset)) == ("llama3", fl)


def test_misspelled_keys_are_rejected(torchtitan: Any, tmp_path: Any) -> None:
    """The parser the tests rely on does reject a typo, in the TOML and on the command line."""
    res = export("torchtitan", CASES["tp-pp-vpp-sp-async"])
    text = render(res)
    _parse_toml(torchtitan, text, tmp_path)  # the real export parses
    with pytest.raises(ValueError, match="tensor_parallel_degre"):
        _parse_toml(torchtitan, text.replace("tensor_parallel_degree", "tensor_parallel_degre"), tmp_path)
    with pytest.raises(ValueError, match="activation_checkpnt"):
        _parse_toml(torchtitan, text.replace("[activation_checkpoint]", "[activation_checkpnt]"), tmp_path)
    manager = torchtitan.config.ConfigManager
    with pytest.raises(SystemExit):
        manager().parse_args([a.replace("tensor_parallel_degree", "tensor_paralel_degree") for a in res.overrides])
    with pytest.raises(SystemExit):  # a value outside the Literal
        manager().parse_args(["--activation_checkpoint.mode", "fulll"])
