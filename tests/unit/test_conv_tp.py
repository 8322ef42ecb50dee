"""Tensor parallelism on convolutions (issue 29): which convolutions ingest/tp.py pairs (the one
function ingestion prices and the runtime splits), how the LayerOps and the cost model price the pairs
(split GEMMs and weights divided by tp, the row convolution's output all-reduced), and the search:
tp > 1 offered for CNNs whose channels divide it, refused with the reason where they do not or where
no block has a pair. The runtime's parity under tp=2: tests/dist/test_conv_tp_runtime.py."""
from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.ingest import ingest  # noqa: E402
from meshplan.ingest import tp as tpi  # noqa: E402
from meshplan.spec.graph import Gemm  # noqa: E402
from meshplan.spec.io import load_cluster  # noqa: E402
from meshplan.spec.plan import Plan, Workload  # noqa: E402

MODULES = Path(__file__).resolve().parents[1] / "data" / "modules"


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(MODULES))


def pairs(block: nn.Module) -> list[tuple[str, str, list[str]]]:
    return [(p.column, p.row, p.norms) for p in tpi.conv_pairs(block)]


def test_bottleneck_and_preactivation_blocks(modules: None) -> None:
    """ResNet's bottleneck: conv1 -> bn1 -> conv2 (conv3 and the shortcut stay whole, bn3 after the
    row convolution too); WRN's pre-activation block: conv1 -> bn2 -> relu2 -> dropout -> conv2."""
    import resnet50
    import wide_resnet
    b = resnet50.Bottleneck(64, 16, 2)
    assert pairs(b) == [("conv1", "conv2", ["bn1"])]
    info = tpi.analyse(b)
    assert info.style == "megatron" and info.pairs == info.conv_pairs == 1 and info.tp_max == 16
    assert info.convs == {"conv1": "column", "conv2": "row", "bn1": "channel"}
    assert info.roles == {"conv1.weight": "column", "conv2.weight": "row"}
    w = wide_resnet.PreActBlock(16, 32, 2)
    assert pairs(w) == [("conv1", "conv2", ["bn2"])] and tpi.analyse(w).tp_max == 32


class _Pair(nn.Module):
    def __init__(self, mid: nn.Module, *, groups: int = 1, cout: int = 8, conv: type = nn.Conv2d) -> None:
        super().__init__()
        self.a = conv(4, 8, 3, padding=1, groups=groups)
        self.mid = mid
        self.b = conv(cout, 4, 3, padding=1)


@pytest.mark.parametrize("block, why", [
    (_Pair(nn.GroupNorm(2, 8)), "a GroupNorm mixes channels"),
    (_Pair(nn.BatchNorm2d(8), groups=2), "a grouped convolution"),
    (_Pair(nn.Identity(), cout=4), "channels do not chain"),
    (_Pair(nn.Linear(8, 8)), "a module that is not channel-wise between them"),
])
def test_no_pair(block: nn.Module, why: str) -> None:
    assert pairs(block) == [], why


def test_pairs_need_one_parent_and_exact_classes() -> None:
    two = nn.Module()
    two.x = nn.Sequential(nn.Conv2d(4, 8, 1))
    two.y = nn.Sequential(nn.Conv2d(8, 4, 1))
    assert pairs(two) == []  # different parents: nothing says one feeds the other

    class MyConv(nn.Conv2d):  # a subclass may compute otherwise (weight standardisation ...)
        pass
    assert pairs(_Pair(nn.ReLU(), conv=MyConv)) == []
    assert pairs(_Pair(nn.ReLU())) == [("a", "b", [])]
    assert pairs(nn.Sequential(nn.Conv1d(4, 8, 3), nn.BatchNorm1d(8), nn.ReLU(), nn.Conv1d(8, 4, 3))) == \
        [("0", "3", ["1"])]


def test_wide_resnet_block_priced_split(modules: None) -> None:
    """WRN-10-2's second block (32 -> 64 channels, 16x16 -> 8x8): conv1 column, conv2 row, the
    shortcut whole; TP divides conv1, conv2 and bn2's parameters; each pass all-reduces conv2's
    output (64 channels x 64 positions x 2 B per image)."""
    g = ingest("module:wide_resnet:make_wrn_tiny", dtype="bfloat16")
    block = [x for x in g.layers if x.kind == "block"][1]
    o = g.ops[block.block]
    assert o.gemms == (Gemm(n=64, k=32 * 9, m=64, split="column"), Gemm(n=64, k=64 * 9, m=64, split="row"),
                       Gemm(n=64, k=32, m=64))
    assert o.params_split == 32 * 64 * 9 + 64 * 64 * 9 + 2 * 64
    assert o.tp_allreduces == 1 and o.tp_reduce == 64 * 64 * 2 == o.hidden
    assert o.tp_divides == {"conv1.out_channels": 64, "conv2.in_channels": 64}
    assert block.tp_style == "megatron" and block.tp_max == 64 and 0.9 < block.tp_fraction < 1.0


def test_tp_divides_the_split_weights(modules: None) -> None:
    """Weights (and gradients, optimizer state) per GPU under tp=2 are the unsplit parameters plus
    half the split ones."""
    from meshplan.cost import estimate
    from meshplan.spec.graph import layer_ops
    g = ingest("module:wide_resnet:make_wrn_tiny", dtype="bfloat16")
    ops = layer_ops(g)
    total = sum(ops[x.block].params for x in g.layers)
    split = sum(ops[x.block].params_split for x in g.layers)
    assert 0.5 < split / total < 1
    w = Workload(global_batch=8, seq_len=1)
    one = estimate(g, load_cluster("h100-sxm-80gb:1"), Plan(), w).memory
    two = estimate(g, load_cluster("h100-sxm-80gb:2"), Plan(tp=2), w).memory
    for part in ("weights", "grads", "optimizer"):
        assert two[part] / one[part] == pytest.approx((total - split / 2) / total, rel=1e-6), part


def test_tp_all_reduces_the_row_convolution_output(modules: None) -> None:
    """ResNet-50's bottleneck all-reduces conv2's output (w channels), a quarter of the block's
    (4 w): priced as if it were the block's output (tp_reduce = 0: tp_allreduces x hidden, exactly
    what tp_reduce = hidden gives), the TP communication is longer; the all-reduces' latency is the
    same, so the ratio stays below 4."""
    from meshplan.cost import estimate
    g = ingest("module:resnet50:make_resnet50", dtype="bfloat16")
    blocks = [g.ops[x.block] for x in g.layers if x.kind == "block"]
    assert all(o.tp_allreduces == 1 and o.tp_reduce * 4 == o.hidden for o in blocks)
    as_hidden = dataclasses.replace(g, ops={b: dataclasses.replace(o, tp_reduce=0.0) for b, o in g.ops.items()})
    c, w, p = load_cluster("h100-sxm-80gb:16"), Workload(global_batch=256, seq_len=1), Plan(tp=2, dp=8, micro_batch=32)
    same = dataclasses.replace(g, ops={b: dataclasses.replace(o, tp_reduce=o.hidden * o.tp_allreduces)
                                       for b, o in g.ops.items()})
    ours, theirs = estimate(g, c, p, w).time["tp_comm"], estimate(as_hidden, c, p, w).time["tp_comm"]
    assert estimate(same, c, p, w).time["tp_comm"] == pytest.approx(theirs, rel=1e-12)
    assert ours > 0 and 2 < theirs / ours < 4


def test_search_offers_tp_for_cnns(modules: None) -> None:
    """The done-when check of issue 29: a Wide-ResNet with a 2.7B-parameter block (WRN-18-24,
    6.4B parameters) fits 64 V100-16GB only with its convolutions split (tp > 1); with the pairs
    turned off nothing fits."""
    from meshplan.search import search
    from meshplan.search.space import SearchSpace
    g = ingest("module:wide_resnet:make_wide_resnet")
    assert max(x.params for x in g.layers) > 2.7e9
    cluster, work = load_cluster("v100-sxm-16gb:64"), Workload(global_batch=64, seq_len=1)
    res = search(g, cluster, work, SearchSpace(base=Plan(precision="fp16")))
    assert res.plans and res.best.report.fits and res.best.plan.tp > 1, res.rejected
    whole = dataclasses.replace(g, ops={b: dataclasses.replace(o, gemms=tuple(dataclasses.replace(x, split="none")
                                                                              for x in o.gemms),
                                                               params_split=0.0, tp_allreduces=0, tp_reduce=0.0,
                                                               tp_divides={})
                                        for b, o in g.ops.items()})
    assert not search(whole, cluster, work, SearchSpace(base=Plan(precision="fp16"))).plans


def test_channels_that_tp_does_not_divide(modules: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A WRN with 24-channel blocks: tp=16 is refused with the channels it does not divide (estimate),
    and the search rejects it for that reason; tp=8 runs."""
    from meshplan.cost import estimate
    from meshplan.search import search
    from meshplan.search.space import SearchSpace
    (tmp_path / "odd_wrn.py").write_text(textwrap.dedent("""
        from wide_resnet import WideResNet
        def make():
            return WideResNet((24, 48, 96), 1, 16, 10, imagenet=False)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    g = ingest("module:odd_wrn:make", dtype="bfloat16")
    cluster, work = load_cluster("h100-sxm-80gb:16"), Workload(global_batch=64, seq_len=1)
    with pytest.raises(MeshplanError, match=r"tp=16 does not divide conv1\.out_channels=24"):
        estimate(g, cluster, Plan(tp=16), work)
    res = search(g, cluster, work, SearchSpace(tp=(8, 16)))
    assert res.rejected["tp does not divide layer widths"] > 0
    assert res.plans and {p.plan.tp for p in res.plans} == {8}


def test_no_pair_refused_with_the_reason(modules: None) -> None:
    """small_cnn has one convolution per block: no pair, tp > 1 refused by the planner and the runtime."""
    from meshplan.cost import estimate
    from meshplan.ingest.builder import build
    from meshplan.runtime.generic import split_of
    g = ingest("module:small_cnn:make_cnn", dtype="bfloat16")
    with pytest.raises(MeshplanError, match="no layer of the model has linear layers tensor parallelism can split"):
        estimate(g, load_cluster("h100-sxm-80gb:2"), Plan(tp=2), Workload(global_batch=8, seq_len=1))
    why = split_of(build("module:small_cnn:make_cnn", device="meta")).refusal
    assert why is not None and "pair of convolutions" in why
