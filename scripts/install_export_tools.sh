#!/usr/bin/env bash
# Install the real parsers that tests/export checks `meshplan export` against, into .venv:
#   torchtitan 0.2.2   (torchtitan.config: JobConfig + ConfigManager, the last release that reads TOML;
#                       0.3.0 replaced TOML files by Python config registries)
#   megatron-core 0.16.1 (the newest release for Python 3.11; TransformerConfig, ModelParallelConfig,
#                       DistributedDataParallelConfig, OptimizerConfig, the micro-batch calculator)
#   deepspeed 0.19.8   (deepspeed.runtime.config.DeepSpeedConfig and its pydantic models)
# torch stays exactly as it is (2.13.0, the CPU build on this disk): every pip call carries a
# constraints file pinning it, and deepspeed (an sdist whose setup.py imports torch) is built
# against the installed torch with --no-build-isolation and DS_BUILD_OPS=0 (no CUDA ops compiled).
# Only what the config parsers import is installed: torchtitan's training-time dependencies
# (datasets, tensorboard, torchdata, tokenizers, wandb) and megatron-core's extras are left out, so
# this takes well under a minute. Idempotent: re-running skips what is already there.
# MESHPLAN_VENV=DIR installs into another virtual environment (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MESHPLAN_VENV:-.venv}
PY=$VENV/bin/python
[ -x "$PY" ] || { echo "install_export_tools: no $VENV; run scripts/setup.sh first" >&2; exit 1; }

TORCH=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
if [ "$TORCH" != "2.13.0" ]; then
  echo "install_export_tools: $VENV has torch '${TORCH:-none}', expected 2.13.0; run scripts/setup.sh first" >&2
  exit 1
fi

CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"
# pip's notes on purpose-left-out dependencies (torchtitan's datasets/tensorboard/...) and on index
# folders without the package are expected; everything else pip says is shown.
quiet() { "$@" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" \
  -e "dependency resolver does not currently take into account" -e "^torchtitan .* requires .*, which is not installed" >&2); }
PIP=(quiet "$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")

have() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }

# torchtitan: the package and tyro (its CLI parser); torchtitan.config needs nothing else.
if ! have torchtitan 0.2.2; then
  "${PIP[@]}" --no-deps "torchtitan==0.2.2"
fi
"${PIP[@]}" "tyro>=0.9"

# megatron-core: a wheel; its only hard requirements are torch, numpy and packaging.
if ! have megatron-core 0.16.1; then
  "${PIP[@]}" "megatron-core==0.16.1"
fi

# deepspeed: its runtime requirements first (so the no-isolation build finds them), then the sdist.
if ! have deepspeed 0.19.8; then
  "${PIP[@]}" einops hjson msgpack ninja psutil py-cpuinfo "pydantic>=2" tqdm
  export DS_BUILD_OPS=0 DS_BUILD_AIO=0 DS_BUILD_GDS=0  # no CUDA ops compiled at install time
  "${PIP[@]}" --no-build-isolation "deepspeed==0.19.8"
fi

"$PY" - <<'PY'
import importlib.metadata as m
import torch
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
for name in ("torchtitan", "megatron-core", "deepspeed", "tyro"):
    print(f"{name} {m.version(name)}")
print(f"torch {torch.__version__} (unchanged)")
PY
