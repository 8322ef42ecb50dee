"""`meshplan report`: one self-contained HTML page for a planning problem (issue 6). Stub."""
from __future__ import annotations

import argparse

from meshplan.errors import MeshplanError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write one self-contained HTML report of the best plans")
    p.add_argument("--model", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--out", required=True)


def run(args: argparse.Namespace) -> int:
    raise MeshplanError("meshplan report is not implemented yet")
