"""meshplan's runtime vs a hand-written FSDP2 script: same model, plan, data and optimizer.

Runs ``meshplan train`` (FSDP2, zero=3) and the script below under torchrun, each NPROC ranks,
and compares the median step time after warm-up. Target (issue 4): meshplan within 2%.
Both do the same work per step: forward/backward per micro-batch, gradient-norm clipping,
AdamW; meshplan additionally reduces the loss, step time and memory for its metrics.

    python benchmarks/runtime_overhead.py [--nproc 2] [--steps 20] [--model tiny-llama]
writes benchmarks/results/runtime_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hand_written(model_name: str, batch: int, seq: int, steps: int, out: str) -> None:
    """The reference: a plain FSDP2 training loop, written as one would by hand."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshplan.runtime.data import global_batch, rank_rows
    from meshplan.runtime.models import build_model, loss_fn
    from meshplan.spec.io import load_model
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = load_model(model_name)
    model = build_model(spec, seq)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        x, y = rank_rows(global_batch(step, batch=batch, seq_len=seq, vocab=spec.vocab_size), rank, world)
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_times": times}))
    dist.destroy_process_group()


def run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    subprocess.run(cmd, check=True, env=env, timeout=900, capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="alternate the two runs this many times")
    ap.add_argument("--_hand", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._hand:
        hand_written(a.model, a.global_batch, a.seq_len, a.steps, a._hand)
        return 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}"]
    mine, hand = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            m = Path(tmp) / f"m{rep}.jsonl"
            run([sys.executable, "-m", "meshplan.cli.train_cmd", "--model", a.model,
                 "--plan", f"dp={a.nproc},zero=3,micro_batch={a.global_batch // a.nproc},precision=fp32",
                 "--global-batch", str(a.global_batch), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
                 "--metrics", str(m)])
            mine += [r["step_time_s"] for r in map(json.loads, m.read_text().splitlines()) if "step" in r][2:]
            h = Path(tmp) / f"h{rep}.json"
            run(torchrun + [str(Path(__file__).resolve()), "--model", a.model, "--global-batch", str(a.global_batch),
                            "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--_hand", str(h)])
            hand += json.loads(h.read_text())["step_times"][2:]
    res = {"model": a.model, "nproc": a.nproc, "global_batch": a.global_batch, "seq_len": a.seq_len,
           "meshplan_median_step_s": statistics.median(mine), "hand_fsdp2_median_step_s": statistics.median(hand)}
    res["overhead_pct"] = 100 * (res["meshplan_median_step_s"] / res["hand_fsdp2_median_step_s"] - 1)
    out = ROOT / "benchmarks" / "results" / "runtime_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
