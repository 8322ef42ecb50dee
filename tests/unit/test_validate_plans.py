"""The steps validate.plans reads a published row's plan in, one by one (the whole row is in
test_validate_runs.py)."""
from __future__ import annotations

import pytest

from meshplan.spec.plan import AXES, AXIS_DESCRIPTIONS
from meshplan.validate.plans import (
    FREE_AXIS_ORDER,
    ROW_AXES,
    batch_sizes,
    kernels,
    parallel_degrees,
    reconcile_micro_batch,
    sharding,
    stage_split,
)
from meshplan.validate.rows import Row, Unsupported


def _read(cells: dict[str, str]):
    notes: list[str] = []
    return Row(cells), notes, notes.append


def test_the_rows_axes_are_the_plans_axes():
    assert sorted(ROW_AXES) == sorted(FREE_AXIS_ORDER) == sorted(AXES)
    assert tuple(AXIS_DESCRIPTIONS) == (*AXES, "ep")


def test_one_unstated_degree_absorbs_the_gpus():
    row, notes, assume = _read({"num_gpus": "64", "tp": "8", "pp": "2"})
    d = parallel_degrees(row, assume)
    assert (d.tp, d.pp, d.dp, d.cp, d.ep, d.n) == (8, 2, 4, 1, 1, 64)
    assert notes == ["cp, ep not stated: assumed 1", "dp not stated: derived num_gpus/(tp*pp*cp) = 4"]
    row, notes, assume = _read({"num_gpus": "64", "tp": "8", "pp": "2", "dp": "2"})
    assert parallel_degrees(row, assume).cp == 2  # cp is the one unstated degree
    row, notes, assume = _read({"num_gpus": "64", "tp": "8", "pp": "2", "dp": "2", "cp": "1"})
    d = parallel_degrees(row, assume)
    assert (d.dp, d.dp_as_stated) == (4, 2) and "dp=2 inconsistent with num_gpus=64" in notes[-1]
    row, _, assume = _read({"num_gpus": "64", "tp": "3"})
    with pytest.raises(Unsupported, match="not divisible"):
        parallel_degrees(row, assume)


def test_batch_and_micro_batch():
    row, notes, assume = _read({"global_batch_seqs": "64"})
    assert batch_sizes(row, "torchtitan", 8, assume) == (64, 8, None)
    assert notes == ["micro_batch not stated: torchtitan local batch = global_batch/dp = 8"]
    row, notes, assume = _read({"micro_batch": "2", "grad_accum": "4"})
    assert batch_sizes(row, "megatron", 8, assume) == (64, 2, 4)
    notes.clear()
    assert reconcile_micro_batch(96, 8, 5, None, assume) == 4  # 12 per rank: largest divisor <= 5
    assert "uneven micro-batches" in notes[0]


def test_hybrid_sharding_defaults_to_a_node():
    row, notes, assume = _read({"sharding": "HSDP", "num_gpus": "64"})
    deg = parallel_degrees(row, lambda _: None)._replace(tp=2)
    assert sharding(row, "torchtitan", deg, assume) == (3, 4)
    assert "shard within a node) = 4 ranks" in notes[-1]


def test_kernels_and_the_stage_split():
    row, notes, assume = _read({"other_settings": "cpu offload of parameters"})
    with pytest.raises(Unsupported, match="ZeRO-3"):
        kernels(row, "megatron", 1, assume)
    row, _, assume = _read({"other_settings": "torch.compile, async TP", "attention_impl": "flash"})
    k = kernels(row, "torchtitan", 3, assume)
    assert k.compile and k.async_tp and k.flash_attention and not k.fused_loss
    row, notes, assume = _read({})
    assert stage_split(row, "torchtitan", 30, 4, 1, 9, assume) == ((7, 8, 8, 7), 8)
    assert "uneven split" in notes[0]
