"""benchmarks/collective_channels.py (issue 26): NCCL's per-size channel/thread rule as the experiment
applies it, and its re-implementation of cost.comm's ring and tree (which must equal cost.comm's with
the rule off, or the experiment's comparison means nothing)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import collective_channels as cc  # noqa: E402

from meshplan.cost.comm import Group  # noqa: E402
from meshplan.validate import collectives as vc  # noqa: E402

KIB = 1024


def test_simple_keeps_every_channel_down_to_32_kib_each():
    assert cc.nccl_channels(32 * 32 * KIB, "ring", "simple", 8, 32) == (32, 512)
    assert cc.nccl_channels(32 * 32 * KIB - 1, "ring", "simple", 8, 32) == (31, 512)
    assert cc.nccl_channels(2 ** 20, "ring", "simple", 16, 8) == (8, 512)  # the AWS p4d 1 MiB row


def test_ring_ll_threshold_is_multiplied_by_ranks_only():
    # AWS's p4d log (16 ranks): "threadThresholds 8/8/64 | 128/8/64": ring/LL 8 x 16 per thread
    assert cc.nccl_channels(8 * 512 * 128, "ring", "ll", 16, 8) == (8, 512)
    assert cc.nccl_channels(8 * 512 * 128 - 1, "ring", "ll", 16, 8) == (7, 512)
    assert cc.nccl_channels(8 * 512 * 8, "tree", "ll", 16, 8) == (8, 512)


def test_threads_halve_at_one_channel_down_to_64():
    assert cc.nccl_channels(512 * 64 - 1, "ring", "simple", 8, 32) == (1, 256)
    assert cc.nccl_channels(8, "ring", "simple", 8, 32) == (1, 64)
    assert cc.nccl_channels(8, "ring", "ll128", 8, 32) == (1, 320)  # 640 -> 320, and 320 % 128 != 0 stops


@settings(max_examples=200, deadline=None)
@given(a=st.integers(1, 2 ** 34), b=st.integers(1, 2 ** 34), proto=st.sampled_from(["simple", "ll", "ll128"]),
       algo=st.sampled_from(["ring", "tree"]), ranks=st.integers(2, 64), nc=st.integers(1, 64))
def test_share_in_unit_interval_and_never_shrinks_with_size(a, b, proto, algo, ranks, nc):
    lo, hi = sorted((a, b))
    s_lo, s_hi = cc.share(lo, algo, proto, ranks, nc), cc.share(hi, algo, proto, ranks, nc)
    assert 0 < s_lo <= s_hi <= 1


def test_reimplementation_equals_cost_comm_with_the_rule_off():
    orig = Group._ring, Group._tree
    rows = [r for r in vc.load_rows() if r.scope == "modelled"]
    base = {r.row_id: vc.predict_busbw(r) for r in rows}
    Group._ring, Group._tree = cc._ring, cc._tree
    try:
        again = {r.row_id: vc.predict_busbw(r) for r in rows}
    finally:
        Group._ring, Group._tree = orig
    for k, v in base.items():
        assert again[k] == pytest.approx(v, rel=1e-9), k
