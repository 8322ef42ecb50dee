"""A small mixture-of-experts language model written as a plain nn.Module, for meshplan's
expert-parallel tests (random init): ``module:list_moe:make_list_moe`` with ``tests/data/modules``
on PYTHONPATH.

Token embedding, pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm ->
MoE -> residual), a final LayerNorm and an LM head. The MoE is the hand-written kind ingestion and
the runtime's expert parallelism recognise (ingest/moe.py): ``gate`` (a Linear to E logits),
``experts`` (an ``nn.ModuleList`` of E MLPs) and ``top_k``; its forward loops over the experts with
``nonzero`` masks (softmax router, top-k, weights renormalised), as hand-written MoEs do. Linear
layers are named as ingest/tp.py pairs them (q/k/v/o projections; each expert's fc1/fc2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TASK = "causal-lm"
VOCAB, DIM, HEADS, LAYERS, EXPERTS, TOP_K, FFN, SEQ = 256, 32, 4, 2, 4, 2, 48, 16


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


class MoE(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, hidden: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = Attention(DIM, HEADS)
        self.norm2 = nn.LayerNorm(DIM)
        self.moe = MoE(DIM, EXPERTS, TOP_K, FFN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class ListMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def make_list_moe() -> ListMoE:
    return ListMoE()


def example_inputs(batch_size: int, seq_len: int | None = None) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, seq_len or SEQ))


def loss(outputs: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy."""
    return F.cross_entropy(outputs[:, :-1].reshape(-1, VOCAB).float(), input_ids[:, 1:].reshape(-1))
