"""`meshplan export`: a plan as torchtitan / Megatron-LM / DeepSpeed settings (issue 6).

The plan is a plan string or a plan file; a file written by `meshplan plan --out` also carries the
model, global batch and sequence length (cli.planfile): --model/--global-batch/--seq-len must agree
with it, or replace it with --override. The
settings go to --out (or stdout); what the tool cannot express is listed on stderr and in the file.
Importing this module is cheap (argparse only).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from meshplan.errors import MeshplanError

TARGETS = ("torchtitan", "megatron", "deepspeed")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from meshplan.cli.args import positive_int, seq_len_int
    p = sub.add_parser(
        "export", help="write a plan as torchtitan, Megatron-LM or DeepSpeed settings",
        description="Write a plan as the settings of a training framework: a torchtitan job-config TOML "
                    "(with the same settings as command-line overrides), Megatron-LM arguments (a bash array, "
                    "or JSON with --out FILE.json) or a DeepSpeed config JSON. What the framework cannot "
                    "express is printed on stderr and written into the file.")
    p.add_argument("--plan", required=True,
                   help="tp=..,pp=..,dp=..,micro_batch=..,... or a plan .json/.toml (as written by "
                        "`meshplan plan --out`, which also records the model, global batch and seq len)")
    p.add_argument("--to", required=True, choices=list(TARGETS), help="the framework")
    p.add_argument("--out", help="write to this file (default: stdout)")
    p.add_argument("--model", help="preset name or ModelSpec .toml/.json (default: the plan file's)")
    p.add_argument("--cluster", help="the cluster (default: the plan file's); sizes the replica groups of "
                                     "local-sgd/diloco plans with sync_scope=node or dc")
    p.add_argument("--global-batch", type=positive_int("--global-batch"),
                   help="sequences per step (default: the plan file's)")
    p.add_argument("--seq-len", type=seq_len_int,
                   help="tokens per sequence (default: the plan file's, else the model's)")
    from meshplan.cli.args import OPTIMIZER_HELP, add_optimizer
    add_optimizer(p, help=OPTIMIZER_HELP + "; written where the target has the setting (default: the plan file's, "
                          "else adamw)")
    from meshplan.cli.planfile import add_override
    add_override(p)


def _load_model(name: str, *, from_file: str | None) -> Any:
    """A ModelSpec (preset or file). Ingested models (hf:, module:, layer-graph files) have no
    transformer shape to write into a framework's settings."""
    from meshplan.cli.model_arg import is_ingested
    from meshplan.spec.io import load_model, read_data_file
    where = f"{from_file}: model {name!r} recorded in the plan file" if from_file else f"--model {name}"
    graph = is_ingested(name)
    if not graph and name.endswith((".json", ".toml")):
        try:
            graph = isinstance(read_data_file(name).get("layers"), list)
        except MeshplanError:
            graph = False  # load_model reports it
    if graph:
        raise MeshplanError(f"{where}: export needs a transformer ModelSpec for the model shape; ingested models "
                            "(hf:, module:, layer-graph files) are not supported",
                            hint="give --model with the matching preset or a ModelSpec .toml/.json")
    try:
        return load_model(name)
    except MeshplanError as e:
        if from_file is None:
            raise
        raise MeshplanError(f"{where} cannot be loaded ({e.message})",
                            hint="give --model PRESET or the ModelSpec .toml/.json it was planned with") from None


def build_input(args: argparse.Namespace) -> Any:
    from meshplan.cli.planfile import resolve
    from meshplan.export import ExportInput
    from meshplan.spec.model import ModelSpec
    from meshplan.spec.plan import Workload
    inputs = resolve(args, fields=("model", "cluster", "global_batch", "seq_len", "optimizer"))
    plan = inputs.plan
    if plan.multi_pool or (plan.dp_shares is not None and len(set(plan.replica_shares)) > 1):
        what = "several GPU pools" if plan.multi_pool else "uneven dp_shares"
        raise MeshplanError(f"export: {plan.short()} uses {what}, which {args.to} cannot express (it launches one "
                            "GPU type with even data-parallel shares)",
                            hint="run it with `meshplan train`, or export a plan with even shares on one pool")
    if plan.buckets is not None:
        raise MeshplanError(f"export: {plan.short()} sets the micro-batch and context parallelism per length bucket, "
                            f"which {args.to} cannot express (one micro-batch size and cp for every sample)",
                            hint="run it with `meshplan train`, or export the one-shape plan without buckets "
                                 f"(micro_batch={plan.micro_batch}, cp={plan.cp})")
    cluster = inputs.cluster() if inputs.cluster_arg is not None else None  # sizes node/dc replica groups
    if cluster is not None and len(cluster.pools) > 1:  # a plan on one pool: that pool's plan
        if not plan.pools:
            raise MeshplanError(f"export: {inputs.cluster_arg} is a cluster of several GPU pools and {plan.short()} "
                                f"names none; {args.to} launches one GPU type",
                                hint=f"name the pool in the plan (pools=NAME; its pools: {', '.join(cluster.names)}), "
                                     "or give --cluster of that pool's GPU type")
        cluster = cluster.pool(plan.pools[0])
    if plan.pools or plan.dp_shares:
        plan = plan.replace(pools=None, pool_dp=None, pool_pp=None, dp_shares=None)
    model = None
    if inputs.model_arg is not None and not inputs.from_file("model"):
        model = _load_model(inputs.model_arg, from_file=None)
    elif inputs.model_arg is not None:
        assert inputs.file is not None
        try:
            spec = inputs.file.model_spec
            if spec is not None and not isinstance(spec.get("layers"), list):
                model = inputs.model()  # the ModelSpec recorded in the file
            else:
                model = _load_model(inputs.model_arg, from_file=inputs.file.path)
        except MeshplanError:
            if args.to != "deepspeed":  # the DeepSpeed config takes no model shape
                raise
    gb, seq = inputs.global_batch, inputs.seq_len
    if seq is None and isinstance(model, ModelSpec):
        seq = model.seq_len
    Workload(global_batch=gb or 1, seq_len=seq or 1)  # the bounds every command applies
    return ExportInput(plan=plan, model=model, global_batch=gb, seq_len=seq, cluster=cluster,
                       optimizer=inputs.optimizer)


def run(args: argparse.Namespace) -> int:
    from meshplan.export import export, formats, render
    if args.to not in TARGETS:  # argparse checks choices; kept for direct callers
        raise MeshplanError(f"unknown --to {args.to!r}", hint="use one of " + ", ".join(TARGETS))
    fmt = None
    if args.out is not None:
        if not args.out.strip():
            raise MeshplanError("empty --out path", hint="give a file name, or leave --out out for stdout")
        ext = args.out.rsplit(".", 1)[-1].lower() if "." in args.out else ""
        fmt = ext if ext in formats(args.to) else None
    result = export(args.to, build_input(args))
    text = render(result, fmt)
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            with open(args.out, "w") as f:
                f.write(text)
        except OSError as e:
            raise MeshplanError(f"cannot write --out {args.out}: {e.strerror or e}") from None
    if result.unsupported:
        print(f"meshplan export: {args.to} cannot express {len(result.unsupported)} part(s) of the plan "
              "(written into the output too):", file=sys.stderr)
        for line in result.unsupported:
            print(f"  - {line}", file=sys.stderr)
    if args.out is not None:
        print(f"meshplan export: wrote {args.out}", file=sys.stderr)
    return 0
