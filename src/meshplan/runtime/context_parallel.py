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

Bucket plans (``Plan.buckets``, spec/buckets.py) switch context parallelism per micro-batch:
``apply_bucket_cp`` keeps the whole rotary tables and puts a ``BucketAttention`` in every block,
plain attention until ``bucket_sequence`` sets a micro-batch's cp degree, its unit's process group,
this rank's index in the unit and the micro-batch's width (the positions of this rank's two chunks
at that width), for that micro-batch's forward and backward.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from meshplan.runtime.models import CoreAttention


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global token indices held by cp rank ``rank``: chunks rank and 2cp-1-rank of 2cp."""
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def shard_sequence(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's two chunks of ``t`` [batch, seq, ...] along the sequence (dim 1)."""
    c = t.shape[1] // (2 * cp)
    return torch.cat([t[:, rank * c:(rank + 1) * c], t[:, (2 * cp - 1 - rank) * c:(2 * cp - rank) * c]], dim=1)


def gather_chunks(t: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """[b, 2c, h, d] on every rank of ``group`` -> [b, 2c * cp, h, d] in sequence order."""
    b, two_c, h, d = t.shape
    g = funcol.all_gather_single(t.contiguous(), gather_dim=0, group=group)  # [cp * b, 2c, h, d]
    g = g.view(cp, b, 2, two_c // 2, h, d)
    early = g[:, :, 0].transpose(0, 1).reshape(b, -1, h, d)  # chunks 0 .. cp-1
    late = g[:, :, 1].flip(0).transpose(0, 1).reshape(b, -1, h, d)  # chunks cp .. 2cp-1
    return torch.cat([early, late], dim=1)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, group: dist.ProcessGroup,
                 cp: int, rank: int) -> torch.Tensor:
    """All-gather attention of cp rank ``rank``: q, k, v [batch, 2c, heads, head_dim] (its two
    chunks), output [batch, 2c, heads * head_dim]."""
    b, s = q.shape[0], q.shape[1]
    c = s // 2
    k, v = gather_chunks(k, group, cp), gather_chunks(v, group, cp)
    q = q.transpose(1, 2)
    rep = q.shape[1] // k.shape[2]  # grouped-query attention; local heads under TP
    outs = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        qc = q[:, :, half * c:(half + 1) * c]
        end = (chunk + 1) * c if causal else k.shape[1]
        kc, vc = (t[:, :end].transpose(1, 2) for t in (k, v))
        if rep > 1:
            kc, vc = kc.repeat_interleave(rep, dim=1), vc.repeat_interleave(rep, dim=1)
        mask = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(chunk * c) if causal else None
        outs.append(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask))
    return torch.cat(outs, dim=2).transpose(1, 2).reshape(b, s, -1)


class ContextParallelAttention(nn.Module):
    """Drop-in for ``models.CoreAttention`` on a cp rank: inputs [batch, 2c, heads, head_dim]
    (the rank's two chunks), output [batch, 2c, heads * head_dim] (``cp_attention``)."""

    def __init__(self, causal: bool, group: dist.ProcessGroup, cp: int, rank: int) -> None:
        super().__init__()
        self.causal, self.group, self.cp, self.rank = causal, group, cp, rank

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_attention(q, k, v, causal=self.causal, group=self.group, cp=self.cp, rank=self.rank)


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


class BucketAttention(nn.Module):
    """Core attention of a bucket plan's block: ``models.CoreAttention`` over the whole sequence
    (a cp 1 micro-batch), or, while ``unit`` is set (``bucket_sequence``: (group, cp, rank)), the
    all-gather attention ``cp_attention`` over that unit's group. The module tree (what DDP and
    FSDP saw) does not change between micro-batches."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.plain = CoreAttention(causal)
        self.causal = causal
        self.unit: tuple[dist.ProcessGroup, int, int] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.unit is None:
            return self.plain(q, k, v)
        group, cp, rank = self.unit
        return cp_attention(q, k, v, causal=self.causal, group=group, cp=cp, rank=rank)


def apply_bucket_cp(part: nn.Module) -> None:
    """Make a model part switchable between plain and context-parallel attention per micro-batch
    (bucket plans): the rotary tables become plain attributes (the whole tables, kept as
    ``rope_full``: DDP leaves plain attributes alone), every block's core attention a
    ``BucketAttention``."""
    full = tuple(getattr(part, name) for name in ("rope_cos", "rope_sin"))
    for name, table in zip(("rope_cos", "rope_sin"), full):
        del part._buffers[name]
        setattr(part, name, table)
    part.rope_full = full
    part.bucket_cores = []
    for block in part.layers.values():
        attn = block.attention
        attn.core = BucketAttention(attn.core.causal)
        part.bucket_cores.append(attn.core)


@contextlib.contextmanager
def bucket_sequence(part: nn.Module, group: dist.ProcessGroup | None, cp: int, rank: int, width: int,
                    device: torch.device | None = None) -> Iterator[None]:
    """One micro-batch of a bucket plan on ``part`` (``apply_bucket_cp``), its forward and its
    backward inside (a recomputed block replays its forward): cp 1 runs the whole sequence with
    positions 0..width-1; cp > 1 this rank's chunks ``rank`` and ``2cp-1-rank`` of ``2cp`` at
    ``width`` (a multiple of 2cp), with their global positions and K/V all-gathered over ``group``.
    Plain attention and the whole tables again on exit."""
    if cp > 1:
        assert group is not None and width % (2 * cp) == 0, (cp, width)
        pos = local_positions(width, cp, rank, device)
        part.rope_cos, part.rope_sin = (t[pos] for t in part.rope_full)
        if part.embed is not None:
            part.embed.positions = pos
        for core in part.bucket_cores:
            core.unit = (group, cp, rank)
    try:
        yield
    finally:
        part.rope_cos, part.rope_sin = part.rope_full
        if part.embed is not None:
            part.embed.positions = None
        for core in part.bucket_cores:
            core.unit = None
