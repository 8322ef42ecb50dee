"""Argument types and actions shared by the subcommands."""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any


def positive_int(name: str) -> Callable[[str], int]:
    """An argparse type: a positive integer, or a one-line error (argparse names the flag:
    ``argument --global-batch: must be a positive integer, got '0'``; ``name`` is kept for the
    callers' sake)."""
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
        return v
    return conv


MAX_SEQ_LEN = 2**24
"""The longest --seq-len accepted: 16,777,216 tokens, above the longest contexts trained (10M tokens,
Llama 4 Scout). A longer one is a typo (10^9 was accepted and planned, issue 29's review)."""


def check_seq_len(v: int, text: object = None) -> int:
    """``v`` if it is at most MAX_SEQ_LEN, else argparse's one-line error."""
    if v > MAX_SEQ_LEN:
        raise argparse.ArgumentTypeError(f"{text if text is not None else v} tokens is longer than any model is trained "
                                         f"on (at most {MAX_SEQ_LEN:,} = 2^24 accepted)")
    return v


def seq_len_int(text: str) -> int:
    """An argparse type for a one-length --seq-len: positive_int, at most MAX_SEQ_LEN."""
    return check_seq_len(positive_int("--seq-len")(text), text)


GIVEN = "_given_once"
"""Namespace attribute: {dest: (option string, value)} of the options given so far (`Once`)."""


def _given(namespace: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    seen = getattr(namespace, GIVEN, None)
    if seen is None:
        seen = {}
        setattr(namespace, GIVEN, seen)
    return seen


class Once(argparse._StoreAction):
    """``store``, refusing a second, different value of a single-valued option (``--cluster a
    --cluster b`` would otherwise keep the last one silently). The same value twice is harmless."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        seen = _given(namespace)
        if self.dest in seen and seen[self.dest][1] != values:
            flag, before = seen[self.dest]
            raise argparse.ArgumentError(self, f"given twice ({flag} {before} and {option_string} {values}); "
                                               "give it once")
        seen[self.dest] = (option_string or self.dest, values)
        setattr(namespace, self.dest, values)


def _exclusive(namespace: argparse.Namespace, action: argparse.Action, option_string: str | None,
               value: Any) -> None:
    """Two flags that set one destination to different values (``--uneven-stages`` and
    ``--even-stages-only``) contradict each other: an error, not the last one winning."""
    seen = _given(namespace)
    key = f"{action.dest}:flag"
    if key in seen and seen[key][1] != value:
        raise argparse.ArgumentError(action, f"not allowed with {seen[key][0]} (they contradict each other); "
                                             "give one of them")
    seen[key] = (option_string or action.dest, value)


class ExclusiveTrue(argparse._StoreTrueAction):
    """store_true that refuses a contradicting flag on the same destination (`_exclusive`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        _exclusive(namespace, self, option_string, self.const)
        super().__call__(parser, namespace, values, option_string)


class ExclusiveFalse(argparse._StoreFalseAction):
    """store_false that refuses a contradicting flag on the same destination (`_exclusive`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        _exclusive(namespace, self, option_string, self.const)
        super().__call__(parser, namespace, values, option_string)


NEGATIVE_VALUE = re.compile(r"^-(\d[\d_]*\.?\d*|\.\d+)([eE][+-]?\d+)?[kKmMbBgGtTpPdD]?$")
"""What argparse should take as a (negative) value rather than an unknown option: -5, -2.5,
-1e12, -5T, -3d. With it ``--train-tokens -5T`` reaches the converter, which says the count must
be positive, instead of argparse's "expected one argument"."""


def accept_negative_values(parser: argparse.ArgumentParser) -> None:
    """Let ``parser`` read values like -5T as values (`NEGATIVE_VALUE`; argparse alone reads only
    plain negative numbers so, and treats -5T as an option)."""
    parser._negative_number_matcher = NEGATIVE_VALUE  # type: ignore[attr-defined]


OPTIMIZER_HELP = ("the optimizer trained with: adamw (default), adam, sgd (momentum), adafactor, lion or adam8bit "
                  "(bitsandbytes): its state bytes per parameter and step time (docs/cost-model.md, Memory)")


def add_optimizer(parser: argparse.ArgumentParser, action: Any = None, default: str | None = None,
                  help: str = OPTIMIZER_HELP) -> None:
    """The ``--optimizer`` flag of every planning command (a workload field, spec.plan.Workload.optimizer;
    recorded in plan files). Default None: the plan file's, else adamw (cli.model_arg.as_problem)."""
    from meshplan.spec.plan import OPTIMIZERS
    kw = {"action": action} if action is not None else {}
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default=default, help=help, **kw)
