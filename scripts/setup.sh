#!/usr/bin/env bash
# Create .venv with meshplan and its test tools. torch is pinned to the CPU build on this disk.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[dev]"
if [ "${MESHPLAN_NO_TORCH:-0}" != "1" ]; then
  .venv/bin/python -m pip install -q "torch==2.13.0" || echo "warning: torch==2.13.0 not installed; runtime features unavailable" >&2
fi
