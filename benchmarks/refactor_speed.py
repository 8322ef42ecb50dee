"""Search time of GPT-3 175B on 1,024 A100s (global batch 1536 x 2048, the default space), for
two source trees in one run, alternating, so that the machine's load falls on both alike.

    python3 benchmarks/refactor_speed.py OLD_SRC NEW_SRC [--repeats 5] [--out FILE]

Each repeat runs the search in a fresh interpreter for each tree; prints and writes the median
wall time of each and their ratio (new / old). Used by issue 25 ("no slower").
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = """
import time, sys
from meshplan.search import SearchSpace, search
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Workload
m, c = load_model('gpt3-175b'), load_cluster('a100-sxm-80gb:1024')
w = Workload(global_batch=1536, seq_len=2048)
t0 = time.perf_counter()
r = search(m, c, w, SearchSpace(), top=3)
print(time.perf_counter() - t0, r.best.plan.short())
"""


def once(src: str) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", CODE], env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout.split(maxsplit=1)
    return float(out[0]), out[1].strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/refactor_speed.json"))
    a = ap.parse_args()
    times: dict[str, list[float]] = {"old": [], "new": []}
    best = {}
    for _ in range(a.repeats):
        for k in ("old", "new"):
            t, b = once(getattr(a, k))
            times[k].append(t)
            best[k] = b
    med = {k: statistics.median(v) for k, v in times.items()}
    doc = {"case": "gpt3-175b on a100-sxm-80gb:1024, 1536 x 2048, SearchSpace()", "repeats": a.repeats,
           "median_s": med, "ratio_new_over_old": med["new"] / med["old"], "times_s": times, "best": best}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
