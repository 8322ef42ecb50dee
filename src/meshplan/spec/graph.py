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

import math
from dataclasses import dataclass, field
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.spec.base import choice
from meshplan.spec.model import ModelSpec

LAYER_KINDS = ("embedding", "block", "head", "other")
TP_STYLES = ("none", "megatron")
"""none: the layer cannot be tensor-parallel (replicated under TP);
megatron: column-parallel then row-parallel linear pairs (attention: q/k/v -> o; MLP: up/gate -> down),
one all-reduce (or reduce-scatter + all-gather with SP) of the layer's output per pair, forward and backward."""
TRACE_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
GEMM_SPLITS = ("column", "row", "none")


# ---- the op-level description of one distinct layer (what the cost model prices) -------------

@dataclass(frozen=True, kw_only=True)
class Gemm:
    """One matrix multiply of a layer, per token: (m x tokens) x k @ k x n."""

    n: float
    """Output width (features)."""
    k: float
    """Reduction width (input features; a convolution's in_channels x kernel area / groups)."""
    m: float = 1.0
    """GEMM rows per token (1 for a linear layer; a convolution: its output positions per token)."""
    split: str = "none"
    """How tensor parallelism splits it: column (n / tp), row (k / tp) or none (every TP rank runs
    it whole; its model FLOPs count once per TP group)."""
    expert: bool = False
    """A GEMM of every expert of a MoE layer: it runs on the tokens routed to each expert, and
    expert parallelism divides the experts (LayerOps.experts, top_k)."""

    def __post_init__(self) -> None:
        choice("gemm split", self.split, GEMM_SPLITS)
        for f in ("n", "k", "m"):
            if not getattr(self, f) >= 0:
                raise MeshplanError(f"gemm: {f} must be >= 0, got {getattr(self, f)}")


@dataclass(frozen=True, kw_only=True)
class Attention:
    """The attention core (scores, softmax, weighted sum) of a layer, over the sample's tokens."""

    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = True
    dropout: bool | None = None
    """Dropout on the attention probabilities (an unfused core then keeps its 1-byte mask and the
    dropped probabilities); None: the kernel's convention (cost.activations.attention_saved_bytes:
    none for eager, as Hugging Face's Llama family; with it for Megatron's fused softmax)."""
    softmax_fp32: bool = True
    """An unfused (eager) core takes its softmax in float32 (Llama, Mistral, Qwen2, Mixtral) rather
    than in the activations' dtype (GPT-2): 4 or 2 bytes per score kept."""

    q_dim = property(lambda self: self.heads * self.head_dim, doc="Width of all query heads together.")
    kv_dim = property(lambda self: self.kv_heads * self.head_dim, doc="Width of the key (or value) heads.")


Pair = tuple[float, float]
"""(fused, eager): with torch.compile / fused kernels, and as separate PyTorch ops."""


@dataclass(frozen=True, kw_only=True)
class LayerOps:
    """What one distinct layer computes, stores and sends, per token of a micro-batch, with
    activations at 2 bytes (bf16/fp16; the cost model doubles them for fp32). The cost model
    (cost.layer) prices every layer of every model from these fields alone.

    Tensor parallelism splits the column/row GEMMs, the ``*_split`` bytes and ``params_split``;
    sequence parallelism splits the ``*_rep`` bytes (the hidden state between TP GEMMs: norms,
    residuals, dropout masks); context parallelism splits the tokens and gathers the attention's
    keys and values; expert parallelism splits the experts."""

    params: float
    """Parameter elements the layer holds (a weight tied to another layer counted here too)."""
    params_split: float = 0.0
    """Of which tensor parallelism divides (weights of split GEMMs, vocabulary-parallel tables)."""
    params_expert: float = 0.0
    """Of params_split: the experts' (expert parallelism divides them too)."""
    params_ep: float = 0.0
    """Not in params_split: experts' parameters tensor parallelism keeps whole on every TP rank
    (transformers' fused 3-D expert parameters) and expert parallelism alone divides."""
    gemms: tuple[Gemm, ...] = ()
    attention: Attention | None = None
    experts: int = 0
    top_k: int = 0
    ew_rep: Pair = (0.0, 0.0)
    """Forward HBM bytes per token of memory-bound ops on the replicated hidden state."""
    ew_split: Pair = (0.0, 0.0)
    """... on tensor-parallel-split tensors."""
    ew_whole: float = 0.0
    """... that no parallelism splits (an embedding's gather)."""
    ew_bwd_input: float = 2.0
    """Backward (input-gradient pass) memory-bound bytes per forward byte."""
    ew_bwd_weight: float = 0.0
    """Weight-gradient pass memory-bound bytes per forward byte (an embedding's scatter-add)."""
    saved_rep: float = 0.0
    """Bytes per token kept for the backward on the replicated hidden state."""
    saved_split: Pair = (0.0, 0.0)
    """... on tensor-parallel-split tensors."""
    saved_whole: float = 0.0
    """... split by no parallelism."""
    saved_input: float = 0.0
    """Bytes per token of the layer's input: what full recomputation keeps (SP splits it)."""
    saved_op: Pair = (0.0, 0.0)
    """(replicated, split) bytes per token kept under op-level selective checkpointing."""
    saved_routed_rep: float = 0.0
    """Of saved_rep: what a MoE layer keeps per token for its routed token-expert pairs (the
    dispatched copies, the experts' own tensors, the outputs the combine weights) on the rank that
    runs the expert: expert parallelism's busiest rank keeps more of it (cost.moe). (In a layer
    without TP pairs: of saved_whole.)"""
    saved_routed_split: Pair = (0.0, 0.0)
    """... of saved_split (fused, eager): the experts' hidden-width tensors."""
    saved_combine_rep: float = 0.0
    """Of saved_routed_rep: the expert outputs the combine keeps to weight them by their routing
    probabilities (the probabilities' gradient reads them). A codebase that multiplies the
    probabilities inside the experts' activation instead keeps none of it
    (CostParams.moe_probs_in_activation)."""
    saved_gemm_rep: float = 0.0
    """Of saved_rep: the 2-byte inputs of fp8-capable (split) GEMMs that only the GEMM keeps, for
    its weight gradient (a norm's output before the q/k/v or MLP-in GEMMs; a MoE's dispatched
    token copies). With precision=fp8 (Transformer Engine) the GEMM keeps its fp8-cast input
    instead: half the bytes."""
    saved_gemm_split: float = 0.0
    """... of saved_split: the same on split tensors (the MLP-out GEMM's input)."""
    saved_attn_out: float = 0.0
    """Of saved_split: the attention core's output, also the o-projection's GEMM input. A flash
    kernel keeps it (2-byte) for its own backward, so an fp8 o-projection's 1-byte copy comes on
    top; with an unfused or recomputed core the GEMM is its only keeper (halved under fp8)."""
    hidden: float = 0.0
    """Bytes per token of the layer's output: the size of each TP all-reduce."""
    send: float = 0.0
    """Bytes per token a pipeline cut after this layer sends onward (output + side inputs)."""
    tp_allreduces: int = 0
    """Column -> row GEMM pairs: one all-reduce of ``hidden`` each, forward and backward."""
    tp_reduce: float = 0.0
    """Bytes per token TP all-reduces per pass (forward or backward) where that is not
    ``tp_allreduces x hidden``: a convolution pair all-reduces its row convolution's output, not the
    block's (ResNet's bottleneck: conv2's width x its positions). 0: ``tp_allreduces x hidden``."""
    loss_vocab: float = 0.0
    """The layer ends in a cross-entropy over this many logits per token (0: no loss here)."""
    loss_split: bool = True
    """The logits are split over TP ranks (vocabulary-parallel head and loss)."""
    fp8: bool = True
    """With precision=fp8 the layer's split GEMMs run in fp8 (the output layer stays bf16)."""
    tp_divides: dict[str, int] = field(default_factory=dict)
    """Widths every tensor-parallel degree must divide, by name (e.g. {'ffn_hidden_size': 11008});
    with an attention, its heads too, and its kv heads or tp a multiple of them."""

    def __post_init__(self) -> None:
        for f in ("params", "params_split", "params_expert", "params_ep", "ew_whole", "saved_rep", "saved_whole",
                  "saved_input", "saved_routed_rep", "saved_combine_rep", "saved_gemm_rep", "saved_gemm_split", "saved_attn_out", "hidden", "send",
                  "loss_vocab", "tp_reduce"):
            v = getattr(self, f)
            if not (v >= 0 and math.isfinite(v)):
                raise MeshplanError(f"layer ops: {f} must be a finite number >= 0, got {v}")
        if self.params_split > self.params * (1 + 1e-9) or self.params_expert > self.params_split * (1 + 1e-9):
            raise MeshplanError("layer ops: need params >= params_split >= params_expert")
        if self.params_split + self.params_ep > self.params * (1 + 1e-9):
            raise MeshplanError("layer ops: need params >= params_split + params_ep")
        if not all(v >= 0 and math.isfinite(v) for v in self.saved_routed_split):
            raise MeshplanError(f"layer ops: saved_routed_split must be finite numbers >= 0, got {self.saved_routed_split}")
        if self.saved_combine_rep > self.saved_routed_rep * (1 + 1e-9):
            raise MeshplanError("layer ops: saved_combine_rep is part of saved_routed_rep and cannot exceed it")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise MeshplanError(f"layer ops: top_k={self.top_k} must be in 1..experts={self.experts}")

    @property
    def splits(self) -> bool:
        """Tensor parallelism can split this layer."""
        return any(g.split != "none" for g in self.gemms)


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
    gradients are all-reduced across those stages when pp > 1. LayerOps count them at both
    users; one copy is dropped when one rank holds both (pp = 1)."""
    tied_split: bool = True
    """Tensor parallelism splits the tied matrix (a vocabulary-parallel embedding and head)."""
    notes: tuple[str, ...] = ()
    ops: dict[str, LayerOps] = field(default_factory=dict)
    """Block id -> what the layer computes (stored once per distinct block). Empty for graphs
    from older files: ``layer_ops`` derives them from the per-layer totals."""
    model: ModelSpec | None = None
    """The transformer description the graph was generated from (presets and model files,
    spec.transformer); None for traced models. Only the runtime (to build the module) and the
    exporters (to write a framework's model arguments) read it."""

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

    def num_params(self) -> int:
        """Trainable parameters (a tied weight counted once)."""
        return self.params

    @property
    def num_blocks(self) -> int:
        """Layers of kind block: what pipeline stages count."""
        return sum(1 for layer in self.layers if layer.kind == "block")

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


def derived(graph: LayerGraph, key: str, make: Any) -> Any:
    """``make(graph)``, computed once per graph object and kept on it (a frozen graph's derived
    views: cost.batch.layout, spec.capabilities)."""
    attr = f"_derived_{key}"
    value = graph.__dict__.get(attr)
    if value is None:
        value = make(graph)
        object.__setattr__(graph, attr, value)
    return value


def layer_ops(graph: LayerGraph) -> dict[str, LayerOps]:
    """Block id -> LayerOps: the graph's own, else derived from each block's per-layer totals
    (graphs written before ingestion recorded operations; see ``derived_ops``)."""
    out = dict(graph.ops)
    for layer in graph.layers:
        if layer.block not in out:
            out[layer.block] = derived_ops(graph, layer)
    return out


#: Parameters of a block per squared GEMM width (a transformer block: 12 h^2), for the GEMM
#: shape of a layer whose width ingestion did not record.
PARAMS_PER_SQUARED_WIDTH = 12.0


def derived_ops(graph: LayerGraph, x: LayerSpec) -> LayerOps:
    """LayerOps from a LayerSpec's per-sample totals: the GEMM FLOPs as one square GEMM of
    extra['gemm_dim'] (else sqrt(params / 12)) split by tp_fraction, the attention from
    extra['attention_flops'] and head_dim, memory-bound bytes extra['mem_bytes'] (else 3 x the
    saved bytes), saved bytes split by extra['tp_saved_fraction'] (else tp_fraction)."""
    s = graph.sample_tokens
    to2 = 2.0 / graph.dtype_bytes / s  # per sample at trace dtype -> per token at 2 bytes
    tp_able = x.tp_style != "none" and x.tp_fraction > 0
    frac = x.tp_fraction if tp_able else 0.0
    att_flops = float(x.extra.get("attention_flops", 0.0))
    attention = None
    if att_flops > 0:
        hd = int(x.extra.get("head_dim", 64)) or 64
        q_dim = att_flops / (4.0 * s * s)
        heads = max(1, round(q_dim / hd))
        attention = Attention(heads=heads, kv_heads=heads, head_dim=hd, causal=bool(x.extra.get("attention_causal", 0)))
    lin = max(0.0, x.fwd_flops - att_flops) / s  # per token
    d = float(x.extra.get("gemm_dim", 0.0)) or math.sqrt(max(x.params, 1) / PARAMS_PER_SQUARED_WIDTH)
    rows = lin / (2.0 * d * d) if d > 0 else 0.0
    gemms = []
    if rows > 0:
        if frac > 0:
            gemms.append(Gemm(n=d, k=d, m=rows * frac, split="column"))
        if frac < 1:
            gemms.append(Gemm(n=d, k=d, m=rows * (1 - frac)))
    mem = float(x.extra.get("mem_bytes", 3.0 * x.saved_bytes)) * to2
    saved = x.saved_bytes * to2
    sfrac = float(x.extra.get("tp_saved_fraction", frac)) if tp_able else 0.0
    out = x.output_bytes * to2
    vocab = 0.0
    if x.kind == "head" and "loss_saved_bytes" in x.extra:
        vocab = x.output_bytes / graph.dtype_bytes / s
    split_params = x.params * float(x.extra.get("tp_param_fraction", frac)) if tp_able else 0.0
    heads = [la for la in graph.layers if la.kind == "head"]
    tied = graph.tied_params if (heads[0] if heads else graph.layers[-1]).block == x.block else 0
    no_bwd_input = x.kind == "embedding" or x.fwd_flops == 0 and x.bwd_flops == 0
    return LayerOps(
        params=float(x.params + tied), params_split=min(float(x.params), split_params), gemms=tuple(gemms),
        attention=attention, ew_split=(mem * frac, mem * frac), ew_rep=(mem * (1 - frac), mem * (1 - frac)),
        ew_bwd_input=0.0 if no_bwd_input else 2.0, ew_bwd_weight=2.0 if x.kind == "embedding" else 0.0,
        saved_split=(saved * sfrac, saved * sfrac), saved_rep=saved * (1 - sfrac), saved_input=out,
        saved_op=(saved * (1 - sfrac), saved * sfrac), hidden=out,
        send=float(x.extra.get("send_bytes", x.output_bytes)) * to2, tp_allreduces=x.tp_allreduces if tp_able else 0,
        loss_vocab=vocab, loss_split=False)
