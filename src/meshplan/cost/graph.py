"""The cost model on a general layer graph (issue 5): any model as a sequence of layers with
measured FLOPs, parameters and activation bytes (``meshplan.spec.graph.LayerGraph``).

    estimate_graph(graph, cluster, plan, workload, params=None) -> CostReport

Same CostReport, same meaning of every field, as ``meshplan.cost.estimate`` on a transformer
ModelSpec; the pieces that do not depend on the layer shapes are the transformer path's own:
ring collectives (comm.Group), GEMM shape efficiency (compute.gemm_efficiency), the bubble and
in-flight micro-batches of each schedule (schedule.bubble_array, in_flight_array), ZeRO model
states (memory.model_state_arrays), ZeRO sharding, data-parallel gradient sync and parameter
offload (batch._shard, _dp_end_of_step, _offload), and every constant of CostParams.

Per layer, per micro-batch of b samples, on one GPU (docs/graph-cost.md has the derivations):
  compute   GEMM FLOPs / (peak x gemm_efficiency(m, d, d)), m = uses of each weight per
            micro-batch (b x FLOPs / 2 params: tokens for a linear layer, output pixels for a
            convolution), d = extra['gemm_dim'] or sqrt(params / 12); the TP-split part runs at
            gemm_efficiency(m, d / tp, d); attention-core FLOPs (extra['attention_flops']) at the
            GPU's FlashAttention efficiency; memory-bound bytes at the achieved HBM bandwidth.
            Backward: the layer's bwd_flops the same way (the weight-gradient share kept apart
            for zero-bubble schedules); full recompute adds one forward.
  TP        only layers with tp_style != none split by tp, only their tp_fraction of FLOPs,
            parameters and activations; tp_allreduces all-reduces of the layer's output forward
            and again backward (and again when recomputed).
  PP        contiguous stages (stage_layers, or the even split by layer count); embedding
            layers stay on the first stage, heads on the last; a send of the boundary layer's
            output forward, of its gradient backward. Zero-bubble and ZBV: the bubble of
            torch's order from m and each rank's F, B, W passes (chunk_passes; ZBV: the
            critical rank's own two chunks), as cost.batch passes them.
  DP/ZeRO   model states per ZeRO level over the stage's (TP-local) parameters; FSDP gathers
            and reduce-scatters each layer, hidden under that layer's compute (once per step
            under a pipeline, the reduce-scatter under the last W pass when the backward is
            split); DDP/ZeRO-1/2 gradient sync at the end of the step.
  memory    per pipeline rank: model states + saved activations x micro-batches in flight
            (full recompute keeps each layer's input only) + the loss's logits + buffers,
            allocator fragmentation and the framework overhead of CostParams.
Activation bytes are traced at graph.trace_dtype and rescaled to the plan's precision (2 bytes
for bf16/fp16, 4 for fp32). ``cost.graph_durations`` keeps the same terms apart by pass, stream,
chunk and rank for the simulator (``sim.simulate_graph_plan``), from the pieces ``finish`` is
built from (boundary_sends, fsdp_layer_traffic/_exposed, batch.optimizer_seconds, tied_sync_seconds,
memory_parts).

Not modelled, refused with a one-line reason (`graph_violations`): cp > 1 and ep > 1 (a graph
has no attention sequence axis or experts to split), sequence_parallel (which activations are
replicated is unknown), recompute=selective/op (a graph records whole layers, not which ops
are the attention core), fp8 (which FLOPs are linear layers is unknown), and explicit
stage_layers with virtual stages (the chunk placement would be ambiguous).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from meshplan.cost import batch as _b
from meshplan.cost.comm import Group, exposed_under, staged_fsdp_exposed, staged_fsdp_overlapped
from meshplan.cost.compute import ELEMENTWISE_BWD_RATIO, gemm_efficiency
from meshplan.cost.graph_params import (
    DEFAULT_HEAD_DIM,
    MEM_BYTES_PER_SAVED_BYTE,
    PARAMS_PER_SQUARED_WIDTH,
    REPLICATED_PER_PAIR,
)
from meshplan.cost.memory import (
    FUSED_LOGITS_BYTES_PER_ELEM,
    LOGITS_BYTES_PER_ELEM,
    VOCAB_PARALLEL_LOGITS_BYTES_PER_ELEM,
    fit_verdicts,
    model_state_arrays,
    usable_gib,
)
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.report import CostReport
from meshplan.cost.schedule import SPLIT_BACKWARD, RankPasses, bubble_array, in_flight_array, rank_passes
from meshplan.errors import MeshplanError
from meshplan.spec import constraints as _c
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph, LayerSpec
from meshplan.spec.plan import Plan, Workload, microbatches
from meshplan.units import GiB

TIME_KEYS = _b.TIME_KEYS
MEMORY_KEYS = _b.MEMORY_KEYS
EXPOSED_KEYS = tuple(k for k in TIME_KEYS if not k.endswith("_overlapped"))


def graph_workload(graph: LayerGraph, global_batch: int) -> Workload:
    """The workload of ``global_batch`` samples per step at the graph's traced sample size."""
    return Workload(global_batch=global_batch, seq_len=graph.sample_tokens)


# ---- the graph as arrays ---------------------------------------------------------------------

@dataclass(frozen=True)
class GraphArrays:
    """Per-layer arrays of a LayerGraph (per sample, at trace dtype), with the extras filled in."""

    params: np.ndarray
    weights: np.ndarray       # weights the layer multiplies (its params, + tied ones at the head)
    fwd: np.ndarray
    bwd: np.ndarray
    saved: np.ndarray
    out: np.ndarray
    send: np.ndarray          # what a pipeline cut after the layer carries (extra send_bytes, else out)
    tp_able: np.ndarray       # tp_style != none and tp_fraction > 0
    tp_fraction: np.ndarray
    tp_saved_fraction: np.ndarray
    allreduces: np.ndarray
    gemm_dim: np.ndarray
    att: np.ndarray           # attention-core forward FLOPs (full s x s count)
    att_bwd: np.ndarray       # attention-core backward FLOPs as counted in bwd
    causal: np.ndarray        # 1 causal, else 0
    head_dim: np.ndarray
    mem: np.ndarray           # forward memory-bound HBM bytes
    bwd_weight: np.ndarray    # weight-gradient FLOPs
    prefix: int
    """Layers 0..prefix-1 (up to the last embedding) must be on the first pipeline rank."""
    suffix: int
    """Layers suffix..L-1 (from the first head) must be on the last pipeline rank."""
    defaults: tuple[str, ...]
    """Extras that were missing on some layer with FLOPs (for CostReport.notes)."""


def graph_arrays(graph: LayerGraph) -> GraphArrays:
    """The graph's layers as arrays; LayerSpec.extra keys of graph_params.EXTRA_KEYS override
    the defaults documented there."""
    layers = graph.layers

    def arr(f: Callable) -> np.ndarray:
        return np.array([float(f(x)) for x in layers])

    params, fwd, bwd = arr(lambda x: x.params), arr(lambda x: x.fwd_flops), arr(lambda x: x.bwd_flops)
    saved = arr(lambda x: x.saved_bytes)
    tp_able = np.array([x.tp_style != "none" and x.tp_fraction > 0 for x in layers])
    frac = arr(lambda x: x.tp_fraction)
    missing = []
    for key in ("gemm_dim", "mem_bytes"):
        if any(key not in x.extra and (x.fwd_flops > 0 or x.saved_bytes > 0) for x in layers):
            missing.append(key)
    att = arr(lambda x: x.extra.get("attention_flops", 0.0))
    kinds = [x.kind for x in layers]
    emb = [i for i, k in enumerate(kinds) if k == "embedding"]
    head = [i for i, k in enumerate(kinds) if k == "head"]
    weights = params.copy()  # weights each layer multiplies: a tied weight's second user is the head
    weights[head[0] if head else len(layers) - 1] += graph.tied_params
    width = np.sqrt(np.maximum(weights, 1.0) / PARAMS_PER_SQUARED_WIDTH)
    return GraphArrays(
        params=params, weights=weights, fwd=fwd, bwd=bwd, saved=saved, out=arr(lambda x: x.output_bytes),
        send=arr(lambda x: x.extra.get("send_bytes", x.output_bytes)),
        tp_able=tp_able, tp_fraction=np.where(tp_able, frac, 0.0),
        tp_saved_fraction=np.where(tp_able, arr(_tp_saved_fraction), 0.0),
        allreduces=np.where(tp_able, arr(lambda x: x.tp_allreduces), 0.0),
        gemm_dim=np.array([float(x.extra.get("gemm_dim", w)) for x, w in zip(layers, width)]),
        att=att, att_bwd=np.array([float(x.extra.get("attention_bwd_flops", 2.0 * a)) for x, a in zip(layers, att)]),
        causal=arr(lambda x: x.extra.get("attention_causal", 0.0)),
        head_dim=arr(lambda x: x.extra.get("head_dim", DEFAULT_HEAD_DIM)),
        mem=np.array([float(x.extra.get("mem_bytes", MEM_BYTES_PER_SAVED_BYTE * x.saved_bytes)) for x in layers]),
        bwd_weight=np.minimum(bwd, arr(lambda x: x.extra.get(
            "bwd_weight_flops", max(0.0, x.fwd_flops - x.extra.get("attention_flops", 0.0))))),
        prefix=emb[-1] + 1 if emb else 0, suffix=head[0] if head else len(layers),
        defaults=tuple(missing))


def _tp_saved_fraction(x: LayerSpec) -> float:
    """extra['tp_saved_fraction'], else: each column->row pair keeps REPLICATED_PER_PAIR
    output-sized tensors whole (its norm's input and output), tp_fraction of the rest splits."""
    if "tp_saved_fraction" in x.extra:
        return float(x.extra["tp_saved_fraction"])
    if x.saved_bytes <= 0:
        return x.tp_fraction
    rep = min(x.saved_bytes, REPLICATED_PER_PAIR * x.tp_allreduces * x.output_bytes)
    return x.tp_fraction * (x.saved_bytes - rep) / x.saved_bytes


# ---- per-layer costs of one micro-batch on one GPU -------------------------------------------

@dataclass(frozen=True)
class LayerCosts:
    """Seconds, bytes and parameters per layer for one micro-batch on one GPU, for one
    (tp, micro_batch, precision, fused_loss) setting. Recompute and TP-communication terms are
    given both ways; a plan picks per layer."""

    f: np.ndarray           # forward seconds
    b: np.ndarray           # backward seconds (input + weight gradients)
    bw: np.ndarray          # weight-gradient seconds (part of b)
    rc: np.ndarray          # recompute seconds (one forward) if the layer is recomputed
    tp2: np.ndarray         # TP all-reduce seconds, forward + backward
    tp3: np.ndarray         # ... plus the recomputed forward's
    lp: np.ndarray          # parameters on this GPU (TP-local)
    saved: np.ndarray       # bytes kept for backward, no recompute
    inp: np.ndarray         # bytes of the layer's input (what full recompute keeps)
    out: np.ndarray         # bytes of the layer's output (full tensor)
    send: np.ndarray        # bytes a pipeline cut after the layer sends (output + side inputs, e.g. rotary)
    loss_s: float           # loss forward + backward seconds (last rank)
    logits_bytes: float     # bytes alive at the loss (last rank's transient)
    tied_local: float       # tied parameters on this GPU (copy on the last rank when pp > 1)
    loss_fwd_share: float = 1.0  # share of loss_s in the forward pass (the rest is backward)


def act_bytes(precision: str) -> float:
    """Bytes per activation element under ``precision``."""
    return 4.0 if precision == "fp32" else 2.0


def layer_costs(graph: LayerGraph, ga: GraphArrays, cluster: ClusterSpec, tp: int, micro_batch: int,
                precision: str, fused_loss: bool, params: CostParams = DEFAULT_PARAMS) -> LayerCosts:
    """Per-layer costs (see LayerCosts) from the graph's per-sample numbers."""
    p, gpu, mb = params, cluster.gpu, float(micro_batch)
    peak = gpu.peak(precision)
    hbm = gpu.hbm_bandwidth_gbps * 1e9 * p.hbm_efficiency
    split = np.where(tp > 1, ga.tp_fraction, 0.0)
    keep = 1.0 - split + split / tp                  # local share of FLOPs and parameters
    s_split = np.where(tp > 1, ga.tp_saved_fraction, 0.0)
    s_keep = 1.0 - s_split + s_split / tp           # local share of activations
    scale = act_bytes(precision) / graph.dtype_bytes

    # GEMMs: shape factor with m = uses of each weight per micro-batch, n = k = the layer width
    # (the TP-split part: n / tp).
    gemm_f = np.maximum(0.0, ga.fwd - ga.att) * mb
    gemm_b = np.maximum(0.0, ga.bwd - ga.att_bwd) * mb
    uses = np.where(ga.weights > 0, gemm_f / np.maximum(2.0 * ga.weights, 1.0), mb * graph.sample_tokens)
    uses = np.maximum(uses, 1.0)
    eff_rep = gemm_efficiency(uses, ga.gemm_dim, ga.gemm_dim, gpu, p)
    eff_tp = gemm_efficiency(uses, ga.gemm_dim / tp, ga.gemm_dim, gpu, p)
    per_flop = ((1.0 - split) / eff_rep + split / tp / eff_tp) / peak  # seconds per layer-FLOP
    t_gemm_f, t_gemm_b = gemm_f * per_flop, gemm_b * per_flop
    t_w = np.where(gemm_b > 0, t_gemm_b * np.minimum(1.0, ga.bwd_weight * mb / np.maximum(gemm_b, 1e-300)), 0.0)

    # Attention core (FlashAttention): masked half skipped when causal; per-GPU efficiency with
    # the head-dimension and sequence factors of compute.attention_core; the backward kernel's
    # work (with its recomputation of QK^T) is flash_bwd_flop_ratio x the forward's.
    d0 = p.attn_headdim_half
    kv = float(graph.sample_tokens)
    base = gpu.attention_efficiency or gpu.gemm_efficiency * p.flash_fwd_efficiency
    eff_att = base * (ga.head_dim / (ga.head_dim + d0)) / (128 / (128 + d0)) * kv / (kv + p.attn_half_seq)
    run = ga.att * mb * keep * np.where(ga.causal > 0, 0.5, 1.0)
    t_att_f = run / (peak * eff_att)
    t_att_b = p.flash_bwd_flop_ratio * run / (peak * eff_att * p.flash_bwd_efficiency)

    t_mem_f = ga.mem * mb * scale * s_keep / hbm
    f = t_gemm_f + t_att_f + t_mem_f
    b = t_gemm_b + t_att_b + ELEMENTWISE_BWD_RATIO * t_mem_f

    out = ga.out * mb * scale
    one = Group.of(cluster, tp, 1).all_reduce(out)
    tp_one = np.where(ga.tp_able & (tp > 1), ga.allreduces * one, 0.0)

    # The last layer's output is the loss input (logits for a language model): the loss's
    # memory traffic as compute.output_layer_times, its working set as batch._memory.
    head_keep = float(keep[-1])
    elems = ga.out[-1] / graph.dtype_bytes * mb * head_keep
    fwd_b, bwd_b = (4.0, 0.0) if fused_loss else (14.0, 14.0)
    per_elem = (FUSED_LOGITS_BYTES_PER_ELEM if fused_loss else
                VOCAB_PARALLEL_LOGITS_BYTES_PER_ELEM if (tp > 1 and bool(ga.tp_able[-1])) else LOGITS_BYTES_PER_ELEM)
    inp = np.concatenate([[0.0], out[:-1]])
    owner = int(np.argmax(ga.params > 0)) if graph.tied_params else 0
    return LayerCosts(f=f, b=b, bw=t_w, rc=f.copy(), tp2=2 * tp_one, tp3=3 * tp_one, lp=ga.params * keep,
                      saved=ga.saved * mb * scale * s_keep, inp=inp, out=out, send=ga.send * mb * scale,
                      loss_s=elems * (fwd_b + bwd_b) / hbm, logits_bytes=elems * per_elem,
                      tied_local=graph.tied_params * float(keep[owner]), loss_fwd_share=fwd_b / (fwd_b + bwd_b))


# ---- pipeline layout -------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Which pipeline rank runs each layer, and the chunk boundaries."""

    rank: np.ndarray         # (L,) rank of each layer
    pos: np.ndarray          # (L,) position of the layer among its rank's layers (execution order)
    chunk_end: np.ndarray    # (chunks,) exclusive end layer of each model chunk, in model order
    chunk_rank: np.ndarray   # (chunks,) rank of each chunk
    stage_layers: tuple[int, ...]
    """Layers per chunk (model order; pp entries when virtual_stages = 1)."""


def even_split(n: int, parts: int) -> tuple[int, ...]:
    """The transformer path's default: base layers each, the first n mod parts one more."""
    base, extra = divmod(n, parts)
    return tuple(base + (1 if j < extra else 0) for j in range(parts))


def make_layout(num_layers: int, pp: int, v: int, schedule: str,
                stage_layers: tuple[int, ...] | None) -> Layout:
    """Chunks of contiguous layers: ``stage_layers`` (v = 1) or the even split into pp x v
    chunks; interleaved: chunk c on rank c mod pp; zbv: a V (rank r holds chunks r and 2pp-1-r)."""
    chunks = stage_layers if stage_layers is not None else even_split(num_layers, pp * v)
    n = len(chunks)
    c = np.arange(n)
    chunk_rank = np.where(c < pp, c, 2 * pp - 1 - c) if schedule == "zbv" and v == 2 else c % pp
    ends = np.cumsum(chunks)
    rank = np.repeat(chunk_rank, chunks)
    pos = np.zeros(num_layers, dtype=np.int64)
    for r in range(pp):
        idx = np.nonzero(rank == r)[0]
        pos[idx] = np.arange(len(idx))
    return Layout(rank=rank, pos=pos, chunk_end=ends, chunk_rank=chunk_rank, stage_layers=tuple(chunks))


# ---- feasibility -----------------------------------------------------------------------------

@dataclass(frozen=True)
class GraphContext:
    graph: LayerGraph
    cluster: ClusterSpec
    plan: Plan
    work: Workload

    def plain(self) -> _c.Context:
        """The transformer checks' context (for the checks that do not read the model)."""
        return _c.Context(None, self.cluster, self.plan, self.work)  # type: ignore[arg-type]


def _workload(c: GraphContext) -> str | None:
    g, w = c.graph, c.work
    if w.seq_len != g.sample_tokens:
        return (f"the workload has {w.seq_len} tokens per sample but graph {g.name} was traced at "
                f"{g.sample_tokens}; use seq_len={g.sample_tokens} or ingest again at {w.seq_len}")
    return None


def _tp_allowed(c: GraphContext) -> str | None:
    tp, g = c.plan.tp, c.graph
    if tp == 1:
        return None
    able = [x for x in g.layers if x.tp_style != "none" and x.tp_fraction > 0]
    if not able:
        return f"tp={tp} but no layer of {g.name} can be split by tensor parallel; use tp=1"
    bad = next((x for x in able if x.tp_max % tp), None)
    if bad is not None:
        allowed = ", ".join(map(str, g.tp_degrees(max(tp, c.cluster.gpus_per_node))))
        return f"tp={tp} does not divide layer {bad.name}'s tp_max={bad.tp_max}; use tp in {allowed}"
    return None


def unsupported_reason(p: Plan) -> str | None:
    """Why the graph cost model cannot price ``p`` whatever the graph (None: it can)."""
    if p.cp > 1:
        return f"cp={p.cp}: a layer graph has no attention sequence axis to split; use cp=1"
    if p.ep > 1:
        return f"ep={p.ep}: a layer graph has no experts to split; use ep=1"
    if p.sequence_parallel:
        return ("sequence_parallel is not modelled on a layer graph (its replicated activations are unknown); "
                "turn it off")
    if p.recompute in ("selective", "op"):
        return (f"recompute={p.recompute} needs to know which ops to recompute; a layer graph records whole "
                "layers; use recompute=full or none")
    if p.precision == "fp8":
        return "precision=fp8 needs to know which FLOPs are linear layers; a layer graph does not; use bf16"
    return None


def _unsupported(c: GraphContext) -> str | None:
    return unsupported_reason(c.plan)


def _stages(c: GraphContext) -> str | None:
    p, g = c.plan, c.graph
    L, pp, v = g.num_layers, p.pp, p.virtual_stages
    if p.stage_layers is not None:
        if v > 1:
            return "stage_layers with virtual_stages > 1 is ambiguous on a layer graph; leave stage_layers unset"
        if sum(p.stage_layers) != L:
            return f"stage_layers sum to {sum(p.stage_layers)} but graph {g.name} has {L} layers"
        if any(n < 1 for n in p.stage_layers):
            return "every pipeline stage needs at least one layer (stage_layers entries >= 1)"
        chunks = p.stage_layers
    else:
        if pp * v > L:
            return f"pp*virtual_stages = {pp * v} exceeds the {L} layers of graph {g.name}"
        chunks = even_split(L, pp * v)
    if pp == 1:
        return None
    kinds = [x.kind for x in g.layers]
    emb = [i for i, k in enumerate(kinds) if k == "embedding"]
    head = [i for i, k in enumerate(kinds) if k == "head"]
    if emb and chunks[0] <= emb[-1]:
        return (f"the first stage ({chunks[0]} layers) does not hold embedding layer "
                f"{g.layers[emb[-1]].name}; give stage_layers with at least {emb[-1] + 1} on the first stage")
    if head and L - chunks[-1] > head[0]:
        return (f"the last stage ({chunks[-1]} layers) does not hold head layer {g.layers[head[0]].name}; "
                f"give stage_layers with at least {L - head[0]} on the last stage")
    return None


def _wrap(fn: Callable[[_c.Context], str | None]) -> Callable[[GraphContext], str | None]:
    return lambda c: fn(c.plain())


GRAPH_CHECKS: dict[str, Callable[[GraphContext], str | None]] = {
    "gpu count mismatch": _wrap(_c.gpus_match),
    "workload does not match the graph": _workload,
    "not modelled on a layer graph": _unsupported,
    "tp not allowed by the layers": _tp_allowed,
    "tp larger than a node": _wrap(_c.tp_within_node),
    "layers do not split into stages": _stages,
    "batch not divisible": _wrap(_c.batch_divides),
    "schedule incompatible": _wrap(_c.schedule_fits),
    "invalid hybrid sharding": _wrap(_c.hybrid_valid),
    "invalid offload": _wrap(_c.offload_valid),
    "zero=2 under a pipeline": _wrap(_c.zero2_pipeline),
    "precision unsupported": _wrap(_c.precision_supported),
}
"""Named feasibility predicates of a plan on a layer graph (memory aside), in counting order."""


def graph_violations(graph: LayerGraph, cluster: ClusterSpec, plan: Plan, work: Workload) -> list[tuple[str, str]]:
    """Every (name, reason) this plan violates on ``graph``."""
    ctx = GraphContext(graph, cluster, plan, work)
    out = []
    for name, fn in GRAPH_CHECKS.items():
        reason = fn(ctx)
        if reason:
            out.append((name, reason))
    return out


def check_graph(graph: LayerGraph, cluster: ClusterSpec, plan: Plan, work: Workload) -> None:
    """Raise MeshplanError naming every reason the plan cannot run on ``graph`` (memory aside)."""
    bad = graph_violations(graph, cluster, plan, work)
    if bad:
        raise MeshplanError("plan cannot run: " + "; ".join(reason for _, reason in bad))


# ---- assembly --------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageSums:
    """Per-rank sums of one micro-batch's layer costs for one layout and recompute choice (what
    every ZeRO/offload variant of the plan shares)."""

    pp: int
    onehot: np.ndarray       # (L, pp) layer -> rank
    compute: np.ndarray      # (pp,) forward + backward seconds (+ the loss on the last layer's rank)
    recompute: np.ndarray
    tp_t: np.ndarray         # TP all-reduce seconds
    tp_exp: np.ndarray       # of which exposed
    p2p: np.ndarray          # pipeline sends
    plocal: np.ndarray       # parameters per GPU before ZeRO sharding (tied copy with the last layer)
    lp_max: np.ndarray       # largest layer's parameters (FSDP's gathered copies)
    kept: np.ndarray         # activation bytes kept per micro-batch
    transient: np.ndarray    # bytes of the layer being recomputed / the logits at the loss
    f: np.ndarray            # (L,) forward seconds
    b_rc: np.ndarray         # (L,) backward + recompute seconds
    lp: np.ndarray           # (L,) parameters per GPU
    first_lp: float          # parameters of the first layer the step runs (ZeRO-3's exposed gather)
    w_frac: float            # weight-gradient share of a micro-batch's compute (zero-bubble)
    tied_local: float        # tied parameters copied onto the last layer's rank (0 when that is rank 0)
    recompute_flops: float   # forward FLOPs per sample recomputed
    bw: np.ndarray           # (L,) weight-gradient seconds
    chunk_onehot: np.ndarray  # (L, chunks) layer -> model chunk (virtual stage, model order)
    chunk_rank: np.ndarray   # (chunks,) rank of each chunk
    chunk_fwd: np.ndarray    # (chunks,) the split-backward passes of each chunk, without the per-row
    chunk_bwd: np.ndarray    # FSDP and offload terms (finish adds them): forward (+ the loss's forward
    chunk_wgt: np.ndarray    # share, exposed TP, its forward send), input gradients (+ recompute, the
    #                          loss's backward, exposed TP, its gradient send), weight gradients


def recompute_mask(lay: Layout, recompute: str, recompute_layers: int | None) -> np.ndarray:
    """(L,) layers whose forward is recomputed: all with recompute=full, or the first
    ``recompute_layers`` of each rank."""
    if recompute == "full":
        return np.ones(len(lay.rank), dtype=bool) if recompute_layers is None else lay.pos < recompute_layers
    return np.zeros(len(lay.rank), dtype=bool)


def stage_sums(graph: LayerGraph, cluster: ClusterSpec, lc: LayerCosts, lay: Layout, *, tp: int, cp: int, dp: int,
               recompute: str, recompute_layers: int | None, p2p_sharded: bool, async_tp: bool,
               params: CostParams = DEFAULT_PARAMS) -> StageSums:
    """StageSums of a plan's layer costs ``lc`` on layout ``lay``."""
    p = params
    pp = int(lay.chunk_rank.max()) + 1
    rank = lay.rank
    onehot = (rank[:, None] == np.arange(pp)[None, :]).astype(float)
    rc_mask = recompute_mask(lay, recompute, recompute_layers)
    rc = np.where(rc_mask, lc.rc, 0.0)
    fb = lc.f + lc.b
    compute = fb @ onehot
    last = int(rank[-1])  # the rank of the last layer (rank 0 under zbv's V)
    compute[last] += lc.loss_s
    tp_t = np.where(rc_mask, lc.tp3, lc.tp2) @ onehot
    p2p = np.zeros(pp)
    if pp > 1:  # each chunk boundary: the activation forward (sender), its gradient backward (receiver)
        src, dst, send, moved = boundary_sends(cluster, lc, lay, tp=tp, cp=cp, dp=dp, p2p_sharded=p2p_sharded)
        t = send * p.pp_p2p_exposed * moved
        p2p = np.bincount(src, weights=t, minlength=pp) + np.bincount(dst, weights=t, minlength=pp)
    plocal = lc.lp @ onehot
    tied = lc.tied_local if last != 0 else 0.0  # a copy (and its all-reduce) only off the first rank
    plocal[last] += tied
    lp_max = np.zeros(pp)
    np.maximum.at(lp_max, rank, lc.lp)
    transient = np.zeros(pp)
    np.maximum.at(transient, rank, np.where(rc_mask, lc.saved, 0.0))
    transient[last] = max(transient[last], lc.logits_bytes)
    rc_flops = float(sum(x.fwd_flops for x, m in zip(graph.layers, rc_mask) if m))
    # Per chunk, the passes of the split-backward schedules as the simulator runs them
    # (cost.graph_durations): TP forward / backward all-reduces with their pass, each send with
    # the pass that sends it (an activation after F, a gradient after B).
    nch = len(lay.chunk_rank)
    chunk_of = np.repeat(np.arange(nch), lay.stage_layers)
    chunk_onehot = (chunk_of[:, None] == np.arange(nch)[None, :]).astype(float)
    a = p.tp_exposed_async if async_tp else 1.0
    tp_f = lc.tp2 / 2
    loss = np.zeros(len(lc.f))
    loss[-1] = lc.loss_s * lc.loss_fwd_share
    c_fwd = (lc.f + tp_f * a + loss) @ chunk_onehot
    loss[-1] = lc.loss_s - loss[-1]
    c_bwd = (lc.b - lc.bw + rc + (np.where(rc_mask, lc.tp3, lc.tp2) - tp_f) * a + loss) @ chunk_onehot
    if pp > 1:
        c_fwd[:-1] += t
        c_bwd[1:] += t
    return StageSums(
        pp=pp, onehot=onehot, compute=compute, recompute=rc @ onehot, tp_t=tp_t,
        tp_exp=tp_t * (p.tp_exposed_async if async_tp else 1.0), p2p=p2p, plocal=plocal, lp_max=lp_max,
        kept=np.where(rc_mask, lc.inp, lc.saved) @ onehot, transient=transient, f=lc.f, b_rc=lc.b + rc, lp=lc.lp,
        first_lp=float(lc.lp[rank == 0][0]), w_frac=float(lc.bw.sum() / max(1e-30, float(fb.sum() + rc.sum()))),
        tied_local=tied, recompute_flops=rc_flops, bw=lc.bw, chunk_onehot=chunk_onehot, chunk_rank=lay.chunk_rank,
        chunk_fwd=c_fwd, chunk_bwd=c_bwd, chunk_wgt=lc.bw @ chunk_onehot)


def boundary_sends(cluster: ClusterSpec, lc: LayerCosts, lay: Layout, *, tp: int, cp: int, dp: int,
                   p2p_sharded: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per chunk boundary (model order): sending rank, receiving rank, seconds of one send of
    the boundary layer's output (its gradient goes back the same way), and whether it crosses
    ranks (zbv's turn keeps both chunks on one rank)."""
    src, dst = lay.chunk_rank[:-1], lay.chunk_rank[1:]
    size = lc.send[lay.chunk_end[:-1] - 1] / (tp if p2p_sharded else 1)
    return src, dst, Group.of(cluster, 2, tp * cp * dp).send_recv(size), src != dst


def fsdp_layer_traffic(cluster: ClusterSpec, s: StageSums, shard: np.ndarray, tp: int,
                       params: CostParams = DEFAULT_PARAMS) -> tuple[np.ndarray, np.ndarray]:
    """(rows, L) seconds of each layer's ZeRO-3 all-gather (16-bit weights) and gradient
    reduce-scatter over the shard group."""
    sg = Group.of(cluster, shard[:, None], tp)
    return sg.all_gather(2.0 * s.lp[None, :]), sg.reduce_scatter(params.fsdp_reduce_bytes * s.lp[None, :])


def fsdp_layer_exposed(ag: np.ndarray, rs: np.ndarray, s: StageSums,
                       params: CostParams = DEFAULT_PARAMS) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the parts of its gather not hidden under its forward, and of its gather +
    reduce-scatter not hidden under its backward (+ recompute): FSDP without a pipeline."""
    a = params.overlap_slowdown
    return exposed_under(ag, s.f, a), exposed_under(ag + rs, s.b_rc, a)


def tied_sync_seconds(cluster: ClusterSpec, s: StageSums, *, tp: int, cp: int, dp: int) -> float:
    """The all-reduce of the tied parameters' 16-bit gradients between the first rank and the
    rank holding their copy (0 when there is no copy)."""
    if not s.tied_local:
        return 0.0
    return float(Group.of(cluster, 2, tp * cp * dp).all_reduce(2.0 * s.tied_local))


def memory_parts(cluster: ClusterSpec, s: StageSums, plocal: np.ndarray, *, dp: int, cp: int, micro: int,
                 schedule: str, v: int, zero: np.ndarray, shard: np.ndarray, offload_params: np.ndarray,
                 offload_optimizer: np.ndarray, params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """Bytes per rank, (rows, pp) or broadcastable: weights, grads, optimizer, activations
    (kept bytes x micro-batches in flight), transient (with the allocator fragmentation of
    activations and transient) and overhead; ``inflight`` (pp,) micro-batches in flight."""
    p, pp = params, s.pp
    w, g, o, buffers = model_state_arrays(plocal, s.lp_max[None, :], zero[:, None], shard[:, None],
                                          offload_params[:, None], offload_optimizer[:, None], dp * cp, p)
    stepped = ((zero == 3) & (pp > 1))[:, None]  # pipelined FSDP keeps unsharded 16-bit params + fp32 grads
    w, g = w + stepped * 2 * plocal, g + stepped * 4 * plocal
    inflight = in_flight_array(pp, v, np.asarray(schedule), np.arange(pp), micro)
    acts = s.kept * inflight
    transient = s.transient[None, :] + buffers
    transient = transient + p.allocator_fragmentation * (acts + transient)
    return {"weights": w, "grads": g, "optimizer": o, "activations": acts, "transient": transient,
            "overhead": p.framework_overhead_gib * GiB, "inflight": inflight}


def chunk_passes(fwd: np.ndarray, bwd: np.ndarray, wgt: np.ndarray, chunk_rank: np.ndarray, totals: np.ndarray,
                 zbv: bool) -> RankPasses:
    """schedule.RankPasses from (rows, chunks) forward / input-gradient / weight-gradient seconds
    of each model chunk (``chunk_rank``: their ranks) and the (rows, pp) per-rank totals of
    finish: each rank's F and W are its chunks' sums, its B the rest of its total (so F + B + W
    is the total). ZBV (rank r: chunks r and 2 pp - 1 - r): the second chunk is the V's way
    back (chunk 2 pp - 1 - r), with the output layer and the loss on rank 0."""
    pp = totals.shape[1]
    to_rank = (np.asarray(chunk_rank)[:, None] == np.arange(pp)[None, :]).astype(float)
    f, w = fwd @ to_rank, wgt @ to_rank
    second = None
    if zbv:
        back = 2 * pp - 1 - np.arange(pp)
        second = (fwd[:, back], bwd[:, back], wgt[:, back])
    return rank_passes(f, totals - f - w, w, np.ones(totals.shape, dtype=bool), second)


def finish(cluster: ClusterSpec, work: Workload, s: StageSums, *, tp: int, dp: int, cp: int, micro_batch: int,
           schedule: str, v: int, zero: np.ndarray, shard: np.ndarray, offload_params: np.ndarray,
           offload_optimizer: np.ndarray, grad_sync: np.ndarray,
           params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """Step time, its terms and memory for rows that share ``s``, the schedule and the
    micro-batch and differ in ZeRO level, shard group and offload (arrays, one entry per row).

    Returns arrays (rows,): step_time_s, peak_memory_gib, fits, time.<TIME_KEYS>,
    memory.<MEMORY_KEYS> (the fullest rank), and stage_memory_gib (rows, pp)."""
    p, pp = params, s.pp
    zero = np.asarray(zero)
    shard = np.asarray(shard, dtype=float)
    offp, offo = np.asarray(offload_params, dtype=bool), np.asarray(offload_optimizer, dtype=bool)
    n = len(zero)
    rows = np.arange(n)
    micro = microbatches(work.global_batch, dp, micro_batch)
    full = np.ones(n)

    fsdp, per_step = (zero == 3) & (shard > 1), (zero == 3) & (pp > 1)
    ag, rs = fsdp_layer_traffic(cluster, s, shard, tp, p)
    blocked = (fsdp & ~per_step)[:, None]  # ZeRO-3 without a pipeline: per layer, under its compute
    fe, be = fsdp_layer_exposed(ag, rs, s, p)
    exp_l = np.where(blocked, fe + be, 0.0)
    dp_layer = exp_l @ s.onehot
    dp_layer_ovl = np.where(blocked, 2 * ag + rs - exp_l, 0.0) @ s.onehot
    plocal = np.broadcast_to(s.plocal, (n, pp))
    offload = _b._offload({"offload_params": offp}, plocal, shard, p)
    base = s.compute + s.recompute + s.tp_exp + s.p2p
    totals = base[None, :] + dp_layer + offload
    crit = np.argmax(totals, axis=1)
    tmax, tsum = totals[rows, crit], totals.sum(axis=1)
    split = schedule in SPLIT_BACKWARD and pp > 1
    if split:  # zero-bubble, ZBV: the form of torch's order from each rank's F, B, W (and ZBV's chunks)
        chunk_params = s.lp @ s.chunk_onehot
        chunk_params[-1] += s.tied_local
        off_c = _b._offload({"offload_params": offp}, np.broadcast_to(chunk_params, (n, len(chunk_params))),
                            shard, p)
        passes = chunk_passes(s.chunk_fwd + np.where(blocked, fe, 0.0) @ s.chunk_onehot + off_c / 2,
                              s.chunk_bwd + np.where(blocked, be, 0.0) @ s.chunk_onehot + off_c / 2,
                              np.broadcast_to(s.chunk_wgt, off_c.shape), s.chunk_rank, totals, schedule == "zbv")
        bubble = bubble_array(tsum, tmax, pp, v, np.asarray(schedule), s.w_frac, micro, passes)
    else:
        bubble = bubble_array(tsum, tmax, pp, v, np.asarray(schedule), s.w_frac)

    # End of step: the transformer path's gradient sync / ZeRO gathers; tied weights; FSDP
    # under a pipeline (once per step, hidden by one micro-batch's compute only).
    cols = {"zero": zero, "pp": np.full(n, pp), "grad_sync": np.asarray(grad_sync)}
    dp_exp, dp_ovl = _b._dp_end_of_step(cluster, cols, p, tp * full, dp * full, cp * full, shard,
                                        s.first_lp * full, s.plocal.max() * full, s.compute[0] / 2 * full, micro)
    if s.tied_local:
        dp_exp = dp_exp + tied_sync_seconds(cluster, s, tp=tp, cp=cp, dp=dp)
    staged = fsdp & per_step
    if staged.any():
        ag_s, rs_s = (ag @ s.onehot)[rows, crit], (rs @ s.onehot)[rows, crit]
        f_c, b_c = (s.f @ s.onehot)[crit], (s.b_rc @ s.onehot)[crit]
        if split:  # the last weight gradients come with the rank's last W, which alone hides the reduce
            b_c = (s.bw @ (s.chunk_onehot if schedule == "zbv" else s.onehot))[crit]  # ZBV: chunk 0's (chunk crit)
        exp_s = staged_fsdp_exposed(ag_s, f_c, rs_s, b_c, pp, split, p.overlap_slowdown)
        dp_exp = dp_exp + np.where(staged, exp_s, 0)
        dp_ovl = dp_ovl + np.where(staged, staged_fsdp_overlapped(ag_s, f_c, rs_s, b_c), 0)
    opt = _b.optimizer_seconds(cluster, plocal, zero, shard, offo, p).max(axis=1)
    step = micro * tmax + bubble + dp_exp + opt + p.step_overhead_s

    per_rank = {"compute": s.compute, "recompute": s.recompute, "tp_comm": s.tp_exp,
                "tp_comm_overlapped": s.tp_t - s.tp_exp, "pp_comm": s.p2p}
    out: dict[str, np.ndarray] = {f"time.{k}": micro * t[crit] for k, t in per_rank.items()}
    out |= {f"time.{k}": micro * t[rows, crit] for k, t in
            (("dp_comm", dp_layer), ("dp_comm_overlapped", dp_layer_ovl), ("offload", offload))}
    out["time.cp_comm"] = out["time.ep_comm"] = np.zeros(n)
    out["time.dp_comm"] = out["time.dp_comm"] + dp_exp
    out["time.dp_comm_overlapped"] = out["time.dp_comm_overlapped"] + dp_ovl
    out |= {"time.bubble": bubble, "time.optimizer": opt, "time.overhead": np.full(n, p.step_overhead_s)}

    mem = memory_parts(cluster, s, plocal, dp=dp, cp=cp, micro=micro, schedule=schedule, v=v, zero=zero,
                       shard=shard, offload_params=offp, offload_optimizer=offo, params=p)
    w, g, o, acts, transient, overhead = (mem[k] for k in ("weights", "grads", "optimizer", "activations",
                                                           "transient", "overhead"))
    total = w + g + o + acts + transient + overhead
    worst = np.argmax(total, axis=1)
    peak = total[rows, worst] / GiB
    fits, at_risk = fit_verdicts(peak, usable_gib(cluster, p), p)
    out |= {f"memory.{k}": np.broadcast_to(x, (n, pp))[rows, worst] / GiB for k, x in
            (("weights", w), ("grads", g), ("optimizer", o), ("transient", transient))}
    out["memory.activations"] = acts[worst] / GiB
    out["memory.overhead"] = np.full(n, overhead / GiB)
    out |= {"step_time_s": step, "peak_memory_gib": peak, "stage_memory_gib": total / GiB,
            "fits": fits, "at_risk": at_risk, "microbatches": np.full(n, micro)}
    return out


def to_report(graph: LayerGraph, cluster: ClusterSpec, plan: Plan, work: Workload, r: dict[str, np.ndarray],
              i: int, recompute_flops: float, params: CostParams = DEFAULT_PARAMS,
              notes: list[str] | None = None) -> CostReport:
    """Row ``i`` of a finish() result as a CostReport (model FLOPs: the graph's forward +
    backward FLOPs x the global batch; recompute FLOPs counted in hfu only)."""
    gpu, n, step = cluster.gpu, plan.num_gpus, float(r["step_time_s"][i])
    peak = gpu.peak("bf16" if plan.precision in ("bf16", "fp8") else plan.precision)
    model_flops = (graph.fwd_flops + graph.bwd_flops) * work.global_batch
    rc_flops = recompute_flops * work.global_batch
    time = {k: float(r[f"time.{k}"][i]) for k in TIME_KEYS}
    exposed = {k: time[k] for k in EXPOSED_KEYS}
    memory = {k: float(r[f"memory.{k}"][i]) for k in MEMORY_KEYS}
    memory["total"] = sum(memory.values())
    return CostReport(
        step_time_s=step, tokens_per_s=work.tokens / step, tflops_per_gpu=model_flops / step / n / 1e12,
        mfu=model_flops / step / n / peak, hfu=(model_flops + rc_flops) / step / n / peak,
        peak_memory_gib=float(r["peak_memory_gib"][i]), fits=bool(r["fits"][i]), at_risk=bool(r["at_risk"][i]),
        usable_memory_gib=usable_gib(cluster, params), params=graph.params, num_gpus=n,
        microbatches=int(r["microbatches"][i]), memory=memory,
        memory_per_stage=[float(x) for x in r["stage_memory_gib"][i]], time=time,
        dominant=max(exposed, key=exposed.__getitem__), notes=list(notes or []))


def plan_sums(graph: LayerGraph, ga: GraphArrays, cluster: ClusterSpec, plan: Plan, lay: Layout,
              params: CostParams = DEFAULT_PARAMS, lc: LayerCosts | None = None) -> StageSums:
    """StageSums of ``plan`` on layout ``lay`` (layer costs computed unless given)."""
    if lc is None:
        lc = layer_costs(graph, ga, cluster, plan.tp, plan.micro_batch, plan.precision, plan.fused_loss, params)
    return stage_sums(graph, cluster, lc, lay, tp=plan.tp, cp=plan.cp, dp=plan.dp, recompute=plan.recompute,
                      recompute_layers=plan.recompute_layers, p2p_sharded=plan.p2p_sharded,
                      async_tp=plan.async_tp, params=params)


def finish_plan(cluster: ClusterSpec, work: Workload, plan: Plan, s: StageSums,
                params: CostParams = DEFAULT_PARAMS) -> dict[str, np.ndarray]:
    """finish() for one plan (a result of one row)."""
    return finish(cluster, work, s, tp=plan.tp, dp=plan.dp, cp=plan.cp, micro_batch=plan.micro_batch,
                  schedule=plan.schedule, v=plan.virtual_stages, zero=np.array([plan.zero]),
                  shard=np.array([plan.effective_shard]), offload_params=np.array([plan.offload_params]),
                  offload_optimizer=np.array([plan.offload_optimizer]), grad_sync=np.array([plan.grad_sync]),
                  params=params)


def estimate_graph(graph: LayerGraph, cluster: ClusterSpec, plan: Plan, workload: Workload,
                   params: CostParams | None = None) -> CostReport:
    """Predict step time, throughput and peak memory per GPU of ``plan`` on ``graph``.

    Raises MeshplanError (one line, with the fix) when the plan cannot run on the graph."""
    p = DEFAULT_PARAMS if params is None else params
    check_graph(graph, cluster, plan, workload)
    ga = graph_arrays(graph)
    lay = make_layout(graph.num_layers, plan.pp, plan.virtual_stages, plan.schedule, plan.stage_layers)
    s = plan_sums(graph, ga, cluster, plan, lay, p)
    r = finish_plan(cluster, workload, plan, s, p)
    return to_report(graph, cluster, plan, workload, r, 0, s.recompute_flops, p,
                     notes=report_notes(graph, ga, plan, lay))


def report_notes(graph: LayerGraph, ga: GraphArrays, plan: Plan, lay: Layout) -> list[str]:
    notes = [f"layer graph {graph.name}: {graph.num_layers} layers, {graph.sample_tokens} tokens per sample"]
    if plan.pp > 1:
        notes.append("layers per pipeline chunk: " + ":".join(map(str, lay.stage_layers)))
    if ga.defaults:
        notes.append("defaults used for missing layer extras: " + ", ".join(ga.defaults)
                     + " (see meshplan.cost.graph_params)")
    return notes
