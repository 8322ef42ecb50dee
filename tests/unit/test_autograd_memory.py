"""The cost model's activation bytes per transformer block against what autograd saves.

Real Hugging Face models at full width (hidden size, heads, MLP, vocabulary as published; 2
layers, 256 tokens) are built from config objects on the meta device (no weights) in bf16, train
mode, and one forward runs under ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved
for backward is counted once per storage (its whole storage's bytes: a view keeps all of it alive),
parameters and buffers excluded, attributed to the decoder layer running. The second layer is
compared (the first also saves the rotary tables all layers share) with
``cost.layer.quantities`` of the matching preset's block (``spec.transformer``), tp = 1, one
sample, compile off (the eager counts), for each recompute policy and attention implementation:

  none       ``full``: everything the block keeps.
  full       ``inp``: Hugging Face's gradient checkpointing (re-entrant: the block's input is
             saved by the checkpoint function, nothing inside it).
  selective  ``full`` under recompute=selective: the attention core (eager_attention_forward or
             sdpa) runs under a re-entrant checkpoint that keeps its inputs q, k, v (Korthikanti
             et al. 2022's selective recomputation).

What runs as on a GPU, not as the meta/CPU kernels would: SDPA is the fused flash kernel
(ingest.trace's redirect: q, k, v, output and log-sum-exp kept, no s x s matrix), dropout with
0 < p < 1 is torch's fused ``native_dropout`` (a 1-byte bool mask; the CPU path keeps a 2-byte one),
and RMSNorm is a fused kernel keeping its input and 1/rms (Apex's, Megatron's, torch's CUDA
``_fused_rms_norm``): the convention of LayerOps' ``saved_rep`` (docs/ingest.md).
``test_python_rmsnorm_gap`` pins what Hugging Face's Python RMSNorm keeps on top (8 h per block).

What each family's block keeps beyond the dense Llama block, in the cost model from first
principles (spec.transformer), per token per block:

  Mixtral   the expert dispatch's gathered copy of the hidden state per routed expert (the expert
            GEMM's input, top_k x 2 h), the expert outputs the routing-weight multiply keeps
            (top_k x 2 h), the router's fp32 softmax and the fp32 routing weights (4 (E + top_k)
            B); the experts' SwiGLU intermediates per routed copy (8 B per element of f x top_k
            eager). Hugging Face's grouped_mm path and its per-expert loop keep the same.
  GPT-2     gelu_new, the tanh formula in PyTorch ops (ModelSpec ``gelu = "tanh-python"``): x,
            tanh(.), 0.5 x and 1 + tanh(.) (4 h-wide each, 2 B) plus the output the c_proj GEMM
            keeps, where one GELU kernel keeps x (MLP_SAVED_BYTES' eager and fused counts); the
            fused c_attn output is q, k and v in one storage (what the model counts for them);
            eager attention takes its softmax in bf16 with attention dropout (``softmax_fp32 =
            false``, ``attention_dropout = true``: 5 B per score). Learned positions and biases
            keep nothing per block.

Differences of Hugging Face's code from the cost model's reference (torchtitan/Megatron) that
are not bugs of either, added to the model's side explicitly (``hf_layout``; every term an exact
function of the shapes): with sdpa, k and v go to the kernel at their kv width (``enable_gqa``,
no repeat_kv) and under selective recomputation the repeat_kv of k and v happens inside the
recomputed core, so the kept k and v are kv wide: -4 (q - kv) for grouped-query models. The 2%
tolerance is the rounding the comparison cannot remove: the log-sum-exp (4 B per head per token)
and the norms' 1/rms (4 B per token), both under 0.2% of a block.
"""
from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from meshplan.cost.activations import score_bytes  # noqa: E402
from meshplan.cost.layer import quantities  # noqa: E402
from meshplan.cost.params import CostParams  # noqa: E402
from meshplan.ingest.trace import _sdpa_meta  # noqa: E402
from meshplan.spec.io import load_gpu, load_model  # noqa: E402
from meshplan.spec.plan import Plan  # noqa: E402
from meshplan.spec.transformer import transformer_graph  # noqa: E402

SEQ = 256
TOL = 0.02
GPU = load_gpu("h100-sxm-80gb")
T = transformers
FAMILIES = {  # preset: published config at full width (2 layers)
    "llama2-7b": lambda: T.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama3-8b": lambda: T.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "mistral-7b": lambda: T.MistralConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                          num_key_value_heads=8, vocab_size=32000, sliding_window=None),
    "qwen2-7b": lambda: T.Qwen2Config(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                      num_key_value_heads=4, vocab_size=152064),
    "mixtral-8x7b": lambda: T.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                            num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                                            num_experts_per_tok=2, sliding_window=None),
    "gpt2-medium": lambda: T.GPT2Config(n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024),
}


class _GpuKernels(TorchFunctionMode):
    """SDPA as the flash kernel, dropout as the fused native_dropout (what a CUDA run saves)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa_meta(*args, **kwargs)
        if func is F.dropout:
            x, p = args[0], kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            train = kwargs.get("training", args[2] if len(args) > 2 else True)
            if train and 0 < p < 1:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


class _FusedRMSNorm(torch.autograd.Function):
    """A fused RMSNorm kernel's autograd: keeps its input and 1/rms."""

    @staticmethod
    def forward(ctx, x, w, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return (x.float() * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        xn = x.float() * rstd
        gw = (g.float() * xn).sum(tuple(range(g.dim() - 1))).to(w.dtype)
        gx = g.float() * w.float()
        gx = rstd * (gx - xn * (gx * xn).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


def _fuse_norms(model):
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            eps = getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6))
            m.forward = lambda x, m=m, eps=eps: _FusedRMSNorm.apply(x, m.weight, eps)


def _checkpointed(core):
    def attention(module, q, k, v, mask, **kw):
        def run(q, k, v, *m):
            return core(module, q, k, v, m[0] if m else None, **kw)[0]
        args = (q, k, v) + ((mask,) if mask is not None else ())
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True), None
    return attention


def measure(preset: str, impl: str, recompute: str, fused_norm: bool = True, seq: int = SEQ) -> dict[str, float]:
    """Saved bytes per token by region (pre, L0, L1, post, loss) of one forward on meta."""
    cfg = FAMILIES[preset]()
    cfg.num_hidden_layers = 2
    cfg._attn_implementation = impl
    if recompute == "selective":
        cls = T.AutoModelForCausalLM._model_mapping[type(cfg)]
        mod = sys.modules[cls.__module__]
        core = mod.eager_attention_forward if impl == "eager" else T.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]
        T.AttentionInterface.register(f"checkpointed_{impl}_{preset}", _checkpointed(core))
        cfg._attn_implementation = f"checkpointed_{impl}_{preset}"
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.train()
    if fused_norm:
        _fuse_norms(model)
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    state = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    where, acc, seen, keep = ["pre"], {}, set(), []

    def pack(t):
        k = t.untyped_storage()._cdata
        if k not in state and k not in seen:
            seen.add(k)
            keep.append(t.untyped_storage())
            acc[where[0]] = acc.get(where[0], 0) + t.untyped_storage().nbytes()
        return t

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, f"L{i}"))
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "post"))
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    packed = T.masking_utils.find_packed_sequence_indices
    T.masking_utils.find_packed_sequence_indices = lambda position_ids: None  # one sequence; reads values
    try:
        with _GpuKernels(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(input_ids=ids, use_cache=False).logits
            where[0] = "loss"
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
    finally:
        T.masking_utils.find_packed_sequence_indices = packed
    return {k: v / seq for k, v in acc.items()}


def model_bytes(preset: str, impl: str, recompute: str, seq: int = SEQ) -> float:
    """The cost model's bytes per token of one block (tp = 1, one sample, compile off)."""
    spec = load_model(preset)
    ops = transformer_graph(spec, seq).ops["block"]
    plan = Plan(micro_batch=1, recompute=recompute, flash_attention=impl == "sdpa", compile=False)
    q = quantities(ops, plan, seq, GPU, CostParams())
    return q["inp"] if recompute == "full" else q["full"]


def hf_layout(preset: str, impl: str, recompute: str) -> float:
    """Bytes per token Hugging Face's code keeps beyond the cost model's reference block."""
    m = load_model(preset)
    if recompute == "full" or m.kv_heads == m.num_attention_heads:
        return 0.0
    if impl == "sdpa" or recompute == "selective":
        return -4.0 * (m.q_dim - m.kv_dim)  # k and v kept at kv width: no repeat_kv before them
    return 0.0


CASES = [(p, i, r) for p in FAMILIES for i in ("eager", "sdpa") for r in ("none", "full", "selective")]


@pytest.mark.parametrize(("preset", "impl", "recompute"), CASES)
def test_block_saved_bytes(preset, impl, recompute):
    got = measure(preset, impl, recompute)["L1"]
    want = model_bytes(preset, impl, recompute) + hf_layout(preset, impl, recompute)
    assert got == pytest.approx(want, rel=TOL), (preset, impl, recompute, got, want, got / want - 1)


def test_eager_scores_are_what_autograd_keeps():
    """Eager minus sdpa at the same block: the s x s bytes cost.activations prices, per family's
    softmax dtype (Llama: fp32 softmax + bf16 probabilities, 6 B per score)."""
    d = measure("llama2-7b", "eager", "none")["L1"] - measure("llama2-7b", "sdpa", "none")["L1"]
    lse = 4 * 32  # the flash kernel's log-sum-exp, per token, that eager does not keep
    assert d + lse == score_bytes("eager", dropout=False, softmax_fp32=True) * 32 * SEQ


def test_python_rmsnorm_gap():
    """Hugging Face's Python RMSNorm keeps an fp32 copy of its input (4 h) and the normalised
    bf16 tensor before the weight (2 h) where a fused kernel keeps the bf16 input (2 h): +4 h per
    norm, 8 h per block, which LayerOps' single-valued saved_rep (the fused count) leaves out."""
    h = 4096
    gap = measure("llama2-7b", "sdpa", "none", fused_norm=False)["L1"] - measure("llama2-7b", "sdpa", "none")["L1"]
    assert gap == pytest.approx(8 * h, abs=16)  # 1/rms: 4 B per token per norm, in both
