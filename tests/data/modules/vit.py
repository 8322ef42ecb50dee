"""A vision transformer written as an nn.Module, for meshplan's ingestion and runtime tests (no
downloaded weights, random init): ``module:vit:make_vit`` (ViT-B/16: 224x224 images, 16x16
patches, width 768, 12 blocks of 12 heads, MLP 3072, 1000 classes, 86.6M parameters) or
``module:vit:make_vit_tiny`` (16x16 images, 4x4 patches, width 32, 4 blocks of 4 heads, 10
classes: trains on a CPU in seconds), with ``tests/data/modules`` on PYTHONPATH.

The structure is Dosovitskiy et al.'s: a patch embedding (a convolution with stride = kernel =
patch, a class token prepended, learned positions added), pre-norm encoder blocks (LayerNorm ->
multi-head self-attention -> residual, LayerNorm -> MLP with GELU -> residual), a final LayerNorm
and a linear head on the class token. The blocks are one ``nn.ModuleList`` (``layers``): ingestion's
units are ``embed``, the blocks (kind "block"), ``norm`` and ``head``, and the forward is a plain
sequence of them (the runtime may pipeline it; ``[:, 0]`` runs between ``norm`` and ``head``).

Tensor parallelism: the linear layers are named as ``ingest/tp.py`` recognises them: attention
``q_proj``/``k_proj``/``v_proj`` (column) closed by ``o_proj`` (row), MLP ``fc1`` (column) closed
by ``fc2`` (row). The attention reshapes with ``-1`` heads and a fixed ``head_dim``, so a
column-split projection (``num_heads / tp`` heads per rank) runs unchanged; ``num_heads`` is the
attribute the runtime divides by tp.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TASK = "classification"


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, image_size: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image_size // patch) ** 2 + 1, dim))
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)  # [b, patches, dim]
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed


class ViT(nn.Module):
    def __init__(self, image_size: int = 224, patch: int = 16, dim: int = 768, depth: int = 12,
                 num_heads: int = 12, mlp: int = 3072, num_classes: int = 1000) -> None:
        super().__init__()
        self.image_size = image_size
        self.SAMPLE_TOKENS = (image_size // patch) ** 2 + 1  # tokens per image (tokens/s in the metrics)
        self.embed = PatchEmbed(image_size, patch, dim)
        self.layers = nn.ModuleList(Block(dim, num_heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        for block in self.layers:
            x = block(x)
        x = self.norm(x)
        return self.head(x[:, 0])

    def example_inputs(self, batch_size: int, seq_len: int | None = None) -> torch.Tensor:
        return torch.randn(batch_size, 3, self.image_size, self.image_size)


def make_vit() -> ViT:
    """ViT-B/16 (86.6M parameters)."""
    return ViT()


def make_vit_tiny() -> ViT:
    """4 blocks, width 32, 4 heads, MLP 64, 16x16 images of 4x4 patches (17 tokens), 10 classes."""
    return ViT(image_size=16, patch=4, dim=32, depth=4, num_heads=4, mlp=64, num_classes=10)


def loss(outputs: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    return F.cross_entropy(outputs.float(), labels)
