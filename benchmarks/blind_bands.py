"""Write the built-in step bands by how well the codebase is known (issue 28, item 4).

    meshplan validate --cross-validate --shots 0,1,3,5 --blind --json > cv.json
    PYTHONPATH=src python benchmarks/blind_bands.py cv.json [--write]

Reads a cross-validation's JSON (its ``few_shot`` section, blind, from
calibration.few_shot.knowledge_coverage) and prints, per K, the 90% step band and its coverage out of
sample (each source against the band of the other sources' errors). ``--write`` stores the bands in
src/meshplan/data/calibration.json under uncertainty.knowledge (cost.uncertainty.KNOWLEDGE: 'unknown'
is K = 0 blind, 'k1'/'k3'/'k5' a codebase calibrated on that many of its runs). It leaves the
per-plan-kind step bands (uncertainty.step) alone: `meshplan calibrate`'s refinement takes its noise
from them (calibration.fit.refinement), and the 24-source cross-validation's wider ones kept a 3-run
calibration of a 25%-slower codebase at 1.205x (tests/unit/test_codebase_calibration.py).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "src" / "meshplan" / "data" / "calibration.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cv_json", help="output of meshplan validate --cross-validate --shots 0,1,3,5 --blind --json")
    ap.add_argument("--write", action="store_true", help="store the bands in the built-in calibration")
    args = ap.parse_args(argv)
    cv = json.loads(Path(args.cv_json).read_text())
    fs = cv.get("few_shot") or {}
    know = fs.get("knowledge_bands")
    if not fs.get("blind") or not know:
        print(f"{args.cv_json}: no blind few-shot bands (run with --shots 0,1,3,5 --blind)", file=sys.stderr)
        return 2
    for k in fs["shots"]:
        s = fs["summary"][f"k{k}"]
        band = s.get("band_log_q05_q95")
        if band:
            print(f"K={k}: band {100 * (math.exp(band[0]) - 1):+.1f}% to {100 * (math.exp(band[1]) - 1):+.1f}%, "
                  f"{s.get('coverage_pct')}% of runs inside their source's out-of-sample band, sources with 8+ runs "
                  f"within 85-95%: {s.get('sources_8plus_within_target')} of {s.get('sources_8plus')}")
    if not args.write:
        return 0
    cal = json.loads(CALIBRATION.read_text())
    unc = cal.setdefault("uncertainty", {})
    unc["knowledge"] = {key: {"log_q05": v[0], "log_q95": v[1]} for key, v in know.items()}
    n = sum(1 for e in fs["by_source"] if e.get("k0") is not None)
    unc["knowledge_derived_from"] = (f"benchmarks/blind_bands.py --write: {cv.get('command', 'meshplan validate')}; "
                                     f"blind few-shot over {n} sources with timed runs, seed {fs.get('seed')}")
    CALIBRATION.write_text(json.dumps(cal, indent=1) + "\n")
    print(f"wrote {CALIBRATION.relative_to(ROOT)}: uncertainty.knowledge")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
