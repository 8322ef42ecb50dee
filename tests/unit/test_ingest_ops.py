"""Exact LayerOps from the trace (issue 12): ingestion fills ``LayerGraph.ops`` for every distinct
layer (ingest/ops.py), and the one cost path prices an ingested model like the analytic one.

Acceptance: Llama 2 7B from a Hugging Face config.json (traced on the meta device) and the
``llama2-7b`` preset (spec/transformer.py) give the same LayerOps block by block (GEMM shapes,
attention, saved bytes; the differences are the measured truth of HF's modules, docs/ingest.md
"Against the analytic transformer") and the same estimate within 2% on step time and peak memory
for 64 H100s, global batch 512, sequence 4096. Then the other families (BERT, RoBERTa, T5, ViT)
and the example modules of tests/data/modules (ResNet-50, a ViT, a GNN), whose FLOPs are checked
against hand counts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from meshplan.cost import estimate  # noqa: E402
from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.ingest import ingest  # noqa: E402
from meshplan.spec.graph import Attention, Gemm, LayerGraph  # noqa: E402
from meshplan.spec.io import load_cluster, load_model  # noqa: E402
from meshplan.spec.plan import Plan, Workload  # noqa: E402
from meshplan.spec.transformer import transformer_graph  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
HF = DATA / "hf"
LLAMA2_7B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
PLANS = [dict(dp=64, zero=1), dict(tp=2, dp=32, zero=3), dict(tp=4, pp=2, dp=8, sequence_parallel=True),
         dict(pp=4, dp=16, zero=1)]


def fwd_flops(graph: LayerGraph, block: str) -> float:
    """Forward FLOPs of one sample through a layer, from its LayerOps alone."""
    o, s = graph.ops[block], graph.sample_tokens
    lin = sum(2.0 * g.m * g.n * g.k * (o.top_k if g.expert else 1) for g in o.gemms)
    return s * lin + (4.0 * s * s * o.attention.q_dim if o.attention else 0.0)


@pytest.fixture(scope="module")
def llama2(tmp_path_factory) -> tuple[LayerGraph, LayerGraph]:
    path = tmp_path_factory.mktemp("llama2") / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    return ingest(f"hf:{path}", seq_len=4096, dtype="bfloat16"), transformer_graph(load_model("llama2-7b"), 4096)


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(DATA / "modules"))


# ---- Llama 2 7B: the acceptance test ---------------------------------------------------------------

def test_llama2_layer_ops_block_by_block(llama2):
    g, p = llama2
    assert [x.kind for x in g.layers] == ["embedding", *["block"] * 32, "head", "head"]
    assert g.params == load_model("llama2-7b").num_params()
    block, ref = g.ops["LlamaDecoderLayer"], p.ops["block"]
    h, q, f, v = 4096, 4096, 11008, 32000
    # GEMMs: q/k/v one column GEMM of one input (like the preset's fused qkv), o row, gate/up column, down row
    assert block.gemms == ref.gemms == (Gemm(n=3 * q, k=h, split="column"), Gemm(n=h, k=q, split="row"),
                                        Gemm(n=2 * f, k=h, split="column"), Gemm(n=h, k=f, split="row"))
    assert block.attention == ref.attention == Attention(heads=32, kv_heads=32, head_dim=128, causal=True)
    assert block.tp_allreduces == 2 and block.params == ref.params and set(block.tp_divides.values()) == {f}
    assert (block.hidden, block.saved_input, block.saved_rep) == (ref.hidden, ref.saved_input, ref.saved_rep)
    lse = 4 * 32  # the flash kernel's float32 log-sum-exp per token (the preset leaves it out)
    assert block.saved_split[0] == ref.saved_split[0] + lse
    # eager: rotary keeps no q-sized copies (HF's rotate_half, like the preset since issue 12)
    assert block.saved_split[1] == ref.saved_split[1] + lse
    # memory-bound bytes: eager RMSNorm/residual measured as the preset counts them (36 + 6 B per element)
    assert block.ew_rep[1] == pytest.approx(ref.ew_rep[1], rel=1e-3)
    cos_sin = 4 * 128 * 2  # q * cos, q' * sin, k * cos, k' * sin read a cos/sin row per token
    assert block.ew_split[0] == ref.ew_split[0] + cos_sin  # SwiGLU 6 B, rotary 4 B per element
    assert block.ew_split[1] == ref.ew_split[1] - 4 * (q + q) + cos_sin  # HF's rotary: 20 B, not 24 B
    assert block.ew_rep[0] == pytest.approx(1.5 * ref.ew_rep[0], rel=1e-3)  # fused groups: 18 h, not 12 h
    head, norm = g.ops["Linear"], g.ops["LlamaRMSNorm"]
    assert head.gemms == p.ops["head"].gemms == (Gemm(n=v, k=h, split="column"),)
    assert head.loss_vocab == v and head.loss_split and head.params_split == v * h and not head.fp8
    assert norm.params + head.params == p.ops["head"].params
    emb = g.ops["Embedding"]
    assert emb.params == emb.params_split == v * h and emb.ew_bwd_input == 0.0
    assert emb.ew_bwd_weight * emb.ew_whole == pytest.approx(2 * p.ops["embedding"].ew_whole, rel=1e-3)  # scatter-add
    # the FLOPs of the LayerOps are the traced FLOPs
    for x in g.layers:
        assert fwd_flops(g, x.block) == pytest.approx(x.fwd_flops, rel=1e-9), x.name


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("plan", PLANS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_llama2_estimate_matches_the_preset(llama2, plan, recompute):
    g, p = llama2
    cluster, work = load_cluster("h100-sxm-80gb:64"), Workload(global_batch=512, seq_len=4096)
    pl = Plan(**plan, recompute=recompute)
    a, b = estimate(p, cluster, pl, work), estimate(g, cluster, pl, work)
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=0.02)
    assert b.peak_memory_gib == pytest.approx(a.peak_memory_gib, rel=0.02)


def test_float32_ingest_takes_layer_ops_from_a_bf16_trace():
    """A float32 trace cannot see a bf16 run's fp32 upcasts (RMSNorm's math): the ops come from a
    second trace in bfloat16, the same as ingesting in bfloat16."""
    g32 = ingest(f"hf:{HF / 'llama-tiny.json'}", seq_len=64)
    g16 = ingest(f"hf:{HF / 'llama-tiny.json'}", seq_len=64, dtype="bfloat16")
    assert g32.trace_dtype == "float32" and g32.ops == g16.ops
    assert any("layer ops from a bfloat16 trace" in n for n in g32.notes)
    norm = g16.ops["LlamaDecoderLayer"].ew_rep[1] / 256  # eager bytes per hidden element
    assert 84 <= norm < 86  # 2 RMSNorms x 36 B + 2 residual adds x 6 B


# ---- every family: the LayerOps reproduce the traced FLOPs ---------------------------------------

SOURCES = {f: (f"hf:{HF / f'{f}-tiny.json'}", 64) for f in
           ("llama", "mistral", "mixtral", "qwen2", "gpt2", "bert", "roberta", "t5", "bart")}
SOURCES |= {"vit": (f"hf:{HF / 'vit-tiny.json'}", None), "resnet50": ("module:resnet50:make_resnet50_tiny", None),
            "vit-module": ("module:vit:make_vit_tiny", None), "gnn": ("module:gnn:make_gnn_tiny", None),
            "cnn": ("module:small_cnn:make_cnn", None)}


@pytest.mark.parametrize("name", list(SOURCES))
def test_layer_ops_reproduce_the_traced_flops(name, modules):
    source, seq = SOURCES[name]
    g = ingest(source, seq_len=seq, dtype="bfloat16")
    assert set(g.ops) == {x.block for x in g.layers}
    for x in g.layers:
        traced = x.fwd_flops - x.extra.get("loss_flops", 0.0)
        assert fwd_flops(g, x.block) == pytest.approx(traced, rel=1e-9, abs=1e-6), (name, x.name)
    assert sum(1 for o in g.ops.values() if o.loss_vocab) == 1
    assert g.ops[g.layers[-1].block].loss_vocab > 0


def test_families_estimate():
    """BERT, RoBERTa, T5 and ViT configs ingest and estimate, TP and pipelines included."""
    cluster = load_cluster("h100-sxm-80gb:8")
    for fam in ("bert", "roberta", "t5", "vit"):
        g = ingest(f"hf:{HF / f'{fam}-tiny.json'}", seq_len=None if fam == "vit" else 64, dtype="bfloat16")
        work = Workload(global_batch=16, seq_len=g.sample_tokens)
        blocks = sum(1 for x in g.layers if x.kind == "block")
        stages = (blocks - blocks // 2, blocks // 2)
        for plan in (Plan(dp=8), Plan(tp=2, dp=4, zero=1),
                     Plan(tp=2, pp=2, dp=2, recompute="full", stage_layers=stages)):
            if plan.pp > 1 and fam in ("bert", "roberta", "t5"):  # tied embeddings, an encoder-decoder:
                with pytest.raises(MeshplanError, match="cannot be cut into pipeline stages"):  # the runtime's
                    estimate(g, cluster, plan, work)  # refusal, from the graph's 'no pipeline:' note
                continue
            r = estimate(g, cluster, plan, work)
            assert r.step_time_s > 0 and 0 < r.peak_memory_gib < 80, (fam, plan)


def test_encoders_and_heads():
    bert = ingest(f"hf:{HF / 'bert-tiny.json'}", seq_len=64, dtype="bfloat16")
    layer = bert.ops["BertLayer"]
    assert layer.attention == Attention(heads=4, kv_heads=4, head_dim=32, causal=False)
    assert [(g.n, g.split) for g in layer.gemms] == [(384, "column"), (128, "row"), (512, "column"), (128, "row")]
    head = bert.ops["BertOnlyMLMHead"]  # transform (replicated) then the tied decoder (vocabulary-parallel)
    assert [(g.n, g.split) for g in head.gemms] == [(128, "none"), (1000, "column")]
    assert head.loss_vocab == 1000 and head.loss_split and bert.tied_split and bert.tied_params == 128000
    assert bert.ops["BertEmbeddings"].params_split == 1000 * 128  # the word table; positions replicated
    vit = ingest(f"hf:{HF / 'vit-tiny.json'}", dtype="bfloat16")  # 64x64 images, 16x16 patches: 17 tokens
    emb = vit.ops["ViTEmbeddings"]
    assert emb.gemms == (Gemm(n=128, k=3 * 16 * 16, m=16 / 17),)  # the patch convolution as its GEMM
    cls = vit.ops[vit.layers[-1].block]  # the classifier on the class token, not split
    assert cls.gemms == (Gemm(n=10, k=128, m=1 / 17),) and cls.loss_vocab == pytest.approx(10 / 17)
    assert not cls.loss_split


def test_t5_attention_over_half_the_tokens_is_two_gemms():
    """A T5 sample is source + target (2 s tokens); each attention sees s queries: QK^T and AV stay
    GEMMs of their shapes, the heads a width TP must divide. Both stacks are blocks."""
    g = ingest(f"hf:{HF / 't5-tiny.json'}", seq_len=64, dtype="bfloat16")
    assert g.sample_tokens == 128
    assert [x.kind for x in g.layers if "block" in x.name] == ["block"] * 6
    enc = g.ops[g.layers[[x.name for x in g.layers].index("encoder.block.1")].block]
    assert enc.attention is None and enc.tp_divides["attention heads"] == 4
    assert enc.gemms[:2] == (Gemm(n=64, k=32, m=2.0, split="column"), Gemm(n=32, k=64, m=2.0, split="column"))
    dec = g.ops[g.layers[[x.name for x in g.layers].index("decoder.block.1")].block]
    assert dec.tp_allreduces == 3 and len([x for x in dec.gemms if x.n == 64 and x.k == 32]) == 2
    assert g.ops[g.layers[-1].block].loss_vocab == 500  # the decoder's s logits per 2 s tokens


def test_moe_layer_ops():
    g = ingest(f"hf:{HF / 'mixtral-tiny.json'}", seq_len=64, dtype="bfloat16")
    o = g.ops["MixtralDecoderLayer"]
    assert (o.experts, o.top_k) == (4, 2)
    # the fused 3-D expert parameters stay whole under TP (the runtime does not split them): not split,
    # neither TP- nor EP-divided parameters (the runtime runs ingested models at ep=1)
    assert [g_ for g_ in o.gemms if g_.expert] == [Gemm(n=512, k=128, split="none", expert=True),
                                                  Gemm(n=128, k=256, split="none", expert=True)]
    assert Gemm(n=4, k=128) in o.gemms  # the router, replicated
    assert o.params_expert == 0 and o.params_split == 128 * (128 + 2 * 64 + 128) and o.tp_allreduces == 1


class EagerAttention(nn.Module):
    """Attention written out (matmul, softmax, matmul) and a column/row MLP."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        return x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))


class EagerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EagerAttention() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def example_inputs(self, batch_size: int, seq_len: int | None) -> torch.Tensor:
        return torch.randn(batch_size, seq_len or 16, 32)


def eager_net() -> nn.Module:
    return EagerNet()


def test_eager_attention_is_an_attention():
    """matmul -> softmax -> matmul over the sample's tokens is Attention(...): its GEMMs leave the
    GEMM list and its s x s scores the saved and memory-bound bytes (the cost model prices them)."""
    g = ingest(f"module:{__name__}:eager_net", seq_len=16, dtype="bfloat16")
    o = g.ops["EagerAttention"]
    assert o.attention == Attention(heads=4, kv_heads=4, head_dim=8, causal=False)
    # its qkv is fused (one nn.Linear): the runtime keeps it whole, so nothing of the layer is split
    assert o.gemms == (Gemm(n=96, k=32), Gemm(n=32, k=32)) and not o.splits
    assert o.saved_whole == 392  # x, the norm's statistics and output, q, k, v, the attention output ...;
    # no 16 x 16 scores (4 heads x 16 keys x 2 B = 128 per token each)
    assert fwd_flops(g, "EagerAttention") == pytest.approx(g.layers[0].fwd_flops)


# ---- the example modules: hand counts ----------------------------------------------------------

def resnet50_flops(width: int = 64, image: int = 224, classes: int = 1000) -> float:
    """Forward FLOPs of one image through ResNet-50, counted by hand (2 per multiply-add)."""
    hw = image // 2
    macs = hw * hw * width * 3 * 7 * 7  # stem 7x7 stride 2
    hw //= 2  # max-pool
    cin = width
    for stage, blocks in enumerate((3, 4, 6, 3)):
        w = width * 2 ** stage
        for i in range(blocks):
            stride = 2 if i == 0 and stage > 0 else 1
            out = hw // stride
            macs += hw * hw * w * cin + out * out * w * w * 9 + out * out * 4 * w * w
            if i == 0:
                macs += out * out * 4 * w * cin  # projection shortcut
            hw, cin = out, 4 * w
    return 2.0 * (macs + cin * classes)


def test_resnet50_convolutions_as_gemms(modules):
    g = ingest("module:resnet50:make_resnet50", dtype="bfloat16")
    assert g.sample_tokens == 1 and g.fwd_flops == pytest.approx(resnet50_flops(), rel=1e-9)
    assert abs(g.fwd_flops / 8.18e9 - 1) < 0.01  # the published 4.09 GMACs
    assert sum(fwd_flops(g, x.block) for x in g.layers) == pytest.approx(resnet50_flops(), rel=1e-9)
    stem = g.ops[g.layers[0].block]
    assert stem.gemms == (Gemm(n=64, k=3 * 49, m=112 * 112),)  # im2col: out channels, in x kernel, positions
    blocks = [x for x in g.layers if x.kind == "block"]
    assert len(blocks) == 16
    # issue 29: conv1 -> bn1 -> conv2 is a TP pair (column, row), conv3 and the shortcut stay whole;
    # the pair all-reduces conv2's output (w channels x positions, 2 B), not the block's (4 w channels)
    last = g.ops[blocks[-1].block]
    assert last.gemms == (Gemm(n=512, k=2048, m=49, split="column"), Gemm(n=512, k=512 * 9, m=49, split="row"),
                          Gemm(n=2048, k=512, m=49))
    assert last.tp_allreduces == 1 and last.tp_reduce == 512 * 49 * 2 and last.hidden == 2048 * 49 * 2
    assert last.params_split == 2048 * 512 + 512 * 512 * 9 + 2 * 512  # conv1, conv2, bn1's weight and bias
    assert last.tp_divides == {"conv1.out_channels": 512, "conv2.in_channels": 512}
    assert g.ops[g.layers[-1].block].loss_vocab == 1000 and not g.ops[g.layers[-1].block].loss_split


def test_vit_module_hand_count(modules):
    g = ingest("module:vit:make_vit", dtype="bfloat16")
    p, s, d, m, c = 196, 197, 768, 3072, 1000
    block = 2 * s * d * 3 * d + 2 * s * d * d + 4 * s * s * d + 2 * 2 * s * d * m
    assert g.sample_tokens == s
    assert g.fwd_flops == pytest.approx(2 * p * d * 3 * 16 * 16 + 12 * block + 2 * d * c, rel=1e-9)
    o = g.ops["Block"]
    assert o.attention == Attention(heads=12, kv_heads=12, head_dim=64, causal=False)
    assert o.gemms == (Gemm(n=3 * d, k=d, split="column"), Gemm(n=d, k=d, split="row"),
                       Gemm(n=m, k=d, split="column"), Gemm(n=d, k=m, split="row"))
    assert o.tp_allreduces == 2 and o.tp_divides == {"mlp.fc1.out_features": m, "mlp.fc2.in_features": m}
    assert g.ops["PatchEmbed"].gemms == (Gemm(n=d, k=3 * 16 * 16, m=p / s),)


def test_gnn_message_passing_as_a_gemm(modules):
    g = ingest("module:gnn:make_gnn", dtype="bfloat16")
    n, f, d, depth, c = 2048, 128, 256, 8, 16
    block = 2 * n * n * d + 2 * 2 * n * d * 2 * d  # adj @ h, then fc1 and fc2
    model = 2 * n * f * d + depth * block + 2 * n * d * c
    assert g.sample_tokens == n
    assert g.fwd_flops - sum(x.extra.get("loss_flops", 0.0) for x in g.layers) == pytest.approx(model, rel=1e-9)
    o = g.ops["GraphBlock"]
    # per node: the aggregation reads all n nodes' d features (replicated under TP), then the split MLP
    assert o.gemms == (Gemm(n=d, k=n), Gemm(n=2 * d, k=d, split="column"), Gemm(n=d, k=2 * d, split="row"))
    assert o.attention is None and o.tp_allreduces == 1 and o.saved_rep > 0 and o.ew_rep[0] > 0
    assert fwd_flops(g, "GraphBlock") == pytest.approx(block, rel=1e-9)


# ---- requests that do not suit the model ---------------------------------------------------------

def test_sequence_longer_than_the_positions_is_one_line():
    with pytest.raises(MeshplanError, match=r"seq_len 2048 exceeds the model's 128 positions "
                                            r"\(max_position_embeddings\) \(use --seq-len <= 128, or a config "
                                            r"with more positions"):
        ingest(f"hf:{HF / 'bert-tiny.json'}", seq_len=2048)
    # RoBERTa's positions start after the padding token: 130 rows, 128 positions
    with pytest.raises(MeshplanError, match=r"exceeds the model's 128 positions \(max_position_embeddings = 130, "
                                            r"of which 2 come before the first position"):
        ingest(f"hf:{HF / 'roberta-tiny.json'}", seq_len=129)
    assert ingest(f"hf:{HF / 'roberta-tiny.json'}").sample_tokens == 128


def test_image_models_take_their_tokens_from_the_config(tmp_path):
    with pytest.raises(MeshplanError, match=r"--seq-len 2048 does not suit ViTForImageClassification: it takes "
                                            r"64x64 images in 16x16 patches: 17 tokens per image"):
        ingest(f"hf:{HF / 'vit-tiny.json'}", seq_len=2048)
    assert ingest(f"hf:{HF / 'vit-tiny.json'}", seq_len=17).sample_tokens == 17  # what a plan file passes back
    cfg = json.loads((HF / "vit-tiny.json").read_text()) | {"patch_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MeshplanError, match="patch_size 128 is larger than image_size 64"):
        ingest(f"hf:{tmp_path}")
