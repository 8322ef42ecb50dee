"""hf: configs must define their architecture (no silent library defaults for layers, heads, vocab,
MLP width), and a sequence may not run past a learned position table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from meshplan.cli.main import main  # noqa: E402
from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.ingest import ingest  # noqa: E402
from meshplan.ingest.hf import missing_arch_fields  # noqa: E402

HF = Path(__file__).resolve().parents[1] / "data" / "hf"


def config_class(model_type: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return CONFIG_MAPPING[model_type]


def write(tmp_path: Path, cfg: dict) -> str:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return f"hf:{p}"


def test_the_bug_report_config_is_refused_listing_the_missing_keys(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    src = write(tmp_path, {"model_type": "llama", "hidden_size": 256})
    with pytest.raises(MeshplanError) as e:
        ingest(src)
    msg = str(e.value)
    assert "does not define the architecture: missing num_hidden_layers, num_attention_heads, vocab_size, " \
           "intermediate_size" in msg and "\n" not in msg
    assert main(["ingest", "--model", src]) == 2
    err = capsys.readouterr().err
    assert err.count("meshplan: error:") == 1 and "missing num_hidden_layers" in err and "Traceback" not in err


@pytest.mark.parametrize("model_type, cfg, missing", [
    ("gpt2", {"n_embd": 64}, ["n_layer", "n_head", "vocab_size"]),  # n_inner: None means 4 x n_embd
    ("gpt2", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}, []),
    ("t5", {"d_model": 64, "vocab_size": 100}, ["num_layers", "num_heads", "d_ff"]),
    ("bart", {"d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
              "vocab_size": 100}, ["decoder_layers", "decoder_attention_heads", "decoder_ffn_dim"]),
    ("vit", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}, ["intermediate_size"]),
    ("mixtral", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
                 "intermediate_size": 128}, ["num_experts_per_tok", "num_local_experts"][::-1]),
    ("llama", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
               "intermediate_size": 128, "n_layer": 7}, []),
])
def test_families_are_asked_for_their_own_names(model_type: str, cfg: dict, missing: list[str]) -> None:
    assert missing_arch_fields(config_class(model_type), {"model_type": model_type, **cfg}) == missing


def test_a_key_of_another_family_does_not_count() -> None:
    cfg = {"model_type": "llama", "hidden_size": 64, "n_layer": 2, "num_attention_heads": 4, "vocab_size": 100,
           "intermediate_size": 128}
    assert missing_arch_fields(config_class("llama"), cfg) == ["num_hidden_layers"]


@pytest.mark.parametrize("path", sorted(HF.glob("*.json")), ids=lambda p: p.stem)
def test_the_test_configs_define_their_architecture(path: Path) -> None:
    cfg = json.loads(path.read_text())
    assert missing_arch_fields(config_class(cfg["model_type"]), cfg) == []


def test_seq_len_past_a_learned_position_table_is_refused() -> None:
    with pytest.raises(MeshplanError, match=r"seq_len 256 exceeds the model's 128 positions \(n_positions\)"):
        ingest(f"hf:{HF / 'gpt2-tiny.json'}", seq_len=256)
    assert ingest(f"hf:{HF / 'gpt2-tiny.json'}", seq_len=128).layers
    # rotary angles are computed per position: no table to run past
    assert ingest(f"hf:{HF / 'llama-tiny.json'}", seq_len=256).layers
