"""Checks of files a command will write, made before any work (torch-free)."""
from __future__ import annotations

import os
from pathlib import Path

from meshplan.errors import MeshplanError


def check_output_file(flag: str, path: str | None, example: str = "out.json") -> str | None:
    """A file to write (``--metrics``, ``--out``, ``--plot``): not empty, not a directory, in an
    existing directory that can be written (nothing is created but the file itself), and
    writable if it exists. Returns the path (None or "" unchanged when not given)."""
    if path is None:
        return path
    if not str(path).strip():
        raise MeshplanError(f"{flag} is empty", hint=f"give a file name, e.g. {flag} {example}")
    p = Path(path).expanduser()
    if p.is_dir():
        raise MeshplanError(f"{flag} {path} is a directory", hint=f"give a file, e.g. {flag} {p / example}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise MeshplanError(f"{flag} {path}: the directory {parent} {what}",
                            hint=f"create it first, or give a {flag} path in an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise MeshplanError(f"{flag} {path}: permission denied", hint=f"give a {flag} path you can write")
    return path
