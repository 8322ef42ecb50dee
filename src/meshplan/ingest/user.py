"""``module:package.module:factory`` sources: any callable returning an nn.Module.

The contract (docs/ingest.md):

- ``factory()`` is called with no arguments (under ``torch.device(device)``) and returns the module.
- The example input comes from ``example_inputs(batch_size, seq_len)``: a method of the returned
  module, else a function of the factory's Python module. It returns a dict (keyword arguments of
  ``forward``), a tuple (positional arguments) or one tensor. ``seq_len`` is None when the user
  gave none (pick your default). Tensors are made under ``torch.device(device)`` and moved there;
  floating ones are cast to the traced dtype.
- The loss is ``loss(outputs, inputs)`` (a method of the module, else a function of the factory's
  module), given what ``example_inputs`` returned; the default is cross-entropy against synthetic
  labels when the output looks like logits, else the mean square of the output.
- Optional module-level (or module attribute) constants: ``TASK`` (default "classification") and
  ``SAMPLE_TOKENS`` (tokens per sample; default ``seq_len`` when given, else 1).
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshplan.errors import MeshplanError
from meshplan.ingest.batch import Batch, default_loss
from meshplan.ingest.source import Source

TASKS = ("causal-lm", "seq2seq-lm", "masked-lm", "classification")


def import_factory(src: Source) -> tuple[Any, Callable[[], Any]]:
    """(the factory's Python module, the factory)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # like `python -m`: modules in the working directory are importable
    try:
        mod = importlib.import_module(src.module)
    except ModuleNotFoundError as e:
        raise MeshplanError(f"{src.text}: cannot import {src.module!r} ({e})",
                            hint="check the module name and that it is on PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - importing user code: any failure is one line
        raise MeshplanError(f"{src.text}: importing {src.module!r} failed: {type(e).__name__}: {_first(e)}",
                            hint="fix the error in that module") from None
    obj: Any = mod
    for part in src.attr.split("."):
        if not hasattr(obj, part):
            raise MeshplanError(f"{src.text}: {src.module!r} has no attribute {src.attr!r}",
                                hint="give module:package.module:factory with the factory's exact name")
        obj = getattr(obj, part)
    if not callable(obj):
        raise MeshplanError(f"{src.text}: {src.attr!r} is not callable",
                            hint="the factory must be a function or class returning an nn.Module")
    return mod, obj


def make_module(src: Source, pymod: Any, factory: Callable[[], Any], device: str) -> nn.Module:
    try:
        with torch.device(device):
            module = factory()
    except MeshplanError:
        raise
    except Exception as e:  # noqa: BLE001
        where = " on the meta device" if device == "meta" else ""
        raise MeshplanError(f"{src.text}: the factory failed{where}: {type(e).__name__}: {_first(e)}",
                            hint="the factory must build the module without reading tensor values "
                                 "(no checkpoint loading, no .item())") from None
    if not isinstance(module, nn.Module):
        raise MeshplanError(f"{src.text}: the factory returned a {type(module).__name__}, not a torch.nn.Module",
                            hint="return the model (an nn.Module) from the factory")
    module.train()
    return module


def hook(module: nn.Module, pymod: Any, name: str) -> Any:
    """``name`` as a method of the module, else a function of its Python module, else None."""
    fn = getattr(module, name, None)
    if fn is None:
        fn = getattr(pymod, name, None)
    return fn


def constant(module: nn.Module, pymod: Any, name: str) -> Any:
    v = getattr(module, name, None)
    return getattr(pymod, name, None) if v is None else v


def make_batch_fn(src: Source, module: nn.Module, pymod: Any, seq_len: int | None, device: str,
                  dtype: torch.dtype = torch.float32):
    fn = hook(module, pymod, "example_inputs")
    if fn is None:
        raise MeshplanError(f"{src.text}: no example input",
                            hint="define example_inputs(batch_size, seq_len) in the factory's module (or as a method "
                                 "of the module) returning the forward arguments: a dict, a tuple or a tensor")

    def make(batch_size: int, seed: int = 0) -> Batch:
        from torch.utils._pytree import tree_map

        torch.manual_seed(seed)
        try:
            with torch.device(device):
                raw = fn(batch_size, seq_len)
        except Exception as e:  # noqa: BLE001
            raise MeshplanError(f"{src.text}: example_inputs({batch_size}, {seq_len}) failed: "
                                f"{type(e).__name__}: {_first(e)}", hint="fix example_inputs") from None
        raw = tree_map(lambda t: (t.to(device, dtype) if t.is_floating_point() else t.to(device))
                       if isinstance(t, torch.Tensor) else t, raw)
        if isinstance(raw, dict):
            return Batch(kwargs=dict(raw), raw=raw)
        if isinstance(raw, tuple):
            return Batch(args=raw, raw=raw)
        if isinstance(raw, torch.Tensor):
            return Batch(args=(raw,), raw=raw)
        raise MeshplanError(f"{src.text}: example_inputs returned a {type(raw).__name__}",
                            hint="return a dict of keyword arguments, a tuple of positional arguments or a tensor")

    return make


def loss_fn(module: nn.Module, pymod: Any):
    fn = hook(module, pymod, "loss")
    if fn is None:
        return default_loss, False
    return (lambda outputs, batch: fn(outputs, batch.raw)), True


def task(src: Source, module: nn.Module, pymod: Any) -> str:
    t = constant(module, pymod, "TASK") or "classification"
    if t not in TASKS:
        raise MeshplanError(f"{src.text}: TASK={t!r} is not one of {', '.join(TASKS)}", hint="fix TASK")
    return t


def sample_tokens(src: Source, module: nn.Module, pymod: Any, seq_len: int | None) -> int:
    n = constant(module, pymod, "SAMPLE_TOKENS")
    if n is None:
        if seq_len is not None and not _inputs_follow_seq_len(module, pymod, seq_len):
            raise MeshplanError(f"--seq-len {seq_len}: {src.text}'s example inputs do not depend on the sequence "
                                "length (its samples have a fixed size, e.g. images)",
                                hint="drop --seq-len (or declare SAMPLE_TOKENS and take seq_len in example_inputs)")
        return seq_len or 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise MeshplanError(f"{src.text}: SAMPLE_TOKENS={n!r} must be a positive integer", hint="fix SAMPLE_TOKENS")
    if seq_len is not None and seq_len != n and not _inputs_follow_seq_len(module, pymod, seq_len):
        raise MeshplanError(f"--seq-len {seq_len}: {src.text}'s samples are {n} tokens each (its SAMPLE_TOKENS)",
                            hint="drop --seq-len, or build the model for other samples")
    return n


def _inputs_follow_seq_len(module: nn.Module, pymod: Any, seq_len: int) -> bool:
    """Whether example_inputs(1, s) changes shape with s (on the meta device, no memory)."""
    from torch.utils._pytree import tree_flatten
    fn = hook(module, pymod, "example_inputs")
    if fn is None:
        return True
    try:
        with torch.device("meta"):
            shapes = [tuple(tuple(t.shape) for t in tree_flatten(fn(1, s))[0] if isinstance(t, torch.Tensor))
                      for s in (seq_len, seq_len + 1)]
    except Exception:  # noqa: BLE001 - the real call reports what is wrong with example_inputs
        return True
    return shapes[0] != shapes[1]


def _first(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""
