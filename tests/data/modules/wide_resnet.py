"""Wide residual networks for meshplan's tensor-parallel convolutions (issue 29), built from code
(no downloaded weights, random init), with ``tests/data/modules`` on PYTHONPATH:

- ``module:wide_resnet:make_wide_resnet`` (WRN-50-21): ResNet-50's bottleneck layout
  (resnet50.py: a stem, [3, 4, 6, 3] bottlenecks, a linear head) with every channel count
  multiplied by a width factor k = 21 (stem 1344 channels, the last stage's blocks 10752 -> 43008),
  224x224 images, 1000 classes: 10.4B parameters, of which 2.66B in the first block of the last
  stage (its 3x3 convolution alone 1.04B). The factory takes ``width_factor`` (k) for other sizes.
- ``module:wide_resnet:make_wrn_tiny``: Zagoruyko and Komodakis' CIFAR Wide-ResNet (WRN-d-k,
  "Wide Residual Networks", 2016) at depth 10, k = 2: a 3x3 stem convolution to 16 channels, three
  groups of one pre-activation basic block (BatchNorm, ReLU, 3x3 convolution, BatchNorm, ReLU,
  dropout, 3x3 convolution; a 1x1 projection shortcut where the shape changes) of 32, 64 and 128
  channels (strides 1, 2, 2), BatchNorm, ReLU, global pooling and a linear head; 16x16 images, 10
  classes, dropout 0 (trains on a CPU in seconds). The blocks are one ``nn.ModuleList``.

Under tensor parallelism meshplan splits each block's first and second 3x3 convolutions as a
column -> row pair, with the BatchNorm between them split on channels (ingest/tp.py). The loss is
cross-entropy against a label computed from the image (the sign of its mean), as resnet50.py's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from resnet50 import ResNet50
from torch import nn

TASK = "classification"
WIDTH_FACTOR = 21
"""k of ``make_wide_resnet``: the last stage's first block holds 6,029,312 k^2 parameters (2.66B)."""


def make_wide_resnet(width_factor: int = WIDTH_FACTOR, image_size: int = 224, num_classes: int = 1000) -> ResNet50:
    """WRN-50-k: ResNet-50 with every channel count multiplied by ``width_factor``."""
    return ResNet50(width=64 * width_factor, image_size=image_size, num_classes=num_classes)


class PreActBlock(nn.Module):
    """A Wide-ResNet basic block (pre-activation): BN-ReLU-conv3x3-BN-ReLU-dropout-conv3x3 plus the
    input (or its 1x1 projection, taken from the first activation, where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.relu1(self.bn1(x))
        out = self.conv2(self.dropout(self.relu2(self.bn2(self.conv1(a)))))
        return out + (x if self.shortcut is None else self.shortcut(a))


class WideResNet(nn.Module):
    """WRN-d-k for small images: d = 6 n + 4 (n blocks per group), groups of 16k, 32k, 64k channels."""

    def __init__(self, depth: int = 10, k: int = 2, image_size: int = 16, num_classes: int = 10,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WRN depth must be 6n+4, got {depth}")
        n = (depth - 4) // 6
        self.image_size = image_size
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        blocks, cin = [], 16
        for g, width in enumerate((16 * k, 32 * k, 64 * k)):
            for i in range(n):
                blocks.append(PreActBlock(cin, width, 2 if (i == 0 and g > 0) else 1, dropout))
                cin = width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(cin, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def example_inputs(self, batch_size: int, seq_len: int | None = None) -> torch.Tensor:
        return torch.randn(batch_size, 3, self.image_size, self.image_size)


def make_wrn_tiny() -> WideResNet:
    """WRN-10-2 on 16x16 images, 10 classes, no dropout."""
    return WideResNet(depth=10, k=2, image_size=16, num_classes=10)


def loss(outputs: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    return F.cross_entropy(outputs.float(), labels)
