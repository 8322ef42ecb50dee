"""Load imbalance of a mixture-of-experts layer under expert parallelism (issue 29).

Routing is priced balanced everywhere else (spec/transformer.py, ingest/moe.py's uniform routing:
``tokens k / E`` token-expert pairs per expert). A real router is not: with ``ep > 1`` the
ranks of an expert-parallel group wait for each other at the combine all-to-all, so each MoE layer
takes as long as its busiest rank. That rank runs more expert GEMM rows, receives more all-to-all
bytes and keeps more routed activations than the mean rank. ``load_factor`` is the expected
busiest-rank load over the mean, from routing statistics:

- One micro-batch of a layer puts ``N = ep T k`` token-expert pairs (``T`` tokens per rank) on
  ``E`` experts, ``E / ep`` per rank. A rank's share of the pairs has two sources of spread:

  * the finite number of tokens. Each token picks ``k`` distinct experts; under a balanced router
    its ``k`` picks land on a rank's ``E / ep`` experts as a hypergeometric draw, so a rank's load
    over its mean ``T k`` has variance ``(ep - 1)(E - k) / (ep T k (E - 1))`` (multinomial-like,
    without replacement). It shrinks as tokens per expert grow.
  * the router's persistent skew: even over many tokens experts are not equally popular. With
    per-expert loads of coefficient of variation ``c`` (CostParams.moe_expert_load_cv) around the
    mean, a rank's mean over its ``E / ep`` experts, drawn without replacement from the ``E``, has
    variance ``c^2 (ep - 1) / E``.

- The ``ep`` rank loads sum to ``N``: exchangeable normals with that marginal variance and a fixed
  sum are iid ones of variance ``v = var ep / (ep - 1)`` less their mean, whose expected maximum
  is ``sqrt(v) e(ep)``, ``e(n)`` the expected maximum of ``n`` standard normals
  (``expected_max_normal``). So ``factor = 1 + e(ep) sqrt(c^2 ep / E + (E - k) / ((E - 1) T k))``,
  1 at ``ep = 1`` (one rank holds every expert: nothing to wait for), non-increasing in ``T``,
  and at most ``ep min(k, E / ep) / k`` (every pair on one rank).
- A codebase that drops tokens at a capacity factor ``C`` (GShard, Switch, DeepSpeed-MoE: an
  expert takes at most ``C`` times its mean load; CostParams.moe_capacity_factor) caps the factor
  at ``C``; one that pads every expert's buffer to its capacity (DeepSpeed-MoE's einsum dispatch,
  CostParams.moe_pad_to_capacity) always runs ``C``.

Memory (``memory_factor``): the routed activations a rank keeps are the sum over the MoE layers it
holds, whose loads are independent draws (each layer has its own router), so their busiest-rank
excess over the mean shrinks as ``1 / sqrt(layers)``.

Token permutation (``permute_bytes``, issue 29): besides the expert GEMMs and the all-to-alls, a
dropless MoE layer copies every token-expert pair through HBM several times, as memory-bound
kernels. In Megatron-core's all-to-all dispatcher (megatron/core/transformer/moe/token_dispatcher.py,
``MoEAlltoAllTokenDispatcher``; the flex dispatcher's permute and unpermute alike) one micro-batch's
forward runs, per token of ``H`` bytes routed to ``k`` experts:

- ``permute`` (``dispatch_preprocess``, "Permutation 1: input to AlltoAll input"; TE's fused
  ``moe_permute_with_probs`` with ``--moe-permute-fusion``): gathers ``k`` copies, reading and
  writing ``k H`` (2 k H);
- ``sort_chunks_by_idxs`` (``dispatch_postprocess``, "Permutation 2: Sort tokens by local
  expert"), only where a rank holds more than one expert: the received ``k H`` read and written
  (2 k H), and its inverse before the combine all-to-all (``combine_preprocess``, 2 k H);
- ``unpermute`` (``combine_postprocess``, "Unpermutation 1: AlltoAll output to output"): the ``k``
  copies read and summed into one token (k H + H).

Each kernel's backward moves the same bytes the other way (the gradient of a gather is a
scatter-add and vice versa), so the backward repeats them. The received-side sorts run on the
busiest rank's load (``load_factor``). The routing probabilities permuted alongside (4 B per pair)
and the router's fused top-k/softmax over ``E`` fp32 logits (``--moe-router-fusion``: about
``9 E`` B per token) are under 2 % of these bytes for the rows this was checked on and are not
counted.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np

from meshplan.cost.params import CostParams
from meshplan.errors import MeshplanError

#: Bounds of CostParams.moe_expert_load_cv: 0 (a perfectly balanced router over many tokens) to 1
#: (expert loads spread as much as their mean: far past any auxiliary-loss-balanced router).
CV_BOUNDS = (0.0, 1.0)
#: Bounds of a capacity factor other than 0 (dropless): below 1 a layer drops tokens by design
#: (not modelled: the factor would price less than the mean work); 16 is far past any published one.
CAPACITY_BOUNDS = (1.0, 16.0)


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` iid standard normals] (0 for n = 1; 0.564 for 2, 1.029 for 4, 1.424 for 8),
    by quadrature of ``x n phi(x) Phi(x)^(n-1)``."""
    if n <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 24001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))
    f = x * n * phi * cdf ** (n - 1)
    return float(np.sum((f[1:] + f[:-1]) * 0.5 * np.diff(x)))


def _e_max(ep: Any) -> np.ndarray:
    e = np.rint(np.asarray(ep, dtype=float)).astype(np.int64)
    u, inv = np.unique(e, return_inverse=True)
    return np.array([expected_max_normal(int(v)) for v in u.tolist()])[inv.ravel()].reshape(e.shape)


def check_params(p: CostParams) -> None:
    """A one-line MeshplanError for MoE parameters out of their bounds."""
    lo, hi = CV_BOUNDS
    if not lo <= p.moe_expert_load_cv <= hi:
        raise MeshplanError(f"moe_expert_load_cv = {p.moe_expert_load_cv} is outside [{lo}, {hi}]",
                            hint="the coefficient of variation of per-expert loads: 0.1 for an auxiliary-loss router")
    c = p.moe_capacity_factor
    if c != 0 and not CAPACITY_BOUNDS[0] <= c <= CAPACITY_BOUNDS[1]:
        raise MeshplanError(f"moe_capacity_factor = {c} is outside [{CAPACITY_BOUNDS[0]}, {CAPACITY_BOUNDS[1]}]",
                            hint="0 for a dropless codebase, else the capacity factor it drops tokens at (>= 1)")


def _excess(tokens: Any, experts: Any, top_k: Any, ep: Any, p: CostParams) -> tuple[np.ndarray, np.ndarray]:
    """(relative standard deviation of a rank's load as an iid-equivalent draw, upper bound of the
    factor) for layers of ``experts`` experts, ``top_k`` per token, ``tokens`` per rank."""
    t = np.maximum(np.asarray(tokens, dtype=float), 1e-9)
    e = np.maximum(np.asarray(experts, dtype=float), 1.0)
    k = np.clip(np.asarray(top_k, dtype=float), 1.0, e)
    ep_ = np.maximum(np.asarray(ep, dtype=float), 1.0)
    routing = p.moe_expert_load_cv ** 2 * ep_ / e
    sampling = np.where(e > 1, (e - k) / np.maximum(e - 1, 1.0), 0.0) / (t * k)
    most = ep_ * np.minimum(k, e / ep_) / k  # every pair on one rank
    return np.sqrt(routing + sampling), np.maximum(most, 1.0)


def _apply_capacity(f: np.ndarray, p: CostParams) -> np.ndarray:
    c = p.moe_capacity_factor
    if c == 0:
        return f
    return np.full_like(f, c) if p.moe_pad_to_capacity else np.minimum(f, c)


def load_factor(tokens: Any, experts: Any, top_k: Any, ep: Any, p: CostParams) -> np.ndarray:
    """Expected load of the busiest expert-parallel rank over the mean rank's, for one MoE layer
    and micro-batch (module doc): ``tokens`` per rank, ``experts`` (E), ``top_k`` (k) and ``ep``
    broadcast together. 1 where there are no experts (E = 0)."""
    check_params(p)
    s, most = _excess(tokens, experts, top_k, ep, p)
    f = np.minimum(1.0 + s * _e_max(np.broadcast_to(np.asarray(ep), s.shape)), most)
    f = _apply_capacity(f, p)
    return np.where(np.asarray(experts) > 0, f, 1.0)


def memory_factor(tokens: Any, experts: Any, top_k: Any, ep: Any, layers: Any, p: CostParams) -> np.ndarray:
    """The same for the routed activations a rank keeps over ``layers`` MoE layers (independent
    routers: the excess shrinks as 1 / sqrt(layers))."""
    check_params(p)
    s, most = _excess(tokens, experts, top_k, ep, p)
    n = np.maximum(np.asarray(layers, dtype=float), 1.0)
    f = np.minimum(1.0 + s / np.sqrt(n) * _e_max(np.broadcast_to(np.asarray(ep), np.broadcast(s, n).shape)), most)
    f = _apply_capacity(f, p)
    return np.where(np.asarray(experts) > 0, f, 1.0)


def permute_bytes(hidden_bytes: float, top_k: int, local_experts: int, busiest: float = 1.0) -> float:
    """HBM bytes per token that one forward of a dropless MoE layer's token permutation moves
    (module doc: Megatron-core's permute, the per-expert sort and its inverse where a rank holds more
    than one expert, and the unpermute), for tokens of ``hidden_bytes`` routed to ``top_k`` experts,
    ``local_experts`` per rank; the received-side sorts at the busiest rank's ``busiest`` load. The
    backward moves the same bytes again. 0 for a layer without experts (``top_k`` 0)."""
    if top_k <= 0:
        return 0.0
    kh = float(top_k) * float(hidden_bytes)
    sort = 4.0 * kh * busiest if local_experts > 1 else 0.0
    return 2.0 * kh + sort + kh + float(hidden_bytes)
