"""meshplan's runtime vs a hand-written FSDP2 script: same model, plan, data and optimizer.

Target (issue 4): meshplan's step time within 2% of the hand-written loop. Two measurements on
NPROC ranks (gloo, one thread each), both reporting wall time and rank 0's process CPU time per
step (``time.process_time``: other load on a shared machine disturbs it much less):

1. interleaved (the figure): one torchrun job whose ranks hold a meshplan ``Trainer`` (A, built
   as ``meshplan train`` builds it; each step is ``launch.run_step``, the loop body of ``meshplan
   train``: timed step, log line, metrics record), the hand-written FSDP2 model (B) and a second
   copy of it (C, the control), and run them in turn, ``--block-steps`` steps at a time (default
   1), cycling through the six orders of A, B, C (``--blocks`` blocks of each, after ``--warmup``
   steps of each). Steps of one block see the same machine, so load drifts cancel in the
   per-block ratio A/B. The figure (``headline``): the median of those ratios with a 95%
   bootstrap interval over blocks, beside the same for C/B, which should be 0 (the instrument's
   own error). Also reported: ratios of the medians and of the 10th percentiles over all steps
   (other load only adds time: the low quantile estimates the undisturbed step, timeit's min
   made robust), with paired bootstrap intervals.
2. launches (the end-to-end cross-check): ``meshplan train`` and the script as separate torchrun
   jobs, alternated A B A B ... ``--launch-pairs`` times, each ``--steps`` steps, the first
   ``--warmup`` dropped; step time = interval between the ends of consecutive steps on rank 0
   (meshplan's ``wall_time`` / ``cpu_time`` metrics), so everything the loop does counts.
   Launch-to-launch variation on a shared 2-core machine is several percent: a coarse check.

The model is tiny-llama widened and deepened (4 layers, hidden 256, ~3M parameters, sequence
128), so that a step is compute, not Python: ~0.25 s on one CPU thread per rank.

    python benchmarks/runtime_overhead.py [--nproc 2] [--blocks 180] [--block-steps 1] [--launch-pairs 3]
writes benchmarks/results/runtime_overhead.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"name": "bench-llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_kv_heads": 4,
         "ffn_hidden_size": 688, "seq_len": 128}
"""tiny-llama with these fields replaced (written to a ModelSpec file for `meshplan train`)."""


def hand_setup(model_file: str, batch: int, seq: int) -> Any:
    """The reference: a plain FSDP2 training step, written as one would by hand (the process
    group exists). Returns step(i)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshplan.runtime.data import global_batch, rank_rows
    from meshplan.runtime.models import build_model, loss_fn
    from meshplan.spec.io import load_model
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = load_model(model_file)
    model = build_model(spec, seq)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        x, y = rank_rows(global_batch(i, batch=batch, seq_len=seq, vocab=spec.vocab_size), rank, world)
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return step


def hand_written(model_file: str, batch: int, seq: int, steps: int, out: str) -> None:
    """The script as its own torchrun job: step-end clocks of rank 0."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    step = hand_setup(model_file, batch, seq)
    ends, cpu_ends = [], []
    for i in range(steps):
        step(i)
        ends.append(time.time())
        cpu_ends.append(time.process_time())
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"step_ends": ends, "cpu_ends": cpu_ends}))
    dist.destroy_process_group()


def interleaved(model_file: str, plan_text: str, batch: int, seq: int, warmup: int, blocks: int,
                block_steps: int, out: str) -> None:
    """meshplan (A), the script (B) and a second copy of the script (C, the control) in one job,
    blocks of steps in the orders ABC ACB BAC ...; per-step clocks of rank 0."""
    import torch.distributed as dist

    from meshplan.runtime.launch import Job, run_step
    from meshplan.runtime.mesh import build_mesh
    from meshplan.runtime.train import RunConfig, Trainer, init_distributed
    from meshplan.spec.io import load_model, parse_plan
    device = init_distributed(300.0)
    spec, plan = load_model(model_file), parse_plan(plan_text)
    steps = warmup + blocks * block_steps
    job = Job(model_arg=model_file, plan_arg=plan_text, model=spec, plan=plan, global_batch=batch, seq_len=seq,
              steps=steps, nproc_per_node=dist.get_world_size(), metrics=out + ".metrics.jsonl")
    trainer = Trainer(RunConfig(model=spec, plan=plan, global_batch=batch, seq_len=seq, steps=steps),
                      build_mesh(plan, device.type), device)
    rank0 = dist.get_rank() == 0
    hand, control = hand_setup(model_file, batch, seq), hand_setup(model_file, batch, seq)
    done = {"A": 0, "B": 0, "C": 0}
    run = {"A": lambda: run_step(trainer, job, rank0), "B": lambda: hand(done["B"]), "C": lambda: control(done["C"])}
    res: dict[str, list[list[list[float]]]] = {"A": [], "B": [], "C": []}
    for side in run:
        for _ in range(warmup):
            run[side]()
            done[side] += 1
    orders = list(itertools.permutations("ABC"))  # each side first, middle and last equally often
    for b in range(blocks):
        for side in orders[b % len(orders)]:
            times = []
            for _ in range(block_steps):
                t0, c0 = time.perf_counter(), time.process_time()
                run[side]()
                times.append([time.perf_counter() - t0, time.process_time() - c0])
                done[side] += 1
            res[side].append(times)
    if rank0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def torch_version() -> str:
    import torch
    return torch.__version__


def run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, env=env, timeout=1800, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")


def intervals(ends: list[float], warmup: int) -> list[float]:
    """Step times from consecutive step-end times, the first ``warmup`` steps dropped."""
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]


def low(xs: list[float]) -> float:
    """The 10th percentile: the step time without interference (other load only adds time)."""
    return statistics.quantiles(xs, n=10)[0]


STATS = {"median": statistics.median, "p10": low}
"""Estimators of a step time compared: the median, and the 10th percentile (on a shared machine
interference is one-sided, so a low quantile estimates the undisturbed time: timeit's min, made
robust)."""


def bootstrap_ratio(a_runs: list[list[float]], b_runs: list[list[float]], stat: Any, n: int = 1000,
                    seed: int = 0) -> tuple[float, float]:
    """95% interval of stat(A)/stat(B), paired: resample pair indices (run or block i of A with
    i of B: adjacent in time), then steps within each chosen run."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        idx = rng.choices(range(len(a_runs)), k=len(a_runs))
        a = [x for i in idx for x in rng.choices(a_runs[i], k=len(a_runs[i]))]
        b = [x for i in idx for x in rng.choices(b_runs[i], k=len(b_runs[i]))]
        ratios.append(stat(a) / stat(b))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def compare(a_runs: list[list[float]], b_runs: list[list[float]]) -> dict[str, Any]:
    """Per estimator (median, p10 over all steps): meshplan's and the script's step time and the
    overhead % with its paired-bootstrap 95% interval; and the quartiles of per-pair median ratios."""
    out: dict[str, Any] = {"steps_per_side": sum(map(len, a_runs))}
    for name, stat in STATS.items():
        a, b = stat([x for r in a_runs for x in r]), stat([x for r in b_runs for x in r])
        lo, hi = bootstrap_ratio(a_runs, b_runs, stat)
        out[name] = {"meshplan_step_s": a, "hand_fsdp2_step_s": b, "overhead_pct": 100 * (a / b - 1),
                     "overhead_pct_95ci": [100 * (lo - 1), 100 * (hi - 1)]}
    pairs = [statistics.median(a) / statistics.median(b) for a, b in zip(a_runs, b_runs)]
    rng = random.Random(1)
    boot = sorted(statistics.median(rng.choices(pairs, k=len(pairs))) for _ in range(1000))
    out["pair_ratio"] = {"what": "median over pairs of median(A block) / median(B block), A and B adjacent",
                         "overhead_pct": 100 * (statistics.median(pairs) - 1),
                         "overhead_pct_95ci": [100 * (boot[25] - 1), 100 * (boot[974] - 1)],
                         "overhead_pct_quartiles": [100 * (q - 1) for q in statistics.quantiles(pairs, n=4)]
                         if len(pairs) > 1 else []}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5, help="steps dropped first (per run / per loop)")
    ap.add_argument("--blocks", type=int, default=180, help="interleaved: blocks (one per side), orders ABC ACB ...")
    ap.add_argument("--block-steps", type=int, default=1, help="interleaved: steps per block")
    ap.add_argument("--launch-pairs", type=int, default=3, help="launches: A/B pairs of torchrun jobs, alternated")
    ap.add_argument("--steps", type=int, default=25, help="launches: steps per job")
    ap.add_argument("--_hand", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_inproc", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    seq = MODEL["seq_len"]
    if a._hand:
        hand_written(a._hand[0], a.global_batch, seq, a.steps, a._hand[1])
        return 0
    if a._inproc:
        interleaved(a._inproc[0], a._inproc[1], a.global_batch, seq, a.warmup, a.blocks, a.block_steps, a._inproc[2])
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _evaluators import commit

    from meshplan.spec.base import to_dict
    from meshplan.spec.io import load_model
    me = str(Path(__file__).resolve())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}"]
    plan = f"dp={a.nproc},zero=3,micro_batch={a.global_batch // a.nproc},precision=fp32"
    common = ["--global-batch", str(a.global_batch), "--warmup", str(a.warmup)]
    t_start, load_start = time.time(), os.getloadavg()[0]
    launches: dict[str, list[list[float]]] = {"mine": [], "hand": [], "mine_cpu": [], "hand_cpu": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_file = str(Path(tmp) / "bench-llama.json")
        spec = load_model("tiny-llama").replace(**MODEL)
        Path(model_file).write_text(json.dumps(to_dict(spec)))
        # 1. interleaved blocks in one job
        out = str(Path(tmp) / "inproc.json")
        run(torchrun + [me, *common, "--blocks", str(a.blocks), "--block-steps", str(a.block_steps),
                        "--_inproc", model_file, plan, out])
        blocks = json.loads(Path(out).read_text())
        inter = {k: compare([[t[i] for t in b] for b in blocks["A"]], [[t[i] for t in b] for b in blocks["B"]])
                 for i, k in enumerate(("wall", "cpu"))}
        control = {k: compare([[t[i] for t in b] for b in blocks["C"]], [[t[i] for t in b] for b in blocks["B"]])
                   for i, k in enumerate(("wall", "cpu"))}
        print("interleaved: " + ", ".join(f"{k} {inter[k]['pair_ratio']['overhead_pct']:+.2f}% (control "
                                          f"{control[k]['pair_ratio']['overhead_pct']:+.2f}%)" for k in inter),
              file=sys.stderr, flush=True)
        # 2. separate launches, alternated
        for rep in range(a.launch_pairs):
            m = Path(tmp) / f"m{rep}.jsonl"
            run([sys.executable, "-m", "meshplan.cli.train_cmd", "--model", model_file, "--plan", plan,
                 "--global-batch", str(a.global_batch), "--seq-len", str(seq), "--steps", str(a.steps),
                 "--metrics", str(m)])
            rows = [r for r in map(json.loads, m.read_text().splitlines()) if "step" in r]
            launches["mine"].append(intervals([r["wall_time"] for r in rows], a.warmup))
            launches["mine_cpu"].append(intervals([r["cpu_time"] for r in rows], a.warmup))
            h = Path(tmp) / f"h{rep}.json"
            run(torchrun + [me, *common, "--steps", str(a.steps), "--_hand", model_file, str(h)])
            hd = json.loads(h.read_text())
            launches["hand"].append(intervals(hd["step_ends"], a.warmup))
            launches["hand_cpu"].append(intervals(hd["cpu_ends"], a.warmup))
            mm, hm = (statistics.median(launches[k][-1]) * 1e3 for k in ("mine", "hand"))
            print(f"launch pair {rep + 1}/{a.launch_pairs}: meshplan {mm:.1f} ms, hand-written {hm:.1f} ms",
                  file=sys.stderr, flush=True)
    res = {
        "command": " ".join(["python benchmarks/runtime_overhead.py", *sys.argv[1:]]),
        "model": MODEL, "params": spec.num_params(), "nproc": a.nproc, "global_batch": a.global_batch,
        "seq_len": seq, "plan": plan,
        "interleaved": {"what": "one job, meshplan (A) vs the script (B), blocks in the orders ABC ACB BAC ... (C: "
                                "control); per-step time of rank 0 (wall: perf_counter; cpu: process_time); "
                                "meshplan's step is launch.run_step",
                        "warmup_steps": a.warmup, "blocks_per_loop": a.blocks, "steps_per_block": a.block_steps,
                        **inter},
        "control": {"what": "the same comparison between two copies of the hand-written script (C vs B): the "
                            "instrument's own error, ideally 0", **control},
        "launches": {"what": "separate torchrun jobs alternated A B A B; step = interval between step ends on rank 0",
                     "pairs": a.launch_pairs, "steps_per_job": a.steps, "warmup_steps": a.warmup,
                     "wall": compare(launches["mine"], launches["hand"]) if launches["mine"] else None,
                     "cpu": compare(launches["mine_cpu"], launches["hand_cpu"]) if launches["mine"] else None},
        "load_average_1min_start_end": [load_start, os.getloadavg()[0]],
        "wall_s": time.time() - t_start, "commit": commit(), "python": platform.python_version(),
        "torch": torch_version(), "machine": platform.platform(), "cpus": os.cpu_count(),
    }
    res["headline"] = {"what": "interleaved: median over adjacent pairs of meshplan's / the script's step time",
                       **{k: {"overhead_pct": inter[k]["pair_ratio"]["overhead_pct"],
                              "overhead_pct_95ci": inter[k]["pair_ratio"]["overhead_pct_95ci"],
                              "control_pct": control[k]["pair_ratio"]["overhead_pct"],
                              "control_pct_95ci": control[k]["pair_ratio"]["overhead_pct_95ci"]} for k in inter}}
    path = ROOT / "benchmarks" / "results" / "runtime_overhead.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
