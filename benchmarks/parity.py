"""Behaviour parity of a refactor: every number the CLI prints, before and after.

    PYTHONPATH=src python3 benchmarks/parity.py --out FILE          # record (JSON of every command's output)
    PYTHONPATH=src python3 benchmarks/parity.py --compare A.json B.json

Runs a fixed list of planning commands in process (validate on every development run, estimates
of single-GPU-type, pooled, uneven-share, length-distribution and bucket plans, searches, the
simulator, plan-file round trips) with --json, and records their outputs. --compare prints the
largest relative difference over every number both records hold (timings left out) and every
key that one record has and the other lacks. Used by issue 25 (the refactor must not change a
number: max relative difference <= 1e-9).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from meshplan.cli.main import main as cli  # noqa: E402

POOLS = str(ROOT / "docs/examples/a100-h100-pools.toml")
TWO_DC = str(ROOT / "docs/examples/two-dc.toml")
DIST = "2048:0.6,8192:0.3,32768:0.1"

COMMANDS: list[list[str]] = [
    ["validate", "--json"],
    # one GPU type
    ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--plan", "dp=8,zero=3,micro_batch=1",
     "--global-batch", "64", "--seq-len", "8192", "--json"],
    ["estimate", "--model", "llama3-70b", "--cluster", "h100-sxm-80gb:64", "--plan",
     "tp=8,pp=4,dp=2,micro_batch=1,schedule=interleaved-1f1b,virtual_stages=5,sequence_parallel=1",
     "--global-batch", "128", "--seq-len", "4096", "--json"],
    ["estimate", "--model", "gpt3-175b", "--cluster", "a100-sxm-80gb:1024", "--plan",
     "tp=8,pp=16,dp=8,micro_batch=1,recompute=selective,sequence_parallel=1", "--global-batch", "1536",
     "--seq-len", "2048", "--json"],
    ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--plan", "dp=4,cp=4,zero=3,micro_batch=1",
     "--global-batch", "64", "--seq-len", "32768", "--json"],
    ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--plan",
     "dp=8,zero=1,micro_batch=2,dp_shares=3:1", "--global-batch", "64", "--seq-len", "4096", "--json"],
    ["estimate", "--model", "llama3-8b", "--cluster", TWO_DC, "--plan",
     "tp=8,dp=32,zero=1,micro_batch=1,grad_sync=diloco,sync_every=100", "--global-batch", "256", "--seq-len", "4096",
     "--json"],
    # length distributions, bucket plans
    ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--plan", "dp=16,zero=3,micro_batch=1",
     "--global-batch", "256", "--seq-len", DIST, "--json"],
    ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--plan",
     "tp=2,pp=2,dp=4,micro_batch=1", "--global-batch", "256", "--seq-len", DIST, "--json"],
    ["estimate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--plan",
     "dp=4,cp=4,zero=3,buckets=2048x8cp1:8192x2cp1:32768x1cp4", "--global-batch", "256", "--seq-len", DIST,
     "--json"],
    # pools
    ["estimate", "--model", "llama3-70b", "--cluster", POOLS, "--plan",
     "tp=8,pp=2,dp=8,micro_batch=1,pools=h100:a100,pool_dp=4:4,dp_shares=3:2", "--global-batch", "520",
     "--seq-len", "4096", "--json"],
    ["estimate", "--model", "llama3-70b", "--cluster", POOLS, "--plan",
     "tp=8,pp=4,dp=4,micro_batch=1,pools=h100:a100,pool_pp=2:2", "--global-batch", "512", "--seq-len", "4096",
     "--json"],
    ["estimate", "--model", "llama3-8b", "--cluster", POOLS, "--plan",
     "tp=1,dp=8,zero=3,micro_batch=1,pools=h100", "--global-batch", "256", "--seq-len", DIST, "--json"],
    # searches
    ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "64", "--seq-len", "8192",
     "--top", "5", "--json"],
    ["plan", "--model", "gpt3-175b", "--cluster", "a100-sxm-80gb:1024", "--global-batch", "1536", "--seq-len",
     "2048", "--top", "5", "--json"],
    ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--global-batch", "256", "--seq-len", DIST,
     "--top", "5", "--json"],
    ["plan", "--model", "llama3-70b", "--cluster", POOLS, "--global-batch", "512", "--seq-len", "4096", "--top", "5",
     "--json"],
    ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:8", "--global-batch", "64", "--seq-len", "8192",
     "--gpus", "8..32", "--top", "3", "--json"],
    # simulator
    ["simulate", "--model", "llama3-70b", "--cluster", "h100-sxm-80gb:64", "--plan",
     "tp=8,pp=4,dp=2,micro_batch=1,schedule=interleaved-1f1b,virtual_stages=5", "--global-batch", "128",
     "--seq-len", "4096", "--json"],
    ["simulate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--plan", "tp=2,pp=2,dp=4,micro_batch=1",
     "--global-batch", "256", "--seq-len", DIST, "--batches", "20", "--json"],
    ["simulate", "--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--plan",
     "dp=4,cp=4,zero=3,buckets=2048x8cp1:8192x2cp1:32768x1cp4", "--global-batch", "256", "--seq-len", DIST,
     "--batches", "20", "--json"],
    ["simulate", "--model", "llama3-70b", "--cluster", POOLS, "--plan",
     "tp=8,pp=4,dp=4,micro_batch=1,pools=h100:a100,pool_pp=2:2", "--global-batch", "512", "--seq-len", "4096",
     "--json"],
]

TIMING_KEYS = ("time_s", "_s_wall", "timings", "search_s", "wall_s", "elapsed", "took", "seconds_searched",
               "search_time", "command")


def run(argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli(argv)
        except SystemExit as e:  # argparse errors
            rc = e.code
    text = out.getvalue()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = text
    return {"argv": argv, "rc": rc, "out": doc, "err": err.getvalue()}


def record() -> list[dict]:
    rows = [run(a) for a in COMMANDS]
    with tempfile.TemporaryDirectory() as tmp:  # plan-file round trips
        for i, a in enumerate(c for c in COMMANDS if c[0] == "plan" and "--gpus" not in c):
            f = str(Path(tmp) / f"p{i}.json")
            rows.append(run(a + ["--out", f]) | {"argv": ["plan", "--out", str(i)]})
            rows.append(run(["estimate", "--plan", f, "--json"]) | {"argv": ["estimate", "--plan", str(i)]})
    return rows


def _walk(x, path=""):  # type: ignore[no-untyped-def]
    if isinstance(x, dict):
        for k, v in x.items():
            if any(t in str(k) for t in TIMING_KEYS):
                continue
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, x


def compare(a: list[dict], b: list[dict]) -> int:
    worst, where, missing, differ = 0.0, "", [], []
    for ra, rb in zip(a, b):
        name = " ".join(ra["argv"][:3])
        if ra["rc"] != rb["rc"]:
            differ.append(f"{name}: exit {ra['rc']} vs {rb['rc']}")
        va, vb = dict(_walk(ra["out"])), dict(_walk(rb["out"]))
        for k in va.keys() ^ vb.keys():
            missing.append(f"{name}: {k} only in {'A' if k in va else 'B'}")
        for k in va.keys() & vb.keys():
            x, y = va[k], vb[k]
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
                if x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)):
                    continue
                d = abs(x - y) / max(abs(x), abs(y), 1e-300)
                if d > worst:
                    worst, where = d, f"{name}: {k} ({x} vs {y})"
            elif x != y:
                differ.append(f"{name}: {k}: {str(x)[:80]!r} vs {str(y)[:80]!r}")
    print(f"commands: {len(a)} vs {len(b)}")
    print(f"max relative difference of numbers: {worst:.3g}" + (f" at {where}" if where else ""))
    print(f"keys in one record only: {len(missing)}")
    for m in missing[:30]:
        print("  " + m)
    print(f"other values that differ: {len(differ)}")
    for m in differ[:30]:
        print("  " + m)
    return 0 if worst <= 1e-9 and not missing and not differ and len(a) == len(b) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        return compare(a, b)
    rows = record()
    Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    bad = [r for r in rows if r["rc"] not in (0, None)]
    print(f"{len(rows)} commands recorded to {args.out}; {len(bad)} exited non-zero")
    for r in bad:
        print("  ", " ".join(r["argv"][:6]), "->", r["err"].strip().splitlines()[-1:] if r["err"] else r["rc"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
