"""Heterogeneous data: a distribution of sample lengths instead of one sequence length.

A workload may say ``--seq-len 2048:0.6,8192:0.3,32768:0.1`` (length:probability pairs; the
probabilities are normalised) or give a histogram file (``--seq-len lengths.csv``: rows of
``length,count``; or JSON ``{"lengths": [...], "counts": [...]}`` / ``[[length, count], ...]``),
and how samples become micro-batches (``packing``):

- ``padded``: a step's samples are taken in order; each data-parallel replica takes its block,
  cut into micro-batches of ``micro_batch`` samples; each micro-batch is padded to its longest
  sample (padding is computed, its loss is masked).
- ``bucketed``: the step's samples are sorted by length first, cut into micro-batches in that
  order (so a micro-batch holds samples of similar length and pads little), and micro-batch j
  goes to replica j mod dp (every replica gets a similar mix).
- ``packed``: samples are concatenated into windows of ``seq_len`` (the longest length) tokens
  with causal attention over the whole window (no document mask, as torchtitan and nanoGPT
  pack); the global batch counts windows. Every micro-batch then costs the same.

``Workload.seq_len`` is the longest length (what a plan must hold in memory), and
``Workload.lengths`` the distribution (None: every sample is seq_len tokens).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshplan.errors import MeshplanError

PACKING = ("padded", "bucketed", "packed")
EXAMPLE = "--seq-len 2048:0.6,8192:0.3,32768:0.1"
MAX_BINS = 64
"""Most distinct lengths a distribution may hold (a histogram file with more is coarsened to
this many bins by quantile, keeping the longest length exact)."""


@dataclass(frozen=True)
class LengthDist:
    """Sample lengths (ascending, distinct) with their probabilities (summing to 1)."""

    lengths: tuple[int, ...]
    probs: tuple[float, ...]
    packing: str = "padded"
    source: str = ""
    """Where it came from (the --seq-len text or the file), for messages and reports."""

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.probs):
            raise MeshplanError("sequence-length distribution: give at least one length:probability pair",
                                hint=f"e.g. {EXAMPLE}")
        if self.packing not in PACKING:
            raise MeshplanError(f"--packing {self.packing!r} is not one of {', '.join(PACKING)}",
                                hint="padded: pad each micro-batch to its longest sample; bucketed: sort by "
                                     "length first; packed: concatenate samples into full-length windows")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise MeshplanError("sequence-length distribution: lengths must be distinct and ascending "
                                "(parse_lengths merges and sorts them)")
        for n in self.lengths:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise MeshplanError(f"sequence-length distribution: length {n!r} must be a whole number >= 1")
        if any(not (isinstance(p, float) and math.isfinite(p) and p > 0) for p in self.probs) \
                or abs(sum(self.probs) - 1) > 1e-9:
            raise MeshplanError("sequence-length distribution: probabilities must be positive and sum to 1")

    @property
    def max_len(self) -> int:
        return self.lengths[-1]

    @property
    def mean_len(self) -> float:
        return float(np.dot(self.lengths, self.probs))

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.lengths, dtype=np.int64), np.asarray(self.probs, dtype=float)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` sample lengths drawn independently (int64)."""
        L, p = self.arrays
        return L[rng.choice(len(L), size=n, p=p)]

    def text(self) -> str:
        """The --seq-len form: ``2048:0.6,8192:0.3,32768:0.1`` (probabilities to 6 significant digits)."""
        return ",".join(f"{n}:{p:.6g}" for n, p in zip(self.lengths, self.probs))

    def with_packing(self, packing: str) -> LengthDist:
        return LengthDist(self.lengths, self.probs, packing, self.source)


def from_pairs(pairs: list[tuple[int, float]], packing: str = "padded", source: str = "") -> LengthDist:
    """Merge equal lengths, sort, normalise the weights; coarsen to MAX_BINS bins if needed."""
    acc: dict[int, float] = {}
    for n, w in pairs:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise MeshplanError(f"sequence-length distribution: length {n!r} must be a whole number >= 1",
                                hint=f"e.g. {EXAMPLE}")
        if not (isinstance(w, (int, float, np.integer, np.floating)) and math.isfinite(float(w)) and w >= 0):
            raise MeshplanError(f"sequence-length distribution: weight {w!r} of length {n} must be a number >= 0",
                                hint=f"e.g. {EXAMPLE}")
        acc[int(n)] = acc.get(int(n), 0.0) + float(w)
    acc = {n: w for n, w in acc.items() if w > 0}
    total = sum(acc.values())
    if not acc or total <= 0:
        raise MeshplanError("sequence-length distribution: every weight is 0", hint=f"e.g. {EXAMPLE}")
    lengths = sorted(acc)
    probs = [acc[n] / total for n in lengths]
    if len(lengths) > MAX_BINS:
        lengths, probs = _coarsen(lengths, probs)
    probs = [float(p) for p in np.asarray(probs) / np.sum(probs)]
    return LengthDist(tuple(lengths), tuple(probs), packing, source)


def _coarsen(lengths: list[int], probs: list[float]) -> tuple[list[int], list[float]]:
    """MAX_BINS bins of about equal probability; each bin is represented by its longest length
    (a sample is never priced shorter than it is), the longest length kept exact."""
    cdf = np.cumsum(probs)
    out_l: list[int] = []
    out_p: list[float] = []
    start = 0
    for k in range(1, MAX_BINS + 1):
        end = int(np.searchsorted(cdf, k / MAX_BINS - 1e-12)) + 1 if k < MAX_BINS else len(lengths)
        end = max(end, start + 1)
        if start >= len(lengths):
            break
        out_l.append(lengths[min(end, len(lengths)) - 1])
        out_p.append(float(sum(probs[start:end])))
        start = end
    return out_l, out_p


def looks_like_dist(text: str) -> bool:
    """Whether a --seq-len value is a distribution (``L:p,...``) or a file, not one length."""
    t = str(text).strip()
    return ":" in t or "," in t or not t.isdigit()


PROB_SUM_TOL = 0.005
"""How far from 1 inline probabilities may sum (rounded shares such as 0.333,0.333,0.333 pass).
Weights that are all whole numbers are counts, normalised."""


def parse_lengths(text: str, packing: str = "padded") -> LengthDist:
    """``2048:0.6,8192:0.3,32768:0.1`` or a histogram file path -> LengthDist."""
    t = str(text).strip()
    if not t:
        raise MeshplanError("--seq-len is empty",
                            hint=f"give one length (--seq-len 4096) or a distribution ({EXAMPLE})")
    if re.fullmatch(r"[+-]?\d+", t.replace("_", "")) and int(t.replace("_", "")) <= 0:
        raise MeshplanError(f"--seq-len {t}: a sequence length must be a positive whole number",
                            hint=f"e.g. --seq-len 4096, or a distribution ({EXAMPLE})")
    path = Path(t)
    if ":" not in t or path.suffix.lower() in (".csv", ".json", ".tsv", ".txt"):
        if path.is_file():
            return load_length_file(path, packing)
        if path.is_dir():
            raise MeshplanError(f"--seq-len {t}: a directory, not a histogram file",
                                hint="give a CSV of length,count rows or a JSON histogram")
        if path.suffix or "/" in t:
            raise MeshplanError(f"--seq-len {t}: no such histogram file",
                                hint="give a CSV of length,count rows, a JSON histogram, or length:probability "
                                     f"pairs ({EXAMPLE})")
    pairs: list[tuple[int, float]] = []
    for part in t.split(","):
        part = part.strip()
        if not part:
            raise MeshplanError(f"--seq-len {t}: an empty item between commas",
                                hint=f"one length:probability pair between commas, e.g. {EXAMPLE}")
        n, sep, w = part.partition(":")
        if not sep:
            raise MeshplanError(f"--seq-len {t}: {part!r} is not length:probability",
                                hint=f"e.g. {EXAMPLE}")
        try:
            length = int(n.strip().replace("_", ""))
        except ValueError:
            raise MeshplanError(f"--seq-len {t}: length {n.strip()!r} is not a whole number",
                                hint=f"e.g. {EXAMPLE}") from None
        try:
            weight = float(w.strip())
        except ValueError:
            raise MeshplanError(f"--seq-len {t}: probability {w.strip()!r} of length {length} is not a number",
                                hint=f"e.g. {EXAMPLE}") from None
        pairs.append((length, weight))
    if not pairs:
        raise MeshplanError(f"--seq-len {t!r} holds no length:probability pair",
                            hint=f"give one length (--seq-len 4096) or a distribution ({EXAMPLE})")
    total = sum(w for _, w in pairs)
    counts = all(float(w).is_integer() for _, w in pairs)  # whole weights are counts; others probabilities
    if total > 0 and not counts and all(w >= 0 for _, w in pairs) and abs(total - 1) > PROB_SUM_TOL:
        raise MeshplanError(f"--seq-len {t}: the probabilities sum to {total:.4g}, not 1",
                            hint="fix them so that they sum to 1, or give whole-number counts (e.g. 2048:600,8192:300,"
                                 "32768:100), which are normalised")
    return from_pairs(pairs, packing, source=t)


def load_length_file(path: str | Path, packing: str = "padded") -> LengthDist:
    """A histogram: CSV/TSV rows ``length,count`` (a header row is skipped; '#' comments), or JSON
    ``{"lengths": [...], "counts": [...]}`` (or ``"probs"``) or ``[[length, count], ...]``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise MeshplanError(f"cannot read the length histogram {p}: {e.strerror or e}") from None
    pairs: list[tuple[int, float]] = []
    if p.suffix.lower() == ".json" or text.lstrip().startswith(("{", "[")):
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise MeshplanError(f"{p}: not valid JSON ({e.msg}, line {e.lineno})") from None
        if isinstance(data, dict):
            ls = data.get("lengths")
            ws = data.get("counts", data.get("probs", data.get("weights")))
            if not isinstance(ls, list) or not isinstance(ws, list) or len(ls) != len(ws):
                raise MeshplanError(f"{p}: a JSON histogram needs lists 'lengths' and 'counts' (or 'probs') "
                                    "of the same length")
            raw = list(zip(ls, ws))
        elif isinstance(data, list):
            raw = data
        else:
            raise MeshplanError(f"{p}: a JSON histogram is an object or a list of [length, count] pairs")
        for i, item in enumerate(raw):
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise MeshplanError(f"{p}: entry {i} is not a [length, count] pair")
            pairs.append((_as_int(item[0], p, i), _as_float(item[1], p, i)))
    else:
        for i, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            cells = [c.strip() for c in line.replace("\t", ",").replace(";", ",").split(",") if c.strip()]
            if len(cells) != 2:
                raise MeshplanError(f"{p}:{i}: expected 'length,count', got {line!r}")
            if not cells[0].isdigit() and not pairs:
                continue  # a header row
            pairs.append((_as_int(cells[0], p, i), _as_float(cells[1], p, i)))
    if not pairs:
        raise MeshplanError(f"{p}: the histogram is empty", hint="rows of length,count, e.g. 2048,600")
    try:
        return from_pairs(pairs, packing, source=str(p))
    except MeshplanError as e:  # say which file (its rows are length,count; no --seq-len syntax to suggest)
        raise MeshplanError(f"{p}: {e.message.removeprefix('sequence-length distribution: ')}",
                            hint="fix that row of the histogram (length,count: a whole length >= 1, a count "
                                 ">= 0)") from None


def _as_int(v: Any, p: Path, i: int) -> int:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise MeshplanError(f"{p}: entry {i}: length {v!r} is not a number") from None
    if not f.is_integer():
        raise MeshplanError(f"{p}: entry {i}: length {v!r} is not a whole number")
    return int(f)


def _as_float(v: Any, p: Path, i: int) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise MeshplanError(f"{p}: entry {i}: count {v!r} is not a number") from None


def workload_text(work: Any, unit: str = "tokens") -> str:
    """'global batch 256 x 4096 tokens'; with a length distribution, what a sample of the batch is
    (padded/bucketed: samples of the mean length, up to the longest; packed: full windows); an
    optimizer other than the default AdamW is named."""
    opt = getattr(work, "optimizer", "adamw")
    return _batch_text(work, unit) + ("" if opt == "adamw" else f", optimizer {opt}")


def _batch_text(work: Any, unit: str) -> str:
    d = work.lengths
    if d is None or len(d.lengths) == 1:
        return f"global batch {work.global_batch} x {work.seq_len} {unit}"
    if d.packing == "packed":
        return (f"global batch {work.global_batch} packed windows x {work.seq_len} {unit} (samples of mean "
                f"{d.mean_len:,.0f} concatenated, causal over each whole window)")
    return (f"global batch {work.global_batch} samples of {d.mean_len:,.0f} {unit} on average (longest "
            f"{work.seq_len:,}, {d.packing})")
