"""ResNet-50 built from code, for meshplan's ingestion and runtime tests (no downloaded weights,
random init): ``module:resnet50:make_resnet50`` (the real size: width 64, 224x224 images, 1000
classes, 25.6M parameters) or ``module:resnet50:make_resnet50_tiny`` (the same structure at width 8
on 64x64 images, 10 classes: trains on a CPU in seconds; the last stage is 2x2, so BatchNorm sees
more than one value per channel even at batch 1), with ``tests/data/modules`` on PYTHONPATH.

The structure is He et al.'s (and torchvision's ``resnet50``): a stem (7x7 convolution, stride 2,
BatchNorm, ReLU, 3x3 max-pool), 16 bottleneck blocks in four stages of [3, 4, 6, 3] (1x1 -> 3x3 ->
1x1 convolutions, expansion 4, BatchNorm after each, a projection shortcut in each stage's first
block, stride 2 in the 3x3 convolution of stages 2-4) and a head (global average pool, linear).
The blocks are one ``nn.ModuleList`` (``blocks``), so ingestion's units are ``stem``, the 16
bottlenecks (the layers of kind "block") and ``fc``, and the forward is a plain sequence of them
(the runtime may pipeline it).

BatchNorm in training mode normalises with the statistics of the micro-batch it sees: a
data-parallel rank's rows, a pipeline micro-batch. A single-process run matches a distributed one
when it runs the same micro-batches (the runtime's gradient accumulation). ``zero_init_residual``
(torchvision's option; Goyal et al., "Accurate, Large Minibatch SGD") starts the last BatchNorm of
every residual branch at zero, so each block starts as the identity: the tiny model uses it. Without
it, 16 blocks normalising 2x2 maps of one image (the last stage at micro-batch 1) start with gradient
norms near 2000, where fp32 rounding is amplified far past 1e-5 in a few steps; with it, about 7. The loss is
cross-entropy against a label computed from the image (the sign of its mean), so the model has
something to learn and the runtime hands the loss the images (one tensor).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TASK = "classification"
STAGES = (3, 4, 6, 3)
EXPANSION = 4


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * EXPANSION
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self, width: int = 64, image_size: int = 224, num_classes: int = 1000,
                 zero_init_residual: bool = False) -> None:
        super().__init__()
        self.image_size = image_size
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        blocks, cin = [], width
        for stage, n in enumerate(STAGES):
            w = width * 2 ** stage
            for i in range(n):
                blocks.append(Bottleneck(cin, w, 2 if (i == 0 and stage > 0) else 1))
                cin = w * EXPANSION
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:
            for b in self.blocks:
                nn.init.zeros_(b.bn3.weight)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)

    def example_inputs(self, batch_size: int, seq_len: int | None = None) -> torch.Tensor:
        return torch.randn(batch_size, 3, self.image_size, self.image_size)


def make_resnet50(width: int = 64, image_size: int = 224, num_classes: int = 1000,
                  zero_init_residual: bool = False) -> ResNet50:
    """ResNet-50 (width 64: 25.6M parameters at 1000 classes)."""
    return ResNet50(width, image_size, num_classes, zero_init_residual)


def make_resnet50_tiny() -> ResNet50:
    """The same 50 layers at width 8 (channels 8..256) on 64x64 images, 10 classes, residual
    branches starting at zero (``zero_init_residual``)."""
    return ResNet50(width=8, image_size=64, num_classes=10, zero_init_residual=True)


def loss(outputs: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    return F.cross_entropy(outputs.float(), labels)
