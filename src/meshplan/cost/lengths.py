"""The expected step of a workload whose samples have a distribution of lengths.

``Workload.lengths`` (spec.lengths) gives sample lengths L_1 < ... < L_K with probabilities p_j
and how samples become micro-batches (``packing``, defined in spec/lengths.py and run so by
meshplan's runtime). A step's micro-batches then differ: each costs what a micro-batch of its
padded length (its longest sample) costs, and the step ends when the slowest data-parallel replica
is done (its gradient sync waits for it). This module prices that analytically, for many plans at
once (the search's seam, like cost.batch.estimate_batch); docs/heterogeneous-data.md has the
derivation and its limits.

Per plan and length L (the cost model at ``seq_len = L``, transformers regenerated at L):

- t(L): one micro-batch on the critical pipeline rank (its compute, TP/CP/EP and per-block FSDP
  communication, sends: everything that scales with the micro-batch);
- bub(L): the pipeline bubble (fill and drain) at that length, cost.schedule's closed form;
- rest(L) = step(L) - m t(L) - bub(L): the once-per-step parts (gradient sync and optimizer,
  their overlap with the last backward, pipelined FSDP, stragglers, overhead);
- D(L) = sum T - max T: a micro-batch's passes on the other ranks.

The step is

    E[step] = E[max over the dp replicas of R] + E[rest],  R = sum_i t(l_i) + Z

for a replica that runs micro-batches of padded lengths l_1..l_m, Z its pipeline's fill, drain and
stalls (0 without a pipeline), rest averaged over the micro-batch lengths. By packing:

- padded: a micro-batch's padded length is the max of ``micro_batch`` draws, P(l <= L_j) = F_j^b;
  a replica's m micro-batches are independent, so R takes one value per composition of m into
  the K lengths (multinomial counts; exact while at most MAX_COMPOSITIONS are at least
  PRUNE_BELOW likely), and the replicas are independent: E[max of n] = sum_v v (F_R(v)^n -
  F_R(v-)^n), exact on the discrete support. Beyond, R is a mixture of normals (the count of the
  longest micro-batches exact, or, where that count is near normal, a mixture over the longest
  micro-batch with the sum's exact conditional moments), E[max] integrated.
  Z: GPipe is a flow shop, Z = bub(max_i l_i). 1F1B and the others stall again at every
  micro-batch heavier than those in flight with it: the first pays bub(l_1), micro-batch i its
  stall s(l_i) (D, less the weight gradients under zero-bubble schedules) beyond the largest of
  the pp - 1 before it, a_d = 1 - (d - 1)/(pp - 1) of it d back (stall_extra, STALL_SHARE),
  averaged over the orders of the replica's composition.
- bucketed: the step's G = dp m b samples sorted, cut into micro-batches, micro-batch j to
  replica j mod dp: replica dp - 1 gets the longest micro-batch of every round and the longest
  of all, so it is the slowest on every draw: E[step] = sum_i E[t(X_(i dp b))] +
  E[Z(X_(G)) + rest(X_(G))], X_(r) the r-th order statistic of G draws (P(X_(r) <= L_j) =
  P(Binomial(G, F_j) >= r)); its ascending micro-batches pay the fill and drain once, at the
  last, Z = max(bub, D) (replica_bucketed). Exact given Z.
- packed: every micro-batch is a full window: the fixed-length estimate (no imbalance).
- a pipeline whose schedule has one shape (``CostParams.pipeline_variable_shapes`` False:
  meshplan's runtime, torchtitan, DeepSpeed, Megatron without --variable-seq-lengths): every
  micro-batch padded to the longest length, the fixed-length estimate at it (no imbalance, the
  padding counted); the stalls below price a pipeline of variable shapes (the profile setting True).

The step at even load is what every replica would take if each micro-batch cost the mean
micro-batch of the step: m E[t(l)] + E[bub(l)] + E[rest(l)]; the difference is the time lost to
imbalance (``time.imbalance`` / ``imbalance_s``, between replicas and, in a pipeline, between
micro-batches). Padding is not imbalance: it is in both. Throughput counts real tokens
(Workload.tokens), model FLOPs those of the real samples at their own lengths. Memory is the
longest micro-batch's (micro_batch x the longest length): the estimate at the workload's seq_len.

More than EXACT_LENGTHS distinct lengths: the cost model runs at EXACT_LENGTHS anchor lengths
(the shortest, the longest and lengths between them, geometrically spaced) and each per-length
term is interpolated quadratically in L between the three nearest anchors (a micro-batch's time
is a + b L + c L^2 up to the kernels' efficiency curves).

An ingested (traced) layer graph has one traced length: a distribution over it is refused
(``check_model``); a transformer (preset or ModelSpec file) is regenerated at every length.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from meshplan.cost import batch as _b
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.report import CostReport, report_from_row
from meshplan.cost.uncertainty import step_band
from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload
from meshplan.spec.transformer import as_graph

EXACT_LENGTHS = 8
"""Most distinct lengths the cost model is run at per plan; more are interpolated between anchors."""
MAX_COMPOSITIONS = 2000
"""Most compositions of a replica's micro-batches into lengths kept for the exact enumeration
(padded), after dropping those less likely than PRUNE_BELOW; beyond, a mixture of normals."""
ENUMERATE_AT_MOST = 60_000
"""Most compositions generated to look for the likely ones among them."""
PRUNE_BELOW = 1e-10
"""Compositions less likely than this are dropped (the rest renormalised): E[max] moves by at most
this times the count of replicas times the spread of R."""
MIXTURE_GRID = 1024
"""Points of the integral of E[max] under the normal-mixture approximation."""

EXTRA_KEYS = ("step_time_even_s", "imbalance_s", "padding_fraction", "padded_tokens")
"""Per-row results beyond estimate_batch's (time.imbalance too)."""

__all__ = ["EXACT_LENGTHS", "MAX_COMPOSITIONS", "check_model", "emax_discrete", "emax_mixture", "expected_batch",
           "expected_report", "graph_at", "microbatch_probs", "order_stat_pmf", "replica_padded"]


# ---- the model at one length -------------------------------------------------------------------

def check_model(model: LayerGraph | ModelSpec, work: Workload) -> None:
    """Refuse a length distribution over a traced layer graph (one traced length)."""
    if not work.varied or isinstance(model, ModelSpec) or model.model is not None:
        return
    raise MeshplanError(
        f"--seq-len {work.lengths.text() if work.lengths else work.seq_len}: {model.name} is a layer graph traced at "
        f"{model.sample_tokens} tokens per sample; meshplan prices a length distribution only for transformer "
        "descriptions (presets, ModelSpec files), which it regenerates at every length",
        hint="give one length (--seq-len N, ingested at N), or --packing packed")


def graph_at(model: LayerGraph | ModelSpec, length: int) -> LayerGraph:
    """``model`` at ``length`` tokens per sample: a transformer regenerated (memoised); a traced
    graph only at its own length."""
    if isinstance(model, ModelSpec):
        return as_graph(model, length)
    if model.model is not None:
        return as_graph(model.model, length)
    if int(length) == model.sample_tokens:
        return model
    raise MeshplanError(f"{model.name}: a traced layer graph has one length ({model.sample_tokens} tokens); "
                        f"cannot price {length}", hint="give one length, or a transformer preset")


def anchor_lengths(lengths: Sequence[int], most: int | None = None) -> list[int]:
    """The lengths the cost model runs at: all of them when there are at most ``most``, else
    ``most`` of them, the shortest and the longest included, geometrically spaced."""
    most = EXACT_LENGTHS if most is None else most
    ls = list(lengths)
    if len(ls) <= most:
        return ls
    targets = np.geomspace(ls[0], ls[-1], most)
    arr = np.asarray(ls, dtype=float)
    out = sorted({ls[int(np.argmin(np.abs(np.log(arr) - math.log(t))))] for t in targets} | {ls[0], ls[-1]})
    rest = [x for x in ls if x not in out]
    while len(out) < most and rest:  # snapping merged some: fill the widest gaps
        gaps = [(out[i + 1] / out[i], i) for i in range(len(out) - 1)]
        _, i = max(gaps)
        mid = math.sqrt(out[i] * out[i + 1])
        cand = min((x for x in rest if out[i] < x < out[i + 1]), key=lambda x: abs(math.log(x / mid)), default=None)
        if cand is None:
            break
        out = sorted(out + [cand])
        rest.remove(cand)
    return out


def interpolation(lengths: Sequence[int], anchors: Sequence[int]) -> np.ndarray:
    """(K, A) weights: a per-length term at each of ``lengths`` from its values at ``anchors``
    (exact at an anchor; else quadratic Lagrange on the three nearest anchors)."""
    A = np.asarray(anchors, dtype=float)
    W = np.zeros((len(lengths), len(anchors)))
    for k, x in enumerate(lengths):
        hit = np.nonzero(np.isclose(A, x, rtol=0, atol=0.5))[0]
        if len(hit):
            W[k, hit[0]] = 1.0
            continue
        if len(A) < 3:
            i = int(np.clip(np.searchsorted(A, x) - 1, 0, len(A) - 2))
            u = (x - A[i]) / (A[i + 1] - A[i])
            W[k, i], W[k, i + 1] = 1 - u, u
            continue
        i = int(np.clip(np.searchsorted(A, x) - 2, 0, len(A) - 3))
        pts = [i, i + 1, i + 2]
        if i + 3 < len(A) and abs(A[i + 3] - x) < abs(A[i] - x):
            pts = [i + 1, i + 2, i + 3]
        for a in pts:
            w = 1.0
            for c in pts:
                if c != a:
                    w *= (x - A[c]) / (A[a] - A[c])
            W[k, a] = w
    return W


# ---- distributions -----------------------------------------------------------------------------

def microbatch_probs(probs: Sequence[float], b: int) -> np.ndarray:
    """(K,) distribution of a padded micro-batch's length: the max of ``b`` independent samples."""
    F = np.clip(np.cumsum(probs), 0.0, 1.0)
    F[-1] = 1.0
    G = F ** int(b)
    return np.diff(np.concatenate([[0.0], G]))


def _log_factorials(n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1, dtype=float)))])


def order_stat_pmf(probs: Sequence[float], n: int, ranks: Sequence[int]) -> np.ndarray:
    """(len(ranks), K): P(X_(r) = L_j), X_(r) the r-th smallest of ``n`` independent draws
    (P(X_(r) <= L_j) = P(Binomial(n, F_j) >= r)). Exact (log-space binomial) up to 4e6 draws,
    a normal approximation of the binomial beyond."""
    F = np.clip(np.cumsum(probs), 0.0, 1.0)
    F[-1] = 1.0
    r = np.asarray(ranks, dtype=np.int64)
    cdf = np.empty((len(r), len(F)))
    if n <= 4_000_000:
        lf = _log_factorials(n)
        k = np.arange(n + 1)
        for j, f in enumerate(F):
            if f >= 1.0:
                cdf[:, j] = 1.0
                continue
            if f <= 0.0:
                cdf[:, j] = 0.0
                continue
            logpmf = lf[n] - lf[k] - lf[n - k] + k * math.log(f) + (n - k) * math.log1p(-f)
            pmf = np.exp(logpmf - logpmf.max())
            pmf /= pmf.sum()
            tail = np.cumsum(pmf[::-1])[::-1]  # P(Bin >= k)
            cdf[:, j] = np.clip(tail[np.clip(r, 0, n)], 0.0, 1.0)
    else:
        mu, sd = n * F, np.sqrt(n * F * (1 - F))
        z = (r[:, None] - 0.5 - mu[None, :]) / np.maximum(sd[None, :], 1e-12)
        cdf = 1.0 - _phi(z)
        cdf[:, F >= 1.0] = 1.0
    return np.diff(np.concatenate([np.zeros((len(r), 1)), cdf], axis=1), axis=1).clip(min=0.0)


@lru_cache(maxsize=256)
def compositions(m: int, k: int) -> np.ndarray:
    """(C(m + k - 1, k - 1), k): every way to count m micro-batches into k lengths."""
    rows = []
    for bars in itertools.combinations(range(m + k - 1), k - 1):
        prev, counts = -1, []
        for b in bars:
            counts.append(b - prev - 1)
            prev = b
        counts.append(m + k - 2 - prev)
        rows.append(counts)
    return np.asarray(rows, dtype=np.int64).reshape(-1, k)


def n_compositions(m: int, k: int) -> int:
    return math.comb(m + k - 1, k - 1)


def likely_compositions(q: np.ndarray, m: int, limit: int = MAX_COMPOSITIONS) -> tuple[np.ndarray, np.ndarray] | None:
    """(counts (S, K), probabilities (S,)) of the compositions of m micro-batches into the lengths
    at least PRUNE_BELOW likely (renormalised), or None when there are more than ``limit``."""
    K = len(q)
    if n_compositions(m, K) > ENUMERATE_AT_MOST:
        return None
    N = compositions(m, K)
    lf = _log_factorials(m)
    with np.errstate(divide="ignore"):
        logq = np.log(np.asarray(q, dtype=float))
    w = np.exp(lf[m] - lf[N].sum(axis=1) + np.where(N > 0, N * logq[None, :], 0.0).sum(axis=1))
    keep = w >= PRUNE_BELOW
    if keep.sum() > limit:
        return None
    return N[keep], w[keep] / w[keep].sum()


def emax_discrete(values: np.ndarray, probs: np.ndarray, n: Any) -> np.ndarray:
    """E[max of n independent draws] of a discrete distribution per row: ``values`` (rows, S),
    ``probs`` (S,) or (rows, S), ``n`` scalar or (rows,). sum_v v (F(v)^n - F(v-)^n), exact."""
    v = np.asarray(values, dtype=float)
    w = np.broadcast_to(np.asarray(probs, dtype=float), v.shape)
    order = np.argsort(v, axis=1, kind="stable")
    vs = np.take_along_axis(v, order, axis=1)
    ws = np.take_along_axis(w, order, axis=1)
    F = np.clip(np.cumsum(ws, axis=1), 0.0, None)
    F = F / F[:, -1:]
    Fp = np.concatenate([np.zeros((len(F), 1)), F[:, :-1]], axis=1)
    nn = np.broadcast_to(np.asarray(n, dtype=float), (len(v),))[:, None]
    return (vs * (F ** nn - Fp ** nn)).sum(axis=1)


def _phi(z: np.ndarray) -> np.ndarray:
    """The standard normal CDF (Abramowitz and Stegun 7.1.26 for erf: |error| < 1.5e-7)."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def emax_mixture(means: np.ndarray, sds: np.ndarray, weights: np.ndarray, n: Any,
                 grid: int = MIXTURE_GRID) -> np.ndarray:
    """E[max of n independent draws] of a mixture of normals per row (means, sds: (rows, C);
    weights (C,) or (rows, C)): lo + integral from lo of 1 - F^n, on a grid over +-8 sd."""
    mu, sd = np.asarray(means, dtype=float), np.maximum(np.asarray(sds, dtype=float), 1e-12)
    w = np.broadcast_to(np.asarray(weights, dtype=float), mu.shape)
    live = w > 0
    lo = np.where(live, mu - 8 * sd, np.inf).min(axis=1)
    hi = np.where(live, mu + 8 * sd, -np.inf).max(axis=1)
    x = lo[:, None] + (hi - lo)[:, None] * np.linspace(0.0, 1.0, grid)[None, :]  # (rows, G)
    F = np.zeros_like(x)
    for c in range(mu.shape[1]):
        F += w[:, c:c + 1] * _phi((x - mu[:, c:c + 1]) / sd[:, c:c + 1])
    F = np.clip(F / w.sum(axis=1, keepdims=True), 0.0, 1.0)
    nn = np.broadcast_to(np.asarray(n, dtype=float), (len(mu),))[:, None]
    g = 1.0 - F ** nn
    dx = (hi - lo) / (grid - 1)
    return lo + dx * (g.sum(axis=1) - 0.5 * (g[:, 0] + g[:, -1]))


# ---- a replica's load ---------------------------------------------------------------------------

def replica_padded(t: np.ndarray, bub: np.ndarray, q: np.ndarray, m: int, n: Any,
                   exact_limit: int = MAX_COMPOSITIONS) -> tuple[np.ndarray, np.ndarray]:
    """(E[max over n replicas of R], E[R]) per row, R = sum of m independent micro-batch times
    t_j (prob. q_j) + bub at the longest of them. ``t``, ``bub``: (rows, K)."""
    t, bub = np.asarray(t, dtype=float), np.asarray(bub, dtype=float)
    K = t.shape[1]
    q = np.asarray(q, dtype=float)
    Q = np.clip(np.cumsum(q), 0.0, 1.0)
    Q[-1] = 1.0
    pM = np.diff(np.concatenate([[0.0], Q ** m]))  # P(longest micro-batch = L_j)
    mean = m * (t @ q) + bub @ pM
    comp = likely_compositions(q, m, exact_limit)
    if comp is not None:
        N, w = comp
        top = K - 1 - np.argmax(N[:, ::-1] > 0, axis=1)  # index of the longest micro-batch
        R = t @ N.T.astype(float) + bub[:, top]
        return emax_discrete(R, w, n), mean
    if m * q[-1] * (1.0 - q[-1]) >= LONGEST_NORMAL_VAR:  # the longest's count is itself near normal
        return emax_by_longest(t, bub, q, m, n), mean
    return emax_longest_exact(t, bub, q, m, n), mean


LONGEST_NORMAL_VAR = 16.0
"""Above this variance of the count of longest micro-batches (m q_K (1 - q_K): 4 sd), the
mixture over the longest micro-batch (emax_by_longest) replaces the exact count (emax_longest_exact):
that count is then near normal, and the mixture has K components instead of ~ 12 sd of them."""


def emax_by_longest(t: np.ndarray, bub: np.ndarray, q: np.ndarray, m: int, n: Any) -> np.ndarray:
    """E[max over n replicas] of R = sum of m micro-batch times + bub at the longest M: a mixture
    over M = L_j (weights Q_j^m - Q_(j-1)^m) of normals with the exact conditional mean and
    variance of the sum given M."""
    K = t.shape[1]
    Q = np.clip(np.cumsum(q), 0.0, 1.0)
    Q[-1] = 1.0
    pM = np.diff(np.concatenate([[0.0], Q ** m]))
    mus, sds, ws = [], [], []
    for j in range(K):
        if pM[j] <= 1e-15:
            continue
        qj = q[:j + 1] / Q[j]
        mu_j = t[:, :j + 1] @ qj
        var_j = (t[:, :j + 1] ** 2) @ qj - mu_j ** 2
        A1 = Q[j] ** m
        e1, e2 = A1 * m * mu_j, A1 * (m * var_j + (m * mu_j) ** 2)
        if j > 0:
            qi = q[:j] / Q[j - 1]
            mu_i = t[:, :j] @ qi
            var_i = (t[:, :j] ** 2) @ qi - mu_i ** 2
            A0 = Q[j - 1] ** m
            e1, e2 = e1 - A0 * m * mu_i, e2 - A0 * (m * var_i + (m * mu_i) ** 2)
        cm = e1 / pM[j]
        cv = np.maximum(e2 / pM[j] - cm ** 2, 0.0)
        mus.append(cm + bub[:, j])
        sds.append(np.sqrt(cv))
        ws.append(pM[j])
    return emax_mixture(np.stack(mus, 1), np.stack(sds, 1), np.asarray(ws), n)


def emax_longest_exact(t: np.ndarray, bub: np.ndarray, q: np.ndarray, m: int, n: Any) -> np.ndarray:
    """E[max over n replicas] of R = sum of m micro-batch times + bub at the longest, with the count
    c of micro-batches of the longest length exact (Binomial(m, q_K): the rare, costly ones that
    skew R) and the other m - c micro-batches' sum a normal (their exact mean and variance); bub
    is bub_K when c > 0, else its mean over the others' longest. A mixture of normals, integrated."""
    K = t.shape[1]
    if K == 1:
        return m * t[:, 0] + bub[:, 0]
    qK = float(q[-1])
    lf = _log_factorials(m)
    c = np.arange(m + 1)
    with np.errstate(divide="ignore"):
        logw = lf[m] - lf[c] - lf[m - c] + c * np.log(qK) + (m - c) * np.log1p(-qK)
    w = np.exp(logw)
    keep = np.nonzero(w > 1e-12 * w.max())[0]
    qr = q[:-1] / max(1e-300, 1.0 - qK)
    mu = t[:, :-1] @ qr
    var = np.maximum((t[:, :-1] ** 2) @ qr - mu ** 2, 0.0)
    Qr = np.clip(np.cumsum(qr), 0.0, 1.0)
    Qr[-1] = 1.0
    pM = np.diff(np.concatenate([[0.0], Qr ** m]))  # the others' longest when none is of length L_K
    bub0 = bub[:, :-1] @ pM
    cc = c[keep].astype(float)
    means = cc[None, :] * t[:, -1:] + (m - cc)[None, :] * mu[:, None] + np.where(cc > 0, bub[:, -1:], bub0[:, None])
    sds = np.sqrt((m - cc)[None, :] * var[:, None])
    return emax_mixture(means, sds, w[keep] / w[keep].sum(), n)


def _all_from(A: np.ndarray, c: float, M: int) -> np.ndarray:
    """P(c micro-batches drawn without replacement from M all come from a set of A of them), for
    a fractional c = k + phi: the k draws' product times the next draw's chance to the phi."""
    A = np.asarray(A, dtype=float)
    k = int(math.floor(c))
    out = np.ones_like(A)
    for d in range(min(k, M)):
        out = out * np.clip((A - d) / (M - d), 0.0, 1.0)
    phi = c - k
    if phi > 0 and k < M:
        out = out * np.clip((A - k) / (M - k), 0.0, 1.0) ** phi
    return out


def replica_padded_pipeline(t: np.ndarray, bub: np.ndarray, stall: np.ndarray, q: np.ndarray, m: int, n: Any,
                            window: float, exact_limit: int = MAX_COMPOSITIONS) -> np.ndarray:
    """E[max over n replicas of R] per row for a pipeline that is not a flow shop (1F1B,
    interleaved, zero-bubble, ZBV) under padding: R = sum_i t(l_i) + Z, Z the stalls of a random
    order of the replica's micro-batches: the first pays the bubble at its length, micro-batch i
    what its stall exceeds of the largest in flight before it (stall_extra). Given the replica's
    counts N (exact enumeration), Z is its expectation over the orders of N: a micro-batch longer
    than L_k has only shorter ones in its window with chance _all_from(A_k, c(i), m - 1), A_k the
    replica's other micro-batches no longer than L_k; beyond ``exact_limit`` compositions, each
    micro-batch carries its expected stall over independent neighbours (stall_extra)."""
    s = np.maximum.accumulate(np.asarray(stall, dtype=float), axis=1)
    comp = likely_compositions(q, m, exact_limit)
    if comp is None:
        eff = t + stall_extra(s, bub, q, m, window) / m
        return replica_padded(eff, np.zeros_like(eff), q, m, n, exact_limit)[0]
    N, w = comp
    A = np.cumsum(N, axis=1)[:, :-1].astype(float)  # (nc, K - 1) micro-batches no longer than L_k
    cs = overlap_counts(window, m)[1:]
    H = np.zeros_like(A)
    for c in np.unique(cs).tolist():
        H += (cs == c).sum() * _all_from(A, c, m - 1)
    Gk = (m - A) / m * H  # (nc, K - 1): expected count of positions where the stall rises past s_k
    Z = (N @ bub.T).T / m + (Gk @ np.diff(s, axis=1).T).T  # (rows, nc)
    R = t @ N.T.astype(float) + Z
    return emax_discrete(R, w, n)


def replica_bucketed(t: np.ndarray, bub: np.ndarray, rest: np.ndarray, probs: Sequence[float], dp: int,
                     m: int, b: int, drain: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(E[step], E[step at even load], (K,) mean micro-batch length distribution) per row under
    bucketing. The slowest replica (dp - 1) takes the (i dp b)-th smallest sample's length in
    round i, so its micro-batches ascend and the longest of all is its last:
    sum_i t(X_(i dp b)) + Z(X_(G)) + rest(X_(G)). Z, the pipeline's fill and drain, is paid once,
    at the last micro-batch: bub (a flow shop's, GPipe's and 1F1B's, whose bubble is sum T - max T);
    with ``drain`` = sum T - max T, max(bub, drain): interleaving's 1/v and the zero-bubble
    schedules' weight-gradient credit need neighbours as heavy as the last one, which the steep end
    of a long tail does not have (a lone heavy micro-batch at the end pays the whole sum T - max T),
    so this bounds them from above (docs/heterogeneous-data.md)."""
    G = dp * m * b
    ranks = np.arange(1, dp * m + 1) * b  # the longest sample of micro-batch j is the (j+1) b-th
    pmf = order_stat_pmf(probs, G, ranks)  # (dp m, K)
    slow = pmf[dp - 1::dp]                 # replica dp - 1's micro-batches, round by round
    c = slow.sum(axis=0)                   # expected count of its micro-batches at each length
    last = pmf[-1]
    q_even = pmf.mean(axis=0)
    z = (bub if drain is None else np.maximum(bub, drain)) @ last
    expected = t @ c + z + rest @ last
    even = m * (t @ q_even) + (bub + rest) @ q_even
    return expected, even, q_even


# ---- the batch -----------------------------------------------------------------------------------

def _columns(plans: Sequence[Plan] | Mapping[str, Any]) -> dict[str, Any]:
    cols = plans if isinstance(plans, Mapping) else _b.plans_to_columns(plans)
    return {k: np.asarray(v) if k != "stage_layers" else v for k, v in cols.items()}


Priced = Callable[[int], "tuple[_b.Assembly, dict[str, np.ndarray]]"]
"""(assembly, its estimate_assembly result) of the plan rows at one sample length: how a stage
above (cost.pools' pipeline over pools) has its own assembly priced per length."""


def expected_batch(model: LayerGraph | ModelSpec, cluster: ClusterSpec, work: Workload,
                   plans: Sequence[Plan] | Mapping[str, Any],
                   params: CostParams = DEFAULT_PARAMS, *, priced: Priced | None = None) -> dict[str, np.ndarray]:
    """cost.batch.estimate_batch for a workload with a length distribution: the same keys
    (step_time_s the expected step, tokens_per_s real tokens per second, time.* the even-load
    breakdown plus time.imbalance, memory at the longest micro-batch) and EXTRA_KEYS. A workload
    without varied lengths (one length, or packed) is estimate_batch's result with no imbalance.
    ``priced``: the rows' assembly and estimate at one length (default: cost.batch's on ``cluster``)."""
    cols = _columns(plans)
    if not work.varied and priced is not None:
        out = priced(work.seq_len)[1]
        n = len(out["step_time_s"])
        padded = float(work.global_batch * work.seq_len)
        return out | {"time.imbalance": np.zeros(n), "step_time_even_s": out["step_time_s"].copy(),
                      "imbalance_s": np.zeros(n), "padding_fraction": np.full(n, 1.0 - work.tokens / padded),
                      "padded_tokens": np.full(n, padded)}
    if not work.varied:
        out = _b.estimate_batch(model, cluster, work, cols, params)
        n = len(out["step_time_s"])
        padded = float(work.global_batch * work.seq_len)
        return out | {"time.imbalance": np.zeros(n), "step_time_even_s": out["step_time_s"].copy(),
                      "imbalance_s": np.zeros(n), "padding_fraction": np.full(n, 1.0 - work.tokens / padded),
                      "padded_tokens": np.full(n, padded)}
    check_model(model, work)
    if priced is not None:
        return _estimate_group(model, cluster, work, cols, params, priced)
    return _b.by_pipeline_depth(cols, lambda c: _estimate_group(model, cluster, work, c, params))


def expected_report(model: LayerGraph | ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
                    params: CostParams = DEFAULT_PARAMS) -> CostReport:
    """One plan (no buckets) on one GPU type: the expected step over a length distribution
    (time carries 'imbalance'), or the one-length estimate; the plan checked (cost.batch.check)."""
    _b.check(model, cluster, plan, work)
    if not work.varied:
        return report_from_row(model, cluster, _b.estimate_batch(model, cluster, work, [plan], params), 0, params)
    check_model(model, work)
    return report_from_row(model, cluster, expected_batch(model, cluster, work, [plan], params), 0, params)


def _per_length(model: LayerGraph | ModelSpec, cluster: ClusterSpec, work: Workload, cols: dict[str, Any],
                params: CostParams, length: int,
                priced: Priced | None = None) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """(estimate_batch's result at ``length``, and per row: t, one micro-batch on the critical rank;
    stall, what one micro-batch heavier than its neighbours adds to a pipeline's step; drain,
    sum T - max T, its passes on the other ranks)."""
    if priced is not None:
        a, est = priced(int(length))
    else:
        w = work.shaped(work.global_batch, int(length))
        a = _b.assemble(graph_at(model, length), cluster, w, cols, params)
        est = _b.estimate_assembly(a, cluster, w, params)
    tot = np.where(a.valid, a.totals, 0.0)
    tmax = a.totals.max(axis=1)
    blk = a.lay.is_block[None, :] * a.lay.total[None, :]
    w_frac = (blk * a.q["bw"]).sum(1) / np.maximum(1e-30, (blk * (a.q["f"] + a.q["bi"] + a.q["bw"] + a.q["rc"])).sum(1))
    tsum = tot.sum(axis=1)
    return est, tmax, stall_seconds(tsum, tmax, cols, w_frac), tsum - tmax


STALL_FRACTION = {"interleaved-1f1b": 0.9, "zbv": 0.9}
"""Of sum T - max T (less W under ZBV), the stall a lone heavy micro-batch adds to these schedules
(1 for GPipe, 1F1B and ZB-H1): measured on their orders (sim.schedules) with uniform stages,
pp 2-8, v 2-8, F : B : W from 1 : 1 : 1 to 1 : 2.7 : 0.48: 0.87-0.92 for interleaved 1F1B,
0.85-0.91 for ZBV, 0.97-0.99 for ZB-H1 (tests/unit/test_lengths_pipeline.py)."""
STALL_SHARE = "pp - 1"
"""A heavy micro-batch shares its stall with one d micro-batches before it by
max(0, 1 - (d - 1) / (pp - 1)): for 1F1B and ZB-H1 the micro-batches rank 0 starts before its
first backward, and the shared stall (the sum over d, pp / 2) matches the one measured on their
orders within 0.2 micro-batches. ZBV and interleaved 1F1B share more for a lone pair of heavy
micro-batches (about pp and 1.25 pp) but no single window fits them within 15% on real plans
(windows pp - 1 to 2.5 pp - 1 tried against the simulator): they take the same window, which bounds
their stalls from above on every plan measured (docs/heterogeneous-data.md)."""


def stall_seconds(tsum: np.ndarray, tmax: np.ndarray, cols: Mapping[str, Any], w_frac: np.ndarray) -> np.ndarray:
    """(rows,) the stall of a pipeline around one micro-batch heavier than those in flight with
    it: its passes on the other ranks, sum T - max T (GPipe's and 1F1B's fill and drain, which
    interleaving hardly shortens for a lone heavy micro-batch: STALL_FRACTION), less its weight
    gradients under the split-backward schedules (their W passes still fill the gaps); 0 without
    a pipeline."""
    sched = np.asarray(cols["schedule"])
    split = (sched == "zero-bubble") | (sched == "zbv")
    frac = np.ones(len(sched))
    for name, f in STALL_FRACTION.items():
        frac = np.where(sched == name, f, frac)
    out = (tsum - tmax) * np.where(split, 1.0 - w_frac, 1.0) * frac
    return np.where(np.asarray(cols[AX.PP]) > 1, out, 0.0)


def stall_window(cols: Mapping[str, Any]) -> np.ndarray:
    """(rows,) the window of STALL_SHARE, pp - 1 (at least 1); GPipe: every earlier micro-batch,
    undecayed (inf)."""
    pp = np.asarray(cols[AX.PP], dtype=float)
    return np.where(np.asarray(cols["schedule"]) == "gpipe", np.inf, np.maximum(pp - 1.0, 1.0))


def overlap_counts(window: float, m: int) -> np.ndarray:
    """(m,) the effective number of earlier micro-batches whose stall covers micro-batch i's:
    sum_{d=1}^{i} max(0, 1 - (d - 1) / window) (i for GPipe's infinite window)."""
    i = np.arange(m, dtype=float)
    if not np.isfinite(window):
        return i
    k = np.minimum(i, np.floor(window) + 1)
    return k - k * (k - 1) / (2 * window)


def stall_extra(stall: np.ndarray, bubble: np.ndarray, q: np.ndarray, m: int, window: float) -> np.ndarray:
    """(rows, K): the expected pipeline stall a micro-batch of length L_j brings, summed over the
    replica's m positions (independent neighbours of distribution q): the first pays the
    schedule's bubble at its length, micro-batch i > 0 what its stall exceeds of the largest
    stall of those before it still in flight, E[(s_j - Y)^+], P(Y <= y) = Q_s(y)^c(i)
    (c(i): overlap_counts, the decayed window as that many full ones)."""
    s = np.maximum.accumulate(np.asarray(stall, dtype=float), axis=1)  # longer is never lighter
    Q = np.clip(np.cumsum(q), 0.0, 1.0)[:-1]  # P(stall <= s_k), k < K - 1
    c = overlap_counts(window, m)[1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        wq = (Q[None, :] ** c[:, None]).sum(axis=0) if len(c) else np.zeros(len(Q))  # (K - 1,)
    ds = np.diff(s, axis=1) * wq[None, :]
    inc = np.concatenate([np.zeros((len(s), 1)), np.cumsum(ds, axis=1)], axis=1)
    return bubble + inc


def _estimate_group(model: LayerGraph | ModelSpec, cluster: ClusterSpec, work: Workload, cols: dict[str, Any],
                    params: CostParams, priced: Priced | None = None) -> dict[str, np.ndarray]:
    dist = work.lengths
    assert dist is not None
    L, p = dist.arrays
    anchors = anchor_lengths(dist.lengths)
    W = interpolation(dist.lengths, anchors)  # (K, A)
    ests, ts, ss, ds = [], [], [], []
    for x in anchors:
        e, t, s, dr = _per_length(model, cluster, work, cols, params, x, priced)
        ests.append(e)
        ts.append(t)
        ss.append(s)
        ds.append(dr)
    top = ests[-1]  # the longest length: memory, fits, the plan's checks

    def per(key: str) -> np.ndarray:  # (rows, K) a per-length term at every length
        return np.stack([e[key] for e in ests], axis=1) @ W.T

    micro = np.asarray(top["microbatches"]).astype(np.int64)
    t = np.stack(ts, axis=1) @ W.T
    stall = np.stack(ss, axis=1) @ W.T
    drain = np.stack(ds, axis=1) @ W.T
    step = per("step_time_s")
    bub = per("time.bubble")
    rest = step - micro[:, None] * t - bub
    n = len(micro)
    G = work.global_batch
    mb = np.asarray(cols["micro_batch"]).astype(np.int64)
    dp = np.asarray(cols[AX.DP]).astype(np.int64)
    window = stall_window(cols)
    gpipe = (np.asarray(cols["schedule"]) == "gpipe") | (np.asarray(cols[AX.PP]) == 1)
    pps = np.asarray(cols[AX.PP]).astype(np.int64)
    expected, even = np.empty(n), np.empty(n)
    qbar = np.empty((n, len(L)))
    keys = np.stack([micro, mb, dp, pps, np.where(np.isfinite(window), window * 1000, -1).astype(np.int64)], axis=1)
    for key in np.unique(keys, axis=0).tolist():
        m_, b_, d_, _, _ = key
        rows = np.nonzero((keys == np.asarray(key)[None, :]).all(axis=1))[0]
        w_ = float(window[rows[0]])
        tr, br, sr, rr = t[rows], bub[rows], stall[rows], rest[rows]
        if dist.packing == "bucketed":  # ascending micro-batches: the bubble once, at the longest
            e_, v_, q_ = replica_bucketed(tr, br, rr, p, d_, m_, b_, drain[rows])
        else:
            q_ = microbatch_probs(p, b_)
            v_ = m_ * (tr @ q_) + (br + rr) @ q_
            e_ = np.empty(len(rows))
            g = gpipe[rows]
            if g.any():  # a flow shop: fill and drain once, at the replica's longest micro-batch
                e_[g] = replica_padded(tr[g], br[g], q_, m_, d_)[0]
            if (~g).any():  # each micro-batch heavier than those in flight stalls the pipeline again
                e_[~g] = replica_padded_pipeline(tr[~g], br[~g], sr[~g], q_, m_, d_, w_)
            e_ = e_ + rr @ q_
        expected[rows], even[rows], qbar[rows] = e_, v_, q_
    expected = np.maximum(expected, even)  # E[max] >= the mean (guards rounding in the mixture)
    if not params.pipeline_variable_shapes:  # a schedule of one shape: every micro-batch at the longest
        fixed = pps > 1
        expected = np.where(fixed, np.asarray(top["step_time_s"]), expected)
        even = np.where(fixed, expected, even)
        qbar[fixed] = 0.0
        qbar[fixed, -1] = 1.0
    out = dict(top)
    for k in [k for k in top if k.startswith("time.")]:
        out[k] = (per(k) * qbar).sum(axis=1)
    out["time.imbalance"] = expected - even
    out["step_time_s"] = expected
    out["step_time_even_s"] = even
    out["imbalance_s"] = expected - even
    out["tokens_per_s"] = work.tokens / expected
    # model FLOPs of the real samples, each at its own length (padding is not useful work)
    ngpu = np.asarray(top["num_gpus"], dtype=float)
    mf = per("tflops_per_gpu") * step * ngpu[:, None]  # TFLOP per step of a batch of L_j-length samples
    hf = per("hfu") / np.maximum(per("mfu"), 1e-300) * mf
    real_mf, real_hf = mf @ p, hf @ p
    out["tflops_per_gpu"] = real_mf / expected / ngpu
    peak = np.asarray(top["tflops_per_gpu"]) / np.maximum(np.asarray(top["mfu"]), 1e-300)
    out["mfu"] = out["tflops_per_gpu"] / peak
    out["hfu"] = real_hf / expected / ngpu / peak
    low, high = step_band(expected, cols[AX.PP], params)
    out["step_time_s_low"], out["step_time_s_high"] = low, high
    out["time_to_target_s"] = expected * np.asarray(top["token_factor"])
    for k in ("outer_sync_s", "straggler_sync_s"):
        out[k] = (per(k) * qbar).sum(axis=1)
    padded = G * (qbar @ L.astype(float))
    out["padded_tokens"] = padded
    out["padding_fraction"] = 1.0 - G * dist.mean_len / padded
    return out
