"""Which framework produced a published run, and that framework's usual settings.

The defaults fill cells a row leaves blank; every use is written to the case's assumptions.
"""
from __future__ import annotations

from meshplan.validate.rows import Row

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


def detect_framework(row: Row) -> str:
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
