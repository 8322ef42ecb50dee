"""Context parallelism (cp > 1) for meshplan's models, on any device and backend (gloo included).

PyTorch's ``context_parallel`` rewrites the CUDA SDPA kernels (ring attention), so it does not
run on CPU; this is the all-gather variant Llama 3 trained with, written with stock autograd-aware
collectives (``torch.distributed._functional_collectives``):

- every sequence is cut into ``2 * cp`` chunks and cp rank ``r`` holds chunks ``r`` and
  ``2 * cp - 1 - r`` (load balance under the causal mask: each rank gets one early, one late chunk);
- positions are the global indices of the local tokens: the rotary tables and the learned
  position embedding are indexed with them;
- each block all-gathers K and V over the cp group (before the GQA head repeat; the backward
  is a reduce-scatter of their gradients), puts the chunks back in sequence order, and each
  local query chunk attends to the keys up to its own end with a bottom-right causal mask;
- a rank's loss is the mean over its tokens; all ranks hold equally many, so averaging losses
  and gradients over dp x cp gives the mean over the global batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global token indices held by cp rank ``rank``: chunks rank and 2cp-1-rank of 2cp."""
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def shard_sequence(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's two chunks of ``t`` [batch, seq, ...] along the sequence (dim 1)."""
    c = t.shape[1] // (2 * cp)
    return torch.cat([t[:, rank * c:(rank + 1) * c], t[:, (2 * cp - 1 - rank) * c:(2 * cp - rank) * c]], dim=1)


class ContextParallelAttention(nn.Module):
    """Drop-in for ``models.CoreAttention`` on a cp rank: inputs [batch, 2c, heads, head_dim]
    (the rank's two chunks), output [batch, 2c, heads * head_dim]."""

    def __init__(self, causal: bool, group: dist.ProcessGroup, cp: int, rank: int) -> None:
        super().__init__()
        self.causal, self.group, self.cp, self.rank = causal, group, cp, rank

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """[b, 2c, h, d] on every rank -> [b, 2c * cp, h, d] in sequence order."""
        b, two_c, h, d = t.shape
        g = funcol.all_gather_single(t.contiguous(), gather_dim=0, group=self.group)  # [cp * b, 2c, h, d]
        g = g.view(self.cp, b, 2, two_c // 2, h, d)
        early = g[:, :, 0].transpose(0, 1).reshape(b, -1, h, d)  # chunks 0 .. cp-1
        late = g[:, :, 1].flip(0).transpose(0, 1).reshape(b, -1, h, d)  # chunks cp .. 2cp-1
        return torch.cat([early, late], dim=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = q.shape[0], q.shape[1]
        c = s // 2
        k, v = self._gather(k), self._gather(v)
        q = q.transpose(1, 2)
        rep = q.shape[1] // k.shape[2]  # grouped-query attention; local heads under TP
        outs = []
        for half, chunk in enumerate((self.rank, 2 * self.cp - 1 - self.rank)):
            qc = q[:, :, half * c:(half + 1) * c]
            end = (chunk + 1) * c if self.causal else k.shape[1]
            kc, vc = (t[:, :end].transpose(1, 2) for t in (k, v))
            if rep > 1:
                kc, vc = kc.repeat_interleave(rep, dim=1), vc.repeat_interleave(rep, dim=1)
            mask = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(chunk * c) if self.causal else None
            outs.append(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask))
        return torch.cat(outs, dim=2).transpose(1, 2).reshape(b, s, -1)


def apply_cp(part: nn.Module, group: dist.ProcessGroup, cp: int, rank: int, seq_len: int,
             device: torch.device) -> None:
    """Make a model part (a ``models.Transformer`` or a pipeline stage of one) run on this
    rank's chunks: global positions for rotary tables and learned positions, all-gather attention."""
    pos = local_positions(seq_len, cp, rank, device)
    for name in ("rope_cos", "rope_sin"):  # per-rank tables: plain attributes, so that no wrapper
        table = getattr(part, name)[pos]    # (DDP) overwrites them with rank 0's buffers
        del part._buffers[name]
        setattr(part, name, table)
    if part.embed is not None:
        part.embed.positions = pos
    for block in part.layers.values():
        attn = block.attention
        attn.core = ContextParallelAttention(attn.core.causal, group, cp, rank)
