"""The 2026-12-08 fresh-clone review's findings, each with a test that fails before its fix."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from meshplan.cli.main import main


class _ClosedPipe:
    """stdout of `meshplan plan ... | head -3` once head has exited: every write is a broken pipe."""

    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_plan_out_is_written_even_when_the_reader_closes_the_pipe(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    with contextlib.redirect_stdout(_ClosedPipe()):
        rc = main(["plan", "--model", "gpt2-medium", "--cluster", "h100-sxm-80gb:8", "--global-batch", "32",
                   "--seq-len", "1024", "--out", str(out)])
    assert rc == 0
    assert out.is_file() and json.loads(out.read_text())["plan"]


def test_a_plan_naming_a_pool_the_cluster_has_not_is_refused(capsys) -> None:
    rc = main(["estimate", "--model", "gpt2-medium", "--cluster", "h100-sxm-80gb:8", "--global-batch", "32",
               "--seq-len", "1024", "--plan", "dp=8,pools=a100"])
    err = capsys.readouterr().err
    assert rc == 2 and "no pool named 'a100'" in err and len(err.strip().splitlines()) == 1


def test_a_negative_sequence_length_is_called_what_it_is(capsys) -> None:
    rc = main(["estimate", "--model", "gpt2-medium", "--cluster", "h100-sxm-80gb:8", "--global-batch", "32",
               "--seq-len", "-5", "--plan", "dp=8"])
    err = capsys.readouterr().err
    assert rc == 2 and "positive" in err and "length:probability" not in err.splitlines()[0].split("(")[0]
