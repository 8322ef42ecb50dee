"""Data-parallel synchronisation on weak links: compression, periodic (local SGD / DiLoCo) outer
syncs, stragglers, and the traffic that crosses the link between datacenters.

Every function takes numpy arrays (one row per plan; (rows, ranks) where a pipeline rank's
parameters matter) so that the scalar estimate and the search share them.

Per step, a synchronous plan reduces every gradient over all data-parallel ranks (cost.parts).
A periodic plan (grad_sync=local-sgd or diloco) does that only within its inner group
(spec.sync.inner_dp) and, every ``sync_every`` = H steps, all-reduces the parameters (local
SGD) or the parameter deltas (DiLoCo) across the groups:

  outer sync   all-reduce of the parameters each rank holds (after ZeRO within its group), in
               fp32, bf16 or fp8 per grad_compression, over the n_out groups (a ring of n_out
               ranks tp*cp*n_in apart: cost.comm.Group puts it on the link it crosses), plus the
               outer step (memory bound, CostParams.outer_step_bytes_per_param);
  amortised    (max(0, outer - sync_overlap x inner step) + outer step) / H per step: with
               sync_overlap = tau the sync runs under the next tau inner steps (streaming DiLoCo).

Compression of a synchronous plan's per-step gradient sync: bf16 sends 2 bytes per gradient,
fp8 one (a reduce-scatter of fp8 chunks summed in fp32, then an fp8 all-gather: the ring's
volume at 1 byte), PowerSGD sends rank-r factors P (m x r) and Q (n x r) of each weight matrix
plus the vectors uncompressed (Vogels et al. 2019), in fp32, as three all-reduces, and its
compression moves CostParams.powersgd_bytes_per_param of HBM per gradient element.

Stragglers: with a per-GPU step-time jitter (coefficient of variation c, ClusterSpec.step_jitter)
a step that waits for n ranks lasts on average sigma x z(n) longer than one rank's, where sigma =
c x the step's compute (what jitters; waiting on links is not counted) and z(n) is the expected
maximum of n standard normals. A synchronous plan waits for all its ranks every step. A periodic
one waits for its inner group every step, and for the slowest group every H steps: H steps' sums have sigma sqrt(H), so
sigma x z(n_out) / sqrt(H) per step. That difference is what local SGD hides.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from meshplan.cost.comm import column_st, dpcp_group, members_within, mesh_strides
from meshplan.cost.params import flat_collectives
from meshplan.spec.axes import AX
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.sync import inner_dp, is_periodic

Num = Any

OUTER_BYTES = {"none": 4.0, "bf16": 2.0, "fp8": 1.0, "powersgd": 4.0}
"""Bytes per value of the outer sync by grad_compression (fp32 parameters / deltas)."""


def groups(cols: dict[str, Any], cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(periodic, n_in, n_out) per row: local-sgd/diloco rows, data-parallel ranks per inner
    group (dp for synchronous plans), and the inner groups (1 for synchronous plans)."""
    periodic = is_periodic(cols["grad_sync"])
    dp = np.asarray(cols[AX.DP], dtype=np.int64)
    n_in = inner_dp(dp, cols[AX.TP], cols[AX.CP], np.asarray(cols["sync_scope"]), cluster, periodic)
    return periodic, n_in, np.maximum(1, dp // np.maximum(n_in, 1))


_GRID = np.linspace(-12.0, 12.0, 24001)
_PDF = np.exp(-0.5 * _GRID**2) / math.sqrt(2 * math.pi)
_CDF = np.array([0.5 * math.erfc(-x / math.sqrt(2)) for x in _GRID.tolist()])


def expected_max_normal(n: Num) -> np.ndarray:
    """E[max of n standard normals] = the integral of x n phi(x) Phi(x)^(n-1) (on a grid of
    step 0.001 over +-12: exact to 1e-6 for any count of ranks); 0 for n <= 1."""
    n = np.asarray(n, dtype=float)
    uniq, inv = np.unique(np.maximum(n, 1.0), return_inverse=True)  # rank counts: few distinct values
    z = np.array([_z_max(k) for k in uniq.tolist()])
    return z[inv].reshape(n.shape) if n.size else np.zeros(n.shape)


_ZMAX: dict[float, float] = {}


def _z_max(k: float) -> float:
    """expected_max_normal of one count (memoised: a pure function of k; few distinct counts recur)."""
    hit = _ZMAX.get(k)
    if hit is None:
        if len(_ZMAX) > 4096:
            _ZMAX.clear()
        dx = _GRID[1] - _GRID[0]
        hit = _ZMAX[k] = 0.0 if k <= 1 else float(np.sum(_GRID * k * _PDF * _CDF ** (k - 1)) * dx)
    return hit


def straggler_seconds(jitter: float, step: Num, ranks: Num, periodic: Num, inner_ranks: Num,
                      n_out: Num, sync_every: Num) -> tuple[np.ndarray, np.ndarray]:
    """(expected wait per step, what the same plan would wait synchronously): sigma = jitter x
    ``step`` (the compute per step); synchronous: sigma z(ranks); periodic: sigma (z(inner_ranks)
    + z(n_out) / sqrt(H))."""
    sigma = jitter * np.asarray(step, dtype=float)
    sync = sigma * expected_max_normal(ranks)
    h = np.maximum(np.asarray(sync_every, dtype=float), 1.0)
    per = sigma * (expected_max_normal(inner_ranks) + expected_max_normal(n_out) / np.sqrt(h))
    return np.where(periodic, per, sync), sync


def matrix_elements(lay: Any, tp: np.ndarray, ep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """((rows, B) weight-matrix elements of each distinct layer on one GPU, (rows, B) the sum of
    their two sides m + n): the layers' GEMM weights (k x n, split by TP as the GEMM says;
    experts' counted per local expert), and a layer without GEMMs but with parameters (an
    embedding table) as one matrix of its output width (LayerOps.hidden, 2-byte activations) by
    params / width rows, split over TP when its parameters are (vocabulary-parallel). PowerSGD
    compresses every 2-D gradient; the rest (norms, biases) it sends whole."""
    tp, ep = np.asarray(tp, dtype=float)[:, None], np.asarray(ep, dtype=float)[:, None]
    elems = np.zeros((len(tp), len(lay.ops)))
    sides = np.zeros_like(elems)
    for b, o in enumerate(lay.ops):
        for g in o.gemms:
            k = g.k / np.where(g.split == "row", tp, 1.0)
            n = g.n / np.where(g.split == "column", tp, 1.0)
            copies = (max(1.0, float(o.experts)) / ep) if g.expert else 1.0
            elems[:, b:b + 1] += copies * k * n
            sides[:, b:b + 1] += copies * (k + n)
        if not o.gemms and o.params > 0 and o.hidden > 0:  # an embedding table
            width = o.hidden / 2.0
            rows = o.params / width / np.where(o.params_split >= 0.5 * o.params, tp, 1.0)
            elems[:, b:b + 1] += rows * width
            sides[:, b:b + 1] += rows + width
    return elems, sides


def powersgd_bytes(lay: Any, counts: Any, lp: np.ndarray, tp: np.ndarray, ep: np.ndarray,
                   rank: np.ndarray) -> np.ndarray:
    """(rows, ranks) bytes PowerSGD all-reduces per step on a rank: r (m + n) fp32 values per
    weight matrix and every other parameter whole (fp32), capped at the uncompressed 4 B each."""
    elems, sides = matrix_elements(lay, tp, ep)
    elems = np.minimum(elems, lp)
    r = np.asarray(rank, dtype=float)[:, None]
    per_layer = 4.0 * np.minimum(lp, (lp - elems) + r * sides)
    return counts.sum(per_layer)


def compressed_sync_bytes(grads: np.ndarray, params_local: np.ndarray, compression: np.ndarray,
                          psgd: np.ndarray | None) -> np.ndarray:
    """Bytes per rank of a synchronous plan's per-step gradient collective under compression
    (``grads``: uncompressed; ``psgd``: powersgd_bytes, or None when no row uses it)."""
    comp = np.asarray(compression)
    out = np.where(comp == "bf16", np.minimum(grads, 2.0 * params_local), grads)
    out = np.where(comp == "fp8", np.minimum(grads, 1.0 * params_local), out)
    if psgd is not None:
        out = np.where(comp == "powersgd", np.minimum(grads, psgd), out)
    return out


def outer_bytes(compression: Any) -> np.ndarray:
    """Bytes per value of each row's outer sync (OUTER_BYTES by grad_compression)."""
    comp = np.asarray(compression)
    out = np.full(comp.shape, 4.0)
    for name, b in OUTER_BYTES.items():
        out = np.where(comp == name, b, out)
    return out


def reduce_bytes(cols: dict[str, Any], p: Any) -> np.ndarray:
    """Bytes per gradient element FSDP's reduce-scatter (and HSDP's all-reduce) moves per row:
    CostParams.fsdp_reduce_bytes, or less with the gradient compression of a synchronous plan
    (FSDP2's reduce_dtype bf16: 2; meshplan's fp8 reduce-scatter: 1). A periodic plan's
    compression is its outer sync's: its inner reduction is uncompressed."""
    comp = np.asarray(cols["grad_compression"])
    periodic = is_periodic(cols["grad_sync"])
    base = np.full(comp.shape, float(p.fsdp_reduce_bytes))
    out = np.where(comp == "bf16", np.minimum(base, 2.0), np.where(comp == "fp8", np.minimum(base, 1.0), base))
    return np.where(periodic, base, out)


def outer_sync(cluster: ClusterSpec, cols: dict[str, Any], p: Any, held: np.ndarray, n_in: np.ndarray,
               n_out: np.ndarray, st: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """((rows, ranks) seconds of one outer all-reduce, (rows, ranks) seconds of one outer step)
    for the parameters ``held`` on each rank (after ZeRO within the inner group). Zero for
    synchronous rows. ``st``: the rows' strides (cost.comm.mesh_strides), if already known."""
    tp, cp = (np.asarray(cols[k], dtype=float)[:, None] for k in (AX.TP, AX.CP))
    per_value = outer_bytes(cols["grad_compression"])
    n_in = np.asarray(n_in, dtype=float)[:, None]
    st = column_st(mesh_strides(cols) if st is None else st)
    g = dpcp_group(cluster, st, cp, np.asarray(n_out, dtype=float)[:, None], cp * n_in, flat=flat_collectives(p))
    t = g.all_reduce(per_value[:, None] * held)
    diloco = (np.asarray(cols["grad_sync"]) == "diloco")[:, None]
    hbm = cluster.gpu.hbm_bandwidth_gbps * 1e9 * p.hbm_efficiency
    step_bytes = np.where(diloco, p.outer_step_bytes_per_param, 8.0)  # local SGD: read + write the average
    periodic = is_periodic(cols["grad_sync"])[:, None]
    return np.where(periodic, t, 0.0), np.where(periodic, step_bytes * held / hbm, 0.0)


def amortised_outer(outer: np.ndarray, outer_step: np.ndarray, inner_step: np.ndarray, cols: dict[str, Any],
                    slowdown: float) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, overlapped) seconds per step of the outer sync, amortised over H steps: the
    part sync_overlap inner steps do not hide (they are slowed by ``slowdown`` x what they
    hide, as any collective under compute), plus the outer step itself."""
    h = np.maximum(np.asarray(cols["sync_every"], dtype=float), 1.0)[:, None]
    tau = np.asarray(cols["sync_overlap"], dtype=float)[:, None]
    hide = tau * np.asarray(inner_step, dtype=float)
    hidden = np.minimum(outer, hide)
    exposed = (outer - hidden + slowdown * hidden + outer_step) / h
    return exposed, hidden / h


def cross_bytes(cluster: ClusterSpec, n: Num, stride: Num, size: Num, passes: Num,
                parts: list[tuple[Num, Num]] | None = None) -> np.ndarray:
    """Bytes one collective of every group (size bytes per rank, ``passes``: 2 for an all-reduce, 1
    for an all-gather or reduce-scatter) puts on each direction of the link between datacenters,
    run hierarchically (cost.comm.Group): each of the N / n groups moves (m - 1) / m of its
    size across the sites it spans (m of them) per pass, in 1 / k-sized pieces from each of its
    k members per site. 0 when the group stays in one datacenter. ``parts``: the group as the
    (degree, stride) of each axis it spans (cost.comm.dpcp_parts), instead of n ranks stride apart."""
    n, stride = np.asarray(n, dtype=float), np.asarray(stride, dtype=float)
    if cluster.num_dcs < 2:
        return np.zeros(np.broadcast_shapes(n.shape, stride.shape, np.shape(size)))
    per_site, one_site = members_within(cluster.gpus_per_dc, [(n, stride)] if parts is None else
                                        [(np.asarray(k, dtype=float), np.asarray(t, dtype=float)) for k, t in parts])
    m = np.where(one_site, 1.0, np.round(n / np.maximum(per_site, 1.0)))
    per = cluster.num_gpus / np.maximum(n, 1) * passes * (m - 1) / np.maximum(m, 1) * np.asarray(size, dtype=float)
    return np.where((m > 1) & (n > 1), per, 0.0)
