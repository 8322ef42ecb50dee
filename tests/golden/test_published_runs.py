"""Golden test: the cost model against the published runs of shared/data (shipped copy).

These bounds are regression guards at the in-sample accuracy the built-in calibration reaches
today (see docs/cost-model.md). The headline accuracy is out of sample (`meshplan validate
--cross-validate`, benchmarks/cross_validate.py): the built-in calibration is fitted with
first-principles priors and each source weighted by the square root of its rows, which costs
some in-sample accuracy on the shared rows (4.0% -> 4.5%) for out-of-sample accuracy.
"""
from __future__ import annotations

import pytest

from meshplan.validate.report import default_runs_path, validate
from meshplan.validate.runs import load_runs


@pytest.fixture(scope="module")
def cases():
    return {c.row_id: c for c in load_runs(default_runs_path())}


SHARED_SOURCES = ("MEG_SC21_T1", "KOR22_T5", "TT_2024_A100", "TT_2412_H100", "MOSAIC_LLMFOUNDRY",
                  "BLOOM176B")
"""The sources of the shared/data copy (186 rows): the regression guards below are theirs; the
rows added after it (src/meshplan/data/README.md) are reported by `meshplan validate`, not bounded."""


@pytest.fixture(scope="module")
def result(cases):
    return validate([c for c in cases.values() if c.source_id in SHARED_SOURCES])


def test_every_dev_row_is_expressible(result, cases):
    assert result["summary"]["ok"] == 186 and result["summary"]["unsupported"] == 0
    assert all(c.ok for c in cases.values()), [c.row_id for c in cases.values() if not c.ok]


def test_step_time_accuracy(result):
    s = result["summary"]
    assert s["step_time_mape_pct"] <= 4.7
    assert s["step_time_max_abs_pct"] <= 32.0
    assert sum(abs(r["step_time_error_pct"]) > 20 for r in result["rows"]) <= 5
    # BLOOM176B 2.2% -> 5.5% on 2026-12-08: DeepSpeed's pipeline engine sends 1/tp of each activation
    # (engine.py is_pipe_partitioned), which made its sends 8x cheaper; the production script also ran with
    # CUDA_LAUNCH_BLOCKING=1 (tr11-176B-ml.slurm from 2022-03-02), which the shared rows do not state, so its
    # launch cost is not charged to them (rows 1..1314 stay byte-for-byte the shared copy)
    bounds = {"MEG_SC21_T1": 4.2, "KOR22_T5": 2.6, "TT_2024_A100": 4.8, "TT_2412_H100": 6.8,
              "MOSAIC_LLMFOUNDRY": 4.6, "BLOOM176B": 6.0}
    for src, bound in bounds.items():
        assert s["by_source"][src]["mape_pct"] <= bound, src


def test_peak_memory_accuracy(result):
    s = result["summary"]
    # 4.4% / 12.2% since issue 27's memory refit: the framework overhead is fitted to the allocator-measured
    # peaks of every codebase (0.14 GiB; 0.80 when only these reserved rows informed it), which leaves the
    # torchtitan rows about 0.7 GiB (~1%) lower; they were 3.6% / 11.4%
    assert s["memory_rows"] == 18 and s["memory_mape_pct"] <= 4.6
    errors = [r["memory_error_pct"] for r in result["rows"] if r["memory_error_pct"] is not None]
    assert len(errors) == 18 and max(abs(e) for e in errors) <= 12.5


def test_runs_that_ran_are_predicted_to_fit_or_within_the_margin(result, cases):
    # Every dev run trained: a predicted OOM is allowed only inside the stated safety margin.
    from meshplan.cost import DEFAULT_PARAMS
    for r in result["rows"]:
        if r["predicted_fits"] is False:
            hbm = cases[r["row_id"]].cluster.gpu.memory_gib
            assert hbm * (1 - DEFAULT_PARAMS.memory_margin) < r["predicted_peak_memory_gib"] <= hbm
