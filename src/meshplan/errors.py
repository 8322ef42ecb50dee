"""One exception type for every user-facing error: a message that says what is wrong and how to fix it."""
from __future__ import annotations


class MeshplanError(ValueError):
    """Bad input or an impossible request. ``str(err)`` is a complete, one-line explanation."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} ({hint})" if hint else message)


class Infeasible(MeshplanError):
    """The request is well formed, but nothing meets it: no plan fits, or none meets the deadline.
    The CLI exits with code 3 for it (2 is bad usage or input), and its message says what would
    make the request feasible."""

    exit_code = 3


class Terminated(BaseException):
    """SIGTERM arrived (cli.main turns it into this, as Python turns SIGINT into KeyboardInterrupt): the
    command ends with one line and exit code 143, like Ctrl-C's 130 (issue 29: SIGTERM during
    `train` printed a torchrun traceback)."""

    exit_code = 143


def raise_terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler: raise Terminated where the main thread is."""
    raise Terminated()
