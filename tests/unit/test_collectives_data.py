"""The collective-level validation rows (data/collectives_dev.csv) and their scoring (validate.collectives)."""
from __future__ import annotations

import csv

import pytest

from meshplan.cost.comm import COLLECTIVES
from meshplan.errors import MeshplanError
from meshplan.spec.io import preset_names
from meshplan.spec.links import KIND_DEFAULTS
from meshplan.validate.collectives import (COLUMNS, ESTIMATED_KINDS, cluster_for, default_path,
                                           estimate_kind_efficiency, load_rows, predict_busbw,
                                           validate_collectives, to_text)


@pytest.fixture(scope="module")
def rows():
    return load_rows()


def test_data_is_sized_and_cited(rows):
    assert len(rows) >= 25
    assert len({r.source_id for r in rows}) >= 4
    for r in rows:
        assert r.citation.startswith("https://"), r.row_id
        assert r.collective in COLLECTIVES and r.gpu in preset_names("gpus")
    assert sum(r.nbytes >= 256 * 2 ** 20 for r in rows) >= 15  # bandwidth-bound rows dominate
    assert any(r.nbytes <= 2 ** 20 for r in rows)  # and some latency-bound ones


def test_published_times_give_the_published_busbw(rows):
    """Where a time is published, nccl-tests' busbw formula reproduces the published busbw."""
    timed = [r for r in rows if r.time_us is not None]
    assert len(timed) >= 10
    for r in timed:
        assert r.derived_busbw_gbs == pytest.approx(r.busbw_gbs, rel=2e-3), r.row_id


def test_row_links_override_the_preset(rows):
    jz = next(r for r in rows if r.source_id == "bigscience")
    c = cluster_for(jz)
    assert c.inter_node.kind == "omnipath" and c.inter_node.bandwidth_gbps == 1.5625  # the one HFI NCCL used
    assert c.intra_node.bandwidth_gbps == 100.0
    efa = next(r for r in rows if r.inter_kind == "efa")
    assert cluster_for(efa).inter_node.efficiency == KIND_DEFAULTS["efa"].efficiency


@pytest.mark.parametrize("kind", ESTIMATED_KINDS)
def test_table_matches_the_estimate_from_the_rows(rows, kind):
    """spec.links' 'estimated' entries are what the rows give (to the table's two decimals)."""
    est = estimate_kind_efficiency(rows, kind)
    assert est is not None
    assert KIND_DEFAULTS[kind].efficiency == pytest.approx(est, abs=0.006)


def test_predictions_are_positive_and_bounded(rows):
    for r in rows:
        p = predict_busbw(r)
        assert 0 < p < 2 * cluster_for(r).intra_node.bandwidth_gbps * 2


def test_result_has_the_section(rows):
    res = validate_collectives()
    s = res["summary"]
    assert s["rows"] == len(rows) and s["sources"] == len({r.source_id for r in rows})
    assert len(res["rows"]) == len(rows) and s["mean_abs_error_pct"] is not None
    assert set(s["per_source"]) == {r.source_id for r in rows}
    text = to_text(res)
    assert text.startswith(f"Collectives: predicted vs measured bus bandwidth (nccl-tests busbw, GB/s) of {len(rows)}")
    assert "mean abs error" in text and "worst:" in text


def test_bad_csv_is_a_clear_error(tmp_path):
    with open(default_path()) as f:
        good = list(csv.DictReader(f))[0]
    p = tmp_path / "c.csv"

    def write(row):
        with open(p, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerow(row)

    write({**good, "collective": "allreduce"})
    with pytest.raises(MeshplanError, match="unknown collective"):
        load_rows(p)
    write({**good, "busbw_gbs": "fast"})
    with pytest.raises(MeshplanError, match="not a number"):
        load_rows(p)
    write({**good, "ranks": "64"})
    with pytest.raises(MeshplanError, match="ranks"):
        load_rows(p)
    with pytest.raises(MeshplanError, match="cannot read"):
        load_rows(tmp_path / "missing.csv")


def test_p4d_rows_are_efa_v1(rows):
    """Every p4d (A100-40GB over EFA) row is priced as EFA v1, not with the p5en/p6 efficiency."""
    p4d = [r for r in rows if r.gpu == "a100-sxm-40gb" and r.nodes > 1]
    assert len({r.source_id for r in p4d}) >= 2
    for r in p4d:
        assert r.inter_kind == "efa-v1"
        assert cluster_for(r).inter_node.efficiency == KIND_DEFAULTS["efa-v1"].efficiency
