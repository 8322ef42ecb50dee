"""pp_p2p_overlap: which schedules overlap their pipeline sends (an implementation profile's
field), and the one function (cost.params.p2p_exposed) that turns it into the exposed fraction."""
from __future__ import annotations

import csv

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost.params import DEFAULT_PARAMS, P2P_OVERLAP, p2p_exposed
from meshplan.cost.profile import PROFILE_FIELDS, PROFILES, get_profile, load_profile
from meshplan.errors import MeshplanError
from meshplan.validate import default_runs_path
from meshplan.validate.runs import case_from_row


def test_field_is_a_profile_field_with_cited_defaults() -> None:
    assert PROFILE_FIELDS["pp_p2p_overlap"] == P2P_OVERLAP
    assert DEFAULT_PARAMS.pp_p2p_overlap == "none" and DEFAULT_PARAMS.pp_p2p_exposed == 1.0
    want = {"meshplan": "none", "megatron": "interleaved", "nemo": "interleaved", "megatron-deepspeed": "none",
            "deepspeed": "none", "torchtitan": "none"}
    for name, value in want.items():
        prof = PROFILES[name]
        assert prof.apply(DEFAULT_PARAMS).pp_p2p_overlap == value
        assert prof.sources["pp_p2p_overlap"], name  # each states the codebase default it follows
    # profiles without a pipeline engine keep the class default
    assert get_profile("llm-foundry").apply(DEFAULT_PARAMS).pp_p2p_overlap == "none"


def test_describe_shows_the_field() -> None:
    lines = get_profile("megatron").describe()
    line = next(x for x in lines if x.startswith("pipeline sends:"))
    assert "interleaved" in line and "overlap_p2p_comm" in line
    assert any(x.startswith("pipeline sends: blocking") for x in get_profile("deepspeed").describe())


def test_exposed_fraction_by_schedule() -> None:
    none, inter, every = (DEFAULT_PARAMS.replace(pp_p2p_overlap=v) for v in P2P_OVERLAP)
    assert p2p_exposed(none, 4) == 1.0 and p2p_exposed(none) == 1.0
    assert p2p_exposed(inter, 1) == 1.0 and p2p_exposed(inter, 2) == 0.0
    assert p2p_exposed(every, 1) == 0.0
    half = none.replace(pp_p2p_exposed=0.5)
    assert p2p_exposed(half, 3) == 0.5
    v = np.array([1, 2, 1, 8])
    assert p2p_exposed(inter, v).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert p2p_exposed(none, v).tolist() == [1.0] * 4 and p2p_exposed(every, v).tolist() == [0.0] * 4
    with pytest.raises(MeshplanError, match="pp_p2p_overlap"):
        p2p_exposed(DEFAULT_PARAMS.replace(pp_p2p_overlap="sometimes"), 2)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 1.0), st.lists(st.integers(1, 16), min_size=1, max_size=8))
def test_overlap_never_exposes_more(base: float, stages: list[int]) -> None:
    """More overlap never exposes more of a send; the fraction stays within [0, pp_p2p_exposed]."""
    p = DEFAULT_PARAMS.replace(pp_p2p_exposed=base)
    v = np.array(stages)
    none, inter, every = (p2p_exposed(p.replace(pp_p2p_overlap=o), v) for o in P2P_OVERLAP)
    assert np.all(every <= inter) and np.all(inter <= none)
    assert np.all(every >= 0) and np.all(none == base)


def test_profile_files(tmp_path) -> None:
    f = tmp_path / "async.toml"
    f.write_text('base = "deepspeed"\npp_p2p_overlap = "all"\n')
    prof = load_profile(f)
    assert prof.apply(DEFAULT_PARAMS).pp_p2p_overlap == "all"
    assert prof.sources["pp_p2p_overlap"] == "async.toml"
    bad = tmp_path / "bad.toml"
    bad.write_text("pp_p2p_overlap = true\n")
    with pytest.raises(MeshplanError, match="pp_p2p_overlap"):
        load_profile(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text('pp_p2p_overlaps = "all"\n')
    with pytest.raises(MeshplanError, match="did you mean 'pp_p2p_overlap'"):
        load_profile(typo)


def _dev_rows() -> list[dict[str, str]]:
    with open(default_runs_path(), newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_validate_rows_that_predate_or_turn_off_the_flag() -> None:
    """Megatron runs from before overlap_p2p_comm existed (SC'21, Korthikanti 2022) and rows that
    turn it off keep their sends exposed under the megatron profile's 'interleaved' default."""
    rows = _dev_rows()
    sc21 = next(r for r in rows if r["source_id"] == "MEG_SC21_T1" and int(r["virtual_stages"] or 1) > 1)
    c = case_from_row(sc21)
    assert c.ok and c.profile == "megatron" and c.overrides.get("pp_p2p_overlap") == "none"
    assert any("predates" in a for a in c.assumptions)
    later = case_from_row(dict(sc21, source="Megatron-LM benchmark 2024"))
    assert "pp_p2p_overlap" not in later.overrides  # the profile's default applies
    off = case_from_row(dict(sc21, source="Megatron-LM benchmark 2024",
                             other_settings="--no-overlap-p2p-communication"))
    assert off.overrides.get("pp_p2p_overlap") == "none"
    flat = case_from_row(dict(sc21, virtual_stages="1", pp_schedule="1F1B"))
    assert "pp_p2p_overlap" not in flat.overrides  # 'interleaved' does not cover 1F1B anyway
