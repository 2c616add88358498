"""The paper's MLP: 3 hidden Linear layers of width 512, each followed by GELU then dropout."""

from __future__ import annotations

from torch import Tensor, nn

from .dropout import MaskedDropout


class MLP(nn.Module):
    def __init__(
        self, in_features: int, num_classes: int, p: float, width: int = 512, depth: int = 3, bias: bool = False
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        features = in_features
        for _ in range(depth):
            layers += [nn.Linear(features, width, bias=bias), nn.GELU(), MaskedDropout(p)]
            features = width
        layers.append(nn.Linear(features, num_classes, bias=bias))  # no dropout after the classifier
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
