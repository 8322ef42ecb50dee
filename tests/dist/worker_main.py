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


def run_steps(trainer: Any, steps: int, losses: list[float], norms: list[float]) -> None:
    """Train until ``losses`` holds ``steps`` entries, recording each step's loss and gradient norm."""
    while len(losses) < steps:
        losses.append(trainer.train_step())
        norms.append(float(trainer.grad_norm))


def save_first_part(trainer: Any, steps: int, losses: list[float], norms: list[float]) -> str:
    """Run ``steps`` steps of ``trainer`` (the first plan of a resume case), save a checkpoint to a
    fresh directory every rank agrees on, and return it."""
    import tempfile

    from meshplan.runtime import checkpoint
    run_steps(trainer, steps, losses, norms)
    where = [tempfile.mkdtemp(prefix="meshplan-resume-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    checkpoint.save(trainer, where[0])
    return str(where[0])


def resume_from(trainer: Any, where: str, steps_done: int) -> None:
    """Load the checkpoint ``save_first_part`` wrote into ``trainer`` (the second plan) and remove it."""
    from meshplan.runtime import checkpoint
    assert checkpoint.load(trainer, where) == steps_done
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil
        shutil.rmtree(where, ignore_errors=True)
