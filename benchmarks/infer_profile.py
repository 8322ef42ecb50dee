"""Does `meshplan calibrate` name the codebase that ran a source's runs? (issue 28, item 1)

For each development source: k runs (with a step time or an out-of-memory outcome) chosen with a
fixed seed, their profile hidden (each candidate replaces it; a row's own cells stay, as they would
in a user's file), and calibration.infer run on them. Reported: the inferred profile, whether the
source's own profile (cases.RunCase.profile) is the best or tied with it, its rank, and the
likelihood ratio of the best over it.

    PYTHONPATH=src python3 benchmarks/infer_profile.py [--k 6] [--out benchmarks/results/infer_profile.json]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "infer_profile.json"))
    args = ap.parse_args()
    from meshplan.calibration.fit import runs_from_cases
    from meshplan.calibration.infer import TIE, infer
    from meshplan.cli.calibrate_cmd import _cases
    from meshplan.validate.report import default_runs_path
    cases = [c for c in _cases(str(default_runs_path())) if c.ok]
    rows = []
    for src in dict.fromkeys(c.source_id for c in cases):
        cs = [c for c in cases if c.source_id == src and (c.measured_step_time_s or c.measured_fits is False)]
        idx = np.random.default_rng(0).choice(len(cs), min(args.k, len(cs)), replace=False)
        pick = [cs[i] for i in sorted(idx)]
        truth = pick[0].profile
        cands = infer(runs_from_cases(pick))
        best = cands[0]
        plain = [c for c in cands if not c.settings]  # the built-in profiles as they are
        mine = next(c for c in plain if c.profile == truth)
        rank = 1 + sum(c.score > mine.score + TIE for c in plain)
        d = best.score - mine.score
        rows.append({"source": src, "runs": len(pick), "truth": truth, "inferred": best.label,
                     "truth_best_or_tied": d <= TIE or best.profile == truth, "truth_rank_among_profiles": rank,
                     "ratio_best_over_truth": round(math.exp(min(d, 50)), 3)})
        print(rows[-1], flush=True)
    ok = sum(r["truth_best_or_tied"] for r in rows)
    top2 = sum(r["truth_rank_among_profiles"] <= 2 for r in rows)
    out = {"k": args.k, "rows": rows, "truth_best_or_tied": ok, "truth_in_top_2": top2, "sources": len(rows)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"own profile best or tied on {ok} of {len(rows)} sources, in the top 2 profiles on {top2} -> {args.out}")


if __name__ == "__main__":
    main()
