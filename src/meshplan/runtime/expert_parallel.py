"""Expert parallelism (ep > 1) for ``models.MoE``: experts sharded over an ep group, tokens
dispatched with all-to-all and combined back.

As in Megatron and torchtitan, the ep group is carved out of the data-parallel ranks: the
innermost ``ep`` ranks of dp x cp (the planner's ``ep`` divides ``dp * cp``; with tp, the members
of a group have the same tp rank and TP still splits each expert). A rank keeps experts
``[i * E/ep, (i+1) * E/ep)`` for its ep index i, under their global names (checkpoints reshard).

Per MoE layer: route locally, sort token copies by expert, exchange per-expert counts
(all_to_all_single of E integers), send each expert's rows to its owner (autograd-aware
``funcol.all_to_all_single``: the backward sends the gradients back), run each local expert once
on the rows from all sources, send the outputs back, weight and sum per token in expert order
(the same order as the single-process model, so results agree to rounding).

Gradients: an expert's gradient already sums the contributions of the ep group's tokens; it is
then reduced over the other ``dp * cp / ep`` ranks (the expert's replicas) and divided by ``dp * cp``,
like the dense gradients, which are reduced over all of dp x cp.

Ingested models (runtime/generic.py, ``shard_ingested``): the same exchange (``exchange``) on the
MoE modules ingestion recognises (ingest/moe.py):

- transformers >= 5 fused experts (Mixtral, Qwen-MoE, Qwen3-MoE, DeepSeek-V2/V3 ...: ``gate_up_proj``
  / ``up_proj`` and ``down_proj`` as [E, out, in] parameters, called with the router's
  ``(hidden_states, top_k_index, top_k_weights)``): the model's own router, shared experts and
  their gates run unchanged on every rank (replicated, like any dense layer; DeepSeek's
  group-limited and biased routing included); the experts module keeps rows
  ``[i * E/ep, (i+1) * E/ep)`` of its fused parameters and its forward becomes the exchange, each
  local expert computed as transformers computes it (``ingest.moe.fused_expert``). Under TP the
  fused experts stay whole on every TP rank (the TP ranks of an ep group hold the same tokens);
- a module with ``gate`` (a Linear to E logits), ``experts`` (a ModuleList/ModuleDict of E MLPs)
  and ``top_k``: its forward becomes the softmax top-k router with the weights renormalised
  (``models.MoE``'s), after checking on a random input that it gives what the module's own forward
  gives (else refused); the experts container keeps this rank's experts under their global keys.
  Under TP their Linear layers are split as ingest/tp.py pairs them (as for the presets' experts).
"""
from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from meshplan.runtime.models import MoE


class ExpertParallelMoE(MoE):
    """A ``MoE`` holding only this ep rank's experts; ``dispatch`` exchanges tokens."""

    group: dist.ProcessGroup
    ep: int

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return exchange(rows, counts, self.group, self.ep, self.experts)


def exchange(rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, ep: int,
             run: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> torch.Tensor:
    """Expert outputs for ``rows`` (this rank's token copies sorted by global expert, ``counts[e]``
    rows each): the rows go to their expert's owner (experts ``[i * E/ep, (i+1) * E/ep)`` on ep rank
    i), ``run`` computes each local expert once on its rows from every source (a list per local
    expert, in order; it also runs on empty ones), and the outputs come back in ``rows``' order.
    Both all-to-alls are autograd-aware (the backward sends the gradients back)."""
    local = counts.numel() // ep
    recv_counts = torch.empty_like(counts)  # [source, local expert] rows this rank receives
    dist.all_to_all_single(recv_counts, counts, group=group)
    send_splits = counts.view(ep, local).sum(1).tolist()
    per_source = recv_counts.view(ep, local)
    recv_splits = per_source.sum(1).tolist()
    recv = funcol.all_to_all_single(rows.contiguous(), recv_splits, send_splits, group)
    # received rows are grouped by source, then expert: regroup by expert (stable: source order)
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep),
                                            per_source.reshape(-1))
    perm = torch.argsort(expert_of_row, stable=True)
    ys = torch.cat(run(list(recv[perm].split(per_source.sum(0).tolist()))))
    back = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return funcol.all_to_all_single(ys[back].contiguous(), send_splits, recv_splits, group)


def local_expert_ids(num_experts: int, ep: int, ep_rank: int) -> list[int]:
    per = num_experts // ep
    return list(range(ep_rank * per, (ep_rank + 1) * per))


def shard_experts(moe: MoE, group: dist.ProcessGroup, ep: int, ep_rank: int) -> None:
    """Turn ``moe`` (all experts, same weights on every rank) into this rank's ExpertParallelMoE."""
    keep = {str(e) for e in local_expert_ids(moe.num_experts, ep, ep_rank)}
    for name in list(moe.experts.keys()):
        if name not in keep:
            del moe.experts[name]
    moe.__class__ = ExpertParallelMoE
    moe.group, moe.ep = group, ep  # type: ignore[attr-defined]
    moe.experts.meshplan_ep = True  # type: ignore[assignment]  (parallelize.apply_fsdp: its own mesh)


def is_expert_param(name: str) -> bool:
    return ".experts." in name


# ---- ingested models ------------------------------------------------------------------------------
FUSED, LIST = "fused", "list"


def find_moe(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, module, kind) of every MoE module ingestion recognises in ``model`` (ingest/moe.py):
    kind ``FUSED`` (a transformers fused experts module) or ``LIST`` (gate + experts list + top_k)."""
    from meshplan.ingest.moe import is_expert_list, is_fused
    out = []
    for name, m in model.named_modules():
        if is_fused(m):
            out.append((name, m, FUSED))
        elif is_expert_list(m):
            out.append((name, m, LIST))
    return out


def num_experts(m: nn.Module, kind: str) -> int:
    return int(m.num_experts) if kind == FUSED else len(m.experts)  # type: ignore[arg-type]


def ep_refusal(model: nn.Module, name: str, ep: int) -> str | None:
    """Why ``model`` cannot run under ``ep`` (None: it can): it has no experts the runtime
    recognises, ep does not divide a layer's experts, or a parameter under an ``experts`` name
    belongs to no recognised MoE module (it would be taken for an expert's)."""
    if ep == 1:
        return None
    found = find_moe(model)
    if not found:
        return (f"plan: ep={ep} but {name} has no experts this runtime splits (transformers fused experts, or a "
                "module with gate, an experts ModuleList and top_k: docs/ingest.md)")
    for path, m, kind in found:
        n = num_experts(m, kind)
        if n % ep:
            return f"plan: ep={ep} does not divide the {n} experts of {name}'s {path or 'root'}"
    owned = {id(p) for _, m, _ in found for p in m.parameters()}
    stray = next((n for n, p in model.named_parameters() if is_expert_param(n) and id(p) not in owned), None)
    if stray is not None:
        return (f"plan: ep={ep}: {name}'s parameter {stray} is under an 'experts' name but in no MoE module "
                "this runtime splits")
    return None


def _top_k(m: nn.Module) -> int:
    from meshplan.ingest.moe import TOPK_ATTRS
    return next(int(getattr(m, a)) for a in TOPK_ATTRS if isinstance(getattr(m, a, None), int))


def _combine(flat: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n_experts: int,
             run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The token copies sorted by expert (stable), ``run(rows, counts)`` their outputs, weighted and
    summed per token in expert order (the order transformers' loop over experts adds them in)."""
    k = top_k_index.shape[-1]
    choice = top_k_index.reshape(-1)  # copy a = token * k + slot
    order = torch.argsort(choice, stable=True)
    token = order // k
    counts = torch.bincount(choice, minlength=n_experts)
    y = run(flat[token], counts) * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(flat).index_add(0, token, y.to(flat.dtype))


def _fused_runner(m: nn.Module) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    from meshplan.ingest.moe import fused_expert
    return lambda xs: [fused_expert(m, i, x) for i, x in enumerate(xs)]


def _rows_runner(m: nn.Module, run: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Any:
    ep, group = getattr(m, "meshplan_ep_size", 1), getattr(m, "meshplan_ep_group", None)
    if ep == 1:
        return lambda rows, counts: torch.cat(run(list(rows.split(counts.tolist()))))
    return lambda rows, counts: exchange(rows, counts, group, ep, run)


def fused_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A transformers fused experts module's forward with its experts spread over the ep group."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = _combine(flat, top_k_index, top_k_weights, self.meshplan_experts,
                   _rows_runner(self, _fused_runner(self)))
    return out.view(hidden_states.shape)


def list_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A gate + experts + top_k module's forward: softmax router, top-k, weights renormalised
    (models.MoE's), the experts spread over the ep group."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    fp64 = flat.dtype == torch.float64
    probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float64 if fp64 else torch.float32)
    weights, chosen = probs.topk(_top_k(self), dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
    experts = list(self.experts.values() if isinstance(self.experts, nn.ModuleDict) else self.experts)
    run = _rows_runner(self, lambda xs: [e(r) for e, r in zip(experts, xs)])
    return _combine(flat, chosen, weights, self.meshplan_experts, run).view(shape)


def list_mismatch(m: nn.Module, path: str) -> str | None:
    """Why ``list_forward`` is not ``m``'s own routing (None: it gives what m's forward gives on a
    random input, to 1e-5 relative), checked with every expert present."""
    h = m.gate.in_features
    p = next(m.parameters())
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        x = torch.randn(2, 8, h, dtype=p.dtype, device=p.device)
        try:
            want = m(x)
        except Exception as e:  # noqa: BLE001 - user code: any failure is one line
            return f"{path}'s forward failed on a [2, 8, {h}] input ({type(e).__name__})"
        m.meshplan_experts = len(m.experts)
        got = list_forward(m, x)
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return f"{path}'s forward returns {type(want).__name__}, not a tensor of its input's shape"
    err = float((got - want).norm() / want.norm().clamp_min(1e-12))
    if err > 1e-5:
        return (f"{path}'s routing is not softmax top-{_top_k(m)} with renormalised weights (relative difference "
                f"{err:.1e} on a random input)")
    return None


def shard_ingested(model: nn.Module, name: str, group: dist.ProcessGroup, ep: int,
                   ep_rank: int) -> dict[str, tuple[int, int]]:
    """Expert parallelism on an ingested model (all experts, the same weights on every rank): each
    recognised MoE module keeps this rank's experts and exchanges tokens with all-to-all. Returns
    the fused parameters kept in part, by name in the model -> (rows of the whole, first row kept):
    ``TrainModel.expert_rows`` (a list module's experts keep their own names). Raises
    MeshplanError for a model it cannot split (``ep_refusal``, a list module whose routing is not
    the standard one)."""
    from meshplan.errors import MeshplanError
    why = ep_refusal(model, name, ep)
    if why:
        raise MeshplanError(why, hint="use ep=1")
    found = find_moe(model)
    for path, m, kind in found:
        if kind == LIST:
            why = list_mismatch(m, path)
            if why:
                raise MeshplanError(f"plan: ep={ep}: {why}", hint="use ep=1 for this model")
    rows: dict[str, tuple[int, int]] = {}
    for path, m, kind in found:
        n = num_experts(m, kind)
        keep = local_expert_ids(n, ep, ep_rank)
        m.meshplan_experts, m.meshplan_ep_size, m.meshplan_ep_group = n, ep, group
        if kind == FUSED:
            lo, hi = keep[0], keep[-1] + 1
            for pname, p in list(m.named_parameters(recurse=False)):
                if p.dim() >= 1 and p.shape[0] == n:
                    setattr(m, pname, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
                    rows[f"{path}.{pname}" if path else pname] = (n, lo)
            m.forward = types.MethodType(fused_forward, m)
            m.meshplan_ep = True
        else:
            items = list(m.experts.items()) if isinstance(m.experts, nn.ModuleDict) \
                else [(str(i), e) for i, e in enumerate(m.experts)]
            m.experts = nn.ModuleDict({k: e for i, (k, e) in enumerate(items) if i in keep})
            m.experts.meshplan_ep = True
            m.forward = types.MethodType(list_forward, m)
    return rows
