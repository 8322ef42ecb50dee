"""A small CNN for meshplan's ingestion and runtime tests: ``module:small_cnn:make_cnn`` with
``tests/data/modules`` on PYTHONPATH.

A root ``nn.Sequential`` of conv blocks and a head, so its units (ingest.layers) are the children
and its forward is a plain sequence of them (the runtime may pipeline it). GroupNorm, not
BatchNorm: batch statistics would differ between a data-parallel rank's rows and the whole batch.
The loss is cross-entropy against a label computed from the image (the sign of its mean), so the
model has something to learn and the runtime hands the loss the images (one tensor).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TASK = "classification"
IMAGE = 32
CLASSES = 10


def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.GroupNorm(4, cout), nn.ReLU())


def make_cnn() -> nn.Sequential:
    """Four conv blocks (32x32 -> 8x8) and a pooled linear head."""
    return nn.Sequential(_block(3, 16, 1), _block(16, 32, 2), _block(32, 32, 1), _block(32, 64, 2),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES)))


def example_inputs(batch_size: int, seq_len: int | None = None) -> torch.Tensor:
    return torch.randn(batch_size, 3, IMAGE, IMAGE)


def loss(outputs: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()
    return F.cross_entropy(outputs.float(), labels)
