"""`meshplan report`: one self-contained HTML page for a planning problem (issue 6).

Takes the search options of `meshplan plan` (the same argparse actions, taken from
plan_cmd.add_parser, less --json, --out and --plot) and writes the page to --out. ``--model``
takes every kind `meshplan plan` does: a preset or ModelSpec file, ``hf:``/``module:`` through
ingestion, or a layer graph .json (all one LayerGraph, search.search). Exit status
0 when the page is written, also when no plan fits (the page then says what would make the
problem feasible); 2 with a one-line error on bad input or an unwritable --out. Importing
this module is cheap; the search, the simulator and the page are imported when it runs.
"""
from __future__ import annotations

import argparse
import copy
import os
import shlex
import sys
import time
from typing import Any

from meshplan.errors import MeshplanError

NOT_FROM_PLAN = frozenset({"help", "json", "out", "plot"})
"""`meshplan plan` options that make no sense here (--out is redefined: the HTML file)."""
NOT_IN_HELP = frozenset({"deadline"})
"""`meshplan plan` options the report does not take but still parses, so that giving one is a
one-line error naming `meshplan plan` (plan_cmd.deadline_days), not an unknown option; its help
leaves them out (the page ranks plans without a deadline)."""
FROM_PLAN_FILE = ("model", "cluster", "global_batch", "seq_len", "optimizer")
"""Options that ``--plan FILE`` gives (required without it)."""


def _search_actions() -> list[argparse.Action]:
    """The argparse actions of `meshplan plan`'s search options (one definition for both)."""
    from meshplan.cli import plan_cmd
    from meshplan.cli.args import positive_int
    holder = argparse.ArgumentParser(add_help=False)
    subs = holder.add_subparsers()
    plan_cmd.add_parser(subs, positive_int)
    plan = subs.choices["plan"]
    return [a for a in plan._actions if a.dest not in NOT_FROM_PLAN]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `report` subcommand's arguments (called from meshplan.cli.main.build_parser)."""
    p = sub.add_parser(
        "report", help="write one self-contained HTML report of the best plans",
        description="Search the plans like `meshplan plan`, simulate the winner's step, and write one "
                    "self-contained HTML page (no network needed): the problem, the top plans, the Pareto "
                    "front, time and memory breakdowns, the winner's timeline and the explanation. When no "
                    "plan fits, the page says what would make the problem feasible.")
    from meshplan.cli.planfile import FROM_FILE, add_override
    for action in _search_actions():
        if action.dest in FROM_PLAN_FILE:  # given by --plan FILE too: checked once the file is read
            action = copy.copy(action)
            action.required = False
            action.help = (action.help or "") + FROM_FILE
        if action.dest in NOT_IN_HELP:
            action = copy.copy(action)
            action.help = argparse.SUPPRESS
        elif action.help and "; the default with --deadline" in action.help:  # --objective
            action = copy.copy(action)
            action.help = action.help.replace("; the default with --deadline", "")
        p._add_action(action)  # what ArgumentParser(parents=...) does, less the options above
    p.add_argument("--plan", help="a plan file from `meshplan plan --out`: the model, cluster, global batch and "
                                  "seq len it was planned for (the report searches that problem again)")
    add_override(p)
    p.add_argument("--out", required=True, help="the HTML file to write (e.g. report.html)")
    return p


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this page (options at their defaults left out)."""
    words = ["meshplan", "report"]
    for a in _search_actions():
        value = getattr(args, a.dest, None)
        if not a.option_strings or value is None or (value == a.default and not a.required):
            continue
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if value is (not isinstance(a, argparse._StoreFalseAction)):  # the flag that sets this value
                words.append(a.option_strings[0])
        else:
            words += [a.option_strings[0], str(value)]
    if getattr(args, "plan", None) is not None:
        words += ["--plan", args.plan] + (["--override"] if getattr(args, "override", False) else [])
    words += ["--out", args.out]
    return " ".join(shlex.quote(w) for w in words)



def _check_out(path: str) -> None:
    """Fail before the search if --out cannot be written."""
    from meshplan.paths import check_output_file
    check_output_file("--out", path, "report.html")
    if os.path.splitext(path)[1].lower() not in (".html", ".htm"):
        raise MeshplanError(f"--out {path}: the report is an HTML page; give a .html file",
                            hint="e.g. --out report.html (open it in a browser and print it to PDF if needed)")


def run(args: argparse.Namespace) -> int:
    from meshplan.cli.plan_cmd import Progress, problem, train_cost
    from meshplan.cli.planfile import resolved_args
    from meshplan.report import build_report, write_html
    from meshplan.spec.io import is_file_arg
    t0 = time.perf_counter()
    _check_out(args.out)
    if args.plan is not None and not is_file_arg(args.plan):
        raise MeshplanError(f"--plan {args.plan}: report takes a plan file written by `meshplan plan --out`",
                            hint="the report searches every plan; drop --plan, or give a plan .json")
    command = _command(args)  # as typed (the plan file, not what it records)
    from meshplan.cli.lengths_arg import lengths_of
    lengths_of(args)  # a --seq-len distribution (or the plan file's), before the file is resolved
    args = resolved_args(args, required=("model", "cluster", "global_batch"))  # --plan FILE's problem
    model, clusters, tokens, space, work = problem(args)  # the model as a LayerGraph, any kind
    bar = Progress(sys.stderr) if sys.stderr.isatty() else None
    try:
        from meshplan.cli.costing import costing
        cost = costing(args)
        report = build_report(model, clusters, work, space, objective=args.objective, top=args.top,
                              progress=bar, command=command, model_name=str(args.model), params=cost.params)
        report.result.notes += cost.lines()
    finally:
        if bar is not None:
            bar.close()
    result = report.result
    if tokens is not None and result.plans:
        report.train = [train_cost(tokens, p) for p in result.plans]
    text = report.html()
    write_html(args.out, text)
    size = f"{len(text.encode()) / 1024:,.0f} KiB"
    took = f"{time.perf_counter() - t0:.1f} s"
    if result.pooled:  # a cluster of several pools (report.pools)
        from meshplan.units import human_seconds
        b = result.best_pooled
        print(f"wrote {args.out}: " + (f"best plan {b.plan.short()}, {human_seconds(b.step_time_s)} per step"
                                       if b is not None else "no plan fits on any pool"))
    elif result.best is not None:
        from meshplan.cli.format import seconds
        b = result.best
        print(f"wrote {args.out} ({size}, {took}): best plan {b.plan.short()} on {b.plan.num_gpus} GPUs, "
              f"{seconds(b.report.step_time_s)} per step")
    else:
        print(f"wrote {args.out} ({size}, {took}): no plan fits; the page says what would make it feasible")
    return 0
