"""When nothing is feasible: the nearest feasible options, never just "no plan".

The memory-saving corner of the space is the part that uses least memory per GPU: ZeRO-3
sharded over all data-parallel ranks, optimizer and parameter offload where the space has
them, full recompute of every block, the smallest micro-batch, every mesh shape and schedule.
It is small (hundreds of plans), so it is priced for:
  * the cluster as given (how far the most memory-saving plan is from fitting);
  * the request without the user's restrictions (--fix), on the same cluster;
  * larger clusters of the same GPU (doubling, then bisection over whole nodes: the smallest
    size found, reported as "needs at least");
  * the same number of GPUs with more memory (GPU presets).
A corner plan that fits is then refined (`refine`): on its mesh, the fastest fitting plan over
all ZeRO levels, offload, recompute and micro-batch sizes is the example shown.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.cost.memory import usable_gib
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.uncertainty import risk_words
from meshplan.errors import MeshplanError
from meshplan.search.columns import PlanColumns
from meshplan.search.constraints import first_violation, violation_masks
from meshplan.search.evaluate import evaluate, recommendable
from meshplan.search.sizes import MAX_GPUS, nice_sizes, node_size, resized
from meshplan.search.space import SearchSpace, enumerate_space
from meshplan.spec.cluster import ClusterSpec, GPUSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import MAX_COUNT, Plan, Workload
from meshplan.units import gib_need

MAX_GROWTH = 64
"""Clusters up to this many times the given size (and at least 65,536 GPUs, at most
sizes.MAX_GPUS) are tried."""


def growth_limit(cluster: ClusterSpec) -> int:
    return min(max(cluster.num_gpus * MAX_GROWTH, 65536), MAX_GPUS)


@dataclass(frozen=True)
class Corner:
    """The most memory-saving plan of a SearchSpace on one cluster."""

    cluster: ClusterSpec
    plan: Plan | None
    """None when no plan passes the constraints."""
    peak_memory_gib: float
    fits: bool
    step_time_s: float


def corner_space(space: SearchSpace) -> SearchSpace:
    """The memory-saving corner of ``space`` (rows are then narrowed by `corner_rows`)."""
    rc = ("full",) if "full" in space.recompute else space.recompute
    return space.replace(zero=(max(space.zero),), hybrid_nodes=(), recompute=rc,
                         recompute_fractions=())


def corner_rows(cols: PlanColumns, space: SearchSpace) -> np.ndarray:
    """Indices of the memory-saving corner among ``cols`` (enumerated from corner_space)."""
    z = max(space.zero)
    sel = (cols["zero"] == z) & (cols["shard_group"] == 0)
    if space.offload and z >= 1:
        sel &= cols["offload_optimizer"] & (cols["offload_params"] == (z == 3))
    rank = cols.meta.get("mb_rank")
    if rank is not None:
        sel &= rank == 0
    return np.nonzero(sel)[0]


def memory_corner(model: ModelSpec, cluster: ClusterSpec, work: Workload, space: SearchSpace,
                  params: CostParams = DEFAULT_PARAMS) -> Corner:
    """The fastest fitting plan of the corner, or (none fits) its least-memory plan."""
    cspace = corner_space(space)
    cols = enumerate_space(model, cluster, work, cspace, params)
    sub = cols.take(corner_rows(cols, cspace))
    masks = violation_masks(model, cluster, work, sub, export_only=getattr(space, "allow_export_only", False))
    ok = first_violation(masks, sub.num_rows) < 0
    sub = sub.take(np.nonzero(ok)[0])
    if sub.num_rows == 0:
        return Corner(cluster, None, float("inf"), False, float("inf"))
    res = evaluate(model, cluster, work, sub, params)
    usable = recommendable(res, getattr(space, "headroom", True))
    fits = np.nonzero(usable)[0]
    j = (int(fits[np.argmin(res["step_time_s"][fits])]) if len(fits)  # fastest that fits
         else int(np.argmin(res["peak_memory_gib"])))  # else the least memory
    return Corner(cluster, sub.plan(j), float(res["peak_memory_gib"][j]), bool(usable[j]),
                  float(res["step_time_s"][j]))


def _corner_at(model: ModelSpec, cluster: ClusterSpec, work: Workload, space: SearchSpace,
               params: CostParams) -> Corner:
    """`memory_corner`, or a Corner without a plan where no mesh of ``space`` makes the cluster's
    GPU count (e.g. 56 GPUs under --fix pp=16): that size has no plan, which is not the reason
    the request fails (issue 29: the error of a size tried while growing was reported instead)."""
    try:
        return memory_corner(model, cluster, work, space, params)
    except MeshplanError:
        return Corner(cluster, None, float("inf"), False, float("inf"))


def next_size(n: int, node: int) -> int:
    """The next cluster size tried when growing: doubling, in whole nodes once past one node."""
    return n * 2 if n >= node else min(n * 2, node)


def smallest_fitting_size(model: ModelSpec, cluster: ClusterSpec, work: Workload,
                          space: SearchSpace, params: CostParams = DEFAULT_PARAMS) -> Corner | None:
    """Smallest larger cluster of the same GPU where the corner fits: doubling, then bisection
    over whole nodes between the last size that failed and the first that fitted. None up to
    the growth limit. (Fitting need not be monotone in the size, because of divisibility, so
    this is the smallest size found, not a proof that nothing smaller fits.)"""
    node = node_size(cluster)
    limit = growth_limit(cluster)
    lo, size, found = cluster.num_gpus, cluster.num_gpus, None
    while found is None:
        size = next_size(size, node)
        if size > limit:
            return None
        c = _corner_at(model, resized(cluster, size), work, space, params)
        if c.fits:
            found = c
        else:
            lo = size
    lo_nodes, hi_nodes = lo // node, size // node
    while hi_nodes - lo_nodes > 1 and hi_nodes > 1:
        mid = (lo_nodes + hi_nodes) // 2
        c = _corner_at(model, resized(cluster, mid * node), work, space, params)
        if c.fits:
            hi_nodes, found = mid, c
        else:
            lo_nodes = mid
    return found


def fewer_gpus(model: ModelSpec, cluster: ClusterSpec, work: Workload, space: SearchSpace,
               params: CostParams = DEFAULT_PARAMS) -> Corner | None:
    """When no plan passes the constraints (typically: more GPUs than the global batch, heads,
    layers and sequence can be split over), the largest smaller cluster of the same GPU among
    the usual sizes (powers of two and 3 x 2^k, `sizes.nice_sizes`) where the corner fits.
    None down to one GPU."""
    for n in reversed(nice_sizes(1, cluster.num_gpus - 1, node_size(cluster))):
        c = _corner_at(model, resized(cluster, n), work, space, params)
        if c.plan is not None and c.fits:
            return c
    return None


def larger_batch(model: ModelSpec, cluster: ClusterSpec, work: Workload, space: SearchSpace,
                 params: CostParams = DEFAULT_PARAMS) -> tuple[int, Corner] | None:
    """The smallest global batch (doubling, up to one sequence per GPU and a little more) with
    which the corner fits on ``cluster``; None if none does."""
    b = work.global_batch
    while b < min(4 * cluster.num_gpus, MAX_COUNT // 2):
        b *= 2
        c = _corner_at(model, cluster, work.shaped(b, work.seq_len), space, params)
        if c.plan is not None and c.fits:
            return b, c
    return None


def larger_memory_gpus(cluster: ClusterSpec) -> list[GPUSpec]:
    """The GPU presets with more memory than ``cluster``'s, smallest memory first."""
    from meshplan.spec.io import load_gpu, preset_names  # io is heavy-ish; only on this path
    gpus = [load_gpu(n) for n in preset_names("gpus")]
    return sorted((g for g in gpus if g.memory_gib > cluster.gpu.memory_gib), key=lambda g: (g.memory_gib, g.name))


def bigger_gpus(model: ModelSpec, cluster: ClusterSpec, work: Workload, space: SearchSpace,
                params: CostParams = DEFAULT_PARAMS) -> Corner | None:
    """The same number of GPUs of the smallest-memory preset type on which the corner fits."""
    for g in larger_memory_gpus(cluster):
        c = memory_corner(model, cluster.replace(gpu=g, name=f"{g.name}:{cluster.num_gpus}"),
                          work, space, params)
        if c.fits:
            return c
    return None


def refine(model: ModelSpec, corner: Corner, work: Workload, space: SearchSpace,
           params: CostParams = DEFAULT_PARAMS) -> Corner:
    """The fastest fitting plan with the corner plan's mesh (tp, cp, pp, ep, schedule), over
    every ZeRO level, offload, recompute and micro-batch of ``space``: a better example than
    the corner itself, which offloads and recomputes everything."""
    p = corner.plan
    if p is None or not corner.fits:
        return corner
    sub = space.replace(tp=(p.tp,), cp=(p.cp,), pp=(p.pp,), ep=(p.ep,), schedules=(p.schedule,))
    cols = enumerate_space(model, corner.cluster, work, sub, params)
    ok = first_violation(violation_masks(model, corner.cluster, work, cols), cols.num_rows) < 0
    cols = cols.take(np.nonzero(ok)[0])
    res = evaluate(model, corner.cluster, work, cols, params)
    fits = np.nonzero(recommendable(res, getattr(space, "headroom", True)))[0]
    if len(fits) == 0:  # pragma: no cover - the corner itself is in this sub-space
        return corner
    j = int(fits[np.lexsort((res["peak_memory_gib"][fits], res["step_time_s"][fits]))[0]])
    return Corner(corner.cluster, cols.plan(j), float(res["peak_memory_gib"][j]), True,
                  float(res["step_time_s"][j]))


def corner_reason(model: ModelSpec, cluster: ClusterSpec, work: Workload, space: SearchSpace) -> str:
    """'; most often: NAME': the rule that rejects most of the memory-saving corner's candidates
    ('' when none is rejected or the space has no mesh)."""
    cspace = corner_space(space)
    try:
        cols = enumerate_space(model, cluster, work, cspace)
    except MeshplanError:
        return ""
    sub = cols.take(corner_rows(cols, cspace))
    masks = violation_masks(model, cluster, work, sub, export_only=getattr(space, "allow_export_only", False))
    first = first_violation(masks, sub.num_rows)
    first = first[first >= 0]
    if len(first) == 0:
        return ""
    names = list(masks)
    return f"; most often: {names[int(np.bincount(first).argmax())]}"


def _short(c: Corner) -> str:
    return c.plan.short() if c.plan is not None else "(no plan)"


def nearest_options(model: ModelSpec, cluster: ClusterSpec, work: Workload, space: SearchSpace,
                    params: CostParams = DEFAULT_PARAMS) -> list[str]:
    """Sentences naming what would make the request feasible."""
    out = []
    usable = usable_gib(cluster, params)
    here = memory_corner(model, cluster, work, space, params)
    gpu = cluster.gpu.name
    if here.plan is not None and not here.fits:
        why = f"needs {gib_need(here.peak_memory_gib, usable)}"
        if here.peak_memory_gib <= usable:  # it fits the GPU: the host, or the headroom, rules it out
            from meshplan.cost import estimate
            r = estimate(model, cluster, here.plan, work, params)
            why += (f", but its offload needs {r.host_memory_gib:.0f} GiB of host memory per GPU (of "
                    f"{cluster.host_memory_per_gpu_gib:.0f}, the node's {cluster.host_memory_per_node_gib:,.0f} GiB "
                    f"over {cluster.gpus_per_node})" if not r.host_fits else
                    f", but {risk_words(params)}")
        out.append(f"on {cluster.num_gpus} x {gpu} the most memory-saving plan ({here.plan.short()}) {why}")
    open_space = SearchSpace(base=space.base, uneven_stages=space.uneven_stages)
    if space != open_space:
        free = memory_corner(model, cluster, work, open_space, params)
        if free.fits and free.plan is not None:
            free = refine(model, free, work, open_space, params)
            out.append(f"without the --fix restrictions it fits on {cluster.num_gpus} GPUs: "
                       f"{_short(free)} ({free.peak_memory_gib:.1f} GiB per GPU)")
    if here.plan is None:  # the constraints, not memory, rule everything out on this size
        fewer = fewer_gpus(model, cluster, work, space, params)
        if fewer is not None and fewer.plan is not None:
            fewer = refine(model, fewer, work, space, params)
            out.append(f"no plan passes the constraints on {cluster.num_gpus} GPUs (see the rejection "
                       f"reasons); on fewer GPUs it fits: {fewer.cluster.num_gpus} x {gpu}, e.g. "
                       f"{_short(fewer)} ({fewer.peak_memory_gib:.1f} GiB per GPU)")
        batch = larger_batch(model, cluster, work, space, params)
        if batch is not None:
            b, c = batch
            c = refine(model, c, work.shaped(b, work.seq_len), space, params)
            out.append(f"or, on {cluster.num_gpus} GPUs, a global batch of {b} sequences: "
                       f"e.g. {_short(c)} ({c.peak_memory_gib:.1f} GiB per GPU)")
        if out:
            return out
    more = smallest_fitting_size(model, cluster, work, space, params)
    if more is not None and more.plan is not None:
        more = refine(model, more, work, space, params)
        out.append(f"needs at least {more.cluster.num_gpus} x {gpu}: e.g. {_short(more)} "
                   f"({more.peak_memory_gib:.1f} GiB per GPU)")
    big = bigger_gpus(model, cluster, work, space, params)
    if big is not None and big.plan is not None:
        big = refine(model, big, work, space, params)
        out.append(f"or {cluster.num_gpus} x {big.cluster.gpu.name}: {_short(big)} "
                   f"({big.peak_memory_gib:.1f} GiB per GPU)")
    if more is None:
        limit = growth_limit(cluster)
        if here.plan is None:
            out.append(f"no candidate passes the constraints on {cluster.num_gpus} GPUs, nor a "
                       f"memory-saving one on larger clusters up to {limit} (see the rejection "
                       f"reasons{corner_reason(model, cluster, work, space)})")
        else:
            out.append(f"no cluster of up to {limit} x {gpu} fits global batch {work.global_batch} "
                       f"x {work.seq_len} tokens; try a smaller sequence length or GPUs with more memory")
    return out
