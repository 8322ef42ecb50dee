"""Fit the cost model's few free parameters to the published runs, and report every row.

    python benchmarks/fit_cost_model.py [--runs CSV] [--iters N] [--show-only]

Free parameters (all physically meaningful, bounded to plausible ranges):
  per GPU type: gemm_efficiency, attention_efficiency (GPU data files)
  global (CostParams): gemm_half_dim, gemm_half_tokens, attn_half_seq, hbm_efficiency,
  flash_bwd_efficiency, tp_exposed_async, overlap_slowdown; link efficiencies (intra-node,
  inter-node).
Objective: mean absolute log error over all rows plus penalties for a source above 9% and a
row above 18% (the acceptance targets: 5% overall, 10% per source, 20% per row). Needs scipy (dev only).
Writes benchmarks/results/fit_cost_model.json. Paste the values into the GPU files and
src/meshplan/cost/params.py by hand: the fit informs, the code states.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from meshplan.cost import DEFAULT_PARAMS, estimate  # noqa: E402
from meshplan.validate.report import default_runs_path  # noqa: E402
from meshplan.validate.runs import load_runs  # noqa: E402

GLOBAL = {  # name: (low, high)
    "gemm_half_dim": (16.0, 512.0), "gemm_half_tokens": (4.0, 512.0), "attn_half_seq": (16.0, 4096.0),
    "hbm_efficiency": (0.5, 0.95),
    "flash_bwd_efficiency": (0.6, 1.0),
    "tp_exposed_async": (0.2, 1.0), "overlap_slowdown": (0.0, 0.6),
}
LINK_BOUNDS = (0.3, 0.95)  # efficiency of each (tier, link kind) seen in the runs
PER_GPU = {"gemm_efficiency": (0.4, 0.9), "attention_efficiency": (0.15, 0.75)}


def _cases(path: str) -> list:
    return [c for c in load_runs(path) if c.status == "ok" and c.measured_step_time_s]


# A starting point away from the shallow minima near the current values.
START = {"a100-sxm-80gb.gemm_efficiency": 0.82, "a100-sxm-40gb.gemm_efficiency": 0.82,
         "a100-sxm-80gb.attention_efficiency": 0.35, "a100-sxm-40gb.attention_efficiency": 0.35,
         "h100-sxm-96gb-500w.gemm_efficiency": 0.55, "h100-sxm-96gb-500w.attention_efficiency": 0.25,
         "gemm_half_dim": 250.0, "gemm_half_tokens": 64.0, "attn_half_seq": 256.0,
         # mid-range, away from its bound of 0 where the bounded search barely moves
         "overlap_slowdown": 0.2}


def _space(cases: list, start: dict[str, float] | None = None,
           ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Names, lower and upper bounds, and starting values of the free parameters."""
    spec: list[tuple[str, float, float, float]] = []  # (name, low, high, current value)
    for g in sorted({c.cluster.gpu.name for c in cases}):
        gpu = next(c.cluster.gpu for c in cases if c.cluster.gpu.name == g)
        for k, (a, b) in PER_GPU.items():
            v = getattr(gpu, k) or gpu.gemm_efficiency * DEFAULT_PARAMS.flash_fwd_efficiency
            spec.append((f"{g}.{k}", a, b, v))
    spec += [(k, a, b, getattr(DEFAULT_PARAMS, k)) for k, (a, b) in GLOBAL.items()]
    links: dict[str, float] = {}
    for c in cases:
        for t in ("intra_node", "inter_node"):
            tier = getattr(c.cluster, t)
            links.setdefault(f"link.{t}.{tier.kind}", tier.efficiency)
    spec += [(k, *LINK_BOUNDS, v) for k, v in sorted(links.items())]
    names = [n for n, *_ in spec]
    lo, hi = np.array([a for _, a, _, _ in spec]), np.array([b for _, _, b, _ in spec])
    x0 = np.array([(start or {}).get(n, min(b, max(a, v))) for n, a, b, v in spec])
    return names, lo, hi, x0


def predict(cases: list, names: list[str], x: np.ndarray) -> list[float]:
    vals = dict(zip(names, x))
    p = DEFAULT_PARAMS.replace(**{k: float(vals[k]) for k in GLOBAL})
    out = []
    for c in cases:
        g = c.cluster.gpu
        gpu = dataclasses.replace(g, **{k: float(vals[f"{g.name}.{k}"]) for k in PER_GPU})
        links = {t: dataclasses.replace(getattr(c.cluster, t), efficiency=float(
                     vals[f"link.{t}.{getattr(c.cluster, t).kind}"])) for t in ("intra_node", "inter_node")}
        cl = c.cluster.replace(gpu=gpu, **links)
        out.append(estimate(c.model, cl, c.plan, c.work, p).step_time_s)
    return out


def loss(cases: list, names: list[str], x: np.ndarray) -> float:
    """The acceptance targets as a smooth objective: mean |log error| over all rows, plus
    penalties for any source above 9% and any row above 18%."""
    errs = np.array([math.log(t / c.measured_step_time_s)
                     for c, t in zip(cases, predict(cases, names, x))])
    a = np.abs(errs)
    total = float(np.mean(a)) + 5 * float(np.mean(np.maximum(0, a - 0.18)))
    src = np.array([c.source_id for c in cases])
    for s in set(src):
        total += 5 * max(0.0, float(np.mean(a[src == s])) - 0.09)
    return total


def report(cases: list, names: list[str], x: np.ndarray) -> dict:
    rows, by = [], {}
    for c, t in zip(cases, predict(cases, names, x)):
        e = (t / c.measured_step_time_s - 1) * 100
        rows.append({"row_id": c.row_id, "source_id": c.source_id, "error_pct": round(e, 2)})
        by.setdefault(c.source_id, []).append(e)
    allv = [abs(e) for v in by.values() for e in v]
    return {"params": {n: round(float(v), 4) for n, v in zip(names, x)},
            "mape_pct": float(np.mean(allv)), "max_abs_pct": float(np.max(allv)),
            "by_source": {s: {"rows": len(v), "mape_pct": float(np.mean(np.abs(v))),
                              "bias_pct": float(np.mean(v)), "max_abs_pct": float(np.max(np.abs(v)))}
                          for s, v in by.items()}, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(default_runs_path()))
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--show-only", action="store_true", help="report the current values, no fit")
    args = ap.parse_args()
    cases = _cases(args.runs)
    names, lo, hi, x0 = _space(cases, None if args.show_only else START)
    x = x0
    if not args.show_only:
        from scipy.optimize import minimize
        to_x = lambda z: lo + (hi - lo) / (1 + np.exp(-np.clip(z, -30, 30)))  # noqa: E731
        q = (x0 - lo) / (hi - lo)
        z0 = np.log(np.clip(q, 1e-3, 1 - 1e-3) / (1 - np.clip(q, 1e-3, 1 - 1e-3)))
        t0 = time.time()
        res = minimize(lambda z: loss(cases, names, to_x(z)), z0, method="Nelder-Mead",
                       options={"maxiter": args.iters, "xatol": 1e-4, "fatol": 1e-7})
        x = to_x(res.x)
        print(f"fit: {res.nit} iterations, {time.time() - t0:.0f} s, loss {res.fun:.4f}")
    out = report(cases, names, x)
    Path(__file__).parent.joinpath("results").mkdir(exist_ok=True)
    Path(__file__).parent.joinpath("results", "fit_cost_model.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out["params"], indent=1))
    print(f"all rows: MAPE {out['mape_pct']:.2f}%  max {out['max_abs_pct']:.1f}%")
    for s, v in out["by_source"].items():
        print(f"  {s:20s} rows {v['rows']:3d}  MAPE {v['mape_pct']:6.2f}%  "
              f"bias {v['bias_pct']:+6.2f}%  max {v['max_abs_pct']:5.1f}%")


if __name__ == "__main__":
    main()
