"""Decoder-only transformers built from a ModelSpec with random weights.

One module tree covers the families of the presets: Llama-style (RMSNorm, rotary, SwiGLU,
grouped-query attention), GPT-2-style (LayerNorm with biases, learned positions, GELU, tied
embeddings) and mixture-of-experts (top-k routed SwiGLU experts). The model knows nothing of
parallelism; the pieces are named so that ``parallelize`` can act on them from outside:

    embed.tok, embed.pos, embed.norm      token / learned-position embeddings (+ BLOOM's norm)
    layers["i"].attention.{wq,wk,wv,wo}   projections; attention.core is the softmax(QK^T)V part
    layers["i"].feed_forward.{w1,w2,w3}   MLP (w3 only for gated MLPs) or .gate + .experts["e"]
    norm, output                          final norm and output projection

Any of ``embed``, ``norm`` and ``output`` may be None (a pipeline stage keeps only its part);
``layers`` is a ModuleDict so that deleting blocks keeps the names of the others (torchtitan).

``pad_vocab`` appends zero rows to the token embedding and the output projection (Megatron's
make-vocab-size-divisible-by, used when tp does not divide the vocabulary); the padded logit
columns are then left out of the loss: cut off when the logits are a whole tensor, set to -inf in
the local shard when they are a vocabulary-sharded DTensor (tensor parallelism computes the loss
on sharded logits, ``loss_fn``). Either way the padded rows get exactly zero gradient and the
loss is the unpadded model's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.spec.model import ModelSpec

INIT_STD = 0.02
"""Standard deviation of the normal init of weight matrices (GPT-2 / Llama reference code)."""
ROPE_THETA = 10000.0
"""Rotary base frequency (Llama 2; Llama 3 uses 500000 but the choice does not matter here)."""
NORM_EPS = 1e-5


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden_size, eps=NORM_EPS)
    return nn.LayerNorm(spec.hidden_size, eps=NORM_EPS, bias=spec.bias)


def rope_tables(head_dim: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim] for rotate-half rotary embeddings."""
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos/sin: [seq, head_dim]."""
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V over [batch, seq, heads, head_dim] inputs (Megatron's
    'core attention': what selective recomputation recomputes)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = q.shape[0], q.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]  # grouped-query attention; local heads under TP
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return out.transpose(1, 2).reshape(b, s, -1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, bias = spec.hidden_size, spec.bias
        self.head_dim = spec.dhead
        self.rotary = spec.position == "rotary"
        self.wq = nn.Linear(h, spec.q_dim, bias=bias)
        self.wk = nn.Linear(h, spec.kv_dim, bias=bias)
        self.wv = nn.Linear(h, spec.kv_dim, bias=bias)
        self.wo = nn.Linear(spec.q_dim, h, bias=bias)
        self.core = CoreAttention(spec.causal)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape[0], x.shape[1], self.head_dim
        q = self.wq(x).view(b, s, -1, d)  # -1: the heads local to this rank under TP
        k = self.wk(x).view(b, s, -1, d)
        v = self.wv(x).view(b, s, -1, d)
        if self.rotary:
            q, k = apply_rope(q, cos[:s], sin[:s]), apply_rope(k, cos[:s], sin[:s])
        return self.wo(self.core(q, k, v))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, ffn: int) -> None:
        super().__init__()
        h, bias = spec.hidden_size, spec.bias
        self.kind = spec.mlp_type
        self.w1 = nn.Linear(h, ffn, bias=bias)
        self.w2 = nn.Linear(ffn, h, bias=bias)
        self.w3 = nn.Linear(h, ffn, bias=bias) if spec.mlp_type == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.w1(x)
        if self.w3 is not None:
            a = F.silu(a) * self.w3(x)
        elif self.kind == "gelu_4h":
            a = F.gelu(a, approximate="tanh")  # GPT-2's tanh approximation
        elif self.kind == "squared_relu":
            a = F.relu(a).square()
        else:
            a = F.relu(a)
        return self.w2(a)


class Experts(nn.ModuleDict):
    """Expert MLPs keyed by global expert index ("0" .. "E-1"; a subset under expert parallelism).
    One forward for all of them, so that FSDP gathers their parameters once per layer."""

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [expert(x) for expert, x in zip(self.values(), xs)]


class MoE(nn.Module):
    """Top-k routed experts (softmax router, weights renormalised over the chosen k: Mixtral).
    Token copies are sorted by expert, each expert runs once on its rows (also on none: every
    expert always gets a gradient, so all ranks agree on what the optimizer updates), and the
    weighted outputs are summed back per token in expert order. No token dropping.
    ``dispatch`` is the seam for expert parallelism (``runtime.expert_parallel``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k = spec.experts_per_token
        self.num_experts = spec.num_experts
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts({str(e): FeedForward(spec, spec.expert_ffn) for e in range(spec.num_experts)})

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs for ``rows`` (token copies sorted by expert; ``counts[e]`` rows each)."""
        return torch.cat(self.experts(list(rows.split(counts.tolist()))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        fp64 = flat.dtype == torch.float64  # the tests' exact reference keeps float64
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float64 if fp64 else torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        choice = chosen.reshape(-1)  # copy a = token * top_k + slot
        order = torch.argsort(choice, stable=True)
        token = order // self.top_k
        counts = torch.bincount(choice, minlength=self.num_experts)
        y = self.dispatch(flat[token], counts) * weights.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add(0, token, y).view(shape)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = _norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = _norm(spec)
        self.feed_forward = MoE(spec) if spec.is_moe else FeedForward(spec, spec.ffn_hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Embeddings(nn.Module):
    def __init__(self, spec: ModelSpec, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.hidden_size)
        rows = max(spec.max_position_embeddings or spec.seq_len, seq_len)
        self.pos = nn.Embedding(rows, spec.hidden_size) if spec.position == "learned" else None
        self.norm = _norm(spec) if spec.embedding_norm else None
        self.positions: torch.Tensor | None = None
        """Global positions of the input's tokens (set under context parallelism); None: 0..s-1."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        if self.pos is not None:
            pos = self.positions if self.positions is not None else torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.pos(pos)
        return self.norm(h) if self.norm is not None else h


class Transformer(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab] (or hidden states for a pipeline stage)."""

    def __init__(self, spec: ModelSpec, seq_len: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.vocab_size = spec.vocab_size
        """The logical vocabulary: the logits' width (the weights may hold more rows: pad_vocab)."""
        seq_len = seq_len or spec.seq_len
        self.embed: Embeddings | None = Embeddings(spec, seq_len)
        self.layers = nn.ModuleDict({str(i): Block(spec) for i in range(spec.num_layers)})
        self.norm: nn.Module | None = _norm(spec)
        self.output: nn.Linear | None = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.embed.tok.weight
        cos, sin = rope_tables(spec.dhead, seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        logits = self.output(h)
        return logits if logits.shape[-1] == self.vocab_size else drop_padded_columns(logits, self.vocab_size)

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding / output matrices (vocab_size unless pad_vocab added some)."""
        w = self.embed.tok.weight if self.embed is not None else self.output.weight if self.output is not None \
            else None
        return self.vocab_size if w is None else w.shape[0]

    def pad_vocab(self, multiple: int) -> None:
        """Append zero rows to the token embedding and the output projection up to a multiple of
        ``multiple`` (tied: one matrix, still tied). Call on the full model, before it is split
        into stages (so that a tied copy is padded alike). Tokens never index the padded rows and
        ``forward`` leaves the padded logit columns out of the loss (``drop_padded_columns``), so
        the padded rows get zero gradients (and AdamW keeps them zero: decoupled decay of zero,
        zero update)."""
        rows = -(-self.vocab_size // multiple) * multiple
        if rows == self.vocab_size:
            return
        tied = self.embed is not None and self.output is not None and self.output.weight is self.embed.tok.weight

        def padded(w: nn.Parameter) -> nn.Parameter:
            extra = w.new_zeros(rows - w.shape[0], *w.shape[1:])
            return nn.Parameter(torch.cat([w.detach(), extra]), requires_grad=w.requires_grad)
        if self.embed is not None:
            self.embed.tok.weight = padded(self.embed.tok.weight)
            self.embed.tok.num_embeddings = rows
        if self.output is not None:
            self.output.weight = self.embed.tok.weight if tied else padded(  # type: ignore[union-attr]
                self.output.weight)
            self.output.out_features = rows


def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic random init: N(0, 0.02) matrices and embeddings, output projections of
    residual branches scaled by 1/sqrt(2 * layers) (GPT-2), norms 1, biases 0."""
    gen = torch.Generator().manual_seed(seed)
    layers = getattr(getattr(model, "spec", None), "num_layers", 1)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if p.dim() >= 2:
                std = INIT_STD / math.sqrt(2 * layers) if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def build_model(spec: ModelSpec, seq_len: int | None = None, *, seed: int = 0) -> Transformer:
    """A Transformer for ``spec`` with deterministic random weights (same on every rank)."""
    model = Transformer(spec, seq_len)
    init_weights(model, seed)
    return model


def _vocab_sharded(logits: torch.Tensor) -> bool:
    """Whether ``logits`` is a DTensor whose last (vocabulary) dim is sharded on one mesh dim."""
    from torch.distributed.tensor import DTensor
    if not isinstance(logits, DTensor):
        return False
    last = logits.dim() - 1
    return sum(p.is_shard() and p.dim % logits.dim() == last for p in logits.placements) == 1  # type: ignore[attr-defined]


def drop_padded_columns(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits without their padded vocabulary columns (``Transformer.pad_vocab``), as the loss must
    see them. A whole tensor (or a replicated DTensor): cut to ``vocab`` columns. Vocabulary-sharded
    logits (tensor parallelism, the loss on sharded logits): the same global shape, the padded
    columns of the local shard set to -inf (``masked_fill``: their gradient is exactly zero, and
    exp(-inf) = 0 leaves them out of the softmax's sum exactly), so no rank gathers anything."""
    if not _vocab_sharded(logits):
        return logits[..., :vocab]
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    assert isinstance(logits, DTensor)
    local = logits.to_local()
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    start = offset[-1]
    if start + local.shape[-1] <= vocab:  # no padded column in this shard
        return logits
    cols = torch.arange(start, start + local.shape[-1], device=local.device)
    local = local.masked_fill(cols >= vocab, float("-inf"))
    return DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False,
                              shape=logits.shape, stride=logits.stride())


def loss_parallel_active() -> bool:
    """Whether ``torch.distributed.tensor.parallel.loss_parallel()`` is entered (its cross-entropy
    handlers are installed on DTensor's dispatcher)."""
    from torch.distributed.tensor import DTensor
    return torch.ops.aten._log_softmax.default in DTensor._op_dispatcher._custom_op_handlers


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all tokens (fp32).

    Vocabulary-sharded logits (a DTensor sharded on its last dim: tensor parallelism) are reduced
    where they lie, as torchtitan and Megatron do: under ``loss_parallel()``, which the caller
    enters around the forward *and* the backward, each rank takes the log-softmax of its shard with
    all-reduces of one number per token (the max, the sum of exponentials, the target's logit) and
    the logits' gradient stays sharded. Outside ``loss_parallel`` DTensor would gather the full
    logits on every rank, so that is refused. The result is a plain tensor (the global mean, the
    same on every tensor-parallel rank; its backward re-enters the DTensor graph)."""
    sharded = _vocab_sharded(logits)
    if sharded and not loss_parallel_active():
        raise RuntimeError("loss_fn: vocabulary-sharded logits outside loss_parallel() (the cross-entropy "
                           "would all-gather the full logits on every tensor-parallel rank)")
    flat = logits.flatten(0, -2)  # float64 stays float64 (the tests' exact reference)
    loss = F.cross_entropy(flat if flat.dtype == torch.float64 else flat.float(), targets.reshape(-1))
    # not a view (to_local's is): the zero-bubble schedules detach_() the loss after its input backward
    return loss.to_local().clone() if sharded else loss  # type: ignore[attr-defined]
