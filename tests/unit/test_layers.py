"""The layer order of docs/architecture.md ("Dependencies point one way"), enforced on the source.

Every ``src/meshplan/**/*.py`` is parsed (ast; nothing is imported, so this is fast and needs no
torch) and every import of a meshplan module is read: at module level and inside functions, ``from .
import x`` and other relative forms. Each module belongs to a *unit*: a sub-package (``spec``,
``cost``, ...) or a top-level module (``errors``, ``units``, ``cases``, ...). The tests check:

(a) the order: a unit imports only units of a lower rank (``RANK``), never one of its own rank;
(b) the planning units never import torch, and import ``runtime`` or ``ingest`` only inside a
    function, at the places named in ``LAZY_RUNTIME`` (the commands that need them);
(c) no import cycle between modules (``KNOWN_CYCLES`` lists the ones being removed), none between
    the modules of ``runtime``, none between units;
(d) no module imports a private (underscore) name of another module.

A failure names the file, the line and the import.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import meshplan

SRC = Path(meshplan.__file__).resolve().parent
ROOT = SRC.parent

RANK: dict[str, int] = {
    # leaves: import nothing from meshplan but other leaves
    "errors": 0, "builtin_calibration": 0,
    "units": 1, "paths": 1, "svg": 1, "meshplan": 1,  # "meshplan": the package's __init__ (__version__)
    "spec": 2,
    "cost": 3,
    "cases": 4,  # RunCase and its CostParams: what validate and calibration share
    "search": 5, "sim": 5, "validate": 5, "ingest": 5,
    "calibration": 6,
    "report": 7, "export": 7,
    "runtime": 8,
    "cli": 9,
    "__main__": 10,
}
"""Each unit's layer, lowest first. ``ingest`` (torch) sits beside the planning packages it may not
be imported by (see (b)); ``runtime`` (torch) runs plans and may import every planning package
but ``cli``."""

TORCH_UNITS = {"runtime", "ingest"}
"""The only units that import torch (lazily where the CLI imports them)."""

LAZY_RUNTIME: dict[str, set[str]] = {
    "meshplan.cli.main": {"meshplan.ingest"},                    # `meshplan ingest`
    "meshplan.cli.model_arg": {"meshplan.ingest"},               # --model hf:... / module:...
    "meshplan.cli.train_cmd": {"meshplan.runtime.generic", "meshplan.runtime.job", "meshplan.runtime.launch",
                               "meshplan.runtime.preflight"},     # `meshplan train` and its torchrun workers
    "meshplan.cli.calibrate_cmd": {"meshplan.runtime.bench"},    # calibrate --bench
}
"""The places where a planning unit imports ``runtime`` or ``ingest``, inside a function (the command
that needs them): importer -> what it imports."""

KNOWN_CYCLES: set[frozenset[str]] = set()
"""Module import cycles still being removed (issue 25): empty when none is left."""


@dataclass(frozen=True)
class Import:
    src: str
    """The importing module (dotted)."""
    path: Path
    line: int
    target: str
    """The imported module (dotted): ``from a.b import c`` is ``a.b.c`` when that is a module."""
    name: str | None
    """The imported name of ``from ... import name`` (None for ``import x``)."""
    lazy: bool
    """Inside a function (or a lambda), or under ``if __name__ == "__main__":``, not at module level."""
    script: bool
    """Under ``if __name__ == "__main__":`` (run as a script, the module is ``__main__``: no cycle)."""
    alias: str
    """The name the import binds."""
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT.parent)}:{self.line}: {self.text}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "meshplan"


def resolve(target: str, name: str | None) -> str:
    """``from target import name``: the module ``target.name`` if there is one, else ``target``."""
    if name is not None and f"{target}.{name}" in modules():
        return f"{target}.{name}"
    return target


def is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


@cache
def imports() -> list[Import]:
    out: list[Import] = []
    for mod, path in modules().items():
        tree = trees()[mod]
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

        found: list[tuple[ast.Import | ast.ImportFrom, bool, bool]] = []

        def visit(body: list[ast.stmt], lazy: bool, script: bool) -> None:
            """Import statements in a list of statements, and in the blocks it holds (statements only:
            an import cannot be an expression)."""
            for st in body:
                if isinstance(st, (ast.Import, ast.ImportFrom)):
                    found.append((st, lazy, script))
                    continue
                main = isinstance(st, ast.If) and is_main_guard(st.test)
                inner = lazy or main or isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(st, field, None) or [], inner, script or main)
                for h in getattr(st, "handlers", None) or []:
                    visit(h.body, inner, script or main)
                for case in getattr(st, "cases", None) or []:
                    visit(case.body, inner, script or main)

        visit(tree.body, False, False)
        for node, lazy, script in found:
            if isinstance(node, ast.Import):
                for a in node.names:
                    out.append(Import(mod, path, node.lineno, a.name, None, lazy, script,
                                      a.asname or a.name.split(".")[0], f"import {a.name}"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                dots = "." * node.level
                for a in node.names:
                    out.append(Import(mod, path, node.lineno, resolve(target, a.name), a.name, lazy, script,
                                      a.asname or a.name, f"from {dots}{node.module or ''} import {a.name}"))
    return out


@cache
def trees() -> dict[str, ast.Module]:
    return {mod: ast.parse(path.read_text(), filename=str(path)) for mod, path in modules().items()}


def internal() -> list[Import]:
    return [i for i in imports() if i.target == "meshplan" or i.target.startswith("meshplan.")]


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def cycle_text(comp: frozenset[str], imps: list[Import]) -> str:
    lines = [i.where() for i in imps if i.src in comp and i.target in comp and i.src != i.target and not i.script]
    return f"cycle {sorted(comp)}:\n    " + "\n    ".join(lines)


# ---- the tests -----------------------------------------------------------------------------------
def test_every_unit_has_a_rank() -> None:
    missing = sorted({unit(m) for m in modules()} - set(RANK))
    assert not missing, f"units without a layer in RANK (add them, and to docs/architecture.md): {missing}"


def test_imports_follow_the_layer_order() -> None:
    bad = []
    for i in internal():
        a, b = unit(i.src), unit(i.target)
        if a != b and RANK[b] >= RANK[a]:
            bad.append(f"{i.where()}  ({a}, layer {RANK[a]}, imports {b}, layer {RANK[b]})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_planning_units_import_no_torch_runtime_or_ingest() -> None:
    bad = []
    for i in imports():
        a = unit(i.src)
        if a in TORCH_UNITS:
            continue
        top = i.target.split(".")[0]
        if top == "torch":
            bad.append(f"{i.where()}  (only runtime and ingest import torch)")
        elif i.target.startswith("meshplan.") and unit(i.target) in TORCH_UNITS:
            allowed = any(i.target == t or i.target.startswith(t + ".") for t in LAZY_RUNTIME.get(i.src, ()))
            if not i.lazy or not allowed:
                bad.append(f"{i.where()}  ({'at module level' if not i.lazy else 'not in LAZY_RUNTIME'})")
    assert not bad, "a planning package imports torch, runtime or ingest:\n" + "\n".join(bad)


def test_lazy_runtime_exceptions_are_used() -> None:
    used = {(i.src, t) for i in internal() for t in LAZY_RUNTIME.get(i.src, ())
            if i.target == t or i.target.startswith(t + ".")}
    stale = sorted((s, t) for s, ts in LAZY_RUNTIME.items() for t in ts if (s, t) not in used)
    assert not stale, f"LAZY_RUNTIME names imports that no longer exist: {stale}"


def test_no_cycles_between_units() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for i in internal():
        if unit(i.src) != unit(i.target):
            edges[unit(i.src)].add(unit(i.target))
    found = cycles(edges)
    assert not found, "\n".join(
        f"cycle between units {sorted(c)}:\n    " + "\n    ".join(
            i.where() for i in internal() if unit(i.src) in c and unit(i.target) in c and unit(i.src) != unit(i.target))
        for c in found)


def module_edges(imps: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for i in imps:
        if i.target in modules() and i.target != i.src and not i.script:
            edges[i.src].add(i.target)
    return edges


def test_runtime_modules_import_one_way() -> None:
    imps = [i for i in internal() if unit(i.src) == "runtime" and unit(i.target) == "runtime"]
    found = cycles(module_edges(imps))
    assert not found, "import cycles inside runtime/ (lazy imports count too):\n" + "\n".join(
        cycle_text(c, imps) for c in found)


def test_no_module_import_cycles() -> None:
    imps = internal()
    found = [c for c in cycles(module_edges(imps)) if c not in KNOWN_CYCLES]
    assert not found, "module import cycles (lazy imports count too):\n" + "\n".join(cycle_text(c, imps) for c in found)
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles(module_edges(imps))]
    assert not gone, f"KNOWN_CYCLES lists cycles that are gone; remove them: {gone}"


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_is_imported_across_modules() -> None:
    bad = [i.where() for i in internal() if i.name is not None and private(i.name) and i.target != f"{i.src}.{i.name}"
           and i.target != i.src]
    by_src: dict[str, list[Import]] = defaultdict(list)
    for i in internal():
        by_src[i.src].append(i)
    for mod, path in modules().items():  # module._name, through an imported module
        aliases = {i.alias: i.target for i in by_src[mod] if i.target in modules() and i.target != mod
                   and (i.name is not None or i.alias == i.target)}
        text = path.read_text()
        if not any(f"{a}._" in text for a in aliases):  # the text first: walking every tree is slow
            continue
        for node in ast.walk(trees()[mod]):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and private(node.attr)):
                bad.append(f"{modules()[mod].relative_to(ROOT.parent)}:{node.lineno}: {node.value.id}.{node.attr} "
                           f"({aliases[node.value.id]})")
    assert not bad, "private names used across modules (make them public, or move them to their user):\n" + \
        "\n".join(bad)
