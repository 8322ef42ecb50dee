#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/meshplan ] || bash scripts/setup.sh
# The HTML report is checked in headless Chromium (tests/browser); they skip if it can't be installed.
[ -x /usr/bin/chromium ] || bash scripts/install_chromium.sh || echo "test.sh: no chromium; browser tests will skip" >&2
.venv/bin/python -m pytest tests "$@"
