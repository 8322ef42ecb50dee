"""Simulating a plan over several GPU pools (cost.pools): every rank on its own pool's hardware.

- pool_dp: each pool's replicas are simulated as a plan of their own on that pool (the
  replica with the most micro-batches, which sets the pool's step); the step is the slowest
  pool's simulated step plus the cross-pool gradient exchange (cost.pools), and every other
  pool idles for the difference: drawn as a "waits for pool X" event on its ranks.
- pool_pp: one pipeline whose rank r takes its durations from its own pool's hardware
  (cost.durations evaluated once per pool, spliced per rank); the sends that cross from one
  pool to the next carry the extra time of the inter_pool link on the boundary ranks.
- device order (neither pool_dp nor pool_pp, cost.pools.device_order): the same one pipeline,
  each stage taking the durations of the slowest pool its GPUs touch, the sends where a replica's
  two stages lie in different pools slower by inter_pool, and a stage whose data-parallel group
  spans pools ending its step with the exchange across them (cost.pools.device_splice). A stage
  whose tensor- or context-parallel group spans pools takes the durations of its slowest member's
  GPU on the slowest link it crosses (cost.pools.spanning_cluster). With uneven dp_shares, one
  pipeline per class of replicas (its micro-batches, its own GPUs), the longest setting the step.

On CPU (meshplan train) the pools are only emulated: the GPU types differ in this simulator and
the cost model, never in the local processes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.durations import StageDurations, stage_durations
from meshplan.cost.lengths import graph_at
from meshplan.cost.pools import (
    PooledEstimate,
    as_run,
    device_order,
    device_splice,
    estimate_pooled,
    plan_pools,
    pool_cluster,
    pool_pipeline_cross,
    replica_parts,
)
from meshplan.sim.build import run_and_summarise, spec_from_durations, spec_from_plan
from meshplan.sim.engine import Event, SimResult, run
from meshplan.sim.varlen import DEFAULT_BATCHES, sampled, simulate_lengths
from meshplan.spec.axes import AX
from meshplan.spec.cluster import ClusterSpec, PooledCluster
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload


@dataclass
class PoolSim:
    name: str
    gpu: str
    result: SimResult
    """The pool's simulated step (its slowest replica, or the whole pipeline under pool_pp)."""
    ranks: list[int]
    """Pipeline ranks of the combined timeline that belong to this pool."""
    busy_s: float = 0.0
    """Compute-stream seconds of the pool's busiest rank in the step."""
    idle_s: float = 0.0
    """Seconds of the step the pool's busiest rank does not compute (bubble, waits, syncs)."""


@dataclass
class PooledSimulation:
    plan: Plan
    step_time_s: float
    analytic_step_time_s: float
    pools: list[PoolSim]
    result: SimResult
    """The combined timeline (pools' ranks one after another), for traces and figures."""
    cross_pool_s: float = 0.0
    estimate: PooledEstimate | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        t = self.step_time_s
        return {"step_time_s": t, "analytic_step_time_s": self.analytic_step_time_s,
                "sim_vs_analytic_pct": 100 * (t / self.analytic_step_time_s - 1), "cross_pool_s": self.cross_pool_s,
                "pools": [{"pool": p.name, "gpu": p.gpu, "ranks": p.ranks, "busy_s": p.busy_s, "idle_s": p.idle_s,
                           "utilisation": p.busy_s / t if t else 0.0} for p in self.pools],
                "imbalance_s": self.estimate.imbalance_s if self.estimate else 0.0, "notes": list(self.notes)} | (
                    self._memory() if self.estimate else {})

    def _memory(self) -> dict[str, Any]:
        """The memory verdict, as for one GPU type: the tightest pool's (cost.pools.PooledEstimate)."""
        e = self.estimate
        assert e is not None
        t = e.tightest
        return {"peak_memory_gib": e.peak_memory_gib, "oom_probability": e.oom_probability, "verdict": e.verdict,
                "memory_pool": t.name, "memory_pool_peak_gib": t.peak_memory_gib,
                "memory_pool_usable_gib": t.usable_memory_gib}


def simulate_pooled(model: LayerGraph | ModelSpec, cluster: ClusterSpec | PooledCluster, plan: Plan, work: Workload,
                    params: CostParams = DEFAULT_PARAMS, *, batches: int = DEFAULT_BATCHES,
                    seed: int = 0) -> PooledSimulation:
    """Simulate one step of a plan over pools (see the module docstring); under a length
    distribution each pool's step is the mean of ``batches`` sampled steps (sim.varlen)."""
    est = estimate_pooled(model, cluster, plan, work, params)
    pools = plan_pools(cluster, plan)
    if (plan.pool_pp is not None and len(pools) > 1) or device_order(plan):
        return _pipeline(model, cluster, pools, plan, work, params, est, batches, seed)
    ran, _ = as_run(plan)  # the replicas as the cost model times them
    sims = []
    steps: list[float] = []
    for part in replica_parts(pools, ran, work):
        if work.varied:  # each pool's step: the mean over sampled batches; its timeline: the first batch
            res, s = sampled(model, part.cluster, part.plan, part.work, params, batches=batches, seed=seed)
            steps.append(s["step_time_s"])
        else:
            res, _ = run_and_summarise(*spec_from_plan(model, part.cluster, part.plan, part.work, params))
            steps.append(res.step_time_s)
        sims.append((part.pool, res))
    slowest = max(steps)
    step = slowest + est.cross_pool_s
    events: list[Event] = []
    memory: list = []
    wait: list[float] = []
    out: list[PoolSim] = []
    offset = 0
    for (pool, res), own in zip(sims, steps):
        ranks = list(range(offset, offset + res.pp))
        for e in res.events:
            events.append(dataclasses.replace(e, rank=e.rank + offset, args={**e.args, "pool": pool.name}))
        idle = slowest - own
        for r in range(res.pp):
            if idle > 0 and res.step_time_s < slowest:
                events.append(Event(offset + r, "compute", "waits for the slowest pool", res.step_time_s, slowest,
                                    {"pool": pool.name}))
            if est.cross_pool_s > 0:
                events.append(Event(offset + r, AX.DP, "cross-pool gradient exchange", slowest, step,
                                    {"pool": pool.name}))
        memory += res.memory
        wait += res.wait_s
        busy = max(res.busy(r, "compute") for r in range(res.pp))
        if work.varied:  # the timeline is one sampled batch: its busy time scaled to the pool's mean step
            busy *= own / res.step_time_s
        out.append(PoolSim(pool.name, pool.gpu.name, res, ranks, busy_s=busy, idle_s=step - busy))
        offset += res.pp
    labels = {r.rank_label for _, r in sims}
    drawn = max([step] + [r.step_time_s + est.cross_pool_s for _, r in sims])  # a sampled batch may run longer
    combined = SimResult(step_time_s=drawn, events=events, memory=memory, pp=offset, wait_s=wait,
                         rank_label=labels.pop() if len(labels) == 1 else "rank")
    return PooledSimulation(plan=plan, step_time_s=step, analytic_step_time_s=est.step_time_s, pools=out,
                            result=combined, cross_pool_s=est.cross_pool_s, estimate=est,
                            notes=["one replica per pool is drawn (the one with the most micro-batches); the "
                                   "pool's other replicas run the same timeline"]
                            + ([f"under the length distribution each pool's step is the mean of {batches} "
                                "sampled batches (sim.varlen; a bucket plan's by sim.buckets), and its timeline is "
                                "the first of them"]
                               if work.varied else []))


def _spliced(model: LayerGraph | ModelSpec, cluster: PooledCluster, plan: Plan, work: Workload,
             params: CostParams, analytic_s: float, f: dict[str, Any] | None = None) -> StageDurations:
    """The durations of a pipeline over pools: rank r's from its own pool's hardware, the sends
    between two pools' boundary stages slower by the inter_pool link (in device order: as
    cost.pools.device_splice says, ``f`` one class of replicas of it; None: the first)."""
    f = _splices(model, cluster, plan, work, params)[0] if f is None else f
    owner, crossing, cross_dp = f["owner"], f["crossing"], f["cross_dp_s"]
    ds = [stage_durations(model, c, f["plan"], f["work"], params) for c in f["clusters"]]
    base = ds[0]
    lists = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if isinstance(getattr(base, f.name), list)}
    spliced = {k: [getattr(ds[owner[r]], k)[r] for r in range(len(v))] for k, v in lists.items()}
    extra = pool_pipeline_cross(model, cluster, plan, f["work"], params, ds[0].p2p_send_s)
    for b in range(len(owner) - 1):
        if crossing[b]:
            spliced["tp_fwd_exposed_s"][b] += extra
            spliced["tp_bwd_exposed_s"][b + 1] += extra
    for r, x in enumerate(cross_dp):
        spliced["end_dp_exposed_s"][r] += x
    return dataclasses.replace(base, **spliced, analytic={"step_time_s": analytic_s},
                               straggler_s=max(x.straggler_s for x in ds))


def _splices(model: LayerGraph | ModelSpec, cluster: PooledCluster, plan: Plan, work: Workload,
             params: CostParams) -> list[dict[str, Any]]:
    """How the pipeline is spliced over the pools, per class of replicas (cost.pools.device_splice's
    fields): device order's (one class per share with uneven dp_shares), or pool_pp's one."""
    if device_order(plan):
        return device_splice(model, cluster, plan, work, params)
    assert plan.pool_pp is not None
    pools = plan_pools(cluster, plan)
    owner = [i for i, k in enumerate(plan.pool_pp) for _ in range(k)]
    return [{"replicas": None, "work": work, "clusters": [pool_cluster(p, plan.num_gpus) for p in pools],
             "keys": [(i, None) for i in range(len(pools))], "owner": owner,
             "plan": plan.replace(dp_shares=None, pools=None, pool_dp=None, pool_pp=None),
             "crossing": [owner[b] != owner[b + 1] for b in range(len(owner) - 1)], "cross_dp_s": [0.0] * len(owner)}]


def _pipeline(model: LayerGraph | ModelSpec, cluster: PooledCluster, pools: list[ClusterSpec], plan: Plan,
              work: Workload, params: CostParams, est: PooledEstimate, batches: int, seed: int) -> PooledSimulation:
    notes: list[str] = []
    if work.varied:  # sampled batches, every length's pipeline spliced over the pools the same way
        sub = plan.replace(dp_shares=None, pools=None, pool_dp=None, pool_pp=None)
        f = _splices(model, cluster, plan, work, params)[0]

        def durations(length: int) -> StageDurations:
            g = graph_at(model, length)
            return _spliced(g, cluster, plan, work.shaped(work.global_batch, length), params, est.step_time_s)
        vr = simulate_lengths(model, pools[0], sub, work, params, batches=batches, seed=seed, durations=durations)
        res = run(vr.example)
        step = vr.mean_s
        notes.append(f"under the length distribution the step is the mean of {batches} sampled batches (sim.varlen), "
                     "and the timeline is the first of them")
    else:  # one pipeline per class of replicas (uneven dp_shares in device order), the longest sets the step
        runs = []
        for f in _splices(model, cluster, plan, work, params):
            d = _spliced(model, cluster, plan, f["work"], params, est.step_time_s, f)
            runs.append((f, run(spec_from_durations(d, d.output_static_bytes))))
        f, res = max(runs, key=lambda x: x[1].step_time_s)
        step = res.step_time_s
        if len(runs) > 1:
            notes.append("uneven dp_shares in device order: each class of replicas is simulated as a pipeline of its "
                         "own (its micro-batches, its stages' GPUs); the longest, drawn here, sets the step ("
                         + ", ".join(f"{g['micro']} micro-batches: {r.step_time_s:.3f} s" for g, r in runs) + ")")
    pool_of = [f["keys"][o][0] for o in f["owner"]]
    res.events = [dataclasses.replace(e, args={**e.args, "pool": pools[pool_of[e.rank]].name}) for e in res.events]
    out = []
    for i, pool in enumerate(pools):
        ranks = ([r for r, o in enumerate(pool_of) if o == i]
                 or [r for r, t in enumerate(_touched(plan, pools)) if i in t])
        busy = max(res.busy(r, "compute") for r in ranks)
        out.append(PoolSim(pool.name, pool.gpu.name, res, ranks, busy_s=busy,
                           idle_s=res.step_time_s - busy))
    return PooledSimulation(plan=plan, step_time_s=step, analytic_step_time_s=est.step_time_s, pools=out,
                            result=res, cross_pool_s=est.cross_pool_s, estimate=est, notes=notes)


def _touched(plan: Plan, pools: list[ClusterSpec]) -> list[tuple[int, ...]]:
    """Per pipeline rank, the pools its GPUs lie in (device order; pool_pp: its own pool)."""
    if device_order(plan):
        from meshplan.cost.pools import device_layout
        return list(device_layout(pools, plan).touched)
    assert plan.pool_pp is not None
    return [(i,) for i, k in enumerate(plan.pool_pp) for _ in range(k)]
