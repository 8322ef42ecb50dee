"""`meshplan train`: run a plan on a real model with torch.distributed and measure it.

Wiring (cli/main.py): ``add_train_parser(sub)`` in build_parser and ``"train": cmd_train`` in
COMMANDS. torch is imported only when the command runs. Run standalone for development:
``python -m meshplan.cli.train_cmd --model tiny-llama --plan dp=2,precision=fp32 ...``
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from meshplan.errors import MeshplanError

EXAMPLES = """examples:
  meshplan train --model tiny-llama --plan dp=2,zero=3,precision=fp32 --global-batch 8 --steps 10
  meshplan train --model tiny-llama --plan tp=2,pp=2,dp=2,zero=3,precision=fp32 --global-batch 16 --steps 20 \\
      --checkpoint-dir ckpt --checkpoint-every 5 --metrics run.jsonl
  meshplan train --model tiny-llama --plan tp=2,dp=2,precision=fp32 --global-batch 16 --steps 40 \\
      --checkpoint-dir ckpt --resume            # continue the run above under another plan
  meshplan train --model hf:config.json --plan pp=2,dp=2,zero=3,precision=fp32 --global-batch 8 --steps 10
  meshplan train --model module:mypkg.models:make_cnn --plan dp=2,precision=fp32 --global-batch 16 --steps 10
  meshplan train --model tiny-llama --plan tp=2,micro_batch=1,precision=fp32 --global-batch 8 --steps 20 \\
      --replan-after 3 --switch --checkpoint-dir ckpt --metrics run.jsonl   # re-plan on what 3 steps measured
  meshplan train --model tiny-llama --plan dp=4,grad_sync=diloco,sync_every=4,precision=fp32 --global-batch 8 \\
      --steps 12 --outer-lr 0.7 --outer-momentum 0.9      # DiLoCo: 4 workers, an outer Nesterov step every 4
  meshplan train --model tiny-llama --plan dp=4,grad_compression=powersgd,compression_rank=2,precision=fp32 \\
      --global-batch 8 --steps 12                         # DDP with PowerSGD's communication hook
  meshplan train --model tiny-llama --plan dp=2,dp_shares=3:1,precision=fp32 --global-batch 8 --steps 5
                                                          # replica 0 trains on 6 samples a step, replica 1 on 2
  meshplan train --model tiny-llama --plan pp=2,pools=h100:a100,pool_pp=1:1,precision=fp32 --global-batch 8 \\
      --steps 5                                           # pools: placement only (which ranks stand for which)
  meshplan train --model tiny-llama --plan dp=2,precision=fp32 --global-batch 8 --steps 5 \\
      --seq-len 64:0.6,128:0.3,256:0.1 --packing bucketed  # variable-length samples (or a histogram file)
  meshplan train --model tiny-llama --plan cp=2,buckets=128x2cp1:256x1cp2,precision=fp32 --global-batch 8 \\
      --steps 5 --seq-len 64:0.6,128:0.3,256:0.1          # per length bucket a micro-batch size and a cp degree
"""


def _positive(name: str, allow_zero: bool = False) -> Any:
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 0 or (v == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {text!r}")
        return v
    return conv


def learning_rate(text: str) -> float:
    """argparse type of --lr: a float, finite and > 0 (runtime.preflight.check_lr)."""
    from meshplan.runtime import preflight  # no torch
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lr must be a number, got {text!r}") from None
    try:
        return preflight.check_lr(value)
    except MeshplanError as e:
        raise argparse.ArgumentTypeError(f"--lr must be a finite number > 0, got {text!r}") from e


def number_in(flag: str, low: float, high: float | None = None, *, low_open: bool = True,
              example: str = "") -> Callable[[str], float]:
    """argparse type of a finite float in (low, high) (``low_open``: low excluded; high always
    excluded; None: no upper bound)."""
    words = f"{'>' if low_open else '>='} {low:g}" + (f" and < {high:g}" if high is not None else "")

    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        if not math.isfinite(v) or v < low or (low_open and v == low) or (high is not None and v >= high):
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number {words}, got {text!r}"
                                             + (f" (e.g. {flag} {example})" if example else ""))
        return v
    return conv


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `train` sub-command to an argparse sub-parsers object."""
    t = subparsers.add_parser("train", help="run a plan with torch.distributed and compare with the estimate",
                              epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--model", help="preset (tiny-llama, tiny-gpt2, tiny-moe, ...), ModelSpec file, "
                   "hf:CONFIG.json or module:package.module:factory (an ingested model: random weights, synthetic "
                   "batches of its example inputs; default with --plan FILE: the plan file's)")
    t.add_argument("--plan", required=True, help="tp=..,pp=..,dp=..,... or a plan file from `meshplan plan --out` "
                   "(which also gives the model, global batch and seq len)")
    t.add_argument("--global-batch", type=_positive("--global-batch"),
                   help="sequences per step (default with --plan FILE: the plan file's; else 2 micro-batches per "
                        "data-parallel replica: 2 x dp x micro_batch)")
    from meshplan.cli.planfile import add_override
    add_override(t)
    t.add_argument("--steps", type=_positive("--steps"), required=True,
                   help="optimizer steps (in total, when resuming)")
    t.add_argument("--seq-len", type=_seq_len, help="tokens per sequence (default: the plan file's, "
                   "else the model's; ingested models: ingestion's default), or for presets a distribution of sample "
                   "lengths: length:probability pairs (64:0.6,128:0.3,256:0.1) or a histogram file (CSV rows "
                   "length,count, or JSON)")
    t.add_argument("--packing", choices=["padded", "bucketed", "packed"],
                   help="with a --seq-len distribution: padded (default: each micro-batch padded to its longest "
                        "sample), bucketed (the step's samples sorted by length first) or packed (documents "
                        "concatenated into windows of the longest length)")
    t.add_argument("--nproc-per-node", type=_positive("--nproc-per-node"),
                   help="processes on this node (default: the plan's GPU count / --nnodes)")
    t.add_argument("--nnodes", type=_positive("--nnodes"), default=1)
    t.add_argument("--node-rank", type=_positive("--node-rank", True),
                   help="this node's rank among --nnodes (default 0; with --site: derived from the plan's site_order)")
    t.add_argument("--site", type=_positive("--site", True),
                   help="the site (datacenter, 0-based, in the cluster's node order) this node is in: with a plan's "
                        "site_order, the node rank that realises it is derived (site site_order[k]'s nodes are the "
                        "k-th block of node ranks) and printed")
    t.add_argument("--site-node", type=_positive("--site-node", True),
                   help="with --site: this node's index within its site, 0-based (default 0 with one node per site)")
    t.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (multi-node)")
    t.add_argument("--max-restarts", type=_positive("--max-restarts", True), default=0,
                   help="torchrun restarts after a failure; the run resumes from the last checkpoint")
    t.add_argument("--checkpoint-dir", help="directory for distributed checkpoints")
    t.add_argument("--checkpoint-every", type=_positive("--checkpoint-every", True), default=0,
                   help="save every S steps (and at the end)")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    t.add_argument("--overwrite", action="store_true",
                   help="delete the checkpoint already in --checkpoint-dir (meta.json, step-* folders) and start "
                        "again; without it (or --resume) a --checkpoint-dir holding a checkpoint is refused")
    t.add_argument("--metrics", help="append one JSON object per step (and a summary) to this file")
    t.add_argument("--lr", type=learning_rate, default=1e-3, help="AdamW learning rate, > 0 (default 1e-3)")
    t.add_argument("--seed", type=_positive("--seed", True), default=0)
    from meshplan.cli.args import add_optimizer
    add_optimizer(t, help="the optimizer (the inner one of local-sgd/diloco): adamw (betas 0.9, 0.95, weight decay "
                          "0.1), sgd (momentum 0.9) or adafactor (torch.optim.Adafactor's defaults); default: the plan "
                          "file's, else adamw. lion and adam8bit are planned and priced, not run")
    t.add_argument("--grad-clip", type=number_in("--grad-clip", 0.0, low_open=False, example="1.0"), default=1.0,
                   help="largest global gradient norm (each inner group's own under local-sgd/diloco); 0: no "
                        "clipping; default 1.0")
    t.add_argument("--outer-lr", type=number_in("--outer-lr", 0.0, example="0.7"),
                   help="grad_sync=diloco: the outer Nesterov SGD's learning rate, > 0 (default 0.7, the paper's)")
    t.add_argument("--outer-momentum", type=number_in("--outer-momentum", 0.0, 1.0, low_open=False, example="0.9"),
                   help="grad_sync=diloco: the outer Nesterov momentum, in [0, 1) (default 0.9, the paper's)")
    t.add_argument("--nodes-per-dc", type=_positive("--nodes-per-dc"),
                   help="nodes per datacenter (of --nnodes): what sync_scope=dc groups; needed by it")
    t.add_argument("--data", choices=["corpus", "synthetic"],
                   help="generated byte-level text (default) or random tokens (presets only: ingested models "
                        "train on synthetic batches of their example inputs)")
    t.add_argument("--pg-timeout", type=float, default=300.0, help="process-group timeout, seconds")
    t.add_argument("--replan-after", type=_integer("--replan-after"), metavar="N",
                   help="after N steps (2 or more: the first is warm-up), compare the measured step time and memory "
                        "with the cost model's band; outside it, fit a calibration to them (written beside --metrics "
                        "FILE as FILE.calibration.json, else into --checkpoint-dir) and rank the plans again")
    t.add_argument("--switch", action="store_true",
                   help="with --replan-after: when a plan the runtime runs on these processes is predicted at least "
                        "5%% faster under that calibration, checkpoint (needs --checkpoint-dir) and go on under it")
    return t


def _seq_len(text: str) -> int | str:
    """--seq-len: a positive length (int), or a distribution / histogram file (kept as text: parsed
    by spec.lengths.parse_lengths once --packing is known)."""
    from meshplan.spec.lengths import looks_like_dist
    if looks_like_dist(text):
        return text.strip()
    from meshplan.cli.args import check_seq_len
    return check_seq_len(_positive("--seq-len")(text), text)


def _lengths(args: argparse.Namespace) -> Any:
    """The LengthDist of --seq-len (with --packing), or None for one length."""
    if not isinstance(args.seq_len, str):
        return None
    from meshplan.spec.lengths import parse_lengths
    return parse_lengths(args.seq_len, getattr(args, "packing", None) or "padded")


def _integer(name: str) -> Any:
    def conv(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
    return conv


def _procs_per_node(args: argparse.Namespace, plan: Any) -> int:
    """--nproc-per-node, or the plan's GPUs spread evenly over --nnodes."""
    if args.nproc_per_node is not None:
        return args.nproc_per_node
    if plan.num_gpus % args.nnodes:
        raise MeshplanError(f"plan needs {plan.num_gpus} processes, not a multiple of --nnodes {args.nnodes}")
    return plan.num_gpus // args.nnodes


def site_node_rank(plan: Any, nnodes: int, site: int, site_node: int | None,
                   nodes_per_dc: int | None = None) -> tuple[int, int]:
    """(node rank, nodes per site) that realise ``plan``'s site order for the node ``site_node`` of
    site ``site``: site site_order[k]'s nodes are the k-th block of node ranks (runtime/mesh.py
    root_mesh), so node i of site s is node rank site_order.index(s) x nodes per site + i."""
    sites = getattr(plan, "site_order", None)
    if not sites:
        raise MeshplanError(f"--site {site}: the plan has no site_order, so the node rank is not derived from the site",
                            hint="give --node-rank, or add site_order=... to the plan")
    m = len(sites)
    order = ":".join(map(str, sites))
    if nnodes % m:
        raise MeshplanError(f"--site: --nnodes {nnodes} is not a multiple of the {m} sites of site_order={order}",
                            hint=f"start the same number of nodes on each site (--nnodes a multiple of {m})")
    per = nnodes // m
    if nodes_per_dc is not None and nodes_per_dc != per:
        raise MeshplanError(f"--nodes-per-dc {nodes_per_dc} but --nnodes {nnodes} over the {m} sites of "
                            f"site_order={order} is {per} nodes per site", hint=f"--nodes-per-dc {per}")
    if site >= m:
        raise MeshplanError(f"--site {site}: site_order={order} has sites 0..{m - 1}", hint="give this node's site")
    if site_node is None:
        if per > 1:
            raise MeshplanError(f"--site {site}: each site has {per} nodes; say which one this is with --site-node "
                                f"(0..{per - 1})", hint="e.g. --site-node 0")
        site_node = 0
    if site_node >= per:
        raise MeshplanError(f"--site-node {site_node}: each site has {per} node(s) (0..{per - 1})",
                            hint=f"--nnodes {nnodes} over {m} sites")
    return sites.index(site) * per + site_node, per


def resolve_site(args: argparse.Namespace, plan: Any, quiet: bool = False) -> None:
    """--site / --site-node: set args.node_rank to the node rank that realises the plan's site order
    (and print the mapping); an explicit --node-rank that disagrees is refused. Without --site the
    node rank is --node-rank's (default 0)."""
    site, site_node = getattr(args, "site", None), getattr(args, "site_node", None)
    if site is None:
        if site_node is not None:
            raise MeshplanError("--site-node needs --site (the site this node is in)", hint="add --site S")
        if args.node_rank is None:
            args.node_rank = 0
        return
    rank, per = site_node_rank(plan, args.nnodes, site, site_node, getattr(args, "nodes_per_dc", None))
    if args.node_rank is not None and args.node_rank != rank:
        raise MeshplanError(f"--node-rank {args.node_rank} disagrees with --site {site} --site-node {site_node or 0}, "
                            f"which site_order={':'.join(map(str, plan.site_order))} puts at node rank {rank}",
                            hint="drop --node-rank: --site derives it")
    args.node_rank = rank
    args.site, args.site_node = None, None  # the workers get the node rank (and the launcher's environment)
    args.site_ranks = True
    args.site_flags = f"--site {site}" + (f" --site-node {site_node}" if site_node is not None else "")
    if not quiet:
        nproc = _procs_per_node(args, plan)
        print(f"meshplan: site_order={':'.join(map(str, plan.site_order))}: site {site} node {site_node or 0} "
              f"(of {per} per site) -> node rank {rank} of {args.nnodes}, global ranks {rank * nproc}-"
              f"{(rank + 1) * nproc - 1}", file=sys.stderr)


def _job(args: argparse.Namespace) -> Any:
    """The job of a preset model or file, or of an ingested model (hf:/module:, by its source)."""
    from meshplan.cli.model_arg import is_ingested
    from meshplan.runtime.job import Job
    from meshplan.runtime.launch import metrics_path
    from meshplan.spec.io import load_model, load_plan
    plan = load_plan(args.plan)
    lengths = _lengths(args)
    if is_ingested(args.model):
        if args.data:
            from meshplan.runtime.generic import data_refusal
            raise MeshplanError(data_refusal(args.model), hint="drop --data")
        if lengths is not None:
            raise MeshplanError(f"--seq-len {args.seq_len}: variable-length samples run for preset models only (an "
                                "ingested model trains on synthetic batches of its example inputs)",
                                hint="give one --seq-len")
        model: Any = args.model
        seq_len = args.seq_len
    else:
        model = load_model(args.model)
        seq_len = lengths.max_len if lengths is not None else args.seq_len or model.seq_len
    return Job(model_arg=args.model, plan_arg=args.plan, model=model, plan=plan,
               global_batch=args.global_batch, seq_len=seq_len, steps=args.steps,
               nproc_per_node=_procs_per_node(args, plan), nnodes=args.nnodes, node_rank=args.node_rank or 0,
               site_ranks=getattr(args, "site_ranks", False), site_flags=getattr(args, "site_flags", ""),
               rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts,
               checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
               resume=args.resume, overwrite=getattr(args, "overwrite", False),
               metrics=metrics_path(args.metrics), lr=args.lr, seed=args.seed,
               data=args.data or "corpus", pg_timeout_s=args.pg_timeout,
               replan_after=getattr(args, "replan_after", None), switch=getattr(args, "switch", False),
               optimizer=getattr(args, "optimizer", "adamw"), grad_clip=getattr(args, "grad_clip", 1.0),
               outer_lr=getattr(args, "outer_lr", None), outer_momentum=getattr(args, "outer_momentum", None),
               nodes_per_dc=getattr(args, "nodes_per_dc", None), lengths=lengths)


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The same request as command-line arguments, for the processes torchrun starts (not --overwrite:
    the launcher deletes the old checkpoint once, before any rank starts)."""
    out = ["--model", args.model, "--plan", args.plan, "--global-batch", str(args.global_batch),
           "--steps", str(args.steps), "--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank or 0),
           "--max-restarts", str(args.max_restarts), "--checkpoint-every", str(args.checkpoint_every),
           "--lr", repr(args.lr), "--seed", str(args.seed), "--pg-timeout", repr(args.pg_timeout),
           "--optimizer", getattr(args, "optimizer", "adamw"), "--grad-clip", repr(getattr(args, "grad_clip", 1.0))]
    for flag, val in (("--seq-len", args.seq_len), ("--packing", getattr(args, "packing", None)),
                      ("--nproc-per-node", args.nproc_per_node), ("--data", args.data),
                      ("--rdzv-endpoint", args.rdzv_endpoint), ("--checkpoint-dir", args.checkpoint_dir),
                      ("--metrics", args.metrics), ("--outer-lr", getattr(args, "outer_lr", None)),
                      ("--outer-momentum", getattr(args, "outer_momentum", None)),
                      ("--nodes-per-dc", getattr(args, "nodes_per_dc", None))):
        if val is not None:
            out += [flag, str(val)]
    out += ["--override"] if getattr(args, "override", False) else []  # the plan file's values were replaced
    if getattr(args, "replan_after", None) is not None:
        out += ["--replan-after", str(args.replan_after)]
    out += ["--switch"] if getattr(args, "switch", False) else []
    return out + (["--resume"] if args.resume else [])


def check_optimizer(args: argparse.Namespace, from_file: bool = False) -> None:
    """--optimizer (or the plan file's): default adamw; one the runtime does not run (lion, adam8bit:
    the planner prices them) is refused before anything starts."""
    from meshplan.spec.plan import RUNTIME_OPTIMIZERS
    if getattr(args, "optimizer", None) is None:
        args.optimizer = "adamw"
    if args.optimizer not in RUNTIME_OPTIMIZERS:
        where = " (the plan file's)" if from_file else ""
        raise MeshplanError(f"--optimizer {args.optimizer}{where}: meshplan train runs {', '.join(RUNTIME_OPTIMIZERS)} "
                            f"(torch's own) only; {args.optimizer} is planned and priced, not run",
                            hint="train with --optimizer adamw, sgd or adafactor (add --override with a plan file), "
                                 "or export the plan to a framework that has it (meshplan export)")


DEFAULT_MICROBATCHES = 2
"""Without --global-batch (and no plan file giving one): this many micro-batches per replica."""


def cmd_train(args: argparse.Namespace) -> int:
    """Run `meshplan train` (launcher, or one rank when started by torchrun)."""
    from meshplan.cli.planfile import resolve_into
    from meshplan.runtime import launch
    # --plan FILE: model, global batch and seq len from the file (written back into args for the workers);
    # a --seq-len distribution replaces the file's one length
    if args.seq_len is None:  # a plan file that records a length distribution (cli/lengths_arg.py writes it)
        from meshplan.cli.lengths_arg import file_lengths
        text, packing = file_lengths(args)
        if text is not None:
            args.seq_len = text
            if getattr(args, "packing", None) is None and packing is not None:
                args.packing = packing
    dist_text = args.seq_len if isinstance(args.seq_len, str) else None
    if dist_text is not None:
        args.seq_len = None
    inputs = resolve_into(args, fields=("model", "global_batch", "seq_len", "optimizer"), required=("model",),
                          quiet=launch.in_torchrun())
    check_optimizer(args, from_file=inputs.from_file("optimizer"))
    if dist_text is not None:
        args.seq_len = dist_text
    elif getattr(args, "packing", None) and not launch.in_torchrun():
        print(f"meshplan: note: --packing {args.packing} changes nothing with one --seq-len (every sample has "
              "the same length)", file=sys.stderr)
    if args.global_batch is None:
        from meshplan.spec.io import load_plan
        plan = load_plan(args.plan)
        args.global_batch = DEFAULT_MICROBATCHES * plan.dp * plan.micro_batch
        if not launch.in_torchrun():
            print(f"meshplan: note: --global-batch {args.global_batch} ({DEFAULT_MICROBATCHES} micro-batches of "
                  f"{plan.micro_batch} per data-parallel replica; give --global-batch to change it)", file=sys.stderr)
    from meshplan.spec.io import load_plan
    resolve_site(args, load_plan(args.plan), quiet=launch.in_torchrun())
    job = _job(args)
    if launch.in_torchrun():
        return launch.worker_main(job)
    return launch.launch(job, worker_argv(args))


if __name__ == "__main__":  # the torchrun workers: `python -m meshplan.cli.train_cmd ARGS` is `meshplan train ARGS`
    from meshplan.cli.main import main  # (with the CLI's one-line error handling)
    from meshplan.runtime.launch import exit_worker, in_torchrun, run_reporting_lost_peers
    _args = sys.argv[1:]
    _rc = run_reporting_lost_peers(main, _args if _args and _args[0] == "train" else ["train", *_args])
    if in_torchrun():
        exit_worker(int(_rc or 0))
    sys.exit(_rc)
