"""Human-readable renderings of reports."""
from __future__ import annotations

from typing import Any

from meshplan.cli.format import seconds, table
from meshplan.cost.report import CostReport
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.lengths import workload_text
from meshplan.spec.plan import Plan, Workload, microbatches
from meshplan.units import human_count

TIME_LABELS = {
    "compute": "compute (fwd+bwd)", "recompute": "recompute", "tp_comm": "TP/SP communication",
    "cp_comm": "CP communication", "ep_comm": "EP all-to-all", "dp_comm": "DP/FSDP communication",
    "pp_comm": "pipeline send/recv", "offload": "parameter offload (PCIe)", "bubble": "pipeline bubble",
    "optimizer": "optimizer step", "outer_sync": "outer sync (amortised)", "straggler": "straggler wait",
    "overhead": "fixed overhead", "imbalance": "length imbalance",
}


def model_line(model: LayerGraph, params: int) -> str:
    """The model in one line: a transformer description's shape, or the graph a trace gave."""
    m = model.model
    if m is not None:
        return f"model    {model.name}: {human_count(params)} parameters, {m.num_layers} layers, h={m.hidden_size}"
    return (f"model    {model.name} ({model.source}): {human_count(params)} parameters, {model.num_layers} layers "
            f"({len(model.distinct_blocks())} distinct), ingested layer graph")


def weak_link_lines(cluster: ClusterSpec, plan: Plan, r: CostReport, params: object = None) -> list[str]:
    """Time to target (with where its token factor comes from), the outer sync, the bytes across
    sites and the straggler wait, where they apply."""
    from meshplan.cost.convergence import token_efficiency
    from meshplan.cost.params import DEFAULT_PARAMS
    out = []
    p = params if params is not None else DEFAULT_PARAMS
    if plan.periodic or plan.grad_compression != "none" or r.token_factor != 1:
        basis = token_efficiency(getattr(p, "token_efficiency_file", "")).basis(
            plan.grad_sync, plan.sync_every, r.outer_workers, plan.grad_compression, plan.compression_rank)
        out.append(f"time to target {seconds(r.time_to_target_s)} per synchronous-equivalent step (tokens "
                   f"x{r.token_factor:.2f}: {basis})")
    if plan.periodic:
        out.append(f"outer sync     {seconds(r.outer_sync_s)} across {r.outer_workers} groups every "
                   f"{plan.sync_every} steps ({seconds(r.time.get('outer_sync', 0.0))} per step exposed)")
    if cluster.num_dcs > 1 or plan.mesh_order is not None:
        from meshplan.search.explain import axis_tiers
        from meshplan.spec.axes import DEFAULT_ORDER
        order = plan.mesh_order or DEFAULT_ORDER
        tiers = axis_tiers(cluster, plan)
        where = ", ".join(f"{a}={plan.dims.degree(a)} {tiers[a]}" for a in order if a in tiers)
        out.append(f"placement      {':'.join(order)}" + (" (default)" if plan.mesh_order is None else "")
                   + (f": {where}" if where else ""))
        from meshplan.search.explain import pipeline_site_line
        sites = pipeline_site_line(cluster, plan)
        if sites:
            out.append(f"               {sites}")
    if cluster.num_dcs > 1:
        out.append(f"cross-site     {r.cross_site_gb:,.2f} GB per step each way on the link between datacenters")
    if r.time.get("straggler", 0.0) > 0:
        out.append(f"stragglers     {seconds(r.time['straggler'])} per step waiting for the slowest rank "
                   f"(step_jitter {100 * cluster.step_jitter:g}%"
                   + (f"; {seconds(r.straggler_sync_s)} if it synced every step)" if plan.periodic else ")"))
    return out


def time_rows(time: dict[str, float], labels: dict[str, str], step_s: float) -> list[tuple[str, ...]]:
    """(label, exposed, share of the step, overlapped) of each term of ``time`` that has either."""
    rows = []
    for k, label in labels.items():
        v = time.get(k, 0.0)
        ov = time.get(f"{k}_overlapped", 0.0)
        if v or ov:
            rows.append((label, seconds(v), f"{100 * v / step_s:.1f}%", seconds(ov) if ov else ""))
    return rows


def estimate_text(model: LayerGraph, cluster: ClusterSpec, plan: Plan, work: Workload,
                  r: CostReport, params: object = None) -> str:
    unit = "tokens" if model.model is not None else f"tokens ({model.task} samples)"
    head = [
        model_line(model, r.params),
        f"cluster  {cluster.num_gpus} x {cluster.gpu.name} ({cluster.num_nodes} node(s) x {cluster.gpus_per_node})",
        f"plan     {plan.short()}",
        f"workload {workload_text(work, unit)} = {human_count(work.tokens)} tokens/step, "
        + (f"{r.microbatches} micro-batch(es) per replica" if plan.buckets is None else
         f"about {r.microbatches} micro-batch(es) per rank, varying by step (the plan's buckets)"),
        "",
        f"step time      {seconds(r.step_time_s)}   (90% band {seconds(r.step_time_s_low)} to "
        f"{seconds(r.step_time_s_high)}, from the cost model's out-of-sample errors)",
        f"throughput     {r.tokens_per_s:,.0f} tokens/s ({r.tokens_per_s / r.num_gpus:,.0f} per GPU)",
        f"model TFLOP/s  {r.tflops_per_gpu:.1f} per GPU   MFU {r.mfu * 100:.1f}%   HFU {r.hfu * 100:.1f}%   "
        f"(over {mfu_basis_words(cluster.gpu, plan.precision)})",
        f"peak memory    {r.peak_memory_gib:.1f} GiB per GPU of {cluster.gpu.memory_gib:.0f} "
        f"(usable {r.usable_memory_gib:.1f}; 95th percentile {r.peak_memory_gib_high:.1f}): {fit_word(r, params)}",
        f"               allocated {r.allocated_memory_gib:.1f} GiB (torch max_memory_allocated), reserved "
        f"{r.reserved_memory_gib:.1f} (max_memory_reserved); the peak adds the CUDA context and NCCL's buffers "
        f"(what nvidia-smi shows)",
        *host_lines(r, cluster),
        *weak_link_lines(cluster, plan, r, params),
        *runtime_lines(model, plan, work),
        "",
    ]
    trows = time_rows(r.time, TIME_LABELS, r.step_time_s)
    mrows = [(k, f"{v:.2f}") for k, v in r.memory.items()]
    out = head + ["time per step (exposed; overlapped shown apart)",
                  table(["term", "exposed", "share", "overlapped"], trows, "lrrr"), "",
                  "memory of the fullest GPU (GiB)", table(["part", "GiB"], mrows, "lr")]
    if len(r.memory_per_stage) > 1:
        out.append("per pipeline stage: " + ", ".join(f"{m:.1f}" for m in r.memory_per_stage) + " GiB")
    if not r.fits:
        out.append("\n" + fit_hint(plan, r))
    return "\n".join(out)


def mfu_basis_words(gpu: Any, precision: str) -> str:
    """Which peak MFU divides by, e.g. 'the bf16 peak, 989.4 TFLOP/s per GPU' (cost.batch.mfu_basis)."""
    from meshplan.cost.batch import mfu_basis
    basis = mfu_basis(precision)
    words = f"the {basis} peak, {gpu.peak(basis) / 1e12:,.1f} TFLOP/s per GPU"
    if precision == "fp32":
        words += ": CUDA cores, not tf32's tensor-core peak"
    elif precision == "fp8":
        words += ": fp8 plans against the 16-bit peak"
    return words


def fit_word(r: CostReport, params: object = None) -> str:
    """fits / at risk / DOES NOT FIT, with the headroom the memory model's error asks for."""
    if not r.fits:
        return f"DOES NOT FIT ({100 * r.oom_probability:.0f}% chance of running out of memory)"
    if r.at_risk:
        from meshplan.cost.params import DEFAULT_PARAMS
        from meshplan.cost.uncertainty import risk_reason
        why = risk_reason(r.peak_memory_gib, r.usable_memory_gib, r.oom_probability, params or DEFAULT_PARAMS)
        return f"fits, but AT RISK: {why}; recommended plans stay below {safe_peak(r, params):.1f} GiB"
    return f"fits ({100 * r.oom_probability:.1f}% chance of running out of memory)"


def safe_peak(r: CostReport, params: object = None) -> float:
    """The largest predicted peak that is recommended (cost.uncertainty.safe_peak_gib)."""
    from meshplan.cost.params import DEFAULT_PARAMS
    from meshplan.cost.uncertainty import safe_peak_gib
    return safe_peak_gib(r.usable_memory_gib, params or DEFAULT_PARAMS)


def host_lines(r: CostReport, cluster: object = None) -> list[str]:
    """The host memory an offload takes, when the plan offloads anything."""
    if r.host_memory_gib <= 0:
        return []
    have = r.host_memory_per_gpu_gib
    line = f"host memory    {r.host_memory_gib:.1f} GiB per GPU offloaded, of {have:.0f} per GPU"
    if cluster is not None and len(getattr(cluster, "pools", (cluster,))) == 1:
        line += (f" (a node's {cluster.host_memory_per_node_gib:,.0f} GiB over {cluster.gpus_per_node} GPUs: "
                 f"{cluster.host_memory_basis()})")
    return [line + ": " + ("fits" if r.host_fits else "DOES NOT FIT (offload less, or shard more: zero=3, more "
                                                     "GPUs; or a cluster file with the nodes' host_memory_gib)")]


def runtime_status(model: LayerGraph, plan: Plan, work: Workload) -> dict[str, object]:
    """Whether meshplan's runtime runs ``plan`` as planned (spec.support), for the JSON output."""
    from meshplan.spec.support import export_targets, runtime_violations
    spec = model
    micro = microbatches(work.global_batch, plan.dp, plan.micro_batch)
    bad = runtime_violations(plan, micro, spec)
    targets = export_targets(plan, micro, spec)
    issues = [{"rule": rule.name, "kind": rule.kind, "reason": why} for rule, why in bad]
    if work.varied and plan.buckets is None and plan.cp > 1 and plan.pp == 1:  # runtime.hetero.check_lengths
        d = work.lengths
        issues.append({"rule": "context parallelism on samples of several lengths", "kind": "refused",
                       "reason": f"cp={plan.cp} without buckets: meshplan train splits a micro-batch of its own "
                                 f"width over cp ranks only under a bucket plan (buckets={d.max_len if d else ''}"
                                 f"x{plan.micro_batch}cp{plan.cp} runs every sample over cp={plan.cp})"})
    return {"runs_as_planned": not issues, "issues": issues,
            "export_targets": None if targets is None else list(targets)}


def runtime_lines(model: LayerGraph, plan: Plan, work: Workload) -> list[str]:
    """'meshplan train' lines: refused or run as something else (spec.support), else nothing."""
    st = runtime_status(model, plan, work)
    if st["runs_as_planned"]:
        return []
    out = [f"runtime        meshplan train {'refuses' if i['kind'] == 'refused' else 'runs it otherwise'}: "
           f"{i['reason']}" for i in st["issues"]]  # type: ignore[union-attr]
    targets = st["export_targets"]
    out.append("               as planned by: " + (", ".join(targets) if targets else "no export target")  # type: ignore[arg-type]
               + " (meshplan export --to ...)")
    return out


def fit_hint(plan: Plan, r: CostReport) -> str:
    """What could make a plan that does not fit fit, biggest memory part first."""
    over = r.peak_memory_gib - r.usable_memory_gib
    tips = []
    acts = r.memory.get("activations", 0) + r.memory.get("transient", 0)
    states = r.memory.get("weights", 0) + r.memory.get("grads", 0) + r.memory.get("optimizer", 0)
    if acts >= states:
        if plan.recompute != "full":
            tips.append("recompute=full")
        if plan.micro_batch > 1:
            tips.append(f"micro_batch={plan.micro_batch // 2}")
        if not plan.fused_loss:
            tips.append("fused_loss=1")
    if plan.zero < 3:
        tips.append("zero=3")
    if not plan.offload_optimizer and plan.zero >= 1:
        tips.append("offload_optimizer=1")
    tips.append("more tp or pp, or more GPUs, or GPUs with more memory")
    why = (f"{over:.1f} GiB over the usable {r.usable_memory_gib:.1f} GiB" if over > 0 else
           f"{r.peak_memory_gib:.1f} GiB predicted of {r.usable_memory_gib:.1f} usable, but runs of this codebase "
           f"used more memory than the model predicted (95th percentile {r.peak_memory_gib_high:.1f} GiB), so it "
           f"more likely than not runs out ({100 * r.oom_probability:.0f}%)")
    return f"does not fit: {why}; try {', '.join(tips)} (or `meshplan plan` to search)"


# ---- meshplan presets ------------------------------------------------------------------------

def presets_data(kinds: list[str]) -> dict[str, dict[str, dict[str, object]]]:
    """Every preset of ``kinds`` by name: its full spec plus what the listing shows (parameter
    counts; the price a preset sets itself or inherits; GPU counts)."""
    from meshplan.spec.base import to_dict
    from meshplan.spec.io import cluster_from_dict, gpu_from_dict, load_preset_data, model_from_dict, preset_names
    out: dict[str, dict[str, dict[str, object]]] = {}
    for kind in kinds:
        out[kind] = {}
        for name in preset_names(kind):
            raw = load_preset_data(kind, name)
            meta = raw.get("meta") or {}
            where = f"preset {kind}/{name}"
            if kind == "models":
                m = model_from_dict(raw, where=where)
                entry = to_dict(m) | {"params": m.num_params()}
                if m.is_moe:
                    entry["active_params"] = m.num_active_params()
            elif kind == "gpus":
                g = gpu_from_dict(raw, where=where)
                entry = to_dict(g) | {"price_in_preset": "price_per_hour_usd" in raw}
            else:
                c = cluster_from_dict(raw, where=where)
                entry = to_dict(c) | {"num_gpus": c.num_gpus, "price_per_hour_usd": c.price_per_hour,
                                      "price_in_preset": c.price_per_gpu_hour_usd is not None}
            if meta:
                entry["meta"] = meta
            out[kind][name] = entry
    return out


def _tflops(peaks: dict[str, float], *dtypes: str) -> str:
    for d in dtypes:
        if d in peaks:
            return f"{peaks[d]:,.0f}" + ("" if d == dtypes[0] else f" ({d})")
    return "-"


def _link(t: dict[str, object] | None) -> str:
    if not t:
        return "-"
    kind = f"{t.get('kind')} " if t.get("kind") else ""
    return f"{kind}{t['bandwidth_gbps']:g} GB/s"


def presets_text(data: dict[str, dict[str, dict[str, object]]]) -> str:
    """The preset listing: one table per kind with the numbers that tell presets apart."""
    parts = []
    for kind, items in data.items():
        parts.append(f"{kind} ({len(items)}):")
        if not items:
            parts += ["  (none)", ""]
            continue
        rows: list[list[object]] = []
        if kind == "models":
            head = ["name", "params", "layers", "hidden", "heads", "kv heads", "seq len", "experts"]
            for name, m in items.items():
                experts = (f"{m['num_experts']} x top-{m['experts_per_token']} "
                           f"({human_count(m['active_params'])} active)" if m.get("active_params") else "-")
                rows.append([name, human_count(m["params"]), m["num_layers"], m["hidden_size"],
                             m["num_attention_heads"], m["num_kv_heads"] or m["num_attention_heads"],
                             m["seq_len"], experts])
            align = "lrrrrrrl"
        elif kind == "gpus":
            head = ["name", "HBM GiB", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB/s", "$/GPU-h", "GPUs/node",
                    "node link"]
            for name, g in items.items():
                peaks = g["peak_tflops"]
                rows.append([name, f"{g['memory_gib']:g}", _tflops(peaks, "bf16", "fp16"), _tflops(peaks, "fp8"),
                             f"{g['hbm_bandwidth_gbps']:,.0f}",
                             f"{g['price_per_hour_usd']:.2f}" if g["price_in_preset"] else "-",
                             g["gpus_per_node"], f"{g['intra_node_link']} {g['intra_node_bandwidth_gbps']:g} GB/s"])
            align = "lrrrrrrl"
        else:
            head = ["name", "GPU", "GPUs", "intra-node", "inter-node", "inter-DC", "$/GPU-h"]
            for name, c in items.items():
                price = f"{c['price_per_hour_usd']:.2f}" + ("" if c["price_in_preset"] else " (GPU's)")
                rows.append([name, c["gpu"]["name"], f"{c['num_gpus']} ({c['num_nodes']} x {c['gpus_per_node']})",
                             _link(c["intra_node"]), _link(c["inter_node"]),
                             _link(c.get("inter_dc"))
                             + (f", {c['nodes_per_dc']} nodes/DC" if c.get("inter_dc") else ""),
                             price])
            align = "llrlllr"
        parts += ["  " + line for line in table(head, rows, align).splitlines()] + [""]
    return "\n".join(parts).rstrip()


def pooled_memory_words(e: Any) -> str:
    """The memory verdict of a plan over pools (cost.pools.PooledEstimate): its tightest pool's,
    as `simulate` says it for one GPU type ("fits (0.0% chance of running out)")."""
    t = e.tightest
    where = (f"pool {t.name}: {t.peak_memory_gib:.1f} of {t.usable_memory_gib:.1f} GiB usable; allocated "
             f"{t.allocated_memory_gib:.1f}, reserved {t.reserved_memory_gib:.1f}")
    return f"{e.verdict} ({100 * t.oom_probability:.1f}% chance of running out; tightest {where})"


def pooled_runtime_lines(e: Any) -> list[str]:
    """'meshplan train' lines of a plan over pools: the runtime rules its pools' parts break (spec.support)."""
    where: dict[tuple[str, str], list[str]] = {}  # a rule that every pool's part breaks: said once
    for i in e.runtime:
        where.setdefault((i["kind"], i["reason"]), []).append(i["pool"])
    return [f"runtime      meshplan train {'refuses' if kind == 'refused' else 'runs it otherwise'} "
            f"(pool{'s' * (len(on) > 1)} {', '.join(on)}): {why}" for (kind, why), on in where.items()]


def pooled_estimate_text(e: Any, pc: Any, work: Workload | None = None) -> str:
    """`meshplan estimate` of a plan on a cluster of several GPU pools (cost.pools.PooledEstimate)."""
    from meshplan.units import human_seconds as hs
    lines = [f"plan         {e.plan.short()}",
             f"cluster      {pc.name}: {pc.describe()}",
             f"step time    {hs(e.step_time_s)}   ({e.tokens_per_s:,.0f} tokens/s, MFU {100 * e.mfu:.1f}% of "
             f"the GPUs' own peaks, ${e.usd_per_m_tokens:.3f} per M tokens)",
             f"fits         {'yes' if e.fits else 'NO'}: memory {pooled_memory_words(e)}"]
    if work is not None:
        lines.insert(2, f"workload     {workload_text(work)} = {work.tokens:,} tokens/step"
                     + ("; each pool's part is its expected step over the distribution (cost.lengths)"
                        if work.varied else ""))
    one = len(e.parts) == 1  # a plan on one pool: no other pool to wait for or to exchange with
    for p in e.parts:
        lines.append(f"pool {p.name:<8}{p.gpus} of {p.gpus_total} {p.gpu}: {p.role}")
        share = f"busy {100 * p.busy_fraction:.0f}% of the step on average"
        waits = "" if one and not p.idle_s else f", waits {hs(p.idle_s)} for the slowest pool"
        lines.append(f"{'':13}own part {hs(p.step_s)} ({share}){waits}, memory {p.peak_memory_gib:.1f} of "
                     f"{p.usable_memory_gib:.1f} GiB"
                     + ("" if p.fits else "  DOES NOT FIT"))
    if not (one and not e.cross_pool_s and not e.cross_pool_gb):
        lines.append(f"across pools {hs(e.cross_pool_s)} per step exposed over inter_pool (the 'across pools' term "
                     f"below); a GPU sends up to {e.cross_pool_gb:.2f} GB over it per step")
    if not (one and not e.imbalance_s):
        lines.append(f"imbalance    {hs(e.imbalance_s)} per step lost waiting for the slowest pool (GPU-weighted)")
    lines += pooled_runtime_lines(e)
    lines += [f"note         {n}" for n in e.notes]
    lines += pooled_time_lines(e)
    return "\n".join(lines)


POOLED_TIME_LABELS = {**TIME_LABELS, "cross_pool": "across pools (inter_pool)"}
"""The terms of a plan over pools (cost.pools.PooledEstimate.time): a plan's on one GPU type, and the exchange
across pools."""


def pooled_time_lines(e: Any) -> list[str]:
    """The step of a plan over pools by term, as `estimate` shows a plan on one GPU type: along the critical path
    (pool_dp: the slowest pool's own step; pool_pp: the pipeline's critical rank), the time across pools as its
    own term, and the pools' wait for the slowest apart."""
    if not e.time:
        return []
    pipeline = e.plan.pool_pp is not None or (e.plan.multi_pool and e.plan.pool_dp is None)  # (device order too)
    where = ("the pipeline's critical rank" if pipeline and len(e.parts) > 1 else
             f"the slowest pool ({max(e.parts, key=lambda p: p.step_s).name})" if len(e.parts) > 1 else "")
    rows = time_rows(e.time, POOLED_TIME_LABELS, e.step_time_s)
    out = ["", "time per step (exposed; overlapped shown apart)" + (f", along {where}" if where else ""),
           table(["term", "exposed", "share", "overlapped"], rows, "lrrr")]
    if e.time.get("pool_idle"):
        out.append(f"apart: the pools wait {seconds(e.time['pool_idle'])} per step for the slowest (GPU-weighted mean)")
    return out
