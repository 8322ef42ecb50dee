"""Plans as columns: one numpy array per Plan field, so 10^5-10^6 candidates stay cheap.

Encoding (row i is one plan):
  int fields (tp, pp, dp, cp, ep, zero, shard_group, micro_batch, virtual_stages): int32
  bool fields (sequence_parallel, offload_*, compile, flash_attention, ...): bool
  str fields with a fixed vocabulary (schedule, recompute, precision): int8 codes into
      ``CATEGORIES[field]`` (the tuples of meshplan.spec.plan)
  recompute_layers: int32, -1 = None (all blocks of the stage)
  stage_layers: int32 code into ``PlanColumns.stage_table``, -1 = None (even split)
  dp_shares, pools, pool_dp, pool_pp: their plan-string form ('3:1'), '' = None
  other str fields (grad_sync, ...): numpy unicode arrays, until their vocabulary is added
      to CATEGORIES
Any Plan field added later is carried the same way by its type (bool/int/str), so the
columns always hold every field.
"""
from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from meshplan.spec.axes import AX
from meshplan.spec.plan import COLON_LISTS, PRECISIONS, RECOMPUTE, SCHEDULES, Plan, parse_colon_list

CATEGORIES: dict[str, tuple[str, ...]] = {
    "schedule": SCHEDULES, "recompute": RECOMPUTE, "precision": PRECISIONS}
NONE_CODE = -1


def _field_kinds() -> dict[str, str]:
    """Plan field -> 'int' | 'bool' | 'cat' | 'str' | 'optint' | 'stages'."""
    kinds: dict[str, str] = {}
    for name, tp in Plan.flat_hints().items():
        if name == "stage_layers":
            kinds[name] = "stages"
        elif name in COLON_LISTS:
            kinds[name] = "colon"
        elif name in CATEGORIES:
            kinds[name] = "cat"
        elif tp is bool:
            kinds[name] = "bool"
        elif tp is str:
            kinds[name] = "str"
        elif tp is int:
            kinds[name] = "int"
        elif typing.get_origin(tp) in (typing.Union, types.UnionType) and int in typing.get_args(tp):
            kinds[name] = "optint"
        else:  # pragma: no cover - a new field type needs an encoding here
            raise TypeError(f"Plan.{name}: no columnar encoding for type {tp}")
    return kinds


FIELD_KINDS = _field_kinds()
FIELDS = tuple(FIELD_KINDS)
_DTYPES = {"colon": np.str_, "int": np.int32, "bool": np.bool_, "cat": np.int8, "optint": np.int32, "stages": np.int32,
           "str": np.str_}


class PlanColumns(Mapping[str, np.ndarray]):
    """Mapping field -> column (all the same length), plus the stage-split table.

    ``meta`` holds row-aligned bookkeeping of the enumeration that is not a Plan field
    (``group``: rows that differ only in micro_batch share it; ``mb_rank``: the rank of the
    row's micro_batch within its group). It travels with ``take``.
    """

    def __init__(self, cols: Mapping[str, np.ndarray], stage_table: Sequence[tuple[int, ...]] = (),
                 meta: Mapping[str, np.ndarray] | None = None) -> None:
        missing = [f for f in FIELDS if f not in cols]
        if missing:
            raise KeyError(f"plan columns missing: {', '.join(missing)}")
        self._cols: dict[str, np.ndarray] = {
            f: np.asarray(cols[f], dtype=_DTYPES[FIELD_KINDS[f]]) for f in FIELDS}
        lengths = {len(c) for c in self._cols.values()}
        if len(lengths) > 1:
            raise ValueError(f"plan columns have different lengths: {sorted(lengths)}")
        self.stage_table: tuple[tuple[int, ...], ...] = tuple(tuple(s) for s in stage_table)
        self.meta: dict[str, np.ndarray] = dict(meta or {})

    # Mapping protocol: the keys are the Plan fields.
    def __getitem__(self, key: str) -> np.ndarray:
        return self._cols[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols)

    def __len__(self) -> int:
        return len(self._cols)

    @property
    def num_rows(self) -> int:
        return len(self._cols[AX.TP])

    def take(self, idx: np.ndarray) -> PlanColumns:
        """Rows ``idx`` (an index or boolean array), same stage table."""
        return PlanColumns({f: c[idx] for f, c in self._cols.items()}, self.stage_table,
                           {k: v[idx] for k, v in self.meta.items()})

    def decoded(self, field: str) -> np.ndarray:
        """A categorical column as strings."""
        return np.asarray(CATEGORIES[field])[self._cols[field]]

    def plain(self) -> dict[str, np.ndarray]:
        """Decoded arrays, one per Plan field: categoricals as str arrays, recompute_layers as
        int64 with -1 = None, stage_layers as an object array of tuples or None (the layout of
        ``[getattr(p, f) for p in plans]`` per field, for code that wants values, not codes)."""
        out: dict[str, np.ndarray] = {}
        for f, c in self._cols.items():
            kind = FIELD_KINDS[f]
            if kind == "cat":
                out[f] = self.decoded(f)
            elif kind == "stages":
                table = np.empty(len(self.stage_table) + 1, dtype=object)  # all None
                for i, split in enumerate(self.stage_table):  # one by one: no 2-D broadcast
                    table[i] = split  # code -1 reads the trailing None
                out[f] = table[c]
            elif kind == "optint":
                out[f] = c.astype(np.int64)
            else:
                out[f] = c
        return out

    def plan(self, i: int) -> Plan:
        return self.plans(np.asarray([i]))[0]

    def plans(self, idx: np.ndarray | None = None) -> list[Plan]:
        """Plan objects for rows ``idx`` (all rows if None)."""
        sub = self if idx is None else self.take(np.asarray(idx))
        lists = {f: c.tolist() for f, c in sub._cols.items()}
        out = []
        for i in range(sub.num_rows):
            out.append(Plan(**{f: self._value(f, lists[f][i]) for f in FIELDS}))
        return out

    def _value(self, field: str, raw: Any) -> Any:
        kind = FIELD_KINDS[field]
        if kind == "cat":
            return CATEGORIES[field][raw]
        if kind == "optint":
            return None if raw == NONE_CODE else raw
        if kind == "stages":
            return None if raw == NONE_CODE else self.stage_table[raw]
        if kind == "colon":
            return parse_colon_list(raw, field) if raw else None
        return raw

    @staticmethod
    def from_plans(plans: Sequence[Plan]) -> PlanColumns:
        """Encode Plan objects (used by tests and by callers holding a few plans)."""
        table: list[tuple[int, ...]] = []
        codes: dict[tuple[int, ...], int] = {}
        cols: dict[str, list[Any]] = {f: [] for f in FIELDS}
        for p in plans:
            for f in FIELDS:
                v, kind = getattr(p, f), FIELD_KINDS[f]
                if kind == "cat":
                    v = CATEGORIES[f].index(v)
                elif kind == "optint":
                    v = NONE_CODE if v is None else v
                elif kind == "colon":
                    v = "" if v is None else ":".join(str(x) for x in v)
                elif kind == "stages":
                    if v is None:
                        v = NONE_CODE
                    else:
                        v = codes.setdefault(tuple(v), len(codes))
                        if v == len(table):
                            table.append(tuple(p.stage_layers or ()))
                cols[f].append(v)
        return PlanColumns({f: np.asarray(c) for f, c in cols.items()}, table)

    @staticmethod
    def concat(parts: Sequence[PlanColumns]) -> PlanColumns:
        """Rows of several column sets (stage tables merged and codes remapped)."""
        index: dict[tuple[int, ...], int] = {}
        cols: dict[str, list[np.ndarray]] = {f: [] for f in FIELDS}
        metas: dict[str, list[np.ndarray]] = {}
        for part in parts:
            remap = np.asarray([index.setdefault(s, len(index)) for s in part.stage_table] + [NONE_CODE],
                               dtype=np.int32)
            for f in FIELDS:
                c = part[f]
                cols[f].append(remap[c] if f == "stage_layers" else c)
            for k, v in part.meta.items():
                metas.setdefault(k, []).append(v)
        table = sorted(index, key=index.__getitem__)  # dicts keep insertion order: codes 0..n-1
        meta = {k: np.concatenate(v) for k, v in metas.items() if len(v) == len(parts)}
        return PlanColumns({f: np.concatenate(c) if c else np.zeros(0) for f, c in cols.items()},
                           table, meta)
