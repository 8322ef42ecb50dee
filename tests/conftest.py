"""Test tiers. Markers (registered in pyproject.toml): ``dist`` (tests/dist: torchrun on CPU),
``browser`` (tests/browser: the report in headless Chromium), ``export_tools`` (tests/export: the
frameworks' own parsers) are given here by directory; ``slow`` is put on single tests by hand.
``bash scripts/test.sh --fast`` runs the rest; ``bash scripts/test.sh`` runs everything."""
from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
MARK_OF_DIRECTORY = {"dist": "dist", "browser": "browser", "export": "export_tools"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            top = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/
            continue
        mark = MARK_OF_DIRECTORY.get(top)
        if mark is not None:
            item.add_marker(getattr(pytest.mark, mark))
