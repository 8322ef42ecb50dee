"""Collective-level validation: the cost model's bus bandwidth against published collective benchmarks.

``meshplan/data/collectives_dev.csv`` holds published nccl-tests (and all_reduce_bench.py) results,
one row per (system, collective, ranks, message size), each with its citation (docs/collectives.md
describes the columns and sources). For every row this module builds the row's ClusterSpec (its GPU
preset and spec.cluster.default_links; the links the row states override them, with the per-kind
efficiency of spec.links), prices the collective with ``cost.comm.collective_seconds`` and turns the
time into nccl-tests' bus bandwidth with ``cost.comm.bus_bandwidth`` (doc/PERFORMANCE.md of
NVIDIA/nccl-tests: busbw = size / time x 2 (n-1)/n for all-reduce, (n-1)/n for all-gather,
reduce-scatter and all-to-all, 1 for send/recv).

Rows whose ``scope`` is not ``modelled`` measure something the model does not claim to price
(NVLink SHARP's in-switch reduction, ``nvls``; two GPUs of a full mesh on one link, ``mesh-pair``):
they are listed and scored, but kept out of the headline mean.

The per-kind efficiencies estimated from these rows (spec.links.KIND_DEFAULTS: efa, tcpx, xgmi) are
solved against the model itself (_solve_efficiency: the efficiency at which cost.comm reproduces each
bandwidth-bound row) and are in-sample for the rows of that kind; the leave-one-source-out figures
re-price those rows with the kind's efficiency estimated without the row's own source.
"""
from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from meshplan.cost.comm import COLLECTIVES, bus_bandwidth, collective_seconds
from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec, LinkTier, default_links
from meshplan.spec.io import load_gpu
from meshplan.spec.links import KIND_DEFAULTS, link_efficiency

DEV_CSV = "collectives_dev.csv"
COLUMNS = ("row_id", "source_id", "citation", "collective", "gpu", "nodes", "gpus_per_node", "ranks",
           "intra_kind", "intra_gbps", "inter_kind", "inter_gbps", "inter_published", "nbytes", "time_us",
           "busbw_gbs", "algo", "scope", "note")
SCOPES = ("modelled", "nvls", "mesh-pair")
GIB = 2 ** 30


def default_path() -> Path:
    """The shipped collective rows (meshplan/data/collectives_dev.csv)."""
    return Path(str(resources.files("meshplan") / "data" / DEV_CSV))


@dataclass(frozen=True)
class CollectiveRow:
    """One published measurement of one collective."""

    row_id: str
    source_id: str
    citation: str
    collective: str
    gpu: str
    nodes: int
    gpus_per_node: int
    ranks: int
    nbytes: float
    busbw_gbs: float
    """Bus bandwidth, GB/s (1e9 B/s): as published, or derived from time_us by nccl-tests' formula."""
    time_us: float | None = None
    intra_kind: str = ""
    intra_gbps: float | None = None
    inter_kind: str = ""
    inter_gbps: float | None = None
    inter_published: str = ""
    algo: str = ""
    scope: str = "modelled"
    note: str = ""

    @property
    def derived_busbw_gbs(self) -> float | None:
        """busbw from the published time (nccl-tests' formula), where a time is published."""
        if self.time_us is None:
            return None
        return bus_bandwidth(self.collective, self.nbytes, self.ranks, self.time_us * 1e-6) / 1e9


def _num(raw: dict[str, str], key: str, where: str, cast: Any = float, required: bool = True) -> Any:
    text = (raw.get(key) or "").strip()
    if not text:
        if required:
            raise MeshplanError(f"{where}: {key} is empty")
        return None
    try:
        v = cast(text)
    except ValueError:
        raise MeshplanError(f"{where}: {key} = {text!r} is not a number") from None
    if isinstance(v, float) and not math.isfinite(v) or v <= 0:
        raise MeshplanError(f"{where}: {key} must be a positive number; got {text!r}")
    return v


def row_from_dict(raw: dict[str, str], where: str) -> CollectiveRow:
    missing = [c for c in COLUMNS if c not in raw]
    if missing:
        raise MeshplanError(f"{where}: missing column(s) {', '.join(missing)}", hint="columns: " + ", ".join(COLUMNS))
    op = raw["collective"].strip()
    if op not in COLLECTIVES:
        raise MeshplanError(f"{where}: unknown collective {op!r}", hint="one of " + ", ".join(COLLECTIVES))
    scope = (raw["scope"] or "modelled").strip()
    if scope not in SCOPES:
        raise MeshplanError(f"{where}: unknown scope {scope!r}", hint="one of " + ", ".join(SCOPES))
    row = CollectiveRow(
        row_id=raw["row_id"].strip(), source_id=raw["source_id"].strip(), citation=raw["citation"].strip(),
        collective=op, gpu=raw["gpu"].strip(), nodes=_num(raw, "nodes", where, int),
        gpus_per_node=_num(raw, "gpus_per_node", where, int), ranks=_num(raw, "ranks", where, int),
        nbytes=_num(raw, "nbytes", where), busbw_gbs=_num(raw, "busbw_gbs", where),
        time_us=_num(raw, "time_us", where, required=False), intra_kind=raw["intra_kind"].strip(),
        intra_gbps=_num(raw, "intra_gbps", where, required=False), inter_kind=raw["inter_kind"].strip(),
        inter_gbps=_num(raw, "inter_gbps", where, required=False), inter_published=raw["inter_published"].strip(),
        algo=raw["algo"].strip(), scope=scope, note=raw["note"].strip())
    if not row.row_id or not row.source_id or not row.citation:
        raise MeshplanError(f"{where}: row_id, source_id and citation are required")
    if row.ranks > row.nodes * row.gpus_per_node or (row.nodes > 1 and row.ranks != row.nodes * row.gpus_per_node):
        raise MeshplanError(f"{where}: ranks={row.ranks} does not fit {row.nodes} node(s) of {row.gpus_per_node}",
                            hint="multi-node rows use every GPU of every node")
    return row


def load_rows(path: str | Path | None = None) -> list[CollectiveRow]:
    """The rows of a collectives CSV (default: the shipped development set)."""
    p = default_path() if path is None else Path(path)
    try:
        with open(p, newline="") as f:
            raws = list(csv.DictReader(f))
    except OSError as e:
        raise MeshplanError(f"cannot read {p}: {e.strerror or e}") from None
    rows = [row_from_dict(r, f"{p.name} line {i + 2}") for i, r in enumerate(raws)]
    ids = [r.row_id for r in rows]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise MeshplanError(f"{p.name}: row_id {dup[0]!r} is used twice")
    return rows


def cluster_for(row: CollectiveRow, efficiency: dict[str, float] | None = None) -> ClusterSpec:
    """The row's cluster: its GPU preset with default_links, the links the row states overriding
    them (bandwidth, kind, and that kind's efficiency; ``efficiency`` overrides a kind's value)."""
    eff = efficiency or {}
    gpu = load_gpu(row.gpu)
    intra, inter = default_links(gpu)

    def tier(base: LinkTier, name: str, kind: str, gbps: float | None) -> LinkTier:
        if not kind and gbps is None:
            return base
        k = kind or base.kind
        if k == base.kind and k not in eff:
            e = base.efficiency
        else:
            e = eff.get(k) or link_efficiency(name, k, where=f"row {row.row_id}")
        return LinkTier(name=name, bandwidth_gbps=gbps or base.bandwidth_gbps, latency_us=base.latency_us,
                        efficiency=e, kind=k)

    return ClusterSpec(name=row.row_id, gpu=gpu, num_nodes=row.nodes, gpus_per_node=row.gpus_per_node,
                       intra_node=tier(intra, "intra_node", row.intra_kind, row.intra_gbps),
                       inter_node=tier(inter, "inter_node", row.inter_kind, row.inter_gbps))


def predict_busbw(row: CollectiveRow, efficiency: dict[str, float] | None = None) -> float:
    """The model's bus bandwidth for the row, GB/s."""
    c = cluster_for(row, efficiency)
    t = collective_seconds(c, row.collective, row.nbytes, row.ranks, 1)
    return bus_bandwidth(row.collective, row.nbytes, row.ranks, t) / 1e9


# --- per-kind efficiency estimates (spec.links.KIND_DEFAULTS 'estimated' entries) ---------------------

def _kind_samples(rows: Iterable[CollectiveRow], kind: str) -> dict[str, list[float]]:
    """source -> achieved fractions of line rate of ``kind`` in its large (>= 1 GiB, bandwidth-bound)
    modelled all-reduce rows: the efficiency at which the cost model (cost.comm, whatever algorithm it
    runs: ring, NCCL's tree on 2 nodes, ...) reproduces the measured bus bandwidth (solved by bisection
    in (0, 1]; a row the model cannot reach at 1 counts 1). A network kind: multi-node rows whose
    inter-node link is of the kind; an intra-node kind: full-node single-node rows."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r.scope != "modelled" or r.collective != "all_reduce" or r.nbytes < GIB:
            continue
        if not ((r.nodes > 1 and r.inter_kind == kind and r.inter_gbps)
                or (r.nodes == 1 and r.intra_kind == kind and r.ranks == r.gpus_per_node)):
            continue
        out.setdefault(r.source_id, []).append(_solve_efficiency(r, kind))
    return out


def _solve_efficiency(row: CollectiveRow, kind: str) -> float:
    """The efficiency of ``kind`` at which predict_busbw(row) equals the measured busbw (monotone in it)."""
    lo, hi = 1e-3, 1.0
    if predict_busbw(row, {kind: hi}) <= row.busbw_gbs:
        return hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if predict_busbw(row, {kind: mid}) < row.busbw_gbs:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def estimate_kind_efficiency(rows: Iterable[CollectiveRow], kind: str, *,
                             exclude_source: str | None = None) -> float | None:
    """Mean over sources (each source's mean once) of the kind's achieved fraction; None without data."""
    per = {s: v for s, v in _kind_samples(rows, kind).items() if s != exclude_source}
    if not per:
        return None
    return statistics.fmean(statistics.fmean(v) for v in per.values())


ESTIMATED_KINDS = tuple(k for k, v in KIND_DEFAULTS.items() if v.basis == "estimated")


# --- scoring -------------------------------------------------------------------------------------------

@dataclass
class Scored:
    row: CollectiveRow
    predicted_gbs: float
    error_pct: float
    loso_predicted_gbs: float | None = None
    loso_error_pct: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _mean_abs(xs: list[float]) -> float | None:
    return statistics.fmean(abs(x) for x in xs) if xs else None


def score(rows: list[CollectiveRow]) -> list[Scored]:
    """Every row priced, with the in-sample prediction and, for rows of an estimated kind, the one
    under that kind's efficiency estimated without the row's source (no estimate left: the prior 0.8)."""
    out = []
    for r in rows:
        p = predict_busbw(r)
        s = Scored(r, p, (p - r.busbw_gbs) / r.busbw_gbs * 100)
        kinds = [k for k in (r.inter_kind if r.nodes > 1 else "", r.intra_kind) if k in ESTIMATED_KINDS]
        if kinds:
            eff = {k: estimate_kind_efficiency(rows, k, exclude_source=r.source_id) or 0.8 for k in kinds}
            lp = predict_busbw(r, eff)
            s.loso_predicted_gbs, s.loso_error_pct = lp, (lp - r.busbw_gbs) / r.busbw_gbs * 100
        else:
            s.loso_predicted_gbs, s.loso_error_pct = p, s.error_pct
        out.append(s)
    return out


def summarize(scored: list[Scored]) -> dict[str, Any]:
    modelled = [s for s in scored if s.row.scope == "modelled"]
    sources = sorted({s.row.source_id for s in scored})
    per_source = {}
    for src in sources:
        mine = [s for s in modelled if s.row.source_id == src]
        per_source[src] = {"rows": len(mine), "mean_abs_error_pct": _mean_abs([s.error_pct for s in mine]),
                           "loso_mean_abs_error_pct": _mean_abs([s.loso_error_pct for s in mine
                                                                 if s.loso_error_pct is not None])}
    large = [s for s in modelled if s.row.nbytes >= 256 * 2 ** 20]
    worst = sorted(modelled, key=lambda s: -abs(s.error_pct))[:5]
    within = [s for s in modelled if abs(s.error_pct) <= 15.0]
    return {
        "rows": len(scored), "sources": len(sources), "modelled_rows": len(modelled),
        "mean_abs_error_pct": _mean_abs([s.error_pct for s in modelled]),
        "median_abs_error_pct": statistics.median(abs(s.error_pct) for s in modelled) if modelled else None,
        "loso_mean_abs_error_pct": _mean_abs([s.loso_error_pct for s in modelled if s.loso_error_pct is not None]),
        "large_rows": len(large), "large_mean_abs_error_pct": _mean_abs([s.error_pct for s in large]),
        "all_rows_mean_abs_error_pct": _mean_abs([s.error_pct for s in scored]),
        "rows_within_15pct": len(within),
        "mean_source_mean_abs_error_pct": _mean_abs([v["mean_abs_error_pct"] for v in per_source.values()
                                                     if v["mean_abs_error_pct"] is not None]),
        "per_source": per_source,
        "worst": [{"row_id": s.row.row_id, "error_pct": s.error_pct} for s in worst],
        "kind_estimates": {k: {"table": KIND_DEFAULTS[k].efficiency,
                               "estimate": _round(estimate_kind_efficiency(_rows_of(scored), k)),
                               "loso": {src: _round(estimate_kind_efficiency(_rows_of(scored), k, exclude_source=src))
                                        for src in _kind_samples(_rows_of(scored), k)}}
                           for k in ESTIMATED_KINDS},
    }


def _rows_of(scored: list[Scored]) -> list[CollectiveRow]:
    return [s.row for s in scored]


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def validate_collectives(path: str | Path | None = None) -> dict[str, Any]:
    """The collectives section of ``meshplan validate``: per-row and summary, JSON-able."""
    scored = score(load_rows(path))
    rows = [{"row_id": s.row.row_id, "source_id": s.row.source_id, "collective": s.row.collective,
             "gpu": s.row.gpu, "nodes": s.row.nodes, "ranks": s.row.ranks, "nbytes": s.row.nbytes,
             "inter_kind": s.row.inter_kind if s.row.nodes > 1 else "", "algo": s.row.algo, "scope": s.row.scope,
             "measured_busbw_gbs": s.row.busbw_gbs, "predicted_busbw_gbs": round(s.predicted_gbs, 3),
             "error_pct": round(s.error_pct, 2),
             "loso_error_pct": None if s.loso_error_pct is None else round(s.loso_error_pct, 2),
             "citation": s.row.citation} for s in scored]
    return {"rows": rows, "summary": summarize(scored)}


def _size(n: float) -> str:
    for unit, k in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("GB", 10 ** 9), ("MB", 10 ** 6), ("KiB", 2 ** 10)):
        if n >= k and abs(n / k - round(n / k)) < 1e-9:
            return f"{n / k:g}{unit}"
    return f"{n / 1e9:g}GB" if n >= 1e9 else f"{n / 1e6:g}MB" if n >= 1e6 else f"{n:g}B"


def to_text(result: dict[str, Any]) -> str:
    s = result["summary"]

    def f(x: float | None, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [f"Collectives: predicted vs measured bus bandwidth (nccl-tests busbw, GB/s) of {s['rows']} published "
             f"rows from {s['sources']} sources (data/collectives_dev.csv; {s['modelled_rows']} in the model's scope)",
             "",
             f"{'row':20s} {'op':14s} {'gpu':15s} {'nodes':>5s} {'ranks':>5s} {'size':>8s} {'link':>6s} "
             f"{'measured':>9s} {'predicted':>9s} {'err %':>7s} {'loso %':>7s}  scope"]
    for r in result["rows"]:
        lines.append(f"{r['row_id']:20s} {r['collective']:14s} {r['gpu']:15s} {r['nodes']:5d} {r['ranks']:5d} "
                     f"{_size(r['nbytes']):>8s} {r['inter_kind'] or '-':>6s} {r['measured_busbw_gbs']:9.2f} "
                     f"{r['predicted_busbw_gbs']:9.2f} {r['error_pct']:+7.1f} {f(r['loso_error_pct'], '+.1f'):>7s}  "
                     f"{r['scope']}")
    lines += ["", "per source (modelled rows): " + "; ".join(
        f"{k} {v['rows']} rows {f(v['mean_abs_error_pct'])}%" for k, v in s["per_source"].items()),
        f"collectives: busbw mean abs error {f(s['mean_abs_error_pct'])}% over {s['modelled_rows']} modelled rows "
        f"(median {f(s['median_abs_error_pct'])}%, >= 256 MiB {f(s['large_mean_abs_error_pct'])}% over "
        f"{s['large_rows']}, leave-one-source-out {f(s['loso_mean_abs_error_pct'])}%, all {s['rows']} rows "
        f"{f(s['all_rows_mean_abs_error_pct'])}%); {s['rows_within_15pct']} of {s['modelled_rows']} within 15%",
        "worst: " + ", ".join(f"{w['row_id']} {w['error_pct']:+.0f}%" for w in s["worst"])]
    return "\n".join(lines)
