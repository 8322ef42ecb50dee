#!/usr/bin/env bash
# Create .venv with meshplan, its test tools (numpy, pytest, pytest-xdist, hypothesis) and the runtime's torch.
# Planning needs no torch; `meshplan train` and tests/dist do. torch is pinned to 2.13.0 (on this
# disk the CPU build; an unpinned torch pulls a multi-GB CUDA build). MESHPLAN_WITH_TORCH=0 skips it
# (tests/dist are then skipped). With torch it also installs transformers (ingestion) and the export
# tools' parsers (MESHPLAN_WITH_EXPORT_TOOLS=0 skips them; their tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
if [ "${MESHPLAN_WITH_TORCH:-1}" = "1" ]; then
  .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
    || .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  # Ingestion of Hugging Face configs (issue 5); the constraint keeps torch as it is.
  .venv/bin/python -m pip install -q --disable-pip-version-check -c <(echo "torch==2.13.0") -e ".[ingest]"
  # The real parsers `meshplan export` is tested against (torchtitan, megatron-core, deepspeed).
  if [ "${MESHPLAN_WITH_EXPORT_TOOLS:-1}" = "1" ]; then bash scripts/install_export_tools.sh >/dev/null; fi
fi
