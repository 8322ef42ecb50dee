"""--seq-len as one length or a distribution of sample lengths, and --packing, for the planning
commands (estimate, plan, report, simulate; `meshplan train` has its own copy in train_cmd).

``--seq-len 2048:0.6,8192:0.3,32768:0.1`` (length:probability pairs) or a histogram file (CSV rows
``length,count``, or JSON) is a distribution (spec.lengths); ``--packing padded|bucketed|packed``
says how samples form micro-batches. The argparse type keeps a distribution as text; ``stash``
moves it out of ``args.seq_len`` before the plan file is resolved (a plan file records the longest
length as ``seq_len`` and the distribution as ``lengths`` / ``packing``), ``lengths_of`` parses it
once --packing is known. Importing this module is cheap.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX

PACKING_HELP = ("with a --seq-len distribution: how samples form micro-batches: padded (default: each "
                "micro-batch padded to its longest sample), bucketed (the step's samples sorted by length "
                "first, micro-batch j to replica j mod dp) or packed (samples concatenated into windows of the "
                "longest length)")
SEQ_LEN_HELP = ("tokens per sequence, or a distribution of sample lengths: length:probability pairs "
                "(2048:0.6,8192:0.3,32768:0.1) or a histogram file (CSV rows length,count, or JSON); plans are "
                "priced by the expected step (default: the plan file's, else the model's)")
DIST_ATTR = "seq_len_dist"


def seq_len_type(text: str) -> int | str:
    """An argparse type: a positive length (int), or a distribution / histogram file (kept as
    text, parsed by ``lengths_of`` once --packing is known)."""
    from meshplan.spec.lengths import looks_like_dist
    t = str(text).strip()
    if looks_like_dist(t):
        return t
    try:
        v = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or a length distribution, got {text!r}") \
            from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    from meshplan.cli.args import check_seq_len
    return check_seq_len(v, text)


def add_packing(parser: argparse.ArgumentParser, action: Any = None) -> None:
    kw = {"action": action} if action is not None else {}
    parser.add_argument("--packing", choices=["padded", "bucketed", "packed"], default=None, help=PACKING_HELP, **kw)


def stash(args: argparse.Namespace) -> None:
    """Move a --seq-len distribution out of ``args.seq_len`` (to ``args.seq_len_dist``) so that the
    plan file resolves the one length; idempotent."""
    if isinstance(getattr(args, "seq_len", None), str):
        setattr(args, DIST_ATTR, args.seq_len)
        args.seq_len = None


def _plan_file_doc(args: argparse.Namespace) -> dict[str, Any] | None:
    """The plan file given as --plan, read (None for a plan string or a file that is not a plan file:
    the plan's own reading says why, in its words)."""
    from meshplan.spec.io import is_file_arg, read_data_file
    plan = getattr(args, "plan", None)
    if not is_file_arg(plan):
        return None
    try:
        data = read_data_file(plan)
    except MeshplanError:
        return None
    return data if isinstance(data, dict) and "plan" in data else None


def file_lengths(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(lengths, packing) a plan file given as --plan records (None, None for a plan string)."""
    plan = getattr(args, "plan", None)
    data = _plan_file_doc(args)
    if data is None:
        return None, None
    text, packing = data.get("lengths"), data.get("packing")
    if text is not None and not isinstance(text, str):
        raise MeshplanError(f"{plan}: 'lengths' must be a length:probability string; got {text!r}",
                            hint="fix the file or give --seq-len")
    return text, packing if isinstance(packing, str) else None


RESOLVED_ATTR = "seq_len_lengths"


def lengths_of(args: argparse.Namespace) -> Any:
    """The LengthDist of --seq-len (with --packing), or of the plan file when --seq-len is not given;
    None for one length. --packing with one length is an error. Call it before the plan file is
    resolved into ``args`` (the answer is kept on ``args`` and copies of it)."""
    if hasattr(args, RESOLVED_ATTR):
        return getattr(args, RESOLVED_ATTR)
    out = _lengths_of(args)
    setattr(args, RESOLVED_ATTR, out)
    return out


def _lengths_of(args: argparse.Namespace) -> Any:
    from meshplan.spec.lengths import parse_lengths
    stash(args)
    text = getattr(args, DIST_ATTR, None)
    packing = getattr(args, "packing", None)
    ftext, fpacking = file_lengths(args)
    if ftext is not None and (text is not None or packing is not None):
        _check_file_lengths(args, ftext, fpacking, text, packing)  # replaced only with --override
    if ftext is None and text is not None:  # a distribution for a file planned at one length
        _check_file_seq_len(args, parse_lengths(text, packing or "padded"))
    one = getattr(args, "seq_len", None)
    if ftext is not None and text is None and one is not None:  # one length for the file's distribution
        if not getattr(args, "override", False):
            raise MeshplanError(f"--seq-len {one} disagrees with the plan file's length distribution {ftext}; "
                                "drop --seq-len or pass --override",
                                hint=f"{args.plan} records the length distribution it was planned for")
        print(f"meshplan: note: --override: --seq-len {one} (every sample that long) replaces the plan file's "
              f"length distribution {ftext}", file=sys.stderr)
    if text is None and one is None and ftext is not None:
        return parse_lengths(ftext, packing or fpacking or "padded")
    if text is None:
        if packing is not None:  # as `meshplan train` does: said, and the one length planned as given
            print(f"meshplan: note: --packing {packing} has no effect with one --seq-len (every sample is the same "
                  "length); give a distribution, e.g. --seq-len 2048:0.6,8192:0.3,32768:0.1", file=sys.stderr)
        return None
    return parse_lengths(text, packing or fpacking or "padded")


def _check_file_seq_len(args: argparse.Namespace, mine: Any) -> None:
    """--seq-len DIST against the one sequence length a plan file records: a distribution whose only
    length is the file's passes; otherwise an error unless --override (then a note says what replaces
    what), as for the file's other recorded inputs."""
    data = _plan_file_doc(args)
    theirs = None if data is None else data.get("seq_len")
    if not isinstance(theirs, int) or isinstance(theirs, bool) or (len(mine.lengths) == 1 and mine.max_len == theirs):
        return
    clash = f"--seq-len {mine.text()} disagrees with the plan file's sequence length {theirs}"
    if not getattr(args, "override", False):
        raise MeshplanError(clash + "; drop --seq-len or pass --override",
                            hint=f"{args.plan} records the sequence length it was planned for (every sample "
                                 f"{theirs} tokens)")
    print("meshplan: note: --override: " + clash.replace("disagrees with", "replaces"), file=sys.stderr)


def _check_file_lengths(args: argparse.Namespace, ftext: str, fpacking: str | None, text: str | None,
                        packing: str | None) -> None:
    """--seq-len DIST / --packing against the distribution a plan file records: the same
    distribution (to the file's precision) and packing pass; otherwise an error unless --override,
    which says what replaces what (as planfile.resolve does for the other recorded inputs)."""
    from meshplan.spec.lengths import parse_lengths
    theirs = parse_lengths(ftext, fpacking or "padded")
    clashes = []
    if text is not None:
        mine = parse_lengths(text, packing or theirs.packing)
        same = (mine.lengths == theirs.lengths
                and all(abs(a - b) <= 1e-5 for a, b in zip(mine.probs, theirs.probs)))
        if not same:
            clashes.append(f"--seq-len {mine.text()} disagrees with the plan file's {theirs.text()}")
    if packing is not None and packing != theirs.packing:
        clashes.append(f"--packing {packing} disagrees with the plan file's {theirs.packing}")
    if not clashes:
        return
    if not getattr(args, "override", False):
        raise MeshplanError("; ".join(clashes) + "; drop the flag or pass --override",
                            hint=f"{args.plan} records the length distribution it was planned for")
    print("meshplan: note: --override: " + "; ".join(c.replace("disagrees with", "replaces") for c in clashes),
          file=sys.stderr)


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The length terms of one plan (cost.lengths_summary) as text lines."""
    from meshplan.cli.format import seconds
    step, even, imb = s["expected_step_s"], s["step_time_even_s"], s["imbalance_s"]
    share = f" ({100 * imb / step:.1f}% of the step)" if step > 0 else ""
    head = (f"lengths        {s['lengths']} ({'sorted into the plan buckets' if 'buckets' in s else s['packing']}): "
            f"mean {s['mean_length']:,.0f} tokens, longest {s['max_length']:,}; {s['real_tokens_per_step']:,} real "
            f"tokens per step, padding {abs(100 * s['padding_fraction']):.1f}% of the tokens computed")
    if "buckets" in s:  # a data-aware plan (spec/buckets.py)
        return [head, f"buckets        {s['buckets']}; micro-batches dealt to ranks heaviest first",
                f"expected step  {seconds(step)} = {seconds(even)} at even load + {seconds(imb)} lost to imbalance"
                f"{share} (the busiest rank, waits for context-parallel peers included; gradient sync exposed after "
                "the last micro-batch); memory for the heaviest bucket's micro-batch"]
    return [head,
            f"expected step  {seconds(step)} = {seconds(even)} at even load + {seconds(imb)} lost to imbalance"
            f"{share} ("
            + ("a pipeline runs every micro-batch at the longest length" if s.get("pipeline_one_shape") else
               "the slowest data-parallel replica, and pipeline stalls at heavier micro-batches" if s.get(AX.PP, 1) > 1
               else "the slowest data-parallel replica")
            + "); memory for the longest micro-batch"]


def insert_lines(text: str, summary: dict[str, Any]) -> str:
    """``text`` (cli.views.estimate_text) with the length lines after its workload line."""
    lines = text.split("\n")
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("workload")), len(lines))
    return "\n".join(lines[:at] + summary_lines(summary) + lines[at:])


def dist_line(result: Any) -> str:
    """The first line of `meshplan plan` for a length distribution."""
    c = result.clusters
    where = (f"{c[0].num_gpus} x {c[0].gpu.name}" if len(c) == 1 else
             f"{', '.join(str(x.num_gpus) for x in c)} x {c[0].gpu.name}")
    d = result.work.lengths
    if d.packing == "packed":
        what = (f"global batch {result.work.global_batch} packed windows of {d.max_len:,} tokens (samples of lengths "
                f"{d.text()}, mean {d.mean_len:,.0f}, concatenated; causal attention over each whole window, no "
                f"document mask; objective: {result.objective})")
    else:
        what = (f"global batch {result.work.global_batch} samples of lengths {d.text()} ({d.packing}; mean "
                f"{d.mean_len:,.0f}, longest {d.max_len:,}; objective: {result.objective}, by the expected step: "
                "'imbalance' is the time lost to uneven micro-batches and replicas)")
    return f"model {result.model.name} on {where}, {what}" + _winner_line(result)


def _winner_line(result: Any) -> str:
    if not result.plans:
        return ""
    from meshplan.cli.format import seconds
    r = result.plans[0].report
    imb = r.time.get("imbalance", 0.0)
    mem = ("the heaviest bucket's micro-batches" if result.plans[0].plan.buckets is not None else
           "micro-batches of the longest length")
    return (f"\nthe winner's expected step {seconds(r.step_time_s)}: {seconds(r.step_time_s - imb)} at even load + "
            f"{seconds(imb)} lost to imbalance; memory for {mem}")


def data_aware_lines(info: dict[str, Any]) -> list[str]:
    """What the data-aware stage of the search (search.buckets) tried and found."""
    from meshplan.cli.format import seconds
    tried = (f"data-aware: {info['candidates']} bucket plans (micro-batch and cp per length bucket) built from "
             f"{len(info['bases'])} one-shape plan(s) without a pipeline, {info['fitting']} fit")
    best, one = info.get("best"), info.get("best_one_shape")
    if info.get("replaced"):
        tried += (f"; {info['replaced']} one-shape plan(s) with cp > 1 and no pipeline left the ranking (meshplan "
                  "train splits a micro-batch of its own width over cp ranks only under buckets)")
    piped = ([f"  note: {info['pipelines_padded']} ranked plan(s) with a pipeline are priced with each micro-batch at "
              "its own padded length (a pipeline of variable shapes, as Megatron-LM's --variable-seq-lengths runs); "
              "meshplan train pads every micro-batch to the longest length under a pipeline (one shape per schedule)"]
             if info.get("pipelines_padded") else [])
    if best is None:
        return [tried + ("; none fits with headroom" if info["candidates"] else
                         " (no base plan without a pipeline to build them from)")] + piped
    out = [tried, f"  best bucket plan {best['plan']}: {seconds(best['step_time_s'])} expected"] + piped
    if one is not None:
        gain = 100 * (1 - best["step_time_s"] / one["step_time_s"])
        out.append(f"  best one-shape plan meshplan train runs, {one['plan']}: {seconds(one['step_time_s'])} "
                   f"({'buckets save' if gain >= 0 else 'buckets lose'} {abs(gain):.1f}%)")
    return out


def lengths_json(result: Any, params: Any) -> dict[str, Any]:
    """--json's "lengths": the distribution, and the winner's expected step, even-load step and
    imbalance (cost.lengths_summary)."""
    d = result.work.lengths
    out: dict[str, Any] = {"lengths": d.text(), "packing": d.packing, "mean_length": d.mean_len,
                           "max_length": d.max_len}
    if result.plans:
        from meshplan.cost import lengths_summary
        b = result.plans[0]
        out["best"] = lengths_summary(result.model, b.cluster, b.plan, result.work, params)
    return out
