"""Browser tests: Debian's chromium, headless. Skipped (with the reason) when it is missing,
unless MESHPLAN_REQUIRE_BROWSER=1, which makes a missing browser a failure."""
from __future__ import annotations

import os

import pytest
from chromium_check import find_chromium

INSTALL = "bash scripts/install_chromium.sh (as root)"


def _unavailable(reason: str) -> None:
    if os.environ.get("MESHPLAN_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason}, and MESHPLAN_REQUIRE_BROWSER=1 requires the browser tests; install: {INSTALL}")
    pytest.skip(f"{reason} (install: {INSTALL}; set MESHPLAN_REQUIRE_BROWSER=1 to make this a failure)")


@pytest.fixture(scope="session")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        _unavailable(f"no chromium at {os.environ.get('MESHPLAN_CHROMIUM', '/usr/bin/chromium')}")
    try:
        import PIL  # noqa: F401  (decodes the screenshots; a dependency of matplotlib, a dev dependency)
    except ImportError:
        _unavailable("Pillow is not installed (needed to read screenshots)")
    return path
