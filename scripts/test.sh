#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/meshplan ] || bash scripts/setup.sh
.venv/bin/python -m pytest tests "$@"
