"""ModelSpec: what is trained. A decoder-only (or encoder-only) transformer description.

Field names follow the columns of shared/data/published_runs_dev.csv.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshplan.errors import MeshplanError
from meshplan.spec.base import choice, positive

MLP_TYPES = ("gelu_4h", "swiglu", "squared_relu", "relu_4h")
GATED_MLPS = ("swiglu",)
POSITIONS = ("learned", "rotary", "alibi", "none")
NORMS = ("layernorm", "rmsnorm")
GELUS = ("native", "tanh-python")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A transformer: per-layer shapes plus the embedding/output layers."""

    name: str = "custom"
    """Preset or user name (lowercase with hyphens for presets)."""
    num_layers: int
    """Number of transformer blocks."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means equal to num_attention_heads."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size / num_attention_heads."""
    ffn_hidden_size: int
    """MLP width; for a gated MLP (swiglu) the width of one of its three matrices."""
    mlp_type: str = "gelu_4h"
    """One of gelu_4h, swiglu, squared_relu, relu_4h."""
    vocab_size: int
    """Vocabulary size (as padded by the framework)."""
    seq_len: int = 2048
    """Default training sequence length (the workload may override it)."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table; None means seq_len. Ignored unless position='learned'."""
    tied_embeddings: bool = False
    """Input embedding and output projection share one matrix."""
    position: str = "rotary"
    """Position encoding: learned, rotary, alibi or none."""
    norm: str = "rmsnorm"
    """layernorm (weight+bias) or rmsnorm (weight only)."""
    bias: bool = False
    """Linear layers (and LayerNorms) carry biases."""
    embedding_norm: bool = False
    """A norm right after the token embedding (BLOOM)."""
    num_experts: int = 1
    """Experts per MoE layer; 1 means a dense model."""
    experts_per_token: int = 1
    """Experts each token is routed to (top-k)."""
    expert_ffn_hidden_size: int | None = None
    """Width of one expert's MLP; None means ffn_hidden_size."""
    causal: bool = True
    """Causal (decoder) attention; False for encoders."""
    dropout: bool = False
    """Trained with dropout (stores 1-byte masks after attention and MLP; GPT-3/Megatron/BLOOM)."""
    attention_dropout: bool | None = None
    """Dropout on the attention probabilities; None: the attention kernel's convention
    (cost.activations: eager without, as Hugging Face's Llama family; Megatron's fused softmax
    with). Only an unfused core's saved bytes read it."""
    softmax_fp32: bool = True
    """An unfused (eager) attention takes its softmax in float32 (Hugging Face's Llama, Mistral,
    Qwen2, Mixtral) rather than in the activations' dtype (GPT-2)."""
    gelu: str = "native"
    """How a gelu_4h MLP's GELU runs when elementwise ops run eager: native (torch's one-kernel
    F.gelu / nn.GELU, exact or tanh: keeps its input) or tanh-python (the tanh formula as
    separate PyTorch ops: Hugging Face's gelu_new, OpenAI's GPT-2 code, nanoGPT's NewGELU)."""

    def __post_init__(self) -> None:
        w = f"model {self.name!r}"
        for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "vocab_size", "seq_len", "num_experts", "experts_per_token"):
            positive(f"{w}: {f}", getattr(self, f))
        for f in ("num_kv_heads", "head_dim", "max_position_embeddings", "expert_ffn_hidden_size"):
            if getattr(self, f) is not None:
                positive(f"{w}: {f}", getattr(self, f))
        choice(f"{w}: mlp_type", self.mlp_type, MLP_TYPES)
        choice(f"{w}: position", self.position, POSITIONS)
        choice(f"{w}: norm", self.norm, NORMS)
        choice(f"{w}: gelu", self.gelu, GELUS)
        kv = self.kv_heads
        if kv <= 0 or self.num_attention_heads % kv:
            raise MeshplanError(f"{w}: num_kv_heads={kv} must divide num_attention_heads="
                                f"{self.num_attention_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise MeshplanError(f"{w}: hidden_size={self.hidden_size} is not divisible by "
                                f"num_attention_heads={self.num_attention_heads}; set head_dim")
        if self.experts_per_token > self.num_experts:
            raise MeshplanError(f"{w}: experts_per_token={self.experts_per_token} exceeds "
                                f"num_experts={self.num_experts}")

    # ---- derived shapes -------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_attention_heads

    @property
    def dhead(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        """Width of all query heads together."""
        return self.num_attention_heads * self.dhead

    @property
    def kv_dim(self) -> int:
        """Width of all key heads together (values are the same)."""
        return self.kv_heads * self.dhead

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden_size or self.ffn_hidden_size

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices in one MLP: 3 for gated (swiglu), 2 otherwise."""
        return 3 if self.mlp_type in GATED_MLPS else 2

    # ---- parameter counts -----------------------------------------------------------
    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        n = h * q + 2 * h * kv + q * h
        if self.bias:
            n += q + 2 * kv + h
        return n

    def mlp_params(self, ffn: int | None = None) -> int:
        """Parameters of one (dense or expert) MLP of width ``ffn``."""
        h, f = self.hidden_size, ffn or self.ffn_hidden_size
        n = self.mlp_matrices * h * f
        if self.bias:
            n += (self.mlp_matrices - 1) * f + h
        return n

    def norm_params(self) -> int:
        """LayerNorm: weight (+ bias when the model has biases); RMSNorm: weight."""
        return 2 * self.hidden_size if (self.norm == "layernorm" and self.bias) else self.hidden_size

    def layer_params(self) -> int:
        """Parameters of one transformer block (all experts counted)."""
        if self.is_moe:
            mlp = self.num_experts * self.mlp_params(self.expert_ffn) + self.hidden_size * self.num_experts
        else:
            mlp = self.mlp_params()
        return self.attention_params() + mlp + 2 * self.norm_params()

    def active_layer_params(self) -> int:
        """Parameters one token touches in one block (top-k experts only)."""
        if not self.is_moe:
            return self.layer_params()
        return (self.attention_params() + self.experts_per_token * self.mlp_params(self.expert_ffn)
                + self.hidden_size * self.num_experts + 2 * self.norm_params())

    def embedding_params(self) -> int:
        """Token embedding (+ learned positions + embedding norm)."""
        n = self.vocab_size * self.hidden_size
        if self.position == "learned":
            n += (self.max_position_embeddings or self.seq_len) * self.hidden_size
        if self.embedding_norm:
            n += self.norm_params()
        return n

    def output_params(self) -> int:
        """Final norm + output projection (zero extra matrix when tied)."""
        n = self.norm_params()
        if not self.tied_embeddings:
            n += self.vocab_size * self.hidden_size
        return n

    def num_params(self) -> int:
        """Total trainable parameters."""
        return self.num_layers * self.layer_params() + self.embedding_params() + self.output_params()

    def num_active_params(self) -> int:
        """Parameters used per token (differs from num_params for mixture-of-experts)."""
        return (self.num_layers * self.active_layer_params() + self.embedding_params()
                + self.output_params())

    def replace(self, **changes: object) -> ModelSpec:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
