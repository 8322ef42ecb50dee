"""`meshplan plan`: search the plan space, rank it, explain the choice.

Importing this module is cheap (argparse only); the search is imported when the command runs.
Exit status: 0 with a plan; 2 with a one-line `meshplan: error: ...` on bad input or when no
plan is feasible (that line names the nearest feasible options; --json still prints the
document first).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from meshplan.errors import MeshplanError

SEARCHABLE_FIX = ("tp", "pp", "cp", "ep", "zero", "micro_batch", "schedule", "recompute")


def add_parser(sub: Any, positive_int: Any) -> None:
    """The `plan` subcommand's arguments (called from meshplan.cli.main.build_parser)."""
    pl = sub.add_parser(
        "plan", help="search for the fastest plan that fits, rank and explain it",
        description="Search every parallel plan for the model on the cluster, rank the feasible "
                    "ones (fastest first, or cheapest with --objective cost; ties: fewer GPUs, "
                    "less memory, then the plan string), explain the winner and every rejection.")
    pl.add_argument("--model", required=True,
                    help="preset name, ModelSpec .toml/.json, hf:CONFIG.json, module:pkg.mod:factory, "
                         "or a layer graph .json from `meshplan ingest --out`")
    pl.add_argument("--cluster", required=True,
                    help="GPU:COUNT, GPU:NODESxPER_NODE or a cluster .toml; with --gpus, the GPU type "
                         "and links (e.g. h100-sxm-80gb)")
    pl.add_argument("--global-batch", type=positive_int("--global-batch"), required=True,
                    help="sequences per step")
    pl.add_argument("--seq-len", type=positive_int("--seq-len"), help="tokens per sequence (default: the model's)")
    pl.add_argument("--top", type=positive_int("--top"), default=5, help="plans to show (default 5)")
    pl.add_argument("--json", action="store_true", help="one JSON object on stdout")
    pl.add_argument("--out", help="write the winning plan (with its predicted cost) to this .json file")
    pl.add_argument("--plot", help="draw the Pareto front (step time vs memory) to this image (needs matplotlib)")
    pl.add_argument("--gpus", help="search cluster sizes: LOW..HIGH (powers of two and 3x2^k in whole "
                                   "nodes) or a list 64,128,256")
    pl.add_argument("--objective", choices=["time", "cost"], default="time",
                    help="rank by step time (default) or by dollars per million tokens")
    pl.add_argument("--train-tokens", help="report days and dollars to train this many tokens (e.g. 2T, 300B)")
    pl.add_argument("--precision", choices=["bf16", "fp16", "fp8", "fp32"], default="bf16",
                    help="matmul precision (default bf16; fp8 only when asked)")
    pl.add_argument("--compile", action="store_true", help="plans use torch.compile (fused elementwise ops)")
    pl.add_argument("--no-flash-attention", action="store_true", help="unfused attention (no FlashAttention)")
    pl.add_argument("--fused-loss", action="store_true", help="fused cross-entropy")
    pl.add_argument("--async-tp", action="store_true", help="overlap TP communication (AsyncTP)")
    pl.add_argument("--uneven-stages", action="store_true",
                    help="also try pipeline stages of unequal size (dynamic programming)")
    pl.add_argument("--fix", help="restrict the space: key=value[|value...],... over "
                                  + ", ".join(SEARCHABLE_FIX) + ", offload (0/1) and any non-searched plan field")


# ---- inputs --------------------------------------------------------------------------------

def search_space(args: argparse.Namespace, cluster: Any) -> Any:
    """The SearchSpace of the plan options (--fix, --precision, ...) on ``cluster``."""
    from meshplan.search.space import SearchSpace
    from meshplan.spec.plan import Plan
    base: dict[str, Any] = {"precision": args.precision, "compile": args.compile,
                            "flash_attention": not args.no_flash_attention,
                            "fused_loss": args.fused_loss, "async_tp": args.async_tp}
    changes: dict[str, Any] = {"uneven_stages": args.uneven_stages}
    if args.fix:
        _apply_fix(args.fix, base, changes)
    if base["precision"] == "fp8" and "fp8" not in cluster.gpu.peak_tflops:
        raise MeshplanError(f"--precision fp8: {cluster.gpu.name} has no fp8 tensor cores",
                            hint="use --precision bf16, or an fp8 GPU such as h100-sxm-80gb")
    try:
        plan = Plan(**base)
    except TypeError as e:  # pragma: no cover - keys are checked in _apply_fix
        raise MeshplanError(f"--fix: {e}") from None
    return SearchSpace(base=plan, **changes)


def graph_space(args: argparse.Namespace, cluster: Any) -> Any:
    """The search space on an ingested layer graph: the same options, mapped to GraphSpace."""
    from meshplan.search.graph import GraphSpace
    from meshplan.spec.plan import Plan
    space = search_space(args, cluster)  # parses and checks --fix and the plan options once
    for axis in ("cp", "ep"):
        if getattr(space, axis, None) not in (None, (1,)):
            raise MeshplanError(f"--fix {axis}: a layer graph has no {'sequence' if axis == 'cp' else 'expert'} "
                                "axis to split", hint=f"drop {axis} from --fix (ingested models plan with "
                                "tp, pp, dp/zero, micro_batch, schedule, recompute)")
    fixed = {k: getattr(space, k) for k in ("tp", "pp", "micro_batch") if getattr(space, k, None)}
    if getattr(space, "zero", None):
        fixed["zero"] = tuple(space.zero)
    if args.fix and "schedule" in args.fix:
        fixed["schedules"] = tuple(space.schedules)
    if args.fix and "recompute" in args.fix:
        fixed["recompute"] = tuple(space.recompute)
    if args.fix and "offload" in args.fix:
        fixed["offload"] = bool(space.offload)
    base = space.base
    if base.precision == "fp8":
        raise MeshplanError("--precision fp8 is not modelled on an ingested layer graph",
                            hint="use --precision bf16")
    return GraphSpace(base=Plan(precision=base.precision, fused_loss=base.fused_loss, async_tp=base.async_tp,
                                compile=base.compile, flash_attention=base.flash_attention),
                      even_stages=not args.uneven_stages, **fixed)


def _apply_fix(text: str, base: dict[str, Any], changes: dict[str, Any]) -> None:
    """Parse --fix into base plan fields and search-space restrictions."""
    import dataclasses
    import typing

    from meshplan.search.space import SEARCHED
    from meshplan.spec.base import _coerce
    from meshplan.spec.plan import Plan
    hints = typing.get_type_hints(Plan)
    fields = {f.name for f in dataclasses.fields(Plan)}
    seen: set[str] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if "=" not in part:
            raise MeshplanError(f"--fix: {part!r} is not key=value", hint="e.g. --fix tp=8,zero=1|3")
        key, value = (s.strip() for s in part.split("=", 1))
        alts = [v.strip() for v in value.split("|") if v.strip()]
        if not alts:
            raise MeshplanError(f"--fix: {key} has no value")
        if key in seen:
            raise MeshplanError(f"--fix: {key} given twice", hint=f"list alternatives as {key}=a|b")
        seen.add(key)
        if key in ("tp", "pp", "cp", "ep", "zero", "micro_batch"):
            changes[key] = tuple(_coerce(v, int, f"--fix {key}") for v in alts)
        elif key == "schedule":
            changes["schedules"] = tuple(alts)
        elif key == "recompute":
            changes["recompute"] = tuple(alts)
            changes["recompute_fractions"] = ()
        elif key == "offload":
            changes["offload"] = bool(_coerce(alts[0], bool, "--fix offload"))
        elif key in fields and key not in SEARCHED:
            base[key] = _coerce(alts[0], hints[key], f"--fix {key}")
        elif key in fields:
            raise MeshplanError(f"--fix: {key} cannot be fixed (it follows from the others)",
                                hint="fixable: " + ", ".join(SEARCHABLE_FIX) + ", offload, and non-searched fields")
        else:
            raise MeshplanError(f"--fix: unknown key {key!r}", hint="fixable: " + ", ".join(SEARCHABLE_FIX))


def cluster_sizes(args: argparse.Namespace) -> list[Any]:
    """--cluster, at each size of --gpus (if given)."""
    from meshplan.search.sizes import node_size, parse_gpus, resized
    from meshplan.spec.io import load_cluster
    cluster = load_cluster(args.cluster)
    if args.gpus is None:
        return [cluster]
    return [resized(cluster, n) for n in parse_gpus(args.gpus, node_size(cluster))]


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
    `meshplan report`): a layer graph (hf:, module:, graph .json) gets a GraphSpace and
    graph_workload, a transformer a SearchSpace."""
    from meshplan.cli.model_arg import load_model_arg
    from meshplan.spec.graph import LayerGraph
    from meshplan.spec.plan import Workload
    model = load_model_arg(args.model, seq_len=args.seq_len)
    clusters = cluster_sizes(args)
    tokens = train_tokens(args.train_tokens)
    if isinstance(model, LayerGraph):
        from meshplan.cost.graph import graph_workload
        return model, clusters, tokens, graph_space(args, clusters[0]), graph_workload(model, args.global_batch)
    work = Workload(global_batch=args.global_batch, seq_len=args.seq_len or model.seq_len)
    return model, clusters, tokens, search_space(args, clusters[0]), work


# ---- progress ------------------------------------------------------------------------------

class Progress:
    """A plain-text bar on a terminal's stderr, shown once a search has run 0.5 s."""

    def __init__(self, stream: TextIO, delay_s: float = 0.5, width: int = 30) -> None:
        self.stream, self.delay_s, self.width = stream, delay_s, width
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.t0 < self.delay_s or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * self.width)
        self.stream.write(f"\rsearching [{bar:<{self.width}}] {100 * frac:3.0f}% "
                          f"{done:,}/{total:,} plans priced or pruned")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * (self.width + 60) + "\r")
            self.stream.flush()


# ---- output --------------------------------------------------------------------------------

def train_cost(tokens: float | None, plan: Any) -> dict[str, float] | None:
    """Days and dollars for a ranked plan to train ``tokens`` tokens (None without --train-tokens)."""
    if tokens is None:
        return None
    seconds = tokens / plan.report.tokens_per_s
    usd = plan.plan.num_gpus * plan.cluster.price_per_hour * seconds / 3600
    return {"tokens": tokens, "days": seconds / 86400, "usd": usd}


def _table(result: Any, tokens: float | None) -> str:
    from meshplan.cli.format import seconds, table
    multi = len(result.clusters) > 1
    head = ["#", "plan"] + (["GPUs"] if multi else []) + [
        "step time", "tokens/s", "MFU", "peak GiB", "$/M tok", "dominant"]
    if tokens is not None:
        head += ["days", "$ to train"]
    rows = []
    for p in result.plans:
        r = p.report
        row: list[object] = [p.rank, p.plan.short()] + ([p.plan.num_gpus] if multi else []) + [
            seconds(r.step_time_s), f"{r.tokens_per_s:,.0f}", f"{100 * r.mfu:.1f}%",
            f"{r.peak_memory_gib:.1f}", f"{p.usd_per_mtok:.3f}", r.dominant]
        t = train_cost(tokens, p)
        if t is not None:
            row += [f"{t['days']:.1f}", f"{t['usd']:,.0f}"]
        rows.append(row)
    align = "rl" + ("r" if multi else "") + "rrrrrl" + ("rr" if tokens is not None else "")
    return table(head, rows, align)


def _text(result: Any, tokens: float | None) -> str:
    from meshplan.search.explain import explain
    c = result.clusters
    where = (f"{c[0].num_gpus} x {c[0].gpu.name}" if len(c) == 1 else
             f"{', '.join(str(x.num_gpus) for x in c)} x {c[0].gpu.name} (objective: {result.objective})")
    lines = [(f"model {result.model.name} on {where}, global batch {result.work.global_batch} x "
              f"{result.work.seq_len} tokens"),
             (f"searched {result.considered:,} plans in {result.search_time_s:.2f} s: "
              f"{result.feasible:,} feasible, {result.evaluated:,} priced by the cost model"), ""]
    if result.plans:
        lines += [_table(result, tokens), ""]
    if len(c) > 1:
        lines.append("best per cluster size:")
        for pc in result.per_cluster:
            best = (f"{pc.best_step_time_s:.3f} s, ${pc.best_usd_per_mtok:.3f}/M tokens"
                    if pc.best_step_time_s is not None else "no feasible plan")
            lines.append(f"  {pc.num_gpus:>6} GPUs: {best} ({pc.feasible:,} feasible)")
        lines.append("")
    lines += explain(result)
    if result.pareto:
        lines += ["", f"Pareto front (step time, memory, $): {len(result.pareto)} plans"]
        for p in result.pareto[:8]:
            lines.append(f"  {p.step_time_s:8.3f} s  {p.peak_memory_gib:6.1f} GiB  ${p.usd_per_mtok:.3f}/M  "
                         f"{p.plan.short()}" + (f"  ({p.plan.num_gpus} GPUs)" if len(c) > 1 else ""))
        if len(result.pareto) > 8:
            lines.append(f"  ... {len(result.pareto) - 8} more in --json")
    return "\n".join(lines)


def _json_default(obj: Any) -> Any:
    """numpy scalars and arrays (a vectorised cost model may return them) as plain JSON."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _write_out(path: str, result: Any) -> None:
    from meshplan.spec.io import plan_document
    best = result.best
    model = getattr(result.model, "source", None) or result.model.name  # an ingested graph: how to rebuild it
    doc = plan_document(best.plan, model=model, cluster=best.cluster.name,
                        global_batch=result.work.global_batch, seq_len=result.work.seq_len,
                        predicted=best.report.to_dict())
    try:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2, default=_json_default)
            f.write("\n")
    except OSError as e:
        raise MeshplanError(f"cannot write --out {path}: {e.strerror or e}") from None


def _plot_format(path: str) -> str:
    """The image format of --plot PATH (from its extension; png without one), checked before
    the search: matplotlib is installed and can write it."""
    import os
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise MeshplanError("--plot needs matplotlib, which is not installed",
                            hint="pip install 'meshplan[plot]'") from None
    ext = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in formats:
        raise MeshplanError(f"--plot {path}: cannot draw a .{ext} image",
                            hint="use one of " + ", ".join(f".{f}" for f in sorted(formats)))
    return ext or "png"


def plot_pareto(path: str, result: Any) -> None:
    """Scatter of every feasible plan (step time vs peak memory), the front and the winner,
    written to exactly ``path``."""
    fmt = _plot_format(path)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MeshplanError("--plot needs matplotlib, which is not installed",
                            hint="pip install 'meshplan[plot]'") from None
    pts = result.points
    fig, ax = plt.subplots(figsize=(7, 4.5))
    multi = len(result.clusters) > 1
    sc = ax.scatter(pts["step_time_s"], pts["peak_memory_gib"], s=4, alpha=0.3,
                    c=pts["num_gpus"] if multi else "tab:gray", cmap="viridis" if multi else None,
                    label="feasible plans")
    if multi:
        fig.colorbar(sc, ax=ax, label="GPUs")
    if result.pareto:
        # One size: the front is a staircase in (time, memory). Several sizes: it is 3-D
        # (dollars too), so its points are shown without a connecting line.
        ax.plot([p.step_time_s for p in result.pareto], [p.peak_memory_gib for p in result.pareto],
                "o" if multi else "o-", color="tab:red", ms=4, mfc="none" if multi else None,
                label="Pareto front (time, memory, $)" if multi else "Pareto front")
    if result.best is not None:
        r = result.best.report
        ax.plot([r.step_time_s], [r.peak_memory_gib], "*", color="gold", mec="black", ms=14, label="winner")
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_title(f"{result.model.name}: {result.feasible:,} feasible of {result.considered:,}")
    ax.legend(loc="best", fontsize=8)
    try:
        with open(path, "wb") as f:  # a file object: matplotlib adds no extension to the name
            fig.savefig(f, format=fmt, dpi=120, bbox_inches="tight")
    except OSError as e:
        raise MeshplanError(f"cannot write --plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from meshplan.search.driver import search
    from meshplan.spec.graph import LayerGraph
    if args.plot is not None:
        _plot_format(args.plot)
    model, clusters, tokens, space, work = problem(args)
    if isinstance(model, LayerGraph):
        from meshplan.search.graph import search_graph
        result = search_graph(model, clusters, work, space, objective=args.objective, top=args.top)
    else:
        bar = Progress(sys.stderr) if sys.stderr.isatty() else None
        try:
            result = search(model, clusters, work, space, objective=args.objective, top=args.top,
                            progress=bar)
        finally:
            if bar is not None:
                bar.close()
    if args.json:
        from meshplan.cli.format import json_text
        from meshplan.search.explain import explain
        doc = result.to_json()
        doc["explanation"] = explain(result)
        if tokens is not None:
            doc["train"] = [train_cost(tokens, p) for p in result.plans]
        print(json_text(doc))
    elif result.plans:
        print(_text(result, tokens))
    if not result.plans:
        if not args.json:
            from meshplan.search.explain import rejection_lines
            print("\n".join(rejection_lines(result)))
        c = clusters[-1]
        raise MeshplanError(f"no plan fits {model.name} on {c.num_gpus} x {c.gpu.name} with global batch "
                            f"{work.global_batch} x {work.seq_len}: " + "; ".join(result.nearest))
    if args.out is not None:
        _write_out(args.out, result)
    if args.plot is not None:
        plot_pareto(args.plot, result)
    return 0
