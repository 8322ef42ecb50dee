"""Mixture-of-experts routing on the meta device: uniform routing.

Routing is data dependent (which expert gets which token) and cannot run on the meta device as
written (``nonzero``/``where`` over the router's choice). While tracing, ingestion replaces the
experts' forward by a uniform-routing equivalent: the router still runs (its FLOPs and saved
tensors are counted), and the ``tokens x k`` token-expert pairs are split evenly over the E experts
(``tokens k / E`` each, the remainder spread one by one), each expert running its real matrices on
its share. FLOPs therefore equal a perfectly balanced step: ``k/E`` of the experts' dense cost;
what the pairs keep for the backward is recorded apart (``routed``), for the cost model's
load-imbalance term under expert parallelism (cost.moe).

Two layouts are handled:
- transformers >= 5 fused experts (``gate_up_proj``/``up_proj`` and ``down_proj`` as [E, out, in]
  parameters, forward(hidden_states, top_k_index, top_k_weights)): Mixtral, Qwen-MoE, DeepSeek ...
- a module with ``gate`` (a Linear to E logits), ``experts`` (a ModuleList/ModuleDict of E MLPs), ``top_k``
  (or ``num_experts_per_tok``/``experts_per_token``), whose forward maps x to a tensor of x's shape
  (meshplan's runtime MoE, most hand-written ones). Softmax router, top-k, weights renormalised.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

TOPK_ATTRS = ("top_k", "num_experts_per_tok", "experts_per_token", "k")


@dataclass(eq=False)
class MoeLayer:
    """One patched MoE module: what ingest/ops.py needs to describe its expert GEMMs."""

    name: str
    """Module path in the model."""
    module: nn.Module
    experts: int
    top_k: int = 0
    """Experts per token (seen when the module runs; 0 before)."""
    expert_params: dict[str, str] = field(default_factory=dict)
    """Name inside the MoE module -> slot: the same matrix of every expert shares a slot
    (``experts.3.w1.weight`` -> ``experts.*.w1.weight``; fused ``gate_up_proj`` is its own slot)."""


def _counts(pairs: int, experts: int) -> list[int]:
    base, extra = divmod(pairs, experts)
    return [base + (1 if e < extra else 0) for e in range(experts)]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    y = x @ w if transposed else F.linear(x, w)
    return y + b if b is not None else y


def fused_expert(m: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` (an index into the fused parameters' first dimension) of a transformers >= 5
    fused experts module ``m`` on the rows ``x``: transformers' own per-expert computation
    (``integrations.moe``: gate_up or up projection, its gate or activation, down projection,
    biases, transposed weights and the post-expert norm where the module has them)."""
    has_gate = bool(getattr(m, "has_gate", hasattr(m, "gate_up_proj")))
    has_bias = bool(getattr(m, "has_bias", False))
    transposed = bool(getattr(m, "is_transposed", False))
    w_in = m.gate_up_proj if has_gate else m.up_proj
    b_in = getattr(m, "gate_up_proj_bias" if has_gate else "up_proj_bias", None) if has_bias else None
    b_out = getattr(m, "down_proj_bias", None) if has_bias else None
    y = _linear(x, w_in[e], None if b_in is None else b_in[e], transposed)
    if has_gate:
        y = m._apply_gate(y) if hasattr(m, "_apply_gate") else _gate_act(m, y)
    else:
        y = m.act_fn(y)
    y = _linear(y, m.down_proj[e], None if b_out is None else b_out[e], transposed)
    if getattr(m, "has_post_expert_norm", False):
        y = m.post_expert_norm(y)
    return y


def _gate_act(m: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of a fused gate_up output (transformers' default gating)."""
    gate, up = y.chunk(2, dim=-1)
    return m.act_fn(gate) * up


def _uniform_fused(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    h = hidden_states.shape[-1]
    flat = hidden_states.reshape(-1, h)
    k, n_exp = top_k_index.shape[-1], int(self.num_experts)
    _seen(self, k)
    with routed():
        pairs = flat.repeat_interleave(k, dim=0)  # [tokens*k, h], token-major like top_k_index.reshape(-1)
        outs = [fused_expert(self, e, chunk) for e, chunk in enumerate(pairs.split(_counts(pairs.shape[0], n_exp)))
                if chunk.shape[0]]
        y = torch.cat(outs) * top_k_weights.reshape(-1, 1).to(flat.dtype)
    return y.view(flat.shape[0], k, -1).sum(dim=1).view(hidden_states.shape).to(hidden_states.dtype)


def _uniform_list(self: nn.Module, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    k = next(int(getattr(self, a)) for a in TOPK_ATTRS if isinstance(getattr(self, a, None), int))
    _seen(self, k)
    probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
    weights, _chosen = probs.topk(k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
    experts = list(self.experts.values() if isinstance(self.experts, nn.ModuleDict) else self.experts)
    with routed():
        pairs = flat.repeat_interleave(k, dim=0)
        outs = [expert(chunk) for expert, chunk in zip(experts, pairs.split(_counts(pairs.shape[0], len(experts))))
                if chunk.shape[0]]
        y = torch.cat(outs) * weights.reshape(-1, 1)
    return y.view(flat.shape[0], k, -1).sum(dim=1).view(shape)


_ACTIVE: dict[int, MoeLayer] = {}
_ROUTED = [0]


@contextlib.contextmanager
def routed() -> Iterator[None]:
    """While the token-expert pairs are dispatched, run by their experts and weighted for the
    combine: what autograd saves here is kept per pair on the expert's rank (LayerOps.saved_routed_*,
    the part of the activations expert parallelism's load imbalance scales: cost.moe)."""
    _ROUTED[0] += 1
    try:
        yield
    finally:
        _ROUTED[0] -= 1


def in_routed() -> bool:
    return _ROUTED[0] > 0


def _seen(m: nn.Module, k: int) -> None:
    rec = _ACTIVE.get(id(m))
    if rec is not None:
        rec.top_k = int(k)


def _expert_params(m: nn.Module, fused: bool) -> dict[str, str]:
    if fused:
        return {n: n for n, p in m.named_parameters(recurse=False) if p.dim() >= 2}
    out = {}
    for n, _p in m.experts.named_parameters():
        parts = n.split(".", 1)
        out[f"experts.{n}"] = f"experts.*.{parts[1]}" if len(parts) == 2 else f"experts.{n}"
    return out


def is_fused(m: nn.Module) -> bool:
    return (isinstance(getattr(m, "num_experts", None), int) and isinstance(getattr(m, "down_proj", None), nn.Parameter)
            and (isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)
                 or isinstance(getattr(m, "up_proj", None), nn.Parameter))
            and m.down_proj.dim() == 3)


def is_expert_list(m: nn.Module) -> bool:
    experts, gate = getattr(m, "experts", None), getattr(m, "gate", None)
    return (isinstance(experts, (nn.ModuleList, nn.ModuleDict)) and len(experts) > 1 and isinstance(gate, nn.Linear)
            and gate.out_features == len(experts)
            and any(isinstance(getattr(m, a, None), int) for a in TOPK_ATTRS))


@contextlib.contextmanager
def uniform_routing(model: nn.Module) -> Iterator[list[MoeLayer]]:
    """Patch every MoE layer of ``model`` for the duration; yields the patched layers."""
    patched: list[tuple[nn.Module, bool, object]] = []
    layers: list[MoeLayer] = []
    for name, m in model.named_modules():
        fused = is_fused(m)
        fn = _uniform_fused if fused else _uniform_list if is_expert_list(m) else None
        if fn is None:
            continue
        had = "forward" in vars(m)
        patched.append((m, had, vars(m).get("forward")))
        m.forward = types.MethodType(fn, m)
        n_exp = int(m.num_experts) if fused else len(m.experts)
        rec = MoeLayer(name=name, module=m, experts=n_exp, expert_params=_expert_params(m, fused))
        _ACTIVE[id(m)] = rec
        layers.append(rec)
    try:
        yield layers
    finally:
        for rec in layers:
            _ACTIVE.pop(id(rec.module), None)
        for m, had, old in patched:
            if had:
                m.forward = old
            else:
                del m.forward
