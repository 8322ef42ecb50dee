"""Shared machinery for the frozen spec records: strict dict/JSON/TOML round-trip.

Every spec is a frozen, keyword-only dataclass. ``from_dict`` rejects unknown keys
(naming the known ones), coerces plain JSON/TOML values to the annotated field type,
and lets ``__post_init__`` validate. Errors are :class:`MeshplanError` with one line.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, TypeVar

from meshplan.errors import MeshplanError

SCHEMA_VERSION = 1
T = TypeVar("T")


def closest(name: str, options: typing.Iterable[str]) -> str:
    if not isinstance(name, str):
        return ""
    best = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {best[0]!r}?" if best else ""


def short_repr(value: Any, limit: int = 60) -> str:
    """repr() for error messages: short, and safe for ints too long to print."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # int beyond sys.get_int_max_str_digits(), deep nesting
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a JSON/TOML value to the annotated type ``tp`` or raise MeshplanError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, where)
            except MeshplanError as e:
                errors.append(str(e))
        raise MeshplanError(errors[0] if errors else f"{where}: unexpected value {short_repr(value)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise MeshplanError(f"{where}: expected a list, got {short_repr(value)}")
        inner = args[0] if args else Any
        return tuple(coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise MeshplanError(f"{where}: expected a table/object, got {short_repr(value)}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise MeshplanError(f"{where}: expected a table/object, got {short_repr(value)}")
        return from_dict(tp, value, where=where)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise MeshplanError(f"{where}: expected true/false, got {short_repr(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise MeshplanError(f"{where}: expected an integer, got {short_repr(value)}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise MeshplanError(f"{where}: expected an integer, got {short_repr(value)}")
    if tp is float:
        if isinstance(value, bool):
            raise MeshplanError(f"{where}: expected a number, got {short_repr(value)}")
        number: float | None = None
        if isinstance(value, (int, float)):
            try:
                number = float(value)
            except OverflowError:  # an int beyond the float range
                pass
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is not None and not math.isnan(number):
            return number
        raise MeshplanError(f"{where}: expected a number, got {short_repr(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise MeshplanError(f"{where}: expected a string, got {short_repr(value)}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], *, where: str | None = None) -> T:
    """Build the dataclass ``cls`` from a plain dict, strictly."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise MeshplanError(f"{where}: expected a table/object, got {type(data).__name__}")
    flat_hints = getattr(cls, "flat_hints", None)  # a record written flat (Plan: its sub-records' keys)
    hints = flat_hints() if flat_hints is not None else typing.get_type_hints(cls)
    fields = dict.fromkeys(hints) if flat_hints is not None else \
        {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("schema_version", "kind") and key not in fields:  # file header (LinkTier has a kind)
            continue
        if key not in fields:
            raise MeshplanError(
                f"{where}: unknown field {short_repr(key)}{closest(key, fields)}",
                hint="known fields: " + ", ".join(sorted(fields)),
            )
        kwargs[key] = coerce(value, hints[key], f"{where}.{key}")
    missing = [n for n, f in fields.items() if n not in kwargs and f is not None
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise MeshplanError(f"{where}: missing required field(s): {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - defensive
        raise MeshplanError(f"{where}: {e}") from None


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain JSON-able dict (tuples as lists, nested specs as dicts)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "flat_dict"):  # a record written flat (Plan: its sub-records' fields in one table)
            return {k: to_dict(v) for k, v in obj.flat_dict().items()}
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def json_safe(x: Any) -> Any:
    """``x`` as strict JSON (RFC 8259) takes it: numpy scalars and arrays as plain numbers and
    lists, a non-finite float (an overflow) as None (null, never NaN or Infinity), dict keys as
    strings."""
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        x = x.tolist()
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k if isinstance(k, str) else str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def choice(where: str, value: str, options: typing.Iterable[str]) -> None:
    """Raise a helpful error if ``value`` is not one of ``options``."""
    opts = list(options)
    if value not in opts:
        raise MeshplanError(f"{where} must be one of {', '.join(opts)}; got {value!r}{closest(value, opts)}")


def positive(where: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise unless value > 0 (or >= 0). NaN fails both."""
    if not (value > 0 or (allow_zero and value == 0)):
        raise MeshplanError(f"{where} must be {'>= 0' if allow_zero else '> 0'}; got {value!r}")
