"""`meshplan simulate`: a discrete-event simulation of one training step of a plan.

Wire into meshplan.cli.main: ``simulate_cmd.add_parser(sub)`` in build_parser and
``"simulate": simulate_cmd.run`` in COMMANDS. Numpy only (matplotlib for a --plot other than .svg).
``--model`` takes every kind ``meshplan estimate`` does: a transformer (preset/ModelSpec) or a layer
graph (``hf:``/``module:`` through ingestion, or a graph .json), all simulated by ``sim.simulate`` (any cluster, plan and workload).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from meshplan.cli.args import positive_int
from meshplan.cli.format import json_doc, slow_step
from meshplan.cli.planfile import FROM_FILE, add_override


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `simulate` subcommand's arguments."""
    p = sub.add_parser("simulate", help="simulate one training step of a plan (timeline, trace, memory)",
                       description="Discrete-event simulation of one step on every pipeline rank: "
                                   "compute, TP/CP/EP, data-parallel and pipeline-send streams, the "
                                   "schedule micro-batch by micro-batch. Durations from the cost model.")
    p.add_argument("--model",
                   help="preset name, ModelSpec .toml/.json, hf:CONFIG.json, module:pkg.mod:factory, "
                        "or a layer graph .json from `meshplan ingest --out`" + FROM_FILE)
    p.add_argument("--cluster", help="GPU:COUNT, GPU:NODESxPER_NODE, a cluster preset or .toml" + FROM_FILE)
    p.add_argument("--plan", required=True,
                   help="tp=..,pp=..,dp=..,... or a plan file from `meshplan plan --out`, which also gives "
                        "the model, cluster, global batch and seq len")
    p.add_argument("--global-batch", type=positive_int("--global-batch"),
                   help="sequences (samples, for an ingested model) per step" + FROM_FILE)
    from meshplan.cli.lengths_arg import add_packing, seq_len_type
    p.add_argument("--seq-len", type=seq_len_type,
                   help="tokens per sequence (default: the plan file's, else the model's; an ingested model "
                        "is traced at it), or a distribution of sample lengths (2048:0.6,8192:0.3,32768:0.1 or a "
                        "histogram file): --batches sampled steps are simulated (sim.varlen)")
    add_packing(p)
    from meshplan.cli.args import add_optimizer
    add_optimizer(p)
    p.add_argument("--batches", type=positive_int("--batches"), default=100,
                   help="with a --seq-len distribution: sampled global batches to simulate (default 100)")
    p.add_argument("--seed", type=int, default=0, help="with a --seq-len distribution: the sampling seed (default 0)")
    add_override(p)
    from meshplan.cli.costing import add_cost_flags
    add_cost_flags(p, policy=True)
    p.add_argument("--trace", help="write a Chrome/Perfetto trace (JSON) to this file")
    p.add_argument("--plot", help="write the Gantt chart per pipeline rank and memory over time (the report's "
                                  "timeline) to this image: .svg, or png, pdf, ... with matplotlib")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p


def run(args: argparse.Namespace) -> int:
    from meshplan.cli.planfile import resolve
    from meshplan.sim.output import check_plot_path
    if args.plot:
        check_plot_path(args.plot)  # before any work: the format can be written (matplotlib if not .svg)
    from meshplan.cli.lengths_arg import lengths_of
    lengths = lengths_of(args)  # a --seq-len distribution (or the plan file's), before the file is resolved
    inputs = resolve(args, required=("model", "cluster", "global_batch"))
    from meshplan.cli.costing import costing
    from meshplan.cli.model_arg import as_problem
    from meshplan.sim import simulate
    cost = costing(args)
    cluster, plan = cost.cluster(inputs.cluster()), inputs.plan
    model, work = as_problem(inputs.model(), inputs.global_batch, inputs.seq_len, lengths, inputs.optimizer)
    if getattr(model, "model", None) is not None:  # past the trained context: a note; past a learned table: an error
        from meshplan.cli.plan_cmd import check_positions
        check_positions(args, model.model, work.seq_len)
    if len(cluster.pools) == 1:  # (a plan over pools is checked pool by pool)
        from meshplan.cost import check
        check(model, cluster, plan, work)
    what = f"simulating {args.batches} sampled steps" if work.varied else "simulating the step"
    with slow_step(what):
        res, sim_summary = simulate(model, cluster, plan, work, cost.params, batches=args.batches, seed=args.seed)
    if "pools" in sim_summary:  # every pool's ranks on its own hardware
        return _pooled(args, model, cluster, plan, work, cost, res, sim_summary)
    if "sampled" in sim_summary:  # sampled batches of the length distribution (sim.varlen)
        if len(cluster.pools) > 1:
            print(f"meshplan: note: the plan runs on pool {plan.pools[0]} alone: simulated on that pool",
                  file=sys.stderr)
            cluster, plan = cluster.pool(plan.pools[0]), plan.replace(pools=None)
        return _sampled(args, model, cluster, plan, work, cost, res, sim_summary)
    _write_outputs(args, res, f"{model.name} on {cluster.name}: {plan.short()}")
    summary: dict[str, Any] = _problem(model, cluster, plan, work) | sim_summary | cost.to_json()
    from meshplan.cost import estimate
    est = estimate(model, cluster, plan, work, cost.params)  # the band: the estimate's, relative
    rel = summary["step_time_s"] / est.step_time_s
    summary |= {"step_time_s_low": est.step_time_s_low * rel, "step_time_s_high": est.step_time_s_high * rel,
                "peak_memory_gib": est.peak_memory_gib, "peak_memory_gib_high": est.peak_memory_gib_high,
                "oom_probability": est.oom_probability, "verdict": est.verdict}
    if args.json:
        print(json_doc("simulate", summary))
        return 0
    for line in cost.lines():
        print(line)
    from meshplan.cli.format import seconds
    from meshplan.sim import STREAMS
    print(f"simulated step: {seconds(summary['step_time_s'])}   analytical estimate: "
          f"{seconds(summary['analytic_step_time_s'])} ({summary['sim_vs_analytic_pct']:+.2f}%); 90% band "
          f"{seconds(summary['step_time_s_low'])} to {seconds(summary['step_time_s_high'])}; memory: "
          f"{summary['verdict']} ({100 * summary['oom_probability']:.1f}% chance of running out)")
    print(f"schedule {summary['schedule']}, {summary['microbatches']} micro-batches, "
          f"ranks idle waiting on the pipeline {100 * summary['bubble_fraction']:.1f}% of the step "
          f"(averaged over ranks, the drain included; `estimate`'s 'pipeline bubble' is the critical "
          f"rank's bubble time)")
    print(f"{'rank':>4}  " + "  ".join(f"{s + ' busy':>13}" for s in STREAMS)
          + f"  {'peak GiB':>9}")
    for r in summary["ranks"]:
        print(f"{r['rank']:>4}  " + "  ".join(f"{seconds(r['busy_s'][s]):>13}" for s in STREAMS)
              + f"  {r['peak_memory_gib']:>9.1f}")
    for label, path in (("trace", args.trace), ("plot", args.plot)):
        if path:
            print(f"{label}: {path}")
    return 0


def _sampled(args: argparse.Namespace, model: Any, cluster: Any, plan: Any, work: Any, cost: Any, ex: Any,
             sim: dict[str, Any]) -> int:
    """`meshplan simulate --seq-len DIST`: --batches sampled steps (sim.varlen) beside the cost
    model's expected step; --trace / --plot draw the first batch's slowest replica (a bucket plan's
    every rank)."""
    from meshplan.cli.format import seconds
    s, est = sim["varlen"], sim["analytic"]
    mean = s["mean_step_s"]
    out: dict[str, Any] = _problem(model, cluster, plan, work) | s | {
        "analytic": est, "analytic_vs_sim_pct": 100 * (est["expected_step_s"] / mean - 1),
        "example_replica_lengths": sim["example_replica_lengths"]} | cost.to_json()
    _write_outputs(args, ex, f"{model.name} on {cluster.name}: {plan.short()}, {sim['sampled']['timeline']} "
                             f"({work.lengths.text()}, {work.lengths.packing})")
    if args.json:
        print(json_doc("simulate", out))
        return 0
    for line in cost.lines():
        print(line)
    print(f"simulated {s['batches']} sampled steps (seed {s['seed']}) of {work.global_batch} samples, lengths "
          f"{s['lengths']} ({s['packing']}): mean {seconds(mean)}, p50 {seconds(s['p50_step_s'])}, p90 "
          f"{seconds(s['p90_step_s'])} (min {seconds(s['min_step_s'])}, max {seconds(s['max_step_s'])})")
    print(f"at even load (every micro-batch the step's mean) {seconds(s['mean_even_step_s'])}: "
          f"{seconds(s['imbalance_s'])} lost to imbalance")
    print(f"cost model: expected step {seconds(est['expected_step_s'])} ({out['analytic_vs_sim_pct']:+.2f}% vs the "
          f"simulated mean), {seconds(est['step_time_even_s'])} at even load + {seconds(est['imbalance_s'])} "
          "imbalance")
    if s["step_at_length_s"]:
        print("a step of one length: " + ", ".join(f"{k}: {seconds(v)}" for k, v in s["step_at_length_s"].items()))
    for label, path in (("trace", args.trace), ("plot", args.plot)):
        if path:
            print(f"{label} (the first batch's {'ranks' if plan.buckets else 'slowest replica'}): {path}")
    return 0


def _pooled(args: argparse.Namespace, model: Any, pc: Any, plan: Any, work: Any, cost: Any, res: Any,
            sim: dict[str, Any]) -> int:
    """`meshplan simulate` of a plan over GPU pools (sim.pools): every pool's ranks on its own GPU."""
    from meshplan.cli.format import seconds
    _write_outputs(args, res, f"{model.name} on {pc.name}: {plan.short()}")
    summary = _problem(model, pc, plan, work) | sim | cost.to_json()
    if getattr(args, "json", False):
        print(json_doc("simulate", summary))
        return 0
    one = len(summary["pools"]) == 1 and not sim["cross_pool_s"] and not summary["imbalance_s"]  # on one pool
    print(f"simulated step: {seconds(sim['step_time_s'])}   analytical estimate: "
          f"{seconds(sim['analytic_step_time_s'])} ({summary['sim_vs_analytic_pct']:+.2f}%)"
          + ("" if one else f"; across pools {seconds(sim['cross_pool_s'])}; time lost to imbalance "
                            f"{seconds(summary['imbalance_s'])} per step (GPU-weighted)"))
    if "verdict" in sim:  # the tightest pool's, as for one GPU type
        print(f"memory: {sim['verdict']} ({100 * sim['oom_probability']:.1f}% chance of running out; tightest pool "
              f"{sim['memory_pool']}: {sim['memory_pool_peak_gib']:.1f} of {sim['memory_pool_usable_gib']:.1f} GiB "
              "usable)")
    print(f"{'pool':<8} {'gpu':<16} {'ranks':<10} {'compute busy':>13} {'utilisation':>12} {'idle':>10}")
    for p in summary["pools"]:
        rk = f"{p['ranks'][0]}-{p['ranks'][-1]}" if len(p["ranks"]) > 1 else str(p["ranks"][0])
        print(f"{p['pool']:<8} {p['gpu']:<16} {rk:<10} {seconds(p['busy_s']):>13} {100 * p['utilisation']:>11.0f}% "
              f"{seconds(p['idle_s']):>10}")
    print("(compute busy and utilisation: the pool's busiest rank's compute stream; idle: the rest of the step, "
          "the pipeline's bubble included)")
    for n in sim["notes"]:
        print(f"note: {n}")
    print("note: the pools' GPU types are emulated by per-rank durations from the cost model; `meshplan train` "
          "on CPU runs every rank at the same speed")
    for label, path in (("trace", args.trace), ("plot", args.plot)):
        if path:
            print(f"{label}: {path}")
    return 0


def _problem(model: Any, cluster: Any, plan: Any, work: Any) -> dict[str, Any]:
    """What was simulated, the head of every --json summary."""
    return {"model": model.name, "cluster": cluster.name, "plan": plan.short(), "global_batch": work.global_batch,
            "seq_len": work.seq_len, "optimizer": work.optimizer}


def _write_outputs(args: argparse.Namespace, res: Any, title: str) -> None:
    """--trace and --plot of the timeline ``res`` (progress on stderr when a write is slow)."""
    from meshplan.sim import write_plot, write_trace
    if args.trace:
        with slow_step(f"writing the trace ({len(res.events):,} events)"):
            write_trace(res, args.trace)
    if args.plot:
        with slow_step(f"drawing the plot ({len(res.events):,} events)"):
            write_plot(res, args.plot, title=title)
