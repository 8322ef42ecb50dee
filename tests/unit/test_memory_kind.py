"""The label of a published row's measured memory (validate.measured.memory_kind): allocated,
reserved or nvidia-smi, and that every row of the development data with a measured peak from the
sources added for issue 27 says which."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from meshplan.errors import MeshplanError
from meshplan.validate.measured import MEMORY_KINDS, memory_by_nvidia_smi, memory_kind
from meshplan.validate.rows import Row

DEV = Path(__file__).resolve().parents[2] / "src" / "meshplan" / "data" / "published_runs_dev.csv"


@pytest.mark.parametrize(("notes", "kind"), [
    ("Peak from the log. memory measured: allocated", "allocated"),
    ("memory measured: Reserved (torch.cuda.max_memory_reserved)", "reserved"),
    ("memory_measured=nvidia-smi", "nvidia-smi"),
    ("memory measured: nvidia smi", "nvidia-smi"),
    ("Mem column read with nvidia-smi", "nvidia-smi"),  # unlabelled, but names the tool
    ("tokens/s from the table", None),
])
def test_memory_kind_reads_the_label(notes: str, kind: str | None) -> None:
    row = Row({"row_id": "1", "notes": notes})
    assert memory_kind(row) == kind
    assert memory_by_nvidia_smi(row) is (kind == "nvidia-smi")


def test_the_label_wins_over_a_mention_of_nvidia_smi() -> None:
    row = Row({"notes": "nvidia-smi showed 30 GB; the table's value: memory measured: allocated"})
    assert memory_kind(row) == "allocated" and not memory_by_nvidia_smi(row)


def test_a_label_naming_no_kind_is_an_error_that_says_the_kinds() -> None:
    with pytest.raises(MeshplanError, match="allocated, reserved, nvidia-smi"):
        memory_kind(Row({"row_id": "7", "notes": "memory measured: active"}))


def test_new_rows_with_memory_say_which_memory() -> None:
    """Rows from row_id 2100 on (issue 27's sources) that carry a measured peak label its kind."""
    with DEV.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if int(r["row_id"]) >= 2100]
    assert rows, "issue 27's rows are missing"
    for r in rows:
        if r["reported_peak_mem_gib"].strip():
            assert memory_kind(Row(r)) in MEMORY_KINDS, r["row_id"]
        assert r["status"] in ("ok", "oom"), r["row_id"]
