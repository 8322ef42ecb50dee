"""Micro-benchmark results (runtime.bench) -> calibration values, by inverting the cost model.

Every value is the one that makes the cost model's own function reproduce the measurement, on
the reference the measurements were compared with (the device's GPU preset, or on CPU the
`local-cpu` device), never a formula of its own:

  gemm_efficiency@FAMILY, gemm_half_dim, gemm_half_tokens
      cost.compute.gemm_time(m, n, k, peak, gpu, p) against each measured GEMM (the 16-bit ones;
      fp32 on CPU): for each (gemm_half_dim, gemm_half_tokens) on a grid over their bounds, zoomed
      in around the best, the efficiency is closed-form (time is 1/efficiency: the geometric mean
      of model time at efficiency 1 over measured time); the pair with the least squared log
      error wins. A half-size the shapes cannot tell (no sweep of that dimension) keeps its
      current value. The family value is the part's over its clock_ratio.
  attention_efficiency@FAMILY, attn_half_seq
      cost.compute.attention_seconds (forward, FlashAttention, causal) against each sequence
      length, the same way (attn_half_seq on a grid; needs two or more lengths).
  hbm_efficiency
      cost.compute.mem_time against the elementwise ops on the largest tensors (the median).
  link_efficiency@TIER:KIND
      cost.comm.Group (Group.of on the reference cluster, the op's ring formula) against each
      collective: the efficiency whose model time equals the measured one (bisection; time falls
      as efficiency rises), the median over the messages the bandwidth term dominates (the
      model's latency term under a quarter of the time; else each op's largest message).
      Within a node first, then across nodes with the fitted intra-node value.

Each value is clamped to its Fittable's bounds (the change records the unclamped value too);
each change names the measurements it came from. On CPU the numbers are labelled CPU
(``device_kind: "cpu"``): the CPU has no GPU family, so no family efficiency is written, and the
calibration carries a note (store.load_calibration warns when it is used).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.builtin_calibration import gpu_key, link_key
from meshplan.calibration.space import FAMILIES, by_name
from meshplan.errors import MeshplanError

CPU_NOTE = ("measured on CPU (meshplan calibrate --bench without a GPU, gloo for the collectives): these values "
            "describe this machine's CPU as the cost model's `local-cpu` device, not a GPU; use the file to test "
            "the pipeline, not to plan GPU runs")
LATENCY_SHARE = 0.25
"""A collective informs its link's efficiency when the model's latency term is under this share of
its time (the bandwidth term dominates)."""
GEMM_FIT_DTYPES = ("bf16", "fp16")
"""The dtypes the GEMM efficiency is fitted to (what training runs in); fp32 when none was
measured (CPU)."""


@dataclass
class Derived:
    """One calibration value the measurements give."""

    name: str
    value: float
    """Clamped to the Fittable's bounds."""
    unclamped: float
    was: float
    """The value the cost model used before (the reference's)."""
    measurements: list[str]
    method: str

    @property
    def clamped(self) -> bool:
        return not math.isclose(self.value, self.unclamped, rel_tol=1e-9)

    def change(self) -> dict[str, Any]:
        out: dict[str, Any] = {"from": self.was, "to": self.value, "measurements": list(self.measurements),
                               "method": self.method}
        if self.clamped:
            out["clamped"] = True
            out["unclamped"] = self.unclamped
        return out


@dataclass
class BenchFit:
    values: dict[str, float]
    derived: list[Derived]
    device_kind: str
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    """What info["bench"] carries: the device, the reference, each fit's error, each measurement
    beside the cost model's time with the new values, what was not measured."""

    def changes(self) -> dict[str, dict[str, Any]]:
        return {d.name: d.change() for d in self.derived if d.name in self.values}

    def info(self) -> dict[str, Any]:
        """The calibration file's provenance for these values."""
        out: dict[str, Any] = {"device_kind": self.device_kind, "changes": self.changes(), "bench": self.summary}
        if self.device_kind == "cpu":
            out["note"] = CPU_NOTE
        return out


# ---- reading ---------------------------------------------------------------------------------
def check_raw(raw: Any, where: str = "bench results") -> dict[str, Any]:
    """The raw results of runtime.bench (or a --bench-out file), checked."""
    if not isinstance(raw, dict) or raw.get("kind") != "bench" or not isinstance(raw.get("measurements"), list):
        raise MeshplanError(f"{where}: not micro-benchmark results (expected the JSON `meshplan calibrate --bench "
                            "--bench-out` writes)")
    if raw.get("device_kind") not in ("cpu", "cuda"):
        raise MeshplanError(f"{where}: device_kind must be 'cpu' or 'cuda'; got {raw.get('device_kind')!r}")
    ref = raw.get("reference")
    if not isinstance(ref, dict) or not isinstance(ref.get("cluster"), dict):
        raise MeshplanError(f"{where}: no reference cluster (the peaks and bandwidths the numbers are compared with)")
    for i, m in enumerate(raw["measurements"]):
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            raise MeshplanError(f"{where}: measurement {i} is not an object with an 'id'")
        if "not_measured" in m:
            continue
        need = REQUIRED.get(str(m.get("kind")))
        if need is None:
            raise MeshplanError(f"{where}: measurement {m['id']}: unknown kind {m.get('kind')!r}",
                                hint=f"kinds: {', '.join(REQUIRED)}")
        bad = [k for k in need if k not in m or (k not in CHOICES and not _positive(m[k]))
               or (k in CHOICES and m[k] not in CHOICES[k])]
        if bad:
            raise MeshplanError(f"{where}: measurement {m['id']}: missing or invalid {', '.join(bad)}",
                                hint="give the JSON file `meshplan calibrate --bench --bench-out` wrote")
    return raw


def _positive(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


REQUIRED = {"gemm": ("dtype", "m", "n", "k", "seconds"),
            "attention": ("dtype", "batch", "seq", "heads", "head_dim", "seconds"),
            "elementwise": ("tensor_bytes", "bytes_moved", "seconds"),
            "collective": ("op", "tier", "n", "stride", "bytes", "seconds")}
"""The fields each kind of measurement needs (runtime.bench writes them)."""
CHOICES = {"dtype": ("fp32", "bf16", "fp16"), "tier": ("intra_node", "inter_node"),
           "op": ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")}


def reference_cluster(raw: dict[str, Any]) -> Any:
    from meshplan.spec.io import cluster_from_dict
    return cluster_from_dict(dict(raw["reference"]["cluster"]), where="bench reference cluster")


def _measured(ms: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in ms if m.get("kind") == kind and "not_measured" not in m
            and isinstance(m.get("seconds"), (int, float)) and m["seconds"] > 0]


def _clamp(name: str, v: float) -> float:
    f = by_name(name)
    return min(f.high, max(f.low, v))


def _fit_shape(resid: Any, axes: list[tuple[float, float, float | None]]) -> tuple[tuple[float, ...], float, float]:
    """The shape parameters of a kernel time by least squares on log time, its overall level left
    free (that level is the part's efficiency): ``resid(*xs)`` gives log(model / measured) per
    measurement; ``axes`` as ``_zoom``'s. Returns (the parameters, the level exp(mean residual),
    the rms of the residuals about it)."""
    def cost(*xs: float) -> float:
        r = resid(*xs)
        return float(((r - r.mean()) ** 2).sum())
    xs = _zoom(cost, axes)
    r = resid(*xs)
    return xs, float(math.exp(r.mean())), float(np.sqrt(np.mean((r - r.mean()) ** 2)))


def _zoom(cost: Any, axes: list[tuple[float, float, float | None]], points: int = 41, zooms: int = 6,
          ) -> tuple[float, ...]:
    """Minimise ``cost(*xs)`` over a log grid of each axis (lo, hi, fixed): a fixed axis keeps its
    value; the others start on ``points`` values over [lo, hi] and zoom in around the best."""
    los = [math.log(lo) for lo, hi, fx in axes]
    his = [math.log(hi) for lo, hi, fx in axes]
    best = [math.log(fx) if fx is not None else 0.5 * (a + b) for (lo, hi, fx), a, b in zip(axes, los, his)]
    span = [(b - a) / 2 for a, b in zip(los, his)]
    for z in range(zooms):
        n = points if z == 0 else 9
        grids = [[best[i]] if axes[i][2] is not None else
                 list(np.clip(np.linspace(best[i] - span[i], best[i] + span[i], n), los[i], his[i]))
                 for i in range(len(axes))]
        cands = np.array(np.meshgrid(*grids, indexing="ij")).reshape(len(axes), -1).T
        costs = [cost(*np.exp(c)) for c in cands]
        best = list(cands[int(np.argmin(costs))])
        span = [s / (points - 1) * 2 if z == 0 else s / 4 for s in span]
    return tuple(float(math.exp(b)) for b in best)


# ---- GEMMs -----------------------------------------------------------------------------------
def fit_gemm(ms: list[dict[str, Any]], gpu: Any, p: Any) -> tuple[list[Derived], dict[str, Any], Any]:
    """(derived values, fit summary, CostParams with the fitted half-sizes)."""
    from meshplan.cost.compute import gemm_time
    gm = _measured(ms, "gemm")
    use = [m for m in gm if m.get("dtype") in GEMM_FIT_DTYPES] or [m for m in gm if m.get("dtype") == "fp32"]
    if not use:
        return [], {}, p
    g1 = dataclasses.replace(gpu, gemm_efficiency=1.0)
    t = np.array([m["seconds"] for m in use])
    shapes = [(m["m"], m["n"], m["k"], gpu.peak(m["dtype"])) for m in use]
    by_nk: dict[tuple[int, int], set[int]] = {}
    by_m: dict[int, set[tuple[int, int]]] = {}
    for m, n, k, _ in shapes:
        by_nk.setdefault((n, k), set()).add(m)
        by_m.setdefault(m, set()).add((n, k))
    tokens_ok = any(len(v) > 1 for v in by_nk.values())
    dim_ok = any(len(v) > 1 for v in by_m.values())
    fd, ft = by_name("gemm_half_dim"), by_name("gemm_half_tokens")

    def resid(h: float, hm: float) -> np.ndarray:
        q = p.replace(gemm_half_dim=h, gemm_half_tokens=hm)
        return np.log([gemm_time(m, n, k, pk, g1, q) for m, n, k, pk in shapes]) - np.log(t)

    (h, hm), part, rms = _fit_shape(resid, [(fd.low, fd.high, None if dim_ok else p.gemm_half_dim),
                                            (ft.low, ft.high, None if tokens_ok else p.gemm_half_tokens)])
    ids = [m["id"] for m in use]
    out = []
    if dim_ok:
        out.append(Derived("gemm_half_dim", _clamp("gemm_half_dim", h), h, p.gemm_half_dim, ids,
                           "cost.compute.gemm_time fitted to the GEMMs (least squares in log time)"))
    if tokens_ok:
        out.append(Derived("gemm_half_tokens", _clamp("gemm_half_tokens", hm), hm, p.gemm_half_tokens, ids,
                           "cost.compute.gemm_time fitted to the GEMMs (least squares in log time)"))
    fam = gpu.family
    if fam in FAMILIES:
        name = gpu_key("gemm_efficiency", fam)
        v = part / gpu.clock_ratio
        out.append(Derived(name, _clamp(name, v), v, gpu.gemm_efficiency / gpu.clock_ratio, ids,
                           f"achieved / ({gpu.name} peak x cost.compute.gemm_efficiency's shape factor), "
                           f"geometric mean, / clock_ratio {gpu.clock_ratio:g}"))
    q = p.replace(gemm_half_dim=_clamp("gemm_half_dim", h), gemm_half_tokens=_clamp("gemm_half_tokens", hm))
    summary = {"dtypes": sorted({m["dtype"] for m in use}), "measurements": len(use),
               "part_efficiency": part, "rms_log_error": rms,
               "identified": [n for n, ok in (("gemm_half_dim", dim_ok), ("gemm_half_tokens", tokens_ok)) if ok]}
    return out, summary, q


def gemm_model_seconds(m: dict[str, Any], gpu: Any, p: Any) -> float:
    from meshplan.cost.compute import gemm_time
    return float(gemm_time(m["m"], m["n"], m["k"], gpu.peak(m["dtype"]), gpu, p))


# ---- attention -------------------------------------------------------------------------------
def _attention_case(m: dict[str, Any]) -> tuple[Any, Any]:
    from meshplan.spec.graph import Attention
    from meshplan.spec.plan import Plan
    att = Attention(heads=int(m["heads"]), kv_heads=int(m["heads"]), head_dim=int(m["head_dim"]),
                    causal=bool(m.get("causal", True)))
    return att, Plan(flash_attention=True)


def attention_model_seconds(m: dict[str, Any], gpu: Any, p: Any) -> float:
    from meshplan.cost.compute import attention_seconds
    att, plan = _attention_case(m)
    return float(attention_seconds(att, plan, int(m["batch"]), int(m["seq"]), gpu, p, gpu.peak(m["dtype"]))[0])


def fit_attention(ms: list[dict[str, Any]], gpu: Any, p: Any) -> tuple[list[Derived], dict[str, Any], Any]:
    use = _measured(ms, "attention")
    if not use:
        return [], {}, p
    p = p.replace(attention_kernel="flash2")  # torch SDPA's FlashAttention backend: FlashAttention-2
    g1 = dataclasses.replace(gpu, attention_efficiency=1.0)
    t = np.array([m["seconds"] for m in use])
    seq_ok = len({m["seq"] for m in use}) > 1
    fa = by_name("attn_half_seq")

    def resid(hs: float) -> np.ndarray:
        q = p.replace(attn_half_seq=hs)
        return np.log([attention_model_seconds(m, g1, q) for m in use]) - np.log(t)

    (hs,), part, rms = _fit_shape(resid, [(fa.low, fa.high, None if seq_ok else p.attn_half_seq)])
    ids = [m["id"] for m in use]
    out = []
    if seq_ok:
        out.append(Derived("attn_half_seq", _clamp("attn_half_seq", hs), hs, p.attn_half_seq, ids,
                           "cost.compute.attention_seconds (forward) fitted to the sequence lengths"))
    if gpu.family in FAMILIES:
        name = gpu_key("attention_efficiency", gpu.family)
        was = gpu.attention_efficiency if gpu.attention_efficiency is not None else \
            gpu.gemm_efficiency * p.flash_fwd_efficiency
        v = part / gpu.clock_ratio
        out.append(Derived(name, _clamp(name, v), v, was / gpu.clock_ratio, ids,
                           "achieved / (peak x cost.compute.attention_seconds' head-dim and sequence factors), "
                           f"geometric mean, / clock_ratio {gpu.clock_ratio:g}"))
    summary = {"measurements": len(use), "backends": sorted({str(m.get("backend")) for m in use}),
               "part_efficiency": part, "rms_log_error": rms,
               "identified": ["attn_half_seq"] if seq_ok else []}
    return out, summary, p.replace(attn_half_seq=_clamp("attn_half_seq", hs))


# ---- HBM ---------------------------------------------------------------------------------------
def hbm_model_seconds(m: dict[str, Any], gpu: Any, p: Any) -> float:
    from meshplan.cost.compute import mem_time
    return float(mem_time(m["bytes_moved"], gpu, p))


def fit_hbm(ms: list[dict[str, Any]], gpu: Any, p: Any) -> tuple[list[Derived], dict[str, Any], Any]:
    use = _measured(ms, "elementwise")
    if not use:
        return [], {}, p
    largest = max(m["tensor_bytes"] for m in use)
    use = [m for m in use if m["tensor_bytes"] == largest]
    p1 = p.replace(hbm_efficiency=1.0)
    each = [hbm_model_seconds(m, gpu, p1) / m["seconds"] for m in use]
    v = float(statistics.median(each))
    d = Derived("hbm_efficiency", _clamp("hbm_efficiency", v), v, p.hbm_efficiency, [m["id"] for m in use],
                f"cost.compute.mem_time at efficiency 1 / measured time (median of the ops on the largest tensors; "
                f"{gpu.hbm_bandwidth_gbps:g} GB/s)")
    return [d], {"measurements": len(use), "each": {m["id"]: e for m, e in zip(use, each)}}, \
        p.replace(hbm_efficiency=d.value)


# ---- links -------------------------------------------------------------------------------------
def _with_link(cluster: Any, tier: str, eff: float) -> Any:
    return cluster.replace(**{tier: dataclasses.replace(getattr(cluster, tier), efficiency=eff)})


def collective_model_seconds(m: dict[str, Any], cluster: Any, size: float | None = None) -> float:
    """The cost model's time of collective ``m`` on ``cluster`` (cost.comm.Group: its ring formulas)."""
    from meshplan.cost.comm import Group
    g = Group.of(cluster, m["n"], m["stride"])
    return float(getattr(g, m["op"])(float(m["bytes"] if size is None else size)))


def _solve_link(m: dict[str, Any], cluster: Any, tier: str, lo: float = 1e-4) -> float:
    """The link efficiency at which the cost model's time of ``m`` is the measured one (in
    [lo, 1]; the ends when the measurement is outside what the model can give)."""
    t = m["seconds"]

    def f(e: float) -> float:
        return collective_model_seconds(m, _with_link(cluster, tier, e))
    if f(1.0) >= t:
        return 1.0
    if f(lo) <= t:
        return lo
    a, b = math.log(lo), 0.0
    for _ in range(60):
        mid = 0.5 * (a + b)
        if f(math.exp(mid)) > t:
            a = mid
        else:
            b = mid
    return math.exp(0.5 * (a + b))


def fit_links(ms: list[dict[str, Any]], cluster: Any) -> tuple[list[Derived], dict[str, Any], Any]:
    out: list[Derived] = []
    summary: dict[str, Any] = {}
    for tier in ("intra_node", "inter_node"):
        use = [m for m in _measured(ms, "collective") if m.get("tier") == tier]
        link = getattr(cluster, tier)
        if not use or link is None:
            continue
        name = link_key(tier, link.kind)
        try:
            by_name(name)
        except KeyError:
            summary[tier] = {"skipped": f"{name} is not a calibrated link kind"}
            continue
        each = {m["id"]: _solve_link(m, cluster, tier) for m in use}
        share = {m["id"]: collective_model_seconds(m, _with_link(cluster, tier, each[m["id"]]), size=1.0)
                 / m["seconds"] for m in use}
        keep = [m for m in use if share[m["id"]] < LATENCY_SHARE]
        if not keep:  # every message latency-bound: each op's largest
            biggest: dict[str, dict[str, Any]] = {}
            for m in use:
                if m["op"] not in biggest or m["bytes"] > biggest[m["op"]]["bytes"]:
                    biggest[m["op"]] = m
            keep = list(biggest.values())
        v = float(statistics.median(each[m["id"]] for m in keep))
        d = Derived(name, _clamp(name, v), v, link.efficiency, [m["id"] for m in keep],
                    f"cost.comm.Group ({link.bandwidth_gbps:g} GB/s {link.kind}, {link.latency_us:g} us) solved for "
                    "the efficiency that gives each measured time; median over the bandwidth-bound messages")
        out.append(d)
        summary[tier] = {"link": f"{link.kind} {link.bandwidth_gbps:g} GB/s", "measurements": len(use),
                         "used": len(keep), "each": each}
        cluster = _with_link(cluster, tier, d.value)
    return out, summary, cluster


# ---- together ----------------------------------------------------------------------------------
def _compact(m: dict[str, Any], model_s: float | None) -> dict[str, Any]:
    keep = ("id", "seconds", "tflops", "gbps", "busbw_gbps", "algbw_gbps", "fraction_of_peak", "backend")
    out = {k: m[k] for k in keep if k in m}
    if model_s is not None:
        out["model_seconds"] = model_s
        out["model_error_pct"] = round((model_s / m["seconds"] - 1) * 100, 2)
    return out


def fit_bench(raw: dict[str, Any], start: dict[str, float] | None = None,
              names: Sequence[str] | None = None) -> BenchFit:
    """The calibration values the micro-benchmarks ``raw`` give (each Derived with the
    measurements it came from). ``start``: calibration values to apply to the reference first
    (default: the built-in calibration, which the reference already carries). ``names``: keep
    only these (default: every value the measurements give)."""
    from meshplan.calibration.store import Calibration
    from meshplan.cost.params import DEFAULT_PARAMS
    raw = check_raw(raw)
    kind = raw["device_kind"]
    cal = Calibration(dict(start or {}))
    cluster = cal.apply_cluster(reference_cluster(raw))
    p = cal.apply_params(DEFAULT_PARAMS)
    gpu = cluster.gpu
    ms = raw["measurements"]
    derived: list[Derived] = []
    fits: dict[str, Any] = {}
    d, fits["hbm"], p = fit_hbm(ms, gpu, p)
    derived += d
    d, fits["gemm"], p = fit_gemm(ms, gpu, p)
    derived += d
    d, fits["attention"], p = fit_attention(ms, gpu, p)
    derived += d
    d, fits["links"], _ = fit_links(ms, cluster)
    derived += d
    values = {x.name: x.value for x in derived if names is None or x.name in names}
    notes = []
    if kind == "cpu":
        notes.append(CPU_NOTE)
    if gpu.family not in FAMILIES:
        fam = [x for x in ("gemm", "attention") if fits.get(x)]
        if fam:
            notes.append(f"{' and '.join(fam)} efficiency not written: {gpu.name} has no GPU family ("
                         + ", ".join(f"{x} {fits[x]['part_efficiency']:.3g} of its peak" for x in fam) + ")")
    for x in derived:
        if x.clamped and x.name in values:
            notes.append(f"{x.name}: the measurements give {x.unclamped:.4g}, outside its range; clamped to "
                         f"{x.value:.4g}")
    # the measurements beside the cost model's time with every new value
    new = Calibration(values)
    after_c = new.apply_cluster(cluster)
    after_p = new.apply_params(p)
    gpu_after = after_c.gpu
    compact = []
    for m in ms:
        if "not_measured" in m:
            continue
        model = None
        k = m.get("kind")
        try:
            if k == "gemm":
                model = gemm_model_seconds(m, gpu_after, after_p)
            elif k == "attention":
                model = attention_model_seconds(m, gpu_after, after_p)
            elif k == "elementwise":
                model = hbm_model_seconds(m, gpu_after, after_p)
            elif k == "collective" and getattr(after_c, m.get("tier", ""), None) is not None:
                model = collective_model_seconds(m, after_c)
        except (KeyError, TypeError, ValueError):
            model = None
        compact.append(_compact(m, model))
    missing = [{"id": m["id"], "why": m["not_measured"]} for m in ms if "not_measured" in m]
    summary = {
        "device_kind": kind, "label": "CPU" if kind == "cpu" else "GPU", "device_name": raw.get("device_name"),
        "reference": raw["reference"].get("gpu"), "basis": raw["reference"].get("basis"),
        "backend": raw.get("backend"), "torch": raw.get("torch"), "date": raw.get("date"),
        "nproc_per_node": raw.get("nproc_per_node"), "nnodes": raw.get("nnodes"), "seconds": raw.get("seconds"),
        "measured": len(compact), "not_measured": missing, "fits": _round(fits), "measurements": compact,
        "unused": [x.name for x in derived if x.name not in values]}
    return BenchFit(values, derived, kind, notes, summary)


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.5g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x
