"""Published training runs -> validation cases.

Each CSV row (columns as in shared/data/published_runs_dev.csv, see its README) becomes a
:class:`RunCase`: a ModelSpec, a ClusterSpec, a Plan and a Workload, plus the measured step
time converted with the source's own formula and the measured peak memory.

Rules:

* Never drop a row. A row that cannot be expressed becomes ``status='unsupported'`` with a
  one-line ``reason``.
* Missing, blank, "not stated" or "unknown" cells get the usual setting of the row's
  framework (Megatron-LM, torchtitan, llm-foundry, Megatron-DeepSpeed), and every such
  default is written to ``assumptions``.
* The row's own ``status`` column ('ok', 'oom', 'failed', ...) is kept in ``run_status``;
  an 'oom' row is still a valid case (the cost model should say it does not fit).
"""
from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.constraints import violations
from meshplan.spec.io import load_cluster, load_gpu, parse_cluster_shorthand, preset_names
from meshplan.spec.model import MLP_TYPES, ModelSpec
from meshplan.spec.plan import Plan, Workload
from meshplan.units import GiB, parse_count


# ======================================================================================
# The case record
# ======================================================================================
@dataclass(frozen=True)
class RunCase:
    """One published run, ready to be estimated and compared."""

    row_id: str
    source_id: str
    model_name: str
    status: str
    """'ok' (expressible) or 'unsupported' (see ``reason``)."""
    reason: str = ""
    """Why the row is unsupported ('' when ok)."""
    assumptions: list[str] = field(default_factory=list)
    """Every default the loader had to assume, one line each."""
    model: ModelSpec | None = None
    cluster: ClusterSpec | None = None
    plan: Plan | None = None
    work: Workload | None = None
    measured_step_time_s: float | None = None
    measured_peak_mem_gib: float | None = None
    measured_from: str = ""
    """Which column and formula gave ``measured_step_time_s`` ('' if none)."""
    raw: dict[str, str] = field(default_factory=dict)
    """The CSV row as read (column name -> cell text)."""
    run_status: str = "ok"
    """The row's own status column: 'ok', 'oom', 'failed', ... (blank read as 'ok')."""
    measured_fits: bool | None = None
    """False for an 'oom' row, True for an 'ok' row with a measurement, else None."""
    framework: str = "unknown"
    """megatron, torchtitan, llm-foundry, deepspeed or unknown (drives the defaults)."""
    gpu_preset: str | None = None
    """The GPU preset name the row's gpu_type mapped to."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _Unsupported(Exception):
    """Internal: the row cannot be expressed; the message is the reason."""


# ======================================================================================
# Step-time formulas. One small function each, with its source.
# Notation: B global batch (sequences), s sequence length, l layers, h hidden size,
# V vocabulary, N parameters, n GPUs, t step time (s).
# ======================================================================================
def step_time_from_tokens_per_gpu(B: float, s: float, n: float, tps_per_gpu: float) -> float:
    """t = B*s / (n * tokens/s/GPU). torchtitan 'WPS' (tokens/s per GPU rank, see
    torchtitan train.py: ntokens / (time * non_data_parallel_size) summed over dp = B*s/(t*n))
    and llm-foundry 'tokens/s/GPU' (scripts/train/benchmarking/README.md)."""
    return B * s / (n * tps_per_gpu)


def step_time_from_tokens_total(B: float, s: float, tps_total: float) -> float:
    """t = B*s / (tokens/s of the whole job)."""
    return B * s / tps_total


def step_time_from_samples(B: float, samples_per_s: float) -> float:
    """t = B / (sequences/s of the whole job)."""
    return B / samples_per_s


def step_time_from_flops(flops_per_step: float, n: float, tflops_per_gpu: float) -> float:
    """t = F / (n * achieved TFLOP/s per GPU * 1e12)."""
    return flops_per_step / (n * tflops_per_gpu * 1e12)


def step_time_from_utilization(flops_per_step: float, n: float, peak_tflops: float,
                               util_pct: float) -> float:
    """t = F / (n * peak * utilization): inverts MFU = F/(t n peak) (or HFU with hardware F)."""
    return flops_per_step / (n * peak_tflops * 1e12 * util_pct / 100.0)


def flops_meg21(B: float, s: float, l: float, h: float, V: float) -> float:
    """F_MEG21: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC'21 (arXiv 2104.04473), Eq. 3:
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)). The 96 includes the extra forward pass of
    full activation recomputation, so utilisation against it is hardware-FLOP utilisation."""
    return 96.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h))


def flops_megatron_no_recompute(B: float, s: float, l: float, h: float, V: float) -> float:
    """Eq. 3 without the recomputed forward: 72 B s l h^2 (1 + s/(6h) + V/(16 l h))
    (Megatron-LM/Megatron-DeepSpeed throughput code with checkpoint_activations_factor=3)."""
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h))


def flops_kor22_model(B: float, s: float, l: float, h: float, V: float) -> float:
    """F_KOR22 model FLOPs: Korthikanti et al., "Reducing Activation Recomputation in Large
    Transformer Models" (arXiv 2205.05198), Sec. 6.3:
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)); MFU = F / (t n 312e12)."""
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (12.0 * l * h))


def flops_kor22_hardware(B: float, s: float, l: float, h: float, V: float, recompute: str) -> float:
    """F_KOR22 hardware FLOPs (Korthikanti et al. 2022, Sec. 6.3): the model FLOPs plus what
    is recomputed. Selective: 72 B s l h^2 (1 + s/(3h) + V/(12 l h)) (reproduces the paper's
    HFU/MFU ratios); full: Eq. 3 of SC'21, 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    if recompute == "full":
        return flops_meg21(B, s, l, h, V)
    if recompute == "selective":
        return 72.0 * B * s * l * h * h * (1.0 + s / (3.0 * h) + V / (12.0 * l * h))
    return flops_kor22_model(B, s, l, h, V)


def flops_bloom(B: float, s: float, l: float, h: float, V: float, recompute: bool = True) -> float:
    """F_BLOOM: Megatron-DeepSpeed (bigscience-workshop/Megatron-DeepSpeed, megatron/training.py
    throughput calculation): 24 * f * B s l h^2 (1 + s/(6h) + V/(16 l h)) with
    f = 4 when activations are checkpointed (the "4*2 coefficient"), else 3."""
    f = 4.0 if recompute else 3.0
    return 24.0 * f * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h))


def flops_tt(B: float, s: float, l: float, h_attn: float, n_params: float) -> float:
    """F_TT: torchtitan (pytorch/torchtitan, utils.get_num_flop_per_token):
    6 N + 12 l h s FLOPs per token, times B*s tokens. The data README says N is the
    non-embedding count; the 2024 docs/performance.md MFUs are reproduced with N = all
    parameters, so the caller decides which N it passes."""
    return B * s * (6.0 * n_params + 12.0 * l * h_attn * s)


def flops_mosaic(B: float, s: float, l: float, h: float, n_params: float,
                 hardware: bool = False) -> float:
    """F_MOSAIC: llm-foundry (mosaicml/llm-foundry, MPT flops_per_batch and
    scripts/train/benchmarking/README.md): per sequence 6 N s + 12 l h s^2 with N including
    embeddings; HFU uses 8 N s + 16 l h s^2 when activation checkpointing is on."""
    if hardware:
        return B * (8.0 * n_params * s + 16.0 * l * h * s * s)
    return B * (6.0 * n_params * s + 12.0 * l * h * s * s)


def flops_palm(B: float, s: float, l: float, h: float, n_params: float) -> float:
    """Generic model FLOPs (Chowdhery et al., PaLM, arXiv 2204.02311, App. B):
    6 N + 12 l h s per token. Used when a row names no formula we know."""
    return B * s * (6.0 * n_params + 12.0 * l * h * s)


# ======================================================================================
# Reading cells
# ======================================================================================
BLANK_CELLS = {"", "not stated", "not reported", "unknown", "unk", "n/a", "na", "nan", "null",
               "none stated", "unspecified", "?", "-", "--", "\u2014", "\u2013", "tbd", "not given"}

COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "global_batch_seqs": ("global_batch", "global_batch_size", "gbs", "global_batch_sequences"),
    "micro_batch": ("micro_batch_size", "mbs", "local_batch", "local_batch_size"),
    "num_gpus": ("gpus", "n_gpus", "world_size", "gpu_count"),
    "gpu_type": ("gpu", "accelerator", "gpu_name"),
    "gpu_memory_gb": ("gpu_memory_gib", "gpu_mem_gb", "gpu_memory"),
    "vocab_size": ("vocab", "padded_vocab_size"),
    "seq_len": ("seq_length", "sequence_length", "context_length"),
    "num_kv_heads": ("num_key_value_heads", "kv_heads", "num_query_groups"),
    "num_attention_heads": ("num_heads", "n_heads", "heads"),
    "num_layers": ("n_layers", "layers"),
    "hidden_size": ("d_model", "hidden", "dim"),
    "ffn_hidden_size": ("ffn_size", "intermediate_size", "ffn_dim"),
    "reported_peak_mem_gib": ("peak_mem_gib", "reported_peak_memory_gib", "peak_memory_gib"),
    "pp_schedule": ("schedule", "pipeline_schedule"),
    "grad_accum": ("gradient_accumulation", "grad_accum_steps", "num_microbatches"),
}

_NUM_RE = re.compile(r"[-+]?(?:\d[\d,_]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _norm_key(k: str) -> str:
    return re.sub(r"\s+", "_", k.strip().lower())


class _Row:
    """Case-insensitive access to one CSV row, treating 'not stated'-like cells as missing."""

    def __init__(self, raw: dict[Any, Any]) -> None:
        self.cells: dict[str, str] = {}
        for k, v in raw.items():
            if k is None:  # surplus cells of a ragged row
                continue
            if isinstance(v, list):
                v = ",".join(str(x) for x in v)
            self.cells[_norm_key(str(k))] = "" if v is None else str(v).strip()

    def text(self, name: str) -> str | None:
        """The cell's text, or None when missing/blank/'not stated'/'unknown'."""
        for key in (name, *COLUMN_ALIASES.get(name, ())):
            v = self.cells.get(key)
            if v is not None and v.strip().lower() not in BLANK_CELLS:
                return v.strip()
        return None

    def lower(self, name: str) -> str:
        return (self.text(name) or "").lower()

    def number(self, name: str) -> float | None:
        v = self.text(name)
        if v is None:
            return None
        m = _NUM_RE.search(v.replace("\u2009", ""))
        if not m:
            raise _Unsupported(f"{name}={v!r} is not a number")
        try:
            x = float(m.group(0).replace(",", "").replace("_", ""))
        except ValueError:
            raise _Unsupported(f"{name}={v!r} is not a number") from None
        if not math.isfinite(x):
            raise _Unsupported(f"{name}={v!r} is not a finite number")
        return x

    def integer(self, name: str) -> int | None:
        x = self.number(name)
        if x is None:
            return None
        if not float(x).is_integer():
            raise _Unsupported(f"{name}={self.text(name)!r} is not a whole number")
        return int(x)

    def positive_number(self, name: str) -> float | None:
        """A number > 0, or None (zero/negative readings are unusable as measurements)."""
        try:
            x = self.number(name)
        except _Unsupported:
            return None
        return x if x is not None and x > 0 else None


# ======================================================================================
# Framework of a row, and its usual settings
# ======================================================================================
FRAMEWORKS = ("torchtitan", "llm-foundry", "deepspeed", "megatron", "unknown")
_FRAMEWORK_KEYWORDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torchtitan", ("torchtitan", "f_tt")),
    ("llm-foundry", ("llm-foundry", "llmfoundry", "mosaicml", "mosaic", "composer", "f_mosaic")),
    ("deepspeed", ("deepspeed", "bigscience", "f_bloom")),
    ("megatron", ("megatron", "nemo", "f_meg21", "f_kor22", "korthikanti", "narayanan")),
)
FRAMEWORK_LABEL = {"torchtitan": "torchtitan", "llm-foundry": "llm-foundry (Composer)",
                   "deepspeed": "Megatron-DeepSpeed", "megatron": "Megatron-LM",
                   "unknown": "an unknown framework"}
DEFAULT_SEQ_LEN = {"torchtitan": 8192, "llm-foundry": 2048, "deepspeed": 2048, "megatron": 2048,
                   "unknown": 2048}
# ZeRO stage when `sharding` is blank: Megatron-LM DDP (no distributed optimizer unless
# asked); torchtitan FSDP2; llm-foundry FSDP FULL_SHARD; Megatron-DeepSpeed ZeRO-1 (BLOOM,
# MT-NLG); unknown: plain data parallelism.
DEFAULT_ZERO = {"torchtitan": 3, "llm-foundry": 3, "deepspeed": 1, "megatron": 0, "unknown": 0}
# Activation recomputation when blank: torchtitan's JobConfig default is selective AC with
# option "2" (every second layer); the others default to none.
DEFAULT_RECOMPUTE = {"torchtitan": "selective (layer)", "llm-foundry": "none", "deepspeed": "none",
                     "megatron": "none", "unknown": "none"}


def detect_framework(row: _Row) -> str:
    """Which framework produced the row (an explicit `framework` column wins)."""
    explicit = row.lower("framework")
    if explicit:
        for fw, keys in _FRAMEWORK_KEYWORDS:
            if fw in explicit or any(k in explicit for k in keys):
                return fw
    if (row.text("source_id") or "").upper().startswith("TT_"):
        return "torchtitan"
    # Columns in order of trust: the first column naming a framework decides.
    cols = ("source_id", "source", "source_locator", "metric_formula_id", "attention_impl",
            "other_settings", "sharding", "pp_schedule", "tflops_kind", "notes")
    for col in cols:
        text = row.lower(col)
        for fw, keys in _FRAMEWORK_KEYWORDS:
            if any(k in text for k in keys):
                return fw
    if "fsdp2" in row.lower("sharding") or "fsdp2" in row.lower("other_settings"):
        return "torchtitan"
    return "unknown"


# ======================================================================================
# Model
# ======================================================================================
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


def arch_family(row: _Row) -> str | None:
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


def _bool_cell(v: str | None) -> bool | None:
    if v is None:
        return None
    v = v.strip().lower()
    if v.startswith(("yes", "true", "y", "1", "on")):
        return True
    if v.startswith(("no", "false", "n", "0", "off")):
        return False
    return None


def _llama_ffn(h: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4h rounded up to a multiple of 256 (Llama 1/2 code)."""
    f = int(2 * 4 * h / 3)
    return multiple_of * ((f + multiple_of - 1) // multiple_of)


def build_model(row: _Row, fw: str, assume: Callable[[str], None]) -> ModelSpec:
    name = row.text("model") or f"row-{row.text('row_id') or '?'}"
    arch_text = row.lower("arch_family")
    if re.search(r"encoder[\s-]*decoder|\bt5\b", f"{arch_text} {name.lower()}"):
        raise _Unsupported("encoder-decoder models are not expressible as a ModelSpec")
    fam = arch_family(row)
    explicit = _explicit_arch(arch_text)
    for col, key in (("position", "position"), ("norm", "norm"), ("bias", "bias"),
                     ("tied_embeddings", "tied_embeddings"), ("embedding_norm", "embedding_norm")):
        v = row.text(col)
        if v is None:
            continue
        if key in ("bias", "tied_embeddings", "embedding_norm"):
            b = _bool_cell(v)
            if b is not None:
                explicit[key] = b
        else:
            explicit[key] = v.lower()
    defaults = ARCH_DEFAULTS[fam or "gpt"]
    arch: dict[str, Any] = {}
    inferred = []
    for key in ("position", "norm", "bias", "tied_embeddings", "embedding_norm"):
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

    L = row.integer("num_layers")
    h = row.integer("hidden_size")
    if L is None or h is None:
        raise _Unsupported("num_layers and hidden_size are required")
    head_dim = row.integer("head_dim")
    heads = row.integer("num_attention_heads")
    if heads is None:
        hd = head_dim or 128
        if h % hd:
            raise _Unsupported("num_attention_heads not stated and hidden_size is not a "
                               "multiple of 128")
        heads = h // hd
        assume(f"num_attention_heads not stated: assumed hidden_size/{hd} = {heads}")
    kv = row.integer("num_kv_heads")
    if kv is None:
        kv = heads
        assume(f"num_kv_heads not stated: assumed equal to num_attention_heads ({heads}, no GQA)")
    mlp = row.lower("mlp_type")
    if mlp:
        mlp = mlp.replace("-", "_").replace(" ", "_")
        mlp = {"gelu": "gelu_4h", "relu": "relu_4h", "geglu": "swiglu", "silu": "swiglu",
               "relu2": "squared_relu", "squared_relu_4h": "squared_relu"}.get(mlp, mlp)
        if mlp not in MLP_TYPES:
            raise _Unsupported(f"mlp_type {row.text('mlp_type')!r} is not one of "
                               f"{', '.join(MLP_TYPES)}")
    else:
        mlp = explicit.get("mlp_type", defaults["mlp_type"])
        assume(f"mlp_type not stated: assumed {mlp}")
    ffn = row.integer("ffn_hidden_size")
    if ffn is None:
        ffn = _llama_ffn(h) if mlp == "swiglu" else 4 * h
        assume(f"ffn_hidden_size not stated: assumed {ffn} "
               f"({'Llama rule 8h/3 rounded up to 256' if mlp == 'swiglu' else '4h'})")
    vocab = row.integer("vocab_size")
    if vocab is None:
        low = name.lower()
        if fam == "llama":
            vocab = 128256 if re.search(r"llama[\s_-]*3", low) else 32000
        elif fam in DEFAULT_VOCAB:
            vocab = DEFAULT_VOCAB[fam]
        else:
            raise _Unsupported("vocab_size not stated and the model family is not recognised")
        label = FAMILY_LABEL.get(fam or "", "family")
        assume(f"vocab_size not stated: assumed {vocab} ({label} default)")
    seq = row.integer("seq_len")
    if seq is None:
        seq = DEFAULT_SEQ_LEN[fw]
        assume(f"seq_len not stated: assumed {seq} ({FRAMEWORK_LABEL[fw]} default)")

    # Mixture of experts (optional columns).
    n_exp = row.integer("num_experts") or row.integer("experts") or row.integer("n_experts")
    top_k = (row.integer("experts_per_token") or row.integer("top_k") or row.integer("moe_top_k")
             or row.integer("topk"))
    exp_ffn = row.integer("expert_ffn_hidden_size") or row.integer("moe_ffn_hidden_size")
    moe_text = f"{arch_text} {name.lower()}"
    if n_exp is None and re.search(r"\bmoe\b|mixture[\s-]*of[\s-]*experts|mixtral", moe_text):
        if "mixtral" in moe_text:
            n_exp, top_k = 8, top_k or 2
            assume("num_experts not stated: assumed Mixtral's 8 experts, top-2")
        else:
            raise _Unsupported("mixture-of-experts model without num_experts")
    if n_exp and n_exp > 1 and top_k is None:
        top_k = 2
        assume("experts_per_token not stated: assumed top-2")

    kwargs: dict[str, Any] = dict(
        name=name, num_layers=L, hidden_size=h, num_attention_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, ffn_hidden_size=ffn, mlp_type=mlp, vocab_size=vocab, seq_len=seq,
        **arch)
    if n_exp and n_exp > 1:
        kwargs.update(num_experts=n_exp, experts_per_token=top_k or 1,
                      expert_ffn_hidden_size=exp_ffn)
    try:
        return ModelSpec(**kwargs)
    except MeshplanError as e:
        raise _Unsupported(str(e)) from None


# ======================================================================================
# GPU and cluster
# ======================================================================================
def _nearest(mem: float, options: tuple[float, ...]) -> float | None:
    best = min(options, key=lambda o: abs(o - mem))
    return best if abs(best - mem) <= 0.1 * best else None


def gpu_preset_for(gpu_type: str, memory_gb: float | None,
                   assume: Callable[[str], None]) -> str:
    """Map a row's gpu_type + gpu_memory_gb to a GPU preset name (which may not exist yet)."""
    t = gpu_type.lower().replace("_", "-")
    if memory_gb is None:
        m = re.search(r"(\d+(?:\.\d+)?)\s*gi?b", t)
        memory_gb = float(m.group(1)) if m else None
    pcie = "pcie" in t

    def mem_or(default: float, options: tuple[float, ...], label: str) -> float:
        if memory_gb is None:
            assume(f"gpu_memory_gb not stated: assumed {default:g} GB {label}")
            return default
        near = _nearest(memory_gb, options)
        if near is None:
            raise _Unsupported(f"no GPU preset for {gpu_type!r} with {memory_gb:g} GB")
        return near

    if "mi300x" in t or "mi300" in t:
        return "mi300x-192gb"
    if "gb200" in t:
        raise _Unsupported(f"no GPU preset for {gpu_type!r} (Grace Blackwell superchips are not modelled)")
    if "gh200" in t:
        if memory_gb is None and "hbm3e" in t:
            return "gh200-144gb"
        return "gh200-144gb" if mem_or(96, (96, 144), "(GH200)") == 144 else "gh200-96gb"
    if "b200" in t:
        return "b200-sxm-192gb"
    if "h200" in t:
        return "h200-sxm-141gb"
    if "h100" in t:
        if "nvl" in t:
            return "h100-nvl-94gb"
        if pcie:
            return "h100-pcie-80gb"
        if "500w" in t or "hbm2e" in t:
            return "h100-sxm-96gb-500w"
        mem = mem_or(80, (80, 96), "(H100 SXM5)")
        return "h100-sxm-96gb-500w" if mem == 96 else "h100-sxm-80gb"
    if "a100" in t:
        mem = mem_or(80, (40, 80), "(A100)")
        form = "pcie" if pcie else "sxm"
        if not pcie and "sxm" not in t:
            assume("A100 form factor not stated: assumed SXM4 (HGX/DGX)")
        return f"a100-{form}-{int(mem)}gb"
    if "v100" in t:
        mem = mem_or(32, (16, 32), "(V100)")
        if not pcie and "sxm" not in t:
            assume("V100 form factor not stated: assumed SXM2 (DGX-1/DGX-2)")
        return f"v100-{'pcie' if pcie else 'sxm'}-{int(mem)}gb"
    if "l40s" in t:
        return "l40s-48gb"
    raise _Unsupported(f"no GPU preset for gpu_type {gpu_type!r}")


KNOWN_SYSTEMS = {
    # pattern in the row's source/notes/settings -> (cluster preset, GPU preset it holds)
    r"jean[\s_-]*zay|bloom[\s_-]*176|bigscience": ("jean-zay-a100", "a100-sxm-80gb"),
}


def known_system(row: _Row, gpu: str | None) -> str | None:
    """A cluster preset for a documented training system the row names (its real links)."""
    text = " ".join(row.lower(c) for c in ("source_id", "source", "model", "notes",
                                            "other_settings", "cluster"))
    for pattern, (preset, gpu_preset) in KNOWN_SYSTEMS.items():
        if re.search(pattern, text) and gpu == gpu_preset:
            return preset
    return None


def system_cluster(preset: str, n: int, assume: Callable[[str], None]) -> ClusterSpec:
    """The named system's cluster preset, sized to ``n`` GPUs."""
    base = load_cluster(preset)
    if n % base.gpus_per_node:
        raise _Unsupported(f"num_gpus={n} is not whole nodes of {preset} "
                           f"({base.gpus_per_node} GPUs per node)")
    assume(f"cluster: {preset} (the documented system of this source, its own links: "
           f"{base.intra_node.bandwidth_gbps:g} GB/s intra-node, "
           f"{base.inter_node.bandwidth_gbps:g} GB/s per GPU inter-node)")
    return base.replace(num_nodes=n // base.gpus_per_node, name=f"{preset}:{n}")


def build_cluster(gpu: str, n: int, per_node: int | None, tp: int,
                  assume: Callable[[str], None]) -> ClusterSpec:
    """parse_cluster_shorthand(f'{gpu}:{n}') semantics: the GPU's typical node size (8 for
    HGX/DGX parts, 4 for GH200), one node below that."""
    node = load_gpu(gpu).gpus_per_node
    if per_node:
        if n % per_node:
            raise _Unsupported(f"num_gpus={n} is not a multiple of gpus_per_node={per_node}")
        spec = f"{gpu}:{n // per_node}x{per_node}"
    elif n > node and n % node:
        cands = [d for d in range(node, 0, -1) if n % d == 0 and d % tp == 0]
        if not cands:
            raise _Unsupported(f"num_gpus={n} does not split into nodes that hold tp={tp}")
        per = cands[0]
        assume(f"{n} GPUs is not a whole number of {node}-GPU nodes: assumed {n // per} nodes x {per}")
        spec = f"{gpu}:{n // per}x{per}"
    else:
        if node != 8 and n > node:
            assume(f"nodes of {node} GPUs ({gpu}'s typical node)")
        spec = f"{gpu}:{n}"
    try:
        return parse_cluster_shorthand(spec)
    except MeshplanError as e:
        raise _Unsupported(str(e)) from None


# ======================================================================================
# Plan pieces
# ======================================================================================
def parse_sharding(text: str | None, fw: str,
                   assume: Callable[[str], None]) -> tuple[int, bool, int | None]:
    """(zero stage, hybrid?, stated shard group) from the `sharding` cell."""
    if text is None:
        z = DEFAULT_ZERO[fw]
        assume(f"sharding not stated: assumed zero={z} ({FRAMEWORK_LABEL[fw]} default)")
        return z, False, None
    t = text.lower()
    hybrid = bool(re.search(r"hsdp|hybrid", t))
    m = re.search(r"(?:shard(?:ing)?[\s_-]*(?:group|degree|size)?|shard)\s*[=:]?\s*(\d+)", t)
    group = int(m.group(1)) if (hybrid and m) else None
    m = re.search(r"zero[\s_-]*(?:stage[\s_-]*)?[=:]?\s*(\d)", t)
    if m and int(m.group(1)) in (0, 1, 2, 3) and not t.startswith("none"):
        z = int(m.group(1))
        return (3 if hybrid and z == 0 else z), hybrid, group
    if "shard_grad_op" in t or "grad_op" in t or "zero2" in t:
        return 2, hybrid, group
    if "distributed optimizer" in t or "distributed-optimizer" in t or "distributed_optimizer" in t:
        return 1, hybrid, group
    if hybrid or "full_shard" in t or "fully shard" in t or "fsdp2" in t or "fully_shard" in t:
        return 3, hybrid, group
    if "no_shard" in t or t.startswith("none") or "ddp" in t or t in ("no", "off", "false"):
        return 0, False, None
    if "fsdp" in t:
        assume(f"sharding {text!r}: assumed FSDP's default FULL_SHARD (zero=3)")
        return 3, False, None
    if "zero" in t:
        assume(f"sharding {text!r} names no ZeRO stage: assumed ZeRO-1")
        return 1, False, None
    raise _Unsupported(f"sharding {text!r} not understood")


def parse_schedule(text: str | None, pp: int, vs: int | None, fw: str,
                   assume: Callable[[str], None]) -> tuple[str, int]:
    """(schedule, virtual_stages)."""
    t = (text or "").lower()
    if text is None or t == "none":
        if pp > 1:
            sched = "interleaved-1f1b" if (vs or 1) > 1 else "1f1b"
            assume(f"pp_schedule not stated with pp={pp}: assumed {sched} "
                   f"({FRAMEWORK_LABEL[fw]} default)")
        else:
            sched = "1f1b"
    elif "dualpipe" in t:
        raise _Unsupported(f"pipeline schedule {text!r} is not modelled")
    elif "zbv" in t or "zero bubble v" in t or "zero-bubble-v" in t or "zb-v" in t:
        sched = "zbv"
    elif re.search(r"zero[\s_-]*bubble|\bzb\b|zb-?h1|zbh1", t):
        sched = "zero-bubble"
    elif "interleav" in t or "looped" in t or "virtual" in t:
        sched = "interleaved-1f1b"
    elif "gpipe" in t or "fill-drain" in t or "fill drain" in t:
        sched = "gpipe"
    elif "1f1b" in t or "pipedream-flush" in t or pp == 1:
        sched = "1f1b"
    else:
        raise _Unsupported(f"pipeline schedule {text!r} not understood")
    if pp == 1:
        return "1f1b", 1
    if sched == "zbv":
        if vs not in (None, 2):
            raise _Unsupported(f"schedule ZBV uses 2 virtual stages, row says {vs}")
        return sched, 2
    if sched == "interleaved-1f1b":
        if vs is None:
            assume("virtual_stages not stated for the interleaved schedule: assumed 2 "
                   "(the smallest interleaving; torchtitan's default stages per rank)")
            vs = 2
        return sched, vs
    if vs is not None and vs > 1:
        assume(f"virtual_stages={vs} with schedule {text!r}: treated as interleaved-1f1b "
               "(Megatron interleaves whenever virtual stages > 1)")
        return "interleaved-1f1b", vs
    return sched, 1


def parse_recompute(text: str | None, fw: str, layers_per_stage: int,
                    assume: Callable[[str], None]) -> tuple[str, int | None]:
    """(recompute, recompute_layers)."""
    if text is None:
        text = DEFAULT_RECOMPUTE[fw]
        assume(f"recompute not stated: assumed {text!r} ({FRAMEWORK_LABEL[fw]} default)")
    t = text.lower()
    if t.startswith(("none", "no", "off", "false", "disabled")):
        return "none", None
    if "selective" in t and "layer" in t:
        m = re.search(r"(?:every|period|freq\w*|ac[\s_]*option)\s*[=:]?\s*(\d+)", t)
        period = int(m.group(1)) if m else 2
        if not m:
            assume("'selective (layer)' period not stated: assumed torchtitan's default "
                   "selective_ac_option=2 (every 2nd block checkpointed) -> full recompute of "
                   f"{layers_per_stage // 2} of {layers_per_stage} blocks per stage")
        return "full", layers_per_stage // period
    if "selective" in t and re.search(r"\bop\b", t):
        return "op", None  # torchtitan op-level SAC: every other matmul recomputed
    if "selective" in t or "attention core" in t:
        return "selective", None
    if t.startswith("full") or "checkpoint" in t or "every" in t or t in ("yes", "true", "on"):
        m = re.search(r"(\d+)\s*(?:of\s*\d+\s*)?(?:layers|blocks)", t)
        if m and "every" not in t:
            n = int(m.group(1))
            return "full", min(n, layers_per_stage)
        return "full", None
    raise _Unsupported(f"recompute {text!r} not understood")


def parse_precision(text: str | None, fw: str, assume: Callable[[str], None]) -> str:
    if text is None:
        assume("precision not stated: assumed bf16")
        return "bf16"
    t = text.lower()
    if "fp8" in t or "float8" in t or "e4m3" in t:
        return "fp8"
    if "fp16" in t or "float16" in t or "half" in t:
        return "fp16"
    if "bf16" in t or "bfloat16" in t:
        return "bf16"
    if "fp32" in t or "float32" in t or "tf32" in t:
        return "fp32"
    if "16-bit" in t or "16 bit" in t or "mixed" in t:
        assume(f"precision {text!r}: assumed bf16 (fp16 and bf16 have the same tensor-core peak)")
        return "bf16"
    assume(f"precision {text!r} not understood: assumed bf16")
    return "bf16"


def split_layers(L: int, pp: int, vs: int, fw: str, notes: str) -> tuple[int, ...]:
    """Blocks per pipeline rank when L is not divisible by pp*vs, as the framework splits them."""
    if fw == "deepspeed" and "embedding" in notes and vs == 1:
        # DeepSpeed partition_method 'type:transformer|embedding': the two embedding layers
        # count as one unit each, so the first and last stages get one block fewer.
        units = L + 2
        base, extra = divmod(units, pp)
        per = [base + (1 if i < extra else 0) for i in range(pp)]
        per[0] -= 1
        per[-1] -= 1
        if min(per) >= 0 and sum(per) == L:
            return tuple(per)
    if vs == 1:
        # torchtitan generate_split_points: stage 0 gets base, middle stages base+1 while
        # extra layers remain, the last stage the rest.
        base, extra = divmod(L, pp)
        per = [base]
        for _ in range(1, pp - 1):
            if extra > 0:
                per.append(base + 1)
                extra -= 1
            else:
                per.append(base)
        per.append(L - sum(per))
        return tuple(per)
    # Interleaved: each rank's count must be a multiple of vs; spread chunks of vs blocks.
    if L % vs:
        raise _Unsupported(f"{L} layers cannot be split into pp={pp} stages of whole "
                           f"virtual_stages={vs} chunks")
    units = L // vs
    base, extra = divmod(units, pp)
    return tuple(vs * (base + (1 if i < extra else 0)) for i in range(pp))


# ======================================================================================
# Measured values
# ======================================================================================
def _peak_from_basis(text: str | None) -> float | None:
    """'A100 bf16 312' -> 312: the last number not glued to letters (A100, bf16 are skipped)."""
    if not text:
        return None
    nums = re.findall(r"(?<![A-Za-z\d.])(\d+(?:\.\d+)?)(?![A-Za-z\d])", text)
    vals = [float(x) for x in nums if float(x) >= 20]
    return vals[-1] if vals else None


#: Frameworks whose MFU divides by the peak of the run's own precision (Composer's
#: SpeedMonitor GPU_AVAILABLE_FLOPS: amp_fp8 -> the fp8 peak, 1979 TFLOP/s on H100 SXM);
#: the others (torchtitan, Megatron) quote the 16-bit peak whatever the precision.
OWN_PRECISION_PEAK = ("llm-foundry",)


def default_peak_tflops(gpu: str | None, gpu_type: str, precision: str,
                        fw: str = "unknown") -> tuple[float | None, str]:
    """The dense peak the row's source divided by, when the row does not state it."""
    t = gpu_type.lower()
    own = precision == "fp8" and fw in OWN_PRECISION_PEAK
    if "a100" in t:
        return 312.0, "A100 dense bf16/fp16 312 TFLOP/s"
    if "h100" in t or "h200" in t:  # also GH200: the H100 GPU of the superchip
        kind = "PCIe" if "pcie" in t else ("NVL" if "nvl" in t else "SXM")
        bf16, fp8 = {"PCIe": (756.0, 1513.0), "NVL": (835.0, 1671.0), "SXM": (989.0, 1979.0)}[kind]
        name = "GH200" if "gh200" in t else ("H200" if "h200" in t else "H100")
        if own:
            return fp8, f"{name} {kind} dense fp8 {fp8:g} TFLOP/s ({FRAMEWORK_LABEL[fw]} uses the fp8 peak)"
        return bf16, f"{name} {kind} dense bf16 {bf16:g} TFLOP/s"
    if gpu:
        try:
            g = load_gpu(gpu)
            prec = precision if (own or precision != "fp8") else "bf16"
            p = g.peak(prec) / 1e12
            return p, f"{gpu} preset dense {prec} {p:g} TFLOP/s"
        except MeshplanError:
            pass
    return None, ""


_OK_STATUS = re.compile(r"^(ok|success|succeeded|completed|done|trained)\b")
_NO_OOM = re.compile(r"\bno[\s_-]*oom\b|oom[\s_-]*free|without[\s_-]*oom")
_GPU_OOM = re.compile(r"(?<![a-z])oom(?![a-z])|out[\s_-]*of[\s_-]*memory|memory[\s_-]*limit[\s_-]*exceeded"
                      r"|exceeded[\s_-]*(gpu[\s_-]*)?memory")
_HOST_OOM = re.compile(r"\b(host|cpu|system)[\s_-]*(oom|out[\s_-]*of[\s_-]*memory)|oom[\s_-]*killer")


def did_not_fit(status: str) -> bool:
    """A `status` cell that says the run ran out of GPU memory ('oom', 'failed (OOM)', 'CUDA out
    of memory', 'memory limit exceeded'); not 'ok (no OOM)', nor a host OOM-killer."""
    t = status.strip().lower()
    if _OK_STATUS.match(t) or _NO_OOM.search(t) or _HOST_OOM.search(t):
        return False
    return bool(_GPU_OOM.search(t))


def measure_step_time(row: _Row, *, B: int | None, s: int | None, n: int | None,
                      model: ModelSpec | None, recompute: str, fw: str, gpu: str | None,
                      precision: str, assume: Callable[[str], None]) -> tuple[float | None, str]:
    """(step time in s, how it was obtained) following the README's per-source formulas."""
    t = row.positive_number("reported_step_time_s")
    if t is not None:
        return t, "reported_step_time_s"
    tpg = row.positive_number("reported_tokens_per_s_per_gpu")
    if tpg is not None and B and s and n:
        return (step_time_from_tokens_per_gpu(B, s, n, tpg),
                "reported_tokens_per_s_per_gpu: t = B*s/(n*tok/s/GPU)")
    tpt = row.positive_number("reported_tokens_per_s_total")
    if tpt is not None and B and s:
        return (step_time_from_tokens_total(B, s, tpt),
                "reported_tokens_per_s_total: t = B*s/(tok/s)")
    sps = row.positive_number("reported_samples_per_s")
    if sps is not None and B:
        return step_time_from_samples(B, sps), "reported_samples_per_s: t = B/(seq/s)"

    # FLOP-based: need the shapes.
    fid = (row.text("metric_formula_id") or "").upper()
    kind = row.lower("tflops_kind")
    L, h, V = row.integer("num_layers"), row.integer("hidden_size"), row.integer("vocab_size")
    if model is not None:
        L, h, V = model.num_layers, model.hidden_size, model.vocab_size
    if not (B and s and n and L and h and V):
        return None, ""
    h_attn = model.q_dim if model is not None else h

    def flops(hardware: bool) -> tuple[float | None, str]:
        if fid == "F_MEG21":
            if hardware:
                return flops_meg21(B, s, L, h, V), "F_MEG21 (SC'21 Eq. 3)"
            return (flops_megatron_no_recompute(B, s, L, h, V),
                    "F_MEG21 without recompute (72 B s l h^2 ...)")
        if fid == "F_BLOOM":
            rec = recompute != "none" if hardware else False
            return (flops_bloom(B, s, L, h, V, rec),
                    f"F_BLOOM (Megatron-DeepSpeed, factor {4 if rec else 3})")
        if fid == "F_KOR22":
            if hardware:
                return flops_kor22_hardware(B, s, L, h, V, recompute), "F_KOR22 hardware FLOPs"
            return flops_kor22_model(B, s, L, h, V), "F_KOR22 model FLOPs"
        if model is None:
            return None, ""
        if fid == "F_TT":
            return flops_tt(B, s, L, h_attn, model.num_params()), "F_TT (6N + 12 l h s per token)"
        if fid == "F_MOSAIC":
            hw = hardware and recompute != "none"
            return (flops_mosaic(B, s, L, h_attn, model.num_params(), hw),
                    f"F_MOSAIC ({'8N s + 16 l h s^2' if hw else '6N s + 12 l h s^2'})")
        # Unknown formula id: fall back on what the row says.
        if hardware and recompute != "none":
            assume(f"metric formula {fid or 'not stated'}: hardware FLOPs taken as "
                   "Megatron Eq. 3 style")
            return (flops_bloom(B, s, L, h, V, recompute != "none"),
                    "Eq. 3 style hardware FLOPs (fallback)")
        assume(f"metric formula {fid or 'not stated'}: model FLOPs taken as "
               "6N + 12 l h s per token (PaLM)")
        return (flops_palm(B, s, L, h_attn, model.num_active_params()),
                "6N + 12 l h s per token (fallback)")

    tfl = row.positive_number("reported_tflops_per_gpu")
    src = "reported_tflops_per_gpu"
    if tfl is None:
        agg = row.positive_number("reported_aggregate_pflops")
        if agg is not None:
            tfl, src = agg * 1e3 / n, "reported_aggregate_pflops/n"
    if tfl is not None:
        hardware = "hardware" in kind or (fid in ("F_MEG21", "F_BLOOM") and "model" not in kind)
        F, how = flops(hardware)
        if F is not None:
            return step_time_from_flops(F, n, tfl), f"{src} via {how}: t = F/(n*TFLOP/s)"

    peak = _peak_from_basis(row.text("peak_tflops_basis"))
    peak_how = "peak_tflops_basis"
    for col, hardware in (("reported_mfu_pct", False), ("reported_hfu_pct", True)):
        u = row.positive_number(col)
        if u is None:
            continue
        if peak is None:
            peak, peak_how = default_peak_tflops(gpu, row.text("gpu_type") or "", precision, fw)
            if peak is None:
                return None, ""
            assume(f"peak_tflops_basis not stated: assumed {peak_how}")
        if u <= 1.0:
            assume(f"{col}={u} read as a fraction, not a percentage")
            u *= 100.0
        F, how = flops(hardware)
        if F is not None:
            return (step_time_from_utilization(F, n, peak, u),
                    f"{col} via {how}, peak {peak:g} TFLOP/s: t = F/(n*peak*util)")
    return None, ""


def measure_peak_mem(row: _Row, assume: Callable[[str], None]) -> float | None:
    v = row.positive_number("reported_peak_mem_gib")
    if v is not None:
        return v
    v = row.positive_number("reported_peak_mem_gb")
    if v is not None:
        assume("reported_peak_mem_gb read as decimal GB and converted to GiB")
        return v * 1e9 / GiB
    return None


# ======================================================================================
# One row
# ======================================================================================
def attention_is_flash(text: str, assume: Callable[[str], None]) -> bool:
    """FlashAttention-style kernel or the unfused softmax path (Megatron before 2022)."""
    if re.search(r"fused softmax|pre-flash|unfused|eager|\bmath\b", text):
        return False
    if not re.search(r"flash|sdpa|triton|cudnn|memory[\s_-]*efficient|xformers|te\b", text):
        assume("attention kernel not stated: assumed FlashAttention-style (fused, causal "
               "blocks skipped)")
    return True


def _plan_from_row(row: _Row, fw: str, model: ModelSpec, assume: Callable[[str], None],
                   ) -> tuple[Plan, Workload, int, str]:
    """(plan, workload, number of GPUs, recompute mode); the caller builds the cluster."""
    L = model.num_layers
    stated: dict[str, int] = {}
    for ax in ("tp", "pp", "dp", "cp", "ep"):
        v = row.integer(ax)
        if v is not None:
            if v <= 0:
                raise _Unsupported(f"{ax}={v} must be positive")
            stated[ax] = v
    n = row.integer("num_gpus")
    if n is not None and n <= 0:
        raise _Unsupported(f"num_gpus={n} must be positive")
    missing = [ax for ax in ("tp", "pp", "dp", "cp") if ax not in stated]
    # One unstated degree absorbs num_gpus (dp first, then tp, pp, cp); the others are 1.
    free = next((ax for ax in ("dp", "tp", "pp", "cp") if ax in missing), None) if n else None
    deg = {ax: stated.get(ax, 1) for ax in ("tp", "pp", "dp", "cp", "ep")}
    ones = [ax for ax in missing + (["ep"] if "ep" not in stated else []) if ax != free]
    if ones:
        assume(f"{', '.join(ones)} not stated: assumed 1")
    if free is not None:
        rest = math.prod(deg[a] for a in ("tp", "pp", "dp", "cp") if a != free)
        if n % rest:
            raise _Unsupported(f"num_gpus={n} is not divisible by the stated degrees ({rest})")
        deg[free] = n // rest
        others = "*".join(a for a in ("tp", "pp", "dp", "cp") if a != free)
        assume(f"{free} not stated: derived num_gpus/({others}) = {deg[free]}")
    tp, pp, dp, cp, ep = (deg[a] for a in ("tp", "pp", "dp", "cp", "ep"))
    if n is None:
        if "dp" not in stated:
            raise _Unsupported("neither num_gpus nor dp is stated")
        n = tp * pp * dp * cp
        assume(f"num_gpus not stated: derived tp*pp*dp*cp = {n}")
    dp_as_stated = dp
    if n != tp * pp * dp * cp:
        if n % (tp * pp * cp) == 0:
            new = n // (tp * pp * cp)
            assume(f"dp={dp} inconsistent with num_gpus={n}: used dp = num_gpus/(tp*pp*cp) = {new}")
            dp = new
        else:
            raise _Unsupported(f"tp*pp*dp*cp = {tp * pp * dp * cp} does not match num_gpus={n}")

    # Batch.
    B = row.integer("global_batch_seqs")
    mb = row.integer("micro_batch")
    ga = row.integer("grad_accum")
    for name, v in (("global_batch_seqs", B), ("micro_batch", mb), ("grad_accum", ga)):
        if v is not None and v <= 0:
            raise _Unsupported(f"{name}={v} must be positive")
    if B is None:
        if mb is None:
            raise _Unsupported("neither global_batch_seqs nor micro_batch is stated")
        if ga is None:
            ga = 1
            assume("grad_accum not stated: assumed 1")
        B = mb * dp * ga
        assume(f"global_batch_seqs not stated: derived micro_batch*dp*grad_accum = {B}")
    pp_micro_note = None
    if mb is None:
        if ga is not None and B % (dp * ga) == 0:
            mb = B // (dp * ga)
            assume(f"micro_batch not stated: derived global_batch/(dp*grad_accum) = {mb}")
        elif fw == "torchtitan" and B % dp == 0:
            mb = B // dp
            assume(f"micro_batch not stated: torchtitan local batch = global_batch/dp = {mb}")
        else:
            mb = 1
            assume("micro_batch not stated: assumed 1")

    # Schedule (needs pp, vs) then torchtitan's PP micro-batching.
    vs_cell = row.integer("virtual_stages")
    sched, vs = parse_schedule(row.text("pp_schedule"), pp, vs_cell, fw, assume)
    if pp > 1 and ga is None:
        if fw == "torchtitan" and B % dp == 0:
            local = B // dp
            m = pp * vs
            if local % m == 0:
                mb = local // m
                pp_micro_note = (f"PP micro-batch count not stated: assumed torchtitan's default "
                                 f"n_microbatches = pp*stages_per_rank = {m}, so the local batch "
                                 f"{local} gives micro_batch={mb}")
            else:
                pp_micro_note = (f"PP micro-batch count not stated: torchtitan default {m} does "
                                 f"not divide the local batch {local}; assumed "
                                 f"global_batch/(dp*micro_batch) = {B / (dp * mb):g}")
        else:
            pp_micro_note = ("micro-batch count for PP not stated: assumed "
                             f"global_batch/(dp*micro_batch) = {B / (dp * mb):g}")
        assume(pp_micro_note)
    if ga is not None and dp * mb * ga != B and B % (dp * ga) == 0:
        # grad_accum is micro-batches per step per data-parallel rank: trust it and the batch.
        new = B // (dp * ga)
        assume(f"micro_batch*dp*grad_accum = {mb}*{dp}*{ga} != global batch {B}: used "
               f"micro_batch = global_batch/(dp*grad_accum) = {new}")
        mb = new
    elif B % (dp * mb) and B % dp == 0:
        # Uneven micro-batching (Composer splits the local batch into ceil(local/mb) pieces):
        # the nearest even split uses the largest divisor of the local batch <= micro_batch.
        local = B // dp
        new = max(d for d in range(1, min(mb, local) + 1) if local % d == 0)
        assume(f"micro_batch={mb} does not divide the per-rank batch {local} "
               f"(uneven micro-batches): assumed micro_batch={new}")
        mb = new

    zero, hybrid, group = parse_sharding(row.text("sharding"), fw, assume)
    shard_group = 0
    sg = row.integer("shard_group") or row.integer("dp_shard") or group
    if hybrid:
        if sg is None and dp_as_stated != dp and dp % dp_as_stated == 0:
            sg = dp_as_stated
            assume(f"hybrid sharding: the row's dp={dp_as_stated} read as the shard group "
                   f"(replicated {dp // dp_as_stated} times)")
        if sg is None:
            per_node = row.integer("gpus_per_node") or min(8, n)
            sg = max(1, per_node // tp)
            assume(f"hybrid sharding group not stated: assumed FSDP HYBRID_SHARD default "
                   f"(shard within a node) = {sg} ranks")
        shard_group = sg if sg < dp * cp else 0

    layers_per_stage = max(1, L // pp)
    recompute, rec_layers = parse_recompute(row.text("recompute"), fw, layers_per_stage, assume)

    sp = _bool_cell(row.text("sequence_parallel"))
    if sp is None:
        sp = fw == "torchtitan" and tp > 1
        why = " TP plan shards norms" if sp else " default"
        assume(f"sequence_parallel not stated: assumed {'yes' if sp else 'no'} "
               f"({FRAMEWORK_LABEL[fw]}{why})")
    if sp and tp == 1:
        assume("sequence_parallel=yes with tp=1 has no effect: set to no")
        sp = False

    precision = parse_precision(row.text("precision"), fw, assume)
    other = " ".join(row.lower(c) for c in ("other_settings", "sharding"))
    compile_ = ("torch.compile" in other or "torch_compile" in other
                or _bool_cell(row.text("compile")) is True)
    # Megatron-LM / NeMo (Transformer Engine or apex fused LayerNorm/RMSNorm, bias-GeLU and
    # bias-SwiGLU fusions, fused bias-dropout-add, fused RoPE) and Megatron-DeepSpeed (apex
    # fused LayerNorm, bias-GeLU, bias-dropout-add) run hand-fused elementwise kernels
    # without torch.compile; plain DeepSpeed (e.g. HF Trainer + ZeRO) does not.
    megatron_code = fw == "megatron" or (fw == "deepspeed" and re.search(
        r"megatron|bloom|bigscience", " ".join(row.lower(c) for c in (
            "source", "source_id", "model", "other_settings", "notes", "framework"))))
    if not compile_ and megatron_code and _bool_cell(row.text("compile")) is None:
        compile_ = True  # the cost model's fused-elementwise path (Plan.compile)
        assume(f"elementwise ops: {FRAMEWORK_LABEL[fw]}'s hand-fused kernels (fused norms, "
               "bias-GeLU/SwiGLU, bias-dropout-add, RoPE), costed as compiled")
    async_tp = bool(re.search(r"async[\s_-]*tp|tp[\s_-]*comm[\s_-]*overlap", other)) or \
        _bool_cell(row.text("async_tp")) is True
    offload_opt = bool(re.search(r"offload[\s_-]*(optim|opt\b)|optimizer[\s_-]*offload"
                                 r"|zero[\s_-]*offload|cpu[\s_-]*adam", other))
    offload_par = bool(re.search(r"param\w*[\s_-]*offload|offload[\s_-]*param|cpuoffload"
                                 r"|cpu[\s_-]*offload", other))
    if offload_par:
        if zero != 3:
            raise _Unsupported("parameter offload needs FSDP/ZeRO-3 sharding")
        offload_opt = True

    flash = attention_is_flash(row.lower("attention_impl"), assume)
    fused_loss = fw == "llm-foundry" or bool(re.search(r"fused[\s_-]*(cross|ce\b|loss)|liger", other))
    if fw == "llm-foundry":
        assume("loss: llm-foundry's default fused_crossentropy (in-place logits gradient)")

    stage_layers = None
    if L % (pp * vs) and pp > 1:
        stage_layers = split_layers(L, pp, vs, fw, row.lower("notes"))
        assume(f"{L} layers are not divisible by pp*virtual_stages = {pp}*{vs}: assumed "
               f"{FRAMEWORK_LABEL[fw]}'s uneven split, blocks per stage {list(stage_layers)}")
    if rec_layers is not None and stage_layers is not None:
        rec_layers = min(rec_layers, max(stage_layers))

    try:
        plan = Plan(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero=zero, shard_group=shard_group,
                    micro_batch=mb, virtual_stages=vs, schedule=sched, recompute=recompute,
                    recompute_layers=rec_layers, sequence_parallel=sp,
                    offload_optimizer=offload_opt, offload_params=offload_par,
                    precision=precision, compile=compile_, async_tp=async_tp,
                    flash_attention=flash, fused_loss=fused_loss, stage_layers=stage_layers,
                    p2p_sharded=fw != "deepspeed",
                    grad_sync="all-reduce" if fw == "deepspeed" else "auto")
        work = Workload(global_batch=B, seq_len=model.seq_len)
    except MeshplanError as e:
        raise _Unsupported(str(e)) from None
    return plan, work, n, recompute


def case_from_row(raw: dict[str, Any], index: int = 0) -> RunCase:
    """Build one RunCase from a CSV row dict. Never raises for bad data: unsupported instead."""
    row = _Row(raw)
    assumptions: list[str] = []

    def assume(msg: str) -> None:
        if msg not in assumptions:
            assumptions.append(msg)

    row_id = row.text("row_id") or str(index + 1)
    source_id = row.text("source_id") or "unknown"
    model_name = row.text("model") or f"row-{row_id}"
    run_status = (row.text("status") or "ok").strip().lower()
    fw = detect_framework(row)
    out: dict[str, Any] = dict(row_id=row_id, source_id=source_id, model_name=model_name,
                               raw=dict(row.cells), run_status=run_status, framework=fw)
    model = cluster = plan = work = None
    gpu = None
    n = None
    recompute = "none"
    precision = "bf16"
    reasons: list[str] = []

    def attempt(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (_Unsupported, MeshplanError) as e:
            reasons.append(str(e))
        except Exception as e:  # never lose a row to an unexpected cell
            reasons.append(f"could not read the row ({type(e).__name__}: {e})")
        return None

    def gpu_preset() -> str:
        gpu_type = row.text("gpu_type")
        if gpu_type is None:
            raise _Unsupported("gpu_type not stated")
        name = gpu_preset_for(gpu_type, row.number("gpu_memory_gb"), assume)
        if name not in preset_names("gpus"):
            raise _Unsupported(f"GPU preset {name!r} (for {gpu_type!r}) is not available: "
                               f"no presets/gpus/{name}.toml yet")
        return name

    model = attempt(lambda: build_model(row, fw, assume))
    if model is not None:
        attempt(lambda: _check_params(row, model, assume))
        got = attempt(lambda: _plan_from_row(row, fw, model, assume))
        if got is not None:
            plan, work, n, recompute = got
            precision = plan.precision
    gpu = attempt(gpu_preset)
    system = known_system(row, gpu)
    if system is not None and plan is not None and n:
        cluster = attempt(lambda: system_cluster(system, n, assume))
    elif gpu is not None and plan is not None:
        cluster = attempt(lambda: build_cluster(gpu, n, row.integer("gpus_per_node"), plan.tp,
                                                assume))
    if cluster is not None:
        bad = violations(model, cluster, plan, work)
        reasons += [f"{name}: {why}" for name, why in bad]
    if not reasons and cluster is None:  # pragma: no cover - defensive
        reasons.append("could not build the case")
    reason = "; ".join(reasons)

    # Measurements (best effort even for unsupported rows).
    B = work.global_batch if work else _safe_int(row, "global_batch_seqs")
    s = work.seq_len if work else _safe_int(row, "seq_len")
    if n is None:
        n = _safe_int(row, "num_gpus")
    try:
        t, how = measure_step_time(row, B=B, s=s, n=n, model=model, recompute=recompute, fw=fw,
                                   gpu=gpu, precision=precision, assume=assume)
    except (_Unsupported, MeshplanError, ArithmeticError, ValueError) as e:
        t, how = None, ""
        assume(f"measurement not readable: {e}")
    mem = measure_peak_mem(row, assume)
    if did_not_fit(run_status):
        fits: bool | None = False
        how = how or f"none (status={run_status}: the run did not fit)"
    elif not _OK_STATUS.match(run_status):
        fits = None
        how = how or f"none (status={run_status})"
    else:
        fits = True
    return RunCase(status="unsupported" if reason else "ok", reason=reason,
                   assumptions=assumptions, model=model,
                   cluster=cluster,
                   plan=plan, work=work, measured_step_time_s=t, measured_peak_mem_gib=mem,
                   measured_from=how, measured_fits=fits, gpu_preset=gpu, **out)


def _check_params(row: _Row, model: ModelSpec, assume: Callable[[str], None]) -> None:
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


def _safe_int(row: _Row, name: str) -> int | None:
    try:
        return row.integer(name)
    except _Unsupported:
        return None


def load_runs(path: str | Path) -> list[RunCase]:
    """Read a published-runs CSV into one RunCase per row (none dropped)."""
    p = Path(path)
    try:
        if not p.is_file():
            raise MeshplanError(f"runs file not found: {p}")
        with p.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = {_norm_key(k) for k in (reader.fieldnames or [])}
    except OSError as e:
        raise MeshplanError(f"cannot read the runs file (--runs) {str(p)[:80]}: {e.strerror or e}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise MeshplanError(f"cannot read the runs file (--runs) {str(p)[:80]}: {e}") from None
    needed = {"num_layers", "hidden_size", "num_gpus"}
    if rows and not needed & header:
        raise MeshplanError(f"{p} is not a published-runs CSV: none of the columns "
                            f"{', '.join(sorted(needed))} is present",
                            hint="see shared/data/README.md for the format")
    return [case_from_row(r, i) for i, r in enumerate(rows)]
