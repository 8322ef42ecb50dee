"""Reading one row of a published-runs CSV.

:class:`Row` gives case-insensitive access to the cells (column aliases, 'not stated'-like cells
read as missing, numbers parsed leniently); :class:`Unsupported` is raised for a row that cannot
be expressed, its message the one-line reason.
"""
from __future__ import annotations

import math
import re
from typing import Any


class Unsupported(Exception):
    """The row cannot be expressed; the message is the reason (the case becomes unsupported)."""


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


def norm_key(k: str) -> str:
    return re.sub(r"\s+", "_", k.strip().lower())


class Row:
    """Case-insensitive access to one CSV row, treating 'not stated'-like cells as missing."""

    def __init__(self, raw: dict[Any, Any]) -> None:
        self.cells: dict[str, str] = {}
        for k, v in raw.items():
            if k is None:  # surplus cells of a ragged row
                continue
            if isinstance(v, list):
                v = ",".join(str(x) for x in v)
            self.cells[norm_key(str(k))] = "" if v is None else str(v).strip()

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
            raise Unsupported(f"{name}={v!r} is not a number")
        try:
            x = float(m.group(0).replace(",", "").replace("_", ""))
        except ValueError:
            raise Unsupported(f"{name}={v!r} is not a number") from None
        if not math.isfinite(x):
            raise Unsupported(f"{name}={v!r} is not a finite number")
        return x

    def integer(self, name: str) -> int | None:
        x = self.number(name)
        if x is None:
            return None
        if not float(x).is_integer():
            raise Unsupported(f"{name}={self.text(name)!r} is not a whole number")
        return int(x)

    def positive_number(self, name: str) -> float | None:
        """A number > 0, or None (zero/negative readings are unusable as measurements)."""
        try:
            x = self.number(name)
        except Unsupported:
            return None
        return x if x is not None and x > 0 else None


def bool_cell(v: str | None) -> bool | None:
    """A yes/no cell: 'yes', 'true', 'on', '1', ... -> True; 'no', 'off', '0', ... -> False; else None."""
    if v is None:
        return None
    v = v.strip().lower()
    if v.startswith(("yes", "true", "y", "1", "on")):
        return True
    if v.startswith(("no", "false", "n", "0", "off")):
        return False
    return None
