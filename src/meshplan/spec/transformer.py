"""A transformer ModelSpec (preset or model file) as a LayerGraph, generated analytically.

The cost model, the search, the simulator, the report and the exports take only LayerGraphs; a
ModelSpec is one way to describe a model, like a Hugging Face config or an nn.Module, and
``transformer_graph`` is its ingestion: an embedding, ``num_layers`` identical blocks (stored once)
and a head, each with the LayerOps the analytic formulas give (docs/cost-model.md):

  block     GEMMs q/k/v (column), o (row), MLP in (column: 2 matrices fused for SwiGLU) and out
            (row); MoE: the experts' pair per expert plus the router (replicated); the attention
            core; elementwise HBM bytes per op (ELEMENTWISE_BYTES: two norms, two residual adds,
            dropout, the MLP activation, rotary); saved activations after Korthikanti et al. 2022
            Eq. 2 generalised to GQA (k and v kept repeated to the query heads), SwiGLU and
            FlashAttention
  embedding a gather of 2 h bytes per token (read + write), its gradient a scatter-add
  head      final norm + logits GEMM (vocabulary-parallel) + cross-entropy

Pure Python; memoised per (model, sequence length).
"""
from __future__ import annotations

from functools import lru_cache

from meshplan.spec.graph import Attention, Gemm, LayerGraph, LayerOps, LayerSpec
from meshplan.spec.model import ModelSpec

#: Forward HBM bytes per element of each elementwise op, (fused, eager). Fused: compiled or
#: hand-fused kernels (torch.compile, apex/Megatron fused LayerNorm and bias-GeLU, native
#: LayerNorm/GeLU). Eager: the op written as separate PyTorch calls (torchtitan's RMSNorm:
#: fp32 upcast, pow, mean, rsqrt-mul, downcast, weight-mul ~ 36 B; rotary via complex fp32
#: multiply ~ 24 B; SiLU then multiply 10 B per element of f). bf16 activations.
ELEMENTWISE_BYTES: dict[str, tuple[float, float]] = {
    "layernorm": (4.0, 4.0), "rmsnorm": (4.0, 36.0), "residual": (2.0, 6.0),
    "gelu_4h": (4.0, 4.0), "relu_4h": (4.0, 4.0), "squared_relu": (4.0, 8.0),
    "swiglu": (6.0, 10.0), "rotary": (4.0, 24.0), "dropout": (1.0, 1.0),
}
ACT_BYTES = 2.0


def _pair(*terms: tuple[float, str]) -> tuple[float, float]:
    """sum of count x ELEMENTWISE_BYTES[op], fused and eager."""
    return (sum(c * ELEMENTWISE_BYTES[op][0] for c, op in terms),
            sum(c * ELEMENTWISE_BYTES[op][1] for c, op in terms))


def block_ops(model: ModelSpec) -> LayerOps:
    """One transformer block, per token."""
    m = model
    h, q, kv = m.hidden_size, m.q_dim, m.kv_dim
    mats_in = m.mlp_matrices - 1
    gemms = [Gemm(n=q + 2 * kv, k=h, split="column"), Gemm(n=h, k=q, split="row")]
    if m.is_moe:
        f = m.expert_ffn
        gemms += [Gemm(n=mats_in * f, k=h, split="column", expert=True),
                  Gemm(n=h, k=f, split="row", expert=True), Gemm(n=m.num_experts, k=h)]
        f_tok = f * m.experts_per_token
        experts = m.num_experts * m.mlp_params(f)
    else:
        f = f_tok = m.ffn_hidden_size
        gemms += [Gemm(n=mats_in * f, k=h, split="column"), Gemm(n=h, k=f, split="row")]
        experts = 0
    rep_ops = [(2 * h, m.norm), (2 * h, "residual")] + ([(2 * h, "dropout")] if m.dropout else [])
    split_ops = [(f_tok, m.mlp_type)] + ([(q + kv, "rotary")] if m.position == "rotary" else [])
    saved_split = 2 * (q + 2 * kv) + 2 * q
    # SDPA keeps its inputs q, k, v; with grouped-query attention the k and v heads are repeated to
    # the query heads first (torchtitan's and Hugging Face's repeat_kv, meshplan's runtime's
    # repeat_interleave), so it keeps q-wide k and v: 4 (q - kv) bytes more per token. (Rotary
    # embeddings keep nothing q-sized: the multiply saves only its cos/sin or complex table.)
    gqa_repeat = 4 * (q - kv)
    mlp = (6 * f_tok, 8 * f_tok) if m.mlp_type == "swiglu" else (4 * f_tok, 4 * f_tok)
    dropout = 1 if m.dropout else 0
    return LayerOps(
        params=m.layer_params(), params_split=m.layer_params(), params_expert=experts,
        gemms=tuple(gemms), attention=Attention(heads=m.num_attention_heads, kv_heads=m.kv_heads,
                                                head_dim=m.dhead, causal=m.causal),
        experts=m.num_experts if m.is_moe else 0, top_k=m.experts_per_token if m.is_moe else 0,
        ew_rep=_pair(*rep_ops), ew_split=_pair(*split_ops),
        saved_rep=(8 + 2 * dropout) * h,
        saved_split=(saved_split + gqa_repeat + mlp[0], saved_split + gqa_repeat + mlp[1]),
        saved_input=ACT_BYTES * h,
        saved_op=(ACT_BYTES * h, 2 * q + 2 * kv + 2 * f_tok + 2 * h + 2 * q),
        hidden=ACT_BYTES * h, send=ACT_BYTES * h, tp_allreduces=2,
        tp_divides={"ffn_hidden_size": m.expert_ffn if m.is_moe else m.ffn_hidden_size})


def embedding_ops(model: ModelSpec) -> LayerOps:
    h = model.hidden_size
    return LayerOps(params=model.embedding_params(), params_split=model.embedding_params(),
                    ew_whole=2 * ACT_BYTES * h, ew_bwd_input=0.0, ew_bwd_weight=2.0,
                    saved_whole=ACT_BYTES * h, hidden=ACT_BYTES * h, send=ACT_BYTES * h)


def head_ops(model: ModelSpec) -> LayerOps:
    """Final norm + output projection + loss (the projection counted even when tied: the
    graph's tied_params drops the copy when one rank holds both)."""
    h, v = model.hidden_size, model.vocab_size
    n = model.norm_params() + v * h
    return LayerOps(params=n, params_split=n, gemms=(Gemm(n=v, k=h, split="column"),),
                    ew_bwd_input=0.0, hidden=ACT_BYTES * v, loss_vocab=v, fp8=False)


@lru_cache(maxsize=256)
def transformer_graph(model: ModelSpec, seq_len: int) -> LayerGraph:
    """``model`` at ``seq_len`` tokens per sample as a LayerGraph."""
    ops = {"embedding": embedding_ops(model), "block": block_ops(model), "head": head_ops(model)}
    s = seq_len

    def layer(name: str, kind: str, bid: str) -> LayerSpec:
        o = ops[bid]
        lin = sum(2.0 * g.n * g.k * (o.top_k if g.expert else g.m) for g in o.gemms)  # per token
        att = 4.0 * s * o.attention.q_dim if o.attention else 0.0
        params = model.output_params() if kind == "head" else int(o.params)  # a tied matrix counted once
        return LayerSpec(name=name, kind=kind, block=bid, params=params, fwd_flops=s * (lin + att),
                         bwd_flops=s * (2 * lin + 2 * att), saved_bytes=s * (o.saved_rep + o.saved_split[0]
                                                                          + o.saved_whole),
                         output_bytes=s * o.hidden, tp_style="megatron" if o.splits and kind == "block" else "none",
                         tp_fraction=1.0 if o.splits and kind == "block" else 0.0,
                         tp_max=_tp_max(model) if kind == "block" else 1,
                         tp_allreduces=o.tp_allreduces)

    layers = ([layer("embedding", "embedding", "embedding")]
              + [layer(f"layers.{i}", "block", "block") for i in range(model.num_layers)]
              + [layer("output", "head", "head")])
    return LayerGraph(name=model.name, source=model.name, task="causal-lm" if model.causal else "masked-lm",
                      sample_tokens=s, trace_dtype="bfloat16", layers=tuple(layers),
                      tied_params=model.vocab_size * model.hidden_size if model.tied_embeddings else 0,
                      tied_split=True, ops=ops, model=model)


def _tp_max(model: ModelSpec) -> int:
    """The largest TP degree the block's shapes allow (kv heads, MLP width)."""
    import math
    f = model.expert_ffn if model.is_moe else model.ffn_hidden_size
    return math.gcd(model.kv_heads, model.num_attention_heads, f)
