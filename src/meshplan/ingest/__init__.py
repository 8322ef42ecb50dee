"""Ingestion (issue 5): any model -> LayerGraph, measured on the meta device.

    from meshplan.ingest import ingest, build
    graph = ingest("hf:path/to/config.json", seq_len=4096)     # LayerGraph, no weights, no memory
    built = build("hf:path/to/config.json", device="cpu")     # the real module with random weights

Sources: ``hf:PATH`` (a Hugging Face config.json) and ``module:package.module:factory`` (see
docs/ingest.md). torch (and transformers for hf:) are imported only when these functions run, so
``import meshplan.ingest`` costs nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshplan.ingest.source import Source, parse_source

if TYPE_CHECKING:  # pragma: no cover
    from meshplan.ingest.batch import Batch
    from meshplan.ingest.builder import Built, build
    from meshplan.ingest.measure import ingest

__all__ = ["Batch", "Built", "Source", "build", "ingest", "parse_source"]
_LAZY = {"ingest": "measure", "build": "builder", "Built": "builder", "Batch": "batch"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'meshplan.ingest' has no attribute {name!r}")
    try:
        import torch  # noqa: F401
    except ImportError:
        from meshplan.errors import MeshplanError

        raise MeshplanError("ingestion needs torch", hint="pip install 'meshplan[runtime]' (torch)") from None
    import importlib

    return getattr(importlib.import_module(f"meshplan.ingest.{mod}"), name)
