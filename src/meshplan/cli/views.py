"""Human-readable renderings of reports."""
from __future__ import annotations

from meshplan.cli.format import seconds, table
from meshplan.cost.report import CostReport
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload
from meshplan.units import human_count

TIME_LABELS = {
    "compute": "compute (fwd+bwd)", "recompute": "recompute", "tp_comm": "TP/SP communication",
    "cp_comm": "CP communication", "ep_comm": "EP all-to-all", "dp_comm": "DP/FSDP communication",
    "pp_comm": "pipeline send/recv", "offload": "parameter offload (PCIe)", "bubble": "pipeline bubble",
    "optimizer": "optimizer step",
    "overhead": "fixed overhead",
}


def model_line(model: ModelSpec | LayerGraph, params: int) -> str:
    if isinstance(model, LayerGraph):
        return (f"model    {model.name} ({model.source}): {human_count(params)} parameters, {model.num_layers} layers "
                f"({len(model.distinct_blocks())} distinct), ingested layer graph")
    return f"model    {model.name}: {human_count(params)} parameters, {model.num_layers} layers, h={model.hidden_size}"


def estimate_text(model: ModelSpec | LayerGraph, cluster: ClusterSpec, plan: Plan, work: Workload,
                  r: CostReport) -> str:
    unit = "tokens" if not isinstance(model, LayerGraph) else f"tokens ({model.task} samples)"
    head = [
        model_line(model, r.params),
        f"cluster  {cluster.num_gpus} x {cluster.gpu.name} ({cluster.num_nodes} node(s) x {cluster.gpus_per_node})",
        f"plan     {plan.short()}",
        f"workload global batch {work.global_batch} x {work.seq_len} {unit} = {human_count(work.tokens)} tokens/step, "
        f"{r.microbatches} micro-batch(es) per replica",
        "",
        f"step time      {seconds(r.step_time_s)}",
        f"throughput     {r.tokens_per_s:,.0f} tokens/s ({r.tokens_per_s / r.num_gpus:,.0f} per GPU)",
        f"model TFLOP/s  {r.tflops_per_gpu:.1f} per GPU   MFU {r.mfu * 100:.1f}%   HFU {r.hfu * 100:.1f}%",
        f"peak memory    {r.peak_memory_gib:.1f} GiB per GPU of {cluster.gpu.memory_gib:.0f} "
        f"(usable {r.usable_memory_gib:.1f}): {'fits' if r.fits else 'DOES NOT FIT'}",
        "",
    ]
    trows = []
    for k, label in TIME_LABELS.items():
        v = r.time.get(k, 0.0)
        ov = r.time.get(f"{k}_overlapped", 0.0)
        if v or ov:
            trows.append((label, seconds(v), f"{100 * v / r.step_time_s:.1f}%", seconds(ov) if ov else ""))
    mrows = [(k, f"{v:.2f}") for k, v in r.memory.items()]
    out = head + ["time per step (exposed; overlapped shown apart)",
                  table(["term", "exposed", "share", "overlapped"], trows, "lrrr"), "",
                  "memory of the fullest GPU (GiB)", table(["part", "GiB"], mrows, "lr")]
    if len(r.memory_per_stage) > 1:
        out.append("per pipeline stage: " + ", ".join(f"{m:.1f}" for m in r.memory_per_stage) + " GiB")
    if not r.fits:
        out.append("\n" + fit_hint(plan, r))
    return "\n".join(out)


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
    return (f"does not fit: {over:.1f} GiB over the usable {r.usable_memory_gib:.1f} GiB; "
            f"try {', '.join(tips)} (or `meshplan plan` to search)")
