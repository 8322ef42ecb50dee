"""Ingestion of ``module:package.module:factory`` sources (issue 5): CNNs, meshplan's own runtime
transformer (a hand-written MoE), the example-input/loss contract, and modules that cannot be traced
on the meta device (one-line MeshplanError naming the operation and what to do).

The factories below are the sources: ``module:<this test module>:<factory>``.
"""
from __future__ import annotations

import pytest

from meshplan.errors import MeshplanError

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from meshplan.ingest import build, ingest  # noqa: E402
from meshplan.spec.io import load_model  # noqa: E402

HERE = __name__
TASK = "classification"


def src(factory: str) -> str:
    return f"module:{HERE}:{factory}"


# ---- sources -------------------------------------------------------------------------------------

def example_inputs(batch_size: int, seq_len: int | None):
    """The module-level example input: images for the CNNs."""
    return torch.randn(batch_size, 3, 32, 32)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.conv2(F.relu(self.conv1(x))))


class ResNetish(nn.Module):
    """A stem, a ModuleList of identical residual blocks, a head; its own loss on given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(Residual(8) for _ in range(5))
        self.head = nn.Linear(8, 4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))

    def example_inputs(self, batch_size: int, seq_len: int | None) -> dict:
        return {"images": torch.randn(batch_size, 3, 16, 16)}


def resnetish() -> nn.Module:
    return ResNetish()


def loss(outputs: torch.Tensor, inputs) -> torch.Tensor:
    """Used by every factory of this module that has no loss method: mean square of the output."""
    return outputs.float().square().mean()


class TinyLM(nn.Module):
    """meshplan's runtime transformer (a ModuleDict of blocks, a hand-written top-k MoE)."""

    def __init__(self) -> None:
        super().__init__()
        from meshplan.runtime.models import Transformer

        self.spec = load_model("tiny-moe")
        self.net = Transformer(self.spec, 64)
        self.TASK = "causal-lm"
        self.SAMPLE_TOKENS = 64

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def example_inputs(self, batch_size: int, seq_len: int | None) -> tuple:
        return (torch.randint(0, self.spec.vocab_size, (batch_size, seq_len or 64)),)

    def loss(self, logits: torch.Tensor, inputs: tuple) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), inputs[0][:, 1:].reshape(-1))


def tiny_lm() -> nn.Module:
    return TinyLM()


class _Bad(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc, self.how = nn.Linear(8, 8), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.how == "item":
            return y / y.abs().max().item()
        if self.how == "mask":
            return y[y > 0].sum().reshape(1, 1)
        if self.how == "branch":
            return y if y.sum() > 0 else -y
        if self.how == "numpy":
            return torch.as_tensor(y.detach().numpy()) + y
        return y

    def example_inputs(self, batch_size: int, seq_len: int | None) -> torch.Tensor:
        return torch.randn(batch_size, 8)


def bad_item() -> nn.Module:
    return _Bad("item")


def bad_mask() -> nn.Module:
    return _Bad("mask")


def bad_branch() -> nn.Module:
    return _Bad("branch")


def bad_numpy() -> nn.Module:
    return _Bad("numpy")


def not_a_module() -> int:
    return 3


def raises() -> nn.Module:
    raise RuntimeError("checkpoint missing")


NOT_CALLABLE = 3


# ---- tests ---------------------------------------------------------------------------------------

def test_sequential_cnn():
    g = ingest(src("cnn"))
    assert g.task == "classification" and g.sample_tokens == 1
    assert g.params == sum(p.numel() for p in cnn().parameters())
    assert [x.name for x in g.layers] == [str(i) for i in range(12)] and all(x.kind == "block" for x in g.layers)
    conv1, conv2, conv3 = g.layers[0], g.layers[3], g.layers[6]
    assert conv1.fwd_flops == 2 * 3 * 9 * 16 * 32 * 32 and conv1.bwd_flops == conv1.fwd_flops  # no input grad
    assert conv2.fwd_flops == 2 * 16 * 9 * 16 * 32 * 32 and conv2.bwd_flops == 2 * conv2.fwd_flops
    assert conv2.block == conv3.block != conv1.block  # repeated blocks share an id
    assert g.layers[7].extra["measured"] == 0.0 and g.layers[7].block == g.layers[4].block  # 3rd BN: copied
    assert g.layers[2].saved_bytes == 16 * 32 * 32 * 4  # ReLU keeps its output
    assert g.layers[-1].output_bytes == 10 * 4  # logits
    assert all(x.tp_style == "none" for x in g.layers)


def test_module_list_blocks_and_own_example_inputs():
    g = ingest(src("resnetish"))
    assert [x.kind for x in g.layers] == ["embedding", *["block"] * 5, "head"]
    blocks = [x for x in g.layers if x.kind == "block"]
    assert len({x.block for x in blocks}) == 1
    assert [x.extra["measured"] for x in blocks] == [1.0, 1.0, 0.0, 0.0, 0.0]
    per_conv = 2 * 8 * 9 * 8 * 16 * 16
    assert all(x.fwd_flops == 2 * per_conv and x.params == 2 * (8 * 9 * 8 + 8) for x in blocks)
    assert not any("default" in n for n in g.notes)  # the module-level loss was used


def test_runtime_transformer_matches_the_analytical_model():
    """meshplan's runtime MoE transformer (ModuleDict experts, data-dependent routing) ingests
    with uniform routing; FLOPs and parameters equal the analytical model of its ModelSpec."""
    from meshplan.spec.transformer import transformer_graph

    spec, s = load_model("tiny-moe"), 64
    g = ingest(src("tiny_lm"))
    ref = transformer_graph(spec, s)

    def fwd(ops) -> float:
        lin = sum(2.0 * x.m * x.n * x.k * (ops.top_k if x.expert else 1) for x in ops.gemms)
        return s * lin + (4.0 * s * s * ops.attention.q_dim if ops.attention else 0.0)

    assert g.params == spec.num_params()
    assert g.fwd_flops + g.bwd_flops == pytest.approx(3 * sum(fwd(ref.ops[x.block]) for x in ref.layers), rel=1e-9)
    assert g.task == "causal-lm" and g.sample_tokens == 64
    blocks = [x for x in g.layers if x.kind == "block"]
    assert [x.name for x in blocks] == ["net.layers.0", "net.layers.1"]
    assert all(x.tp_style == "megatron" and x.tp_allreduces == 2 and x.tp_max == 4 for x in blocks)
    assert any("uniform routing" in n for n in g.notes)


def test_runtime_build_runs_real_routing_on_cpu():
    built = build(src("tiny_lm"), device="cpu", seq_len=16)
    batch = built.make_inputs(2)
    loss_value = built.step(batch)
    loss_value.backward()
    assert torch.isfinite(loss_value) and batch.args[0].shape == (2, 16)


def test_bfloat16_module():
    g = ingest(src("cnn"), dtype="bfloat16")
    assert g.trace_dtype == "bfloat16" and g.layers[2].saved_bytes == 16 * 32 * 32 * 2


@pytest.mark.parametrize("factory, op", [("bad_item", "Tensor.item()"), ("bad_mask", "aten.index"),
                                          ("bad_branch", "bool(tensor)"), ("bad_numpy", "Tensor.numpy()")])
def test_untraceable_modules_name_the_operation(factory, op):
    with pytest.raises(MeshplanError) as e:
        ingest(src(factory))
    msg = str(e.value)
    assert op in msg and "meta device" in msg and "\n" not in msg
    assert "test_ingest_module.py" in msg  # where, in the user's code
    assert "shape" in msg  # what to do


@pytest.mark.parametrize("factory, text", [
    ("not_a_module", "not a torch.nn.Module"), ("raises", "factory failed on the meta device"),
    ("NOT_CALLABLE", "not callable"), ("missing", "has no attribute"),
])
def test_factory_errors(factory, text):
    with pytest.raises(MeshplanError, match=text):
        ingest(src(factory))


def test_import_errors():
    with pytest.raises(MeshplanError, match="cannot import"):
        ingest("module:no_such_package.models:make")


def test_missing_example_inputs(monkeypatch):
    monkeypatch.delitem(globals(), "example_inputs")
    with pytest.raises(MeshplanError, match="example_inputs"):
        ingest(src("cnn"))


def test_tp_structure_of_hand_written_blocks():
    from meshplan.ingest import tp

    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=96)
    info = tp.analyse(layer)
    # in_proj->out_proj, linear1->linear2; but MultiheadAttention's in_proj_weight is fused q/k/v, which
    # the runtime keeps whole: an attention TP cannot split leaves the whole block whole
    assert (info.style, info.pairs, info.tp_max) == ("none", 0, 1) and info.attention_kept
    assert info.kept == ["self_attn.in_proj_weight is fused: kept whole"]

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(16, 48), nn.Linear(48, 16), nn.Linear(16, 48)

    class MoEBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 8)
            self.gate = nn.Linear(16, 4)
            self.experts = nn.ModuleList(MLP() for _ in range(4))
            self.shared_expert = MLP()

    info = tp.analyse(MoEBlock())
    assert info.pairs == 0 and info.attention_kept  # MultiheadAttention's fused in_proj: nothing split

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(16, 16) for _ in range(4))
            self.num_heads = 8

    block = MoEBlock()
    block.attn = Attention()
    info = tp.analyse(block)
    assert info.pairs == 2  # attention + one all-reduce for the experts and the shared expert
    assert info.tp_max == 8  # gcd(8 heads, 48)
    assert info.param_fraction < 1.0  # the router is replicated
    assert info.modules["attn.q_proj"] == "column" and info.modules["experts.3.w2"] == "row"
    assert tp.analyse(nn.Sequential(nn.Linear(4, 4), nn.ReLU())).style == "none"
