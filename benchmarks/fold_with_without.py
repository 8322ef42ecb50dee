"""One leave-one-source-out fold, fitted on the original 10 development sources or on all of them:
whether the rows added later pull the shared parameters away from a source.

    PYTHONPATH=src python3 benchmarks/fold_with_without.py orig|all SOURCE_ID

Prints the source's out-of-sample step MAPE and the fold's seconds. Measured 2026-12-07:
MEG_SC21_T1 4.76% (orig) vs 7.92% (all).
"""
from __future__ import annotations

import sys

ORIGINAL = {"MEG_SC21_T1", "KOR22_T5", "TT_2024_A100", "TT_2412_H100", "MOSAIC_LLMFOUNDRY", "BLOOM176B",
            "BLOOM_PREQ_0228", "BLOOM_PREQ_0225", "NEMO_2407_H100", "NEMO_LONGSEQ_H100"}


def main() -> None:
    from meshplan.calibration.fit import _fold, runs_from_cases
    from meshplan.cli.calibrate_cmd import _cases
    from meshplan.validate.report import default_runs_path
    which, src = sys.argv[1], sys.argv[2]
    cases = _cases(str(default_runs_path()))
    if which == "orig":
        cases = [c for c in cases if c.source_id in ORIGINAL]
    fold = _fold(runs_from_cases(cases), src, None, 25)
    print(which, src, fold.summary()["step_mape_pct"], round(fold.seconds, 1))


if __name__ == "__main__":
    main()
