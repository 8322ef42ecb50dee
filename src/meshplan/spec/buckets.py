"""Data-aware plans: micro-batch size and context-parallel degree per length bucket.

A plan with ``buckets=4096x4cp1:16384x2cp2:32768x1cp4`` (``Plan.buckets``) trains a workload
whose samples have a distribution of lengths (spec.lengths) like this, every step:

1. the step's samples are sorted by length and split into buckets: bucket k holds the samples
   longer than bucket k-1's limit and at most its own (``max_len``); the last limit must reach
   the longest length of the workload;
2. bucket k's samples are cut, in that order, into micro-batches of ``micro_batch`` samples (the
   bucket's last one may hold fewer), each padded to its longest sample;
3. each micro-batch runs on ``cp`` ranks of a context-parallel group (a *unit*): the plan's
   ``cp`` (C, the mesh's axis) is the largest bucket cp; a group of C ranks is C / cp_k units of
   cp_k consecutive ranks for bucket k (a unit of cp 1 is one rank: the group's ranks then act as
   data-parallel ranks). Every bucket cp divides the next larger one, so units nest;
4. micro-batches are dealt to units greedily, the largest cp first and, within a cp, the heaviest
   first (LPT), each to the unit whose busiest rank is least loaded; a micro-batch occupies every
   rank of its unit from the latest of their loads on (they run it together). The weight of a
   micro-batch is its work per rank, ``samples x width x (knee + width) / cp`` (``knee``: the
   length at which a token's causal attention costs as much as its other matmuls, P_layer /
   hidden; ``attention_knee``);
5. each rank runs its micro-batches in that order (units of the largest cp first), so that the
   ranks of a unit meet at each of its micro-batches in the same order.

The layout is a pure function of the step's lengths, the plan and the knee: the runtime
(runtime/hetero.py), the cost model (cost/buckets.py) and the simulator (sim/buckets.py) all
form micro-batches with ``bucket_layout``. Data-parallel gradients are still averaged over all
dp x cp ranks; every micro-batch's loss is weighted by its real tokens (spec/lengths.py).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX

EXAMPLE = "buckets=4096x4cp1:32768x1cp4"
_RE = re.compile(r"^\s*(\d[\d_]*)\s*x\s*(\d+)\s*(?:cp\s*(\d+))?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Bucket:
    """Samples up to ``max_len`` tokens, in micro-batches of ``micro_batch``, on ``cp`` ranks each."""

    max_len: int
    micro_batch: int
    cp: int = 1

    def text(self) -> str:
        return f"{self.max_len}x{self.micro_batch}cp{self.cp}"


def parse_bucket(text: str) -> Bucket:
    """``4096x4cp2`` (or ``4096x4``: cp 1) -> Bucket."""
    m = _RE.match(str(text))
    if not m:
        raise MeshplanError(f"plan: bucket {text!r} is not MAX_LENxMICRO_BATCH[cpCP]",
                            hint=f"e.g. {EXAMPLE} (samples up to 4096 tokens in micro-batches of 4 on one rank, "
                                 "longer ones one per micro-batch over 4 context-parallel ranks)")
    n, b, c = int(m.group(1).replace("_", "")), int(m.group(2)), int(m.group(3) or 1)
    for what, v in (("length limit", n), ("micro-batch", b), (AX.CP, c)):
        if v < 1:
            raise MeshplanError(f"plan: bucket {text!r}: its {what} must be >= 1", hint=f"e.g. {EXAMPLE}")
    return Bucket(n, b, c)


def parse_buckets(entries: Sequence[str]) -> tuple[Bucket, ...]:
    return tuple(parse_bucket(e) for e in entries)


def normalise(entries: Sequence[str]) -> tuple[str, ...]:
    """The canonical text of each bucket (``4096x4cp1``)."""
    return tuple(b.text() for b in parse_buckets(entries))


def check_buckets(buckets: Sequence[Bucket], cp: int, pp: int = 1, ep: int = 1) -> None:
    """What a plan's buckets must satisfy on their own (the workload is checked by
    ``check_workload``): ascending limits, every cp dividing the next larger one, the largest
    equal to the plan's cp, and no pipeline or expert parallelism."""
    text = ":".join(b.text() for b in buckets)
    if not buckets:
        raise MeshplanError("plan: buckets is empty", hint=f"e.g. {EXAMPLE}")
    limits = [b.max_len for b in buckets]
    if limits != sorted(set(limits)):
        raise MeshplanError(f"plan: buckets={text}: the length limits must ascend, each bucket once",
                            hint=f"e.g. {EXAMPLE}")
    cps = sorted({b.cp for b in buckets})
    for lo, hi in zip(cps, cps[1:]):
        if hi % lo:
            raise MeshplanError(f"plan: buckets={text}: bucket cp {lo} does not divide {hi}",
                                hint="use cp degrees that divide each other (1, 2, 4, 8)")
    if cps[-1] != cp:
        raise MeshplanError(f"plan: buckets={text}: the largest bucket cp is {cps[-1]} but the plan's cp={cp}",
                            hint=f"the plan's cp is its context-parallel groups' size: set cp={cps[-1]}")
    if pp > 1:
        raise MeshplanError(f"plan: buckets={text} with pp={pp}: a pipeline needs one micro-batch shape and "
                            "count on every stage", hint="use pp=1 with buckets, or drop buckets")
    if ep > 1:
        raise MeshplanError(f"plan: buckets={text} with ep={ep}: expert parallelism pairs micro-batches across "
                            "ranks", hint="use ep=1 with buckets, or drop buckets")


def check_workload(buckets: Sequence[Bucket], max_len: int, varied: bool) -> str | None:
    """Why the buckets cannot train this workload (None: they can)."""
    text = ":".join(b.text() for b in buckets)
    if not varied:
        example = ",".join(f"{b.max_len}:{1 / len(buckets):.2g}" for b in buckets)
        return (f"buckets={text} needs samples of several lengths that are not packed into full windows (e.g. "
                f"--seq-len {example} with --packing padded or bucketed; packed windows all have one length)")
    if buckets[-1].max_len < max_len:
        return (f"buckets={text}: the last limit {buckets[-1].max_len} is below the longest sample "
                f"({max_len}); raise it to {max_len}")
    return None


def attention_knee(layer_params: float, hidden: int) -> float:
    """The length at which a token's causal attention (2 x length x hidden FLOPs per layer forward)
    costs as much as its other matmuls (2 x the layer's parameters): P_layer / hidden."""
    return max(1.0, float(layer_params) / max(1, int(hidden)))


def model_knee(model: object) -> float:
    """attention_knee of a ModelSpec (or of a LayerGraph built from one): about 12 x hidden for a
    dense transformer (active parameters for a mixture of experts). 4096 for a model that does not
    describe its layers (a traced graph)."""
    spec = getattr(model, "model", None) or model
    hidden = getattr(spec, "hidden_size", None)
    per_layer = getattr(spec, "active_layer_params", None)
    if not hidden or not callable(per_layer):
        return 4096.0
    return attention_knee(float(per_layer()), int(hidden))


@dataclass(frozen=True)
class MicroBatch:
    samples: tuple[int, ...]
    """Indices into the step's lengths."""
    width: int
    """Its padded length (the longest of its samples)."""
    bucket: int
    cp: int
    unit: int
    """Its unit: ranks [unit x cp, (unit + 1) x cp) of the dp x cp ranks (rank = d x C + c)."""
    weight: float
    """Its work per rank (samples x width x (knee + width) / cp), what the dealing balances."""


@dataclass(frozen=True)
class BucketLayout:
    lengths: np.ndarray
    micro_batches: tuple[MicroBatch, ...]
    ranks: tuple[tuple[int, ...], ...]
    """Per dp x cp rank (d x C + c), its micro-batches (indices into micro_batches) in run order."""

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def loads(self) -> np.ndarray:
        """Each rank's end in the dealing's weights, waits for unit peers included."""
        t = np.zeros(len(self.ranks))
        for mb in self.micro_batches:
            sl = slice(mb.unit * mb.cp, (mb.unit + 1) * mb.cp)
            t[sl] = t[sl].max() + mb.weight
        return t


def bucket_of(lengths: np.ndarray, buckets: Sequence[Bucket]) -> np.ndarray:
    """Each length's bucket index (limits inclusive); a length above the last limit is refused."""
    limits = np.asarray([b.max_len for b in buckets])
    k = np.searchsorted(limits, np.asarray(lengths), side="left")
    if (k >= len(buckets)).any():
        raise MeshplanError(f"a sample of {int(np.max(lengths))} tokens is longer than the last bucket's limit "
                            f"{limits[-1]}", hint=f"raise the last bucket's limit to {int(np.max(lengths))}")
    return k


def bucket_layout(lengths: np.ndarray, buckets: Sequence[Bucket], dp: int, cp: int, knee: float) -> BucketLayout:
    """The step's micro-batches and who runs them (the module docstring's rules 1-5)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    which = bucket_of(lengths[order], buckets)
    pending: list[tuple[int, float, tuple[int, ...], int, int]] = []  # (cp, weight, samples, width, bucket)
    for k, b in enumerate(buckets):
        idx = order[which == k]
        for j in range(0, len(idx), b.micro_batch):
            s = idx[j:j + b.micro_batch]
            w = int(lengths[s].max())
            pending.append((b.cp, len(s) * w * (knee + w) / b.cp, tuple(int(i) for i in s), w, k))
    # the largest cp first; within a cp the heaviest first; ties by bucket then data order (stable)
    pending.sort(key=lambda x: (-x[0], -x[1], x[4], x[2]))
    n = dp * cp
    load = np.zeros(n)
    mbs: list[MicroBatch] = []
    runs: list[list[int]] = [[] for _ in range(n)]
    for c, w, s, width, k in pending:
        busiest = load.reshape(-1, c).max(axis=1)
        u = int(np.argmin(busiest))
        load[u * c:(u + 1) * c] = busiest[u] + w
        for r in range(u * c, (u + 1) * c):
            runs[r].append(len(mbs))
        mbs.append(MicroBatch(s, width, k, c, u, w))
    return BucketLayout(lengths, tuple(mbs), tuple(tuple(r) for r in runs))


def buckets_text(buckets: Sequence[Bucket]) -> str:
    return ":".join(b.text() for b in buckets)


def describe(buckets: Sequence[Bucket]) -> str:
    """'<= 4,096 tokens: 4 per micro-batch without context parallelism; 4,097-32,768 tokens: 1 per
    micro-batch over 4 context-parallel ranks' (a rank: the plan's tp ranks together)."""
    parts = []
    for i, b in enumerate(buckets):
        lo = f"<= {b.max_len:,}" if i == 0 else f"{buckets[i - 1].max_len + 1:,}-{b.max_len:,}"
        on = "without context parallelism" if b.cp == 1 else f"over {b.cp} context-parallel ranks"
        parts.append(f"{lo} tokens: {b.micro_batch} per micro-batch {on}")
    return "; ".join(parts)
