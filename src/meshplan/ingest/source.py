"""Parse an ingestion source string (pure Python: no torch, no transformers).

Two kinds of source:

``hf:PATH``
    A Hugging Face ``config.json`` (or a directory holding one). The model is built from the
    config with random weights; nothing is downloaded.
``module:PACKAGE.MODULE:FACTORY``
    Any importable callable returning a ``torch.nn.Module`` (see docs/ingest.md for how the
    example input and the loss are given).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError

SOURCE_KINDS = ("hf", "module")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
SOURCE_HINT = "give hf:path/to/config.json or module:package.module:factory"


@dataclass(frozen=True)
class Source:
    """A parsed source: ``kind`` is 'hf' or 'module'."""

    kind: str
    text: str
    """The source string as given (stored in LayerGraph.source)."""
    path: Path | None = None
    """hf: the config.json file."""
    module: str = ""
    """module: the dotted module name."""
    attr: str = ""
    """module: the factory's name inside the module (may be dotted: Class.method)."""

    @property
    def short_name(self) -> str:
        """A short name for reports: the config's folder or file stem, or the factory name."""
        if self.kind == "hf":
            assert self.path is not None
            stem = self.path.stem
            return self.path.parent.name if stem == "config" and self.path.parent.name else stem
        return self.attr.split(".")[-1]


def parse_source(text: str) -> Source:
    """``hf:PATH`` or ``module:pkg.mod:factory`` -> Source (checks the file exists / the syntax)."""
    if not isinstance(text, str) or ":" not in text:
        raise MeshplanError(f"model source {text!r} has no kind prefix", hint=SOURCE_HINT)
    kind, _, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind == "hf":
        return Source(kind="hf", text=text, path=_config_path(rest.strip()))
    if kind == "module":
        mod, sep, attr = rest.strip().rpartition(":")
        if not sep or not _DOTTED.match(mod or "") or not _IDENT.match(attr or ""):
            raise MeshplanError(f"model source {text!r} is not module:package.module:factory",
                                hint="e.g. module:mypkg.models:make_model (a callable returning an nn.Module)")
        return Source(kind="module", text=text, module=mod, attr=attr)
    raise MeshplanError(f"model source {text!r}: unknown kind {kind!r}", hint=SOURCE_HINT)


def _config_path(rest: str) -> Path:
    if not rest:
        raise MeshplanError("hf: source has no path", hint="give hf:path/to/config.json")
    p = Path(rest).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise MeshplanError(f"hf: no config file at {str(p)!r}",
                            hint="give the path of a Hugging Face config.json (or of the folder holding it)")
    return p


def read_hf_config(path: Path) -> dict[str, Any]:
    """The config dict of a config.json, with one-line errors."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise MeshplanError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise MeshplanError(f"{str(path)!r} is not valid JSON: {e}",
                            hint="give a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise MeshplanError(f"{str(path)!r} is not a JSON object", hint="give a Hugging Face config.json")
    if not isinstance(data.get("model_type"), str):
        raise MeshplanError(f"{str(path)!r} has no \"model_type\"",
                            hint='add "model_type" (e.g. "llama", "gpt2", "t5", "bert", "vit")')
    return data
