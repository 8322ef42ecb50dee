"""Which framework produced a published run, and that framework's usual settings.

The defaults fill cells a row leaves blank; every use is written to the case's assumptions.
"""
from __future__ import annotations

import re

from meshplan.cost.profile import DEFAULT_PROFILE, profile_for_framework
from meshplan.validate.rows import Row

_FRAMEWORK_KEYWORDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torchtitan", ("torchtitan", "f_tt")),
    ("llm-foundry", ("llm-foundry", "llmfoundry", "llm_foundry", "mosaicml", "mosaic", "composer", "f_mosaic")),
    ("deepspeed", ("deepspeed", "bigscience", "f_bloom")),
    ("megatron", ("megatron", "nemo", "mcore", "f_meg21", "f_kor22", "korthikanti", "narayanan")),
)
#: Frameworks of an explicit ``framework`` cell that have no defaults of their own here (their
#: profile still applies): nanotron, Hugging Face Trainer / Accelerate, meshplan.
_OTHER_FRAMEWORKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nanotron", ("nanotron",)),
    ("hf-accelerate", ("accelerate", "hf trainer", "hf-trainer", "transformers", "huggingface", "hugging face",
                       "trainer")),
    ("meshplan", ("meshplan",)),
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


def detect_framework(row: Row, assume: object = None) -> str:
    """Which framework produced the row (an explicit `framework` column wins). Names without
    defaults of their own here (nanotron, HF Trainer/Accelerate, meshplan) read as 'unknown'
    (their profile comes from profile_of); a ``framework`` cell not understood is said through
    ``assume`` when given."""
    explicit = row.lower("framework")
    if explicit:
        if "deepspeed" in explicit:
            return "deepspeed"  # DeepSpeed, with HF model code or Megatron-DeepSpeed's (profile_of)
        if any(any(k in explicit for k in keys) for _, keys in _OTHER_FRAMEWORKS) or \
                (re.search(r"\bhf\b", explicit) and "deepspeed" not in explicit):
            return "unknown"  # no defaults of their own here; profile_of gives their profile
        for fw, keys in _FRAMEWORK_KEYWORDS:
            if fw in explicit or any(k in explicit for k in keys):
                return fw
        if callable(assume):
            assume(f"framework {row.text('framework')!r} not understood: detected from the other columns")
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


def profile_of(row: Row, fw: str) -> str:
    """The implementation profile (meshplan.cost.profile) of the row's codebase: an explicit
    ``framework`` cell naming one (NeMo -> nemo, Megatron-Core -> megatron, HF Trainer/Accelerate ->
    hf-accelerate, nanotron, Composer -> llm-foundry, ...), else the detected framework's; a
    'deepspeed' row running Megatron code (BLOOM, MT-NLG, the Megatron-DeepSpeed fork) ->
    megatron-deepspeed."""
    explicit = row.lower("framework")
    if explicit and "deepspeed" not in explicit:
        for name, keys in _OTHER_FRAMEWORKS:
            if any(k in explicit for k in keys):
                return name
        if re.search(r"\bhf\b", explicit) and "deepspeed" not in explicit:
            return "hf-accelerate"
    if fw == "deepspeed":
        text = " ".join(row.lower(c) for c in ("framework", "source", "source_id", "model", "other_settings", "notes"))
        return "megatron-deepspeed" if re.search(r"megatron|bloom|bigscience|mt-nlg", text) else "deepspeed"
    if fw == "megatron":  # NeMo's recipes differ from Megatron-LM's defaults (gradient sync overlap)
        text = " ".join(row.lower(c) for c in ("framework", "source", "source_id", "other_settings", "notes"))
        return "nemo" if "nemo" in text else "megatron"
    if fw == "unknown":
        return DEFAULT_PROFILE
    return profile_for_framework(fw)


def source_year(row: Row) -> int | None:
    """The year of the row's source as its ``source`` cell names it: an arXiv id (2104.04473 ->
    2021), else the earliest four-digit year from 2000 on; None when it names neither (a
    framework's version such as 'NeMo 24.07' is not read as a year)."""
    text = row.text("source") or ""
    m = re.search(r"arxiv[:\s]*(\d{2})(\d{2})\.\d{4,5}", text, re.IGNORECASE)
    if m:
        return 2000 + int(m.group(1))
    years = [int(y) for y in re.findall(r"(?<!\d)(20\d\d)(?!\d)", text)]
    return min(years) if years else None
