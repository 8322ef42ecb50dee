"""Helpers shared by the CLI tests: run `meshplan` in-process, check one-line errors."""
from __future__ import annotations

from meshplan.cli.main import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``meshplan *argv``."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc: int, err: str, *needles: str) -> None:
    """A usage error: exit 2, one 'meshplan: error: ...' line, no traceback, every needle in it."""
    assert rc == 2, err
    assert err.startswith("meshplan: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
