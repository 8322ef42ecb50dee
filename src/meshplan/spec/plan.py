"""Plan (how it is trained) and Workload (how much per step).

Mesh axis order, outermost to innermost: pp, dp, cp, tp (ep folds into dp x cp, as in
Megatron/torchtitan). The innermost axis gets the fastest links.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX, AXES, AXIS_DESCRIPTIONS, DEGREES, ParallelDims  # noqa: F401  (re-exported)
from meshplan.spec.base import choice, closest, coerce, positive, short_repr
from meshplan.spec.lengths import LengthDist

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
RECOMPUTE = ("none", "selective", "op", "full")
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
GRAD_SYNC = ("auto", "all-reduce", "reduce-scatter", "local-sgd", "diloco")
PERIODIC_SYNC = ("local-sgd", "diloco")
"""grad_sync methods that synchronise across sync_scope only every sync_every steps."""
SYNC_SCOPES = ("all", "dc", "node")
GRAD_COMPRESSION = ("none", "bf16", "fp8", "powersgd")
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion", "adam8bit")
"""The optimizer a workload trains with (Workload.optimizer): its state bytes, step time and
sharding are cost.memory's (OPTIMIZER_STATE_BYTES, docs/cost-model.md "Memory")."""
RUNTIME_OPTIMIZERS = ("adamw", "sgd", "adafactor")
"""The optimizers `meshplan train` runs (torch's own: AdamW, SGD with momentum, Adafactor)."""
SCHEDULE_ALIASES = {
    "none": "1f1b", "interleaved": "interleaved-1f1b", "interleaved_1f1b": "interleaved-1f1b",
    "zb": "zero-bubble", "zb-h1": "zero-bubble", "zero_bubble": "zero-bubble", "zbh1": "zero-bubble",
    "interleaved1f1b": "interleaved-1f1b",
}


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """The parallel degrees (spec.axes): GPUs = tp x pp x dp x cp; ep folds into dp x cp."""

    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split of attention and MLP)."""
    pp: int = 1
    """Pipeline-parallel stages."""
    dp: int = 1
    """Data-parallel degree (replicas or ZeRO/FSDP shards)."""
    cp: int = 1
    """Context-parallel degree (sequence split, ring attention)."""
    ep: int = 1
    """Expert-parallel degree (MoE); must divide dp*cp and the number of experts."""

    def __post_init__(self) -> None:
        for f in DEGREES:
            positive(f"plan: {f}", getattr(self, f))


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """ZeRO/FSDP sharding of the model states and their offload to host memory."""

    zero: int = 0
    """0 = DDP, 1 = optimizer states sharded, 2 = + gradients, 3 = + parameters (FSDP)."""
    shard_group: int = 0
    """Hybrid sharding: ZeRO/FSDP shards within groups of this many dp ranks and replicates
    across groups (HSDP). 0 = shard over all of dp."""
    offload_optimizer: bool = False
    """Keep optimizer states (and the step) in host memory."""
    offload_params: bool = False
    """Keep parameters in host memory between uses (ZeRO-Infinity / FSDP CPU offload)."""

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise MeshplanError(f"plan: zero must be 0, 1, 2 or 3; got {self.zero}")
        positive("plan: shard_group", self.shard_group, allow_zero=True)


@dataclass(frozen=True, kw_only=True)
class Batching:
    """How a replica's share of the global batch forms micro-batches."""

    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    buckets: tuple[str, ...] | None = None
    """A data-aware plan for samples of several lengths (spec/buckets.py): per length bucket,
    ``MAX_LENxMICRO_BATCHcpCP`` (``buckets=4096x4cp1:32768x1cp4``): the step's samples up to each
    limit in micro-batches of that many samples, each on that many context-parallel ranks (the
    largest is the plan's cp). ``micro_batch`` is then the longest bucket's. None: one
    micro-batch size and cp for every sample."""

    def __post_init__(self) -> None:
        positive("plan: micro_batch", self.micro_batch)
        if self.buckets is None:
            return
        from meshplan.spec.buckets import normalise, parse_buckets
        object.__setattr__(self, "buckets", normalise(self.buckets))  # canonical text: 4096x4cp1
        bs = parse_buckets(self.buckets)
        if not bs:
            raise MeshplanError("plan: buckets is empty", hint="give at least one bucket, e.g. buckets=4096x4cp1, "
                                                               "or leave buckets out")
        if self.micro_batch != bs[-1].micro_batch:
            raise MeshplanError(f"plan: micro_batch={self.micro_batch} but the longest bucket's is "
                                f"{bs[-1].micro_batch} (buckets={':'.join(self.buckets)})",
                                hint=f"set micro_batch={bs[-1].micro_batch}, or leave micro_batch out of the plan "
                                     "string (it is then the longest bucket's)")


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """The pipeline schedule and how the layers split into stages."""

    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedules)."""
    schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved-1f1b, zero-bubble (ZB-H1) or zbv."""
    p2p_sharded: bool = True
    """Pipeline sends carry 1/tp of the activation (Megatron's scatter-gather, or sequence
    parallel; DeepSpeed's pipeline engine by default: pipe_partitioned, all-gathered on arrival);
    False: every TP rank sends the whole tensor (DeepSpeed with pipe_partitioned off)."""
    stage_layers: tuple[int, ...] | None = None
    """Optional explicit transformer blocks per pipeline stage (length pp, sums to num_layers)."""

    def __post_init__(self) -> None:
        positive("plan: virtual_stages", self.virtual_stages)
        choice("plan: schedule", self.schedule, SCHEDULES)
        if self.stage_layers is not None and any(n < 0 for n in self.stage_layers):
            raise MeshplanError("plan: stage_layers entries must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """What each GPU computes, and how: recomputation, precision, fused kernels, overlap."""

    recompute: str = "none"
    """Activation recomputation: none; selective (Megatron: the attention core only); op
    (torchtitan op-level SAC: every other matmul and all elementwise ops); full (whole block)."""
    recompute_layers: int | None = None
    """With recompute=full: how many blocks per pipeline stage are recomputed (None = all)."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence over the TP group."""
    precision: str = "bf16"
    """Compute precision of matmuls: bf16, fp16, fp8 (fp8 linears, bf16 elsewhere) or fp32."""
    compile: bool = False
    """torch.compile (or equivalent fused kernels): memory-bound elementwise ops are fused."""
    flash_attention: bool = True
    """FlashAttention-style fused attention (no s x s matrix stored; causal blocks skipped).
    False models the unfused softmax path of Megatron before 2022."""
    fused_loss: bool = False
    """Cross-entropy fused with the logits (in-place softmax/grad, no fp32 copy of the logits:
    ~4 B per logit alive instead of ~10 B), as llm-foundry's fused_crossentropy or Liger."""
    async_tp: bool = False
    """Overlap TP communication with the matmuls (torchtitan AsyncTP / Megatron tp-comm-overlap)."""

    def __post_init__(self) -> None:
        choice("plan: recompute", self.recompute, RECOMPUTE)
        choice("plan: precision", self.precision, PRECISIONS)
        if self.recompute_layers is not None:
            positive("plan: recompute_layers", self.recompute_layers, allow_zero=True)
            if self.recompute != "full":
                raise MeshplanError("plan: recompute_layers needs recompute=full")


@dataclass(frozen=True, kw_only=True)
class GradSync:
    """How the data-parallel ranks synchronise: the collective, its period and its compression."""

    grad_sync: str = "auto"
    """Data-parallel gradient collective: auto (all-reduce for zero=0, reduce-scatter for
    zero>=1), all-reduce (DeepSpeed's bf16 optimizer all-reduces fp32 gradients even with
    sharded optimizer states), or reduce-scatter; or a periodic method: local-sgd (inner
    groups train on their own and the models are averaged every sync_every steps) or diloco
    (inner AdamW steps, then an outer Nesterov step on the averaged parameter deltas every
    sync_every steps; Douillard et al. 2023)."""
    sync_every: int = 1
    """With grad_sync=local-sgd or diloco: inner steps between outer synchronisations (H)."""
    sync_scope: str = "all"
    """With grad_sync=local-sgd or diloco: the tier the slow (outer) synchronisation crosses.
    dc: the data-parallel ranks of one datacenter form an inner group that syncs every step,
    and the groups sync every sync_every steps; node: the same per node; all: every
    data-parallel rank is its own inner group (classic local SGD / DiLoCo workers)."""
    sync_overlap: int = 0
    """With grad_sync=local-sgd or diloco: inner steps the outer synchronisation runs under
    before its result is applied (0: the inner steps wait for it; 1: it runs under the next
    inner step and is applied one step late, as streaming DiLoCo overlaps it)."""
    grad_compression: str = "none"
    """Compression of the slowest data-parallel synchronisation (the per-step gradient sync,
    or the outer sync of local-sgd/diloco): none, bf16 or fp8 (values sent in 16 or 8 bits),
    or powersgd (rank-compression_rank factors with error feedback; Vogels et al. 2019)."""
    compression_rank: int = 1
    """With grad_compression=powersgd: the rank of the low-rank approximation."""

    def __post_init__(self) -> None:
        choice("plan: grad_sync", self.grad_sync, GRAD_SYNC)
        choice("plan: sync_scope", self.sync_scope, SYNC_SCOPES)
        choice("plan: grad_compression", self.grad_compression, GRAD_COMPRESSION)
        for f, example in (("sync_every", "sync_every=500 (DiLoCo's period)"),
                           ("compression_rank", "compression_rank=4")):
            if not getattr(self, f) > 0:
                raise MeshplanError(f"plan: {f} must be >= 1; got {getattr(self, f)!r}", hint=f"e.g. {example}")
        positive("plan: sync_overlap", self.sync_overlap, allow_zero=True)
        if self.grad_sync not in PERIODIC_SYNC:
            if self.sync_every != 1:
                raise MeshplanError(f"plan: sync_every={self.sync_every} needs grad_sync=local-sgd or diloco "
                                    f"(grad_sync={self.grad_sync} syncs every step)",
                                    hint="add grad_sync=diloco (or local-sgd), or drop sync_every")
            if self.sync_overlap:
                raise MeshplanError("plan: sync_overlap needs grad_sync=local-sgd or diloco",
                                    hint="add grad_sync=diloco (or local-sgd), or drop sync_overlap")
            if self.sync_scope != "all":
                raise MeshplanError(f"plan: sync_scope={self.sync_scope} needs grad_sync=local-sgd or diloco",
                                    hint="add grad_sync=diloco (or local-sgd), or drop sync_scope")
        if self.compression_rank != 1 and self.grad_compression != "powersgd":
            raise MeshplanError("plan: compression_rank needs grad_compression=powersgd",
                                hint="add grad_compression=powersgd, or drop compression_rank")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the replicas and stages run on a cluster of several GPU pools, and uneven shares."""

    dp_shares: tuple[int, ...] | None = None
    """Uneven data parallelism: relative shares of the global batch per data-parallel replica
    (``dp_shares=3:1``). With pool_dp and one entry per pool, entry i is the share of each of
    pool i's replicas; otherwise its length divides dp: entry i applies to the i-th block of
    dp/len consecutive replicas. Replica r trains on share_r / sum(shares) of the global batch (as whole
    micro-batches) and its gradients are weighted by its share, so that the step equals training
    on the whole global batch. None: even shares."""
    pools: tuple[str, ...] | None = None
    """On a cluster of several GPU pools: the pools the plan uses, in order (a pool not named
    is left out). None on a cluster of one GPU type. With neither pool_dp nor pool_pp, the plan
    is in device order: its ranks are laid (in the placement's order) over the named pools' GPUs
    in turn, so a stage or a data-parallel group may span GPU types (cost.pools.device_order)."""
    pool_dp: tuple[int, ...] | None = None
    """With several pools: data-parallel replicas per pool (sums to dp). Every replica lives in
    one pool, with the plan's tp, pp and cp; the pools' replicas sync gradients across pools."""
    pool_pp: tuple[int, ...] | None = None
    """With several pools: pipeline stages per pool (sums to pp), the first pool's stages first.
    Every pool holds dp x cp x tp GPUs per stage; the sends between the pools' boundary stages
    cross the link between pools."""
    mesh_order: tuple[str, ...] | None = None
    """The placement: the mesh axes outermost to innermost as they are laid onto the devices
    (nodes, then sites), ``mesh_order=dp:pp:cp:tp``. The innermost axis gets consecutive ranks
    (the fastest links); the outermost crosses the slowest tier. None: the default pp:dp:cp:tp
    (spec.axes.DEFAULT_ORDER). ``placement=`` is an alias in plan strings."""
    site_order: tuple[int, ...] | None = None
    """On a cluster of several sites: the sites in the order the pipeline visits them,
    ``site_order=1:0:2`` (0-based site numbers, a permutation of all the cluster's sites): the
    first stages run on site 1, then site 0, then site 2. The ranks, numbered by mesh_order, are
    cut into one equal block per site and block k runs on site site_order[k]; the pipeline must
    be the only axis across the sites (every stage in one site; spec.axes.site_order_fault). None:
    the sites in their own order (0, 1, ...). ``sites=`` is an alias in plan strings."""

    def __post_init__(self) -> None:
        from meshplan.spec.axes import parse_order, parse_sites
        object.__setattr__(self, "mesh_order", parse_order(self.mesh_order))
        object.__setattr__(self, "site_order", parse_sites(self.site_order))
        if self.dp_shares is not None:  # (no entries: Plan says so, with dp)
            if any(not isinstance(x, int) or x < 1 for x in self.dp_shares):
                raise MeshplanError(f"plan: dp_shares entries must be whole numbers >= 1; got "
                                    f"{':'.join(str(x) for x in self.dp_shares)}", hint="e.g. dp_shares=3:1")
        if self.pools is None:
            for f in ("pool_dp", "pool_pp"):
                if getattr(self, f) is not None:
                    raise MeshplanError(f"plan: {f} needs pools (the pools it counts, in order)",
                                        hint=f"e.g. pools=h100:a100,{f}=2:2")
            return
        if not self.pools or any(not str(n).strip() for n in self.pools):
            raise MeshplanError("plan: pools must name at least one pool", hint="e.g. pools=h100:a100")
        if len(set(self.pools)) != len(self.pools):
            raise MeshplanError(f"plan: pools names a pool twice: {':'.join(self.pools)}")
        for f in ("pool_dp", "pool_pp"):
            v = getattr(self, f)
            if v is None:
                continue
            if len(v) != len(self.pools):
                raise MeshplanError(f"plan: {f} has {len(v)} entries but pools names {len(self.pools)}",
                                    hint=f"one count per pool, e.g. {f}={':'.join(['1'] * len(self.pools))}")
            if any(not isinstance(x, int) or x < 1 for x in v):
                raise MeshplanError(f"plan: {f} entries must be whole numbers >= 1 (leave a pool out of pools "
                                    "instead of giving it 0)")
        if self.pool_dp is not None and self.pool_pp is not None:
            raise MeshplanError("plan: give pool_dp (replicas per pool) or pool_pp (stages per pool), not both")
        # several pools with neither pool_dp nor pool_pp: device order (cost.pools.device_order), the ranks laid
        # over the pools' GPUs in turn, so that a stage or a data-parallel group may span GPU types

    @property
    def multi_pool(self) -> bool:
        """More than one GPU pool."""
        return self.pools is not None and len(self.pools) > 1


PLAN_PARTS: dict[str, type] = {
    "degrees": Degrees, "sharding": Sharding, "batching": Batching, "pipeline": Pipeline,
    "kernels": Kernels, "sync": GradSync, "placement": Placement}
"""Plan's sub-records: the attribute that holds each, and its type (the order they validate in)."""

PLAN_FIELDS: tuple[str, ...] = (
    *DEGREES, "zero", "shard_group", "micro_batch", "virtual_stages", "schedule", "recompute",
    "recompute_layers", "sequence_parallel", "offload_optimizer", "offload_params", "precision", "compile",
    "flash_attention", "fused_loss", "grad_sync", "sync_every", "sync_scope", "sync_overlap",
    "grad_compression", "compression_rank", "p2p_sharded", "async_tp", "stage_layers", "dp_shares", "pools",
    "pool_dp", "pool_pp", "buckets", "mesh_order", "site_order")
"""Every flat plan key (the keys of plan strings, plan JSON and plan files), in their written order."""

FIELD_PART: dict[str, str] = {f.name: part for part, cls in PLAN_PARTS.items() for f in dataclasses.fields(cls)}
"""Flat plan key -> the sub-record that holds it."""
assert sorted(FIELD_PART) == sorted(PLAN_FIELDS), "every flat plan key lives in exactly one sub-record"


@dataclass(frozen=True, init=False, repr=False)
class Plan:
    """A parallel execution plan. Degrees multiply to the number of GPUs: tp*pp*dp*cp.

    Its fields are a few sub-records (``plan.degrees``, ``plan.sharding``, ...), each validating its
    own fields; the rules that span records are here. Every sub-record field reads flat as well
    (``plan.tp``), ``Plan(tp=4, zero=3)`` builds one from flat keys, ``plan.replace(tp=8)`` changes
    them, and ``flat_dict()`` is the flat table of plan strings, JSON and plan files (PLAN_FIELDS)."""

    degrees: Degrees = field(default_factory=Degrees)
    sharding: Sharding = field(default_factory=Sharding)
    batching: Batching = field(default_factory=Batching)
    pipeline: Pipeline = field(default_factory=Pipeline)
    kernels: Kernels = field(default_factory=Kernels)
    sync: GradSync = field(default_factory=GradSync)
    placement: Placement = field(default_factory=Placement)

    def __init__(self, **kwargs: Any) -> None:
        """``Plan(tp=4, zero=3, ...)`` with flat keys, or with sub-records (``degrees=Degrees(...)``);
        flat keys given beside a sub-record change that record's fields (dataclasses.replace)."""
        changes: dict[str, dict[str, Any]] = {}
        for key, value in kwargs.items():
            if key in PLAN_PARTS:
                continue
            part = FIELD_PART.get(key)
            if part is None:
                raise TypeError(f"Plan.__init__() got an unexpected keyword argument {key!r}")
            changes.setdefault(part, {})[key] = value
        for part, cls in PLAN_PARTS.items():
            rec = kwargs.get(part)
            if rec is None:
                rec = cls(**changes[part]) if part in changes else _DEFAULT_PARTS[part]
            elif not isinstance(rec, cls):
                raise TypeError(f"Plan: {part} must be a {cls.__name__}, got {type(rec).__name__}")
            elif part in changes:
                rec = dataclasses.replace(rec, **changes[part])
            object.__setattr__(self, part, rec)
        self._check()

    def _check(self) -> None:
        """The rules that span sub-records."""
        if self.mesh_order is not None and (self.pool_dp is not None or self.pool_pp is not None):
            which = "pool_dp" if self.pool_dp is not None else "pool_pp"
            raise MeshplanError(f"plan: mesh_order with {which}: a plan over pools by {which} places its "
                                f"{'replicas' if which == 'pool_dp' else 'stages'} on the pools itself, in the "
                                "default order inside each",
                                hint=f"drop mesh_order, or drop {which} (pools=A:B alone lays the ranks over the "
                                     "pools in the placement's order: device order)")
        if self.site_order is not None:
            if self.pools is not None:
                raise MeshplanError("plan: site_order with pools: a cluster of several GPU pools has no sites to "
                                    "order (pools are placed by pools, pool_dp or pool_pp)",
                                    hint="drop site_order, or drop pools")
        if self.stage_layers is not None and len(self.stage_layers) != self.pp:
            raise MeshplanError(f"plan: stage_layers has {len(self.stage_layers)} entries but pp={self.pp}")
        self._check_shares_and_pools()
        if self.buckets is not None:
            from meshplan.spec.buckets import check_buckets
            check_buckets(self.bucket_specs, self.cp, self.pp, self.ep)
            if self.dp_shares is not None:  # (several pools: each pool's replicas run the bucket plan, pool_dp)
                raise MeshplanError("plan: buckets with dp_shares: a bucket plan deals each step's samples to its "
                                    "ranks by length (spec.buckets.bucket_layout), so its replicas take no fixed "
                                    "shares of the batch",
                                    hint="drop dp_shares (on pools, pool_dp places the replicas), or drop buckets")

    def _check_shares_and_pools(self) -> None:
        per_pool = self.pool_dp is not None and self.dp_shares is not None and len(self.dp_shares) == len(self.pool_dp)
        if self.dp_shares is not None and (not self.dp_shares or (self.dp % len(self.dp_shares) and not per_pool)):
            raise MeshplanError(f"plan: dp_shares has {len(self.dp_shares)} entries, which does not divide "
                                f"dp={self.dp}",
                                hint="give one share per replica, or per equal block of replicas "
                                     "(dp=8,dp_shares=3:1 gives replicas 0-3 share 3 and 4-7 share 1)")
        if self.pools is None:
            return
        for f, total in (("pool_dp", self.dp), ("pool_pp", self.pp)):
            v = getattr(self, f)
            if v is not None and sum(v) != total:
                raise MeshplanError(f"plan: {f} sums to {sum(v)} but {f[5:]}={total}",
                                    hint=f"the counts per pool add up to {f[5:]}")
        if self.pool_dp is not None and self.shard_group and self.zero and \
                any((n * self.cp) % self.shard_group for n in self.pool_dp):
            raise MeshplanError(f"plan: shard_group={self.shard_group} does not divide every pool's replicas x cp "
                                f"({', '.join(str(n * self.cp) for n in self.pool_dp)}): a shard group must lie in "
                                "one pool", hint=f"e.g. shard_group={math.gcd(*self.pool_dp) * self.cp}")

    def __repr__(self) -> str:
        return f"Plan({', '.join(f'{k}={v!r}' for k, v in self.flat_dict().items())})"

    def flat_dict(self) -> dict[str, Any]:
        """The flat table of the plan: every key of PLAN_FIELDS and its value, in that order (what
        plan JSON and plan files hold; spec.base.to_dict writes a Plan as this)."""
        return {k: getattr(getattr(self, FIELD_PART[k]), k) for k in PLAN_FIELDS}

    @classmethod
    def flat_hints(cls) -> dict[str, Any]:
        """Flat plan key -> its annotated type (PLAN_FIELDS order)."""
        return _FLAT_HINTS

    @property
    def bucket_specs(self) -> tuple:
        """The buckets as spec.buckets.Bucket records (() without buckets)."""
        if self.buckets is None:
            return ()
        from meshplan.spec.buckets import parse_buckets
        return parse_buckets(self.buckets)

    @property
    def replica_shares(self) -> tuple[int, ...]:
        """dp_shares expanded to one share per data-parallel replica (all 1 without dp_shares)."""
        if self.dp_shares is None:
            return (1,) * self.dp
        if self.pool_dp is not None and len(self.dp_shares) == len(self.pool_dp):  # one share per pool
            return tuple(s for s, n in zip(self.dp_shares, self.pool_dp) for _ in range(n))
        block = self.dp // len(self.dp_shares)
        return tuple(s for s in self.dp_shares for _ in range(block))

    @property
    def multi_pool(self) -> bool:
        """The plan spans more than one GPU pool."""
        return self.placement.multi_pool

    @property
    def dims(self) -> ParallelDims:
        """The parallel degrees as the axis object (mesh shapes)."""
        return ParallelDims.of(self)

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def periodic(self) -> bool:
        """Local SGD or DiLoCo: the data-parallel ranks do not sync every step."""
        return self.grad_sync in PERIODIC_SYNC

    @property
    def effective_shard(self) -> int:
        """Ranks that ZeRO/FSDP state is sharded over (dp*cp, or the hybrid group)."""
        if self.zero == 0:
            return 1
        full = self.dp * self.cp
        return self.shard_group if 0 < self.shard_group < full else full

    def replace(self, **changes: object) -> Plan:
        """A copy with flat keys (``tp=8``) or sub-records changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def short(self) -> str:
        """Compact one-line form, accepted back by parse_plan."""
        d = self.flat_dict()
        default = _DEFAULT_FLAT
        keys = [*DEGREES, "zero", "micro_batch"]
        parts = [f"{k}={d[k]}" for k in keys if k in (AX.TP, AX.PP, AX.DP, "micro_batch") or d[k] != default[k]]
        for k, v in d.items():
            if k in keys or v == default[k]:
                continue
            if isinstance(v, bool):
                v = int(v)
            if k == "stage_layers":
                v = format_stage_layers(v)
            elif isinstance(v, (list, tuple)):
                v = ":".join(str(x) for x in v)
            parts.append(f"{k}={v}")
        return ",".join(parts)


def _flat_property(part: str, name: str) -> property:
    """``plan.<name>``: read-only ``plan.<part>.<name>`` (operator.attrgetter: as fast as a field)."""
    return property(operator.attrgetter(f"{part}.{name}"), doc=f"``plan.{part}.{name}``")


for _name, _part in FIELD_PART.items():
    setattr(Plan, _name, _flat_property(_part, _name))
_DEFAULT_PARTS: dict[str, Any] = {part: cls() for part, cls in PLAN_PARTS.items()}
_FLAT_HINTS: dict[str, Any] = {k: v for part, cls in PLAN_PARTS.items() for k, v in typing.get_type_hints(cls).items()}
_FLAT_HINTS = {k: _FLAT_HINTS[k] for k in PLAN_FIELDS}
_DEFAULT_FLAT = Plan().flat_dict()


def format_stage_layers(layers: tuple[int, ...] | list[int]) -> str:
    """Stage sizes as written in plan strings: ``15:17``, with a run of three or more equal
    sizes as ``SIZExCOUNT`` where that is shorter (``4x31:2`` is 31 stages of 4 layers and one of 2).
    `parse_stage_layers` reads it back."""
    out: list[str] = []
    i, n = 0, len(layers)
    while i < n:
        j = i
        while j < n and layers[j] == layers[i]:
            j += 1
        v, count = str(layers[i]), j - i
        expanded = ":".join([v] * count)
        compact = f"{v}x{count}"
        out.append(compact if count >= 3 and len(compact) < len(expanded) else expanded)
        i = j
    return ":".join(out)


def parse_stage_layers(text: str, where: str = "plan: stage_layers") -> tuple[int, ...]:
    """``7:9:9:7`` (``;`` also separates) or the run-length form ``4x31:2`` (SIZExCOUNT: COUNT
    stages of SIZE layers) as a tuple of layer counts."""
    out: list[int] = []
    for part in str(text).replace(";", ":").split(":"):
        part = part.strip()
        size, sep, count = part.lower().partition("x")
        if not (sep and size.strip().lstrip("-").isdigit() and count.strip().lstrip("-").isdigit()):
            size, sep = part, ""  # not SIZExCOUNT: one entry (an error names it as written)
        n = coerce(count.strip(), int, where) if sep else 1
        if sep and n < 1:
            raise MeshplanError(f"{where}: {part!r} repeats a stage size {n} times; the count after 'x' "
                                "must be at least 1",
                                hint="e.g. stage_layers=4x31:2 is 31 stages of 4 layers, then one of 2")
        if n > MAX_STAGES:
            raise MeshplanError(f"{where}: {part!r} makes more than {MAX_STAGES:,} stages")
        out += [coerce(size.strip(), int, where)] * n
        if len(out) > MAX_STAGES:
            raise MeshplanError(f"{where}: more than {MAX_STAGES:,} stages")
    return tuple(out)


COLON_LISTS = ("dp_shares", "pools", "pool_dp", "pool_pp", "buckets", "mesh_order", "site_order")
"""Plan fields written as colon-separated lists in plan strings (dp_shares=3:1, pools=h100:a100)."""


def parse_colon_list(text: str, key: str) -> tuple:
    """``3:1`` -> (3, 1) for the count fields, ``h100:a100`` -> ('h100', 'a100') for pools."""
    parts = [t.strip() for t in str(text).replace(";", ":").split(":")]
    if key in ("pools", "buckets", "mesh_order", "site_order"):  # (checked by the field)
        return tuple(parts)
    out = []
    for t in parts:
        if not t.lstrip("-").isdigit():
            raise MeshplanError(f"plan: {key}={text!r}: {t!r} is not a whole number",
                                hint=f"e.g. {key}=3:1")
        out.append(int(t))
    return tuple(out)


MAX_STAGES = 1_000_000
"""Most pipeline stages a stage_layers string may spell out (a run-length count is expanded)."""


PLAN_KEY_ALIASES = {
    "mbs": "micro_batch", "micro_batch_size": "micro_batch", "vpp": "virtual_stages",
    "sp": "sequence_parallel", "ac": "recompute", "activation_checkpointing": "recompute",
    "hsdp": "shard_group", "fsdp": "zero", "h": "sync_every", "compression": "grad_compression",
    "powersgd_rank": "compression_rank", "placement": "mesh_order", "order": "mesh_order",
    "sites": "site_order",
}


def parse_plan(text: str) -> Plan:
    """Parse 'tp=8,pp=8,dp=16,micro_batch=1,schedule=interleaved-1f1b,...' into a Plan."""
    if not isinstance(text, str) or not text.strip():
        raise MeshplanError("empty plan string", hint="e.g. --plan tp=8,pp=4,dp=16,micro_batch=1")
    fields = dict.fromkeys(PLAN_FIELDS)
    hints = Plan.flat_hints()
    kwargs: dict[str, object] = {}
    parts = text.split(",")
    if len(parts) > 1 and not parts[-1].strip():
        parts = parts[:-1]  # one comma at the end, as a list pasted from a script may have
    for part in parts:
        part = part.strip()
        if not part:
            raise MeshplanError(f"plan: an empty item in {text.strip()!r} (two commas in a row, or a comma at the "
                                "start)", hint="write key=value items separated by single commas, e.g. dp=8,zero=3")
        if "=" not in part:
            raise MeshplanError(f"plan: {part!r} is not key=value",
                                hint="e.g. --plan tp=8,pp=4,dp=16,micro_batch=1")
        key, value = (s.strip() for s in part.split("=", 1))
        raw_key = key.lower()
        key = PLAN_KEY_ALIASES.get(raw_key, raw_key)
        if raw_key == "fsdp":  # fsdp=1/true means ZeRO-3; fsdp=0/false means no sharding
            value = "3" if value.strip().lower() in ("1", "true", "yes", "on", "fsdp") else "0"
        if key not in fields:
            raise MeshplanError(f"plan: unknown key {key!r}{closest(key, fields)}",
                                hint="known keys: " + ", ".join(fields))
        if key in kwargs:
            raise MeshplanError(f"plan: {key!r} given twice")
        if key == "schedule":
            value = SCHEDULE_ALIASES.get(value.lower(), value.lower())
        if key == "zero" and value.lower() in ("fsdp", "true", "yes"):
            value = "3"
        if key == "stage_layers":
            kwargs[key] = parse_stage_layers(value, "plan.stage_layers")
            continue
        if key in COLON_LISTS:
            if not value.strip():
                raise MeshplanError(f"plan: {key} has no value",
                                    hint="e.g. mesh_order=dp:pp:cp:tp" if key == "mesh_order"
                                    else "e.g. site_order=1:0:2" if key == "site_order"
                                    else f"e.g. {key}=3:1, or leave {key} out")
            kwargs[key] = parse_colon_list(value, key)
            continue
        kwargs[key] = coerce(value, hints[key], f"plan: {key}")
    if kwargs.get("buckets") and "micro_batch" not in kwargs:  # the longest bucket's
        from meshplan.spec.buckets import parse_bucket
        kwargs["micro_batch"] = parse_bucket(kwargs["buckets"][-1]).micro_batch  # type: ignore[index]
    return Plan(**kwargs)  # type: ignore[arg-type]


def share_split(shares: Sequence[int], global_batch: int) -> tuple[tuple[int, int], ...]:
    """The uneven data-parallel split, the one definition (spec.constraints, cost, the simulator and
    the runtime use it): replica r of share s_r trains on global_batch x s_r / sum(shares) samples.
    (samples, remainder) per replica; a replica's share is usable when the remainder is 0 and the
    samples are a whole, non-zero number of micro-batches (``split_fault``)."""
    total = sum(shares)
    return tuple(divmod(global_batch * s, total) for s in shares)


def split_fault(samples: int, remainder: int, micro_batch: int) -> str | None:
    """Why one replica's part of ``share_split`` is not usable (None: it is)."""
    if remainder:
        return "not a whole number of samples"
    if samples == 0:
        return "no sample at all"
    if samples % micro_batch:
        return f"not a whole number of micro-batches of micro_batch={micro_batch}"
    return None


def share_unit(shares: Sequence[int], micro_batch: int) -> int:
    """The smallest global batch every replica's share of which is a whole number of micro-batches
    (the usable global batches are its multiples): S x micro_batch / gcd(S x micro_batch, shares),
    S = sum(shares)."""
    total = sum(shares) * micro_batch
    return total // math.gcd(total, math.gcd(*shares))


def microbatches(global_batch, dp, micro_batch):  # type: ignore[no-untyped-def]
    """Micro-batches per optimizer step on each data-parallel replica (the gradient accumulation
    steps, or the pipeline's micro-batches): global_batch // (dp x micro_batch). Ints or numpy
    arrays (one row per plan); the one definition every module uses."""
    return global_batch // (dp * micro_batch)


def checked_microbatches(plan: Plan, global_batch: int) -> int:
    """microbatches() of a run, refusing a global batch that dp x micro_batch does not divide."""
    if global_batch % (plan.dp * plan.micro_batch):
        raise MeshplanError(f"--global-batch {global_batch} is not divisible by dp x micro_batch = "
                            f"{plan.dp} x {plan.micro_batch}", hint="change the batch or the plan")
    return microbatches(global_batch, plan.dp, plan.micro_batch)


MAX_COUNT = 2**31 - 1
"""Largest global batch and sequence length: the cost model and the search hold them (and
products with plan degrees) in fixed-width numpy integers."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """How much is trained per optimizer step."""

    global_batch: int
    """Sequences per optimizer step (all data-parallel replicas together)."""
    seq_len: int
    """Tokens per sequence (with ``lengths``: the longest, what a plan must hold)."""
    lengths: LengthDist | None = None
    """A distribution of sample lengths and how samples form micro-batches (spec.lengths);
    None: every sample is seq_len tokens."""
    optimizer: str = "adamw"
    """The optimizer (OPTIMIZERS): adamw / adam (two fp32 moments), sgd (momentum), adafactor
    (factored second moment, no first moment), lion (one momentum), adam8bit (bitsandbytes 8-bit
    moments). It sets the optimizer-state bytes and the optimizer step's time (cost.memory)."""

    def __post_init__(self) -> None:
        choice("workload: optimizer", self.optimizer, OPTIMIZERS)
        for name in ("global_batch", "seq_len"):
            value = getattr(self, name)
            positive(f"workload: {name}", value)
            if value > MAX_COUNT:
                raise MeshplanError(f"workload: {name} must be at most {MAX_COUNT:,}; got {short_repr(value)}")
        if self.lengths is not None and self.lengths.max_len != self.seq_len:
            raise MeshplanError(f"workload: seq_len={self.seq_len} must be the longest length of the "
                                f"distribution ({self.lengths.max_len})")

    @classmethod
    def of(cls, global_batch: int, lengths: LengthDist, optimizer: str = "adamw") -> Workload:
        """A workload over a length distribution (seq_len = its longest length)."""
        return cls(global_batch=global_batch, seq_len=lengths.max_len, lengths=lengths, optimizer=optimizer)

    def shaped(self, global_batch: int, seq_len: int, lengths: LengthDist | None = None) -> Workload:
        """The same training (its optimizer) on another batch shape: a part of this workload (one
        length of a distribution, a bucket, a pool's share) as the cost model and simulator price it."""
        return Workload(global_batch=global_batch, seq_len=seq_len, lengths=lengths, optimizer=self.optimizer)

    @property
    def varied(self) -> bool:
        """Samples of several lengths that are not packed into full windows."""
        return self.lengths is not None and len(self.lengths.lengths) > 1 and self.lengths.packing != "packed"

    @property
    def tokens(self) -> int:
        """Real (not padding) tokens per step: the expected number under a length distribution
        that is not packed."""
        if self.lengths is not None and self.lengths.packing != "packed":
            return round(self.global_batch * self.lengths.mean_len)
        return self.global_batch * self.seq_len
