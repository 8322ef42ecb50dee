"""The declared search space, enumerated as columns.

Every candidate is a full Plan for one cluster. The dimensions, and the values each takes
(`SearchSpace` fields override them):

  tp              divisors of gpus_per_node (that divide the GPU count); on nodes of at most 4
                  GPUs also whole numbers of nodes up to 8 GPUs (TP across nodes, priced on the
                  inter-node link)
  cp              powers of two up to ``max_cp`` whose sequence chunk s/cp has at least
                  ``min_cp_tokens`` tokens (ring attention on shorter chunks cannot hide its
                  communication; cp=1 always)
  pp              divisors of N/(tp cp) up to num_layers;  dp = N/(tp cp pp)
  ep              MoE only: divisors of num_experts; else 1
  zero            0..3; hybrid shard_group (zero >= 1): groups of dp ranks spanning 1, 2, 4 nodes
                  (and a datacenter's nodes on several datacenters) that are smaller than dp*cp and
                  divide it
  offload         with full sharding only: optimizer (zero >= 1, or dp = 1), and optimizer +
                  parameters (zero = 3); ``offload=False``: none; ``offload_only``: only these
  micro_batch     divisors of B/dp (just 1 when dp does not divide B: rejected, with its reason)
  schedule, v     pp = 1: none needed (1f1b, v = 1); pp > 1: gpipe, 1f1b, zero-bubble (v = 1),
                  zbv (v = 2), interleaved-1f1b with v = 2..max_virtual_stages
  stage_layers    even split, and the dynamic-programming split of `meshplan.search.stages`
                  where pp*v does not divide the layers (``uneven_stages=None``, the
                  default); with ``uneven_stages=True`` also where it does (when different
                  from the even one); with False never
  recompute       none, selective, op, full, and full on a fraction (1/4, 1/2, 3/4) of each
                  stage's blocks (recompute_layers)
  sequence_parallel  on exactly when tp > 1 (it only saves memory and elementwise time);
                  ``sequence_parallel=False``: off for every tp. Where the request's sends are
                  unsharded (``base.p2p_sharded=False``, e.g. DeepSpeed's pipe_partitioned off), off where
                  tp > 1 and pp > 1 too: the runtime's pipeline sends carry the sequence-parallel
                  shard exactly when it is on (spec.support), so a pipeline with TP sends whole
                  activations only without it (and BLOOM's own tp=4, pp=12 plan is in the space)
  async_tp        the request's (``SearchSpace.base``) where tp > 1; off where tp = 1 (no TP
                  communication to overlap: the same plan)
  p2p_sharded     the request's where tp > 1 and pp > 1; on (the default) elsewhere (no pipeline
                  sends, or sends of the whole activation either way: the same plan)
  precision, compile, flash_attention, fused_loss
                  fixed by the request (``SearchSpace.base``)
  grad_sync, sync_every, sync_scope, sync_overlap, grad_compression, compression_rank
                  the request's, except on weak links (``weak_links``: several datacenters, or
                  inter-node links under WEAK_NIC_GBPS per GPU; ``SearchSpace.sync_methods``
                  forces it on or off): then also ``sync_options``: bf16/fp8 compression of the
                  gradient sync, PowerSGD (ranks POWERSGD_RANKS, zero = 0), and DiLoCo / local SGD
                  across each weak tier (sync_scope dc or node) with the periods of
                  SYNC_PERIODS, with and without fp8 outer syncs and a one-step overlap
                  (DiLoCo), within groups sharded at any ZeRO level (no hybrid groups, no
                  offload: a periodic plan shards within its inner group)

Combinations that are the same plan are enumerated once (e.g. schedules when pp = 1).
Everything else is enumerated, including candidates the constraints reject, so that every
rejection is counted under its reason. ``considered`` is the number of rows.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.errors import MeshplanError
from meshplan.search.columns import CATEGORIES, FIELDS, NONE_CODE, PlanColumns
from meshplan.search.stages import balanced_stage_layers, split_layers
from meshplan.spec.axes import AX
from meshplan.spec.base import short_repr
from meshplan.spec.capabilities import Capabilities, capabilities
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import COLON_LISTS, PERIODIC_SYNC, RECOMPUTE, SCHEDULES, Plan, Workload
from meshplan.spec.support import sequence_parallel_runs
from meshplan.spec.transformer import as_graph

MAX_DEGREE = 2**31 - 1
"""Largest value of a parallel degree or micro-batch (plan columns are int32)."""

SEARCHED = (AX.TP, AX.PP, AX.DP, AX.CP, AX.EP, "zero", "shard_group", "micro_batch", "virtual_stages",
            "schedule", "recompute", "recompute_layers", "sequence_parallel", "offload_optimizer",
            "offload_params", "stage_layers")
"""Plan fields the search chooses; every other field comes from ``SearchSpace.base``."""

SYNC_FIELDS = ("grad_sync", "sync_every", "sync_scope", "grad_compression", "compression_rank", "sync_overlap")
"""The plan fields of a synchronisation option (``sync_options``), in this order."""
WEAK_NIC_GBPS = 5.0
"""Inter-node bandwidth per GPU, GB/s, below which the search also tries the weak-link sync
methods (40 Gb/s per GPU): a cloud node's 100 Gb/s Ethernet is 1.6 GB/s per GPU of 8; a DGX
H100's InfiniBand 50, Jean Zay's Omni-Path 6.25 (BLOOM's cluster, which trained synchronously)."""
SYNC_PERIODS = {"diloco": (100, 500), "local-sgd": (8, 32)}
"""Inner steps between outer syncs the search tries: DiLoCo's published H = 500 and a shorter
period; local SGD's shorter ones (its token efficiency falls with H, cost.convergence)."""
POWERSGD_RANKS = (1, 4)

PER_TP = ("async_tp", "p2p_sharded")
"""Fields of ``SearchSpace.base`` the enumeration normalises where they change nothing (async TP
off where tp = 1; p2p_sharded at its default where tp = 1 or pp = 1), so that equal plans are
written alike."""


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What to enumerate. None means the default rule of the module docstring."""

    base: Plan = field(default_factory=Plan)
    """Fields not searched (precision, compile, flash_attention, fused_loss, ...) come from here."""
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    micro_batch: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = SCHEDULES
    recompute: tuple[str, ...] = RECOMPUTE
    recompute_fractions: tuple[float, ...] = (0.25, 0.5, 0.75)
    """recompute=full on round(f x blocks per stage) blocks, for each f (0 < f < 1)."""
    max_virtual_stages: int = 8
    max_cp: int = 32
    min_cp_tokens: int = 1024
    hybrid_nodes: tuple[int, ...] = (1, 2, 4)
    """Hybrid sharding groups spanning this many nodes (empty: no hybrid sharding)."""
    offload: bool = True
    offload_only: bool = False
    """Only the offload variants (``offload`` must be True): optimizer offload, and with zero=3
    parameter offload too (`zero_options`)."""
    sequence_parallel: bool | None = None
    """None: on exactly where tp > 1; False: off for every tp."""
    uneven_stages: bool | None = None
    """Uneven pipeline stage splits (the dynamic-programming balance of `search.stages`): None
    (default) where pp x virtual_stages does not divide the layers; True also where it does;
    False never."""
    headroom: bool = True
    """Reject plans at risk of running out of memory (search.constraints.AT_RISK)."""
    buckets: bool = True
    """Under a length distribution, also try data-aware plans (micro-batch and cp per length
    bucket, search.buckets) built from the best one-shape plans."""
    allow_export_only: bool = False
    """Keep plans that meshplan's runtime would refuse or run as something else but an export
    target runs as planned (spec.support), marked as such."""
    sync_methods: bool | None = None
    """Search the weak-link sync methods (``sync_options``): None = on weak links only
    (``weak_links``), True always, False never (the request's grad_sync and compression)."""
    sync: tuple[tuple[Any, ...], ...] | None = None
    """Explicit sync options (SYNC_FIELDS tuples) instead of ``sync_options``'."""
    placements: tuple[tuple[str, ...] | None, ...] | None = None
    """Placements (Plan.mesh_order) to try for every mesh: None = ``placement_options`` (several
    orders where the cluster has several sites, the default order elsewhere)."""
    fixed_sync: tuple[tuple[str, Any], ...] = ()
    """(field, value) of the SYNC_FIELDS the request fixes (--fix grad_sync=diloco): every option
    takes them (options they make invalid are dropped); a periodic grad_sync turns the sync
    methods on."""

    def __post_init__(self) -> None:
        check_space(self, "search space", (AX.TP, AX.PP, AX.CP, AX.EP, "micro_batch"))
        for r in self.recompute:
            if r not in RECOMPUTE:
                raise MeshplanError(f"search space: unknown recompute {r!r}")
        if self.offload_only and not self.offload:
            raise MeshplanError("search space: offload_only needs offload=True")
        if self.sequence_parallel is True:
            raise MeshplanError("search space: sequence_parallel is None (on where tp > 1) or False (off)")

    def replace(self, **changes: object) -> SearchSpace:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def check_space(space: Any, where: str, degrees: tuple[str, ...]) -> None:
    """The checks of a SearchSpace: known schedules, ZeRO levels
    0..3, and each of ``degrees`` (tuples or None) between 1 and MAX_DEGREE (int32 plan columns)."""
    for s in space.schedules:
        if s not in SCHEDULES:
            raise MeshplanError(f"{where}: unknown schedule {s!r}")
    if any(z not in (0, 1, 2, 3) for z in space.zero):
        raise MeshplanError(f"{where}: zero levels must be among 0, 1, 2, 3")
    for name in degrees:
        for v in getattr(space, name) or ():
            if not 1 <= v <= MAX_DEGREE:
                raise MeshplanError(f"{where}: {name} must be between 1 and {MAX_DEGREE:,}; got {short_repr(v)}")


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# ---- per-dimension values ------------------------------------------------------------------

def node_tp(g: int) -> list[int]:
    """TP degrees tried on nodes of ``g`` GPUs: the divisors of g, and on small nodes (g <= 4:
    cloud nodes, GH200 blades) whole numbers of nodes up to 8 GPUs, priced on the inter-node link."""
    return divisors(g) + ([g * k for k in range(2, 8 // g + 1)] if g <= 4 else [])


def tp_values(cluster: ClusterSpec, space: SearchSpace) -> list[int]:
    n, g = cluster.num_gpus, cluster.gpus_per_node
    vals = space.tp if space.tp is not None else node_tp(g)
    return [t for t in vals if t >= 1 and n % t == 0]


def cp_values(n_left: int, work: Workload, space: SearchSpace, attention: bool = True) -> list[int]:
    if not attention:
        return [1]
    if space.cp is not None:
        return [c for c in space.cp if c >= 1 and n_left % c == 0]
    out, c = [], 1
    while c <= min(space.max_cp, n_left):
        if n_left % c == 0 and (c == 1 or work.seq_len // c >= space.min_cp_tokens):
            out.append(c)
        c *= 2
    return out


def pp_values(n_left: int, caps: Capabilities, space: SearchSpace) -> list[int]:
    vals = space.pp if space.pp is not None else divisors(n_left)
    most = caps.blocks if caps.pipeline is None else 1
    return [p for p in vals if p >= 1 and n_left % p == 0 and p <= max(1, most)]


def ep_values(caps: Capabilities, space: SearchSpace) -> list[int]:
    if space.ep is not None:
        return list(space.ep)
    return divisors(math.gcd(*caps.experts)) if caps.experts else [1]


def micro_batch_values(work: Workload, dp: int, space: SearchSpace) -> list[int]:
    if work.global_batch % dp:
        return [1]
    vals = divisors(work.global_batch // dp)
    if space.micro_batch is not None:
        vals = [v for v in space.micro_batch if v in vals] or [min(space.micro_batch)]
    return vals


def zero_options(cluster: ClusterSpec, tp: int, dp: int, cp: int,
                 space: SearchSpace) -> list[tuple[int, int, bool, bool]]:
    """(zero, shard_group, offload_optimizer, offload_params) combinations."""
    dpc = dp * cp
    groups = []
    nodes = list(space.hybrid_nodes)
    if cluster.num_dcs > 1 and space.hybrid_nodes:  # shard within a datacenter, replicate across (HSDP)
        nodes.append(cluster.nodes_per_dc)
    for k in nodes:
        g = k * cluster.gpus_per_node // tp
        if 1 < g < dpc and dpc % g == 0 and g * tp == k * cluster.gpus_per_node:
            groups.append(g)
    only = space.offload_only
    out = []
    for z in space.zero:
        # nothing to shard (dp x cp = 1): every ZeRO level is the same plan, in memory
        # (cost.memory.effective_zero) and in time; the lowest level stands for them
        same = dpc == 1 and z > min(space.zero)
        if not only and not same:
            out.append((z, 0, False, False))
            if z >= 1:
                out += [(z, g, False, False) for g in sorted(set(groups))]
        if space.offload and (z >= 1 or dp == 1) and not same:
            out.append((z, 0, True, False))
        if space.offload and z == 3:
            out.append((z, 0, True, True))
    return out


def weak_links(cluster: ClusterSpec) -> list[str]:
    """The weak tiers of ``cluster`` a periodic sync can span: dc (several datacenters) and node
    (inter-node links under WEAK_NIC_GBPS per GPU)."""
    out = []
    if cluster.num_dcs >= 2:
        out.append("dc")
    if cluster.num_nodes >= 2 and cluster.inter_node.bandwidth_gbps < WEAK_NIC_GBPS:
        out.append("node")
    return out


def placement_options(cluster: ClusterSpec, space: SearchSpace, sizes: dict[str, int]) -> list[tuple[str, ...] | None]:
    """The placements (mesh orders) tried for a mesh of these ``sizes``: the request's
    (``space.placements``, or the base plan's fixed mesh_order); on a cluster of several sites,
    the default (the pipeline crosses the link between sites) and data parallel outermost (its
    gradient sync crosses it, the pipeline stays inside each site), where they lay the mesh out
    differently (axes of size 1 do not count), for the plans that sync every step; on one
    site, the default only (its one slow tier is crossed by the outermost axis whatever the
    order of the rest: no cost for the search)."""
    from meshplan.spec.axes import DEFAULT_ORDER
    if space.placements is not None:
        cands = list(space.placements)
    elif space.base.mesh_order is not None:
        return [space.base.mesh_order]
    elif cluster.num_dcs > 1:  # the pipeline or data parallelism across the sites (and the nodes)
        cands = [None, (AX.DP, AX.PP, AX.CP, AX.TP)]
    else:
        return [None]
    out: list[tuple[str, ...] | None] = []
    seen: set[tuple[str, ...]] = set()
    for o in cands:
        key = tuple(a for a in (o or DEFAULT_ORDER) if sizes[a] > 1)
        if key not in seen:
            seen.add(key)
            out.append(None if o == DEFAULT_ORDER else o)
    return out


def site_order_options(cluster: ClusterSpec, space: SearchSpace, sizes: dict[str, int],
                       order: tuple[str, ...] | None) -> list[tuple[tuple[int, ...] | None, bool, bool]]:
    """The site orders (Plan.site_order) tried for a mesh of these ``sizes`` in mesh order
    ``order``, each as (site order, for plans without a wrap boundary, for plans with one (the
    interleaved schedules')): the base plan's, if it fixes one; else, on a cluster of three or
    more sites whose links between sites differ, for a pipeline that is the only axis across the
    sites (every stage in one site, spec.axes.site_order_fault), every order of the sites (a
    reversed order crosses the same links, mirrored: kept, as the stages are not alike: the first
    holds the embedding and the most micro-batches in flight, the last the loss), at most
    MAX_SITE_ORDER_SITES sites, each for the plans (with a wrap, or without)
    where no other order's boundary links (cost.comm.pipeline_links) beat or equal its own at
    every boundary (the default, the sites in their own order, first: it wins ties); with a wrap
    boundary (interleaved schedules: a ring of stages, which crosses the same links from whichever
    site it starts, either way round) the links are compared as a set (sorted), so that the
    ring's rotations and reflections count once (they differ only in which stage sits by which
    link: a second-order effect, left out to bound the search). Elsewhere
    the default only: no cost for the search on one or two sites (two sites have one link
    between them, whatever the order)."""
    if space.base.site_order is not None:
        return [(space.base.site_order, True, True)]
    k = cluster.num_dcs
    if k < 3 or k > MAX_SITE_ORDER_SITES or sizes[AX.PP] < 2 or not _distinct_site_links(cluster):
        return [(None, True, True)]
    from meshplan.cost.comm import pipeline_links
    from meshplan.spec.axes import AXES, DEFAULT_ORDER, ParallelDims, site_order_fault
    dims = ParallelDims(**{a: int(sizes[a]) for a in AXES}, order=order or DEFAULT_ORDER, sites=tuple(range(k)))
    if site_order_fault(dims, k) is not None:
        return [(None, True, True)]
    cands = [None if p == tuple(range(k)) else p for p in itertools.permutations(range(k))]
    keep = []
    for wrap in (False, True):
        links = [pipeline_links(cluster, sizes, order, wrap, p) for p in cands]
        if wrap:  # a ring: the same links from whichever site it starts, either way round: compared as a set
            links = [(np.sort(bw), np.sort(lat)[::-1]) for bw, lat in links]
        keep.append([not any((b2 >= bw).all() and (l2 <= lat).all()
                             and (j < i or (b2 > bw).any() or (l2 < lat).any())
                             for j, (b2, l2) in enumerate(links) if j != i)
                     for i, (bw, lat) in enumerate(links)])
    return [(p, kn, kw) for p, kn, kw in zip(cands, *keep) if kn or kw or p is None]  # (the default: periodic plans)


MAX_SITE_ORDER_SITES = 6
"""Most sites whose orders the search tries by brute force (6! = 720 orders)."""


def _distinct_site_links(cluster: ClusterSpec) -> bool:
    """The links between a cluster's sites differ (site_links): otherwise every order is the same."""
    k = cluster.num_dcs
    links = {(link.bytes_per_s, link.latency_us, link.shared)
             for a, b in itertools.combinations(range(k), 2) for link in [cluster.site_link(a, b)]}
    return len(links) > 1


def base_sync(base: Plan) -> tuple[Any, ...]:
    """The request's sync option."""
    return tuple(getattr(base, f) for f in SYNC_FIELDS)


def sync_options(cluster: ClusterSpec, space: SearchSpace) -> list[tuple[Any, ...]]:
    """The sync options (SYNC_FIELDS tuples) the search tries: the request's first."""
    if space.sync is not None:
        return list(space.sync)
    base = base_sync(space.base)
    fixed = dict(space.fixed_sync)
    on = space.sync_methods if space.sync_methods is not None else bool(weak_links(cluster))
    on = on or fixed.get("grad_sync") in ("local-sgd", "diloco")
    if not on:
        return [base]
    if fixed:
        out = []
        for o in _weak_options(cluster):
            o = tuple(fixed.get(f, v) for f, v in zip(SYNC_FIELDS, o))
            try:
                Plan(**dict(zip(SYNC_FIELDS, o)))
            except MeshplanError:
                continue
            out.append(o)
        return list(dict.fromkeys([base] + out))
    return list(dict.fromkeys([base] + _weak_options(cluster)))


def _weak_options(cluster: ClusterSpec) -> list[tuple[Any, ...]]:
    """The weak-link sync options of ``cluster`` (module docstring)."""
    out: list[tuple[Any, ...]] = [("auto", 1, "all", "none", 1, 0)]
    for comp in ("bf16", "fp8"):
        out.append(("auto", 1, "all", comp, 1, 0))
    out += [("auto", 1, "all", "powersgd", r, 0) for r in POWERSGD_RANKS]
    for scope in weak_links(cluster) or ["node"]:
        for h in SYNC_PERIODS["diloco"]:
            for comp in ("none", "fp8"):
                for tau in (0, 1):
                    out.append(("diloco", h, scope, comp, 1, tau))
        for h in SYNC_PERIODS["local-sgd"]:
            out.append(("local-sgd", h, scope, "none", 1, 0))
    return out


def _sync_fits(opt: tuple[Any, ...], z: int, sg: int, offo: bool, offp: bool, dp: int) -> bool:
    """Whether sync option ``opt`` goes with a (zero, shard_group, offload) option: periodic ones
    without hybrid groups or offload and with dp >= 2; PowerSGD with zero = 0; compression needs
    dp >= 2 (and is not tried with offload)."""
    gs, _, _, comp, _, _ = opt
    if gs in ("local-sgd", "diloco"):
        return sg == 0 and not offo and not offp and dp >= 2
    if comp == "powersgd":
        return z == 0 and not offo and dp >= 2
    if comp in ("bf16", "fp8"):
        return not offo and dp >= 2
    return True


def _mesh_sync_fits(opt: tuple[Any, ...], cluster: ClusterSpec, tp: int, cp: int, dp: int) -> bool:
    """Whether a periodic sync option has at least two inner groups on this mesh (the others
    always do); the constraint 'invalid gradient sync' says why where it does not."""
    gs, h, scope, _, _, tau = opt
    if gs not in ("local-sgd", "diloco"):
        return True
    from meshplan.spec.sync import inner_dp
    n_in = int(inner_dp(dp, tp, cp, scope, cluster))
    return dp % n_in == 0 and dp // n_in >= 2 and tau < h and (scope != "dc" or cluster.num_dcs >= 2)


def schedule_options(pp: int, blocks: int, space: SearchSpace) -> list[tuple[str, int]]:
    """(schedule, virtual_stages) pairs for a pipeline of ``pp`` stages."""
    if pp == 1:
        return [("1f1b", 1)]
    out: list[tuple[str, int]] = [(s, 1) for s in ("gpipe", "1f1b", "zero-bubble")
                                  if s in space.schedules]
    if "zbv" in space.schedules:
        out.append(("zbv", 2))
    if "interleaved-1f1b" in space.schedules:
        out += [("interleaved-1f1b", v) for v in range(2, space.max_virtual_stages + 1)
                if pp * v <= blocks]
    return out


def recompute_options(stage_max_layers: int, space: SearchSpace) -> list[tuple[str, int]]:
    """(recompute, recompute_layers or NONE_CODE) pairs."""
    out = [(r, NONE_CODE) for r in space.recompute]
    if "full" in space.recompute:
        ks = sorted({round(f * stage_max_layers) for f in space.recompute_fractions})
        out += [("full", k) for k in ks if 0 < k < stage_max_layers]
    return out


# ---- uneven stages -------------------------------------------------------------------------

@dataclass
class _StageSplitter:
    """Caches dynamic-programming splits; prices each block and the layers before the first
    block and after the last (the first/last extras) with the cost model's per-layer function
    (cost.layer) for the request's settings (micro-batch 1, no recompute): pipeline stages
    balanced by the layers' cost."""

    graph: LayerGraph
    cluster: ClusterSpec
    work: Workload
    base: Plan
    params: CostParams
    table: list[tuple[int, ...]] = field(default_factory=list)
    codes: dict[tuple[int, ...], int] = field(default_factory=dict)
    _costs: dict[int, tuple[np.ndarray, float, float]] = field(default_factory=dict)
    _splits: dict[tuple[int, int, int, bool], tuple[int, ...] | None] = field(default_factory=dict)

    def costs(self, tp: int) -> tuple[np.ndarray, float, float]:
        """(cost of each block with the non-block layers that follow it, layers before the
        first block, layers after the last), in units of the mean block, for this tp."""
        if tp not in self._costs:
            from meshplan.cost.batch import layout
            from meshplan.cost.layer import table
            lay = layout(self.graph)
            b = self.base
            combo = {AX.TP: tp, AX.CP: 1, "micro_batch": 1, "precision": b.precision, "recompute": "none",
                     "sequence_parallel": tp > 1 and b.sequence_parallel is not False, "compile": b.compile,
                     "flash_attention": b.flash_attention, AX.EP: b.ep, "fused_loss": b.fused_loss}
            q = table(list(lay.ops), [bool(x) for x in lay.is_block], [combo], self.work.seq_len,
                      self.cluster.gpu, self.params)[0]
            per_id = q[:, 0] + q[:, 1] + q[:, 2]  # f + bi + bw
            per_layer = per_id[lay.layer_id]
            kinds = lay.kinds
            blocks = [i for i, k in enumerate(kinds) if k == "block"]
            costs = np.zeros(len(blocks))
            for n, i in enumerate(blocks):
                end = blocks[n + 1] if n + 1 < len(blocks) else i + 1
                costs[n] = per_layer[i:end].sum()
            first = float(per_layer[:blocks[0]].sum()) if blocks else 0.0
            last = float(per_layer[blocks[-1] + 1:].sum()) if blocks else 0.0
            unit = max(float(costs.mean()) if len(costs) else 1.0, 1e-30)
            self._costs[tp] = (costs / unit, first / unit, last / unit)
        return self._costs[tp]

    def uniform(self, tp: int) -> bool:
        """The blocks cost the same (a transformer's): the even split by count is even in time."""
        costs = self.costs(tp)[0]
        return bool(np.allclose(costs, costs[0] if costs.size else 0.0, rtol=1e-9, atol=0.0))

    def code(self, tp: int, pp: int, v: int, schedule: str = "1f1b") -> int | None:
        """Stage-table code of the balanced split, None when it equals the even split or
        does not exist. Under zbv the output layer sits on rank 0 with the embedding."""
        zbv = schedule == "zbv"
        key = (tp, pp, v, zbv)
        if key not in self._splits:
            costs, first, last = self.costs(tp)
            L = len(costs)
            if self.uniform(tp):
                split = balanced_stage_layers(L, pp, v, first_extra=first, last_extra=last,
                                              schedule="zbv" if zbv else "1f1b")
            elif v == 1 and pp <= L:
                split = split_layers(costs, pp, first, last)
            else:
                split = None  # blocks of unequal cost in chunks: the even split only
            self._splits[key] = split
        split = self._splits[key]
        L = self.costs(tp)[0].size
        if split is None or (L % (pp * v) == 0 and len(set(split)) == 1):
            return None
        if split not in self.codes:
            self.codes[split] = len(self.table)
            self.table.append(split)
        return self.codes[split]


# ---- enumeration ---------------------------------------------------------------------------

def _mesh_shapes(caps: Capabilities, cluster: ClusterSpec, work: Workload,
                 space: SearchSpace) -> list[tuple[int, int, int, int, int]]:
    """(tp, cp, pp, dp, ep) with tp*cp*pp*dp = N, in a fixed order."""
    n = cluster.num_gpus
    out = []
    for tp in tp_values(cluster, space):
        for cp in cp_values(n // tp, work, space, caps.attention):
            for pp in pp_values(n // (tp * cp), caps, space):
                dp = n // (tp * cp * pp)
                for ep in ep_values(caps, space):
                    out.append((tp, cp, pp, dp, ep))
    return out


def _stage_options(caps: Capabilities, tp: int, pp: int, space: SearchSpace,
                   splitter: _StageSplitter | None) -> list[tuple[str, int, int, str, int]]:
    """(schedule, v, stage code, recompute, recompute_layers) rows for one mesh."""
    L = caps.blocks
    out = []
    for sched, v in schedule_options(pp, L, space):
        variants = [(NONE_CODE, -(-L // pp))]
        # default: the balanced split where the even one does not exist, or where the blocks'
        # costs differ (the even split by count is then not even in time)
        uneven_only = space.uneven_stages is None
        if splitter is not None and pp > 1 and not (uneven_only and L % (pp * v) == 0 and splitter.uniform(tp)):
            c = splitter.code(tp, pp, v, sched)
            if c is not None:
                variants.append((c, max(splitter.table[c])))
        for code, stage_max in variants:
            for rc, rcl in recompute_options(stage_max, space):
                out.append((sched, v, code, rc, rcl))
    return out


def sequence_parallel_allowed(space: SearchSpace, model: LayerGraph | ModelSpec | None = None) -> bool:
    """Whether the enumeration turns sequence parallelism on (where `mesh_sequence_parallel`
    says): the request does not turn it off, and, given ``model``, its layers have a replicated
    hidden state to split (spec.capabilities) and meshplan's runtime applies it (spec.support)."""
    if space.sequence_parallel is False:
        return False
    if model is None:
        return True
    graph = as_graph(model, getattr(model, "seq_len", 0) or getattr(model, "sample_tokens", 1))
    return capabilities(graph).sequence_parallel and sequence_parallel_runs(graph)


def mesh_sequence_parallel(sp_allowed: bool, tp: int, pp: int, p2p_sharded: bool) -> tuple[bool, bool]:
    """(sequence_parallel, p2p_sharded) of the enumerated plans of a tp x pp mesh, given
    `sequence_parallel_allowed` and the request's p2p_sharded: sequence parallel on exactly where
    it is allowed and tp > 1, except with a pipeline whose sends are unsharded (p2p_sharded=False,
    e.g. DeepSpeed's pipe_partitioned off): the runtime's pipeline sends carry the sequence-parallel shard
    exactly when it is on (spec.support). The sends are the request's where tp > 1 and pp > 1
    (sharded only with sequence parallel), sharded elsewhere (the same plan either way)."""
    sp = sp_allowed and tp > 1 and (pp == 1 or p2p_sharded)
    sends = p2p_sharded and (sp_allowed or tp == 1) or tp == 1 or pp == 1
    return sp, sends


def enumerate_space(model: LayerGraph | ModelSpec, cluster: ClusterSpec, work: Workload,
                    space: SearchSpace | None = None, params: CostParams = DEFAULT_PARAMS,
                    ) -> PlanColumns:
    """All candidate plans of ``space`` for this model, cluster and workload, as columns.

    meta['group'] numbers the rows that differ only in micro_batch; meta['mb_rank'] is the
    rank of the row's micro_batch (ascending) within its group.
    """
    space = space or SearchSpace()
    graph = as_graph(model, work.seq_len)
    caps = capabilities(graph)
    splitter = (_StageSplitter(graph, cluster, work, space.base, params)
                if space.uneven_stages is not False else None)
    # site orders (per mesh, as mesh_order) only where they can differ: else the base's '' (no cost)
    by_site = space.base.site_order is not None or cluster.num_dcs >= 3
    placed_f = ("mesh_order", "site_order") if by_site else ("mesh_order",)
    base = {f: getattr(space.base, f) for f in FIELDS if f not in SEARCHED and f not in PER_TP and f not in placed_f}
    parts: list[dict[str, np.ndarray]] = []
    next_group = 0
    meshes = _mesh_shapes(caps, cluster, work, space)
    if not meshes:
        raise no_mesh_error(graph, cluster, space, work)
    sp_on = sequence_parallel_allowed(space, graph)
    syncs = sync_options(cluster, space)
    searched_sync = syncs != [base_sync(space.base)]
    if searched_sync:
        for f in SYNC_FIELDS:
            base.pop(f, None)
    for tp, cp, pp, dp, ep in meshes:
        fits = [k for k, o in enumerate(syncs) if k == 0 or _mesh_sync_fits(o, cluster, tp, cp, dp)]
        zopts = [(*z, k) for z in zero_options(cluster, tp, dp, cp, space) for k in fits
                 if k == 0 or _sync_fits(syncs[k], *z, dp)]
        mbs = micro_batch_values(work, dp, space)
        sopts = _stage_options(caps, tp, pp, space, splitter)
        na, nb, nc = len(zopts), len(mbs), len(sopts)
        if na * nb * nc == 0:  # e.g. offload_only with zero=0 on dp > 1: no variant of this mesh
            continue
        ia = np.repeat(np.arange(na), nb * nc)
        ib = np.tile(np.repeat(np.arange(nb), nc), na)
        ic = np.tile(np.arange(nc), na * nb)
        z = np.asarray(zopts, dtype=np.int64)
        sc = {k: np.asarray(v) for k, v in zip(("schedule", "v", "stage", "recompute", "rcl"),
                                                zip(*sopts))}
        n = len(ia)
        sp, sends = mesh_sequence_parallel(sp_on, tp, pp, bool(space.base.p2p_sharded))
        part = {AX.TP: np.full(n, tp), AX.CP: np.full(n, cp), AX.PP: np.full(n, pp),
                AX.DP: np.full(n, dp), AX.EP: np.full(n, ep),
                "zero": z[ia, 0], "shard_group": z[ia, 1],
                "offload_optimizer": z[ia, 2].astype(bool), "offload_params": z[ia, 3].astype(bool),
                "micro_batch": np.asarray(mbs)[ib],
                "schedule": _codes("schedule", sc["schedule"])[ic], "virtual_stages": sc["v"][ic],
                "stage_layers": sc["stage"][ic],
                "recompute": _codes("recompute", sc["recompute"])[ic], "recompute_layers": sc["rcl"][ic],
                "sequence_parallel": np.full(n, sp),
                "async_tp": np.full(n, bool(space.base.async_tp) and tp > 1),
                "p2p_sharded": np.full(n, sends),
                "_group": next_group + ia * nc + ic, "_mb_rank": ib}
        if searched_sync:
            k = z[ia, 4]
            for i, f in enumerate(SYNC_FIELDS):
                vals = np.asarray([o[i] for o in syncs])
                part[f] = vals[k]
            # a scope unit holding one data-parallel rank of the mesh is sync_scope=all: write it so
            from meshplan.spec.sync import inner_dp
            single = np.asarray([o[0] in ("local-sgd", "diloco") and int(inner_dp(dp, tp, cp, o[2], cluster)) == 1
                                 for o in syncs])
            part["sync_scope"] = np.where(single[k], "all", part["sync_scope"])
        next_group += na * nc
        sizes = {AX.TP: tp, AX.CP: cp, AX.PP: pp, AX.DP: dp}
        orders = [(o, *so) for o in placement_options(cluster, space, sizes)
                  for so in (site_order_options(cluster, space, sizes, o) if by_site else [(None, True, True)])]
        if len(orders) > 1:
            gs = np.asarray(part.get("grad_sync", np.full(n, space.base.grad_sync)))
            periodic = np.isin(gs, PERIODIC_SYNC)  # a periodic plan's inner groups are its sites: default order
            wrap = (part["virtual_stages"] > 1) & (part["schedule"] != SCHEDULES.index("zbv"))
        for k, (o, so, no_wrap, with_wrap) in enumerate(orders):  # the same rows once per placement
            placed = dict(part, mesh_order=np.full(n, ":".join(o) if o else ""))  # (their own micro-batch groups)
            if by_site:
                placed["site_order"] = np.full(n, ":".join(map(str, so)) if so else "")
            keep = np.where(wrap, with_wrap, no_wrap) if not (no_wrap and with_wrap) else None
            if k:
                keep = ~periodic if keep is None else keep & ~periodic
            elif keep is not None:
                keep = keep | periodic
            if keep is not None:
                if not keep.any():
                    continue
                placed = {f: v[keep] for f, v in placed.items()}
            if k:
                placed["_group"] = placed["_group"] + next_group - part["_group"].min()
                next_group += na * nc
            parts.append(placed)
    return _assemble(parts, base, splitter.table if splitter else [])


def most_gpus(model: ModelSpec, cluster: ClusterSpec, work: Workload,
              space: SearchSpace | None = None) -> tuple[int, dict[str, int]]:
    """The most GPUs any plan can use for this model and workload (whatever the restrictions of
    ``space``; its cp rule applies), with the degrees that reach it: tp (within a node, dividing
    the heads and the MLP), cp (the enumeration's rule on the sequence), pp (one block per
    stage) and dp (one sequence per replica) at their largest. A larger cluster has no plan."""
    space = space or SearchSpace()
    g = cluster.gpus_per_node
    caps = capabilities(as_graph(model, work.seq_len))
    tps = [t for t in node_tp(g) if caps.tp_ok(t)]
    s = work.seq_len
    cps, c = [], 1
    while c <= space.max_cp and caps.attention:
        if c == 1 or (s // c >= space.min_cp_tokens and s % (2 * c) == 0):
            cps.append(c)
        c *= 2
    pp = caps.blocks if caps.pipeline is None else 1
    deg = {AX.TP: max(tps, default=1), AX.CP: max(cps, default=1), AX.PP: max(1, pp), AX.DP: work.global_batch}
    return deg[AX.TP] * deg[AX.CP] * deg[AX.PP] * deg[AX.DP], deg


def no_mesh_error(model: LayerGraph | ModelSpec, cluster: ClusterSpec, space: SearchSpace,
                  work: Workload | None = None) -> MeshplanError:
    """Why no mesh tp x cp x pp x dp of ``space`` makes the cluster's GPU count: the fixed tp
    larger than a node (or the cluster), when that is why, else the degrees tried."""
    n, g = cluster.num_gpus, cluster.gpus_per_node
    if space.tp is not None and all(t > g for t in space.tp):
        tps = "|".join(map(str, space.tp))
        if n < cluster.gpu.gpus_per_node or all(t > n for t in space.tp):  # the cluster is the limit
            return MeshplanError(f"--fix tp={tps} is more than the {n} GPU{'' if n == 1 else 's'} of the cluster",
                                 hint=f"fix tp to a divisor of {n}, or search a larger cluster")
        if all(t % g for t in space.tp):
            return MeshplanError(f"--fix tp={tps} is larger than a node ({g} GPUs) and not a whole number of "
                                 "nodes: tensor-parallel groups must tile the nodes",
                                 hint=f"fix tp to a divisor of {g} (e.g. --fix tp={g}) or a multiple of it")
    return MeshplanError(
        f"no mesh tp x cp x pp x dp makes {n} GPUs with tp in "
        f"{tp_values(cluster, space) or space.tp}, cp in {space.cp or 'powers of two'}, "
        f"pp in {space.pp or 'divisors'} (pp <= {_blocks(model, work)} layers)",
        hint="relax --fix, or use a GPU count these degrees divide")


def _blocks(model: LayerGraph | ModelSpec, work: Workload | None) -> int:
    """Blocks of the model (what pipeline stages count)."""
    seq = work.seq_len if work is not None else getattr(model, "seq_len", 1)
    return capabilities(as_graph(model, seq)).blocks


def _codes(field_name: str, values: np.ndarray) -> np.ndarray:
    table = CATEGORIES[field_name]
    return np.asarray([table.index(v) for v in values], dtype=np.int8)


def _assemble(parts: list[dict[str, np.ndarray]], base: dict[str, object],
              table: list[tuple[int, ...]]) -> PlanColumns:
    n = sum(len(p[AX.TP]) for p in parts)
    cols: dict[str, np.ndarray] = {}
    for f in FIELDS:
        if f in base:
            v = base[f]
            if f in CATEGORIES:
                v = CATEGORIES[f].index(v)
            elif f in COLON_LISTS:  # dp_shares, pools: set per mesh by search/pools.py, not here
                v = ""
            elif v is None:
                v = NONE_CODE
            cols[f] = np.full(n, v)
        else:
            cols[f] = np.concatenate([p[f] for p in parts]) if parts else np.zeros(0, dtype=np.int32)
    meta = {k: (np.concatenate([p["_" + k] for p in parts]) if parts else np.zeros(0, dtype=np.int64))
            for k in ("group", "mb_rank")}
    return PlanColumns(cols, table, meta)
