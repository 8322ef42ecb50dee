"""A model whose forward is *not* a plain sequence of its units: the stem's output skips over the
blocks to the head (``module:skip_net:make_skip_net``). The runtime must refuse to pipeline it."""
from __future__ import annotations

import torch
from torch import nn


class SkipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = skip = self.stem(x)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h + skip)


def make_skip_net() -> SkipNet:
    return SkipNet()


def example_inputs(batch_size: int, seq_len: int | None = None) -> torch.Tensor:
    return torch.randn(batch_size, 8)
