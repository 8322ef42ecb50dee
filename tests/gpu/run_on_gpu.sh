#!/usr/bin/env bash
# Single-H200 check of `meshplan train` (issue 4): a ~1B-parameter Llama-style model in bf16
# under a few single-GPU plans (micro-batch, recompute), measured step time and peak memory
# (torch.cuda.max_memory_allocated) beside the cost model's estimate, written to one JSON file.
# First `meshplan calibrate --bench` (issue 14): GEMM/attention/HBM micro-benchmarks on the GPU
# -> $OUT_DIR/bench_calibration.json (+ the raw measurements, bench_raw.json), then an estimate
# priced with that calibration (bench_estimate.json); one GPU: no collectives to measure.
# Budget: under 9 minutes (bench ~1 min; 4 plans x 10 steps; model build ~20 s each).
#   usage: bash tests/gpu/run_on_gpu.sh [OUT_DIR]      (default: $OUT or results/gpu)
# Needs a CUDA build of torch in .venv (the CPU build of scripts/setup.sh cannot run it).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-${OUT:-results/gpu}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" -c "import torch, sys; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
MP=(-c "import sys; from meshplan.cli.main import main; sys.exit(main(sys.argv[1:]))")
echo "== calibrate --bench"
timeout 240 "$PY" "${MP[@]}" calibrate --bench --out "$OUT_DIR/bench_calibration.json" \
    --bench-out "$OUT_DIR/bench_raw.json" 2>&1 | tee "$OUT_DIR/bench.log" \
  || echo "calibrate --bench failed (exit $?)" | tee -a "$OUT_DIR/failures.txt"
if [ -f "$OUT_DIR/bench_calibration.json" ]; then
  timeout 60 "$PY" "${MP[@]}" estimate --model tests/gpu/llama-1b.toml --cluster h200-sxm-141gb:1 \
      --plan micro_batch=1,precision=bf16 --global-batch 8 --seq-len 2048 \
      --calibration "$OUT_DIR/bench_calibration.json" --json > "$OUT_DIR/bench_estimate.json" \
    || echo "estimate --calibration bench_calibration.json failed (exit $?)" | tee -a "$OUT_DIR/failures.txt"
fi
MODEL=tests/gpu/llama-1b.toml
GB=8
STEPS=10
PLANS=(
  "micro_batch=1,recompute=none"
  "micro_batch=2,recompute=selective"
  "micro_batch=4,recompute=op"
  "micro_batch=8,recompute=full"
)
for i in "${!PLANS[@]}"; do
  plan="${PLANS[$i]},precision=bf16"
  echo "== plan $plan"
  timeout 150 "$PY" -m meshplan.cli.train_cmd --model "$MODEL" --plan "$plan" --global-batch "$GB" \
      --steps "$STEPS" --data synthetic --metrics "$OUT_DIR/metrics_$i.jsonl" \
    || echo "plan $plan failed (exit $?)" | tee -a "$OUT_DIR/failures.txt"
done
"$PY" - "$OUT_DIR" <<'PYEOF'
import glob, json, sys
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(f"{out}/metrics_*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if r.get("kind") == "summary":
            m, e = r["measured"], r["estimate"]
            rows.append({"plan": r["plan"], "measured_step_time_s": m.get("step_time_s"),
                         "estimated_step_time_s": e.get("step_time_s"),
                         "measured_peak_memory_gib": m.get("peak_memory_gib"),
                         "estimated_peak_memory_gib": e.get("peak_memory_gib"),
                         "measured_tokens_per_s": m.get("tokens_per_s"), "estimate_cluster": e.get("cluster"),
                         "estimate_error": e.get("error")})
json.dump({"model": "tests/gpu/llama-1b.toml", "global_batch": 8, "seq_len": 2048, "runs": rows},
          open(f"{out}/gpu_results.json", "w"), indent=2)
for r in rows:
    print(r)
PYEOF
echo "wrote $OUT_DIR/gpu_results.json"
