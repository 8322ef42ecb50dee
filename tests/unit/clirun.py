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


def error_line(capsys, argv: list[str]) -> str:
    """Run the CLI: exit 2 and exactly one `meshplan: error:` line (other output, e.g. notes, aside
    from blank lines, is a failure), no traceback. Returns the line."""
    from meshplan.cli.main import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("meshplan: error:"), err
    assert "Traceback" not in err
    return lines[0]
