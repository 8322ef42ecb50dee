"""Mixed hardware: plans over several GPU pools, and uneven data-parallel shares.

A plan on a ``PooledCluster`` (spec.cluster) places its data-parallel replicas on pools
(``pool_dp``) or its pipeline stages on pools (``pool_pp``). Every rank is timed on its own
pool's hardware by the one cost model (cost.batch), evaluated once per pool:

- **pool_dp**: every replica has the plan's tp x pp x cp shape and lives in one pool. Pool i's
  replicas form a plan of their own on that pool (dp = pool_dp[i]; ZeRO/FSDP shards within the
  pool, HSDP-style, so parameters are never gathered across pools), each replica training on
  its share of the global batch (``dp_shares``; even without it). The pool's step is its
  slowest replica's (the most micro-batches) and includes the pool's own gradient sync, which
  runs hierarchically: reduce-scatter within the pool, then one all-reduce of each GPU's
  gradient shard across pools over ``inter_pool`` (exposed: it starts when the slowest pool's
  reduce-scatter ends), then the pool's all-gather / optimizer. The step is the slowest pool's
  step plus that exchange; a faster pool waits for the rest (``idle_s``, the time lost to
  imbalance).
- **pool_pp**: pool i holds pool_pp[i] consecutive pipeline stages (the first pool's first),
  each with the plan's dp x cp x tp GPUs. The whole plan is assembled once per pool (as if
  every rank were of that pool's GPU) and each pipeline rank takes its own pool's terms
  (cost.batch.splice_ranks); the send between two pools' boundary stages crosses inter_pool.
  The pipeline's step then follows from per-rank times as for any uneven pipeline (its
  slowest stage sets the pace; stage_layers balances the layers by speed and memory).

Uneven shares on a single-type cluster (``dp_shares`` without pools) are pool_dp with one
pool: the replica with the largest share sets the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.cost import batch as _b
from meshplan.cost.buckets import plan_report
from meshplan.cost.lengths import expected_batch, graph_at
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.report import CostReport
from meshplan.cost.uncertainty import verdicts
from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec, PooledCluster
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.constraints import violations
from meshplan.spec.plan import Plan, Workload, microbatches, share_split, share_unit, split_fault
from meshplan.spec.support import runtime_violations
from meshplan.units import ranges_text


@dataclass
class PoolPart:
    """What one pool does in a plan, and how long it takes."""

    name: str
    gpu: str
    gpus: int
    """GPUs of the pool the plan uses."""
    gpus_total: int
    role: str
    """e.g. '4 replicas x 16 GPUs, 96 micro-batches each' or 'stages 0-1 (40 layers)'."""
    step_s: float
    """The pool's own step (its slowest replica, or its part of the pipeline), before the
    cross-pool exchange."""
    idle_s: float = 0.0
    """Seconds per step the pool waits for the slowest pool (time lost to imbalance)."""
    busy_fraction: float = 1.0
    """Share of the step the pool's GPUs compute or communicate for themselves."""
    peak_memory_gib: float = 0.0
    usable_memory_gib: float = 0.0
    fits: bool = True
    at_risk: bool = False
    """Fits, but with less headroom than meshplan recommends (cost.uncertainty.verdicts)."""
    oom_probability: float = 0.0
    """The chance the pool's fullest GPU runs out of memory (cost.uncertainty)."""
    report: CostReport | None = None
    """The pool's own estimate (its replicas as a plan on that pool), for pool_dp."""
    memory: dict[str, float] = field(default_factory=dict)
    """The pool's fullest GPU's memory by part, GiB (CostReport.memory's keys, with total)."""
    memory_per_stage: list[float] = field(default_factory=list)
    """GiB per pipeline stage the pool holds (pool_dp: its replicas' stages; pipelines: its stages)."""
    time: dict[str, float] = field(default_factory=dict)
    """The pool's own part by term, seconds per step (CostReport.time's keys): pool_dp, its replicas'
    estimate (``report``); pool_pp, its busiest pipeline rank's per-micro-batch terms over the step's
    micro-batches and its end-of-step work (optimizer; its data-parallel sync in dp_comm), without the
    wait for the other stages (bubble)."""

    @property
    def allocated_memory_gib(self) -> float:
        """The fullest GPU's live tensors at the peak (torch.cuda.max_memory_allocated), GiB: its
        allocated parts (cost.batch.ALLOCATED_KEYS)."""
        return float(sum(self.memory.get(k, 0.0) for k in _b.ALLOCATED_KEYS))

    @property
    def reserved_memory_gib(self) -> float:
        """... plus what PyTorch's caching allocator keeps beyond them (torch.cuda.max_memory_reserved),
        GiB; peak_memory_gib adds the CUDA context and NCCL's buffers (cost.reserved)."""
        return self.allocated_memory_gib + float(self.memory.get("allocator", 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {"pool": self.name, "gpu": self.gpu, "gpus": self.gpus, "gpus_total": self.gpus_total,
                "role": self.role, "step_s": self.step_s, "idle_s": self.idle_s,
                "utilisation": self.busy_fraction, "peak_memory_gib": self.peak_memory_gib,
                "allocated_memory_gib": self.allocated_memory_gib, "reserved_memory_gib": self.reserved_memory_gib,
                "usable_memory_gib": self.usable_memory_gib, "fits": self.fits, "at_risk": self.at_risk,
                "oom_probability": self.oom_probability, "time": dict(self.time), "memory": dict(self.memory),
                "memory_per_stage": list(self.memory_per_stage)}


@dataclass
class PooledEstimate:
    """The estimate of a plan over pools (or with uneven shares)."""

    plan: Plan
    step_time_s: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs over the peak of the GPUs used (each at its own peak)."""
    usd_per_m_tokens: float
    fits: bool
    parts: list[PoolPart]
    cross_pool_s: float = 0.0
    """Exposed seconds per step of traffic over inter_pool on the step's critical path: always
    ``time["cross_pool"]``, and not in dp_comm or pp_comm. pool_dp: the gradient all-reduce across
    pools (exposed after the slowest pool's step); pool_pp and device order: the critical rank's
    sends to another pool (whole: the time over inter_pool, taken out of pp_comm) and the exposed
    share of its data-parallel exchange across pools (taken out of dp_comm). A pipeline whose
    critical rank sends nothing across pools has 0 here while ``cross_pool_gb`` may be > 0."""
    cross_pool_gb: float = 0.0
    """GB a GPU sends over inter_pool per step, the most any GPU does: the all-reduce's share
    (pool_dp, and a data-parallel group over several pools in device order) plus its pipeline
    sends to another pool (one per micro-batch per boundary across pools it sits on)."""
    imbalance_s: float = 0.0
    """GPU-weighted mean of the pools' idle seconds per step: time lost to imbalance."""
    num_gpus: int = 0
    mfu_flops: float = 0.0
    """Model FLOPs per step (the numerator of ``mfu``)."""
    notes: list[str] = field(default_factory=list)
    runtime: list[dict[str, str]] = field(default_factory=list)
    """The runtime rules (spec.support) the plan's pools' parts break: {"pool", "rule", "kind",
    "reason"} each (runtime_issues); empty when meshplan train runs it as planned."""
    time: dict[str, float] = field(default_factory=dict)
    """The step by term, seconds, as a plan on one GPU type has it (CostReport.time: compute,
    recompute, tp_comm, dp_comm, pp_comm, bubble, optimizer, ..., the ``_overlapped`` ones apart),
    along the step's critical path: pool_dp, the slowest pool's own step; pool_pp, the spliced
    pipeline's critical rank. The pooled extras: ``cross_pool``, the exposed time across pools
    (pool_dp: the gradient all-reduce over inter_pool; pool_pp: the boundary sends' time beyond the
    pool's own network, taken out of pp_comm), so that the exposed terms add up to the step; and
    ``pool_idle``, apart (not on the critical path): the GPU-weighted mean wait of the pools for the
    slowest (``imbalance_s``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The keys a plan on one GPU type has in its JSON (CostReport.to_dict) with their pooled meanings
    (`pooled_extras`), added to ``to_dict`` after the pooled keys."""

    @property
    def peak_memory_gib(self) -> float:
        return max(p.peak_memory_gib for p in self.parts)

    @property
    def at_risk(self) -> bool:
        return any(p.at_risk for p in self.parts)

    @property
    def tightest(self) -> PoolPart:
        """The pool whose fullest GPU is likeliest to run out of memory (the memory verdict's pool)."""
        return max(self.parts, key=lambda p: (p.oom_probability, p.peak_memory_gib / max(1e-9, p.usable_memory_gib)))

    @property
    def oom_probability(self) -> float:
        return self.tightest.oom_probability

    @property
    def verdict(self) -> str:
        from meshplan.cost.uncertainty import verdict
        return verdict(self.fits, self.at_risk)

    @property
    def runs_as_planned(self) -> bool:
        return not self.runtime

    @property
    def dominant(self) -> str:
        """The largest exposed term of ``time`` (as CostReport.dominant)."""
        exposed = {k: v for k, v in self.time.items() if not k.endswith("_overlapped") and k != "pool_idle"}
        return max(exposed, key=exposed.__getitem__) if exposed else ""

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.short(), "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu, "usd_per_m_tokens": self.usd_per_m_tokens, "fits": self.fits,
                "at_risk": self.at_risk, "num_gpus": self.num_gpus, "cross_pool_s": self.cross_pool_s,
                "cross_pool_gb": self.cross_pool_gb, "imbalance_s": self.imbalance_s,
                "pools": [p.to_dict() for p in self.parts], "notes": list(self.notes), "time": dict(self.time),
                "dominant": self.dominant,
                "verdict": self.verdict, "oom_probability": self.oom_probability,
                "runtime": {"runs_as_planned": self.runs_as_planned, "issues": list(self.runtime)}} \
            | {k: v for k, v in self.extra.items() if k not in ("plan", "pools", "time")}


def replica_samples(plan: Plan, global_batch: int) -> list[int]:
    """Samples per data-parallel replica under plan.dp_shares (whole micro-batches each)."""
    out = []
    for n, rem in share_split(plan.replica_shares, global_batch):
        if split_fault(n, rem, plan.micro_batch) is not None:
            how = (f"as dp_shares={':'.join(map(str, plan.dp_shares))}" if plan.dp_shares is not None
                   else f"evenly over dp={plan.dp} replicas")
            lo, hi = nearest_batches(plan, global_batch)
            near = " or ".join(str(b) for b in (lo, hi) if b)
            raise MeshplanError(
                f"--global-batch {global_batch} does not split {how} into whole micro-batches of "
                f"{plan.micro_batch} per replica",
                hint=f"the nearest that do: --global-batch {near}; or other shares")
        out.append(n)
    return out


def nearest_batches(plan: Plan, global_batch: int) -> tuple[int | None, int | None]:
    """The nearest global batches below and above ``global_batch`` that split into whole
    micro-batches under the plan's shares (each replica's share s of S: B s / S a multiple of
    micro_batch): the multiples of S x micro_batch / gcd over the shares."""
    unit = share_unit(plan.replica_shares, plan.micro_batch)
    lo = (global_batch // unit) * unit
    hi = lo + unit
    return (lo if lo > 0 and lo != global_batch else None), hi


def as_run(plan: Plan) -> tuple[Plan, list[str]]:
    """The plan as meshplan's runtime runs it: uneven dp_shares under zero=2/3 keep the parameters
    gathered for the step (the replicas make different numbers of collectives), i.e. zero=1."""
    if plan.zero >= 2 and plan.dp_shares is not None and len(set(plan.replica_shares)) > 1:
        return plan.replace(zero=1), [f"uneven dp_shares with zero={plan.zero}: the runtime keeps the parameters "
                                      "gathered for the step (its replicas run different numbers of micro-batches), "
                                      "so it is priced as zero=1"]
    return plan, []


def pool_cluster(pool: ClusterSpec, gpus: int) -> ClusterSpec:
    """The part of ``pool`` a plan uses: ``gpus`` GPUs on whole nodes (the pool's links)."""
    per = pool.gpus_per_node
    if gpus < per:
        return pool.replace(num_nodes=1, gpus_per_node=gpus)
    return pool.replace(num_nodes=-(-gpus // per))


@dataclass(frozen=True)
class ReplicaPart:
    """One pool's replicas under pool_dp (or all of dp on one GPU type), as a plan of their own."""

    pool: ClusterSpec
    replicas: int
    samples: list[int]
    """Samples per replica of this pool (replica_samples)."""
    cluster: ClusterSpec
    """The part of the pool they use (pool_cluster)."""
    plan: Plan
    """Their plan on it (_sub_plan)."""
    work: Workload
    """Every replica at the pool's largest share: the replica that sets the pool's step."""


def replica_parts(pools: list[ClusterSpec], plan: Plan, work: Workload) -> list[ReplicaPart]:
    """The pools' replicas of a pool_dp plan (``plan`` as the runtime runs it: as_run), shared by
    the cost model (estimate_pooled) and the simulator (sim.pools), so the two time the same parts."""
    per_pool = list(plan.pool_dp) if plan.pool_dp is not None else [plan.dp]
    samples = replica_samples(plan, work.global_batch)
    shape = plan.tp * plan.pp * plan.cp
    out, start = [], 0
    for pool, n in zip(pools, per_pool):
        mine = samples[start:start + n]
        start += n
        gpus = n * shape
        if gpus > pool.num_gpus:
            raise MeshplanError(f"pool {pool.name}: {n} replicas x {shape} GPUs = {gpus} GPUs, but it has "
                                f"{pool.num_gpus}", hint="fewer replicas on that pool (pool_dp), or a smaller "
                                                        "tp x pp x cp")
        out.append(ReplicaPart(pool=pool, replicas=n, samples=mine, cluster=pool_cluster(pool, gpus),
                               plan=_sub_plan(plan, n),
                               work=work.shaped(max(mine) * n, work.seq_len, work.lengths)))
    return out


def _sub_plan(plan: Plan, dp: int) -> Plan:
    """A pool's replicas as a plan on that pool: ZeRO/FSDP shards within the pool (a shard_group
    of the pool's replicas, as the search writes for HSDP across pools, is the whole pool)."""
    sg = plan.shard_group if 0 < plan.shard_group < dp * plan.cp else 0
    return plan.replace(dp=dp, dp_shares=None, pools=None, pool_dp=None, pool_pp=None, shard_group=sg)


def plan_pools(cluster: ClusterSpec | PooledCluster, plan: Plan) -> list[ClusterSpec]:
    """The pools ``plan`` runs on: those its ``pools`` names on a cluster of several pools (it must
    name them), the one pool of a cluster of one (its ``pools``, if any, places it there)."""
    if len(cluster.pools) > 1:
        if not plan.pools:
            raise MeshplanError(f"cluster {cluster.name} has pools ({', '.join(cluster.names)}): the plan must say "
                                "which it uses", hint=f"add pools=NAME (one pool) or pools={':'.join(cluster.names)}"
                                                      ",pool_dp=... (replicas per pool)")
        return [cluster.pool(n) for n in plan.pools]
    if plan.multi_pool:
        raise MeshplanError(f"plan uses pools {':'.join(plan.pools or ())} but the cluster has one GPU type",
                            hint="give a cluster file with [[pools]], or drop pools/pool_dp/pool_pp")
    return [cluster.pools[0]]


def estimate_pooled(model: LayerGraph | ModelSpec, cluster: ClusterSpec | PooledCluster, plan: Plan,
                    work: Workload, params: CostParams = DEFAULT_PARAMS) -> PooledEstimate:
    """The step of ``plan`` on ``cluster`` with every rank on its own pool's hardware."""
    est = _estimate_pooled(model, cluster, plan, work, params)
    est.extra = pooled_extras(est, model, cluster, params) | est.extra
    return est


def pooled_extras(est: PooledEstimate, model: LayerGraph | ModelSpec, cluster: ClusterSpec | PooledCluster,
                  params: CostParams) -> dict[str, Any]:
    """The keys of a plan on one GPU type's estimate (CostReport.to_dict) that a plan over pools gives
    with these meanings: memory (memory, memory_per_stage, peak_memory_gib, peak_memory_gib_high,
    allocated_memory_gib, reserved_memory_gib, usable_memory_gib, named by ``memory_pool``) of the tightest
    pool (the memory verdict's, ``tightest``), each pool's own in ``pools``; the step's 90% band
    (step_time_s_low/high, cost.uncertainty.step_band); tflops_per_gpu the model FLOPs over the step and
    every GPU used; hfu the MFU times the hardware-to-model FLOPs ratio (recomputation); the rest
    (microbatches, host memory, cross_site_gb, token_factor, outer and straggler sync) from the step's
    critical part (the pipeline's row, or the slowest pool's estimate; host memory and cross_site_gb the
    most over pools). The paths' own values (``extra``) take precedence."""
    from meshplan.cost.uncertainty import memory_high, step_band
    from meshplan.spec.transformer import as_graph
    t = est.tightest
    low, high = step_band(np.asarray([est.step_time_s]), np.asarray([est.plan.pp]), params)
    n_params = as_graph(model, 1).num_params() if isinstance(model, ModelSpec) else model.num_params()
    out: dict[str, Any] = {
        "tflops_per_gpu": est.mfu_flops / est.step_time_s / max(1, est.num_gpus) / 1e12 if est.step_time_s else 0.0,
        "peak_memory_gib": t.peak_memory_gib, "usable_memory_gib": t.usable_memory_gib,
        "peak_memory_gib_high": float(memory_high(np.asarray([t.peak_memory_gib]), params)[0]),
        "allocated_memory_gib": t.allocated_memory_gib, "reserved_memory_gib": t.reserved_memory_gib,
        "memory_pool": t.name, "memory": dict(t.memory), "memory_per_stage": list(t.memory_per_stage),
        "step_time_s_low": float(low[0]), "step_time_s_high": float(high[0]), "params": int(n_params),
        "model": str(getattr(model, "name", "")), "cluster": str(getattr(cluster, "name", "")),
        # the smallest share of host memory a GPU of the pools used has (each pool's offload is checked against its own)
        "host_memory_per_gpu_gib": min((p.host_memory_per_gpu_gib for p in cluster.pools
                                        if p.name in {q.name for q in est.parts}),
                                       default=min(p.host_memory_per_gpu_gib for p in cluster.pools))}
    reports = [p.report for p in est.parts if p.report is not None]
    if reports:
        crit = max(est.parts, key=lambda p: p.step_s).report or reports[0]
        k = crit.hfu / crit.mfu if crit.mfu else 1.0
        out |= {"hfu": est.mfu * k, "microbatches": max(r.microbatches for r in reports),
                "host_memory_gib": max(r.host_memory_gib for r in reports),
                "host_fits": all(r.host_fits for r in reports),
                "cross_site_gb": max(r.cross_site_gb for r in reports), "token_factor": crit.token_factor,
                "time_to_target_s": est.step_time_s * crit.token_factor, "outer_sync_s": crit.outer_sync_s,
                "outer_workers": crit.outer_workers, "straggler_sync_s": crit.straggler_sync_s}
    return out


def row_extras(row: dict[str, np.ndarray], est: PooledEstimate) -> dict[str, Any]:
    """`pooled_extras`' critical-part keys of a pipeline over pools, from its one cost.batch row."""
    mfu, hfu = float(row["mfu"][0]), float(row["hfu"][0])
    tf = float(row["token_factor"][0])
    return {"hfu": est.mfu * (hfu / mfu if mfu else 1.0), "microbatches": int(row["microbatches"][0]),
            "host_memory_gib": float(row["host_memory_gib"][0]), "host_fits": bool(row["host_fits"][0]),
            "cross_site_gb": float(row["cross_site_gb"][0]), "token_factor": tf,
            "time_to_target_s": est.step_time_s * tf, "outer_sync_s": float(row["outer_sync_s"][0]),
            "outer_workers": int(row["outer_workers"][0]), "straggler_sync_s": float(row["straggler_sync_s"][0])}


def _estimate_pooled(model: LayerGraph | ModelSpec, cluster: ClusterSpec | PooledCluster, plan: Plan,
                     work: Workload, params: CostParams) -> PooledEstimate:
    pools = plan_pools(cluster, plan)
    if plan.pool_pp is not None and len(pools) > 1:
        return _estimate_pool_pp(model, cluster, pools, plan, work, params)  # type: ignore[arg-type]
    if device_order(plan):
        return _estimate_device_order(model, cluster, pools, plan, work, params)  # type: ignore[arg-type]
    given = plan
    plan, notes = as_run(plan)
    per_pool = list(plan.pool_dp) if plan.pool_dp is not None else [plan.dp]
    shape = plan.tp * plan.pp * plan.cp
    parts: list[PoolPart] = []
    flops_per_sample = 0.0
    for part in replica_parts(pools, plan, work):
        pool, n, mine = part.pool, part.replicas, part.samples
        gpus = n * shape
        r = on_pool(pool.name, plan_report, model, part.cluster, part.plan, part.work, params)
        flops_per_sample = max(flops_per_sample, r.tflops_per_gpu * 1e12 * r.step_time_s * r.num_gpus
                               / part.work.global_batch)
        m_max, m_mean = max(mine) // plan.micro_batch, sum(mine) / n / plan.micro_batch
        each = f"{m_max} micro-batch{'es' * (m_max > 1)} each" if min(mine) == max(mine) else \
            f"{min(mine) // plan.micro_batch}-{m_max} micro-batches each"
        unit = "windows" if work.lengths is not None and work.lengths.packing == "packed" else "samples"
        role = (f"{n} replica{'s' * (n > 1)} x {shape} GPU{'s' * (shape > 1)}, {each} ({sum(mine)} of "
                f"{work.global_batch} {unit})")
        if plan.buckets is not None:  # a data-aware plan (spec.buckets): micro-batches dealt by length
            from meshplan.spec.buckets import describe
            role = (f"a data-aware plan on {gpus} GPUs ({n} data-parallel x {plan.cp} context-parallel x {plan.tp} "
                    "tensor-parallel ranks): "
                    f"{describe(plan.bucket_specs)}")
        parts.append(PoolPart(name=pool.name, gpu=pool.gpu.name, gpus=gpus, gpus_total=pool.num_gpus, role=role,
                              step_s=r.step_time_s, busy_fraction=m_mean / max(1, m_max),
                              peak_memory_gib=r.peak_memory_gib, usable_memory_gib=r.usable_memory_gib,
                              fits=r.fits, at_risk=r.at_risk, oom_probability=r.oom_probability, report=r,
                              time=dict(r.time), memory=dict(r.memory),
                              memory_per_stage=list(r.memory_per_stage)))
    cross_s, cross_gb = 0.0, 0.0
    if len(pools) > 1:
        cross_s, cross_gb = _cross_pool_sync(model, cluster, plan, per_pool, params)  # type: ignore[arg-type]
    slowest = max(p.step_s for p in parts)
    step = slowest + cross_s
    for p in parts:
        p.idle_s = slowest - p.step_s
        p.busy_fraction = (p.step_s * p.busy_fraction + cross_s) / step
    est = _finish(given, work, pools, parts, step, flops_per_sample * work.global_batch, cross_s, cross_gb)
    crit = max(parts, key=lambda p: p.step_s)
    est.time = {**crit.time, "cross_pool": cross_s, "pool_idle": est.imbalance_s}
    est.notes += notes
    est.runtime = runtime_issues(model, cluster, given, work)
    return est


def on_pool(name: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` for pool ``name``'s part of a plan: a refusal of the part (the checks of a plan
    on one GPU type: cost.batch.check) names the pool."""
    try:
        return fn(*args)
    except MeshplanError as e:
        msg = e.message
        head = "plan cannot run: "
        msg = f"{head}pool {name}: {msg[len(head):]}" if msg.startswith(head) else f"pool {name}: {msg}"
        raise MeshplanError(msg, hint=e.hint) from e


def part_plans(model: LayerGraph | ModelSpec, cluster: ClusterSpec | PooledCluster, plan: Plan,
               work: Workload) -> list[tuple[str, Plan, int]]:
    """(pool name, the plan its part runs, micro-batches per step of it) for every pool of ``plan``:
    pool_dp, a pool's replicas as a plan of their own (its largest share's micro-batches); pool_pp,
    the whole pipeline (each pool's stages run its schedule)."""
    pools = plan_pools(cluster, plan)
    if (plan.pool_pp is not None and len(pools) > 1) or device_order(plan):
        sub = plan.replace(dp_shares=None, pools=None, pool_dp=None, pool_pp=None)
        micro = microbatches(work.global_batch, sub.dp, sub.micro_batch)
        return [(p.name, sub, micro) for p in pools]
    return [(part.pool.name, part.plan, max(part.samples) // plan.micro_batch)
            for part in replica_parts(pools, plan, work)]


def runtime_issues(model: LayerGraph | ModelSpec, cluster: ClusterSpec | PooledCluster, plan: Plan,
                   work: Workload) -> list[dict[str, str]]:
    """The runtime rules (spec.support: what meshplan train refuses or runs as something else)
    that each pool's part of ``plan`` breaks, as for a plan on one GPU type (cli.views.runtime_status,
    the search's export_only): {"pool", "rule", "kind", "reason"}, each rule once per pool."""
    out: list[dict[str, str]] = []
    for name, sub, micro in part_plans(model, cluster, plan, work):
        for rule, why in runtime_violations(sub, micro, model):
            out.append({"pool": name, "rule": rule.name, "kind": rule.kind, "reason": why})
    return out


def _finish(plan: Plan, work: Workload, pools: list[ClusterSpec], parts: list[PoolPart], step: float,
            model_flops: float, cross_s: float, cross_gb: float) -> PooledEstimate:
    gpus = sum(p.gpus for p in parts)
    peak = sum(p.gpus * pool.gpu.peak(_b.mfu_basis(plan.precision)) for p, pool in zip(parts, pools))
    usd = sum(p.gpus * pool.price_per_hour for p, pool in zip(parts, pools)) * step / 3600
    imbalance = sum(p.gpus * p.idle_s for p in parts) / max(1, gpus)
    return PooledEstimate(plan=plan, step_time_s=step, tokens_per_s=work.tokens / step,
                          mfu=model_flops / step / peak if peak else 0.0,
                          usd_per_m_tokens=usd / work.tokens * 1e6, fits=all(p.fits for p in parts),
                          parts=parts, cross_pool_s=cross_s, cross_pool_gb=cross_gb, imbalance_s=imbalance,
                          num_gpus=gpus, mfu_flops=model_flops)


def _cross_pool_sync(model: LayerGraph | ModelSpec, cluster: PooledCluster, plan: Plan, per_pool: list[int],
                     params: CostParams) -> tuple[float, float]:
    """(seconds, GB per GPU) of the all-reduce of every GPU's gradient shard across the pools:
    a ring over len(per_pool) members on inter_pool, each GPU its own lane. A GPU of pool i holds
    1/(tp x pp) of the model, sharded over that pool's pool_dp[i] x cp replicas; the pool with the
    fewest replicas holds the largest shard and sets the time."""
    from meshplan.cost.parts import plans_to_columns
    from meshplan.cost.sync import reduce_bytes
    from meshplan.spec.transformer import as_graph
    n_params = as_graph(model, 1).num_params() if isinstance(model, ModelSpec) else model.num_params()
    rb = float(reduce_bytes(plans_to_columns([plan]), params)[0])
    shard_bytes = n_params * rb / (plan.tp * plan.pp * plan.cp * min(per_pool))
    k = len(per_pool)
    link = cluster.inter_pool
    t = 2 * (k - 1) / k * shard_bytes / link.bytes_per_s + 2 * (k - 1) * link.latency_us * 1e-6
    return t, 2 * (k - 1) / k * shard_bytes / 1e9


def _estimate_pool_pp(model: LayerGraph | ModelSpec, cluster: PooledCluster, pools: list[ClusterSpec], plan: Plan,
                      work: Workload, params: CostParams) -> PooledEstimate:
    """Pipeline stages on several pools: see the module docstring. Under a length distribution the
    spliced pipeline is priced at every length and cost.lengths takes the expected step over them
    (as for a pipeline on one GPU type: by default every micro-batch padded to the longest length,
    CostParams.pipeline_variable_shapes); each pool's busy time and memory are those of its ranks
    at the longest length."""
    assert plan.pool_pp is not None
    per_stage = plan.dp * plan.cp * plan.tp
    owner: list[int] = []
    for i, (pool, k) in enumerate(zip(pools, plan.pool_pp)):
        if k * per_stage > pool.num_gpus:
            raise MeshplanError(f"pool {pool.name}: {k} stages x {per_stage} GPUs = {k * per_stage} GPUs, but it "
                                f"has {pool.num_gpus}", hint="fewer stages on that pool (pool_pp), or a smaller "
                                                            "dp x cp x tp")
        owner += [i] * k
    sub = plan.replace(dp_shares=None, pools=None, pool_dp=None, pool_pp=None)
    big = [pool_cluster(pool, plan.num_gpus) for pool in pools]  # every rank as if of that pool's GPU
    if plan.virtual_stages > 1 or plan.schedule == "zbv":
        raise MeshplanError("pool_pp: pipelines over pools take one stage per rank (virtual_stages=1, not zbv)",
                            hint="drop virtual_stages / schedule=zbv, or place replicas with pool_dp")
    for pool, c in zip(pools, big):  # the pipeline's checks on each pool's hardware (cost.batch.check), but the
        # GPU count (each pool's stages were counted above; ``c`` is the pool's nodes for the whole plan)
        bad = violations(model, c, sub, work, skip=("gpu count mismatch",))
        if bad:
            raise MeshplanError(f"plan cannot run: pool {pool.name}: " + "; ".join(reason for _, reason in bad))
    _, res, rank = _pool_pipeline(model, big, owner, cluster.inter_pool, work, sub, params)
    step = float(res["step_time_s"][0])
    model_flops = float(res["model_flops"][0])
    scale = 1.0
    time_row = res
    if work.varied:  # the expected step over the distribution, each length's pipeline spliced the same way
        def priced(length: int) -> tuple[_b.Assembly, dict[str, np.ndarray]]:
            w = work.shaped(work.global_batch, length)
            a, r, _ = _pool_pipeline(model, big, owner, cluster.inter_pool, w, sub, params, graph_at(model, length))
            return a, r
        r = expected_batch(model, big[0], work, [sub], params, priced=priced)
        scale = float(r["step_time_s"][0]) / step  # busy time at the longest length, scaled to the expected step
        time_row = r
        step = float(r["step_time_s"][0])
        model_flops = float(r["tflops_per_gpu"][0]) * 1e12 * step * float(r["num_gpus"][0])  # the real samples
    parts = []
    layers = plan.stage_layers
    for i, pool in enumerate(pools):
        ranks = [r for r, o in enumerate(owner) if o == i]
        busy = max(rank["busy_s"][r] for r in ranks) * scale
        mem = max(rank["memory_gib"][r] for r in ranks)
        span = f"stage {ranks[0]}" if len(ranks) == 1 else f"stages {ranks[0]}-{ranks[-1]}"
        nl = f" ({sum(layers[r] for r in ranks)} layers)" if layers else ""
        usable = rank["usable_gib"][i]
        fits, risk, prob = verdicts(np.asarray([mem]), usable, params)
        top = max(ranks, key=lambda r: rank["busy_s"][r])
        full = max(ranks, key=lambda r: rank["memory_gib"][r])
        parts.append(PoolPart(name=pool.name, gpu=pool.gpu.name, gpus=len(ranks) * per_stage,
                              gpus_total=pool.num_gpus, role=f"{span}{nl}, {per_stage} GPUs each",
                              step_s=busy, busy_fraction=busy / step, peak_memory_gib=mem,
                              usable_memory_gib=usable, fits=bool(fits[0]), at_risk=bool(risk[0]),
                              oom_probability=float(prob[0]),
                              time={k: v * scale for k, v in rank["terms"][top].items()},
                              memory=dict(rank["memory"][full]),
                              memory_per_stage=[rank["memory_gib"][r] for r in ranks]))
    slowest = max(p.step_s for p in parts)
    for p in parts:
        p.idle_s = slowest - p.step_s
    time = pipeline_time(time_row, rank["crit_cross_s"] * scale, 0.0)
    est = _finish(plan, work, pools, parts, step, model_flops, time["cross_pool"], float(rank["cross_gb"]))
    est.time = time | {"pool_idle": est.imbalance_s}
    est.extra = row_extras(time_row, est) | {"memory_per_stage": list(rank["memory_gib"])}
    est.runtime = runtime_issues(model, cluster, plan, work)
    est.notes.append("pipeline over pools: each stage is timed on its own pool's GPU; the send between the "
                     "pools' boundary stages crosses inter_pool")
    if work.varied:
        est.notes.append("under the length distribution: the pipeline's expected step over the lengths (cost.lengths)"
                         + ("; its schedule runs one micro-batch shape, so every micro-batch is padded to the longest "
                            "length" if not params.pipeline_variable_shapes else
                            ", each micro-batch at its own padded length") + "; memory at the longest length")
    return est


def pipeline_time(row: dict[str, np.ndarray], cross_s: float, idle_s: float, cross_dp_s: float = 0.0
                  ) -> dict[str, float]:
    """The step by term of a pipeline over pools (cost.batch's ``time.*`` of its one row), the
    critical rank's sends across pools (``cross_s``, whole) moved from pp_comm and the exposed
    share of the data-parallel exchange across pools (``cross_dp_s``) moved from dp_comm to
    ``cross_pool``, and ``pool_idle``: the exposed terms still add up to the step."""
    from meshplan.cost.batch import TIME_KEYS
    time = {k: float(row[f"time.{k}"][0]) for k in TIME_KEYS}
    if "time.imbalance" in row:
        time["imbalance"] = float(row["time.imbalance"][0])
    moved = min(cross_s, time["pp_comm"])
    time["pp_comm"] -= moved
    moved_dp = min(cross_dp_s, time["dp_comm"])
    time["dp_comm"] -= moved_dp
    return time | {"cross_pool": moved + moved_dp, "pool_idle": idle_s}


def splice_owner(owner: list[int], width: int) -> np.ndarray:
    """(ranks,) pool index per pipeline rank (ranks beyond the plan's pp: the last pool)."""
    out = np.full(width, owner[-1])
    out[:len(owner)] = owner
    return out


def _splice(arrays: list[np.ndarray], own: np.ndarray) -> np.ndarray:
    """Column r (axis 1) of arrays[own[r]]: per-rank terms, each from its rank's pool."""
    out = np.array(arrays[0], copy=True)
    for i, x in enumerate(arrays):
        sel = own == i
        out[:, sel] = np.asarray(x)[:, sel]
    return out


PER_RANK = ("fwd", "b_in", "b_w", "fwd_x", "bin_x", "bw_x", "tp_f", "tp_b", "tp_f_ovl", "tp_b_ovl", "dp_f", "dp_b",
            "dp_f_ovl", "dp_b_ovl", "p2p", "totals")
"""Assembly fields of shape (rows, ranks) that depend on the hardware: taken per rank's pool."""


def _pool_pipeline(model: LayerGraph | ModelSpec, clusters: list[ClusterSpec], owner: list[int],
                   link: Any, work: Workload, plan: Plan, params: CostParams,
                   graph: LayerGraph | None = None, layout: DeviceLayout | None = None,
                   replicas: tuple[int, ...] | None = None) -> tuple[Any, dict[str, np.ndarray], dict[str, Any]]:
    """cost.batch's estimate of a pipeline whose rank r runs on clusters[owner[r]]: the plan is
    assembled once per pool, each rank's per-micro-batch terms and end-of-step work are taken
    from its own pool's assembly, and the sends between two pools' boundary stages are priced
    on ``link`` (inter_pool). Returns (the spliced assembly, the estimate_batch row, per-rank facts).

    With ``layout`` (a plan in device order, `device_layout`): ``owner`` is ignored; each rank is
    timed on the slowest of the pools its stage's GPUs touch (the largest per-micro-batch time of
    their assemblies), its memory checked against the smallest usable memory among them, a send
    crosses ``link`` where the two stages' GPUs of some replica lie in different pools, and a
    stage whose data-parallel group spans pools adds the exchange across them (`cross_dp_seconds`)
    to its end-of-step sync. A stage with a tensor- or context-parallel group spanning pools is timed
    on `spanning_cluster`s (its group's GPUs, the slowest links it crosses), appended to ``clusters``.
    ``replicas`` (with ``layout``): only those replicas' GPUs time the stages and their sends (a class of
    replicas with its own share of the batch, `replica_classes`); ``work`` then holds their micro-batches."""
    import dataclasses

    from meshplan.cost.parts import optimizer_seconds, plans_to_columns
    from meshplan.spec.transformer import as_graph
    p = params
    graph = as_graph(model, work.seq_len) if graph is None else graph
    cols = {k: np.asarray(v) if k != "stage_layers" else v for k, v in plans_to_columns([plan]).items()}
    clusters = list(clusters)
    if layout is not None:  # (pool, None): its own hardware; (pool, pools): a group spanning those pools
        cands = stage_candidates(layout, replicas)
        keys: list[tuple[int, tuple[int, ...] | None]] = [(i, None) for i in range(len(clusters))]
        keys += list(dict.fromkeys(k for c in cands for k in c if k not in keys))
        clusters += [spanning_cluster(clusters[i], [clusters[m] for m in span], link)
                     for i, span in keys[len(clusters):]]
    asm = [_b.assemble(graph, c, work, cols, p) for c in clusters]
    width = asm[0].valid.shape[1]
    if layout is not None:
        owner = [max((keys.index(k) for k in cands[j]), key=lambda x: (float(asm[x].totals[0, j]), -x))
                 for j in range(len(cands))]
    own = splice_owner(owner, width)
    fields = {f: _splice([getattr(x, f) for x in asm], own) for f in PER_RANK}
    terms = {k: _splice([x.terms[k] for x in asm], own) for k in asm[0].terms}
    # the sends that cross from one pool to the next: rank b's activations forward, rank b+1's
    # gradients backward (one each per micro-batch; virtual_stages = 1)
    nbytes, extra = _cross_send(asm[0], plan, link, p)
    from meshplan.cost.params import p2p_exposed
    # one send across pools, exposed, whole (the pool's own network's part and the extra): max(send, cross) x exposed
    full = float(asm[0].send[0]) * float(p2p_exposed(p, plan.virtual_stages)) + extra
    n_cross = 0
    crossing = ([owner[b] != owner[b + 1] for b in range(len(owner) - 1)] if layout is None else layout.crossing
                if replicas is None else [any(c[d] for d in replicas) for c in layout.rep_crossing])
    for b in range(len(owner) - 1):
        if crossing[b]:
            n_cross += 1
            for r in (b, b + 1):
                fields["p2p"][:, r] += extra
                fields["totals"][:, r] += extra
                terms["pp_comm"][:, r] += extra
    crit = int(np.argmax(fields["totals"][0]))
    base = asm[own[crit]]  # per-layer quantities (bubble shape, staged FSDP) of the critical rank's pool
    a = dataclasses.replace(base, terms=terms, **fields)
    ends = [_b.end_of_step(x, c, p) for x, c in zip(asm, clusters)]
    offo = np.asarray(cols["offload_optimizer"], dtype=bool)
    opts = [optimizer_seconds(c, x.plocal, cols["zero"], x.shard, offo, p, x.opt) for x, c in zip(asm, clusters)]
    rank_ends = (_splice([e[0] for e in ends], own), _splice([e[1] for e in ends], own), _splice(opts, own))
    cross_dp = [0.0] * len(owner)
    cross_dp_gb = [0.0] * len(owner)
    dp_cross_exposed = 0.0
    if layout is not None:  # a data-parallel group over several pools: then the exchange across them
        cross_dp = [cross_dp_seconds(float(a.plocal[0, j]), plan, layout.dp_counts[j], link, p)
                    for j in range(len(owner))]
        cross_dp_gb = [cross_dp_bytes(float(a.plocal[0, j]), plan, layout.dp_counts[j], p) / 1e9
                       for j in range(len(owner))]
        within = _b.estimate_assembly(a, clusters[own[crit]], work, p,
                                      rank_ends=(rank_ends[0].copy(), rank_ends[1], rank_ends[2]))
        rank_ends[0][0, :len(owner)] += np.asarray(cross_dp)
    res = _b.estimate_assembly(a, clusters[own[crit]], work, p, rank_ends=rank_ends)
    if layout is not None and any(cross_dp):
        # the exchange across pools' exposed share of the step's end-of-step sync (dp_comm): what it adds to it
        dp_cross_exposed = max(0.0, float(res["time.dp_comm"][0] - within["time.dp_comm"][0]))
    # model FLOPs: hardware-independent (the same in every pool's assembly)
    res["model_flops"] = res["tflops_per_gpu"] * 1e12 * res["step_time_s"] * res["num_gpus"]
    mem = _b.memory_parts(a, p, clusters[own[crit]].gpu.family)
    total_mem = np.sum([mem[k] for k in _b.MEMORY_KEYS], axis=0)[0] / 2**30
    micro = float(a.micro[0])
    busy = [micro * float(fields["totals"][0, r]) + float(rank_ends[0][0, r] + rank_ends[2][0, r])
            for r in range(len(owner))]
    from meshplan.cost.memory import usable_gib
    # the critical rank's share of the cross-pool sends (in its pp_comm, one extra per boundary it sits on)
    on_crit = sum(1 for b in range(len(owner) - 1) if crossing[b] and crit in (b, b + 1))
    rank_terms = [{k: micro * float(v[0, r]) for k, v in terms.items()}
                  | {"dp_comm": micro * float(terms["dp_comm"][0, r]) + float(rank_ends[0][0, r]),
                     "dp_comm_overlapped": micro * float(terms["dp_comm_overlapped"][0, r]) + float(rank_ends[1][0, r]),
                     "optimizer": float(rank_ends[2][0, r])}
                  for r in range(len(owner))]
    # per rank, GB it sends over inter_pool in a step: one send per micro-batch per crossing boundary it sits on
    # (activations forward from rank b, gradients backward from rank b + 1), and its data-parallel exchange
    sent_gb = [nbytes * micro / 1e9 * sum(1 for b in range(len(owner) - 1) if crossing[b] and r in (b, b + 1))
               + cross_dp_gb[r] for r in range(len(owner))]
    rank_mem = [{k: float(mem[k][0, r]) / 2**30 for k in _b.MEMORY_KEYS} for r in range(len(owner))]
    for m in rank_mem:
        m["total"] = sum(m.values())
    rank = {"busy_s": busy, "memory_gib": [float(x) for x in total_mem[:len(owner)]], "memory": rank_mem,
            "terms": rank_terms, "crit_cross_s": micro * full * on_crit, "crit_cross_dp_s": dp_cross_exposed,
            "cross_gb": max(sent_gb, default=0.0),
            "usable_gib": [usable_gib(c, p) for c in clusters], "owner": list(owner), "cross_dp_s": cross_dp,
            "clusters": clusters, "crossing": list(crossing),
            "keys": keys if layout is not None else [(i, None) for i in range(len(clusters))]}
    return a, res, rank


def shares_report(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                       params: CostParams = DEFAULT_PARAMS) -> CostReport:
    """The estimate of a plan with dp_shares or pools on a cluster of one GPU type: a plan
    over several pools needs a pooled cluster; pools naming one pool is placement only; uneven
    shares are priced at the replica with the most micro-batches (the others wait for it),
    with throughput and MFU counted on the whole global batch."""
    import dataclasses

    if plan.multi_pool:
        raise MeshplanError(f"plan uses pools {':'.join(plan.pools or ())} but cluster {cluster.name} has one GPU "
                            "type", hint="give a cluster file with [[pools]] (docs/heterogeneous-hardware.md), "
                                         "or drop pools/pool_dp/pool_pp")
    if plan.pools is not None and cluster.name not in plan.pools and not plan.pools[0]:
        raise MeshplanError("plan: pools names no pool")
    plain = plan.replace(pools=None, pool_dp=None, pool_pp=None, dp_shares=None)
    if plan.dp_shares is None or len(set(plan.replica_shares)) == 1:
        return plan_report(model, cluster, plain, work, params)
    ran, run_notes = as_run(plan)
    plain = plain.replace(zero=ran.zero)
    samples = replica_samples(plan, work.global_batch)
    sub = work.shaped(max(samples) * plan.dp, work.seq_len, work.lengths)
    r = plan_report(model, cluster, plain, sub, params)
    k = work.global_batch / sub.global_batch
    waits = (max(samples) - min(samples)) // plan.micro_batch
    note = (f"uneven dp_shares: the replica with the most micro-batches ({max(samples) // plan.micro_batch}) sets "
            f"the step; the one with the fewest idles for {waits} micro-batches' time")
    return dataclasses.replace(r, tokens_per_s=work.tokens / r.step_time_s, tflops_per_gpu=r.tflops_per_gpu * k,
                               mfu=r.mfu * k, hfu=r.hfu * k, microbatches=max(samples) // plan.micro_batch,
                               notes=[*r.notes, note, *run_notes])


def _cross_send(a: Any, plan: Plan, link: Any, p: CostParams) -> tuple[float, float]:
    """(bytes of one pipeline send, extra exposed seconds when it crosses ``link`` instead of the
    pool's own network) for assembly ``a``'s one row."""
    from meshplan.cost.layer import act_scale
    tp = plan.tp if plan.p2p_sharded else 1
    nbytes = float(a.tokens[0]) * float(act_scale(np.asarray([plan.precision]))[0]) * a.lay.send / tp
    cross = nbytes / link.bytes_per_s + link.latency_us * 1e-6
    from meshplan.cost.params import p2p_exposed
    return nbytes, max(0.0, cross - float(a.send[0])) * float(p2p_exposed(p, plan.virtual_stages))


def pool_pipeline_cross(model: LayerGraph | ModelSpec, cluster: PooledCluster, plan: Plan, work: Workload,
                        params: CostParams, send_s: float) -> float:
    """Extra exposed seconds of one send between two pools' boundary stages (for the simulator)."""
    from meshplan.cost.parts import plans_to_columns
    from meshplan.spec.transformer import as_graph
    first = cluster.pool(plan.pools[0]) if plan.pools else cluster.pools[0]
    cols = {k: np.asarray(v) if k != "stage_layers" else v for k, v in plans_to_columns([plan]).items()}
    a = _b.assemble(as_graph(model, work.seq_len), pool_cluster(first, plan.num_gpus), work, cols, params)
    return _cross_send(a, plan, cluster.inter_pool, params)[1]


def device_order(plan: Plan) -> bool:
    """A plan over several pools in device order: neither pool_dp nor pool_pp, its ranks laid in
    placement order (mesh_order) over the pools' GPUs in the order ``pools`` names them, so that a
    stage or a data-parallel group may take GPUs of several types."""
    return plan.multi_pool and plan.pool_dp is None and plan.pool_pp is None


@dataclass(frozen=True)
class DeviceLayout:
    """Where the ranks of a plan in device order (`device_order`) run: rank r on the GPU of index r
    of the pools' GPUs, each pool's in turn (the first pool's first; the last may be used in part)."""

    pool_of_rank: tuple[int, ...]
    """Global rank -> index into the plan's pools."""
    gpus: tuple[int, ...]
    """GPUs of each pool the plan uses (they add up to the plan's GPUs)."""
    touched: tuple[tuple[int, ...], ...]
    """Per pipeline stage: the pools its GPUs lie in."""
    groups: tuple[tuple[tuple[int, ...], ...], ...]
    """Per pipeline stage, per data-parallel replica: the pools its tensor- and context-parallel group
    (tp x cp GPUs) lies in: one, or several where the group spans pools (`spanning`)."""
    dp_counts: tuple[tuple[int, ...], ...]
    """Per pipeline stage: its data-parallel replicas in each pool it touches, for the exchange across
    pools after the sync within each (`cross_dp_seconds`). A stage with a group spanning pools has one
    entry, dp: its whole sync is priced on the spanning links (`spanning_cluster`), no exchange is added."""
    crossing: tuple[bool, ...]
    """Per stage boundary b (stages b, b + 1): some replica's two GPUs lie in different pools."""
    rep_crossing: tuple[tuple[bool, ...], ...]
    """Per stage boundary b, per replica: its send between stages b and b + 1 crosses pools."""

    def spanning(self, stage: int) -> bool:
        """Stage ``stage`` has a tensor- or context-parallel group whose GPUs lie in several pools."""
        return any(len(g) > 1 for g in self.groups[stage])


def device_layout(pools: list[ClusterSpec], plan: Plan) -> DeviceLayout:
    """The layout of a plan in device order over ``pools``; a MeshplanError (with a hint) for what is
    not runnable or not modelled: more GPUs than the pools hold, a named pool left without GPUs, expert
    parallelism, interleaved or ZBV schedules. A tensor- or context-parallel group may span pools
    (priced by `spanning_cluster`)."""
    from meshplan.spec.axes import ParallelDims
    names = ":".join(p.name for p in pools)
    hint = f"or place whole replicas (pools={names},pool_dp=...) or stages (pool_pp=...) on pools"
    total, held = plan.num_gpus, sum(p.num_gpus for p in pools)
    if total > held:
        raise MeshplanError(f"plan: {total} GPUs in device order over pools {names}, but they hold {held}",
                            hint="fewer GPUs (tp x pp x dp x cp), or more pools")
    gpus, left = [], total
    for pool in pools:
        gpus.append(min(left, pool.num_gpus))
        left -= gpus[-1]
    empty = [p.name for p, n in zip(pools, gpus) if n == 0]
    if empty:
        raise MeshplanError(f"plan: its {total} GPUs in device order fill the pools before {', '.join(empty)}, "
                            "which gets none", hint=f"drop {', '.join(empty)} from pools, or use more GPUs")
    if plan.ep > 1:
        raise MeshplanError("plan: expert parallelism in device order over several pools is not supported",
                            hint=hint)
    if plan.virtual_stages > 1 or plan.schedule == "zbv":
        raise MeshplanError("plan: a pipeline in device order over pools takes one stage per rank "
                            "(virtual_stages=1, not zbv)", hint="drop virtual_stages / schedule=zbv")
    owner = np.repeat(np.arange(len(pools)), gpus)
    grid = ParallelDims.of(plan).rank_grid()  # (pp, dp, cp, tp) -> global rank
    inner = owner[grid].reshape(plan.pp, plan.dp, -1)  # the pool of every GPU of each (stage, replica)
    groups = tuple(tuple(tuple(sorted(set(inner[j, d].tolist()))) for d in range(plan.dp)) for j in range(plan.pp))
    touched = tuple(tuple(sorted({i for g in groups[j] for i in g})) for j in range(plan.pp))
    counts = tuple((plan.dp,) if any(len(g) > 1 for g in groups[j]) else
                   tuple(sum(1 for g in groups[j] if g == (i,)) for i in t) for j, t in enumerate(touched))
    rep_crossing = tuple(tuple(bool((inner[b, d] != inner[b + 1, d]).any()) for d in range(plan.dp))
                         for b in range(plan.pp - 1))
    return DeviceLayout(pool_of_rank=tuple(int(x) for x in owner), gpus=tuple(gpus), touched=touched, groups=groups,
                        dp_counts=counts, crossing=tuple(any(r) for r in rep_crossing), rep_crossing=rep_crossing)


def spanning_cluster(pool: ClusterSpec, members: list[ClusterSpec], link: Any) -> ClusterSpec:
    """A tensor- or context-parallel group (and its stage's data-parallel sync) that spans pools, as a
    cluster: ``pool`` (one member's GPU, its part of the plan) with every tier of its network the slowest
    of ``link`` (inter_pool) and the members' own tiers, the largest latency: a group spanning pools runs
    its collectives at the pace of the slowest link it crosses, as a group spanning any slow tier does."""
    import dataclasses

    def slowest(tiers: list[Any], name: str) -> Any:
        t = min(tiers, key=lambda x: (x.bytes_per_s, -x.latency_us))
        return dataclasses.replace(t, name=name, latency_us=max(x.latency_us for x in tiers), shared=False,
                                   sites=None)
    return pool.replace(intra_node=slowest([link, *(m.intra_node for m in members)], "intra_node"),
                        inter_node=slowest([link, *(m.inter_node for m in members)], "inter_node"))


def stage_candidates(layout: DeviceLayout, replicas: tuple[int, ...] | None = None
                     ) -> list[list[tuple[int, tuple[int, ...] | None]]]:
    """Per pipeline stage, what each of its replicas (``replicas``; None: all) may be timed on, as
    (pool whose GPU computes, the pools whose links a spanning group crosses, or None): a replica whose
    group lies in one pool, that pool's own hardware; in a stage with a group spanning pools, every
    replica on its group's GPUs with the links of all the pools the stage touches (`spanning_cluster`).
    The stage (or the replica class) is timed on the slowest of them."""
    out = []
    for j, per in enumerate(layout.groups):
        reps = range(len(per)) if replicas is None else replicas
        link = layout.touched[j] if layout.spanning(j) else None
        out.append(list(dict.fromkeys((i, link) for d in reps for i in per[d])))
    return out


def cross_dp_seconds(params_per_gpu: float, plan: Plan, counts: tuple[int, ...], link: Any,
                     p: CostParams) -> float:
    """Seconds of a data-parallel group's exchange across pools (its members' counts per pool),
    after the sync within each pool (priced there): as the pool_dp sync, one all-reduce of every
    GPU's gradient shard over ``link`` in a ring of the k pools, each GPU on its own lane; the pool
    with the fewest replicas holds the largest shard. 0 within one pool."""
    k = len(counts)
    if k < 2:
        return 0.0
    return cross_dp_bytes(params_per_gpu, plan, counts, p) / link.bytes_per_s + 2 * (k - 1) * link.latency_us * 1e-6


def cross_dp_bytes(params_per_gpu: float, plan: Plan, counts: tuple[int, ...], p: CostParams) -> float:
    """Bytes each GPU sends over inter_pool in `cross_dp_seconds`' exchange: 2 (k - 1) / k of the
    largest gradient shard (a ring all-reduce over the k pools). 0 within one pool."""
    from meshplan.cost.parts import plans_to_columns
    from meshplan.cost.sync import reduce_bytes
    k = len(counts)
    if k < 2:
        return 0.0
    rb = float(reduce_bytes(plans_to_columns([plan]), p)[0])
    shard = params_per_gpu * rb / (plan.cp * min(counts))
    return 2 * (k - 1) / k * shard


@dataclass(frozen=True)
class ReplicaClass:
    """Data-parallel replicas of a plan in device order that run alike: the same pools at every stage,
    the same sends across pools and (with uneven dp_shares) the same micro-batches per step."""

    replicas: tuple[int, ...] | None
    """Their indices; None: every replica, in lockstep (even shares: each stage at its slowest replica's pace)."""
    micro: int
    """Micro-batches per step of each of them."""


def replica_classes(layout: DeviceLayout, micro: list[int]) -> list[ReplicaClass]:
    """The replicas grouped by what they run on (their groups' pools at every stage, their sends across
    pools) and their micro-batches (``micro``, one per replica), in replica order."""
    out: dict[Any, list[int]] = {}
    for d, m in enumerate(micro):
        key = (tuple(g[d] for g in layout.groups), tuple(c[d] for c in layout.rep_crossing), m)
        out.setdefault(key, []).append(d)
    return [ReplicaClass(tuple(v), k[2]) for k, v in out.items()]


def uneven_shares(plan: Plan) -> bool:
    """``plan``'s dp_shares give its replicas different shares of the batch."""
    return plan.dp_shares is not None and len(set(plan.replica_shares)) > 1


@dataclass
class DevicePipelines:
    """A plan in device order as the cost model prices it (`device_pipelines`), shared with the simulator."""

    layout: DeviceLayout
    plan: Plan
    """The pipeline's plan on one GPU type (as the runtime runs it: `as_run`; no pools, no shares)."""
    notes: list[str]
    priced: list[tuple[ReplicaClass, Workload, dict[str, np.ndarray], dict[str, Any]]]
    """Per replica class: its work (its micro-batches x dp x micro_batch samples), its `_pool_pipeline`
    row and per-rank facts."""

    @property
    def critical(self) -> tuple[ReplicaClass, Workload, dict[str, np.ndarray], dict[str, Any]]:
        """The class whose pipeline sets the step (the longest)."""
        return max(self.priced, key=lambda x: float(x[2]["step_time_s"][0]))


def device_pipelines(model: LayerGraph | ModelSpec, cluster: PooledCluster, plan: Plan, work: Workload,
                     params: CostParams = DEFAULT_PARAMS) -> DevicePipelines:
    """The one rule for a plan in device order, for the estimate and the simulator. Even shares: one
    pipeline whose stages run in lockstep, each at the slowest replica's pace (`_pool_pipeline` with the
    layout). Uneven ``dp_shares`` (the runtime then keeps the parameters gathered, `as_run`, so the
    replicas run apart until the end-of-step sync): one pipeline per class of replicas (`replica_classes`),
    each with its own micro-batches and each stage on the slowest GPU its own group touches; the step is
    the longest class's (its stages' time: share x its per-micro-batch time on its slowest member)."""
    pools = plan_pools(cluster, plan)
    layout = device_layout(pools, plan)
    ran, notes = as_run(plan)
    sub = ran.replace(dp_shares=None, pools=None, pool_dp=None, pool_pp=None)
    big = [pool_cluster(pool, plan.num_gpus) for pool in pools]
    if uneven_shares(plan):
        samples = replica_samples(plan, work.global_batch)
        classes = replica_classes(layout, [n // plan.micro_batch for n in samples])
    else:
        classes = [ReplicaClass(None, microbatches(work.global_batch, sub.dp, sub.micro_batch))]
    priced = [(cls, *_class_pipeline(model, cluster, big, layout, sub, work, params, cls)) for cls in classes]
    return DevicePipelines(layout=layout, plan=sub, notes=notes, priced=priced)


def _class_pipeline(model: LayerGraph | ModelSpec, cluster: PooledCluster, big: list[ClusterSpec],
                    layout: DeviceLayout, sub: Plan, work: Workload, params: CostParams, cls: ReplicaClass
                    ) -> tuple[Workload, dict[str, np.ndarray], dict[str, Any]]:
    """One class of replicas' pipeline: (its work, its `_pool_pipeline` row, per-rank facts)."""
    w = work if cls.replicas is None else work.shaped(cls.micro * sub.dp * sub.micro_batch, work.seq_len,
                                                      work.lengths)
    _, res, rank = _pool_pipeline(model, big, [], cluster.inter_pool, w, sub, params, layout=layout,
                                  replicas=cls.replicas)
    return w, res, rank


def class_step(model: LayerGraph | ModelSpec, cluster: PooledCluster, plan: Plan, work: Workload,
               params: CostParams, replicas: tuple[int, ...], micro: int) -> float:
    """Seconds per step of the pipeline of ``replicas`` (one class of `replica_classes`) of ``plan`` in device
    order when each of them runs ``micro`` micro-batches, as `device_pipelines` prices it under uneven shares
    (the parameters kept gathered: zero=2/3 as zero=1). The search fits its shares by speed on it."""
    pools = plan_pools(cluster, plan)
    sub = plan.replace(dp_shares=None, pools=None, pool_dp=None, pool_pp=None, zero=min(plan.zero, 1))
    big = [pool_cluster(pool, plan.num_gpus) for pool in pools]
    _, res, _ = _class_pipeline(model, cluster, big, device_layout(pools, plan), sub, work, params,
                                ReplicaClass(replicas, micro))
    return float(res["step_time_s"][0])


def _estimate_device_order(model: LayerGraph | ModelSpec, cluster: PooledCluster, pools: list[ClusterSpec],
                           plan: Plan, work: Workload, params: CostParams) -> PooledEstimate:
    """A plan in device order over pools (`device_order`): one pipeline (or one per class of replicas
    with uneven shares), spliced as for pool_pp, each stage on the slowest GPU it touches
    (`device_pipelines`)."""
    layout = device_layout(pools, plan)
    sub = as_run(plan)[0].replace(dp_shares=None, pools=None, pool_dp=None, pool_pp=None)
    big = [pool_cluster(pool, plan.num_gpus) for pool in pools]
    # uneven shares: each replica's share whole micro-batches (one line otherwise), the plan checked at the largest
    checked = (work.shaped(max(replica_samples(plan, work.global_batch)) * plan.dp, work.seq_len, work.lengths)
               if uneven_shares(plan) else work)
    for pool, c in zip(pools, big):
        bad = violations(model, c, sub, checked, skip=("gpu count mismatch",))
        if bad:
            raise MeshplanError(f"plan cannot run: pool {pool.name}: " + "; ".join(reason for _, reason in bad))
    if work.varied:
        raise MeshplanError("plan: a plan in device order over pools under a length distribution is not "
                            "supported yet", hint="give one --seq-len, or place replicas (pool_dp) or stages "
                                                   "(pool_pp) on pools")
    dev = device_pipelines(model, cluster, plan, work, params)
    crit_cls, crit_work, res, rank = dev.critical
    step = float(res["step_time_s"][0])
    usable = rank["usable_gib"]
    every = tuple(range(plan.dp))
    per_stage = [max(r["memory_gib"][j] for *_, r in dev.priced) for j in range(plan.pp)]
    parts = []
    for i, pool in enumerate(pools):
        on = [(k, j) for k, (cls, *_rest) in enumerate(dev.priced) for j in range(plan.pp)
              if any(i in layout.groups[j][d] for d in (cls.replicas or every))]
        stages = sorted({j for _, j in on})

        def fact(key: str, kj: tuple[int, int]) -> Any:
            return dev.priced[kj[0]][3][key][kj[1]]
        top = max(on, key=lambda kj: fact("busy_s", kj))
        full = max(on, key=lambda kj: fact("memory_gib", kj))
        busy, mem = fact("busy_s", top), fact("memory_gib", full)
        fits, risk, prob = verdicts(np.asarray([mem]), usable[i], params)  # (so each stage's smallest GPU too)
        span = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}"
        mixed = [j for j in stages if len(layout.touched[j]) > 1]
        across = [j for j in stages if layout.spanning(j)]
        role = (f"{span}, {layout.gpus[i]} GPUs in device order"
                + (f"; stage{'s' * (len(mixed) > 1)} {', '.join(map(str, mixed))} shared with other pools, "
                   "at the slowest member's pace" if mixed else "")
                + (f"; tensor/context-parallel groups across pools in stage{'s' * (len(across) > 1)} "
                   f"{', '.join(map(str, across))}, on inter_pool" if across else ""))
        if crit_cls.replicas is not None:
            mine = sorted({c.micro for c, *_ in dev.priced
                           if any(i in layout.groups[j][d] for j in range(plan.pp) for d in c.replicas or ())})
            role += (f"; {mine[0]}{f'-{mine[-1]}' if mine[-1] != mine[0] else ''} micro-batches per replica "
                     "(dp_shares)")
        parts.append(PoolPart(name=pool.name, gpu=pool.gpu.name, gpus=layout.gpus[i], gpus_total=pool.num_gpus,
                              role=role, step_s=busy, busy_fraction=busy / step, peak_memory_gib=mem,
                              usable_memory_gib=usable[i], fits=bool(fits[0]), at_risk=bool(risk[0]),
                              oom_probability=float(prob[0]), time=dict(fact("terms", top)),
                              memory=dict(fact("memory", full)),
                              memory_per_stage=[per_stage[j] for j in stages]))
    slowest = max(p.step_s for p in parts)
    for p in parts:
        p.idle_s = slowest - p.step_s
    time = pipeline_time(res, rank["crit_cross_s"], 0.0, rank["crit_cross_dp_s"])
    flops = float(res["model_flops"][0]) * work.global_batch / crit_work.global_batch  # the whole batch's
    est = _finish(plan, work, pools, parts, step, flops, time["cross_pool"],
                  max(float(r["cross_gb"]) for *_, r in dev.priced))
    est.time = time | {"pool_idle": est.imbalance_s}
    est.extra = row_extras(res, est) | {"memory_per_stage": per_stage}
    est.runtime = runtime_issues(model, cluster, plan, work)
    timed = ", ".join(f"{j}: {_timed_on(pools, rank['keys'][rank['owner'][j]])}" for j, t in enumerate(layout.touched)
                      if len(t) > 1)
    est.notes.append("device order over pools: ranks laid over the pools' GPUs in order; a stage spanning GPU types "
                     f"runs at its slowest member's pace, its memory checked against the smallest GPU"
                     + (f" (stages timed on: {timed})" if timed else "")
                     + "; a data-parallel group over several pools syncs within each pool, then across them over "
                       "inter_pool (its exposed time in cross_pool, not dp_comm)")
    if any(layout.spanning(j) for j in range(plan.pp)):
        est.notes.append("a tensor- or context-parallel group spans pools: it computes at its slowest member's pace, "
                         "fits on its smallest GPU, and its collectives (and its stage's data-parallel sync) run on "
                         "the slowest link it crosses (inter_pool)")
    if crit_cls.replicas is not None:
        cls_text = "; ".join(f"replicas {ranges_text(c.replicas or ())}: {c.micro} micro-batches, "
                             f"{float(r['step_time_s'][0]):.3f} s" for c, _, r, _ in dev.priced)
        est.notes.append("uneven dp_shares in device order: each class of replicas runs its own pipeline "
                         f"({cls_text}); the longest sets the step")
    est.notes += dev.notes
    return est


def _timed_on(pools: list[ClusterSpec], key: tuple[int, tuple[int, ...] | None]) -> str:
    i, span = key
    return pools[i].name if span is None else f"{pools[i].name} across {'+'.join(pools[m].name for m in span)}"


def device_splice(model: LayerGraph | ModelSpec, cluster: PooledCluster, plan: Plan, work: Workload,
                  params: CostParams = DEFAULT_PARAMS) -> list[dict[str, Any]]:
    """How the cost model splices a plan in device order (for the simulator, sim.pools), per class of
    replicas (`device_pipelines`; one without uneven shares): its ``work``; ``clusters`` (the pools'
    hardware, then any `spanning_cluster`); per stage ``owner`` (the index into ``clusters`` it is timed
    on: the slowest it touches) and ``cross_dp_s`` (its data-parallel exchange across pools, added to its
    end-of-step sync); per boundary ``crossing`` (a send over inter_pool); ``keys`` (per cluster, the pool
    whose GPU it is and the pools a spanning group crosses, or None); ``plan`` (the pipeline's plan on one
    GPU type, as the runtime runs it)."""
    dev = device_pipelines(model, cluster, plan, work, params)
    return [{"replicas": cls.replicas, "micro": cls.micro, "work": w, "clusters": list(rank["clusters"]),
             "keys": list(rank["keys"]), "plan": dev.plan,
             "owner": list(rank["owner"]), "crossing": list(rank["crossing"]), "cross_dp_s": list(rank["cross_dp_s"])}
            for cls, w, _, rank in dev.priced]
