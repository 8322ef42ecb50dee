"""The parallel axes of a plan: their names, their order and the meshes a plan's degrees imply.

The one place that spells the axis names (in the style of torchtitan's ``ParallelDims``): every
other module names an axis as ``AX.TP``, ``AX.PP``, ... and asks :class:`ParallelDims` for the
mesh shapes. Mesh axis order, outermost to innermost: pp, dp, cp, tp (the innermost gets the
fastest links: TP groups are consecutive ranks). Expert parallelism (ep) is not a mesh axis of its
own: it folds into dp x cp, as in Megatron and torchtitan.

A test (tests/unit/test_plan_structure.py) fails on an axis-name string literal anywhere else
in ``src/meshplan``.
"""
from __future__ import annotations

from dataclasses import dataclass


class AX:
    """The axis names (plan fields, mesh dimension names, column keys)."""

    PP = "pp"
    """Pipeline parallel."""
    DP = "dp"
    """Data parallel."""
    CP = "cp"
    """Context parallel."""
    TP = "tp"
    """Tensor parallel."""
    EP = "ep"
    """Expert parallel (folds into dp x cp)."""
    DP_CP = "dp_cp"
    """dp x cp flattened into one mesh dimension (the root mesh's middle axis)."""


AXES = (AX.PP, AX.DP, AX.CP, AX.TP)
"""The mesh axes of a plan, outermost to innermost (the innermost gets the fastest links). Expert
parallelism (ep) is not an axis of its own: it folds into dp x cp."""
DEGREES = (AX.TP, AX.PP, AX.DP, AX.CP, AX.EP)
"""Every parallel degree of a Plan, in the order of the plan's fields (and of plan strings)."""
AXIS_DESCRIPTIONS = {
    AX.PP: "pipeline parallel: stages of consecutive layers",
    AX.DP: "data parallel: replicas, or ZeRO/FSDP shards",
    AX.CP: "context parallel: the sequence split (ring attention)",
    AX.TP: "tensor parallel: attention and MLP matmuls split (Megatron column/row)",
    AX.EP: "expert parallel (MoE): the experts spread over dp x cp",
}
"""Every parallel degree of a Plan, described: the mesh axes in AXES order, then ep."""


@dataclass(frozen=True)
class ParallelDims:
    """A plan's parallel degrees and the meshes they imply (torchtitan's ParallelDims)."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, plan: object) -> ParallelDims:
        """The degrees of a Plan (or of anything with the five degree attributes)."""
        return cls(**{a: getattr(plan, a) for a in DEGREES})

    def degree(self, axis: str) -> int:
        """The degree of one axis by name (``AX.TP`` ...)."""
        return int(getattr(self, axis))

    @property
    def world_size(self) -> int:
        """GPUs (processes): pp x dp x cp x tp."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_cp(self) -> int:
        """Ranks of dp x cp (those that average the loss; ep folds into them)."""
        return self.dp * self.cp

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The world mesh's dimension names: AXES."""
        return AXES

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The world mesh's shape, outermost to innermost: (pp, dp, cp, tp)."""
        return tuple(self.degree(a) for a in AXES)

    @property
    def root_dims(self) -> tuple[str, ...]:
        """The root mesh's dimension names: (pp, dp_cp, tp); every other mesh unflattens dp_cp."""
        return AX.PP, AX.DP_CP, AX.TP

    @property
    def root_shape(self) -> tuple[int, ...]:
        """The root mesh's shape: (pp, dp x cp, tp)."""
        return self.pp, self.dp_cp, self.tp

    def rank(self, pp: int, dp: int, cp: int, tp: int) -> int:
        """The global rank at a mesh coordinate (row-major over AXES: pp outermost, tp innermost)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """A global rank's coordinate on each mesh axis (AXES order; tp varies fastest)."""
        out: dict[str, int] = {}
        for a in reversed(AXES):
            n = self.degree(a)
            out[a] = rank % n
            rank //= n
        return {a: out[a] for a in AXES}
