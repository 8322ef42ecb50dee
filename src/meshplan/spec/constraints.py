"""Named feasibility predicates. Each returns None (ok) or a one-line reason with a fix.

The same predicates serve `estimate` (to refuse a plan that cannot work) and the search
(to count rejections by name). Memory fit is not here: that is the cost model's job.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshplan.spec.capabilities import Capabilities, capabilities
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload, microbatches, share_split
from meshplan.spec.transformer import as_graph


@dataclass(frozen=True)
class Context:
    model: LayerGraph | ModelSpec
    cluster: ClusterSpec
    plan: Plan
    work: Workload

    @property
    def caps(self) -> Capabilities:
        """What the model's layers allow (spec.capabilities)."""
        return capabilities(as_graph(self.model, self.work.seq_len))


Check = Callable[[Context], "str | None"]


def gpus_match(c: Context) -> str | None:
    p = c.plan
    if p.num_gpus != c.cluster.num_gpus:
        return (f"tp*pp*dp*cp = {p.tp}*{p.pp}*{p.dp}*{p.cp} = {p.num_gpus} but the cluster has "
                f"{c.cluster.num_gpus} GPUs; change dp to {c.cluster.num_gpus // max(1, p.tp * p.pp * p.cp)}"
                if c.cluster.num_gpus % (p.tp * p.pp * p.cp) == 0 else
                f"tp*pp*dp*cp = {p.num_gpus} does not equal the cluster's {c.cluster.num_gpus} GPUs")
    return None


def tp_divides_heads(c: Context) -> str | None:
    return c.caps.heads_reason(c.plan.tp)


def tp_divides_widths(c: Context) -> str | None:
    return c.caps.width_reason(c.plan.tp)


def tp_has_layers(c: Context) -> str | None:
    if c.plan.tp > 1 and not c.caps.tp_layers:
        return (f"tp={c.plan.tp} but no layer of the model has linear layers tensor parallelism can split "
                "(column -> row pairs of linear layers, or of convolutions with only BatchNorm/activations "
                "between them); use tp=1")
    return None


def cp_has_attention(c: Context) -> str | None:
    if c.plan.cp > 1 and not c.caps.attention:
        return f"cp={c.plan.cp} but the model has no attention layer to split the sequence of; use cp=1"
    return None


def sp_has_activations(c: Context) -> str | None:
    if c.plan.sequence_parallel and c.plan.tp > 1 and not c.caps.sequence_parallel:
        return ("sequence_parallel but no tensor-parallel layer of the model keeps a replicated hidden state "
                "(norms, residuals) to split; use sequence_parallel=0")
    return None


def pipeline_allowed(c: Context) -> str | None:
    why = c.caps.pipeline
    if c.plan.pp > 1 and why:
        return f"pp={c.plan.pp}: the model cannot be cut into pipeline stages ({why}); use pp=1"
    return None


def tp_within_node(c: Context) -> str | None:
    """Tensor-parallel groups tile the nodes: tp divides a node's GPUs (groups within a node) or
    is a whole number of nodes (a group spanning nodes, priced on the inter-node link by
    cost.comm.Group.of: legal, and used on small cloud nodes). Any other tp would leave a group
    straddling a node boundary with a different share of its ranks on each node."""
    g, tp = c.cluster.gpus_per_node, c.plan.tp
    if g % tp == 0 or tp % g == 0:
        return None
    if tp > g:
        return (f"tp={tp} is not a whole number of nodes ({g} GPUs each): its groups would straddle node "
                f"boundaries; use a multiple of {g} (tp across nodes) or a divisor of {g}")
    return f"tp={tp} does not divide the {g} GPUs of a node"


def layers_split(c: Context) -> str | None:
    p, L = c.plan, c.caps.blocks
    if p.pp > 1 and c.caps.pipeline:  # pipeline_allowed says why there are no stages
        return None
    if p.stage_layers is not None:
        if sum(p.stage_layers) != L:
            return f"stage_layers sum to {sum(p.stage_layers)} but the model has {L} layers"
        if p.virtual_stages > 1 and any(n % p.virtual_stages for n in p.stage_layers):
            return "each stage's layer count must be divisible by virtual_stages"
        return None
    chunks = p.pp * p.virtual_stages
    if chunks > L:
        return f"pp*virtual_stages = {chunks} exceeds the {L} layers"
    if L % chunks:
        return (f"{L} layers are not divisible by pp*virtual_stages = {p.pp}*{p.virtual_stages}; "
                f"give stage_layers or pick pp*virtual_stages dividing {L}")
    return None


def batch_divides(c: Context) -> str | None:
    p, B = c.plan, c.work.global_batch
    if p.dp_shares is not None and len(set(p.replica_shares)) > 1:  # uneven: each share whole micro-batches
        S = sum(p.replica_shares)
        split = dict(zip(p.replica_shares, share_split(p.replica_shares, B)))
        bad = [s for s in sorted(split) if split[s][1] or split[s][0] % p.micro_batch]
        if bad:
            return (f"global batch {B} does not split as dp_shares={':'.join(map(str, p.dp_shares))} into whole "
                    f"micro-batches of {p.micro_batch} per replica (share {bad[0]} of {S} gets {B * bad[0] / S:g} "
                    "samples)")
        return None
    per = p.dp * p.micro_batch
    if B % per:
        head = f"global batch {B} is not divisible by dp*micro_batch = {p.dp}*{p.micro_batch}"
        if B % p.dp:
            return f"{head}: use a dp dividing {B}"
        per = B // p.dp
        must = "be 1" if per == 1 else f"divide {per}"
        return (f"{head}: {B} over dp={p.dp} leaves {per} sequence{'' if per == 1 else 's'} per replica, "
                f"so micro_batch must {must}")
    return None


def schedule_fits(c: Context) -> str | None:
    p = c.plan
    if p.virtual_stages > 1 and p.schedule not in ("interleaved-1f1b", "zbv"):
        return f"virtual_stages={p.virtual_stages} needs schedule=interleaved-1f1b (got {p.schedule})"
    if p.schedule == "interleaved-1f1b" and p.pp > 1:
        m = microbatches(c.work.global_batch, p.dp, p.micro_batch)
        if p.virtual_stages > 1 and m % p.pp:
            return (f"interleaved 1F1B needs micro-batches per step ({m}) divisible by pp={p.pp} "
                    "(Megatron's requirement)")
    if p.schedule == "zbv" and p.virtual_stages != 2:
        return "schedule=zbv uses exactly virtual_stages=2"
    return None


def cp_divides_seq(c: Context) -> str | None:
    cp, s = c.plan.cp, c.work.seq_len
    if cp > 1 and s % (2 * cp) and c.caps.attention:  # (no attention: cp_has_attention says it)
        return f"seq_len {s} is not divisible by 2*cp = {2 * cp} (load-balanced ring attention)"
    return None


def sp_needs_tp(c: Context) -> str | None:
    return "sequence_parallel needs tp > 1" if c.plan.sequence_parallel and c.plan.tp == 1 else None


def ep_valid(c: Context) -> str | None:
    p, experts = c.plan, c.caps.experts
    if p.ep == 1:
        return None
    if not experts:
        return f"ep={p.ep} but the model has no experts; use ep=1"
    bad = [e for e in experts if e % p.ep]
    if bad:
        return f"ep={p.ep} does not divide num_experts={bad[0]}"
    if (p.dp * p.cp) % p.ep:
        return f"ep={p.ep} must divide dp*cp = {p.dp * p.cp}"
    return None


def hybrid_valid(c: Context) -> str | None:
    p = c.plan
    if p.shard_group and p.zero == 0:
        return "shard_group (hybrid sharding) needs zero >= 1"
    if p.shard_group and (p.dp * p.cp) % p.shard_group:
        return f"shard_group={p.shard_group} must divide dp*cp = {p.dp * p.cp}"
    return None


def offload_valid(c: Context) -> str | None:
    p = c.plan
    if p.offload_params and p.zero != 3:
        return "offload_params needs zero=3 (FSDP)"
    if p.offload_optimizer and p.zero == 0 and p.dp > 1:
        return "offload_optimizer needs zero >= 1 when dp > 1"
    if p.offload_optimizer and c.work.optimizer in CUDA_ONLY_OPTIMIZERS:
        return (f"offload_optimizer with optimizer={c.work.optimizer}: bitsandbytes' 8-bit optimizers step on the "
                "GPU only (CUDA kernels; no CPU step for offloaded states); offload with adamw, or keep adam8bit's "
                "states on the GPU")
    return None


CUDA_ONLY_OPTIMIZERS = ("adam8bit",)
"""Optimizers whose step has no CPU implementation (bitsandbytes' blockwise 8-bit kernels are CUDA ones), so
their states cannot be offloaded to the host (offload_optimizer)."""


def zero2_pipeline(c: Context) -> str | None:
    p = c.plan
    if p.zero == 2 and p.pp > 1:
        return ("zero=2 with pp > 1: under a pipeline gradients accumulate unsharded until the last "
                "micro-batch (torch.distributed.pipelining), and DeepSpeed refuses ZeRO-2 with its "
                "pipeline; use zero=1 (distributed optimizer) or zero=3")
    return None


def recompute_layers_valid(c: Context) -> str | None:
    p, L = c.plan, c.caps.blocks
    if p.recompute_layers is None:
        return None
    most = max(p.stage_layers) if p.stage_layers else -(-L // max(1, p.pp))
    if p.recompute_layers > most:
        return (f"recompute_layers={p.recompute_layers} exceeds the {most} blocks of the largest pipeline "
                f"stage ({L} layers over pp={p.pp}); use at most {most}, or drop recompute_layers to "
                "recompute every block")
    return None


def sync_valid(c: Context) -> str | None:
    from meshplan.spec.sync import periodic_reason
    return periodic_reason(c.plan, c.cluster)


def precision_supported(c: Context) -> str | None:
    if c.plan.precision == "fp8" and "fp8" not in c.cluster.gpu.peak_tflops:
        return f"precision=fp8 but {c.cluster.gpu.name} has no fp8 tensor cores; use bf16"
    return None


def site_order_valid(c: Context) -> str | None:
    """A site order names each of the cluster's sites, and only the pipeline crosses them
    (spec.axes.site_order_fault)."""
    from meshplan.spec.axes import site_order_fault
    return site_order_fault(c.plan.dims, getattr(c.cluster, "num_dcs", 1))


CHECKS: dict[str, Check] = {
    "gpu count mismatch": gpus_match,
    "tp does not divide heads": tp_divides_heads,
    "tp does not divide layer widths": tp_divides_widths,
    "no layer for tensor parallel": tp_has_layers,
    "tp larger than a node": tp_within_node,
    "model cannot be pipelined": pipeline_allowed,
    "layers do not split into stages": layers_split,
    "batch not divisible": batch_divides,
    "schedule incompatible": schedule_fits,
    "no attention for context parallel": cp_has_attention,
    "cp does not divide sequence": cp_divides_seq,
    "sequence parallel without tp": sp_needs_tp,
    "no replicated activations for sequence parallel": sp_has_activations,

    "invalid expert parallel": ep_valid,
    "invalid hybrid sharding": hybrid_valid,
    "invalid offload": offload_valid,
    "zero=2 under a pipeline": zero2_pipeline,
    "recompute_layers beyond the stage": recompute_layers_valid,
    "precision unsupported": precision_supported,
    "invalid gradient sync": sync_valid,
    "invalid site order": site_order_valid,
}


def violations(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
               *, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """All (name, reason) pairs this plan violates, in a fixed order."""
    ctx = Context(model, cluster, plan, work)
    out = []
    for name, fn in CHECKS.items():
        if name in skip:
            continue
        reason = fn(ctx)
        if reason:
            out.append((name, reason))
    return out
