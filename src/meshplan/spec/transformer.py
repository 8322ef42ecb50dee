"""A transformer ModelSpec (preset or model file) as a LayerGraph, generated analytically.

The cost model, the search, the simulator, the report and the exports take only LayerGraphs; a
ModelSpec is one way to describe a model, like a Hugging Face config or an nn.Module, and
``transformer_graph`` is its ingestion: an embedding, ``num_layers`` identical blocks (stored once)
and a head, each with the LayerOps the analytic formulas give (docs/cost-model.md):

  block     GEMMs q/k/v (column), o (row), MLP in (column: 2 matrices fused for SwiGLU) and out
            (row); MoE: the experts' pair per expert plus the router (replicated); the attention
            core; elementwise HBM bytes per op (ELEMENTWISE_BYTES: two norms, two residual adds,
            dropout, the MLP activation, rotary); saved activations after Korthikanti et al. 2022
            Eq. 2 generalised to GQA (k and v kept repeated to the query heads), SwiGLU,
            FlashAttention, the MLP activation's own intermediates (MLP_SAVED_BYTES, fused and
            eager) and a MoE's dispatch and combine; which saved tensors are GEMM inputs (what an
            fp8 GEMM keeps at 1 byte: LayerOps.saved_gemm_*, saved_attn_out). All checked
            against what autograd keeps in tests/unit/test_autograd_memory.py.
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
    # GELU's tanh formula as PyTorch ops (ModelSpec.gelu = tanh-python: 0.5 x (1 + tanh(c (x +
    # 0.044715 x^3)))): pow 4, two scalar multiplies 4 + 4, add 6, tanh 4, 1 + 4, 0.5 x 4, multiply 6.
    "gelu_tanh_python": (4.0, 36.0),
}
#: Bytes per element of the MLP's hidden width (f per token; f x top_k routed copies for a MoE)
#: kept for the backward, (fused, eager) as ELEMENTWISE_BYTES. Every MLP keeps the MLP-out GEMM's
#: input (2 B) and what its activation's backward reads: GeLU/ReLU their input (2 B; squared ReLU
#: the ReLU's output, which its square reads too), SwiGLU gate and up (4 B) fused, + SiLU's output
#: (2 B, the multiply's operand) eager. GELU's tanh formula as PyTorch ops keeps x (its pow's and
#: the 0.5 x multiply's input), tanh's output (its backward), 0.5 x and 1 + tanh (the last
#: multiply's operands): 8 B, 10 B with the output; compiled it fuses to one kernel keeping x.
MLP_SAVED_BYTES: dict[str, tuple[float, float]] = {
    "gelu_4h": (4.0, 4.0), "relu_4h": (4.0, 4.0), "squared_relu": (4.0, 4.0), "swiglu": (6.0, 8.0),
    "gelu_tanh_python": (4.0, 10.0),
}
ACT_BYTES = 2.0
#: float32 bytes, for a MoE router's softmax and routing weights.
FP32_BYTES = 4.0


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
    act = "gelu_tanh_python" if m.mlp_type == "gelu_4h" and m.gelu == "tanh-python" else m.mlp_type
    rep_ops = [(2 * h, m.norm), (2 * h, "residual")] + ([(2 * h, "dropout")] if m.dropout else [])
    split_ops = [(f_tok, act)] + ([(q + kv, "rotary")] if m.position == "rotary" else [])
    saved_split = 2 * (q + 2 * kv) + 2 * q
    # SDPA keeps its inputs q, k, v; with grouped-query attention the k and v heads are repeated to
    # the query heads first (torchtitan's and Hugging Face's repeat_kv, meshplan's runtime's
    # repeat_interleave), so it keeps q-wide k and v: 4 (q - kv) bytes more per token. (Rotary
    # embeddings keep nothing q-sized: the multiply saves only its cos/sin or complex table.)
    gqa_repeat = 4 * (q - kv)
    mlp = tuple(b * f_tok for b in MLP_SAVED_BYTES[act])
    dropout = 1 if m.dropout else 0
    # Replicated: the two norms' inputs, the q/k/v GEMM's input (the first norm's output), the MLP's
    # input (the second norm's output: the MLP-in GEMM's, or a MoE router's) and dropout masks.
    saved_rep = (8 + 2 * dropout) * h
    mlp_in = ACT_BYTES * h  # the MLP-in GEMM's input, dense
    if m.is_moe:
        top = m.experts_per_token
        # Dispatch gathers one copy of the token's hidden state per routed expert, the input the
        # expert's first GEMM keeps; combining multiplies each expert's output by its routing
        # weight, which keeps that output (the weight's gradient) and the weight; the router keeps
        # its float32 softmax. (Hugging Face's grouped_mm and per-expert loop, Megatron's
        # permute / unpermute with probabilities, torchtitan's routed output x scores alike.)
        mlp_in = top * ACT_BYTES * h
        saved_rep += 2 * mlp_in + FP32_BYTES * (m.num_experts + top)
    # routed: kept per token-expert pair on the expert's rank (the dispatched copies, the combine's
    # expert outputs, the experts' hidden-width tensors), the router's softmax aside
    routed_rep = 2 * mlp_in if m.is_moe else 0.0
    routed_split = mlp if m.is_moe else (0.0, 0.0)
    return LayerOps(
        params=m.layer_params(), params_split=m.layer_params(), params_expert=experts,
        gemms=tuple(gemms), attention=Attention(heads=m.num_attention_heads, kv_heads=m.kv_heads,
                                                head_dim=m.dhead, causal=m.causal,
                                                dropout=m.attention_dropout, softmax_fp32=m.softmax_fp32),
        experts=m.num_experts if m.is_moe else 0, top_k=m.experts_per_token if m.is_moe else 0,
        ew_rep=_pair(*rep_ops), ew_split=_pair(*split_ops),
        saved_rep=saved_rep,
        saved_split=(saved_split + gqa_repeat + mlp[0], saved_split + gqa_repeat + mlp[1]),
        saved_routed_rep=routed_rep, saved_routed_split=routed_split,
        saved_combine_rep=mlp_in if m.is_moe else 0.0,  # the combine's expert outputs (top_k x 2 h)
        saved_gemm_rep=ACT_BYTES * h + mlp_in, saved_gemm_split=ACT_BYTES * f_tok,
        saved_attn_out=ACT_BYTES * q,
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


def as_graph(model: LayerGraph | ModelSpec, seq_len: int) -> LayerGraph:
    """The one model representation: a LayerGraph as it is; a transformer ModelSpec generated at
    ``seq_len`` tokens per sample (transformer_graph, memoised)."""
    if isinstance(model, LayerGraph):
        return model
    return transformer_graph(model, int(seq_len))
