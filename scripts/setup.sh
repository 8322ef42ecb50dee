#!/usr/bin/env bash
# Create .venv with meshplan and its test tools (numpy, pytest, hypothesis).
# Planning needs no torch. The runtime (coming with `meshplan train`) needs the CPU build of
# torch on this disk: set MESHPLAN_WITH_TORCH=1 to install torch==2.13.0 (pinned: an unpinned
# torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
if [ "${MESHPLAN_WITH_TORCH:-0}" = "1" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
