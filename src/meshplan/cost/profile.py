"""Implementation profiles: what differs between training codebases, as cost-model settings.

A profile names a codebase (Megatron-LM/NeMo, DeepSpeed, torchtitan, ...) and the CostParams
fields its choices set: the attention kernel, elementwise fusion, data-parallel gradient sync,
logits/loss precision, communication buffers, CUDA context and allocator. Profiles set only
codebase choices, never fitted hardware numbers (those come from a calibration), so the two
compose in either order.

    get_profile(None)          -> meshplan's own runtime (the default)
    get_profile("torchtitan")  -> a built-in profile
    get_profile("my.toml")     -> a profile file (see docs/cost-model.md)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshplan.cost.params import CostParams
from meshplan.errors import MeshplanError

DEFAULT_PROFILE = "meshplan"


@dataclass(frozen=True)
class Profile:
    """One codebase's implementation choices."""

    name: str
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)
    """CostParams field -> value."""

    def apply(self, params: CostParams) -> CostParams:
        return params.replace(**self.overrides) if self.overrides else params


PROFILES: dict[str, Profile] = {
    DEFAULT_PROFILE: Profile(DEFAULT_PROFILE, "meshplan's own runtime (FSDP2, DTensor TP, SDPA)"),
}


def get_profile(name_or_path: str | None) -> Profile:
    """A built-in profile by name, or a profile file; None gives meshplan's runtime."""
    key = DEFAULT_PROFILE if name_or_path is None else name_or_path
    if key in PROFILES:
        return PROFILES[key]
    raise MeshplanError(f"unknown profile {name_or_path!r}",
                        hint="built-in profiles: " + ", ".join(PROFILES))


def profile_for_framework(fw: str) -> str:
    """The built-in profile of a framework name as validate.frameworks detects it."""
    return DEFAULT_PROFILE
