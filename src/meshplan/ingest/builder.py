"""build(source) -> the real module (random weights) + synthetic batches + loss.

Shared by ``ingest`` (device "meta": shapes only) and the runtime (device "cpu"/"cuda": a real
module to train). Importing this module imports torch.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshplan.errors import MeshplanError
from meshplan.ingest import hf, user
from meshplan.ingest.batch import Batch
from meshplan.ingest.source import Source, parse_source
from meshplan.spec.graph import TRACE_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Built:
    """A model ready to run: ``loss_fn(module(*b.args, **b.kwargs), b)`` for ``b = make_inputs(n)``."""

    module: nn.Module
    make_inputs: Callable[..., Batch]
    """``make_inputs(batch_size, seed=0) -> Batch`` of synthetic inputs and labels on the module's device."""
    loss_fn: Callable[[Any, Batch], torch.Tensor]
    """``loss_fn(outputs, batch) -> scalar`` (float32 cross-entropy for the built-in tasks)."""
    task: str
    """causal-lm | seq2seq-lm | masked-lm | classification."""
    sample_tokens: int
    """Tokens per sample (sequence length; source + target for seq2seq; patches + 1 for a ViT)."""
    name: str
    source: str
    seq_len: int | None
    dtype: str
    heads: tuple[int | None, int | None] = (None, None)
    """(attention heads, key/value heads) when the config says (hf: sources)."""
    notes: list[str] = field(default_factory=list)
    trace_patches: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Context manager making library code shape-only while ingest traces on the meta device."""

    def step(self, batch: Batch) -> torch.Tensor:
        """Forward + loss of one batch (no backward)."""
        return self.loss_fn(self.module(*batch.args, **batch.kwargs), batch)


def build(source: str | Source, *, device: str | torch.device = "cpu", seq_len: int | None = None,
          dtype: str = "float32") -> Built:
    """The module of ``source`` with random weights on ``device`` (``"meta"``: shapes only)."""
    src = source if isinstance(source, Source) else parse_source(source)
    if dtype not in DTYPES or dtype not in TRACE_DTYPES:
        raise MeshplanError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}", hint="e.g. --dtype bfloat16")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise MeshplanError(f"seq_len must be a positive integer, got {seq_len!r}")
    dev = str(device)
    tdtype = DTYPES[dtype]
    if src.kind == "hf":
        config = hf.load_config(src)
        cls, task = hf.pick_class(config, str(src.path))
        notes = []
        if "pixel_values" in hf.forward_params(cls):
            hf.check_patches(config, src.text)
            if seq_len is not None:
                notes.append(f"seq_len={seq_len} ignored: the image size comes from the config")
            seq = None
        else:
            seq = seq_len or hf.default_seq_len(config, task)
            if seq_len is None:
                notes.append(f"seq_len {seq} (the config's maximum positions, capped at {hf.MAX_DEFAULT_SEQ_LEN})")
        module = build_hf_module(src, config, cls, tdtype, dev)
        return Built(module=module, make_inputs=hf.make_batch_fn(config, task, cls, seq or 1, dev, tdtype),
                     loss_fn=hf.loss_for(task), task=task,
                     sample_tokens=hf.sample_tokens(config, task, cls, seq or 1),
                     name=src.short_name, source=src.text, seq_len=seq, dtype=dtype,
                     heads=hf.head_counts(config), trace_patches=hf.meta_patches,
                     notes=[f"{cls.__name__} ({config.model_type})", *notes])
    pymod, factory = user.import_factory(src)
    module = user.make_module(src, pymod, factory, dev)
    if tdtype != torch.float32:  # the factory builds float32 (its own choice); cast the floating parameters
        module = module.to(tdtype)
    loss, custom = user.loss_fn(module, pymod)
    notes = [] if custom else ["loss: default (cross-entropy against synthetic labels, or mean square)"]
    return Built(module=module, make_inputs=user.make_batch_fn(src, module, pymod, seq_len, dev, tdtype), loss_fn=loss,
                 task=user.task(src, module, pymod), sample_tokens=user.sample_tokens(src, module, pymod, seq_len),
                 name=src.short_name, source=src.text, seq_len=seq_len, dtype=dtype, notes=notes)


def build_hf_module(src: Source, config: Any, cls: type, dtype: torch.dtype, device: str) -> nn.Module:
    try:
        return hf.build_module(config, cls, dtype, device)
    except MeshplanError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own errors become one line
        raise MeshplanError(f"{src.text}: transformers could not build {cls.__name__}: "
                            f"{type(e).__name__}: {hf.one_line(e)}", hint="fix the config field it names") from None
