"""`meshplan plan`: search the plan space, rank it, explain the choice.

Importing this module is cheap (argparse only); the search is imported when the command runs.
Exit status: 0 with a plan; 2 with a one-line `meshplan: error: ...` on bad input or when no
plan is feasible (that line names the nearest feasible options, or, with --deadline, what
would meet it; --json still prints the document first).

Several cluster sizes (--gpus) are searched one at a time and merged (`search.result.merge`:
the same plans as one search of all sizes), so that progress names the size being searched,
every size without a feasible plan gets its own reason, and a deadline is exact.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from meshplan.errors import Infeasible, MeshplanError
from meshplan.spec.axes import AX

SEARCHABLE_FIX = (AX.TP, AX.PP, AX.CP, AX.EP, "zero", "micro_batch", "schedule", "recompute")  # (spec.axes: light)


def add_parser(sub: Any, positive_int: Any) -> None:
    """The `plan` subcommand's arguments (called from meshplan.cli.main.build_parser). A
    single-valued option given twice with different values, and --uneven-stages with
    --even-stages-only, are errors (`cli.args.Once`, `cli.args.ExclusiveTrue`)."""
    from meshplan.cli.args import ExclusiveFalse, ExclusiveTrue, Once, accept_negative_values
    pl = sub.add_parser(
        "plan", help="search for the fastest plan that fits, rank and explain it",
        description="Search every parallel plan for the model on the cluster, rank the feasible "
                    "ones (fastest first, or cheapest with --objective cost; ties: fewer GPUs, "
                    "less memory, then the plan string), explain the winner and every rejection.")
    accept_negative_values(pl)  # --train-tokens -5T: "must be positive", not "expected one argument"
    pl.add_argument("--model", required=True, action=Once,
                    help="preset name, ModelSpec .toml/.json, hf:CONFIG.json, module:pkg.mod:factory, "
                         "or a layer graph .json from `meshplan ingest --out`")
    pl.add_argument("--cluster", required=True, action=Once,
                    help="GPU:COUNT, GPU:NODESxPER_NODE or a cluster .toml; with --gpus, the GPU type "
                         "and links (e.g. h100-sxm-80gb)")
    pl.add_argument("--global-batch", type=positive_int("--global-batch"), required=True, action=Once,
                    help="sequences per step")
    from meshplan.cli.lengths_arg import SEQ_LEN_HELP, add_packing, seq_len_type
    pl.add_argument("--seq-len", type=seq_len_type, action=Once, help=SEQ_LEN_HELP)
    add_packing(pl, Once)
    from meshplan.cli.args import add_optimizer
    add_optimizer(pl, Once)
    pl.add_argument("--top", type=positive_int("--top"), default=5, action=Once, help="plans to show (default 5)")
    pl.add_argument("--json", action="store_true", help="one JSON object on stdout")
    from meshplan.cli.costing import add_cost_flags
    add_cost_flags(pl, policy=True)
    pl.add_argument("--out", action=Once, help="write the winning plan (with its predicted cost) to this .json file")
    pl.add_argument("--plot", action=Once,
                    help="draw the Pareto front (step time vs memory) to this image (.svg; others need matplotlib)")
    pl.add_argument("--gpus", action=Once,
                    help="search cluster sizes: LOW..HIGH (powers of two and 3x2^k in whole "
                         "nodes) or a list 64,128,256")
    pl.add_argument("--sync-methods", choices=["auto", "on", "off"], default="auto", action=Once,
                    help="search the weak-link sync methods (DiLoCo, local SGD, PowerSGD, bf16/fp8 gradient "
                         "compression): auto (default) on clusters with several datacenters or inter-node links "
                         "under 5 GB/s per GPU, on, or off")
    pl.add_argument("--objective", choices=["time", "cost", "time-to-target"], default=None, action=Once,
                    help="rank by step time (default), or by dollars (for the whole run with --train-tokens, "
                         "else per million tokens; the default with --deadline)")
    pl.add_argument("--train-tokens", action=Once,
                    help="report days and dollars to train this many tokens (e.g. 2T, 300B)")
    pl.add_argument("--deadline", metavar="DAYS", action=Once,
                    help="with --train-tokens: reject plans that take longer than DAYS days to train; the "
                         "cheapest plan that meets it wins")
    pl.add_argument("--price-per-gpu-hour", metavar="USD", action=Once,
                    help="US$ per GPU-hour for every dollar figure (default: the cluster file's "
                         "price_per_gpu_hour_usd, else the GPU preset's price)")
    pl.add_argument("--precision", choices=["bf16", "fp16", "fp8", "fp32"], default="bf16", action=Once,
                    help="matmul precision (default bf16; fp8 only when asked)")
    pl.add_argument("--compile", action="store_true", help="plans use torch.compile (fused elementwise ops)")
    pl.add_argument("--no-flash-attention", action="store_true",
                    help="unfused attention (no FlashAttention; meshplan's runtime does not run it: "
                         "needs --allow-export-only)")
    pl.add_argument("--fused-loss", action="store_true",
                    help="fused cross-entropy (meshplan's runtime does not run it: needs --allow-export-only)")
    pl.add_argument("--async-tp", action="store_true",
                    help="overlap TP communication (AsyncTP; an inductor pass, so it turns --compile on), "
                         "on the plans with tp > 1")
    pl.add_argument("--uneven-stages", action=ExclusiveTrue, default=None,
                    help="also try pipeline stages of unequal size where the layers do divide into the "
                         "stages (where they do not, uneven splits are always tried)")
    pl.add_argument("--even-stages-only", dest="uneven_stages", action=ExclusiveFalse,
                    help="never try uneven pipeline stages")
    pl.add_argument("--allow-export-only", action="store_true",
                    help="also list plans that meshplan's runtime would refuse or run differently but an "
                         "export target runs as planned, marked with the targets")
    pl.add_argument("--no-headroom", action="store_true",
                    help="accept plans that fit but are at risk of running out of memory (above --max-oom-risk, "
                         "or with less than --headroom GiB free); they are marked !")
    pl.add_argument("--fix", action=Once,
                    help="restrict the space: key=value[|value...],... over " + ", ".join(SEARCHABLE_FIX)
                         + ", mesh_order (placements, e.g. mesh_order=dp:pp:cp:tp|default)"
                         + ", offload (1: only plans that offload the optimizer, and with zero=3 the parameters "
                           "too; 0: none), sequence_parallel (0: off for every tp; 1: on where tp > 1, the "
                           "default) and any plan field the search does not choose (e.g. grad_sync, "
                           "p2p_sharded)")


# ---- inputs --------------------------------------------------------------------------------

def note(args: argparse.Namespace | None, text: str, stream: TextIO | None = None) -> None:
    """One line ``meshplan: note: ...`` on stderr (once), kept on ``args`` (``plan_notes``) so that
    the result's notes (`meshplan plan --json`) carry it too."""
    if args is not None:
        notes = getattr(args, "plan_notes", None)
        if notes is None:
            notes = []
            args.plan_notes = notes
        if text in notes:
            return
        notes.append(text)
    print(f"meshplan: note: {text}", file=stream if stream is not None else sys.stderr)


def search_space(args: argparse.Namespace, cluster: Any, model: Any = None) -> Any:
    """The SearchSpace of the plan options (--fix, --precision, ...) on ``cluster``."""
    from meshplan.search.space import SearchSpace
    from meshplan.spec.plan import Plan
    base: dict[str, Any] = {"precision": args.precision, "compile": args.compile,
                            "flash_attention": not args.no_flash_attention,
                            "fused_loss": args.fused_loss, "async_tp": args.async_tp}
    changes: dict[str, Any] = {"uneven_stages": args.uneven_stages,
                               "allow_export_only": getattr(args, "allow_export_only", False),
                               "headroom": not getattr(args, "no_headroom", False)}
    fixed: set[str] = set()
    if args.fix is not None:
        fixed = _apply_fix(args.fix, base, changes)
    if base["precision"] == "fp8" and "fp8" not in cluster.gpu.peak_tflops:
        raise MeshplanError(f"--precision fp8: {cluster.gpu.name} has no fp8 tensor cores",
                            hint="use --precision bf16, or an fp8 GPU such as h100-sxm-80gb")
    if base["async_tp"] and not base["compile"]:
        if "compile" in fixed:
            raise MeshplanError("--async-tp with --fix compile=0: async TP's overlap is an inductor "
                                "(torch.compile) pass, so it needs compile",
                                hint="drop compile=0 from --fix, or drop --async-tp")
        base["compile"] = True
        note(args, "--async-tp turns --compile on: the overlap of TP communication is an inductor "
                   "(torch.compile) pass, so every plan compiles its blocks")
    try:
        plan = Plan(**base)
    except TypeError as e:  # pragma: no cover - keys are checked in _apply_fix
        raise MeshplanError(f"--fix: {e}") from None
    from meshplan.search.space import SYNC_FIELDS
    sync_fixed = tuple((f, base[f]) for f in SYNC_FIELDS if f in fixed)
    methods = getattr(args, "sync_methods", "auto")
    space = SearchSpace(base=plan, **changes, fixed_sync=sync_fixed,
                        sync_methods=None if methods in (None, "auto") else methods == "on")
    check_runtime_runs(space, model)
    return space


RULE_FLAGS = {
    "unfused attention": ("--no-flash-attention", "drop --no-flash-attention"),
    "fused loss": ("--fused-loss", "drop --fused-loss"),
    "async TP without compile": ("--async-tp without compile", "add --compile"),
    "all-reduce gradient sync with sharding": ("--fix grad_sync=all-reduce", "fix zero=0 with it, or drop it"),
    "pipeline sends not as planned": ("--fix p2p_sharded", "drop p2p_sharded from --fix"),
    "optimizer offload without parameter offload": ("--fix offload=1 without zero=3", "fix zero=3 with offload=1"),
    "fp8 with tensor parallel": ("--precision fp8 with tp > 1", "use --precision bf16, or fix tp=1"),
    "context parallel on a traced model": ("--fix cp", "drop cp from --fix"),
    "selective recompute on a traced model": ("--fix recompute", "fix recompute=none|full"),
    "fp8 on a traced model": ("--precision fp8", "use --precision bf16"),
    "sequence parallel on a traced model": ("--fix sequence_parallel=1", "drop it from --fix"),
}
"""The option behind a runtime rule (spec.support.RULES) that every plan of a request may
violate, and how to drop it."""


def _probes(space: Any, model: Any = None) -> list[Any]:
    """Plans that stand for the space's corners as far as the runtime rules go (spec.support):
    tp and pp 1 and 2 (or the fixed values), dp 1 and 2, every ZeRO level and schedule allowed,
    sequence parallelism, pipeline sends and async TP as the enumeration sets them
    (search.space.mesh_sequence_parallel), and offload as fixed."""
    import itertools

    from meshplan.search.space import mesh_sequence_parallel, sequence_parallel_allowed
    sp_allowed = sequence_parallel_allowed(space, model)
    tps = sorted(set(space.tp)) if space.tp else [1, 2]
    pps = sorted(set(space.pp)) if space.pp else [1, 2]
    out = []
    for tp, pp, dp, z in itertools.product(tps, pps, (1, 2), space.zero):
        scheds = ["1f1b"] if pp == 1 else list(space.schedules)
        offs = ([(True, z == 3)] if z >= 1 or dp == 1 else []) if space.offload_only else [(False, False)]
        sp, sends = mesh_sequence_parallel(sp_allowed, tp, pp, bool(space.base.p2p_sharded))
        for sched, (oo, op) in itertools.product(scheds, offs):
            out.append(space.base.replace(
                tp=tp, pp=pp, dp=dp, zero=z, schedule=sched, virtual_stages=2 if sched == "zbv" else 1,
                sequence_parallel=sp, p2p_sharded=sends,
                async_tp=space.base.async_tp and tp > 1, offload_optimizer=oo, offload_params=op))
    # the fixed cp, ep and recompute (else their neutral values)
    out = [p.replace(cp=cp, ep=ep, recompute=rc) for p in out for cp in (space.cp or (1,))
           for ep in (space.ep or (1,)) for rc in (space.recompute if len(space.recompute) < 4 else ("none",))]
    return out


def check_runtime_runs(space: Any, model: Any = None) -> None:
    """Before the search: when the request's fixed options make every plan one that meshplan's
    runtime refuses or runs as something else (spec.support.RULES: --fused-loss,
    --no-flash-attention, ...), one line naming the option and the way out
    (--allow-export-only, with the export targets that run it), rather than a search that
    rejects everything."""
    from meshplan.spec.support import RULES
    probes = _probes(space, model)
    if not probes:
        return
    micro = 1 << 20  # as many micro-batches as any schedule needs: the batch is not known here
    for rule in RULES.values():
        if space.allow_export_only and rule.targets or rule.name == "kv heads replicated under tensor parallel":
            continue  # (a fixed tp beyond the kv heads: the search names it, after tp's own checks)
        reasons = [rule.why(p, micro, model) for p in probes]
        if not all(reasons):
            continue
        flag, remedy = RULE_FLAGS.get(rule.name, (f"the options given ({rule.name})", "relax them"))
        if rule.name == "fp8 with tensor parallel" and space.tp:
            flag = "--precision fp8 with --fix tp=" + "|".join(map(str, space.tp))
        why = str(reasons[0]).split(": ", 1)[-1]
        verb = "refuses it" if rule.kind == "refused" else "does not run it as planned"
        if rule.targets:
            hint = (f"--allow-export-only lists the plans an export target runs as planned: "
                    f"{', '.join(rule.targets)}; or {remedy}")
        else:
            hint = f"no export target runs it either; {remedy}"
        raise MeshplanError(f"{flag}: meshplan's runtime {verb}: {why}; every plan would be rejected", hint=hint)


def _apply_fix(text: str, base: dict[str, Any], changes: dict[str, Any]) -> set[str]:
    """Parse --fix into base plan fields and search-space restrictions; the keys given."""
    from meshplan.search.space import SEARCHED
    from meshplan.spec.base import coerce
    from meshplan.spec.plan import Plan
    hints = Plan.flat_hints()
    fields = set(hints)
    seen: set[str] = set()
    fixable = "fixable: " + ", ".join(SEARCHABLE_FIX) + ", offload, sequence_parallel, mesh_order (placement), " \
              "site_order, and the fields the search " \
              "does not choose (precision, compile, flash_attention, fused_loss, grad_sync, p2p_sharded, async_tp)"
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise MeshplanError("--fix is empty", hint="give key=value[|value...],..., e.g. --fix tp=8,zero=1|3; or drop it")
    if not all(parts):
        raise MeshplanError(f"--fix {text}: an empty item (two commas, or a comma at an end)",
                            hint="e.g. --fix tp=8,zero=1|3")
    for part in parts:
        if "=" not in part:
            raise MeshplanError(f"--fix: {part!r} is not key=value", hint="e.g. --fix tp=8,zero=1|3")
        key, value = (s.strip() for s in part.split("=", 1))
        key = {"placement": "mesh_order", "order": "mesh_order"}.get(key, key)
        alts = [v.strip() for v in value.split("|") if v.strip()]
        if not alts:
            raise MeshplanError(f"--fix: {key} has no value")
        if key in seen:
            raise MeshplanError(f"--fix: {key} given twice", hint=f"list alternatives as {key}=a|b")
        seen.add(key)
        if key in SEARCHABLE_FIX[:6]:  # the integer degrees and sizes
            changes[key] = tuple(coerce(v, int, f"--fix {key}") for v in alts)
        elif key == "schedule":
            changes["schedules"] = tuple(alts)
        elif key == "recompute":
            changes["recompute"] = tuple(alts)
            changes["recompute_fractions"] = ()
        elif key == "mesh_order":  # the placements to try (spec.axes.parse_order; 'default' = pp:dp:cp:tp)
            from meshplan.spec.axes import parse_order
            changes["placements"] = tuple(dict.fromkeys(
                None if v.lower() == "default" else parse_order(v, "--fix mesh_order") for v in alts))
        elif key == "site_order":  # the one order of the sites the pipeline visits (spec.axes.parse_sites)
            from meshplan.spec.axes import parse_sites
            if len(alts) > 1:
                raise MeshplanError("--fix site_order: give one order (the search tries the others itself on "
                                    "clusters of three or more sites)", hint="e.g. --fix site_order=1:0:2")
            base[key] = parse_sites(alts[0], "--fix site_order")
        elif key == "offload":
            vals = {bool(coerce(v, bool, "--fix offload")) for v in alts}
            if vals == {True}:  # only the offload variants
                changes["offload"], changes["offload_only"] = True, True
            elif vals == {False}:
                changes["offload"] = False
        elif key == "sequence_parallel":
            vals = {bool(coerce(v, bool, "--fix sequence_parallel")) for v in alts}
            if vals == {False}:
                changes["sequence_parallel"] = False
        elif key in fields and key not in SEARCHED:
            vals = [coerce(v, hints[key], f"--fix {key}") for v in alts]
            if len(set(vals)) > 1:
                raise MeshplanError(f"--fix {key}: give one value ({key} is not searched, so there are no "
                                    "alternatives to choose from)", hint=f"e.g. --fix {key}={alts[0]}")
            base[key] = vals[0]
        elif key in fields:
            raise MeshplanError(f"--fix: {key} cannot be fixed (it follows from the others)", hint=fixable)
        else:
            raise MeshplanError(f"--fix: unknown key {key!r}", hint=fixable)
    if changes.get("sequence_parallel") is False and "p2p_sharded" not in seen:
        # the runtime's pipeline sends carry the sequence-parallel shard exactly when sequence_parallel=1
        base["p2p_sharded"] = False
    return seen


def cluster_sizes(args: argparse.Namespace) -> list[Any]:
    """--cluster, at each size of --gpus (if given), at --price-per-gpu-hour (if given). On a
    cluster of several pools a size is a budget of GPUs in all, taken fastest pool first
    (search.sizes.resized; sizes above the GPUs the pools hold are left out, with a note)."""
    from meshplan.search.sizes import node_size, parse_gpus, resized
    from meshplan.spec.io import load_cluster
    cluster = with_price(load_cluster(args.cluster), getattr(args, "price_per_gpu_hour", None))
    if args.gpus is None:
        return [cluster]
    sizes = parse_gpus(args.gpus, node_size(cluster))
    if len(cluster.pools) > 1:  # a budget over the GPUs the pools hold
        held = sum(p.num_gpus for p in cluster.pools)
        over = [n for n in sizes if n > held]
        sizes = [n for n in sizes if n <= held]
        if not sizes:
            raise MeshplanError(f"--gpus {args.gpus}: the pools of {cluster.name} hold {held:,} GPUs in all",
                                hint=f"give sizes up to {held}, e.g. --gpus {node_size(cluster)}..{held}")
        if over:
            note(args, f"--gpus {args.gpus}: the pools of {cluster.name} hold {held:,} GPUs in all: "
                       f"{', '.join(map(str, over))} left out")
        from meshplan.search.pools import budget_pools
        for n in sizes:  # a budget takes whole nodes (or a divisor of one), fastest pool first
            if not budget_pools(cluster.replace(max_gpus=n)):
                nodes = sorted({p.gpus_per_node for p in cluster.pools}, reverse=True)
                node = " or ".join(map(str, nodes))
                part = sorted({d for g in nodes for d in range(1, g) if g % d == 0})
                raise MeshplanError(f"--gpus {args.gpus}: {n} GPUs is not a whole number of the pools' {node}-GPU "
                                    f"nodes, nor a divisor of one node (a budget takes whole nodes, fastest pool "
                                    "first)", hint=f"e.g. --gpus {nodes[-1]}, or part of one node: "
                                                   + ", ".join(map(str, part)))
    text = str(args.cluster)
    name, colon, count = text.partition(":")
    if colon and count and not text.lower().endswith((".toml", ".json")):
        note(args, f"--gpus {args.gpus} sets the cluster sizes: the count in --cluster {text} is not used "
                   f"(give the GPU type alone, e.g. --cluster {name})")
    return [resized(cluster, n) for n in sizes]


def price_per_gpu_hour(text: str | None) -> float | None:
    """--price-per-gpu-hour as a number (None when not given)."""
    if text is None:
        return None
    try:
        v = float(text.strip().lstrip("$"))
    except ValueError:
        raise MeshplanError(f"--price-per-gpu-hour {text!r}: expected US$ per GPU-hour, e.g. 2.5, or POOL=USD "
                            "pairs on a cluster of several pools, e.g. h100=4,a100=2") from None
    if not 0 <= v < float("inf"):
        raise MeshplanError(f"--price-per-gpu-hour must be zero or positive; got {text!r}")
    return v


def with_price(cluster: Any, text: str | None) -> Any:
    """``cluster`` at --price-per-gpu-hour: one price for every GPU (every pool's), or, on a cluster
    of several pools, POOL=USD pairs (the pools not named keep their price)."""
    if text is None:
        return cluster
    if "=" not in text:
        price = price_per_gpu_hour(text)
        if len(cluster.pools) == 1:
            return cluster.replace(price_per_gpu_hour_usd=price)
        return cluster.replace(pools=tuple(p.replace(price_per_gpu_hour_usd=price) for p in cluster.pools))
    if len(cluster.pools) == 1:
        raise MeshplanError(f"--price-per-gpu-hour {text!r}: POOL=USD pairs are for a cluster of several pools; "
                            f"{cluster.name} has one GPU type", hint="give one price, e.g. --price-per-gpu-hour 2.5")
    prices: dict[str, float] = {}
    for part in (x.strip() for x in text.split(",") if x.strip()):
        name, _, usd = (y.strip() for y in part.partition("="))
        if name not in cluster.names:
            raise MeshplanError(f"--price-per-gpu-hour {text!r}: {cluster.name} has no pool {name!r}",
                                hint=f"its pools: {', '.join(cluster.names)}")
        if name in prices:
            raise MeshplanError(f"--price-per-gpu-hour {text!r}: pool {name} priced twice")
        prices[name] = price_per_gpu_hour(usd)  # type: ignore[assignment]
    return cluster.replace(pools=tuple(p.replace(price_per_gpu_hour_usd=prices[p.name]) if p.name in prices else p
                                       for p in cluster.pools))


def price_source(args: argparse.Namespace, cluster: Any) -> str:
    """Where the price per GPU-hour of ``cluster`` (from `cluster_sizes`) comes from."""
    if getattr(args, "price_per_gpu_hour", None) is not None:
        return "--price-per-gpu-hour"
    if cluster.price_per_gpu_hour_usd is not None:
        return f"cluster {args.cluster} (price_per_gpu_hour_usd)"
    from meshplan.spec.io import load_gpu, preset_names
    g = cluster.gpu
    if g.name in preset_names("gpus") and load_gpu(g.name).price_per_hour_usd == g.price_per_hour_usd:
        return f"GPU preset {g.name}"
    return f"the GPU spec of {args.cluster}"


def deadline_days(args: argparse.Namespace, tokens: float | None) -> float | None:
    """--deadline in days (None when not given); it needs --train-tokens."""
    text = getattr(args, "deadline", None)
    if text is None:
        return None
    if getattr(args, "command", "plan") not in (None, "plan"):
        raise MeshplanError(f"--deadline is not supported by `meshplan {args.command}`",
                            hint="use meshplan plan --deadline")
    try:
        v = float(text.strip().removesuffix("d").removesuffix("days").strip())
    except ValueError:
        raise MeshplanError(f"--deadline {text!r}: expected a number of days, e.g. 90") from None
    if not 0 < v < float("inf"):
        raise MeshplanError(f"--deadline must be a positive number of days; got {text!r}")
    if tokens is None:
        raise MeshplanError("--deadline needs --train-tokens (how many tokens to train within it)",
                            hint=f"e.g. --train-tokens 2T --deadline {text}")
    return v


def train_tokens(text: str | None) -> float | None:
    """--train-tokens as a number (None when not given)."""
    if text is None:
        return None
    from meshplan.units import parse_count
    try:
        v = parse_count(text)
    except ValueError:
        raise MeshplanError(f"--train-tokens {text!r}: expected a count like 2T, 300B or 1.5e12") from None
    if not v > 0 or v == float("inf"):
        raise MeshplanError(f"--train-tokens must be positive; got {text!r}")
    return v


def problem(args: argparse.Namespace) -> tuple[Any, list[Any], float | None, Any, Any]:
    """(model, clusters, train tokens, space, workload) of the search options (`meshplan plan` and
    `meshplan report`): the model as a LayerGraph (cli.model_arg.as_problem), whatever it was
    given as."""
    from meshplan.cli.costing import costing
    from meshplan.cli.model_arg import as_problem, load_model_arg
    cost = costing(args)
    clusters = [cost.cluster(c) for c in cluster_sizes(args)]
    tokens = train_tokens(args.train_tokens)
    deadline = deadline_days(args, tokens)
    from meshplan.cli.lengths_arg import lengths_of
    lengths = lengths_of(args)  # --seq-len as a distribution: plans ranked by the expected step (cost.lengths)
    seq = args.seq_len if lengths is None else lengths.max_len
    model, work = as_problem(load_model_arg(args.model, seq_len=seq), args.global_batch, seq, lengths,
                             getattr(args, "optimizer", None))
    if model.model is not None:
        check_positions(args, model.model, work.seq_len)
    space = search_space(args, clusters[0].pools[0], model)
    space = _without_idle_selective(args, space, model, work, cost.params)
    if args.objective is None:  # by time (to a target, where sync methods trade tokens for time), or by
        # dollars under a deadline
        from meshplan.search.space import base_sync, sync_options
        weak = any(sync_options(p, space) != [base_sync(space.base)] for c in clusters for p in c.pools)
        args.objective = "cost" if deadline is not None else ("time-to-target" if weak else "time")
    return model, clusters, tokens, space, work


SELECTIVE_LEFT_OUT = ("recompute=selective (Megatron's: the attention core) is not searched: with flash attention it "
                      "recomputes the core's forward and saves no memory, so recompute=none beats it; torchtitan's "
                      "'selective' (op-level SAC) is recompute=op (docs/cost-model.md)")


def _without_idle_selective(args: argparse.Namespace, space: Any, model: Any, work: Any, params: Any) -> Any:
    """The space without recompute=selective where it keeps what recompute=none keeps (flash attention,
    no fp8: cost.activations.selective_saves_nothing), so that no plan pays its recompute for nothing;
    a --fix that names selective keeps it (estimate notes what it costs)."""
    import dataclasses

    from meshplan.cost.activations import selective_saves_nothing
    from meshplan.spec.plan import RECOMPUTE
    if "selective" not in space.recompute or len(space.recompute) < len(RECOMPUTE):  # fixed by --fix
        return space
    if not selective_saves_nothing(model, space.base, params, work.seq_len):
        return space
    notes = getattr(args, "plan_notes", None)  # in the result's notes (--json) and a line of the text: not on
    if notes is None:                            # stderr, which a plan's one-line refusals keep to themselves
        notes = args.plan_notes = []
    notes.append(SELECTIVE_LEFT_OUT)
    return dataclasses.replace(space, recompute=tuple(r for r in space.recompute if r != "selective"))


def check_positions(args: argparse.Namespace | None, model: Any, seq_len: int) -> None:
    """A sequence longer than the model's positions: an error for a learned position table
    (there is no row for position max_position_embeddings), a note for rotary and ALiBi
    positions (they extend, but past the context the model was trained on)."""
    if model.position == "learned" and model.max_position_embeddings is not None \
            and seq_len > model.max_position_embeddings:
        n = model.max_position_embeddings
        raise MeshplanError(f"--seq-len {seq_len} exceeds the {n:,} positions of {model.name} (learned position "
                            "embeddings have no row past them)",
                            hint=f"use --seq-len <= {n}, or a model file with a larger max_position_embeddings")
    trained = model.max_position_embeddings or model.seq_len
    if model.position in ("rotary", "alibi") and seq_len > trained:
        note(args, f"--seq-len {seq_len:,} exceeds {model.name}'s trained context ({trained:,} tokens); "
                   f"priced for {seq_len:,}-token sequences as asked (the model may not train well past its context)")


def check_gpus(model: Any, cluster: Any, work: Any, space: Any) -> None:
    """More GPUs than any plan can use (`search.space.most_gpus`): one line with the most the
    global batch, heads, layers and sequence allow, and a size to try. (A cluster of several
    pools is not checked: its plans may use part of it, e.g. one pool alone.)"""
    from meshplan.search.sizes import nice_sizes, node_size
    from meshplan.search.space import most_gpus
    from meshplan.spec.axes import AX
    if len(cluster.pools) > 1:
        return
    most, d = most_gpus(model, cluster, work, space)
    n = cluster.num_gpus
    if n <= most:
        return
    per_seq = min(most, d[AX.DP] * d[AX.TP])
    sizes = nice_sizes(1, per_seq, node_size(cluster)) or [per_seq]
    try_n = sizes[-1]
    shape = ""
    if try_n % d[AX.TP] == 0 and d[AX.DP] % (try_n // d[AX.TP]) == 0:
        k = d[AX.DP] // (try_n // d[AX.TP])
        shape = f" (tp={d[AX.TP]} x dp={try_n // d[AX.TP]}, {k} sequence{'' if k == 1 else 's'} per replica)"
    from meshplan.spec.capabilities import capabilities
    caps = capabilities(model)
    heads = f"{caps.heads[0][0]} heads, " if caps.heads else ""
    raise MeshplanError(
        f"a global batch of {work.global_batch} cannot use {n:,} GPUs: with {model.name}'s "
        f"{heads}{caps.blocks} layers and {work.seq_len:,}-token sequences a plan "
        f"uses at most {most:,} (tp {d[AX.TP]} x cp {d[AX.CP]} x pp {d[AX.PP]} x dp {d[AX.DP]}, one sequence per "
        "data-parallel replica)",
        hint=f"use fewer GPUs, e.g. --cluster {cluster.gpu.name}:{try_n}{shape} or --gpus "
             f"{min(try_n, node_size(cluster))}..{try_n}; or raise --global-batch")


# ---- progress ------------------------------------------------------------------------------

PROGRESS_DELAY_S = 0.5
"""Progress appears once the command has run this long (so every step over 2 s shows it)."""


class Progress:
    """One status line on a terminal's stderr, shown once the command has run ``delay_s``:
    the current step (`step`: what is being done, e.g. the cluster size being searched) and,
    while a search prices plans (the instance is the search's ``progress`` callback), a bar.

    A step without a callback is shown too: at once when ``delay_s`` has passed, else by a
    timer when it has (so a long step never runs silently). ``close`` clears the line."""

    def __init__(self, stream: TextIO, delay_s: float | None = None, width: int = 20,
                 columns: int | None = None) -> None:
        import shutil
        self.stream, self.width = stream, width
        self.delay_s = PROGRESS_DELAY_S if delay_s is None else delay_s
        # the line is cut to the terminal's width: a wrapped line could not be redrawn in place
        self.columns = columns or shutil.get_terminal_size((100, 24)).columns
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False
        self.label = "searching"
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._len = 0
        self._closed = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.t0 < self.delay_s or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * self.width)
        self._write(f"{self.label} [{bar:<{self.width}}] {100 * frac:3.0f}% {done:,}/{total:,} plans that pass "
                    "the constraints")

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[Progress]:
        """Show ``label`` for the duration of a step (the bar, if any, follows it)."""
        self._cancel()
        self.label, self.last = label, 0.0
        wait = self.delay_s - (time.perf_counter() - self.t0)
        if wait <= 0:
            self._write(f"{label} ...")
        else:
            self._timer = threading.Timer(wait, self._write, (f"{label} ...",))
            self._timer.daemon = True
            self._timer.start()
        try:
            yield self
        finally:
            self._cancel()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _write(self, text: str) -> None:
        text = text[:max(10, self.columns - 1)]
        with self._lock:
            if self._closed:
                return
            self.stream.write("\r" + text + " " * max(0, self._len - len(text)))
            self.stream.flush()
            self._len = len(text)
            self.shown = True

    def close(self) -> None:
        self._cancel()
        with self._lock:
            if self.shown and not self._closed:
                self.stream.write("\r" + " " * self._len + "\r")
                self.stream.flush()
            self._closed = True


def progress_bar() -> Progress | None:
    """A Progress on stderr when it is a terminal (None otherwise: logs stay clean)."""
    return Progress(sys.stderr) if sys.stderr.isatty() else None


def _step(progress: Progress | None, label: str) -> contextlib.AbstractContextManager[Any]:
    return progress.step(label) if progress is not None else contextlib.nullcontext()


# ---- the search, one cluster size at a time ------------------------------------------------

def search_sizes(model: Any, clusters: list[Any], work: Any, space: Any, *, objective: str, top: int,
                 tokens: float | None = None, deadline: float | None = None,
                 progress: Progress | None = None, params: Any = None) -> Any:
    """Search each cluster size alone (progress names it), reject the plans over ``deadline``
    days, give each size without a feasible plan its reason, and merge (`search.result`)."""
    import dataclasses

    from meshplan.search.explain import size_reason
    from meshplan.search.result import empty_result, merge
    one = _searcher(model, work, space, objective, top, tokens, deadline, progress, params)
    results, errors = [], []
    for i, c in enumerate(clusters):
        label = (f"searching {c.num_gpus:,} GPU{'' if c.num_gpus == 1 else 's'}"
                 + (f" ({i + 1}/{len(clusters)})" if len(clusters) > 1 else ""))
        with _step(progress, label):
            try:
                r = one(c)
            except MeshplanError as e:  # e.g. no mesh of a --fix-restricted space makes this size
                if len(clusters) == 1:
                    raise
                errors.append(e)
                r = empty_result(model, c, work, objective, str(e))
        if r.feasible == 0 and r.per_cluster and r.per_cluster[0].reason is None:
            r.per_cluster = [dataclasses.replace(r.per_cluster[0], reason=size_reason(r))]
        results.append(r)
    if len(errors) == len(clusters):
        raise errors[0]
    if all(r.pooled for r in results):  # GPU budgets of one cluster of pools: explained from the merged plans
        from meshplan.search.pools import merge_budgets
        result = merge_budgets(results, top)
    else:
        result = merge(results, top)
    result.train_tokens, result.deadline_days = tokens, deadline
    return result


def _searcher(model: Any, work: Any, space: Any, objective: str, top: int, tokens: float | None,
              deadline: float | None, progress: Progress | None, params: Any = None) -> Callable[[Any], Any]:
    """cluster -> SearchResult of that one size (the deadline applied)."""
    from meshplan.cost.params import DEFAULT_PARAMS
    from meshplan.search import search

    def one(cluster: Any) -> Any:
        check_gpus(model, cluster, work, space)
        r = search(model, cluster, work, space, objective=objective, top=top, progress=progress,
                   params=DEFAULT_PARAMS if params is None else params,
                   deadline=(tokens, deadline) if deadline is not None and tokens is not None else None)
        r.train_tokens = tokens
        return r
    return one


MAX_DEADLINE_SIZES = 4
"""Larger cluster sizes tried to find one that meets a deadline the searched sizes miss."""


def deadline_miss(result: Any, model: Any, work: Any, space: Any, *, objective: str,
                  progress: Progress | None = None, params: Any = None) -> dict[str, Any] | None:
    """When plans fit but none meets the deadline: the fastest plan's days, and the smallest
    larger cluster (of the usual sizes, from the ideal-scaling estimate up) whose best plan
    meets it (None when something other than the deadline rules every plan out)."""
    from meshplan.search.result import train_days
    from meshplan.search.sizes import MAX_GPUS, nice_sizes, node_size, resized
    f, tokens, deadline = result.fastest, result.train_tokens, result.deadline_days
    if deadline is None or tokens is None or result.plans or f is None:
        return None
    days = float(train_days(f.step_time_s, work.tokens, tokens))
    out: dict[str, Any] = {"deadline_days": deadline, "fastest": {
        "plan": f.plan.short(), "num_gpus": f.plan.num_gpus, "days": days,
        "usd": f.usd_per_mtok * tokens / 1e6}}
    largest = max(result.clusters, key=lambda c: c.num_gpus)
    ideal = math.ceil(f.plan.num_gpus * days / deadline)
    out["ideal_scaling_gpus"] = ideal
    hi = min(largest.num_gpus * 64, MAX_GPUS)
    sizes = nice_sizes(max(ideal, largest.num_gpus + 1), hi, node_size(largest))[:MAX_DEADLINE_SIZES]
    one = _searcher(model, work, space, objective, 1, tokens, deadline, progress, params)
    out["tried"] = []
    for n in sizes:
        with _step(progress, f"{deadline:g}-day deadline: trying {n:,} GPUs"):
            try:
                r = one(resized(largest, n))
            except MeshplanError:
                continue
        fastest = r.best or r.fastest
        tried = {"num_gpus": n, "days": None}
        if fastest is not None:
            st = fastest.report.step_time_s if r.best is not None else fastest.step_time_s
            tried["days"] = float(train_days(st, work.tokens, tokens))
        out["tried"].append(tried)
        if r.best is not None:
            b = r.best
            out["meets"] = {"num_gpus": n, "plan": b.plan.short(), "days": tried["days"],
                            "usd": b.usd_per_mtok * tokens / 1e6}
            break
    return out


def deadline_message(result: Any, miss: dict[str, Any]) -> str:
    """The one-line error when no plan meets the deadline: what the fastest plan takes and
    how many GPUs would be needed."""
    from meshplan.search.explain import usd
    from meshplan.search.result import token_count
    sizes = sorted({c.num_gpus for c in result.clusters})
    where = f"{sizes[0]:,}" + (f"..{sizes[-1]:,}" if len(sizes) > 1 else "")
    f = miss["fastest"]
    head = (f"no plan trains {token_count(result.train_tokens)} tokens of {result.model.name} within "
            f"{miss['deadline_days']:g} days on {where} x {result.clusters[0].gpu.name}: the fastest, "
            f"{f['plan']} on {f['num_gpus']:,} GPUs, takes {f['days']:,.1f} days")
    if "meets" in miss:
        m = miss["meets"]
        return (f"{head}; about {m['num_gpus']:,} GPUs would meet it: {m['plan']} takes {m['days']:,.1f} days "
                f"({usd(m['usd'])}; search them with --gpus {sizes[0]}..{m['num_gpus']})")
    tried = [t for t in miss["tried"] if t["days"] is not None]
    if tried:
        best = min(tried, key=lambda t: t["days"])
        return (f"{head}; ideal scaling needs at least {miss['ideal_scaling_gpus']:,} GPUs, and no size "
                f"tried up to {miss['tried'][-1]['num_gpus']:,} meets it (best: {best['days']:,.1f} days on "
                f"{best['num_gpus']:,} GPUs); raise --deadline or train fewer tokens")
    return (f"{head}; it would need at least {miss['ideal_scaling_gpus']:,} GPUs at ideal scaling; raise "
            "--deadline or train fewer tokens")


# ---- output --------------------------------------------------------------------------------

def train_cost(tokens: float | None, plan: Any) -> dict[str, float] | None:
    """Days and dollars for a ranked plan to train ``tokens`` tokens (None without --train-tokens)."""
    if tokens is None:
        return None
    seconds = tokens / plan.report.tokens_per_s
    usd = plan.plan.num_gpus * plan.cluster.price_per_hour * seconds / 3600
    return {"tokens": tokens, "days": seconds / 86400, "usd": usd}


def _table(result: Any, tokens: float | None) -> str:
    """The top plans; with the cost objective the dollars come first (the ranking's order)."""
    from meshplan.cli.format import seconds, table
    from meshplan.cost.params import DEFAULT_PARAMS
    from meshplan.search.explain import AT_RISK_MARK
    multi = len(result.clusters) > 1
    risky = any(p.report.at_risk for p in result.plans)
    cols: list[tuple[str, str, Callable[[Any, Any], object]]] = [  # (head, align, cell)
        ("step time", "r", lambda p, t: seconds(p.report.step_time_s)),
        ("tokens/s", "r", lambda p, t: f"{p.report.tokens_per_s:,.0f}"),
        ("MFU", "r", lambda p, t: f"{100 * p.report.mfu:.1f}%"),
        ("peak GiB", "r", lambda p, t: f"{p.report.peak_memory_gib:.1f}"
         + (AT_RISK_MARK if p.report.at_risk else " " if risky else "")),
        ("P(OOM)", "r", lambda p, t: f"{100 * p.report.oom_probability:.1f}%"),
        ("$/M tok", "r", lambda p, t: f"{p.usd_per_mtok:.3f}"),
        ("dominant", "l", lambda p, t: p.report.dominant)]
    if result.other_objective is not None or result.objective == "time-to-target":
        cols.insert(1, ("to target", "r", lambda p, t: seconds(p.report.time_to_target_s)))
        cols.insert(2, ("tokens x", "r", lambda p, t: f"{p.report.token_factor:.2f}"))
    if any(c.num_dcs > 1 for c in result.clusters):
        cols.insert(3, ("x-site GB", "r", lambda p, t: f"{p.report.cross_site_gb:,.2f}"))
    if tokens is not None:
        cols += [("days", "r", lambda p, t: f"{t['days']:,.1f}"), ("$ to train", "r", lambda p, t: f"{t['usd']:,.0f}")]
    if result.objective == "cost":  # dollars first, then days and step time
        order = ["$ to train", "$/M tok", "days", "step time", "to target", "tokens x", "x-site GB", "tokens/s", "MFU",
                 "peak GiB", "P(OOM)", "dominant"]
        cols.sort(key=lambda c: order.index(c[0]))
    head = ["#", "plan"] + (["GPUs"] if multi else []) + [c[0] for c in cols]
    align = "rl" + ("r" if multi else "") + "".join(c[1] for c in cols)
    rows = []
    for p in result.plans:
        t = train_cost(tokens, p)
        name = p.plan.short() + ("" if p.export_only is None else
                                 f"  [export only: {', '.join(p.export_only)}]")
        rows.append([p.rank, name] + ([p.plan.num_gpus] if multi else []) + [c[2](p, t) for c in cols])
    text = table(head, rows, align)
    if max(len(line) for line in text.splitlines()) > TABLE_WIDTH:  # long plan strings: tokens/s is in --json
        k = head.index("tokens/s")
        head, align = head[:k] + head[k + 1:], align[:k] + align[k + 1:]
        text = table(head, [r[:k] + r[k + 1:] for r in rows], align)
    text += "\n" + band_line(result)
    if risky:
        from meshplan.search.explain import at_risk_words
        text += f"\n{AT_RISK_MARK} {at_risk_words(result.params or DEFAULT_PARAMS)} (accepted by --no-headroom)"
    return text


TABLE_WIDTH = 200
"""The plan table drops its tokens/s column when it would be wider (plan strings of huge models)."""


def _band(lo_hi: tuple[int, int]) -> str:
    return f"{lo_hi[0]:+d}%/{lo_hi[1]:+d}%"


def _ranks(ranks: list[int]) -> str:
    """'#1', '#1-#3, #5': the plans of the table a band belongs to."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"#{x[0]}" if len(x) == 1 else f"#{x[0]}-#{x[-1]}" for x in runs)


def band_line(result: Any) -> str:
    """How sure the table is: the step-time band of the plans shown and what P(OOM) is."""
    from meshplan.cost.params import DEFAULT_PARAMS
    from meshplan.cost.uncertainty import memory_policy_words
    ranks: dict[tuple[int, int], list[int]] = {}  # each band, with the plans (their # in the table) it belongs to
    for i, p in enumerate(result.plans):
        key = (round(100 * (p.report.step_time_s_low / p.report.step_time_s - 1)),
               round(100 * (p.report.step_time_s_high / p.report.step_time_s - 1)))
        ranks.setdefault(key, []).append(getattr(p, "rank", 0) or i + 1)
    if len(ranks) == 1:
        band = f"{_band(next(iter(ranks)))} for every plan shown"
    else:  # the band widens with the pipeline depth (cost.uncertainty.step_band): say whose each is
        band = "; ".join(f"{_band(k)} for {_ranks(v)}" for k, v in sorted(ranks.items(), key=lambda kv: kv[1][0]))
    policy = memory_policy_words(result.params or DEFAULT_PARAMS, result.headroom)
    mfu = ""
    prec = result.plans[0].plan.precision if result.plans else "bf16"
    if prec in ("fp32", "fp16") and result.clusters:  # not the usual bf16 basis: say which peak MFU divides by
        from meshplan.cli.views import mfu_basis_words
        mfu = f"\nMFU: model FLOP/s over {mfu_basis_words(result.clusters[0].gpu, prec)}"
    return (f"step time within {band} (90%); P(OOM): chance of running out of memory; both from the cost model's "
            f"out-of-sample errors\n{policy}{mfu}")


SMALL_BATCH_TOKENS = 8192
"""Tokens per GPU per step below which `plan` says the batch is small for the cluster (at most a
few sequences each: the GEMMs thin out and communication is no longer hidden)."""
LOW_MFU = 0.25


def _small_batch_note(args: argparse.Namespace, result: Any, work: Any) -> None:
    """One cluster size whose best plan is slow because the batch is small for it: say so, and
    that --gpus searches smaller sizes."""
    if len(result.clusters) != 1 or result.best is None or result.best.report.mfu >= LOW_MFU:
        return
    n = result.clusters[0].num_gpus
    per_gpu = work.tokens / n
    if per_gpu >= SMALL_BATCH_TOKENS or n < 16:
        return
    note(args, f"the global batch gives each of the {n:,} GPUs {per_gpu:,.0f} tokens a step (the best plan reaches "
               f"MFU {100 * result.best.report.mfu:.1f}%): fewer GPUs waste less; `--gpus 8..{n}` searches the "
               "sizes (or raise --global-batch)")


def _check_policy(args: argparse.Namespace, clusters: list[Any], params: Any) -> None:
    """--headroom that no plan can leave, or --headroom/--max-oom-risk with --no-headroom."""
    from meshplan.cost.memory import usable_gib
    if getattr(args, "no_headroom", False) and (getattr(args, "headroom", None) is not None
                                                or getattr(args, "max_oom_risk", None) is not None):
        raise MeshplanError("--no-headroom accepts every plan that fits, so --headroom/--max-oom-risk would do nothing",
                            hint="give --no-headroom, or the policy (--max-oom-risk P, --headroom GiB), not both")
    usable = max(usable_gib(p, params) for c in clusters for p in c.pools)
    if params.headroom_gib >= usable:
        raise MeshplanError(f"--headroom {params.headroom_gib:g} GiB: a GPU here has only {usable:.1f} GiB usable, so "
                            "no plan can leave that much free", hint=f"give --headroom below {usable:.0f}")


def _per_size(result: Any, tokens: float | None) -> list[str]:
    """One line per cluster size: its best plan, or the main reason it has none (on pools a size
    is a budget of GPUs in all: the winner's is the size whose best plan it is)."""
    from meshplan.search.explain import usd
    from meshplan.search.result import train_days
    lines = ["best per cluster size:"]
    win = result.best.plan.num_gpus if result.best is not None else None
    if result.best_pooled is not None:
        b = result.best_pooled
        win = next((c.num_gpus for c in result.per_cluster if (c.best_step_time_s, c.best_usd_per_mtok)
                    == (b.step_time_s, b.usd_per_m_tokens)), None)
    for pc in result.per_cluster:
        n = f"  {pc.num_gpus:>6,} GPU{'' if pc.num_gpus == 1 else 's'}: "
        if pc.best_step_time_s is None:
            lines.append(n + (pc.reason or "no feasible plan"))
            continue
        t, d = pc.best_step_time_s, pc.best_usd_per_mtok
        if result.objective == "cost" and tokens is not None:
            days = float(train_days(t, result.work.tokens, tokens))
            best = f"{usd(d * tokens / 1e6)} to train in {days:,.1f} days, ${d:.3f}/M tokens, {t:.3f} s per step"
        elif result.objective == "cost":
            best = f"${d:.3f}/M tokens, {t:.3f} s per step"
        else:
            best = f"{t:.3f} s, ${d:.3f}/M tokens"
        extra = f", {pc.over_deadline:,} over the deadline" if pc.over_deadline else ""
        used = getattr(pc, "used_gpus", None)  # on pools: a budget's best plan may use fewer GPUs
        if used is not None and used != pc.num_gpus:
            best += f", using {used:,} of the {pc.num_gpus:,} GPUs"
        lines.append(n + f"{best} ({pc.feasible:,} feasible{extra})" + ("  <- winner" if pc.num_gpus == win else ""))
    return lines


def price_line(price: dict[str, Any]) -> str:
    return (f"price: ${price['usd_per_gpu_hour']:,.2f} per GPU-hour (from {price['source']}"
            + ("" if price["source"] == "--price-per-gpu-hour" else "; change with --price-per-gpu-hour") + ")")


def _text(result: Any, tokens: float | None, price: dict[str, Any] | None = None) -> str:
    from meshplan.search.explain import explain
    from meshplan.search.result import token_count
    c = result.clusters
    where = (f"{c[0].num_gpus} x {c[0].gpu.name}" if len(c) == 1 else
             f"{', '.join(str(x.num_gpus) for x in c)} x {c[0].gpu.name}")
    lines = [(f"model {result.model.name} on {where}, global batch {result.work.global_batch} x "
              f"{result.work.seq_len} tokens (objective: {result.objective})")]
    if result.work.lengths is not None:  # a length distribution: the plans are ranked by the expected step
        from meshplan.cli.lengths_arg import dist_line
        lines[0] = dist_line(result)
    if result.work.optimizer != "adamw":
        lines[0] += f", optimizer {result.work.optimizer}"
    if price is not None:
        lines.append(price_line(price))
    if result.deadline_days is not None:
        lines.append(f"deadline: {result.deadline_days:g} days to train {token_count(tokens)} tokens "
                     "(plans that take longer are rejected)")
    lines += [searched_line(result)]
    if SELECTIVE_LEFT_OUT in result.notes:
        lines.append("recompute=selective (Megatron's: the attention core) not searched: with flash attention it "
                     "saves no memory and costs time; torchtitan's 'selective' is recompute=op")
    lines.append("")
    if result.plans:
        lines += [_table(result, tokens), ""]
    lines += [f"note: {n}" for n in result.notes if "CostParams.sync_method_min_gain" in n]
    if result.data_aware is not None:
        from meshplan.cli.lengths_arg import data_aware_lines
        lines += data_aware_lines(result.data_aware) + [""]
    if result.other_plans and [p.plan.short() for p in result.other_plans] != [p.plan.short() for p in result.plans]:
        what = {"time": "step time", "time-to-target": "time to target"}[result.other_objective]
        lines += [f"by {what} instead:"] + [
            f"  {p.rank}. {p.plan.short()}: {p.report.step_time_s:.3f} s per step, {p.report.time_to_target_s:.3f} s "
            f"to target (tokens x{p.report.token_factor:.2f})" for p in result.other_plans[:3]] + [""]
    if len(c) > 1:
        lines += _per_size(result, tokens) + [""]
    lines += explain(result)
    if result.pareto:
        lines += [""] + _pareto_lines(result, tokens)
    return "\n".join(lines)


def searched_line(result: Any) -> str:
    """What the search counted, in the progress bar's terms: candidates enumerated, those that pass the
    constraints (the bar's count), those of them priced by the cost model (the others over a memory bound),
    and those feasible."""
    n = len(result.clusters)
    head = (f"searched {result.considered:,} plans" + (f" over {n} cluster sizes" if n > 1 else "")
            + f" in {result.search_time_s:.2f} s: ")
    if result.passed_constraints < 0:
        return head + f"{result.feasible:,} feasible, {result.evaluated:,} priced by the cost model"
    skipped = result.passed_constraints - result.evaluated
    return (head + f"{result.passed_constraints:,} pass the constraints, {result.evaluated:,} of them priced by the "
            "cost model" + (f" ({skipped:,} ruled out by a memory bound first)" if skipped > 0 else "")
            + f", {result.feasible:,} feasible")


def _pareto_lines(result: Any, tokens: float | None) -> list[str]:
    """The Pareto front; with the cost objective cheapest first, dollars first."""
    from meshplan.cost.params import DEFAULT_PARAMS
    from meshplan.search.explain import AT_RISK_MARK, usd
    from meshplan.search.result import train_days
    multi = len(result.clusters) > 1
    front = list(result.pareto)
    usable = result.best.report.usable_memory_gib if result.best is not None else float("inf")
    from meshplan.cost.uncertainty import safe_peak_gib
    safe = safe_peak_gib(usable, result.params or DEFAULT_PARAMS) if result.best is not None else usable

    def gib(peak: float) -> str:  # at risk (listed with --no-headroom): marked as in the table
        risky = safe < peak <= usable
        return f"{peak:6.1f}{AT_RISK_MARK if risky else ' '}GiB"
    if result.objective == "cost":
        front.sort(key=lambda p: (p.usd_per_mtok, p.step_time_s, p.peak_memory_gib))
        out = [f"Pareto front ($, step time, memory), cheapest first: {len(front)} plans"]
    else:
        out = [f"Pareto front (step time, memory, $): {len(front)} plans"]
    for p in front[:8]:
        gpus = f"  ({p.plan.num_gpus} GPUs)" if multi else ""
        if result.objective == "cost":
            money = f"${p.usd_per_mtok:.3f}/M"
            if tokens is not None:
                days = float(train_days(p.step_time_s, result.work.tokens, tokens))
                money = f"{usd(p.usd_per_mtok * tokens / 1e6):>12}  {days:7,.1f} days  " + money
            out.append(f"  {money}  {p.step_time_s:8.3f} s  {gib(p.peak_memory_gib)}  {p.plan.short()}{gpus}")
        else:
            out.append(f"  {p.step_time_s:8.3f} s  {gib(p.peak_memory_gib)}  ${p.usd_per_mtok:.3f}/M  "
                       f"{p.plan.short()}{gpus}")
    if len(front) > 8:
        out.append(f"  ... {len(front) - 8} more in --json")
    return out


def _write_out(path: str, result: Any, cost: dict[str, str | None] | None = None) -> None:
    from meshplan.spec.io import plan_document, spec_fields, write_plan_file
    best = result.best
    model = getattr(result.model, "source", None) or result.model.name  # an ingested graph: how to rebuild it
    extra = {k: v for k, v in (cost or {}).items() if v}  # --profile / --calibration as given
    lengths = result.work.lengths  # a distribution: recorded beside its longest length (cli.lengths_arg reads it)
    extra |= {"lengths": lengths.text(), "packing": lengths.packing} if lengths is not None else {}
    # spec_fields: the full model and cluster, so that the file reloads them exactly
    doc = plan_document(best.plan, model=model, cluster=best.cluster.name,
                        global_batch=result.work.global_batch, seq_len=result.work.seq_len,
                        optimizer=result.work.optimizer, **spec_fields(result.model, best.cluster),
                        predicted=best.report.to_dict(), **extra)
    write_plan_file(path, doc)


def plot_pareto(path: str, result: Any) -> None:
    """The report's Pareto figure (every feasible plan, step time vs peak memory, the front and
    the winner: report.charts.pareto_plot), written to exactly ``path`` as `simulate --plot`
    writes its figures."""
    from meshplan.cost.memory import usable_gib
    from meshplan.report.charts import pareto_plot
    from meshplan.sim.output import write_figures
    if result.best_pooled is not None:  # on pools: the tightest pool the winner uses
        usable = min(p.usable_memory_gib for p in result.best_pooled.parts)
    else:
        usable = usable_gib(result.best.cluster if result.best is not None else result.clusters[-1])
    heading = f"{result.model.name}: {result.feasible:,} feasible of {result.considered:,}"
    write_figures([pareto_plot(result, "memory", usable)], path, heading)


def run(args: argparse.Namespace) -> int:
    from meshplan.cli.costing import costing
    from meshplan.paths import check_output_file
    check_output_file("--out", args.out, "plan.json")  # before the search, as calibrate checks its --out
    if args.plot is not None:
        from meshplan.sim.output import check_plot_path
        check_plot_path(args.plot)  # before the search: the format can be written
    bar = progress_bar()
    try:
        with _step(bar, f"loading {args.model}"):
            model, clusters, tokens, space, work = problem(args)
        deadline = deadline_days(args, tokens)
        cost = costing(args)
        _check_policy(args, clusters, cost.params)
        result = search_sizes(model, clusters, work, space, objective=args.objective, top=args.top,
                              tokens=tokens, deadline=deadline, progress=bar, params=cost.params)
        miss = deadline_miss(result, model, work, space, objective=args.objective, progress=bar,
                             params=cost.params)
    finally:
        if bar is not None:
            bar.close()
    price = price_info(args, clusters[0])
    _small_batch_note(args, result, work)
    result.notes += [n for n in getattr(args, "plan_notes", None) or () if n not in result.notes]
    if result.pooled:  # a cluster of several pools: the plans of every kind over them (search.pools)
        return _pooled_output(args, result, cost, tokens, price)
    if args.out is not None and result.plans:  # written before the output: a reader that closes the pipe
        _write_out(args.out, result, {"profile": getattr(args, "profile", None),  # (| head) must not lose it
                                      "calibration": getattr(args, "calibration", None),
                                      "token_efficiency": getattr(args, "token_efficiency", None)})
    if args.json:
        from meshplan.cli.format import json_doc, json_text
        from meshplan.search.explain import explain
        doc = result.to_json() | cost.to_json()
        doc["price"] = price
        doc["explanation"] = explain(result)
        if tokens is not None:
            doc["train"] = [train_cost(tokens, p) for p in result.plans]
        if miss is not None:
            doc["deadline_miss"] = miss
        if work.lengths is not None:
            from meshplan.cli.lengths_arg import lengths_json
            doc["lengths"] = lengths_json(result, cost.params)
        print(json_doc("plan", doc))
    else:
        print("\n".join(cost.lines() + [_text(result, tokens, price)]))
    if not result.plans:
        if miss is not None:
            raise Infeasible(deadline_message(result, miss))
        c = clusters[-1]
        raise Infeasible(f"no plan fits {model.name} on {c.num_gpus} x {c.gpu.name} with global batch "
                         f"{work.global_batch} x {work.seq_len}: " + "; ".join(result.nearest))
    if args.out is not None:
        _said(f"wrote {args.out}: the winner's plan file (estimate, simulate, report, export and train take it "
              f"by --plan {args.out})")
    _plot(args, result)
    return 0


def _said(line: str) -> None:
    """What a command wrote, on stderr (stdout stays one JSON document with --json)."""
    print(f"meshplan: {line}", file=sys.stderr)


def _plot(args: argparse.Namespace, result: Any) -> None:
    if args.plot is not None:
        bar = progress_bar()
        try:
            with _step(bar, f"drawing {args.plot}"):
                plot_pareto(args.plot, result)
        finally:
            if bar is not None:
                bar.close()
        _said(f"wrote {args.plot}: the Pareto front (step time, memory, dollars)")


def price_info(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    """The price per GPU-hour and where it comes from (--json's "price"); on pools, each pool's."""
    if len(cluster.pools) > 1:
        return {"usd_per_gpu_hour": {p.name: p.price_per_hour for p in cluster.pools},
                "source": "--price-per-gpu-hour" if getattr(args, "price_per_gpu_hour", None) is not None
                else f"cluster {args.cluster} (each pool's price_per_gpu_hour_usd, else its GPU preset's)"}
    return {"usd_per_gpu_hour": cluster.price_per_hour, "source": price_source(args, cluster)}


def _pooled_output(args: argparse.Namespace, result: Any, cost: Any, tokens: float | None,
                   price: dict[str, Any]) -> int:
    """`meshplan plan` on a cluster of several pools: the text or --json of search.pools' result,
    the options' parts (--gpus: the best per size; --deadline; --price-per-gpu-hour) only when given."""
    work, model = result.work, result.model
    extra: dict[str, Any] = {}
    if len(result.per_cluster) > 1:
        extra["per_cluster"] = [vars(c) for c in result.per_cluster]
    if result.deadline_days is not None:
        extra |= {"train_tokens": result.train_tokens, "deadline_days": result.deadline_days,
                  "rejected": dict(result.rejected), "reject_examples": dict(result.reject_examples)}
    if price["source"] == "--price-per-gpu-hour":
        extra["price"] = price
    if args.out is not None and result.best_pooled is not None:  # before the output (see run_plan)
        _write_pooled_out(args.out, result, str(args.cluster))
    if args.json:
        from meshplan.cli.format import json_doc
        print(json_doc("plan", result.to_json() | extra | cost.to_json()))
    else:
        print("\n".join(cost.lines() + [pooled_text(result, tokens, price)]))
    if result.best_pooled is None:
        if result.deadline_days is not None and result.rejected.get("over the deadline"):
            from meshplan.search.result import token_count
            raise Infeasible(f"no plan trains {token_count(tokens)} tokens of {model.name} within "
                                f"{result.deadline_days:g} days on {result.clusters[0].name}: "
                                + result.reject_examples.get("over the deadline", ""),
                                hint="raise --deadline, train fewer tokens, or add GPUs to the pools")
        raise Infeasible(f"no plan fits {model.name} on any pool of {result.clusters[0].name} with global batch "
                            f"{work.global_batch} x {work.seq_len}",
                            hint="more GPUs, a smaller global batch or sequence, or a GPU with more memory")
    if args.out is not None:
        _said(f"wrote {args.out}: the winner's plan file (--plan {args.out})")
    _plot(args, result)
    return 0


def pooled_text(result: Any, tokens: float | None = None, price: dict[str, Any] | None = None) -> str:
    """The text of `meshplan plan` on a cluster of several pools."""
    from meshplan.cli.views import workload_text
    from meshplan.units import human_seconds
    pc, work = result.clusters[0], result.work
    d = work.lengths
    dist = "" if d is None or len(d.lengths) == 1 else f" (lengths {d.text()})"
    gpus = (f"budgets of {', '.join(str(c.num_gpus) for c in result.per_cluster)} GPUs"
            if len(result.per_cluster) > 1 else f"{pc.num_gpus} GPUs")
    lines = [f"{result.model.name} on {pc.name} ({pc.describe()}; {gpus}), {workload_text(work)}{dist}, "
             f"objective {result.objective}"]
    if price is not None and price["source"] == "--price-per-gpu-hour":
        each = ", ".join(f"{k} ${v:,.2f}" for k, v in price["usd_per_gpu_hour"].items())
        lines.append(f"price per GPU-hour (--price-per-gpu-hour): {each}")
    if result.deadline_days is not None:
        from meshplan.search.result import token_count
        lines.append(f"deadline: {result.deadline_days:g} days to train {token_count(tokens)} tokens "
                     "(plans that take longer are rejected)")
    lines += [f"searched {result.considered:,} plans in {result.search_time_s:.1f} s (every pool alone, replicas on "
              "every pool, pipeline stages on every pool)", ""]
    lines += result.explanation
    if result.pooled_plans:  # (none: the error says why, without an empty table)
        from meshplan.search.explain import usd
        from meshplan.search.result import train_days
        train = f" {'$ to train':>12} {'days':>8}" if tokens is not None else ""
        lines += ["", f"{'step':>10} {'GPUs':>5} {'$/M tok':>8}{train} {'MFU':>5}  plan"]
        for e in result.pooled_plans:
            if tokens is not None:  # the whole run, as on one GPU type
                days = float(train_days(e.step_time_s, work.tokens, tokens))
                train = f" {usd(e.usd_per_m_tokens * tokens / 1e6):>12} {days:8,.1f}"
            lines.append(f"{human_seconds(e.step_time_s):>10} {e.num_gpus:5d} {e.usd_per_m_tokens:8.3f}{train} "
                         f"{100 * e.mfu:4.0f}%  {e.plan.short()}")
    if len(result.per_cluster) > 1:
        lines += [""] + _per_size(result, tokens)
    if result.deadline_days is not None and result.reject_examples.get("over the deadline"):
        lines += ["", f"over the deadline ({result.rejected['over the deadline']:,}): e.g. "
                  + result.reject_examples["over the deadline"]]
    return "\n".join(lines)


def _write_pooled_out(path: str, result: Any, cluster: str) -> None:
    """--out on pools: the winner as a plan file that every command reloads on its own: the model
    and the cluster of pools are embedded (model_spec, cluster_spec), as `plan --out` does on one
    GPU type, so a copied plan file loads anywhere (issue 29: the cluster file was recorded by a
    relative path, and a copy failed to load). ``cluster`` is kept as the name people see."""
    import os

    from meshplan.spec.io import plan_document, spec_fields, write_plan_file
    best, work, model = result.best_pooled, result.work, result.model
    name = result.clusters[0].name or (os.path.basename(cluster) if os.path.isfile(cluster) else cluster)
    extra = ({"lengths": work.lengths.text(), "packing": work.lengths.packing} if work.lengths is not None else {})
    doc = plan_document(best.plan, model=getattr(model, "source", None) or model.name, cluster=name,
                        global_batch=work.global_batch, seq_len=work.seq_len, optimizer=work.optimizer,
                        predicted=best.to_dict(), **extra, **spec_fields(model, result.clusters[0]))
    write_plan_file(path, doc)
