"""A small CNN of your own, to audit with ``--model examples.own_model:small_cnn`` (from the repository root).

Any module-level callable that returns an ``nn.Module`` works the same way. The federation and the
attacker call it with the model options (``--model-options '{"width": 32}'``) and with the run's
values that its signature names: ``num_classes``, ``in_channels`` and ``image_size`` from the
dataset, ``p`` (or ``drop_rate`` / ``dropout``) from ``--p``. Its ``nn.Dropout`` becomes the
project's recorded dropout layer automatically (fedsim/models/own/).
"""

from __future__ import annotations

from torch import nn


def small_cnn(
    num_classes: int = 10, in_channels: int = 3, image_size: int = 32, p: float = 0.25, width: int = 16
) -> nn.Module:
    """Two 3x3 convolutions, each with ReLU and 2x2 max pooling, then dropout at rate ``p`` on the
    flattened features before the linear classifier (``image_size`` must be a multiple of 4)."""
    features = 2 * width * (image_size // 4) ** 2
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(p),
        nn.Linear(features, num_classes),
    )
