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
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from meshplan.runtime.models import MoE


class ExpertParallelMoE(MoE):
    """A ``MoE`` holding only this ep rank's experts; ``dispatch`` exchanges tokens."""

    group: dist.ProcessGroup
    ep: int

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, len(self.experts)
        recv_counts = torch.empty_like(counts)  # [source, local expert] rows this rank receives
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_splits = counts.view(ep, local).sum(1).tolist()
        per_source = recv_counts.view(ep, local)
        recv_splits = per_source.sum(1).tolist()
        recv = funcol.all_to_all_single(rows.contiguous(), recv_splits, send_splits, self.group)
        # received rows are grouped by source, then expert: regroup by expert (stable: source order)
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep),
                                                per_source.reshape(-1))
        perm = torch.argsort(expert_of_row, stable=True)
        ys = torch.cat(self.experts(list(recv[perm].split(per_source.sum(0).tolist()))))
        back = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
        return funcol.all_to_all_single(ys[back].contiguous(), send_splits, recv_splits, self.group)


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


def is_expert_param(name: str) -> bool:
    return ".experts." in name
