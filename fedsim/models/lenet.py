"""The iDLG LeNet (3 sigmoid convolutions, 12 channels) with one dropout before the classifier."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .dropout import MaskedDropout


def _ceil_half(n: int) -> int:
    return (n + 1) // 2


class LeNet(nn.Module):
    def __init__(self, channels: int, image_size: int, num_classes: int, p: float) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 12, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, kernel_size=5, padding=2, stride=1),
            nn.Sigmoid(),
            nn.Flatten(),
        )
        side = _ceil_half(_ceil_half(image_size))  # two stride-2 convolutions with padding 2
        self.dropout = MaskedDropout(p)
        self.fc = nn.Linear(12 * side * side, num_classes)
        # iDLG initializes every weight and bias from U(-0.5, 0.5); with PyTorch's default init the
        # sigmoid network leaks far less, so the paper's numbers depend on it.
        with torch.no_grad():
            for param in self.parameters():
                param.uniform_(-0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.dropout(self.features(x)))
