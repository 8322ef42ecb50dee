"""How fast is estimate()? Times it over a few hundred varied, valid plans.

Models/clusters: llama3-70b on h100-sxm-80gb:512 and gpt3-175b on a100-sxm-80gb:1024. Plans
vary tp, pp, dp, micro_batch, recompute, zero and schedule; plans that
meshplan.spec.constraints.violations rejects are skipped (not timed). Every valid plan is
estimated ``--repeats`` times; the best of ``--rounds`` timed rounds is reported.

Writes benchmarks/results/estimate_speed.json:
  {"estimates": N, "seconds": T, "estimates_per_s": R, "python": version, "machine": platform}
and prints a one-line summary. Run: PYTHONPATH=src python3 benchmarks/estimate_speed.py
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import sys
import time
from pathlib import Path

from meshplan.cost import estimate
from meshplan.spec.constraints import violations
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload

CASES = [
    # model, cluster, workload
    ("llama3-70b", "h100-sxm-80gb:512", Workload(global_batch=1024, seq_len=8192)),
    ("gpt3-175b", "a100-sxm-80gb:1024", Workload(global_batch=1536, seq_len=2048)),
]
TP = (1, 2, 4, 8)
PP = (1, 2, 4, 8, 16)
MICRO = (1, 2, 4)
RECOMPUTE = ("none", "selective", "full")
ZERO = (0, 1, 3)
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("gpipe", 1))


def plans_for(model, cluster, work, limit: int):
    """Up to ``limit`` valid plans, a fixed pseudo-random sample of the valid grid points."""
    grid = list(itertools.product(TP, PP, MICRO, RECOMPUTE, ZERO, SCHEDULES))
    valid = []
    for tp, pp, mb, rc, z, (sched, v) in grid:
        n = cluster.num_gpus
        if n % (tp * pp):
            continue
        if pp == 1 and sched != "1f1b":
            continue
        plan = Plan(tp=tp, pp=pp, dp=n // (tp * pp), micro_batch=mb, recompute=rc, zero=z,
                    schedule=sched, virtual_stages=v, sequence_parallel=tp > 1)
        if violations(model, cluster, plan, work):
            continue
        valid.append(plan)
    if len(valid) <= limit:
        return valid
    return random.Random(0).sample(valid, limit)  # fixed seed: the same plans every run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans-per-case", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5, help="estimates of each plan per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent / "results" / "estimate_speed.json")
    args = ap.parse_args(argv)

    jobs = []
    for mname, cname, work in CASES:
        m, c = load_model(mname), load_cluster(cname)
        jobs += [(m, c, p, work) for p in plans_for(m, c, work, args.plans_per_case)]
    for m, c, p, w in jobs:  # warm-up, and every plan must estimate cleanly
        estimate(m, c, p, w)

    best = float("inf")
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for m, c, p, w in jobs:
            for _ in range(args.repeats):
                estimate(m, c, p, w)
        best = min(best, time.perf_counter() - t0)
    n = len(jobs) * args.repeats
    batch = _batch_speed(jobs, args.rounds)
    result = {
        "estimates": n,
        "seconds": round(best, 6),
        "estimates_per_s": round(n / best, 1),
        "distinct_plans": len(jobs),
        "batch_rows": batch[0], "batch_seconds": round(batch[1], 6),
        "batch_rows_per_s": round(batch[0] / batch[1], 1),
        "python": platform.python_version(),
        "machine": platform.platform(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"estimate(): {n} estimates ({len(jobs)} distinct plans) in {best:.3f} s = "
          f"{n / best:,.0f} estimates/s (best of {args.rounds}; Python {result['python']}, "
          f"{platform.machine()}) -> {args.out}")
    print(f"estimate_batch(): {batch[0]:,} plans in {batch[1]:.3f} s = {batch[0] / batch[1]:,.0f} plans/s "
          "(the vectorised path the search uses)")
    return 0


def _batch_speed(jobs: list, rounds: int, copies: int = 250) -> tuple[int, float]:
    """Seconds for estimate_batch over every case's plans, each repeated ``copies`` times."""
    from meshplan.cost.batch import estimate_batch, plans_to_columns
    by_case: dict[int, list] = {}
    for m, c, p, w in jobs:
        by_case.setdefault(id(c), [m, c, w, []])[3].append(p)
    cases = [(m, c, w, plans_to_columns(ps * copies)) for m, c, w, ps in by_case.values()]
    rows = sum(len(cols["tp"]) for *_, cols in cases)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for m, c, w, cols in cases:
            estimate_batch(m, c, w, cols)
        best = min(best, time.perf_counter() - t0)
    return rows, best


if __name__ == "__main__":
    sys.exit(main())
