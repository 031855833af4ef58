"""Convolutional models for the benchmarks, written out (no torchvision dependency).

* :func:`resnet18`: He et al.'s ResNet-18 for 224x224 ImageNet images (11,689,512
  parameters at ``width = 64`` and 1000 classes, the torchvision layout);
* :func:`small_resnet`: three BasicBlocks on 32x32-or-smaller images, the K-FAC step benchmark.
"""

from __future__ import annotations

import torch
from torch import nn

RESNET18_PARAMETERS = 11_689_512


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, and a 1x1 projection on the shortcut when the
    stride or the channel count changes."""

    def __init__(self, channels_in: int, channels_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out))
            if stride != 1 or channels_in != channels_out else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def small_resnet(width: int) -> nn.Module:
    """A 3x3 stem, three BasicBlocks (``width``, ``2 width``, ``4 width`` channels), 10 classes."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, 10),
    )


def resnet18(num_classes: int = 1000, width: int = 64) -> nn.Module:
    """ResNet-18: a 7x7 stride-2 stem and max pool, four stages of two BasicBlocks
    (``width`` to ``8 width`` channels, stride 2 from the second stage), average pool, linear."""
    stages = []
    channels_in = width
    for stage, channels in enumerate((width, 2 * width, 4 * width, 8 * width)):
        stride = 1 if stage == 0 else 2
        stages += [BasicBlock(channels_in, channels, stride), BasicBlock(channels, channels, 1)]
        channels_in = channels
    return nn.Sequential(
        nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        *stages,
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * width, num_classes),
    )
