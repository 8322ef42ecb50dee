"""Saved activation bytes under precision=fp8, derived by hand from what Transformer Engine keeps.

TE's Linear (transformer_engine/pytorch/module/linear.py, ``_Linear.forward``) keeps the fp8-cast
GEMM input for the weight-gradient GEMM (``saved_inputmat = inputmat``, the quantized tensor),
not the 16-bit one; LayerNormLinear keeps its 16-bit norm input and the fp8 norm output (the
q/k/v GEMM's input); LayerNormMLP keeps its 16-bit fc1 output (the activation's backward reads
it) and the activation's output written in fp8 (``activation_func(fc1_out,
fc2_input_quantizer)``: the fc2 GEMM's input). The flash attention kernel keeps its 16-bit output
for its own backward, so the o-projection's fp8 copy of it comes on top. Per token, bytes:

  q/k/v input (norm 1 output, h)     2 h -> 1 h        -h
  o-projection input (core out, q)   2 q -> 2 q + 1 q  +q   (flash; -q when only the GEMM keeps it)
  MLP-in input (norm 2 output, h)    2 h -> 1 h        -h   (a MoE: the router keeps it 16-bit;
                                                             the top_k dispatched copies halve)
  MLP-out input (f per routed copy)  2 f -> 1 f        -f
"""
from __future__ import annotations

import pytest

from meshplan.cost.layer import quantities
from meshplan.cost.params import CostParams
from meshplan.spec.io import load_gpu, load_model
from meshplan.spec.plan import Plan
from meshplan.spec.transformer import transformer_graph

GPU = load_gpu("h100-sxm-80gb")
SEQ = 4096


def _full(preset: str, precision: str, layer: str = "block", **plan) -> float:
    ops = transformer_graph(load_model(preset), SEQ).ops[layer]
    kw = dict(micro_batch=1, recompute="none", flash_attention=True, compile=False) | plan
    return quantities(ops, Plan(precision=precision, **kw), SEQ, GPU, CostParams())["full"]


@pytest.mark.parametrize("compile_", [False, True])
def test_dense_block_flash(compile_):
    m = load_model("llama2-7b")
    h, q, f = m.hidden_size, m.q_dim, m.ffn_hidden_size
    bf16 = _full("llama2-7b", "bf16", compile=compile_)
    assert _full("llama2-7b", "fp8", compile=compile_) - bf16 == pytest.approx(-h + q - h - f)


def test_dense_block_selective_core_recomputed():
    """Selective recomputation: the checkpointed core's output is kept by the o-projection alone."""
    m = load_model("llama2-7b")
    h, q, f = m.hidden_size, m.q_dim, m.ffn_hidden_size
    bf16 = _full("llama2-7b", "bf16", recompute="selective")
    assert _full("llama2-7b", "fp8", recompute="selective") - bf16 == pytest.approx(-h - q - h - f)


def test_tensor_and_sequence_parallel_split_the_change():
    m = load_model("llama3-8b")
    h, q, f = m.hidden_size, m.q_dim, m.ffn_hidden_size
    kw = dict(tp=4, sequence_parallel=True)
    change = _full("llama3-8b", "fp8", **kw) - _full("llama3-8b", "bf16", **kw)
    assert change == pytest.approx((-2 * h) / 4 + (q - f) / 4)


def test_moe_dispatched_copies():
    m = load_model("mixtral-8x7b")
    h, q, f, k = m.hidden_size, m.q_dim, m.expert_ffn, m.experts_per_token
    change = _full("mixtral-8x7b", "fp8") - _full("mixtral-8x7b", "bf16")
    assert change == pytest.approx(-h - k * h + q - k * f)


def test_bf16_head_and_other_precisions_unchanged():
    """The output layer stays bf16 under fp8 (LayerOps.fp8 False): nothing changes there."""
    assert _full("llama2-7b", "fp8", layer="head") == _full("llama2-7b", "bf16", layer="head")
    ops = transformer_graph(load_model("llama2-7b"), SEQ).ops["block"]
    assert ops.saved_gemm_rep == 2 * 2 * load_model("llama2-7b").hidden_size  # two norm outputs, 2 B each
