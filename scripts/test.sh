#!/usr/bin/env bash
# Set up (if needed) and run the tests.
#   bash scripts/test.sh          everything (what CI runs): tests/unit, golden, browser, export on two
#                                 workers, then tests/dist (torchrun) one at a time
#   bash scripts/test.sh --fast   the fast tier, at most 3 minutes on 2 cores: the unit and golden tests
#                                 not marked slow (smoke runs of the installed command included), on
#                                 two workers where pytest-xdist is installed
# Other arguments go to pytest (e.g. -x, -k NAME). Markers (pyproject.toml): slow, dist, browser,
# export_tools; tests/conftest.py puts the last three on tests/dist, tests/browser, tests/export.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then fast=1; else args+=("$a"); fi
done
[ -x .venv/bin/meshplan ] || bash scripts/setup.sh
if [ "$fast" = 1 ]; then
  workers=()
  # A .venv set up before pytest-xdist joined the dev extra gets it here (the tier needs both cores).
  .venv/bin/python -c "import xdist" 2>/dev/null || .venv/bin/python -m pip install -q --disable-pip-version-check \
    -e ".[dev]" >/dev/null 2>&1 || echo "test.sh: pytest-xdist could not be installed; one worker" >&2
  .venv/bin/python -c "import xdist" 2>/dev/null && workers=(-n "${MESHPLAN_TEST_WORKERS:-2}")
  # One BLAS/OpenMP thread per worker: two workers with a thread per core each oversubscribe 2 cores
  # (the tier took twice as long).
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  exec .venv/bin/python -m pytest tests -m "not slow and not dist and not browser and not export_tools" \
    ${workers[@]+"${workers[@]}"} ${args[@]+"${args[@]}"}
fi
# The HTML report is checked in headless Chromium (tests/browser); they skip if it can't be installed.
[ -x /usr/bin/chromium ] || bash scripts/install_chromium.sh || echo "test.sh: no chromium; browser tests will skip" >&2
# Two phases: everything but the multi-process runtime tests on two workers (one BLAS thread each),
# then the torchrun tests one at a time (each starts its own process group on the machine's cores).
workers=()
.venv/bin/python -c "import xdist" 2>/dev/null && workers=(-n "${MESHPLAN_TEST_WORKERS:-2}")
status=0
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" .venv/bin/python -m pytest tests -m "not dist" \
  ${workers[@]+"${workers[@]}"} ${args[@]+"${args[@]}"} || status=$?
rc=0
.venv/bin/python -m pytest tests -m dist ${args[@]+"${args[@]}"} || rc=$?
[ "$rc" = 5 ] && rc=0  # no dist test selected (e.g. -k NAME matched none): not a failure
[ "$status" = 5 ] && status=0
[ "$status" = 0 ] && status=$rc
exit "$status"
