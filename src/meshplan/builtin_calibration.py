"""The built-in calibration: the cost model's fitted numbers, read from meshplan/data/calibration.json.

``meshplan calibrate --runs <development runs> --out src/meshplan/data/calibration.json`` writes
that file; the built-in constants are simply this calibration (cost.params.DEFAULT_PARAMS, the
GPU presets' efficiencies and the default link efficiencies read it). This module imports
nothing else from meshplan, so that spec and cost can read it without cycles.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

FILE = "calibration.json"


@lru_cache(maxsize=1)
def builtin_calibration() -> dict[str, Any]:
    """The built-in calibration file as a dict ({} when it is missing: the priors then apply)."""
    try:
        text = (resources.files("meshplan") / "data" / FILE).read_text()
    except (FileNotFoundError, ModuleNotFoundError, OSError):  # pragma: no cover - broken install
        return {}
    return json.loads(text)


def builtin_values() -> dict[str, float]:
    """name -> fitted value of every parameter in the built-in calibration."""
    return {k: float(v) for k, v in builtin_calibration().get("values", {}).items()}


def gpu_key(field: str, family: str) -> str:
    """'gemm_efficiency@hopper': a GPU family's fitted efficiency (times each part's clock_ratio)."""
    return f"{field}@{family}"


def link_key(tier: str, kind: str) -> str:
    """'link_efficiency@inter_node:infiniband': achieved fraction of a link kind's line rate."""
    return f"link_efficiency@{tier}:{kind}"


def part_efficiency(family_value: float, clock_ratio: float) -> float:
    """A GPU part's efficiency from its family's calibrated value: times its clock_ratio, at most 1."""
    return min(1.0, family_value * clock_ratio)


def builtin_gpu_value(field: str, family: str) -> float | None:
    return builtin_values().get(gpu_key(field, family))


def builtin_link_value(tier: str, kind: str) -> float | None:
    return builtin_values().get(link_key(tier, kind))
