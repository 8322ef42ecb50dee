"""What meshplan's own runtime runs: one table, shared by the search, `estimate` and the runtime.

A plan can satisfy every rule of `spec.constraints` (it is a well-formed plan that some
framework could run) and still be one that `meshplan train` refuses, or runs as something else
than planned, so that the estimate would not describe the run. Each such case is a `Rule`:

  kind "refused"  the runtime raises before it starts (wrong results on torch 2.13, or a
                  schedule torch.distributed.pipelining cannot build);
  kind "runs-as"  the runtime substitutes an equivalent that trains the same model but costs
                  other time or memory (it says so when it runs).

``targets`` lists the export targets (`meshplan export --to ...`) that run the plan as
planned: `meshplan plan` recommends only plans that violate no rule; with `--allow-export-only`
it also lists plans whose every violated rule has export targets, marked with the targets that
run all of them. A test exports one example plan per rule to each target and checks the
target expresses it (tests/unit/test_support.py).

The rules are scalar here (torch-free); ``search.constraints`` has a vectorised twin of each,
under the same name (a test checks they agree on random plans).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan
from meshplan.spec.transformer import as_graph

Model = LayerGraph | ModelSpec | None

TARGETS = ("torchtitan", "megatron", "deepspeed")
SPLIT_BACKWARD = ("zero-bubble", "zbv")


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str
    """'refused' or 'runs-as'."""
    targets: tuple[str, ...]
    """Export targets that run such a plan as planned (empty: none)."""
    why: Callable[[Plan, int, Model], str | None]
    """(plan, micro-batches per step, model or None) -> None, or the one-line reason (rules on
    the model fire only when it is given: kv heads under TP, sequence parallelism on a traced
    model; tied embeddings under a pipeline and tp not dividing the vocabulary run, since the
    runtime keeps the tied copies in sync and pads the vocabulary, docs/runtime.md)."""


def _graph(m: Model) -> LayerGraph | None:
    return None if m is None else as_graph(m, getattr(m, "seq_len", 0) or getattr(m, "sample_tokens", 1))


def sequence_parallel_runs(m: Model) -> bool:
    """Whether meshplan's runtime applies sequence parallelism to this model: to the transformers
    it builds from a description (runtime/parallelize.py), not to traced models (runtime/generic.py
    keeps their norms replicated). The search enumerates sequence-parallel plans only where it does."""
    return not is_traced(m)


def kv_replicated(p: Plan, micro: int, m: Model = None) -> str | None:
    g = _graph(m)
    if g is None or p.tp == 1:
        return None
    from meshplan.spec.capabilities import capabilities
    for _, kv in capabilities(g).heads:
        if kv % p.tp and p.tp % kv == 0:
            return (f"tp={p.tp} exceeds the {kv} kv heads: the runtime splits the kv heads over the TP ranks and does "
                    f"not replicate them; use tp <= {kv} (Megatron replicates them)")
    return None


def is_traced(m: Model) -> bool:
    """A model traced from a module (hf:, module:, a graph file): the runtime trains the module
    itself (runtime/generic.py), not a transformer it builds from a description."""
    g = _graph(m)
    return g is not None and g.model is None


def traced_sp(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.sequence_parallel and p.tp > 1 and not sequence_parallel_runs(m):
        return ("sequence_parallel=1 on a traced model: the runtime applies sequence parallelism to the transformers "
                "it builds (presets, model files) only; use sequence_parallel=0")
    return None


def traced_cp(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.cp > 1 and is_traced(m):
        return (f"cp={p.cp} on a traced model: the runtime runs context parallelism on the transformers it builds "
                "(presets, model files) only; use cp=1")
    return None


def traced_recompute(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.recompute in ("selective", "op") and is_traced(m):
        return (f"recompute={p.recompute} on a traced model: the runtime recomputes a traced model's blocks whole "
                "(it does not know which ops are the attention core); use recompute=full or none")
    return None


def traced_fp8(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.precision == "fp8" and is_traced(m):
        return "precision=fp8 on a traced model: the runtime's fp8 linears are the built transformers'; use bf16"
    return None


TRACED = ("sequence parallel on a traced model", "context parallel on a traced model",
          "selective recompute on a traced model", "fp8 on a traced model")
"""The rules that hold for traced models only: what runtime/generic.py does not run. (Expert
parallelism runs on them: runtime/expert_parallel.py splits the experts ingestion recognises, the
same ones whose count the LayerGraph carries, so ``spec.constraints``' "invalid expert parallel"
is the whole rule.)"""


def traced_refusal(plan: Plan) -> str | None:
    """The first TRACED rule ``plan`` breaks on any traced model (runtime/generic.py's refusal)."""
    for name in TRACED:
        why = RULES[name].why(plan, 1, _traced_probe())
        if why:
            return why
    return None


def zero_bubble_dp(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.schedule in SPLIT_BACKWARD and p.pp > 1 and p.dp * p.cp > 1:
        return (f"schedule={p.schedule} with dp*cp={p.dp * p.cp}: zero-bubble schedules with FSDP2/DDP give "
                "wrong gradients on torch 2.13; use 1f1b/interleaved-1f1b, or no data parallelism")
    return None


def few_microbatches(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.pp > 1 and p.schedule in ("interleaved-1f1b", *SPLIT_BACKWARD) and micro < p.pp:
        return (f"schedule={p.schedule} needs at least pp={p.pp} micro-batches per step, got {micro} "
                "(torch.distributed.pipelining); raise the global batch, lower micro_batch, or use 1f1b/gpipe")
    return None


def offload_optimizer_only(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.offload_optimizer and not p.offload_params:
        return ("offload_optimizer without offload_params: FSDP2 has no optimizer-only offload, so the runtime "
                "offloads the parameters too (other time and memory); DeepSpeed and Megatron offload the "
                "optimizer alone")
    return None


def fp8_tp(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.precision == "fp8" and p.tp > 1:
        return "precision=fp8 with tp > 1: the runtime's fp8 linears do not compose with its TP; it runs bf16"
    return None


def allreduce_sharded(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.grad_sync == "all-reduce" and p.zero >= 1:
        return "grad_sync=all-reduce with zero >= 1: the runtime (FSDP2) always reduce-scatters gradients"
    return None


def unfused_attention(p: Plan, micro: int, m: Model = None) -> str | None:
    if not p.flash_attention:
        return "flash_attention=0: the runtime always runs fused attention (SDPA)"
    return None


def fused_loss(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.fused_loss:
        return "fused_loss=1: the runtime computes an unfused cross-entropy (more memory at the loss)"
    return None


def p2p_sends(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.pp > 1 and p.tp > 1 and p.p2p_sharded != p.sequence_parallel:
        return (f"p2p_sharded={int(p.p2p_sharded)} with sequence_parallel={int(p.sequence_parallel)}: the "
                "runtime's pipeline sends carry the sequence-parallel shard exactly when sequence_parallel=1")
    return None


def async_tp_eager(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.async_tp and p.tp > 1 and not p.compile:
        return ("async_tp without compile: the overlap is an inductor pass, so the runtime compiles the blocks "
                "(compile=1 costs)")
    return None


def powersgd_fsdp(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.grad_compression == "powersgd" and not p.periodic and (p.offload_params or p.offload_optimizer):
        return ("grad_compression=powersgd with offload: on a GPU the runtime offloads through FSDP2, which "
                "takes no communication hook, so it reduces the gradients in bf16 (MixedPrecisionPolicy "
                "reduce_dtype); PowerSGD runs on DDP's all-reduce (zero=0 without offload)")
    return None


def periodic_ep(p: Plan, micro: int, m: Model = None) -> str | None:
    if p.periodic and p.ep > 1:
        return (f"grad_sync={p.grad_sync} with ep={p.ep}: the runtime's expert groups span all of dp x cp, not an "
                "inner group; use ep=1, or a synchronous grad_sync")
    return None


RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("zero-bubble schedule with data parallel gives wrong gradients in torch 2.13", "refused", (),
         zero_bubble_dp),
    Rule("too few micro-batches for the schedule", "refused", (), few_microbatches),
    Rule("fp8 with tensor parallel", "runs-as", ("torchtitan", "megatron"), fp8_tp),
    Rule("all-reduce gradient sync with sharding", "runs-as", ("deepspeed",), allreduce_sharded),
    Rule("unfused attention", "runs-as", ("megatron",), unfused_attention),
    Rule("fused loss", "runs-as", ("megatron",), fused_loss),
    Rule("pipeline sends not as planned", "runs-as", (), p2p_sends),
    Rule("async TP without compile", "runs-as", ("megatron",), async_tp_eager),
    Rule("optimizer offload without parameter offload", "runs-as", ("megatron", "deepspeed"),
         offload_optimizer_only),
    Rule("kv heads replicated under tensor parallel", "refused", ("megatron",), kv_replicated),
    Rule("sequence parallel on a traced model", "refused", (), traced_sp),
    Rule("context parallel on a traced model", "refused", (), traced_cp),
    Rule("selective recompute on a traced model", "refused", (), traced_recompute),
    Rule("fp8 on a traced model", "refused", (), traced_fp8),
    Rule("PowerSGD under FSDP2", "runs-as", (), powersgd_fsdp),
    Rule("periodic sync with expert parallel", "refused", (), periodic_ep),
)}
"""Every rule, in counting order (the search counts a rejected plan under its first)."""


@lru_cache(maxsize=1)
def _traced_probe() -> LayerGraph:
    """A traced graph with no layer of note: traced_refusal's model (the TRACED rules read only
    that the model is traced), built once, when first needed."""
    from meshplan.spec.graph import LayerOps, LayerSpec
    return LayerGraph(name="traced", source="module:any", sample_tokens=1, layers=(
        LayerSpec(name="l", block="b", params=1, fwd_flops=0, bwd_flops=0, saved_bytes=0, output_bytes=0),),
        ops={"b": LayerOps(params=1.0)})




def runtime_violations(plan: Plan, micro: int, model: Model = None) -> list[tuple[Rule, str]]:
    """Every (rule, reason) ``plan`` violates, in table order (with ``model``, also the rules on
    its shape)."""
    out = []
    for rule in RULES.values():
        reason = rule.why(plan, micro, model)
        if reason:
            out.append((rule, reason))
    return out


def export_targets(plan: Plan, micro: int, model: Model = None, cluster: object = None) -> tuple[str, ...] | None:
    """None when the runtime runs ``plan`` as planned; else the export targets that run it as
    planned: those common to every violated rule, less those whose exporter cannot express one of
    the plan's settings (spec.export_limits; none for a traced model, which no target takes); empty
    when none does."""
    bad = runtime_violations(plan, micro, model)
    if not bad:
        return None
    if is_traced(model):
        return ()
    from meshplan.spec.export_limits import Ctx, limits
    g = _graph(model)
    ctx = Ctx(num_layers=None if g is None else g.model.num_layers if g.model is not None else None, cluster=cluster)
    return tuple(t for t in TARGETS if all(t in rule.targets for rule, _ in bad) and not limits(t, plan, ctx))
