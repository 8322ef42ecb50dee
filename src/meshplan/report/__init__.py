"""`meshplan report`: one self-contained HTML page for a planning problem.

    build_report(model, clusters, work, space) -> Report      (search + simulate the winner)
    Report.html()                                              (the page, a pure function)
    write_html(path, text)

The page shows the problem, the top plans, the Pareto front (time, memory, dollars), time
and memory breakdowns, the winner's simulated timeline (meshplan.sim) and the search's
explanation; for an infeasible problem, what would make it feasible. Figures are inline SVG
drawn here (report.svg, report.charts); numpy only: no torch, no matplotlib, no network.

``model`` is a LayerGraph (any model: a transformer description generated into one, or a traced
model), searched by search.search and simulated by sim.simulate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.cost.memory import usable_gib
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.errors import MeshplanError
from meshplan.search import search
from meshplan.search.result import SearchResult
from meshplan.spec.cluster import ClusterSpec, PooledCluster
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Workload

__all__ = ["MAX_SIM_PASSES", "Report", "build_report", "model_arg", "simulate_winner", "write_html"]


@dataclass
class Report:
    """Everything the page shows."""

    result: SearchResult
    usable_gib: float
    sim: Any = None
    """meshplan.sim.SimResult of the winner, or None (no winner, or not simulated)."""
    sim_summary: dict[str, Any] | None = None
    sim_error: str | None = None
    """Why the winner was not simulated (e.g. a schedule the simulator does not model)."""
    train: list[dict[str, float] | None] | None = None
    """Per top plan: days and dollars to train --train-tokens (None without it)."""
    command: str | None = None

    def html(self) -> str:
        if self.result.pooled:  # a cluster of several pools: what each pool does (report.pools)
            from meshplan.report.pools import render_pooled
            return render_pooled(self.result, self.sim, self.sim_summary, self.command)
        from meshplan.report.page import render
        return render(self.result, usable_gib=self.usable_gib, sim=self.sim, sim_summary=self.sim_summary,
                      sim_error=self.sim_error, train=self.train, command=self.command)


MAX_SIM_PASSES = 25_000
"""The winner's step is simulated when it has at most this many pipeline passes (forward and
backward per micro-batch, virtual stage and rank: about a second of simulation); beyond,
the page says how to simulate it with `meshplan simulate`."""


def sim_passes(plan: Any, microbatches: int) -> int:
    """Forward and backward passes of one step over all pipeline ranks and virtual stages."""
    v = plan.virtual_stages if plan.schedule == "interleaved-1f1b" and plan.pp > 1 else 1
    return plan.pp * v * microbatches * 2


def model_arg(model: ModelSpec | LayerGraph) -> str:
    """What ``--model`` rebuilds ``model`` from: a preset's name, or an ingested graph's source."""
    return getattr(model, "source", None) or model.name


def simulate_winner(result: SearchResult, params: CostParams = DEFAULT_PARAMS, max_passes: int = MAX_SIM_PASSES,
                    model: str | None = None) -> tuple[Any, dict[str, Any] | None, str | None]:
    """(SimResult, summary, None), or (None, None, why) when there is no winner, its step is
    too long to simulate quickly, or the simulator cannot run its plan. ``model``: the --model of the command the page
    suggests for a long step (default: ``model_arg`` of the result's model)."""
    import meshplan.sim as sim
    if result.pooled:  # every rank on its own pool's hardware (sim.simulate of a plan over pools)
        if result.best_pooled is None:
            return None, None, "no plan fits"
        try:
            res, summary = sim.simulate(result.model, result.clusters[0], result.best_pooled.plan, result.work,
                                        params)
        except MeshplanError as e:
            return None, None, str(e)
        return res, summary, None
    best = result.best
    if best is None:
        return None, None, "no plan fits"
    n = sim_passes(best.plan, best.report.microbatches)
    if n > max_passes:
        w = result.work
        return None, None, (f"the winner runs {n:,} pipeline passes per step, over the report's limit of "
                            f"{max_passes:,} that keeps it fast; simulate it with: meshplan simulate --model "
                            f"{model or model_arg(result.model)} --cluster {best.cluster.name} --global-batch "
                            f"{w.global_batch} --seq-len {w.lengths.text() if w.varied and w.lengths else w.seq_len} "
                            f"--plan {best.plan.short()} --trace trace.json")
    try:  # under a length distribution: sampled batches (sim.simulate)
        res, summary = sim.simulate(result.model, best.cluster, best.plan, result.work, params)
    except MeshplanError as e:
        return None, None, str(e)
    return res, summary, None


def build_report(model: ModelSpec | LayerGraph, clusters: ClusterSpec | PooledCluster | list[Any], work: Workload,
                 space: Any = None, *, objective: str = "time", top: int = 5,
                 params: CostParams = DEFAULT_PARAMS, progress: Any = None, simulate: bool = True,
                 command: str | None = None, model_name: str | None = None) -> Report:
    """Search, then simulate the winner: the inputs of the page.

    ``space``: a SearchSpace (None: the default space). ``model_name``: the --model the page's
    commands use (default ``model_arg(model)``). ``clusters``: any cluster, or several sizes
    (search.search)."""
    clusters = [clusters] if isinstance(clusters, (ClusterSpec, PooledCluster)) else list(clusters)
    result = search(model, clusters[0] if len(clusters) == 1 else clusters, work, space, params=params,
                    objective=objective, top=top, progress=progress)
    sim, summary, err = (simulate_winner(result, params, model=model_name) if simulate
                         else (None, None, "simulation switched off"))
    if result.best_pooled is not None:
        usable = min(p.usable_memory_gib for p in result.best_pooled.parts)
    else:
        ref = result.best.cluster if result.best is not None else clusters[-1]
        usable = usable_gib(ref.pools[0], params)
    return Report(result=result, usable_gib=usable, sim=sim, sim_summary=summary,
                  sim_error=err, command=command)


def write_html(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise MeshplanError(f"cannot write --out {path}: {e.strerror or e}",
                            hint="give a path in an existing, writable directory") from None
