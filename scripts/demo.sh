#!/usr/bin/env bash
# Set up, then run meshplan's main job on a built-in default:
# estimate a plan for Llama 3 8B on 8 H100s, and validate the cost model on published runs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/meshplan ] || bash scripts/setup.sh
mp=.venv/bin/meshplan
echo "== meshplan estimate: Llama 3 8B, FSDP on 8 x H100, op-level activation checkpointing"
$mp estimate --model llama3-8b --cluster h100-sxm-80gb:8 \
  --plan dp=8,zero=3,micro_batch=1,recompute=op,compile=1 --global-batch 16 --seq-len 8192
echo
echo "== meshplan validate: cost model vs published measured runs (summary)"
$mp validate --report validation.md | tail -n 12
echo "(full per-row report written to validation.md)"
