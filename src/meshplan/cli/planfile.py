"""Plan files as the source of truth: how estimate, simulate, report, train and export resolve their
command lines against what `meshplan plan --out p.json` recorded.

Reading and writing the file itself is spec.io's (read_plan_file, spec_fields, write_plan_file). A
plan file holds the plan plus the problem it was planned for: ``model`` and ``cluster`` (the
names shown to people), ``model_spec`` and ``cluster_spec`` (the full specs, so a model or
cluster from a file, or a layer graph, reloads exactly and without torch), ``global_batch``,
``seq_len`` and ``optimizer``. Given ``--plan p.json`` a command takes each of these from the file; a
command-line value that disagrees with the file is an error naming both values, unless
``--override`` is given: then the command-line value wins and one note on stderr says so.
Importing this module is cheap (no numpy, no torch): spec.io is imported when a command runs.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from meshplan.errors import MeshplanError

if TYPE_CHECKING:
    from meshplan.spec.io import PlanFile

CONTEXT = ("model", "cluster", "global_batch", "seq_len", "optimizer")
"""What a plan file records besides the plan (the Namespace attribute of each flag; spec.io.PLAN_CONTEXT)."""

OVERRIDE_HELP = ("with --plan FILE: let --model/--cluster/--global-batch/--seq-len/--optimizer replace the plan file's "
                 "values (without it, a value that disagrees with the file is an error)")
FROM_FILE = " (default with --plan FILE: the plan file's)"


def add_override(parser: argparse.ArgumentParser) -> None:
    """The ``--override`` flag of every command that reads plan files."""
    parser.add_argument("--override", action="store_true", help=OVERRIDE_HELP)


# ---- resolving the command line against the file ----------------------------------------------

@dataclass
class Inputs:
    """The resolved problem of one command: each of model / cluster / global batch / seq len from
    the command line or from the plan file (``source``), loaded on demand."""

    plan: Any
    """The Plan (None when the command was given no --plan)."""
    file: PlanFile | None
    values: dict[str, Any]
    source: dict[str, str]
    """field -> 'cli' or 'file' for every field that has a value."""
    _loaded: dict[str, Any] = field(default_factory=dict)

    @property
    def model_arg(self) -> str | None:
        return self.values.get("model")

    @property
    def cluster_arg(self) -> str | None:
        return self.values.get("cluster")

    @property
    def global_batch(self) -> int | None:
        return self.values.get("global_batch")

    @property
    def seq_len(self) -> int | None:
        return self.values.get("seq_len")

    @property
    def optimizer(self) -> str:
        """The workload's optimizer: --optimizer, the plan file's, else adamw."""
        return self.values.get("optimizer") or "adamw"

    def from_file(self, key: str) -> bool:
        return self.source.get(key) == "file"

    def model(self) -> Any:
        """The ModelSpec or LayerGraph (the plan file's own spec when it comes from the file)."""
        if "model" not in self._loaded:
            self._loaded["model"] = self._load_model()
        return self._loaded["model"]

    def cluster(self) -> Any:
        if "cluster" not in self._loaded:
            self._loaded["cluster"] = self._load_cluster()
        return self._loaded["cluster"]

    def _load_model(self) -> Any:
        from meshplan.cli.model_arg import load_model_arg
        from meshplan.spec.io import beside_plan_file, model_from_plan_spec
        arg, seq = self.model_arg, self.seq_len
        if arg is None:  # pragma: no cover - resolve() requires it where a command needs it
            raise MeshplanError("no --model given", hint="give --model, or --plan a plan file that records it")
        if not self.from_file("model"):
            return load_model_arg(arg, seq_len=seq)
        assert self.file is not None
        spec = self.file.model_spec
        if spec is not None:
            loaded = model_from_plan_spec(spec, self.file.path, seq)
            if loaded is not None:
                return loaded
        try:
            return load_model_arg(beside_plan_file(arg, self.file.path), seq_len=seq)
        except MeshplanError as e:
            raise MeshplanError(f"{self.file.path}: the plan file's model {arg!r} cannot be loaded ({e.message})",
                                hint="give --model with the preset or file it was planned with") from None

    def _load_cluster(self) -> Any:
        from meshplan.spec.io import beside_plan_file, cluster_from_dict, load_cluster
        arg = self.cluster_arg
        if arg is None:  # pragma: no cover - resolve() requires it where a command needs it
            raise MeshplanError("no --cluster given", hint="give --cluster, or --plan a plan file that records it")
        if not self.from_file("cluster"):
            return _cli_loaded(self, "cluster") or load_cluster(arg)
        assert self.file is not None
        if self.file.cluster_spec is not None:
            return cluster_from_dict(self.file.cluster_spec, where=f"{self.file.path}: cluster_spec")
        try:
            return load_cluster(beside_plan_file(arg, self.file.path))
        except MeshplanError as e:
            raise MeshplanError(f"{self.file.path}: the plan file's cluster {arg!r} cannot be loaded "
                                f"({e.message})", hint="give --cluster with the one it was planned for") from None


def _cli_loaded(inputs: Inputs, key: str) -> Any:
    """The command-line cluster if comparing it with the file loaded it already."""
    return inputs._loaded.pop(f"cli_{key}", None)


def _same_model(cli: str, pf: PlanFile, inputs: Inputs) -> bool:
    from meshplan.cli.model_arg import is_ingested, load_model_arg
    from meshplan.spec.base import to_dict
    from meshplan.spec.graph import LayerGraph
    from meshplan.spec.io import beside_plan_file, is_file_arg
    theirs = pf.values["model"]
    if cli.strip() == theirs or (cli.strip().lower() == theirs.lower() and not is_file_arg(cli)):
        return True
    if is_ingested(cli):  # comparing would trace the model: the names decide
        return False
    mine = load_model_arg(cli)  # a typo gets its "did you mean" here
    if isinstance(mine, LayerGraph):
        if mine.source == theirs:
            return True
        spec = pf.model_spec
        return spec is not None and _shape(to_dict(mine)) == _shape(spec)
    spec = pf.model_spec
    if spec is None:
        try:
            spec = to_dict(load_model_arg(beside_plan_file(theirs, pf.path)))
        except MeshplanError:
            return False
    return _shape(to_dict(mine)) == _shape(spec)


def _shape(d: dict[str, Any]) -> dict[str, Any]:
    """A spec without what does not change it: its name, a ModelSpec's seq_len (the workload's)."""
    return {k: v for k, v in d.items() if k not in ("name", "seq_len", "schema_version", "kind", "meta")}


def _same_cluster(cli: str, pf: PlanFile, inputs: Inputs) -> bool:
    from meshplan.spec.base import to_dict
    from meshplan.spec.io import beside_plan_file, is_file_arg, load_cluster
    theirs = pf.values["cluster"]
    if cli.strip().lower() == theirs.lower() and not is_file_arg(cli):
        return True
    mine = load_cluster(cli)  # a typo gets its "did you mean" here
    inputs._loaded["cli_cluster"] = mine
    spec = pf.cluster_spec
    if spec is None:
        try:
            spec = to_dict(load_cluster(beside_plan_file(theirs, pf.path)))
        except MeshplanError:
            return False
    mine_d = to_dict(mine)
    if _shape(mine_d) == _shape(spec):
        return True
    from meshplan.spec.io import cluster_from_dict  # a hand-written spec: compare it loaded (defaults filled)
    try:
        return _shape(to_dict(cluster_from_dict(spec, where=pf.path))) == _shape(mine_d)
    except MeshplanError:
        return False


def resolve(args: argparse.Namespace, *, fields: tuple[str, ...] = CONTEXT, required: tuple[str, ...] = (),
            quiet: bool = False, stream: TextIO | None = None) -> Inputs:
    """Model / cluster / global batch / seq len of a command from its flags and its --plan FILE.

    A flag the command line leaves out comes from the plan file; one given on both must agree
    (the same string, or a spec that loads to the same thing) unless --override, which lets the
    command line win and prints one note (not when ``quiet``). ``required`` fields missing from
    both are an error."""
    from meshplan.spec.io import PLAN_CONTEXT_FLAGS as FLAGS
    from meshplan.spec.io import PLAN_CONTEXT_WHAT as WHAT
    from meshplan.spec.io import load_plan, read_plan_file
    plan_arg = getattr(args, "plan", None)
    plan = load_plan(plan_arg) if plan_arg is not None else None
    pf = read_plan_file(plan_arg, fields) if plan_arg is not None else None
    override = bool(getattr(args, "override", False))
    if override and pf is None:
        raise MeshplanError("--override needs --plan FILE: it lets --model/--cluster/--global-batch/--seq-len/"
                            f"--optimizer replace a plan file's values, and {'--plan ' + str(plan_arg) if plan_arg else 'no --plan'}"
                            " is not a plan file", hint="drop --override, or give --plan PLAN.json from `meshplan plan --out`")
    inputs = Inputs(plan=plan, file=pf, values={}, source={})
    clashes: list[tuple[str, Any, Any]] = []
    for key in fields:
        cli = getattr(args, key, None)
        theirs = pf.values.get(key) if pf is not None else None
        if cli is None and theirs is None:
            continue
        if theirs is None:
            inputs.values[key], inputs.source[key] = cli, "cli"
        elif cli is None:
            inputs.values[key], inputs.source[key] = theirs, "file"
        else:
            assert pf is not None
            same = (_same_model(cli, pf, inputs) if key == "model" else
                    _same_cluster(cli, pf, inputs) if key == "cluster" else cli == theirs)
            if same:
                inputs.values[key], inputs.source[key] = theirs, "file"
                inputs._loaded.pop(f"cli_{key}", None)
            else:
                clashes.append((key, cli, theirs))
                inputs.values[key], inputs.source[key] = cli, "cli"
    if clashes and not override:
        raise MeshplanError(_clash_text(clashes) + "; drop " + " and ".join(FLAGS[k] for k, _, _ in clashes)
                            + " or pass --override",
                            hint=f"{pf.path if pf else 'the plan file'} records the problem it was planned for")
    if clashes and not quiet:
        print("meshplan: note: --override: " + ", ".join(f"{FLAGS[k]} {cli} replaces the plan file's {theirs}"
                                                        for k, cli, theirs in clashes),
              file=stream if stream is not None else sys.stderr)
    missing = [k for k in required if k not in inputs.values]
    if missing:
        flags = ", ".join(FLAGS[k] for k in missing)
        if pf is not None:
            raise MeshplanError(f"{flags} {'is' if len(missing) == 1 else 'are'} required: the plan file "
                                f"{pf.path} does not record the {' or '.join(WHAT[k] for k in missing)}",
                                hint=f"give {flags}")
        raise MeshplanError(f"{flags} {'is' if len(missing) == 1 else 'are'} required",
                            hint=f"give {flags}, or --plan a plan file written by `meshplan plan --out`, "
                                 "which records them")
    return inputs


def _clash_text(clashes: list[tuple[str, Any, Any]]) -> str:
    from meshplan.spec.io import PLAN_CONTEXT_FLAGS as FLAGS
    first, *rest = clashes
    text = f"{FLAGS[first[0]]} {first[1]} disagrees with the plan file's {first[2]}"
    for k, cli, theirs in rest:
        text += f", {FLAGS[k]} {cli} with its {theirs}"
    return text


def resolve_into(args: argparse.Namespace, *, fields: tuple[str, ...], required: tuple[str, ...],
                 quiet: bool = False) -> Inputs:
    """resolve(), then write the resolved values back into ``args`` (for commands that pass
    their arguments on, like `meshplan train` to its torchrun workers)."""
    from meshplan.spec.io import beside_plan_file
    inputs = resolve(args, fields=fields, required=required, quiet=quiet)
    for key in fields:
        if key in inputs.values:
            value = inputs.values[key]
            if inputs.from_file(key) and inputs.file is not None and isinstance(value, str):
                value = beside_plan_file(value, inputs.file.path)  # a file named in the plan file, from here
            setattr(args, key, value)
    return inputs


class Loaded(str):
    """A --model/--cluster value already loaded: the name it is shown by, carrying the spec, which
    ``load_model_arg`` and ``load_cluster`` return as is. It lets code written for command-line
    strings (plan_cmd.problem) run on what a plan file records."""

    loaded: Any

    def __new__(cls, text: str, loaded: Any) -> Loaded:
        obj = super().__new__(cls, text)
        obj.loaded = loaded
        return obj


def resolved_args(args: argparse.Namespace, *, fields: tuple[str, ...] = CONTEXT,
                  required: tuple[str, ...] = ()) -> argparse.Namespace:
    """A copy of ``args`` with model / cluster / global batch / seq len resolved against --plan FILE
    (model and cluster as ``Loaded`` names carrying their specs)."""
    inputs = resolve(args, fields=fields, required=required)
    out = argparse.Namespace(**vars(args))
    for key in fields:
        if key not in inputs.values:
            continue
        value = inputs.values[key]
        if key == "model":
            value = Loaded(value, inputs.model())
        elif key == "cluster":
            value = Loaded(value, inputs.cluster())
        setattr(out, key, value)
    return out
