"""Named constants of the layer-graph cost model (cost/graph.py), with unit and source.

They stand in for details a LayerGraph may lack. Ingestion can give the real values per layer
in ``LayerSpec.extra`` (keys in ``EXTRA_KEYS``); these defaults are used only where it did not.
Everything else (GEMM shape factors, attention and HBM efficiencies, collectives, ZeRO bytes,
memory overheads) comes from ``meshplan.cost.params.CostParams`` and the GPU data files, as in
the transformer cost model.
"""
from __future__ import annotations

PARAMS_PER_SQUARED_WIDTH = 4.0
"""Weights per gemm_dim^2 of a layer (dimensionless, DERIVED), for the default GEMM dimension
sqrt(weights / 4) when ``extra['gemm_dim']`` is absent. gemm_dim is the FLOP-weighted geometric
mean over the layer's weight matrices of sqrt(in x out) (see EXTRA_KEYS); for a transformer
block weights / gemm_dim^2 is 3.6 (GPT: h x 3h, h x h, h x 4h, 4h x h: gemm_dim = 1.82 h,
12 h^2 weights) to 4.3 (Llama 3 8B: gemm_dim = 1.73 h). For a single matrix it is 1, so the
default under-estimates such a layer's width by 2x (ingest should give gemm_dim). The weights
of a layer include tied ones it uses but does not own (graph.tied_params, at the head)."""

MEM_BYTES_PER_SAVED_BYTE = 1.0
"""Forward HBM bytes of memory-bound ops (norms, activations, residual adds, dropout) per byte
of saved activations (dimensionless, DERIVED) when ``extra['mem_bytes']`` is absent. From the
transformer cost model: a fused GPT block moves ~28-30 h bytes per token in elementwise kernels
(cost/compute.py ELEMENTWISE_BYTES) and saves ~32-34 h (Korthikanti et al. 2022): ~0.9. An
eager Llama block (Python RMSNorm, complex rotary) moves ~3.4x its saved bytes, so this
default under-counts eager models: ingest should measure mem_bytes."""

REPLICATED_PER_PAIR = 2.0
"""Output-sized activations each Megatron column->row pair keeps whole on every TP rank
(count, DERIVED): the input and output of the norm before the pair (without sequence
parallel). Korthikanti et al. 2022: a transformer block's replicated activations are 4 x 2sbh
bytes (two pairs) plus dropout masks. Used for the default tp_saved_fraction."""

DEFAULT_HEAD_DIM = 128.0
"""Attention head dimension assumed when ``extra['head_dim']`` is absent (elements): 128 is the
reference of CostParams.attn_headdim_half's factor (factor 1 at 128)."""

EXTRA_KEYS: dict[str, str] = {
    "gemm_dim": "representative weight dimension of the layer's matrix multiplies, elements: the "
                "FLOP-weighted geometric mean of sqrt(in_features x out_features) over its weight "
                "matrices (default sqrt(weights / PARAMS_PER_SQUARED_WIDTH))",
    "attention_flops": "forward FLOPs per sample of the attention core (QK^T, AV; counted over the "
                       "full s x s as FlopCounterMode counts sdpa), included in fwd_flops (default 0)",
    "attention_bwd_flops": "backward FLOPs per sample of the attention core included in bwd_flops "
                           "(default 2 x attention_flops: dQ, dK, dV, dP, the model-FLOPs convention)",
    "attention_causal": "1 when the attention is causal: FlashAttention skips the masked half of "
                        "attention_flops (default 0)",
    "head_dim": "attention head dimension (default DEFAULT_HEAD_DIM)",
    "mem_bytes": "forward HBM bytes per sample of memory-bound ops at trace_dtype "
                 "(default MEM_BYTES_PER_SAVED_BYTE x saved_bytes)",
    "bwd_weight_flops": "weight-gradient FLOPs per sample, included in bwd_flops "
                        "(default: fwd_flops - attention_flops, at most bwd_flops)",
    "tp_saved_fraction": "fraction of saved_bytes and mem_bytes that TP divides (default: tp_fraction of "
                         "what is left after REPLICATED_PER_PAIR x tp_allreduces x output_bytes)",
}
"""``LayerSpec.extra`` keys the graph cost model reads, and what each means."""
