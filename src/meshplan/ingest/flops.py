"""FLOP formulas: torch.utils.flop_counter's registry plus the ops it lacks.

Ingestion traces attention as the fused CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, see trace.py), which FlopCounterMode does
not know. Its forward is counted like the other SDPA kernels (QK^T and AV: 4 s_q s_k d per head,
no causal halving: the PaLM/Megatron model-FLOPs convention meshplan's cost model uses). Its
backward is counted as the 4 GEMMs of the gradients (dV, dP, dQ, dK = 2x the forward), i.e. model
FLOPs; the flash kernel's recomputation of QK^T (0.5x the forward) is left out here and reported in
``LayerSpec.extra['attn_recompute_flops']``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

aten = torch.ops.aten


def _flash_cpu_fwd(query, key, value, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _flash_cpu_bwd(grad_out, query, key, value, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return 2 * sdpa_flop_count(query, key, value)


EXTRA_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_bwd,
}

ATTENTION_FWD = {
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    aten._flash_attention_forward, aten._efficient_attention_forward,
}
ATTENTION_BWD = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward,
    aten._flash_attention_backward, aten._efficient_attention_backward,
}


def registry() -> dict[Any, Any]:
    """OpOverloadPacket -> formula(*args, out_val=..., **kwargs) -> FLOPs (FlopCounterMode's + ours)."""
    mine = {k: v for k, v in EXTRA_FORMULAS.items()}
    return FlopCounterMode(display=False, custom_mapping=mine).flop_registry
