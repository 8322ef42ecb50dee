"""What every exporter shares: the input (plan + model + workload), the result, stage splits,
the plan checks, and a small TOML writer. Pure Python: no torch, no target tool imported."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.io import toml_value
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload, microbatches
from meshplan.spec.export_limits import placement_axes, placement_is, plan_sync_groups, recompute_layers_per_chunk
from meshplan.spec.stages import stage_ids_for_rank as stage_ids_for_rank  # re-exported for the exporters
from meshplan.spec.stages import stage_layer_counts as stage_layer_counts

TARGETS = ("torchtitan", "megatron", "deepspeed")


@dataclass(frozen=True)
class ExportInput:
    """A plan and what it runs on. ``model``, ``global_batch`` and ``seq_len`` may be unknown
    (None); each exporter says which it needs (``require``). ``model`` may be given as the
    LayerGraph every other command takes: the exporters write the shape of the transformer
    description it was generated from (``LayerGraph.model``); a traced model has none, and no
    framework's settings can express it. ``cluster`` (optional) sizes the inner groups of a
    local-sgd/diloco plan whose sync_scope is node or dc (GPUs per node / datacenter)."""

    plan: Plan
    model: ModelSpec | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    cluster: ClusterSpec | None = None
    optimizer: str = "adamw"
    """The workload's optimizer (spec.plan.OPTIMIZERS): each target writes it where it has the
    setting and lists it as unsupported where it has not (``optimizer_unsupported``)."""

    def __post_init__(self) -> None:
        from meshplan.spec.graph import LayerGraph
        m = self.model
        if isinstance(m, LayerGraph):
            if m.model is None:
                raise MeshplanError(f"model {m.name} ({m.source}) is a traced layer graph: the export targets take "
                                    "a transformer's shape (layers, width, heads), which a traced model does not "
                                    "have", hint="run it with `meshplan train`, or export with --model PRESET or a "
                                    "ModelSpec .toml/.json of the same shape")
            object.__setattr__(self, "model", m.model)
            if self.seq_len is None:
                object.__setattr__(self, "seq_len", m.sample_tokens)

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step per data-parallel rank (the gradient accumulation
        steps, or the pipeline's micro-batches under PP)."""
        p = self.plan
        return microbatches(cast(int, self.global_batch), p.dp, p.micro_batch)


@dataclass
class ExportResult:
    """One plan written for one tool.

    ``config``: torchtitan -> the TOML tables (dict); megatron -> the argument list; deepspeed ->
    the JSON object. ``overrides``: the same settings as command-line arguments (torchtitan's
    ``--section.key value`` overrides, Megatron's argument list). ``unsupported``: one line per
    part of the plan the tool cannot express (what was exported instead, how to get it).
    ``notes``: what the exported settings need around them (code, environment, launch)."""

    target: str
    config: Any
    overrides: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    title: str = ""


# ---- inputs --------------------------------------------------------------------------------------

def require(inp: ExportInput, target: str, *, model: bool, seq_len: bool) -> None:
    """One-line errors for what ``target`` needs and the input lacks, then for a plan that cannot
    run (`check_plan`): what every exporter's build() checks first."""
    if inp.global_batch is None:
        raise MeshplanError(f"export --to {target} needs the global batch size (sequences per step)",
                            hint="give --global-batch, or a plan file written by `meshplan plan --out`")
    if model and inp.model is None:
        raise MeshplanError(f"export --to {target} needs the model (its shape goes into the {target} settings)",
                            hint="give --model PRESET or a ModelSpec .toml/.json, or a plan file written by "
                                 "`meshplan plan --out`")
    if seq_len and inp.seq_len is None:
        raise MeshplanError(f"export --to {target} needs the sequence length",
                            hint="give --seq-len (or --model, whose default is used)")
    check_plan(inp)


def check_plan(inp: ExportInput) -> None:
    """The feasibility checks that need no cluster: a plan that cannot run is not exported."""
    from meshplan.spec import constraints as c
    p, m = inp.plan, inp.model
    seq = inp.seq_len if inp.seq_len is not None else 2 * p.cp  # unknown: skip the cp check
    ctx = c.Context(model=cast(ModelSpec, m), cluster=cast(Any, None), plan=p,
                    work=Workload(global_batch=cast(int, inp.global_batch), seq_len=seq))
    checks = [c.batch_divides, c.schedule_fits, c.cp_divides_seq, c.sp_needs_tp, c.hybrid_valid, c.offload_valid]
    if m is not None:
        checks += [c.tp_divides_heads, c.tp_divides_widths, c.layers_split, c.ep_valid]
    for reason in [check(ctx) for check in checks] + [sync_reason(p, inp.cluster)]:
        if reason:
            what = f"model {m.name}, " if m is not None else ""
            raise MeshplanError(f"plan {p.short()} cannot run ({what}global batch {inp.global_batch}): {reason}",
                                hint="fix the plan, or let `meshplan plan` pick one")


# ---- gradient sync: periodic (local SGD, DiLoCo) and compression ---------------------------------

_ANY_CLUSTER = SimpleNamespace(num_dcs=2, gpus_per_node=0, gpus_per_dc=0)
"""Stands in for an unknown cluster in spec.sync.periodic_reason: every check that needs no
cluster runs (powersgd with sharding or periodic sync, dp >= 2, shard_group, sync_overlap), the
scope checks pass (two datacenters; one data-parallel rank per inner group)."""


def sync_reason(plan: Plan, cluster: ClusterSpec | None) -> str | None:
    """Why the plan's gradient sync cannot run (spec.sync.periodic_reason, the constraint
    'invalid gradient sync'); without a cluster only the checks that need none."""
    from meshplan.spec.sync import periodic_reason
    return periodic_reason(plan, cluster if cluster is not None else cast(ClusterSpec, _ANY_CLUSTER))


def sync_overlap(plan: Plan) -> int:
    """The plan's sync_overlap (0 where this meshplan's Plan has no such field)."""
    return int(getattr(plan, "sync_overlap", 0))


def sync_words(plan: Plan) -> str:
    """A periodic plan's sync settings, as unsupported lines name them:
    ``grad_sync=diloco (sync_every=50, sync_scope=node)``."""
    p = plan
    extra = [f"sync_every={p.sync_every}", f"sync_scope={p.sync_scope}"]
    if sync_overlap(p):
        extra.append(f"sync_overlap={sync_overlap(p)}")
    return f"grad_sync={p.grad_sync} ({', '.join(extra)})"


def compression_words(plan: Plan) -> str:
    """``grad_compression=bf16``, or ``grad_compression=powersgd (compression_rank=4)``."""
    p = plan
    rank = f" (compression_rank={p.compression_rank})" if p.grad_compression == "powersgd" else ""
    return f"grad_compression={p.grad_compression}{rank}"


def sync_groups(inp: ExportInput) -> tuple[int, int] | None:
    """(data-parallel ranks per inner group, inner groups) of a local-sgd/diloco plan
    (spec.export_limits.plan_sync_groups); None when its sync_scope (node, dc) needs the cluster
    and the input has none."""
    return plan_sync_groups(inp.plan, inp.cluster)


def sync_unsupported(target: str, plan: Plan) -> list[str]:
    """The unsupported lines of a target with no periodic sync and no gradient compression beyond
    what it maps itself (Megatron-LM, DeepSpeed): local-sgd/diloco and a compressed outer sync."""
    p = plan
    out: list[str] = []
    if p.periodic:
        out.append(f"{sync_words(p)}: {target} has no local SGD or DiLoCo (every data-parallel rank syncs "
                   "gradients every step); exported as synchronous data parallelism")
        if p.grad_compression != "none":
            out.append(f"{compression_words(p)} (of the outer sync of grad_sync={p.grad_sync}): {target} has no "
                       "outer sync to compress; not exported")
    return out


# ---- placement (mesh_order) ----------------------------------------------------------------------

def placement_words(plan: Plan) -> str:
    """``mesh_order=dp:pp:cp:tp``, as unsupported lines name the plan's placement."""
    return f"mesh_order={':'.join(plan.dims.order)}"


def placement_unsupported(target: str, plan: Plan, runs: str) -> list[str]:
    """The unsupported line of a target whose rank order is fixed (``runs``: its order in words) for
    a plan whose placement differs from meshplan's default (spec.axes.DEFAULT_ORDER)."""
    from meshplan.spec.axes import DEFAULT_ORDER
    if placement_is(plan, DEFAULT_ORDER):
        return []
    return [f"{placement_words(plan)}: {target} lays out the ranks in one fixed order ({runs}); exported with that "
            f"order: its groups hold other ranks than the plan places together, so they cross other links than planned"]


# ---- pipeline stages -----------------------------------------------------------------------------

# ---- output --------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """Nested dicts of scalars/lists as TOML: one [table] per dict, sub-dicts as [a.b] tables, bare
    keys where TOML allows them (values: spec.io.toml_value)."""
    out: list[str] = []

    def emit(prefix: str, table: dict[str, Any]) -> None:
        scalars = [(k, v) for k, v in table.items() if not isinstance(v, dict)]
        subs = [(k, v) for k, v in table.items() if isinstance(v, dict)]
        if scalars:
            out.append(f"[{prefix}]")
            out.extend(f"{_toml_key(k)} = {toml_value(v)}" for k, v in scalars)
            out.append("")
        for k, v in subs:
            emit(f"{prefix}.{_toml_key(k)}", v)

    for name, table in tables.items():
        emit(_toml_key(name), table)
    return "\n".join(out)


def comment_block(lines: list[str], prefix: str = "# ") -> str:
    return "".join(f"{prefix}{line}\n" if line else prefix.rstrip() + "\n" for line in lines)


def describe(inp: ExportInput) -> list[str]:
    """Header lines: what was exported."""
    p = inp.plan
    lines = [f"plan: {p.short()}  ({p.num_gpus} GPUs: tp*pp*dp*cp = {p.tp}*{p.pp}*{p.dp}*{p.cp})"]
    if inp.model is not None:
        lines.append(f"model: {inp.model.name}")
    if inp.cluster is not None:
        lines.append(f"cluster: {inp.cluster.name}")
    if p.periodic:
        groups = sync_groups(inp)
        if groups is not None:
            lines.append(f"{sync_words(p)}: {groups[1]} inner groups of {groups[0]} data-parallel rank(s), "
                         f"synchronised every {p.sync_every} steps")
    if inp.global_batch is not None:
        work = f"global batch {inp.global_batch}"
        if inp.seq_len is not None:
            work += f" x {inp.seq_len} tokens"
        work += f", {inp.microbatches} micro-batches of {p.micro_batch} per data-parallel rank per step"
        lines.append(work)
    return lines


def optimizer_unsupported(target: str, inp: ExportInput, has: dict[str, str]) -> list[str]:
    """The unsupported line of a workload optimizer ``target`` cannot set (``has``: the ones it can,
    by meshplan name -> the target's name)."""
    if inp.optimizer in has:
        return []
    names = ", ".join(sorted(has))
    return [f"optimizer={inp.optimizer}: {target} configures {names} only; not exported (its default AdamW "
            "would run: set the optimizer in the training code)"]
