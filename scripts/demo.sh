#!/usr/bin/env bash
# Set up, then run meshplan's main job on a built-in default:
#  1. plan: search every way to train Llama 3 8B on 8 H100s and explain the winner;
#  2. estimate the winner (written to a plan file);
#  3. train: a small real run of the same kind of plan (FSDP) on 2 local CPU processes,
#     with the estimate printed beside the measurement;
#  4. validate: the cost model against published measured runs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/meshplan ] || bash scripts/setup.sh
mp=.venv/bin/meshplan
out=${MESHPLAN_DEMO_DIR:-demo-output}
mkdir -p "$out"
echo "== meshplan plan: Llama 3 8B on 8 x H100, global batch 64 x 8192 tokens"
$mp plan --model llama3-8b --cluster h100-sxm-80gb:8 --global-batch 64 --seq-len 8192 --top 5 \
  --out "$out/plan.json"
echo
echo "== meshplan estimate --plan $out/plan.json (model, cluster, batch and sequence from the file)"
$mp estimate --plan "$out/plan.json" | head -n 9
echo
echo "== meshplan train: tiny-llama, FSDP (zero=3) on 2 local CPU processes, 5 steps"
$mp train --model tiny-llama --plan dp=2,zero=3,precision=fp32 --global-batch 8 --seq-len 64 \
  --steps 5 --nproc-per-node 2 --metrics "$out/train-metrics.jsonl"
echo
echo "== meshplan validate: cost model vs published measured runs (summary)"
$mp validate --report "$out/validation.md" | tail -n 12
echo "(per-row report: $out/validation.md)"
