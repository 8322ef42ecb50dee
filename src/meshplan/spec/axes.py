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
from functools import lru_cache
from typing import Any

import numpy as np


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


DEFAULT_ORDER = AXES
"""The default placement: the mesh axes outermost to innermost (tp innermost, on the fastest links)."""


def parse_order(value: Any, where: str = "plan: mesh_order") -> tuple[str, ...] | None:
    """A placement (the mesh axes, outermost to innermost, as laid onto the device hierarchy:
    node, site) from ``pp:dp:cp:tp`` text or a sequence; None, '' or the default order -> None.
    Raises MeshplanError on anything that is not a permutation of AXES (plan text is memoised)."""
    if value is None or (isinstance(value, str) and not value):
        return None
    if isinstance(value, str) and where == "plan: mesh_order":
        return _parse_order_text(value)
    return _parse_order(value, where)


@lru_cache(maxsize=256)
def _parse_order_text(value: str) -> tuple[str, ...] | None:
    return _parse_order(value, "plan: mesh_order")


def _parse_order(value: Any, where: str = "plan: mesh_order") -> tuple[str, ...] | None:
    from meshplan.errors import MeshplanError
    if value is None:
        return None
    items = [x.strip() for x in value.replace(",", ":").split(":")] if isinstance(value, str) else [
        str(x).strip() for x in value]
    if items == [""] or not items:
        return None
    if sorted(items) != sorted(AXES):
        raise MeshplanError(f"{where}={':'.join(items)}: a placement names each of {', '.join(AXES)} once, "
                            "outermost first",
                            hint=f"e.g. {where.split(': ')[-1]}=dp:pp:cp:tp (data parallel across nodes and sites, "
                                 f"the pipeline inside them); the default is {':'.join(DEFAULT_ORDER)}")
    order = tuple(items)
    return None if order == DEFAULT_ORDER else order


def parse_sites(value: Any, where: str = "plan: site_order") -> tuple[int, ...] | None:
    """A site order (Plan.site_order): the sites in the order the pipeline visits them, ``1:0:2``
    text or a sequence of site numbers (0-based, a cluster's node order: site 0 holds its first
    nodes_per_dc nodes). Logical site k (the k-th block of gpus_per_dc consecutive ranks as the
    mesh order numbers them) runs on physical site ``order[k]``. None or '' -> None (the default:
    site k runs site k's ranks); an order in order is kept (a count of sites the cluster lacks is
    refused by site_order_fault). MeshplanError on anything not a permutation of 0 .. n - 1."""
    from meshplan.errors import MeshplanError
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    raw = value.replace(",", ":").replace(";", ":").split(":") if isinstance(value, str) else list(value)
    items = [str(x).strip() for x in raw]
    hint = ("name every site once, in the order the pipeline visits them (0-based), e.g. site_order=1:0:2 "
            "puts the first stages on site 1, then site 0, then site 2")
    if not all(x.isdigit() for x in items):
        raise MeshplanError(f"{where}={':'.join(items)}: site numbers are whole numbers >= 0", hint=hint)
    sites = tuple(int(x) for x in items)
    if sorted(sites) != list(range(len(sites))):
        raise MeshplanError(f"{where}={':'.join(items)} is not a permutation of the sites 0..{len(sites) - 1}",
                            hint=hint)
    return sites  # kept even in order, so a wrong count of sites is refused where the cluster is known


def site_order_fault(dims: ParallelDims, num_sites: int) -> str | None:
    """Why a plan's site order (``dims.sites``) cannot run on a cluster of ``num_sites`` equal sites
    (None: it can, or there is none). The order must name each of the cluster's sites, and the
    pipeline must be the only axis between sites: every stage's ranks in one site. Then the order
    only relabels whole sites under the pipeline, so every group but the pipeline's boundaries
    (and the tied sync between the first and last stages) keeps its links, and only those change."""
    sites = dims.sites
    if sites is None:
        return None
    if len(sites) != num_sites or dims.world_size % num_sites:
        return (f"site_order={':'.join(map(str, sites))} names {len(sites)} sites but the cluster has "
                f"{num_sites}; name each of its sites once (0-based), or drop site_order")
    if not _stages_in_sites(dims.pp, dims.dp, dims.cp, dims.tp, dims.order, num_sites):
        return (f"site_order needs every pipeline stage inside one site (the pipeline the only axis across the "
                f"{num_sites} sites), but pp={dims.pp} under {':'.join(dims.order)} spreads a stage over several; "
                f"use pp a multiple of {num_sites} with pp outermost (the default mesh_order), or drop site_order")
    return None


@lru_cache(maxsize=1024)
def _stages_in_sites(pp: int, dp: int, cp: int, tp: int, order: tuple[str, ...], num_sites: int) -> bool:
    """Every stage's ranks (in the rank numbering of ``order``) in one block of world / num_sites."""
    world = pp * dp * cp * tp
    if world % num_sites:
        return False
    grid = ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, order=order).rank_grid().reshape(pp, -1) // (world // num_sites)
    return bool((grid == grid[:, :1]).all())


def axis_strides(order: tuple[str, ...] | None, sizes: dict[str, Any]) -> dict[str, Any]:
    """Rank distance between neighbours on each mesh axis under a placement (None: the default):
    the product of the sizes of the axes inside it. ``sizes`` maps each of AXES to an int or a
    numpy array (one row per plan); the strides have the same shape."""
    out: dict[str, Any] = {}
    stride: Any = 1
    for a in reversed(order or DEFAULT_ORDER):
        out[a] = stride
        stride = stride * sizes[a]
    return out


def column_strides(orders: Any, sizes: dict[str, Any]) -> dict[str, np.ndarray]:
    """axis_strides per row of a plan table: ``orders`` holds each row's placement text ('' = the
    default), ``sizes`` each axis's degree per row (arrays)."""
    sz = {a: np.asarray(sizes[a], dtype=float) for a in AXES}
    n = np.broadcast(*sz.values()).shape
    orders = np.broadcast_to(np.asarray(orders if orders is not None else "", dtype=str), n)
    if not orders.any():  # every row in the default order (the common case: no search over placements)
        return {a: np.broadcast_to(v, n).astype(float) for a, v in axis_strides(None, sz).items()}
    out = {a: np.ones(n) for a in AXES}
    for text in np.unique(orders):
        rows = orders == text
        st = axis_strides(parse_order(str(text)), {a: np.broadcast_to(sz[a], n)[rows] for a in AXES})
        for a in AXES:
            out[a][rows] = st[a]
    return out


@dataclass(frozen=True)
class ParallelDims:
    """A plan's parallel degrees and the meshes they imply (torchtitan's ParallelDims)."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER
    """The placement: the mesh axes outermost to innermost as ranks are numbered (parse_order)."""
    sites: tuple[int, ...] | None = None
    """The site order (parse_sites; None: site k holds the k-th block of world / sites ranks):
    the ranks numbered by ``order`` in len(sites) equal blocks, block k on site sites[k]."""

    @classmethod
    def of(cls, plan: object) -> ParallelDims:
        """The degrees of a Plan (or of anything with the five degree attributes) and its placement."""
        order = getattr(plan, "mesh_order", None)
        sites = getattr(plan, "site_order", None)
        return cls(**{a: getattr(plan, a) for a in DEGREES}, order=tuple(order) if order else DEFAULT_ORDER,
                   sites=tuple(sites) if sites else None)

    @property
    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours on each axis under the placement (axis_strides)."""
        return axis_strides(self.order, {a: self.degree(a) for a in AXES})

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

    def _to_site(self, rank: Any) -> Any:
        """A rank of the order's numbering -> the global rank (device) under the site order."""
        if self.sites is None:
            return rank
        if self.world_size % len(self.sites):
            from meshplan.errors import MeshplanError
            raise MeshplanError(f"plan: site_order names {len(self.sites)} sites, which do not split its "
                                f"{self.world_size} GPUs evenly",
                                hint="name each of the cluster's (equal) sites once, or drop site_order")
        block = self.world_size // len(self.sites)
        return np.asarray(self.sites)[rank // block] * block + rank % block

    def rank(self, pp: int, dp: int, cp: int, tp: int) -> int:
        """The global rank at a mesh coordinate: row-major over the placement's order (by default
        AXES: pp outermost, tp innermost), its block of ranks moved to its site (``sites``)."""
        st, at = self.strides, {AX.PP: pp, AX.DP: dp, AX.CP: cp, AX.TP: tp}
        return int(self._to_site(sum(at[a] * st[a] for a in AXES)))

    def coords(self, rank: int) -> dict[str, int]:
        """A global rank's coordinate on each mesh axis (keys in AXES order; under the default
        placement tp varies fastest)."""
        if self.sites is not None:  # the device's site back to the block of the order's numbering
            block = self.world_size // len(self.sites)
            rank = self.sites.index(rank // block) * block + rank % block
        out: dict[str, int] = {}
        for a in reversed(self.order):
            n = self.degree(a)
            out[a] = rank % n
            rank //= n
        return {a: out[a] for a in AXES}

    def rank_grid(self) -> np.ndarray:
        """The global rank at every coordinate, shaped mesh_shape ((pp, dp, cp, tp), whatever the
        placement): the mesh tensor a DeviceMesh is built from. Under a site order, each block of
        world / len(sites) ranks of the order's numbering moves whole to its site."""
        st = self.strides
        grid = np.zeros(self.mesh_shape, dtype=np.int64)
        for i, a in enumerate(AXES):
            shape = [1] * len(AXES)
            shape[i] = self.degree(a)
            grid = grid + st[a] * np.arange(self.degree(a)).reshape(shape)
        return self._to_site(grid)
