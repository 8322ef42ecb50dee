"""Weak-link methods on CPU: the loss curves of synchronous data parallelism, local SGD, DiLoCo and
compressed gradient syncs under `meshplan train` (4 gloo ranks, tiny-llama, fp32, AdamW lr 1e-3,
the same data and initial weights).

Each method is one `meshplan train` launch; the per-step losses come from its --metrics file. The
step times are recorded but mean little here (4 ranks on a shared 2-core machine, gloo over
loopback): what the methods trade is how often and how much they send, which this machine does not
price. What it shows is the optimisation side: how much loss each method gives up, or gains
(DiLoCo's outer Nesterov step), against syncing every step.

    python benchmarks/weak_links_cpu.py [--steps 48] [--global-batch 16] [--seq-len 64]
writes benchmarks/results/weak_links_cpu.json and docs/img/weak-links-loss.png
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "weak_links_cpu.json"
FIGURE = ROOT / "docs" / "img" / "weak-links-loss.png"
NPROC = 4
METHODS = [  # (name, plan, extra flags)
    ("sync DP (all-reduce every step)", "dp=4,precision=fp32", []),
    ("local SGD, H=4", "dp=4,grad_sync=local-sgd,sync_every=4,precision=fp32", []),
    ("DiLoCo, H=4", "dp=4,grad_sync=diloco,sync_every=4,precision=fp32", []),
    ("DiLoCo, H=8", "dp=4,grad_sync=diloco,sync_every=8,precision=fp32", []),
    ("DiLoCo, H=8, fp8 outer sync", "dp=4,grad_sync=diloco,sync_every=8,grad_compression=fp8,precision=fp32", []),
    ("PowerSGD rank 2", "dp=4,grad_compression=powersgd,compression_rank=2,precision=fp32", []),
    ("bf16 gradients", "dp=4,grad_compression=bf16,precision=fp32", []),
]


def run(plan: str, extra: list[str], args: argparse.Namespace, tmp: Path, i: int) -> dict[str, Any]:
    metrics = tmp / f"run{i}.jsonl"
    cmd = [sys.executable, "-m", "meshplan.cli.train_cmd", "--model", "tiny-llama", "--plan", plan,
           "--nproc-per-node", str(NPROC), "--steps", str(args.steps), "--global-batch", str(args.global_batch),
           "--seq-len", str(args.seq_len), "--metrics", str(metrics), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"{plan}: meshplan train failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = sorted((r for r in rows if "step" in r), key=lambda r: r["step"])
    losses = [r["loss"] for r in steps]
    times = [r["step_time_s"] for r in steps[1:]]
    return {"plan": plan, "flags": extra, "losses": losses, "final_loss": losses[-1],
            "mean_loss_last_8": statistics.fmean(losses[-8:]), "median_step_time_s": statistics.median(times),
            "launch_s": time.perf_counter() - t0,
            "warnings": [r["message"] for r in rows if r.get("kind") == "warning"]}


def plot(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    styles = ["-", "--", "-", "-", ":", "-.", "--"]
    for r, style in zip(results, styles):
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, label=r["name"], linewidth=1.4)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over the 4 ranks' rows)")
    ax.set_title(f"tiny-llama, 4 gloo ranks, fp32, AdamW lr 1e-3, {args.global_batch} x {args.seq_len} tokens a step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args()
    import torch
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, plan, extra) in enumerate(METHODS):
            r = {"name": name, **run(plan, extra, args, Path(tmp), i)}
            results.append(r)
            print(f"{name:34} final loss {r['final_loss']:.4f}  mean of last 8 {r['mean_loss_last_8']:.4f}  "
                  f"{r['launch_s']:.0f} s", flush=True)
    base = results[0]["mean_loss_last_8"]
    for r in results:
        r["mean_loss_last_8_vs_sync"] = r["mean_loss_last_8"] - base
    out = {"benchmark": "weak_links_cpu", "command": "python benchmarks/weak_links_cpu.py " + " ".join(sys.argv[1:]),
           "model": "tiny-llama", "nproc": NPROC, "steps": args.steps, "global_batch": args.global_batch,
           "seq_len": args.seq_len,
           "optimizer": "adamw lr 1e-3 (inner); DiLoCo outer Nesterov SGD lr 0.7, momentum 0.9",
           "torch": torch.__version__, "platform": platform.platform(), "cpus": os.cpu_count(),
           "note": "step times are of 4 ranks on this machine's cores over gloo loopback: not a measure of the "
                   "methods' communication savings", "runs": results}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    plot(results, args)
    print(f"wrote {OUT.relative_to(ROOT)} and {FIGURE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
