"""Top-level layers of a module: what ingestion measures and the planner places on stages.

A *container* is an outermost ``nn.ModuleList``/``nn.ModuleDict`` holding parameters (the repeated
blocks: ``model.layers``, ``transformer.h``, T5's ``encoder.block`` and ``decoder.block``); when a
model has none, its outermost ``nn.Sequential``s play that part (a CNN), and when it has no
Sequential either, the root's children are the layers. The *units* are the containers' children
plus, outside the containers, the largest sub-modules holding parameters and no container
(embeddings, final norm, head). Parameter-free modules outside containers (rotary tables, dropout)
are glue: their work is attributed to the layer that ran last.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from torch import nn

_LISTS = (nn.ModuleList, nn.ModuleDict)
_SKIP_ATTR = re.compile(r"(idx|index|layer_id|layer_num|number)$|^id$")


@dataclass(eq=False)
class Unit:
    name: str
    module: nn.Module
    in_container: bool
    aliases: list[str] = field(default_factory=list)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _containers(root: nn.Module, kinds: tuple[type, ...]) -> set[int]:
    found: set[int] = set()

    def walk(m: nn.Module, top: bool) -> None:
        for child in m.children():
            if isinstance(child, kinds) and len(child) > 0 and _has_params(child):
                found.add(id(child))
            else:
                walk(child, False)

    if isinstance(root, kinds) and not isinstance(root, _LISTS) and len(root) > 0:
        found.add(id(root))  # a root nn.Sequential: its children are the layers
        return found
    walk(root, True)
    return found


def find_units(root: nn.Module) -> list[Unit]:
    """The units of ``root`` in module-tree order (execution order is found by running it)."""
    conts = _containers(root, _LISTS) or _containers(root, (nn.Sequential,))
    aliases: dict[int, list[str]] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        aliases.setdefault(id(m), []).append(name)
    units: list[Unit] = []
    seen: set[int] = set()

    def add(name: str, m: nn.Module, inside: bool) -> None:
        if id(m) not in seen:
            seen.add(id(m))
            units.append(Unit(name=name, module=m, in_container=inside, aliases=aliases.get(id(m), [name])))

    if not conts:  # no repeated structure: the root's children (or the root itself)
        children = list(root.named_children())
        if not children:
            add("", root, True)
        for name, child in children:
            add(name, child, True)
        return units
    if id(root) in conts:
        for name, child in root.named_children():
            add(name, child, True)
        return units

    holders: set[int] = set()  # modules with a container below them
    for _name, m in root.named_modules():
        if any(id(c) in conts for c in m.modules() if c is not m):
            holders.add(id(m))

    def collect(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            path = f"{prefix}{name}"
            if id(child) in conts:
                for cname, c in child.named_children():
                    add(f"{path}.{cname}", c, True)
            elif id(child) in holders:
                collect(child, path + ".")
            elif _has_params(child):
                add(path, child, False)

    collect(root, "")
    return units


def signature(m: nn.Module) -> str:
    """Class, parameter shapes/dtypes and scalar settings (not layer indices) of a unit."""
    parts = [type(m).__qualname__]
    for name, p in m.named_parameters():
        parts.append(f"{name}:{tuple(p.shape)}:{p.dtype}")
    for name, sub in m.named_modules():
        for k, v in sorted(vars(sub).items()):
            if k.startswith("_") or _SKIP_ATTR.search(k):
                continue
            if v is None or isinstance(v, (bool, int, float, str)):
                parts.append(f"{name}.{k}={v!r}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def tied_units(units: list[Unit]) -> list[str]:
    """Names of parameters held by more than one unit (tied embeddings)."""
    owner: dict[int, str] = {}
    out = []
    for u in units:
        for name, p in u.module.named_parameters():
            if id(p) in owner and owner[id(p)] != u.name:
                out.append(f"{u.name}.{name}")
            owner.setdefault(id(p), u.name)
    return out


def pipeline_refusal(name: str, task: str, units: list[Unit], calls: list[Unit] | None = None) -> str | None:
    """Why meshplan's runtime cannot cut ``name``'s forward into pipeline stages, known from its
    structure (None: it tries, and checks the cut on one sample). Ingestion writes it into the
    LayerGraph as a note ``no pipeline: <why>`` (spec.capabilities.PIPELINE_NOTE: the planner
    offers no pp > 1 plan), and the runtime refuses pp > 1 with ``pp>1: <why>``: one function, so
    the two say the same. ``calls``: the units in execution order, one entry per call."""
    if task == "seq2seq-lm":
        return (f"{name} is an encoder-decoder: every decoder block reads the encoder's output (and T5's first "
                "block hands its position bias to the others), so the forward is not a sequence of units")
    tied = tied_units(units)
    if tied:
        return (f"{name} ties weights across units ({tied[0]}): the embedding and the output projection would live "
                "on different stages (untie them: tie_word_embeddings=false)")
    if calls is not None and len({id(u) for u in calls}) != len(calls):
        twice = next(u.name for i, u in enumerate(calls) if any(v is u for v in calls[:i]))
        return f"{name} calls unit {twice} more than once"
    return None
