"""Wide residual networks (Zagoruyko and Komodakis, "Wide Residual Networks", 2016) for meshplan's
tensor-parallel convolutions (issue 29), built from code (no downloaded weights, random init), with
``tests/data/modules`` on PYTHONPATH. Every block is the paper's pre-activation basic block
(BatchNorm, ReLU, 3x3 convolution, BatchNorm, ReLU, dropout, 3x3 convolution, plus the input, or its
1x1 projection taken after the first activation where the shape changes); the blocks are one
``nn.ModuleList``.

- ``module:wide_resnet:make_wide_resnet``: WRN-18-24 for 224x224 images (ResNet-18's layout: a 7x7
  stride-2 convolution to 64 channels, BatchNorm, ReLU, 3x3 max-pool, four groups of two blocks of
  64k, 128k, 256k, 512k channels with strides 1, 2, 2, 2; BatchNorm, ReLU, global pooling, a linear
  head to 1000 classes) at width factor k = 24: 6.42B parameters, 2.72B of them in the last block
  (two 3x3 convolutions of 12288 channels). ``width_factor`` sets k.
- ``module:wide_resnet:make_wrn_tiny``: the paper's CIFAR network WRN-10-2 (a 3x3 convolution to 16
  channels, three groups of one block of 32, 64, 128 channels, strides 1, 2, 2) on 16x16 images, 10
  classes, dropout 0: trains on a CPU in seconds.

Under tensor parallelism meshplan splits each block's two 3x3 convolutions as a column -> row pair,
the BatchNorm between them on channels (ingest/tp.py); the shortcut projections stay whole. The loss
is cross-entropy against a label computed from the image (the sign of its mean), as resnet50.py's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TASK = "classification"
WIDTH_FACTOR = 24
"""k of ``make_wide_resnet``: its last block holds 18 (512 k)^2 parameters (2.72B at k = 24)."""


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
    """A Wide-ResNet of pre-activation basic blocks: ``widths`` channels per group, ``blocks`` per
    group; ``imagenet``: a 7x7 stride-2 stem to 64 channels with BatchNorm, ReLU and a 3x3 max-pool,
    else a 3x3 stem to 16 channels (CIFAR)."""

    def __init__(self, widths: tuple[int, ...], blocks: int, image_size: int, num_classes: int, *,
                 imagenet: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.image_size = image_size
        if imagenet:
            stem = 64
            self.stem = nn.Sequential(nn.Conv2d(3, stem, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(stem),
                                      nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        else:
            stem = 16
            self.stem = nn.Conv2d(3, stem, 3, padding=1, bias=False)
        layers, cin = [], stem
        for g, width in enumerate(widths):
            for i in range(blocks):
                layers.append(PreActBlock(cin, width, 2 if (i == 0 and g > 0) else 1, dropout))
                cin = width
        self.blocks = nn.ModuleList(layers)
        self.head = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(cin, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def example_inputs(self, batch_size: int, seq_len: int | None = None) -> torch.Tensor:
        return torch.randn(batch_size, 3, self.image_size, self.image_size)


def make_wide_resnet(width_factor: int = WIDTH_FACTOR, image_size: int = 224, num_classes: int = 1000) -> WideResNet:
    """WRN-18-k for ImageNet-sized images (k = 24: 6.42B parameters, a 2.72B-parameter last block)."""
    k = width_factor
    return WideResNet((64 * k, 128 * k, 256 * k, 512 * k), 2, image_size, num_classes, imagenet=True)


def make_wrn_tiny() -> WideResNet:
    """WRN-10-2 on 16x16 images, 10 classes, no dropout."""
    return WideResNet((32, 64, 128), 1, 16, 10, imagenet=False)


def loss(outputs: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    return F.cross_entropy(outputs.float(), labels)
