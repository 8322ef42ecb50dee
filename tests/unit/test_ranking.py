"""Ranking within sweeps (validate.ranking): Spearman, plan quality, out-of-memory picks."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.validate.ranking import RankRow, score_sweeps, spearman


def row(i: int, meas: float | None, pred: float, rec: bool = True, fits: bool | None = True,
        sweep: str = "S") -> RankRow:
    return RankRow(str(i), "src", sweep, meas, pred, rec, fits)


def test_spearman_known_values() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert math.isclose(spearman([1, 2, 3, 4], [40, 30, 20, 10]), -1.0)
    # one swap of four: 1 - 6 * sum d^2 / (n (n^2 - 1)) = 1 - 6 * 2 / 60 = 0.8
    assert math.isclose(spearman([1, 2, 3, 4], [1, 3, 2, 4]), 0.8)
    # ties get their mean rank: x ranks 1.5 1.5 3 4
    expected = 0.9486832980505138
    assert math.isclose(spearman([1, 1, 2, 3], [1, 2, 3, 4]), expected)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_quality_and_out_of_memory_pick() -> None:
    rows = [row(1, 10.0, 9.0), row(2, 11.0, 8.0), row(3, 12.0, 12.0), row(4, 13.0, 13.0),
            row(5, None, 7.0, fits=False)]  # ran out of memory, predicted fastest and recommended
    s = score_sweeps(rows)["sweeps"][0]
    assert s["pick"] == "5" and s["pick_ran_oom"] and s["plan_quality"] == 0.0
    assert s["runs"] == 4 and s["oom_runs"] == 1
    # not recommended (at-risk): the pick is the fastest predicted of the rest, row 2 (11 s; best 10 s)
    rows[-1] = row(5, None, 7.0, rec=False, fits=False)
    s = score_sweeps(rows)["sweeps"][0]
    assert s["pick"] == "2" and not s["pick_ran_oom"] and math.isclose(s["plan_quality"], 10.0 / 11.0, rel_tol=1e-3)
    assert s["best"] == "1"


def test_small_sweeps_only_count_in_pairs() -> None:
    rows = [row(1, 1.0, 1.0, sweep="A"), row(2, 2.0, 3.0, sweep="A"), row(3, 3.0, 2.0, sweep="A")]
    out = score_sweeps(rows)
    assert out["sweeps"] == [] and out["summary"]["pairs"] == 3 and out["summary"]["pairs_ordered_right"] == 2


def test_no_recommended_plan() -> None:
    out = score_sweeps([row(i, float(i), float(i), rec=False) for i in range(1, 6)])
    assert out["sweeps"][0]["no_pick"] and out["summary"]["sweeps_without_a_pick"] == 1


times = st.lists(st.integers(10, 10_000), min_size=4, max_size=12, unique=True).map(lambda xs: [x / 100 for x in xs])


@settings(max_examples=60, deadline=None)
@given(times, st.floats(0.5, 3.0))
def test_a_monotone_prediction_ranks_perfectly(meas: list[float], scale: float) -> None:
    rows = [row(i, m, scale * m ** 1.3) for i, m in enumerate(meas)]
    out = score_sweeps(rows)
    s = out["sweeps"][0]
    assert math.isclose(s["spearman"], 1.0) and s["plan_quality"] == 1.0
    assert out["summary"]["pairwise_accuracy"] == 1.0


@settings(max_examples=60, deadline=None)
@given(times, st.lists(st.floats(0.1, 100.0, allow_nan=False), min_size=12, max_size=12),
       st.lists(st.booleans(), min_size=12, max_size=12))
def test_quality_is_a_fraction_and_spearman_bounded(meas: list[float], pred: list[float], rec: list[bool]) -> None:
    rows = [row(i, m, pred[i], rec=rec[i]) for i, m in enumerate(meas)]
    s = score_sweeps(rows)["sweeps"][0]
    assert s["plan_quality"] is None or 0.0 < s["plan_quality"] <= 1.0
    assert s["spearman"] is None or -1.0 - 1e-9 <= s["spearman"] <= 1.0 + 1e-9
