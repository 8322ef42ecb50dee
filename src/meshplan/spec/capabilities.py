"""What a model's layers allow: the one table of model-dependent plan rules.

Every model is a LayerGraph (spec.graph); what parallelism it admits follows from its layers'
LayerOps, whatever the model is (a generated transformer, a traced Hugging Face model, a CNN):

  rule                                 the plan needs
  -----------------------------------  -----------------------------------------------------------
  tp does not divide heads             tp divides every attention's heads, and its kv heads (or tp
                                       is a multiple of them: kv heads are then replicated)
  tp does not divide layer widths      tp divides every width a layer names (LayerOps.tp_divides:
                                       an MLP width, a split GEMM's features)
  no layer for tensor parallel         tp > 1 only with a layer that has column/row GEMMs
  no attention for context parallel    cp > 1 only with attention layers
  no replicated activations for SP     sequence_parallel only with a replicated hidden state
                                       between tensor-parallel GEMMs (norms, residuals)
  invalid expert parallel              ep > 1 only with MoE layers, dividing their experts, and dp*cp
  layers do not split into stages      pp x virtual_stages chunks of the model's blocks (the
                                       layers of kind block; the others go with their neighbours)
  recompute_layers beyond the stage    at most the blocks of the largest stage
  model cannot be pipelined            pp > 1 unless ingestion found why the forward cannot be cut
                                       (LayerGraph notes starting 'no pipeline:')

spec.constraints applies these rules (with the model-independent ones) to `estimate`, the
search applies their vectorised twins (search.constraints), and the runtime refuses a plan with
the same reason before it starts (runtime.mesh.check_supported calls spec.constraints).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.spec.graph import LayerGraph, derived, layer_ops

MODEL_CHECKS = ("tp does not divide heads", "tp does not divide layer widths", "no layer for tensor parallel",
                "model cannot be pipelined", "no replicated activations for sequence parallel",
                "no attention for context parallel", "invalid expert parallel")
"""The spec.constraints rules of this table that depend on the model (the others, stages and
recompute_layers against the blocks included, read the plan and the batch as well)."""

PIPELINE_NOTE = "no pipeline:"
"""A LayerGraph note starting with this says why the model's forward cannot be cut into
pipeline stages (e.g. an encoder-decoder whose decoder reads the encoder output everywhere)."""


@dataclass(frozen=True)
class Capabilities:
    """What parallelism a model's layers admit (see the module docstring)."""

    blocks: int
    """Layers of kind block: what pipeline stages count."""
    heads: tuple[tuple[int, int], ...]
    """Distinct (heads, kv_heads) of the attention layers."""
    widths: tuple[tuple[str, int], ...]
    """Distinct (name, width) every TP degree must divide."""
    tp_layers: bool
    """Some layer has column/row GEMMs."""
    attention: bool
    sequence_parallel: bool
    """Some TP-split layer has a replicated hidden state (saved or memory-bound) to split."""
    experts: tuple[int, ...]
    """Distinct expert counts of the MoE layers (empty: dense)."""
    pipeline: str | None
    """Why the model cannot be pipelined (None: it can)."""

    def tp_ok(self, tp: int) -> bool:
        return not (self.heads_reason(tp) or self.width_reason(tp)) and (tp == 1 or self.tp_layers)

    def heads_reason(self, tp: int) -> str | None:
        for heads, kv in self.heads:
            if heads % tp or kv % tp and tp % kv:
                return (f"tp={tp} does not divide the {heads} attention heads ({kv} kv heads); "
                        "use a tp that divides both")
        return None

    def width_reason(self, tp: int) -> str | None:
        for name, w in self.widths:
            if w % tp:
                return f"tp={tp} does not divide {name}={w}"
        return None

    @property
    def max_experts(self) -> int:
        return max(self.experts, default=0)


def capabilities(graph: LayerGraph) -> Capabilities:
    """The graph's Capabilities (computed once per graph object)."""
    return derived(graph, "capabilities", _capabilities)


def _capabilities(graph: LayerGraph) -> Capabilities:
    ops = layer_ops(graph)
    used = [ops[b] for b in dict.fromkeys(layer.block for layer in graph.layers)]
    heads = sorted({(o.attention.heads, o.attention.kv_heads) for o in used if o.attention is not None})
    widths = sorted({(k, int(v)) for o in used for k, v in o.tp_divides.items()})
    sp = any(o.splits and (o.saved_rep > 0 or o.ew_rep[0] > 0 or o.ew_rep[1] > 0) for o in used)
    note = next((n[len(PIPELINE_NOTE):].strip() for n in graph.notes if n.startswith(PIPELINE_NOTE)), None)
    return Capabilities(
        blocks=sum(1 for layer in graph.layers if layer.kind == "block"), heads=tuple(heads), widths=tuple(widths),
        tp_layers=any(o.splits for o in used), attention=any(o.attention is not None for o in used),
        sequence_parallel=sp, experts=tuple(sorted({o.experts for o in used if o.experts})), pipeline=note)
