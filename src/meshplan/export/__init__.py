"""Export a plan as the settings of a training framework (issue 6).

``export(target, ExportInput(plan, model, global_batch, seq_len))`` -> :class:`ExportResult`;
``render(result, fmt)`` -> the file text. Targets:

- ``torchtitan``: a job-config TOML (torchtitan 0.2.x ``--job.config_file``) and the same settings
  as ``--section.key value`` overrides;
- ``megatron``: Megatron-LM arguments (a bash array for pretrain_gpt.py, or JSON);
- ``deepspeed``: a DeepSpeed config JSON.

Each result lists what the tool cannot express (``unsupported``): printed by the command on
stderr and written into the file (comments, or a ``_meshplan_unsupported`` key). Pure Python:
nothing here imports torch or the target tools.
"""
from __future__ import annotations

import json
import shlex
import textwrap

from meshplan.errors import MeshplanError
from meshplan.export.common import TARGETS, ExportInput, ExportResult, comment_block, toml_text

__all__ = ["TARGETS", "ExportInput", "ExportResult", "export", "render", "formats"]


def export(target: str, inp: ExportInput) -> ExportResult:
    if target == "torchtitan":
        from meshplan.export import torchtitan as mod
    elif target == "megatron":
        from meshplan.export import megatron as mod  # type: ignore[no-redef]
    elif target == "deepspeed":
        from meshplan.export import deepspeed as mod  # type: ignore[no-redef]
    else:
        raise MeshplanError(f"unknown export target {target!r}", hint="use one of " + ", ".join(TARGETS))
    return mod.build(inp)


def formats(target: str) -> tuple[str, ...]:
    """Output formats per target, the default first."""
    return {"torchtitan": ("toml",), "megatron": ("sh", "json"), "deepspeed": ("json",)}[target]


def _header(res: ExportResult, what: str) -> list[str]:
    lines = [f"{what}, written by `meshplan export --to {res.target}`", *res.title.splitlines()]
    if res.unsupported:
        lines += ["", f"{res.target} cannot express (what was exported instead):"]
        lines += [f"  - {u}" for u in res.unsupported]
    if res.notes:
        lines += ["", "notes:"]
        lines += [f"  - {n}" for n in res.notes]
    return lines


def _wrap(lines: list[str], width: int = 100) -> list[str]:
    out: list[str] = []
    for line in lines:
        indent = "      " if line.startswith("  - ") else ""
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False,
                             break_long_words=False) or [""]
    return out


def _arg_lines(args: list[str]) -> list[list[str]]:
    """Arguments grouped per flag: [[flag, value, ...], ...]."""
    groups: list[list[str]] = []
    for a in args:
        if a.startswith("--") or not groups:
            groups.append([a])
        else:
            groups[-1].append(a)
    return groups


def render(res: ExportResult, fmt: str | None = None) -> str:
    """The file text of an export: ``toml`` (torchtitan), ``sh`` or ``json`` (megatron), ``json``
    (deepspeed)."""
    fmt = fmt or formats(res.target)[0]
    if fmt not in formats(res.target):
        raise MeshplanError(f"export --to {res.target} writes {' or '.join(formats(res.target))}, not {fmt}")
    if res.target == "torchtitan":
        text = comment_block(_wrap(_header(res, "torchtitan job config (torchtitan 0.2.x: --job.config_file)")))
        text += "\n" + toml_text(res.config)
        groups = [" ".join(shlex.quote(a) for a in g) for g in _arg_lines(res.overrides)]
        text += "\n" + comment_block(["The same settings as command-line overrides (torchtitan's ConfigManager):",
                                      *(f"  {g} \\" for g in groups[:-1]), *(f"  {g}" for g in groups[-1:])])
        return text
    if res.target == "megatron" and fmt == "sh":
        text = comment_block(_wrap(_header(res, "Megatron-LM arguments (pretrain_gpt.py)")))
        text += "".join(f"export {k}={shlex.quote(v)}\n" for k, v in res.env.items())
        text += "MEGATRON_ARGS=(\n"
        text += "".join("    " + " ".join(shlex.quote(a) for a in g) + "\n" for g in _arg_lines(res.config))
        text += ")\n"
        return text
    if res.target == "megatron":
        doc = {"args": res.config, "env": res.env, "_meshplan_unsupported": res.unsupported,
               "_meshplan_notes": res.notes, "_meshplan": res.title.splitlines()}
        return json.dumps(doc, indent=2) + "\n"
    return json.dumps(res.config, indent=2) + "\n"
