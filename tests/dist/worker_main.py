"""The torchrun side shared by worker.py and ingested_worker.py (imported from the script's own
folder, which torchrun puts first on sys.path): run each case, write one JSON result per rank."""
from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshplan.runtime.train import init_distributed


def main(run_case: Callable[[dict[str, Any], torch.device], dict[str, Any]]) -> int:
    """usage: SCRIPT OUT_DIR CASES_JSON. Each case's result goes to OUT_DIR/NAME.rankR.json; the
    first failing case stops the run (the pytest side reports the rest missing)."""
    out_dir, cases = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    device = init_distributed(float(os.environ.get("MESHPLAN_PG_TIMEOUT", "60")))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for case in cases:
        try:
            res = run_case(case, device)
        except Exception as e:  # recorded per rank; the test shows it
            res = {"name": case["name"], "ok": False, "error": f"{type(e).__name__}: {e}",
                   "trace": traceback.format_exc()}
        res["rank"] = rank
        with open(os.path.join(out_dir, f"{case['name']}.rank{rank}.json"), "w") as f:
            json.dump(res, f)
        if not res["ok"]:
            print(f"rank {rank} case {case['name']} failed: {res['error']}", file=sys.stderr, flush=True)
            break  # collectives of the next case could hang; the pytest side reports the rest missing
    dist.barrier()
    dist.destroy_process_group()
    return 0
