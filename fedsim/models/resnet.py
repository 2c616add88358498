"""torchvision's ResNet-18 with one dropout layer right before ``fc``, BatchNorm or GroupNorm."""

from __future__ import annotations

from functools import partial

from torch import nn
from torchvision.models import resnet18

from .dropout import MaskedDropout


def build_resnet18(num_classes: int, p: float, norm: str = "group") -> nn.Module:
    """``norm="group"`` (2 groups, the authors' later variant) trains on one 32x32 image, where
    BatchNorm sees a single value per channel at layer4 and cannot; ``norm="batch"`` is the paper's text."""
    if norm == "batch":
        norm_layer = nn.BatchNorm2d
    elif norm == "group":
        norm_layer = partial(nn.GroupNorm, 2)
    else:
        raise ValueError(f"unknown norm {norm!r}: use 'batch' or 'group'")
    model = resnet18(weights=None, num_classes=num_classes, norm_layer=norm_layer)
    model.fc = nn.Sequential(MaskedDropout(p), model.fc)
    # In-place ReLUs overwrite the norm layers' outputs, which the attack engine needs to keep.
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return model
