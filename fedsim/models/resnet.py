"""torchvision's ResNet-18 with one dropout layer right before ``fc``, BatchNorm or GroupNorm, and
the ImageNet or the CIFAR stem."""

from __future__ import annotations

from functools import partial

from torch import nn

from .dropout import MaskedDropout

# The values of the model options ``norm`` and ``stem`` (the registry refuses others in one line).
NORMS = ("group", "batch")
STEMS = ("imagenet", "cifar")


def build_resnet18(num_classes: int, p: float, norm: str = "group", stem: str = "imagenet") -> nn.Module:
    """``norm="group"`` (2 groups, the authors' later variant) trains on one 32x32 image, where
    BatchNorm sees a single value per channel at layer4 and cannot; ``norm="batch"`` is the paper's text.

    ``stem="imagenet"`` is torchvision's (7x7 stride-2 conv and a max-pool: 32x32 becomes 8x8 before
    layer1), the one the paper names; ``stem="cifar"`` is the gradient-inversion literature's CIFAR-10
    ResNet (3x3 stride-1 conv, no bias, no max-pool: layer1 sees 32x32)."""
    if norm == "batch":
        norm_layer = nn.BatchNorm2d
    elif norm == "group":
        norm_layer = partial(nn.GroupNorm, 2)
    else:
        raise ValueError(f"unknown norm {norm!r}: use one of {NORMS}")
    if stem not in STEMS:
        raise ValueError(f"unknown stem {stem!r}: use one of {STEMS}")
    # Imported here: torchvision (with torch._dynamo, about 2 s) stays out of every process that
    # imports the model registry but builds no ResNet (the CLIs, the ClientApp of an MLP run).
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes, norm_layer=norm_layer)
    if stem == "cifar":
        # Replaced after torchvision's init, which draws conv1 first: only conv1's weights differ from
        # the ImageNet stem's at the same seed (a kaiming_normal_ fan-out draw, as torchvision's).
        conv1 = nn.Conv2d(model.conv1.in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(conv1.weight, mode="fan_out", nonlinearity="relu")
        model.conv1, model.maxpool = conv1, nn.Identity()
    model.fc = nn.Sequential(MaskedDropout(p), model.fc)
    # In-place ReLUs overwrite the norm layers' outputs, which the attack engine needs to keep.
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return model
