"""`meshplan export`: a plan as torchtitan / Megatron-LM / DeepSpeed settings (issue 6). Stub."""
from __future__ import annotations

import argparse

from meshplan.errors import MeshplanError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a plan as torchtitan, Megatron-LM or DeepSpeed settings")
    p.add_argument("--plan", required=True)
    p.add_argument("--to", required=True, choices=["torchtitan", "megatron", "deepspeed"])
    p.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    raise MeshplanError("meshplan export is not implemented yet")
