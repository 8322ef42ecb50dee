"""The ModelSpec of a published run: the row's shapes, and its architecture family's defaults for
what the row leaves out (each default written to the assumptions)."""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.spec.model import MLP_TYPES, ModelSpec
from meshplan.units import parse_count
from meshplan.validate.frameworks import DEFAULT_SEQ_LEN, FRAMEWORK_LABEL
from meshplan.validate.rows import Row, Unsupported, bool_cell

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    # GPT-2/3 as in Megatron-LM: learned absolute positions, LayerNorm, biases, tied output.
    "gpt": dict(position="learned", norm="layernorm", bias=True, tied_embeddings=True,
                embedding_norm=False, mlp_type="gelu_4h", dropout=True),
    # Llama 1/2/3: RoPE, RMSNorm, no biases, separate output matrix, SwiGLU.
    "llama": dict(position="rotary", norm="rmsnorm", bias=False, tied_embeddings=False,
                  embedding_norm=False, mlp_type="swiglu"),
    # MPT as released (no_bias=True, alibi=True); llm-foundry ties wte to the output.
    "mpt": dict(position="alibi", norm="layernorm", bias=False, tied_embeddings=True,
                embedding_norm=False, mlp_type="gelu_4h"),
    # BLOOM: ALiBi, LayerNorm after the embedding, biases, tied output.
    "bloom": dict(position="alibi", norm="layernorm", bias=True, tied_embeddings=True,
                  embedding_norm=True, mlp_type="gelu_4h", dropout=True),
    # BERT-style encoders.
    "bert": dict(position="learned", norm="layernorm", bias=True, tied_embeddings=True,
                 embedding_norm=True, mlp_type="gelu_4h", causal=False),
}
FAMILY_LABEL = {"gpt": "GPT/Megatron", "llama": "Llama", "mpt": "MPT", "bloom": "BLOOM",
                "bert": "BERT"}
DEFAULT_VOCAB = {"gpt": 51200, "mpt": 50368, "bloom": 250880, "bert": 30592}


def arch_family(row: Row) -> str | None:
    text = f"{row.lower('arch_family')} {row.lower('model')}"
    if "bloom" in text:
        return "bloom"
    if re.search(r"\bmpt\b|mpt-", text):
        return "mpt"
    if any(k in text for k in ("llama", "mistral", "mixtral", "qwen", "yi-", "deepseek", "gemma")):
        return "llama"
    if any(k in text for k in ("bert", "encoder-only")):
        return "bert"
    if any(k in text for k in ("gpt", "megatron", "turing", "opt-", "nemotron")):
        return "gpt"
    return None


def _explicit_arch(text: str) -> dict[str, Any]:
    """Architecture facts stated in the arch_family text itself (these beat family defaults)."""
    out: dict[str, Any] = {}
    if re.search(r"learned[\s_-]*(pos|position)|absolute[\s_-]*pos", text):
        out["position"] = "learned"
    elif "alibi" in text:
        out["position"] = "alibi"
    elif re.search(r"\brope\b|rotary", text):
        out["position"] = "rotary"
    elif re.search(r"\bnope\b|no[\s_-]*pos", text):
        out["position"] = "none"
    if "rmsnorm" in text or "rms norm" in text:
        out["norm"] = "rmsnorm"
    elif "layernorm" in text or "layer norm" in text:
        out["norm"] = "layernorm"
    if re.search(r"no[\s_-]*bias|without bias|bias[\s_-]*free|bias=false", text):
        out["bias"] = False
    elif "bias" in text:
        out["bias"] = True
    if "untied" in text or "not tied" in text:
        out["tied_embeddings"] = False
    elif "tied" in text:
        out["tied_embeddings"] = True
    if re.search(r"embedding[\s_-]*(layer)?[\s_-]*norm", text):
        out["embedding_norm"] = True
    if "swiglu" in text:
        out["mlp_type"] = "swiglu"
    elif re.search(r"squared[\s_-]*relu|relu\^?2|relu²", text):
        out["mlp_type"] = "squared_relu"
    elif "gelu" in text:
        out["mlp_type"] = "gelu_4h"
    elif "relu" in text:
        out["mlp_type"] = "relu_4h"
    return out


def _llama_ffn(h: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4h rounded up to a multiple of 256 (Llama 1/2 code)."""
    f = int(2 * 4 * h / 3)
    return multiple_of * ((f + multiple_of - 1) // multiple_of)


_ARCH_KEYS = ("position", "norm", "bias", "tied_embeddings", "embedding_norm")
_BOOL_ARCH_KEYS = ("bias", "tied_embeddings", "embedding_norm")
_MLP_ALIASES = {"gelu": "gelu_4h", "relu": "relu_4h", "geglu": "swiglu", "silu": "swiglu",
                "relu2": "squared_relu", "squared_relu_4h": "squared_relu"}


def _architecture(row: Row, fam: str | None, arch_text: str,
                  assume: Callable[[str], None]) -> tuple[dict[str, Any], str]:
    """(ModelSpec architecture fields, the default mlp_type): the row's own columns, then facts
    stated in arch_family, then the family's defaults (assumed, one line)."""
    explicit = _explicit_arch(arch_text)
    for key in _ARCH_KEYS:
        v = row.text(key)
        if v is None:
            continue
        if key in _BOOL_ARCH_KEYS:
            b = bool_cell(v)
            if b is not None:
                explicit[key] = b
        else:
            explicit[key] = v.lower()
    defaults = ARCH_DEFAULTS[fam or "gpt"]
    arch: dict[str, Any] = {}
    inferred = []
    for key in _ARCH_KEYS:
        if key in explicit:
            arch[key] = explicit[key]
        else:
            arch[key] = defaults[key]
            inferred.append(f"{key}={arch[key]}")
    for key in ("causal", "dropout"):  # GPT-3/Megatron/BLOOM train with dropout 0.1
        if key in defaults:
            arch[key] = defaults[key]
    if inferred:
        if fam is None:
            assume("architecture family not recognised: assumed GPT-style " + ", ".join(inferred))
        else:
            assume(f"not stated in the row, assumed from the {FAMILY_LABEL[fam]} family: "
                   + ", ".join(inferred))
    return arch, explicit.get("mlp_type", defaults["mlp_type"])


def _attention_heads(row: Row, h: int, assume: Callable[[str], None],
                     ) -> tuple[int | None, int, int]:
    """(head_dim or None, attention heads, key/value heads): heads of 128 and no GQA unless stated."""
    head_dim = row.integer("head_dim")
    heads = row.integer("num_attention_heads")
    if heads is None:
        hd = head_dim or 128
        if h % hd:
            raise Unsupported("num_attention_heads not stated and hidden_size is not a "
                              "multiple of 128")
        heads = h // hd
        assume(f"num_attention_heads not stated: assumed hidden_size/{hd} = {heads}")
    kv = row.integer("num_kv_heads")
    if kv is None:
        kv = heads
        assume(f"num_kv_heads not stated: assumed equal to num_attention_heads ({heads}, no GQA)")
    return head_dim, heads, kv


def _mlp(row: Row, h: int, default: str, assume: Callable[[str], None]) -> tuple[str, int]:
    """(mlp_type, ffn_hidden_size): Llama's 8h/3 rule for SwiGLU, else 4h, unless stated."""
    mlp = row.lower("mlp_type")
    if mlp:
        mlp = mlp.replace("-", "_").replace(" ", "_")
        mlp = _MLP_ALIASES.get(mlp, mlp)
        if mlp not in MLP_TYPES:
            raise Unsupported(f"mlp_type {row.text('mlp_type')!r} is not one of "
                              f"{', '.join(MLP_TYPES)}")
    else:
        mlp = default
        assume(f"mlp_type not stated: assumed {mlp}")
    ffn = row.integer("ffn_hidden_size")
    if ffn is None:
        ffn = _llama_ffn(h) if mlp == "swiglu" else 4 * h
        assume(f"ffn_hidden_size not stated: assumed {ffn} "
               f"({'Llama rule 8h/3 rounded up to 256' if mlp == 'swiglu' else '4h'})")
    return mlp, ffn


def _vocab(row: Row, name: str, fam: str | None, assume: Callable[[str], None]) -> int:
    """vocab_size, or the family's usual vocabulary (Llama 3's for a Llama 3 name)."""
    vocab = row.integer("vocab_size")
    if vocab is None:
        low = name.lower()
        if fam == "llama":
            vocab = 128256 if re.search(r"llama[\s_-]*3", low) else 32000
        elif fam in DEFAULT_VOCAB:
            vocab = DEFAULT_VOCAB[fam]
        else:
            raise Unsupported("vocab_size not stated and the model family is not recognised")
        label = FAMILY_LABEL.get(fam or "", "family")
        assume(f"vocab_size not stated: assumed {vocab} ({label} default)")
    return vocab


def _experts(row: Row, moe_text: str, assume: Callable[[str], None]) -> dict[str, Any]:
    """ModelSpec mixture-of-experts fields (optional columns; {} for a dense model)."""
    n_exp = row.integer("num_experts") or row.integer("experts") or row.integer("n_experts")
    top_k = (row.integer("experts_per_token") or row.integer("top_k") or row.integer("moe_top_k")
             or row.integer("topk"))
    exp_ffn = row.integer("expert_ffn_hidden_size") or row.integer("moe_ffn_hidden_size")
    if n_exp is None and re.search(r"\bmoe\b|mixture[\s-]*of[\s-]*experts|mixtral", moe_text):
        if "mixtral" in moe_text:
            n_exp, top_k = 8, top_k or 2
            assume("num_experts not stated: assumed Mixtral's 8 experts, top-2")
        else:
            raise Unsupported("mixture-of-experts model without num_experts")
    if n_exp and n_exp > 1 and top_k is None:
        top_k = 2
        assume("experts_per_token not stated: assumed top-2")
    if n_exp and n_exp > 1:
        return dict(num_experts=n_exp, experts_per_token=top_k or 1, expert_ffn_hidden_size=exp_ffn)
    return {}


def build_model(row: Row, fw: str, assume: Callable[[str], None]) -> ModelSpec:
    """The row's ModelSpec: architecture, shapes, vocabulary, sequence length and experts, each
    missing value assumed (in this order) from the family or the framework."""
    name = row.text("model") or f"row-{row.text('row_id') or '?'}"
    arch_text = row.lower("arch_family")
    if re.search(r"encoder[\s-]*decoder|\bt5\b", f"{arch_text} {name.lower()}"):
        raise Unsupported("encoder-decoder models are not expressible as a ModelSpec")
    fam = arch_family(row)
    arch, default_mlp = _architecture(row, fam, arch_text, assume)
    L = row.integer("num_layers")
    h = row.integer("hidden_size")
    if L is None or h is None:
        raise Unsupported("num_layers and hidden_size are required")
    head_dim, heads, kv = _attention_heads(row, h, assume)
    mlp, ffn = _mlp(row, h, default_mlp, assume)
    vocab = _vocab(row, name, fam, assume)
    seq = row.integer("seq_len")
    if seq is None:
        seq = DEFAULT_SEQ_LEN[fw]
        assume(f"seq_len not stated: assumed {seq} ({FRAMEWORK_LABEL[fw]} default)")
    experts = _experts(row, f"{arch_text} {name.lower()}", assume)
    try:
        return ModelSpec(name=name, num_layers=L, hidden_size=h, num_attention_heads=heads,
                         num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=ffn, mlp_type=mlp,
                         vocab_size=vocab, seq_len=seq, **arch, **experts)
    except MeshplanError as e:
        raise Unsupported(str(e)) from None


def check_params(row: Row, model: ModelSpec, assume: Callable[[str], None]) -> None:
    """Flag (in assumptions) a spec whose parameter count is far from the row's params_reported."""
    text = row.text("params_reported")
    if not text:
        return
    try:
        reported = parse_count(text.replace(" ", ""))
    except ValueError:
        return
    if reported <= 0:
        return
    n = model.num_params()
    off = n / reported - 1
    if abs(off) > 0.10:
        assume(f"check: the inferred spec has {n / 1e9:.3g}B parameters but the row reports "
               f"{text} ({off * 100:+.0f}%); some architecture assumption may be wrong")
