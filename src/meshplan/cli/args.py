"""Argument types shared by the subcommands."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_int(name: str) -> Callable[[str], int]:
    """An argparse type: a positive integer, or a one-line error naming the flag."""
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        return v
    return conv
