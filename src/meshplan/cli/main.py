"""`meshplan` command line. Planning commands never import torch.

Every user error is a MeshplanError printed as one line `meshplan: error: ...` with exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from meshplan.cli.args import positive_int, seq_len_int
from meshplan.cli.planfile import FROM_FILE, add_override
from meshplan.errors import MeshplanError, Terminated

EPILOG = """examples:
  meshplan presets
  meshplan estimate --model llama3-8b --cluster h100-sxm-80gb:8 \\
      --plan dp=8,zero=3,micro_batch=1,recompute=op --global-batch 16 --seq-len 8192
  meshplan plan --model llama3-8b --cluster h100-sxm-80gb:8 --global-batch 16 --out plan.json
  meshplan estimate --plan plan.json          # simulate, report, train, export too: the file's problem
  meshplan validate --report validation.md

exit codes: 0 done; 2 bad usage or input (the message says what is wrong and how to fix it);
  3 the request is well formed but nothing meets it: no plan fits, or none meets --deadline (the
  message says what would); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM).
"""


MODEL_HELP = ("preset name (see `meshplan presets`), ModelSpec .toml/.json, hf:CONFIG.json, "
              "module:pkg.mod:factory, or a layer graph .json from `meshplan ingest --out`")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        raise MeshplanError(message, hint=f"see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="meshplan", description="Find, estimate and run parallel training plans.",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    pr = sub.add_parser("presets", help="list built-in models, GPUs and clusters with their specs",
                        description="Built-in models (parameters, layers, hidden size, heads, sequence length), "
                                    "GPUs (memory, peak TFLOP/s, HBM bandwidth, price, node size) and clusters "
                                    "(GPU, count, links, price). --json: every field of every preset.")
    pr.add_argument("kind", nargs="?", choices=["models", "gpus", "clusters"], help="only this kind")
    pr.add_argument("--json", action="store_true")

    from meshplan.cli.costing import add_cost_flags
    es = sub.add_parser("estimate", help="predict step time, throughput and memory of one plan")
    es.add_argument("--model", help=MODEL_HELP + FROM_FILE)
    es.add_argument("--cluster",
                    help="GPU:COUNT (e.g. h100-sxm-80gb:64), GPU:NODESxPER_NODE, a cluster preset or .toml"
                         + FROM_FILE)
    es.add_argument("--plan", required=True,
                    help="tp=..,pp=..,dp=..,micro_batch=..,... or a plan file from `meshplan plan --out`, which "
                         "also gives the model, cluster, global batch and seq len")
    es.add_argument("--global-batch", type=positive_int("--global-batch"), help="sequences per step" + FROM_FILE)
    from meshplan.cli.lengths_arg import SEQ_LEN_HELP, add_packing, seq_len_type
    es.add_argument("--seq-len", type=seq_len_type, help=SEQ_LEN_HELP)
    add_packing(es)
    from meshplan.cli.args import add_optimizer
    add_optimizer(es)
    add_override(es)
    add_cost_flags(es, policy=True)
    es.add_argument("--json", action="store_true", help="one JSON object on stdout")

    from meshplan.cli import export_cmd, plan_cmd, report_cmd, simulate_cmd, train_cmd
    plan_cmd.add_parser(sub, positive_int)
    simulate_cmd.add_parser(sub)
    train_cmd.add_train_parser(sub)
    report_cmd.add_parser(sub)
    export_cmd.add_parser(sub)

    ig = sub.add_parser("ingest", help="trace any model (hf: config or module: factory) into a layer graph",
                        description="Instantiate the model on the meta device (no weights, no GPU), run forward "
                                    "and backward there, and record per-layer FLOPs, parameters, saved "
                                    "activations and tensor-parallel structure. The graph (--out) plans "
                                    "without torch: pass it as --model to estimate/plan.")
    ig.add_argument("--model", required=True, help="hf:path/to/config.json or module:package.module:factory")
    ig.add_argument("--seq-len", type=seq_len_int, help="tokens per sample (default: the model's)")
    ig.add_argument("--out", help="write the layer graph to this .json file")
    ig.add_argument("--json", action="store_true", help="print the layer graph as JSON")

    from meshplan.cli import calibrate_cmd
    calibrate_cmd.add_parsers(sub)
    for name, sp in sub.choices.items():  # every subcommand's --help ends with examples that run as written
        if name in EXAMPLES and not (sp.epilog or "").lstrip().startswith("examples"):
            sp.epilog = "examples:\n" + "\n".join(f"  {x}" for x in EXAMPLES[name]) + (
                f"\n\n{sp.epilog}" if sp.epilog else "")
            sp.formatter_class = _KeepEpilog
    return p


class _KeepEpilog(argparse.HelpFormatter):
    """Wraps the description as usual and keeps an epilog of examples line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.lstrip().startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


EXAMPLES: dict[str, tuple[str, ...]] = {
    "presets": ("meshplan presets models", "meshplan presets gpus --json"),
    "estimate": ("meshplan estimate --model llama3-8b --cluster h100-sxm-80gb:8 --global-batch 16 "
                 "--plan dp=8,zero=3,micro_batch=1,recompute=op --seq-len 8192",
                 "meshplan estimate --plan plan.json          # a plan file from `meshplan plan --out`"),
    "plan": ("meshplan plan --model llama3-8b --cluster h100-sxm-80gb:8 --global-batch 16 --out plan.json",
             "meshplan plan --model gpt3-13b --cluster h100-sxm-80gb --gpus 16..64 --global-batch 512 --objective cost"),
    "simulate": ("meshplan simulate --model gpt2-medium --cluster h100-sxm-80gb:8 --plan dp=8 --global-batch 16 "
                 "--plot step.svg",),
    "report": ("meshplan report --model llama3-8b --cluster h100-sxm-80gb:8 --global-batch 16 --out report.html",),
    "export": ("meshplan export --to megatron --model llama3-8b --plan tp=2,pp=1,dp=4 --global-batch 16",
               "meshplan export --to torchtitan --plan plan.json --out job.toml"),
    "ingest": ("meshplan ingest --model hf:path/to/config.json --out graph.json",),
    "validate": ("meshplan validate", "meshplan validate --report validation.md"),
    "calibrate": ("meshplan calibrate --runs runs.csv --out cal.json",
                  "meshplan calibrate --metrics run.jsonl --out cal.json"),
}
"""One or two examples per subcommand (train has its own, train_cmd.EXAMPLES)."""


def cmd_presets(args: argparse.Namespace) -> int:
    from meshplan.cli.views import presets_data, presets_text
    from meshplan.spec.io import KINDS
    kinds = [args.kind] if args.kind else list(KINDS)
    data = presets_data(kinds)
    if args.json:
        from meshplan.cli.format import json_doc
        print(json_doc("presets", data))
        return 0
    print(presets_text(data))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from meshplan.cli.costing import costing
    from meshplan.cli.format import json_doc
    from meshplan.cli.lengths_arg import lengths_of
    from meshplan.cli.model_arg import as_problem
    from meshplan.cli.planfile import resolve
    from meshplan.cli.views import estimate_text, pooled_estimate_text
    from meshplan.cost import estimate
    lengths = lengths_of(args)  # a --seq-len distribution (or the plan file's), before the file is resolved
    cost = costing(args)
    inputs = resolve(args, required=("model", "cluster", "global_batch"))
    cluster, plan = cost.cluster(inputs.cluster()), inputs.plan
    model, work = as_problem(inputs.model(), inputs.global_batch, inputs.seq_len, lengths, inputs.optimizer)
    if getattr(model, "model", None) is not None:  # past the trained context: a note; past a learned table: an error
        from meshplan.cli.plan_cmd import check_positions
        check_positions(args, model.model, work.seq_len)
    report = estimate(model, cluster, plan, work, cost.params)
    if len(cluster.pools) > 1:  # every rank on its own pool's hardware: the pools' parts
        d = work.lengths
        dist = None if d is None else {"lengths": d.text(), "packing": d.packing, "mean_length": d.mean_len,
                                       "max_length": d.max_len}
        if args.json:
            from meshplan.cost.batch import mfu_basis
            # the mean peak of the GPUs the plan uses, as cost.pools' MFU divides by it
            peak = (report.mfu_flops / report.step_time_s / report.mfu / report.num_gpus / 1e12
                    if report.mfu and report.step_time_s and report.num_gpus else 0.0)
            print(json_doc("estimate", report.to_dict() | {"mfu_basis": {"dtype": mfu_basis(plan.precision),
                                                                         "peak_tflops_per_gpu": peak},
                                                            "global_batch": work.global_batch, "seq_len": work.seq_len,
                                                            "optimizer": work.optimizer}
                            | ({"lengths": dist} if dist else {}) | cost.to_json()))
        else:
            print(pooled_estimate_text(report, cluster, work))
        return 0
    extra: dict = {}
    if work.lengths is not None and plan.pools is None and plan.dp_shares is None:
        from meshplan.cost import lengths_summary
        extra = {"lengths": lengths_summary(model, cluster, plan, work, cost.params)}
    if args.json:
        from meshplan.cli.views import runtime_status
        from meshplan.cost.batch import mfu_basis
        basis = mfu_basis(plan.precision)
        out = (report.to_dict() | {"mfu_basis": {"dtype": basis,
                                                 "peak_tflops_per_gpu": cluster.gpu.peak(basis) / 1e12}}
               | {"model": model.name, "cluster": cluster.name, "plan": plan.short(),
                                   "global_batch": work.global_batch, "seq_len": work.seq_len,
                                   "optimizer": work.optimizer, "runtime": runtime_status(model, plan, work)}
               | extra | cost.to_json())
        print(json_doc("estimate", out))
    else:
        text = estimate_text(model, cluster, plan, work, report, cost.params)
        if extra:
            from meshplan.cli.lengths_arg import insert_lines
            text = insert_lines(text, extra["lengths"])
        notes = [f"note     {n}" for n in getattr(report, "notes", None) or () if n not in text]
        print("\n".join(cost.lines() + [text] + notes))
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from meshplan.cli.format import json_text
    from meshplan.cli.model_arg import graph_table, graph_text, is_ingested
    from meshplan.spec.io import dump_json
    if not is_ingested(args.model):
        raise MeshplanError(f"--model {args.model}: ingest takes hf:CONFIG.json or module:package.module:factory",
                            hint="presets and ModelSpec files need no ingestion; use them with estimate/plan")
    import time

    from meshplan.ingest import ingest
    t0 = time.perf_counter()
    graph = ingest(args.model, seq_len=args.seq_len)
    took = time.perf_counter() - t0
    if args.out is not None:
        try:
            with open(args.out, "w") as f:
                f.write(dump_json(graph) + "\n")
        except OSError as e:
            raise MeshplanError(f"cannot write --out {args.out}: {e.strerror or e}") from None
    if args.json:
        from meshplan.spec.base import to_dict
        print(json_text(to_dict(graph)))
        return 0
    print("\n".join(graph_text(graph)))
    print(f"traced in {took:.1f} s" + (f"; layer graph written to {args.out}" if args.out else ""))
    print()
    print(graph_table(graph))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from meshplan.cli.calibrate_cmd import run_validate
    return run_validate(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from meshplan.cli.calibrate_cmd import run_calibrate
    return run_calibrate(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from meshplan.cli.plan_cmd import run
    return run(args)


def cmd_simulate(args: argparse.Namespace) -> int:
    from meshplan.cli.simulate_cmd import run
    return run(args)


def cmd_train(args: argparse.Namespace) -> int:
    from meshplan.cli.train_cmd import cmd_train as run  # imports torch only when it runs
    return run(args)


def cmd_report(args: argparse.Namespace) -> int:
    from meshplan.cli.report_cmd import run
    return run(args)


def cmd_export(args: argparse.Namespace) -> int:
    from meshplan.cli.export_cmd import run
    return run(args)


COMMANDS = {"presets": cmd_presets, "ingest": cmd_ingest, "estimate": cmd_estimate, "validate": cmd_validate,
            "plan": cmd_plan, "train": cmd_train, "simulate": cmd_simulate,
            "report": cmd_report, "export": cmd_export, "calibrate": cmd_calibrate}


def _on_sigterm() -> object:
    """SIGTERM ends a command cleanly, as Ctrl-C does (errors.Terminated, exit 143): in the main thread
    of a process that is not a torchrun rank (a rank keeps the default, so torchrun's SIGTERM to its
    ranks stops them at once even inside a collective; the launcher says how the job ended)."""
    import signal
    import threading

    from meshplan.errors import raise_terminated
    if threading.current_thread() is not threading.main_thread():
        return None
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ:
        return None
    before = signal.getsignal(signal.SIGTERM)
    if before not in (signal.SIG_DFL, None):  # someone else's handler (an embedding program): keep it
        return None
    signal.signal(signal.SIGTERM, raise_terminated)
    return before


def _restore_sigterm(before: object) -> None:
    if before is not None:
        import signal
        signal.signal(signal.SIGTERM, before)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    before = _on_sigterm()
    try:
        return _main(parser, argv)
    finally:
        _restore_sigterm(before)


def _main(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    try:
        args = parser.parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what was run (a calibration records it)
        if args.version:
            from meshplan import __version__
            print(__version__)
            return 0
        if not args.command:
            parser.print_help()
            return 0
        return COMMANDS[args.command](args)
    except MeshplanError as e:  # 2: bad usage or input; 3: nothing fits or meets the deadline (errors.Infeasible)
        print(f"meshplan: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("meshplan: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("meshplan: terminated (SIGTERM)", file=sys.stderr)
        return Terminated.exit_code
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
