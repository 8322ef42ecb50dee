"""Vectorised feasibility predicates: one boolean mask per name, True where a plan violates it.

The names and meanings are those of ``meshplan.spec.constraints.CHECKS`` (a test checks, on
random plans, that every mask equals the scalar predicate). A predicate added there without
a vectorised twin here is still applied, row by row (slow, logged once), so the search never
accepts a plan that `estimate` would refuse.

Search-only rules (not properties of the plan but of the runtime it will run on): the rules
of `meshplan.spec.support.RULES`, each with its vectorised twin here (``RUNTIME_CHECKS``, same
names), e.g. ZERO_BUBBLE_DP: zero-bubble schedules (zero-bubble, zbv) with data parallelism
(dp*cp > 1) give wrong gradients with no error on torch 2.13 (0.66-0.85 of the reference
gradient norm). With ``export_only`` a plan that breaks rules with export targets is kept (and
marked: `search.driver`) when one export target runs all of them as planned, and rejected as
NO_EXPORT_TARGET when none does (rule A only Megatron runs, rule B only DeepSpeed: neither runs
the plan as planned); a rule no export target runs still rejects under its own name.

Each rejected plan is counted once, under the first name it violates in the order of
`reason_names()` (the constraints, the runtime rules, NO_EXPORT_TARGET, COST_MODEL_REFUSED,
OUT_OF_MEMORY, HOST_OOM, AT_RISK).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from meshplan.search.columns import CATEGORIES, NONE_CODE, PlanColumns
from meshplan.spec.axes import AX
from meshplan.spec.capabilities import Capabilities, capabilities
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec import constraints as sc
from meshplan.spec import support as su
from meshplan.spec.constraints import CHECKS, Context
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Workload, microbatches
from meshplan.spec.support import RULES, TARGETS, is_traced, sequence_parallel_runs
from meshplan.spec.transformer import as_graph

log = logging.getLogger(__name__)

ZERO_BUBBLE_DP = "zero-bubble schedule with data parallel gives wrong gradients in torch 2.13"
OUT_OF_MEMORY = "out of memory"
HOST_OOM = "out of host memory"
"""Fits on the GPU, but the offload needs more host memory than a GPU has its share of
(ClusterSpec.host_memory_per_gpu_gib: its node's host memory over its GPUs)."""
AT_RISK = "at risk of running out of memory"
"""Fits by the estimate, but within the cost model's demonstrated memory error of the limit
(CostParams.memory_error): not recommended by default (``SearchSpace.headroom``)."""
LIKELY_OOM = "at risk: likely to run out of memory"
"""Within the usable memory by the estimate, but with a chance of running out of 1/2 or more (the
codebase's measured bias puts its peak over the limit): the verdict does-not-fit, which no flag
accepts; counted apart from OUT_OF_MEMORY (over the limit by the estimate) and AT_RISK (a flag
accepts it) so that neither label says something the example contradicts (issue 29 edge 5)."""
NO_EXPORT_TARGET = "no export target runs it as planned"
"""With ``export_only``: the plan breaks runtime rules that export targets run, but no one
target runs them all (spec.support.export_targets is empty)."""
VARIED_CP = "context parallelism on samples of several lengths without buckets"
"""A one-shape plan with cp > 1 and no pipeline under a length distribution, where the search
builds no bucket plans (``SearchSpace.buckets`` False, e.g. per GPU pool): meshplan's runtime
splits a micro-batch of its own width over cp ranks only under a bucket plan
(runtime.hetero.check_lengths). With the bucket stage on, such plans are its bases instead."""
COST_MODEL_REFUSED = "refused by the cost model"
"""A plan every constraint accepts but `estimate` raised on (should not happen; counted, with
the estimate's message as its example, rather than stopping the search)."""

Masker = Callable[[ModelSpec, ClusterSpec, Workload, PlanColumns], np.ndarray]


def _i64(cols: PlanColumns, f: str) -> np.ndarray:
    return cols[f].astype(np.int64)


def _code(field: str, value: str) -> int:
    return CATEGORIES[field].index(value)


def gpus_match(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return _i64(cols, AX.TP) * _i64(cols, AX.PP) * _i64(cols, AX.DP) * _i64(cols, AX.CP) != c.num_gpus


def _caps(m: LayerGraph | ModelSpec, w: Workload) -> Capabilities:
    return capabilities(as_graph(m, w.seq_len))


def tp_divides_heads(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    tp = _i64(cols, AX.TP)
    bad = np.zeros(len(tp), dtype=bool)
    for heads, kv in _caps(m, w).heads:
        bad |= (heads % tp != 0) | ((kv % tp != 0) & (tp % kv != 0))
    return bad


def tp_divides_widths(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    tp = _i64(cols, AX.TP)
    bad = np.zeros(len(tp), dtype=bool)
    for _, width in _caps(m, w).widths:
        bad |= width % tp != 0
    return bad


def tp_has_layers(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return (_i64(cols, AX.TP) > 1) & (not _caps(m, w).tp_layers)


def cp_has_attention(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return (_i64(cols, AX.CP) > 1) & (not _caps(m, w).attention)


def sp_has_activations(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return cols["sequence_parallel"] & (_i64(cols, AX.TP) > 1) & (not _caps(m, w).sequence_parallel)


def pipeline_allowed(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return (_i64(cols, AX.PP) > 1) & (_caps(m, w).pipeline is not None)


def tp_within_node(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    tp, g = _i64(cols, AX.TP), c.gpus_per_node
    return (g % tp != 0) & (tp % g != 0)  # groups tile nodes: a divisor of a node, or whole nodes


def _stage_stats(cols: PlanColumns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: (has explicit stage_layers, their sum, gcd of their entries)."""
    code = _i64(cols, "stage_layers")
    table = cols.stage_table
    sums = np.asarray([sum(s) for s in table] + [0], dtype=np.int64)
    gcds = np.asarray([int(np.gcd.reduce(np.asarray(s, dtype=np.int64))) if s else 0 for s in table] + [0],
                      dtype=np.int64)
    return code != NONE_CODE, sums[code], gcds[code]  # code -1 reads the sentinel entry


def layers_split(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    L = _caps(m, w).blocks
    v = _i64(cols, "virtual_stages")
    explicit, total, g = _stage_stats(cols)
    bad_explicit = (total != L) | ((v > 1) & (g % v != 0))
    chunks = _i64(cols, AX.PP) * v
    bad_even = (chunks > L) | (L % chunks != 0)
    refused = (_i64(cols, AX.PP) > 1) & (_caps(m, w).pipeline is not None)  # pipeline_allowed says why
    return np.where(explicit, bad_explicit, bad_even) & ~refused


def batch_divides(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return w.global_batch % (_i64(cols, AX.DP) * _i64(cols, "micro_batch")) != 0


def schedule_fits(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    s, v, pp = cols["schedule"], _i64(cols, "virtual_stages"), _i64(cols, AX.PP)
    inter, zbv = s == _code("schedule", "interleaved-1f1b"), s == _code("schedule", "zbv")
    micro = _micro(w, cols)
    return (((v > 1) & ~inter & ~zbv)
            | (inter & (pp > 1) & (v > 1) & (micro % pp != 0))
            | (zbv & (v != 2)))


def cp_divides_seq(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    cp = _i64(cols, AX.CP)
    return (cp > 1) & (w.seq_len % (2 * cp) != 0) & _caps(m, w).attention


def sp_needs_tp(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return cols["sequence_parallel"] & (cols[AX.TP] == 1)


def ep_valid(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    ep = _i64(cols, AX.EP)
    dpc = _i64(cols, AX.DP) * _i64(cols, AX.CP)
    experts = _caps(m, w).experts
    bad = np.zeros(len(ep), dtype=bool) if experts else np.ones(len(ep), dtype=bool)
    for e in experts:
        bad |= (e % ep != 0)
    bad |= (dpc % ep != 0) & bool(experts)
    return (ep != 1) & bad


def hybrid_valid(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    sg = _i64(cols, "shard_group")
    dpc = _i64(cols, AX.DP) * _i64(cols, AX.CP)
    on = sg != 0
    return on & ((cols["zero"] == 0) | (dpc % np.where(on, sg, 1) != 0))


def offload_valid(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    z = cols["zero"]
    return ((cols["offload_params"] & (z != 3))
            | (cols["offload_optimizer"] & (z == 0) & (cols[AX.DP] > 1))
            | (cols["offload_optimizer"] & (w.optimizer in sc.CUDA_ONLY_OPTIMIZERS)))


def zero2_pipeline(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return (cols["zero"] == 2) & (_i64(cols, AX.PP) > 1)


def recompute_layers_valid(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    rl = _i64(cols, "recompute_layers")
    code = _i64(cols, "stage_layers")
    most_table = np.asarray([max(s) if s else 0 for s in cols.stage_table] + [0], dtype=np.int64)
    even = -(-_caps(m, w).blocks // np.maximum(1, _i64(cols, AX.PP)))
    most = np.where(code != NONE_CODE, most_table[code], even)
    return (rl >= 0) & (rl > most)


def precision_supported(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    fp8 = cols["precision"] == _code("precision", "fp8")
    return fp8 & ("fp8" not in c.gpu.peak_tflops)


def sync_valid(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    from meshplan.spec.sync import inner_dp, is_periodic
    gs, comp = np.asarray(cols["grad_sync"]), np.asarray(cols["grad_compression"])
    periodic = is_periodic(gs)
    dp = _i64(cols, AX.DP)
    bad = (comp == "powersgd") & ((cols["zero"] != 0) | periodic | (gs == "reduce-scatter"))
    n_in = inner_dp(dp, _i64(cols, AX.TP), _i64(cols, AX.CP), np.asarray(cols["sync_scope"]), c)
    wrong = ((dp < 2) | (_i64(cols, "shard_group") != 0)
             | ((np.asarray(cols["sync_scope"]) == "dc") & (c.num_dcs < 2))
             | (dp % n_in != 0) | (dp // n_in < 2)
             | (_i64(cols, "sync_overlap") >= _i64(cols, "sync_every")))
    return bad | (periodic & wrong)


def site_order_valid(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    from meshplan.spec.axes import AXES, ParallelDims, parse_order, parse_sites, site_order_fault
    from meshplan.cost.comm import any_text, text_codes
    site = cols.get("site_order")
    bad = np.zeros(len(cols[AX.TP]), dtype=bool)
    if site is None or not any_text(site):
        return bad  # (the common case: no row has a site order)
    idx = np.flatnonzero(np.asarray(site) != "")
    s_vals, s_inv = text_codes(np.asarray(site)[idx])
    o_vals, o_inv = text_codes(np.asarray(cols["mesh_order"], dtype=str)[idx])
    code = s_inv * len(o_vals) + o_inv
    for a in AXES:  # one int64 per row where the degrees allow (a 1-D unique is fast), else row-wise
        code = code * 4096 + _i64(cols, a)[idx]
    if max(int(_i64(cols, a)[idx].max()) for a in AXES) < 4096 and len(s_vals) * len(o_vals) < 2**14:
        _, first, inv = np.unique(code, return_index=True, return_inverse=True)
        uniq = np.column_stack([s_inv[first], o_inv[first]] + [_i64(cols, a)[idx][first] for a in AXES])
    else:
        uniq, inv = np.unique(np.column_stack([s_inv, o_inv] + [_i64(cols, a)[idx] for a in AXES]), axis=0,
                              return_inverse=True)  # the distinct (site order, mesh order, mesh)
    fault = np.asarray([site_order_fault(ParallelDims(**{a: int(x) for a, x in zip(AXES, u[2:])},
                                                      order=parse_order(str(o_vals[u[1]])) or AXES,
                                                      sites=parse_sites(str(s_vals[u[0]]))),
                                         getattr(c, "num_dcs", 1)) is not None for u in uniq])
    bad[idx] = fault[inv.reshape(-1)]
    return bad


# ---- the runtime's rules (spec.support.RULES), vectorised ---------------------------------------

def _split_backward(cols: PlanColumns) -> np.ndarray:
    s = cols["schedule"]
    return (s == _code("schedule", "zero-bubble")) | (s == _code("schedule", "zbv"))


def _micro(w: Workload, cols: PlanColumns) -> np.ndarray:
    return microbatches(w.global_batch, _i64(cols, AX.DP), _i64(cols, "micro_batch"))


def zero_bubble_dp(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return _split_backward(cols) & (_i64(cols, AX.PP) > 1) & (_i64(cols, AX.DP) * _i64(cols, AX.CP) > 1)


def few_microbatches(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    pp = _i64(cols, AX.PP)
    sched = _split_backward(cols) | (cols["schedule"] == _code("schedule", "interleaved-1f1b"))
    return (pp > 1) & sched & (_micro(w, cols) < pp)


def offload_optimizer_only(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return cols["offload_optimizer"] & ~cols["offload_params"]


def fp8_tp(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return (cols["precision"] == _code("precision", "fp8")) & (_i64(cols, AX.TP) > 1)


def allreduce_sharded(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return (np.asarray(cols["grad_sync"]) == "all-reduce") & (cols["zero"] >= 1)


def unfused_attention(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return ~np.asarray(cols["flash_attention"], dtype=bool)


def fused_loss(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return np.asarray(cols["fused_loss"], dtype=bool)


def p2p_sends(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    sharded, sp = np.asarray(cols["p2p_sharded"], dtype=bool), np.asarray(cols["sequence_parallel"], dtype=bool)
    return (_i64(cols, AX.PP) > 1) & (_i64(cols, AX.TP) > 1) & (sharded != sp)


def async_tp_eager(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return np.asarray(cols["async_tp"], dtype=bool) & (_i64(cols, AX.TP) > 1) & ~np.asarray(cols["compile"], dtype=bool)


def kv_replicated(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    tp = _i64(cols, AX.TP)
    bad = np.zeros(len(tp), dtype=bool)
    for _, kv in _caps(m, w).heads:
        bad |= (tp > 1) & (kv % tp != 0) & (tp % kv == 0)
    return bad


def _is_traced(m: LayerGraph | ModelSpec, w: Workload) -> bool:
    return is_traced(as_graph(m, w.seq_len))


def traced_cp(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return (_i64(cols, AX.CP) > 1) & _is_traced(m, w)


def traced_recompute(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    r = cols["recompute"]
    return ((r == _code("recompute", "selective")) | (r == _code("recompute", "op"))) & _is_traced(m, w)


def traced_fp8(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return (cols["precision"] == _code("precision", "fp8")) & _is_traced(m, w)


def traced_sp(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    return (np.asarray(cols["sequence_parallel"], dtype=bool) & (_i64(cols, AX.TP) > 1)
            & (not sequence_parallel_runs(as_graph(m, w.seq_len))))


def powersgd_fsdp(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    from meshplan.spec.sync import is_periodic
    offload = np.asarray(cols["offload_params"], dtype=bool) | np.asarray(cols["offload_optimizer"], dtype=bool)
    return ((np.asarray(cols["grad_compression"]) == "powersgd") & ~is_periodic(np.asarray(cols["grad_sync"]))
            & offload)


def periodic_ep(m: ModelSpec, c: ClusterSpec, w: Workload, cols: PlanColumns) -> np.ndarray:
    from meshplan.spec.sync import is_periodic
    return is_periodic(np.asarray(cols["grad_sync"])) & (_i64(cols, AX.EP) > 1)


TWINS: dict[Callable[..., str | None], Masker] = {
    # spec.constraints.CHECKS: the scalar predicate (a Context -> its reason, or None) -> its vectorised twin
    sc.gpus_match: gpus_match,
    sc.tp_divides_heads: tp_divides_heads,
    sc.tp_divides_widths: tp_divides_widths,
    sc.tp_has_layers: tp_has_layers,
    sc.tp_within_node: tp_within_node,
    sc.pipeline_allowed: pipeline_allowed,
    sc.layers_split: layers_split,
    sc.batch_divides: batch_divides,
    sc.schedule_fits: schedule_fits,
    sc.cp_has_attention: cp_has_attention,
    sc.cp_divides_seq: cp_divides_seq,
    sc.sp_needs_tp: sp_needs_tp,
    sc.sp_has_activations: sp_has_activations,
    sc.ep_valid: ep_valid,
    sc.hybrid_valid: hybrid_valid,
    sc.offload_valid: offload_valid,
    sc.zero2_pipeline: zero2_pipeline,
    sc.recompute_layers_valid: recompute_layers_valid,
    sc.precision_supported: precision_supported,
    sc.sync_valid: sync_valid,
    sc.site_order_valid: site_order_valid,
    # spec.support.RULES: the runtime's rule (Rule.why: plan, micro-batches, model -> its reason) -> its twin
    su.zero_bubble_dp: zero_bubble_dp,
    su.few_microbatches: few_microbatches,
    su.fp8_tp: fp8_tp,
    su.allreduce_sharded: allreduce_sharded,
    su.unfused_attention: unfused_attention,
    su.fused_loss: fused_loss,
    su.p2p_sends: p2p_sends,
    su.async_tp_eager: async_tp_eager,
    su.offload_optimizer_only: offload_optimizer_only,
    su.kv_replicated: kv_replicated,
    su.traced_sp: traced_sp,
    su.traced_cp: traced_cp,
    su.traced_recompute: traced_recompute,
    su.traced_fp8: traced_fp8,
    su.powersgd_fsdp: powersgd_fsdp,
    su.periodic_ep: periodic_ep,
}
"""The one table pairing each rule's scalar check with its vectorised twin (True where a plan breaks
it). The rules' names, order and reasons are the spec tables' (spec.constraints.CHECKS and
spec.support.RULES); the masks below are generated from them through this table."""
VECTOR_CHECKS: dict[str, Masker] = {name: TWINS[fn] for name, fn in CHECKS.items() if fn in TWINS}
RUNTIME_CHECKS: dict[str, Masker] = {name: TWINS[rule.why] for name, rule in RULES.items()}
SEARCH_CHECKS = RUNTIME_CHECKS  # the search-only rules are the runtime's


def reason_names() -> list[str]:
    """Every rejection reason, in counting order."""
    return list(CHECKS) + list(RUNTIME_CHECKS) + [NO_EXPORT_TARGET, VARIED_CP, COST_MODEL_REFUSED, OUT_OF_MEMORY,
                                                  HOST_OOM, AT_RISK, LIKELY_OOM]


def _scalar_mask(name: str, model: ModelSpec, cluster: ClusterSpec, work: Workload,
                 cols: PlanColumns) -> np.ndarray:
    log.warning("constraint %r has no vectorised form in meshplan.search.constraints; "
                "checking it plan by plan", name)
    fn = CHECKS[name]
    return np.asarray([fn(Context(model, cluster, p, work)) is not None for p in cols.plans()],
                      dtype=bool)


def violation_masks(model: ModelSpec, cluster: ClusterSpec, work: Workload, cols: PlanColumns,
                    *, search_rules: bool = True, export_only: bool = False) -> dict[str, np.ndarray]:
    """{name: mask of rows violating it} for every constraint of CHECKS (and, with
    ``search_rules``, the runtime's rules and NO_EXPORT_TARGET, in `reason_names()` order).

    With ``export_only``, the masks of the rules that have export targets are all False, and a
    row that breaks any of them is NO_EXPORT_TARGET unless one target runs every rule it breaks
    (the row is then kept, to be marked); the rules no target runs keep their masks. A row is
    thus rejected by the runtime's rules exactly when spec.support.export_targets is () for it.
    Without ``export_only``, NO_EXPORT_TARGET is all False."""
    out = {}
    for name in CHECKS:
        fn = VECTOR_CHECKS.get(name)
        out[name] = (fn(model, cluster, work, cols) if fn is not None
                     else _scalar_mask(name, model, cluster, work, cols))
    if search_rules:
        n = cols.num_rows
        broken = np.zeros(n, dtype=bool)  # some rule with export targets is broken
        untargeted = np.zeros(n, dtype=bool)  # some rule no target runs is broken (rejected under its name)
        runs = {t: np.ones(n, dtype=bool) for t in TARGETS}  # target t runs every broken rule
        for name, fn in RUNTIME_CHECKS.items():
            mask = np.asarray(fn(model, cluster, work, cols), dtype=bool)
            if export_only and not RULES[name].targets:
                untargeted |= mask
            if export_only and RULES[name].targets:
                broken |= mask
                for t in TARGETS:
                    if t not in RULES[name].targets:
                        runs[t] &= ~mask
                mask = np.zeros(n, dtype=bool)
            out[name] = mask
        if export_only and broken.any():  # each target's own limits (spec.export_limits), on the rows kept for it
            if is_traced(model):
                runs = {t: r & untargeted for t, r in runs.items()}
            else:
                from meshplan.spec.export_limits import Ctx, masks as limit_masks
                g = as_graph(model, work.seq_len)
                ctx = Ctx(num_layers=g.model.num_layers if g.model is not None else None, cluster=cluster)
                cand = np.zeros(n, dtype=bool)
                for t in TARGETS:
                    cand |= runs[t] & broken & ~untargeted
                hit = limit_masks(cols, ctx, np.nonzero(cand)[0])
                for t in TARGETS:
                    runs[t] &= ~hit.get(t, np.zeros(n, dtype=bool))
        some_target = np.zeros(n, dtype=bool)
        for t in TARGETS:
            some_target |= runs[t]
        out[NO_EXPORT_TARGET] = broken & ~some_target
    return out


def first_violation(masks: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Per row, the index (into the order of ``masks``) of the first violated rule; -1 if none."""
    first = np.full(n, -1, dtype=np.int32)
    for i, mask in enumerate(masks.values()):
        first[(first < 0) & mask] = i
    return first
