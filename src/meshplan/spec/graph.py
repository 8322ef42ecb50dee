"""LayerGraph: any model as a sequence of layers with measured costs (issue 5).

This is the contract between ``ingest/`` (which builds it from a torch.nn.Module or a Hugging Face
config on the meta device) and ``cost/``/``search/`` (which plan on it without torch). Pure Python.

Units and conventions
- A *sample* is one row of the micro-batch: one sequence for a language model, one image for a
  vision model, one (source, target) pair for an encoder-decoder. Per-sample quantities are traced
  at ``sample_tokens`` tokens per sample and scale linearly with the micro-batch.
- FLOPs are floating point operations (a multiply-add is 2), as counted by
  ``torch.utils.flop_counter.FlopCounterMode`` plus meshplan's formulas for ops it lacks.
- Bytes are at ``trace_dtype`` (the dtype activations had when traced, usually float32 or
  bfloat16); the cost model rescales floating activations to the plan's precision.
- ``layers`` is the top-level execution order. A pipeline stage is a contiguous run of layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from meshplan.errors import MeshplanError
from meshplan.spec.base import choice

LAYER_KINDS = ("embedding", "block", "head", "other")
TP_STYLES = ("none", "megatron")
"""none: the layer cannot be tensor-parallel (replicated under TP);
megatron: column-parallel then row-parallel linear pairs (attention: q/k/v -> o; MLP: up/gate -> down),
one all-reduce (or reduce-scatter + all-gather with SP) of the layer's output per pair, forward and backward."""
TRACE_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One top-level layer (a transformer block, an embedding, a conv stage, a head ...)."""

    name: str
    """Module path, e.g. ``model.layers.0``."""
    kind: str = "block"
    """embedding | block | head | other (embedding/head are pinned to the first/last stage)."""
    block: str
    """Id of the distinct layer type; repeated layers share it (cost and search work once per id)."""
    params: int
    """Parameter elements owned by this layer (a tied weight counted once, at its first owner)."""
    fwd_flops: float
    """Forward FLOPs per sample."""
    bwd_flops: float
    """Backward FLOPs per sample (input gradients + weight gradients)."""
    saved_bytes: float
    """Bytes of activations the forward keeps for backward, per sample, at trace_dtype."""
    output_bytes: float
    """Bytes of the layer's own output per sample (the hidden state; the logits for the last layer):
    the size of its TP all-reduces and of the loss input. A pipeline cut after the layer sends
    ``extra['send_bytes']`` when ingestion recorded it (side inputs such as rotary tables or an
    encoder output travel too), else this."""
    tp_style: str = "none"
    """How tensor parallel splits this layer: see TP_STYLES."""
    tp_fraction: float = 0.0
    """Fraction of the layer's FLOPs and parameters that TP divides (the rest is replicated)."""
    tp_max: int = 1
    """Largest TP degree the layer's shapes allow (TP degrees must divide it)."""
    tp_allreduces: int = 0
    """Column->row pairs (one all-reduce of output_bytes each, forward and backward again)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Optional named details from ingestion (e.g. attention FLOPs, memory-bound bytes)."""

    def __post_init__(self) -> None:
        choice(f"layer {self.name}: kind", self.kind, LAYER_KINDS)
        choice(f"layer {self.name}: tp_style", self.tp_style, TP_STYLES)
        for f in ("params", "fwd_flops", "bwd_flops", "saved_bytes", "output_bytes", "tp_allreduces"):
            if getattr(self, f) < 0:
                raise MeshplanError(f"layer {self.name}: {f} must be >= 0, got {getattr(self, f)}")
        if not 0.0 <= self.tp_fraction <= 1.0:
            raise MeshplanError(f"layer {self.name}: tp_fraction must be in [0, 1], got {self.tp_fraction}")
        if self.tp_max < 1:
            raise MeshplanError(f"layer {self.name}: tp_max must be >= 1, got {self.tp_max}")


@dataclass(frozen=True, kw_only=True)
class LayerGraph:
    """A model as measured by ingestion: what cost/search need, no torch objects."""

    name: str
    """A short name for reports (e.g. the HF model_type or the factory name)."""
    source: str
    """How to rebuild the real module: ``hf:PATH`` or ``module:pkg.mod:factory`` (used by the runtime)."""
    task: str = "causal-lm"
    """causal-lm | seq2seq-lm | masked-lm | classification: what the loss is (runtime and reports)."""
    sample_tokens: int
    """Tokens per sample at trace time (sequence length; patches+1 for a ViT; 1 for a plain CNN)."""
    trace_dtype: str = "float32"
    layers: tuple[LayerSpec, ...]
    tied_params: int = 0
    """Elements of parameters shared between the first and last stage (tied embeddings): their
    gradients are all-reduced across those stages when pp > 1."""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        choice("graph trace_dtype", self.trace_dtype, tuple(TRACE_DTYPES))
        if not self.layers:
            raise MeshplanError(f"graph {self.name}: no layers (ingestion found no parameters or ops)")
        if self.sample_tokens < 1:
            raise MeshplanError(f"graph {self.name}: sample_tokens must be >= 1")

    # -- derived -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def fwd_flops(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def bwd_flops(self) -> float:
        return sum(layer.bwd_flops for layer in self.layers)

    @property
    def dtype_bytes(self) -> int:
        return TRACE_DTYPES[self.trace_dtype]

    def distinct_blocks(self) -> dict[str, list[int]]:
        """Block id -> indices of the layers that share it, in order of first appearance."""
        out: dict[str, list[int]] = {}
        for i, layer in enumerate(self.layers):
            out.setdefault(layer.block, []).append(i)
        return out

    def tp_degrees(self, limit: int) -> list[int]:
        """TP degrees (<= limit) every TP-able layer allows; 1 always."""
        caps = [layer.tp_max for layer in self.layers if layer.tp_style != "none" and layer.tp_fraction > 0]
        if not caps:
            return [1]
        return [d for d in range(1, limit + 1) if all(c % d == 0 for c in caps)]
