"""`meshplan plan` / `estimate` / `simulate` on a cluster of several GPU pools (cluster files
with [[pools]]; spec.cluster.PooledCluster, cost.pools, search.pools, sim.pools)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.units import human_seconds as hs

UNSUPPORTED = {"gpus": "--gpus", "deadline": "--deadline", "plot": "--plot", "price_per_gpu_hour":
               "--price-per-gpu-hour"}


def is_pooled(arg: Any, args: argparse.Namespace | None = None) -> bool:
    """Whether --cluster (or, without it, the cluster a --plan file records) has several pools.
    With ``args``, a pooled plan file's model, cluster, global batch and sequence fill the flags
    that were not given (the file reloads as `meshplan plan --out` wrote it)."""
    from meshplan.spec.cluster import PooledCluster
    from meshplan.spec.io import load_cluster
    if arg is None and args is not None:
        arg = _file_cluster(args)
    if arg is None:
        return False
    try:
        pooled = isinstance(load_cluster(arg), PooledCluster)
    except MeshplanError:
        return False  # the command's own loading says what is wrong
    if pooled and args is not None:
        _fill_from_plan_file(args, arg)
    return pooled


def _plan_doc(args: argparse.Namespace) -> tuple[str, dict[str, Any]] | None:
    from meshplan.cli.planfile import is_file_arg
    from meshplan.spec.io import read_data_file
    path = getattr(args, "plan", None)
    if not is_file_arg(path):
        return None
    try:
        doc = read_data_file(path)
    except MeshplanError:
        return None  # the plan's own loading says what is wrong
    return (path, doc) if isinstance(doc, dict) and isinstance(doc.get("plan"), dict) else None


def _file_cluster(args: argparse.Namespace) -> str | None:
    """The pooled cluster a --plan file records (next to the file when relative)."""
    from meshplan.cli.planfile import _near
    got = _plan_doc(args)
    if got is None or not isinstance(got[1].get("cluster"), str):
        return None
    return _near(got[1]["cluster"], got[0])


def _fill_from_plan_file(args: argparse.Namespace, cluster: str) -> None:
    got = _plan_doc(args)
    if getattr(args, "cluster", None) is None:
        args.cluster = cluster
    if got is None:
        return
    doc = got[1]
    for key in ("model", "global_batch", "seq_len"):
        if key == "seq_len" and doc.get("lengths"):
            continue  # a recorded distribution: cli.lengths_arg.lengths_of reads it (and its longest) from the file
        if getattr(args, key, None) is None and doc.get(key) is not None:
            setattr(args, key, doc[key])
    # (a recorded length distribution is read by cli.lengths_arg.lengths_of from the file itself)


def _refuse(args: argparse.Namespace) -> None:
    for key, flag in UNSUPPORTED.items():
        if getattr(args, key, None) not in (None, False):
            raise MeshplanError(f"{flag} is not supported with a cluster of several pools ({args.cluster})",
                                hint=f"drop {flag}" + (" (each [[pools]] table sets its price_per_gpu_hour_usd)"
                                                       if key == "price_per_gpu_hour" else ""))


def load(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(graph, pooled cluster, workload, cost) of a command on a pooled cluster."""
    from meshplan.cli.costing import costing
    from meshplan.cli.model_arg import as_problem, load_model_arg
    from meshplan.spec.io import load_cluster
    cost = costing(args)
    pc = load_cluster(args.cluster)
    if cost.calibration is not None:
        pc = type(pc)(name=pc.name, pools=tuple(cost.cluster(p) for p in pc.pools), inter_pool=pc.inter_pool)
    from meshplan.cli.lengths_arg import lengths_of, stash
    stash(args)
    lengths = lengths_of(args)  # a --seq-len distribution: each pool's part priced by cost.lengths
    seq = args.seq_len if lengths is None else lengths.max_len
    model, work = as_problem(load_model_arg(args.model, seq_len=seq), args.global_batch, seq, lengths)
    return model, pc, work, cost


def run_plan(args: argparse.Namespace) -> int:
    from meshplan.cli.plan_cmd import search_space
    from meshplan.search.pools import search_pools
    _refuse(args)
    model, pc, work, cost = load(args)
    space = search_space(args, pc.pools[0], model)
    objective = args.objective if args.objective in ("time", "cost") else "time"
    res = search_pools(model, pc, work, space, params=cost.params, objective=objective, top=args.top)
    if args.json:
        from meshplan.cli.format import json_text
        doc = res.to_dict() | cost.to_json()
        print(json_text(doc))
    else:
        print(text(res, model, work))
    if res.best is None:
        raise MeshplanError(f"no plan fits {model.name} on any pool of {pc.name} with global batch "
                            f"{work.global_batch} x {work.seq_len}",
                            hint="more GPUs, a smaller global batch or sequence, or a GPU with more memory")
    if args.out is not None:
        write_out(args.out, res, model, args)
    return 0


def text(res: Any, model: Any, work: Any) -> str:
    pc = res.cluster
    from meshplan.cli.views import workload_text
    d = work.lengths
    dist = "" if d is None or len(d.lengths) == 1 else f" (lengths {d.text()})"
    lines = [f"{model.name} on {pc.name} ({pc.describe()}; {pc.num_gpus} GPUs), {workload_text(work)}{dist}, "
             f"objective {res.objective}",
             f"searched {res.considered:,} plans in {res.search_time_s:.1f} s (every pool alone, replicas on "
             "every pool, pipeline stages on every pool)", ""]
    lines += res.explanation
    lines += ["", f"{'step':>10} {'GPUs':>5} {'$/M tok':>8} {'MFU':>5}  plan"]
    for e in res.plans:
        lines.append(f"{hs(e.step_time_s):>10} {e.num_gpus:5d} {e.usd_per_m_tokens:8.3f} {100 * e.mfu:4.0f}%  "
                     f"{e.plan.short()}")
    return "\n".join(lines)


def write_out(path: str, res: Any, model: Any, args: argparse.Namespace) -> None:
    """--out: the winner as a plan file that every command reloads (cli.pools_cmd.is_pooled reads
    its cluster, recorded relative to the file, which cli.planfile._near resolves)."""
    import os

    from meshplan.cli.plan_cmd import write_plan_file
    from meshplan.spec.io import plan_document
    best = res.best
    cluster = str(args.cluster)
    if os.path.isfile(cluster):
        cluster = os.path.relpath(os.path.abspath(cluster), os.path.dirname(os.path.abspath(path)))
    extra = ({"lengths": res.work.lengths.text(), "packing": res.work.lengths.packing}
             if res.work.lengths is not None else {})
    doc = plan_document(best.plan, model=getattr(model, "source", None) or model.name, cluster=cluster,
                        global_batch=res.work.global_batch, seq_len=res.work.seq_len, predicted=best.to_dict(),
                        **extra)
    write_plan_file(path, doc)


def run_estimate(args: argparse.Namespace) -> int:
    """`meshplan estimate --cluster POOLS.toml --plan ...,pools=...`."""
    from meshplan.cli.format import json_text
    from meshplan.cost.pools import estimate_pooled
    from meshplan.spec.io import load_plan
    model, pc, work, cost = load(args)
    plan = load_plan(args.plan)
    from meshplan.cli.lengths_arg import no_pools
    no_pools(work.lengths, plan)
    e = estimate_pooled(model, pc, plan, work, cost.params)
    lengths = None if work.lengths is None else {"lengths": work.lengths.text(), "packing": work.lengths.packing,
                                                 "mean_length": work.lengths.mean_len,
                                                 "max_length": work.lengths.max_len}
    if getattr(args, "json", False):
        print(json_text(e.to_dict() | {"global_batch": work.global_batch, "seq_len": work.seq_len}
                        | ({"lengths": lengths} if lengths else {}) | cost.to_json()))
        return 0
    print(estimate_text(e, pc, work))
    return 0


def estimate_text(e: Any, pc: Any, work: Any = None) -> str:
    lines = [f"plan         {e.plan.short()}",
             f"cluster      {pc.name}: {pc.describe()}",
             f"step time    {hs(e.step_time_s)}   ({e.tokens_per_s:,.0f} tokens/s, MFU {100 * e.mfu:.1f}% of "
             f"the GPUs' own peaks, ${e.usd_per_m_tokens:.3f} per M tokens)",
             f"fits         {'yes' if e.fits else 'NO'}"]
    if work is not None:
        from meshplan.cli.views import workload_text
        lines.insert(2, f"workload     {workload_text(work)} = {work.tokens:,} tokens/step"
                     + ("; each pool's part is its expected step over the distribution (cost.lengths)"
                        if work.varied else ""))
    for p in e.parts:
        lines.append(f"pool {p.name:<8}{p.gpus} of {p.gpus_total} {p.gpu}: {p.role}")
        share = f"busy {100 * p.busy_fraction:.0f}% of the step on average"
        lines.append(f"{'':13}own part {hs(p.step_s)} ({share}), waits "
                     f"{hs(p.idle_s)} for the slowest pool, memory {p.peak_memory_gib:.1f} of "
                     f"{p.usable_memory_gib:.1f} GiB"
                     + ("" if p.fits else "  DOES NOT FIT"))
    lines.append(f"across pools {hs(e.cross_pool_s)} per step ({e.cross_pool_gb:.2f} GB per GPU over inter_pool)")
    lines.append(f"imbalance    {hs(e.imbalance_s)} per step lost waiting for the slowest pool (GPU-weighted)")
    lines += [f"note         {n}" for n in e.notes]
    return "\n".join(lines)


def run_simulate(args: argparse.Namespace) -> int:
    """`meshplan simulate --cluster POOLS.toml --plan ...,pools=...`: every pool's ranks on its own GPU."""
    from meshplan.cli.format import json_text, seconds, slow_step
    from meshplan.sim import write_plot, write_trace
    from meshplan.sim.pools import simulate_pooled
    from meshplan.spec.io import load_plan
    model, pc, work, cost = load(args)
    plan = load_plan(args.plan)
    if work.varied:  # sampled batches on one GPU type: a plan on one pool (a bucket plan, say) on that pool
        from meshplan.cli.lengths_arg import no_pools, simulate_lengths_cmd
        if plan.pools is not None and len(plan.pools) == 1 and plan.dp_shares is None:
            print(f"meshplan: note: the plan runs on pool {plan.pools[0]} alone: simulated on that pool",
                  file=sys.stderr)
            return simulate_lengths_cmd(args, model, pc.pool(plan.pools[0]), plan.replace(pools=None), work, cost)
        no_pools(work.lengths, plan, simulate=True)
    with slow_step("simulating the step"):
        sim = simulate_pooled(model, pc, plan, work, cost.params)
    res = sim.result
    if args.trace:
        write_trace(res, args.trace)
    if args.plot:
        write_plot(res, args.plot, title=f"{model.name} on {pc.name}: {plan.short()}")
    summary = {"model": model.name, "cluster": pc.name, "plan": plan.short(), "global_batch": work.global_batch,
               "seq_len": work.seq_len} | sim.summary() | cost.to_json()
    if getattr(args, "json", False):
        print(json_text(summary))
        return 0
    print(f"simulated step: {seconds(sim.step_time_s)}   analytical estimate: {seconds(sim.analytic_step_time_s)} "
          f"({summary['sim_vs_analytic_pct']:+.2f}%); across pools {seconds(sim.cross_pool_s)}; time lost to "
          f"imbalance {seconds(summary['imbalance_s'])} per step (GPU-weighted)")
    print(f"{'pool':<8} {'gpu':<16} {'ranks':<10} {'compute busy':>13} {'utilisation':>12} {'idle':>10}")
    for p in summary["pools"]:
        rk = f"{p['ranks'][0]}-{p['ranks'][-1]}" if len(p["ranks"]) > 1 else str(p["ranks"][0])
        print(f"{p['pool']:<8} {p['gpu']:<16} {rk:<10} {seconds(p['busy_s']):>13} {100 * p['utilisation']:>11.0f}% "
              f"{seconds(p['idle_s']):>10}")
    print("(compute busy and utilisation: the pool's busiest rank's compute stream; idle: the rest of the step, "
          "the pipeline's bubble included)")
    for n in sim.notes:
        print(f"note: {n}")
    print("note: the pools' GPU types are emulated by per-rank durations from the cost model; `meshplan train` "
          "on CPU runs every rank at the same speed")
    for label, path in (("trace", args.trace), ("plot", args.plot)):
        if path:
            print(f"{label}: {path}")
    return 0


def run_report(args: argparse.Namespace, command: str) -> int:
    """`meshplan report --cluster POOLS.toml`: the pooled search, its best plan simulated, one page."""
    from meshplan.cli.plan_cmd import search_space
    from meshplan.report import write_html
    from meshplan.report.pools import render_pooled
    from meshplan.search.pools import search_pools
    from meshplan.sim.pools import simulate_pooled
    _refuse(args)
    model, pc, work, cost = load(args)
    space = search_space(args, pc.pools[0], model)
    objective = args.objective if args.objective in ("time", "cost") else "time"
    res = search_pools(model, pc, work, space, params=cost.params, objective=objective, top=args.top)
    res.model_name = model.name  # type: ignore[attr-defined]
    sim = simulate_pooled(model, pc, res.best.plan, work, cost.params) if res.best is not None else None
    text = render_pooled(res, sim, command)
    write_html(args.out, text)
    if res.best is None:
        print(f"wrote {args.out}: no plan fits on any pool")
    else:
        print(f"wrote {args.out}: best plan {res.best.plan.short()}, {hs(res.best.step_time_s)} per step")
    return 0
