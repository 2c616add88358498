"""Build any model of the paper from a name, a dataset and the dropout rate p.

A ``ModelSpec`` is plain data (JSON-serializable) so that captures and results can say exactly
which model they belong to, and rebuild it bit for bit from its seed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .lenet import LeNet
from .mlp import MLP
from .resnet import build_resnet18
from .vit import ViT

# (channels, image size, classes) per dataset, as the models see it.
DATASET_SHAPES: dict[str, tuple[int, int, int]] = {
    "mnist": (1, 28, 10),
    "cifar10": (3, 32, 10),
    "imagenet": (3, 224, 1000),
}

# The paper feeds MNIST to the CNNs as 3-channel images (its Parameters check; tests/test_models.py).
THREE_CHANNEL_MODELS = {"lenet", "resnet18"}

MODEL_OPTIONS: dict[str, set[str]] = {
    "mlp": {"bias", "width", "depth"},
    "vit": {"patch_size", "dim", "depth", "heads", "dim_head", "mlp_dim"},
    "vit_b16": set(),
    "lenet": set(),
    "resnet18": {"norm"},
}

VIT_B16 = dict(patch_size=16, dim=768, depth=12, heads=12, dim_head=64, mlp_dim=3072)


class ModelSpecError(ValueError):
    """A model spec that cannot be built (unknown name, dataset, option, or impossible value)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dataset: str
    p: float
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        unknown = set(data) - {"name", "dataset", "p", "seed", "options"}
        if unknown:
            raise ModelSpecError(f"unknown model spec keys: {sorted(unknown)}")
        return cls(**data)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        channels, size, _ = DATASET_SHAPES[self.dataset]
        if self.name in THREE_CHANNEL_MODELS:
            channels = 3
        return (channels, size, size)

    @property
    def num_classes(self) -> int:
        return DATASET_SHAPES[self.dataset][2]


def validate_spec(spec: ModelSpec) -> None:
    if spec.name not in MODEL_OPTIONS:
        raise ModelSpecError(f"unknown model {spec.name!r}; choose from {sorted(MODEL_OPTIONS)}")
    if spec.dataset not in DATASET_SHAPES:
        raise ModelSpecError(f"unknown dataset {spec.dataset!r}; choose from {sorted(DATASET_SHAPES)}")
    if isinstance(spec.p, bool) or not isinstance(spec.p, (int, float)) or not 0.0 <= spec.p < 1.0:
        raise ModelSpecError(f"dropout rate p must be a number in [0, 1), got {spec.p!r}")
    unknown = set(spec.options) - MODEL_OPTIONS[spec.name]
    if unknown:
        raise ModelSpecError(
            f"unknown option(s) {sorted(unknown)} for model {spec.name!r}; allowed: {sorted(MODEL_OPTIONS[spec.name])}"
        )
    if spec.name == "vit_b16" and spec.dataset != "imagenet":
        raise ModelSpecError("vit_b16 takes 224x224 ImageNet images; use 'vit' for MNIST and CIFAR-10")
    if spec.name == "vit":
        patch = spec.options.get("patch_size", 4)
        size = DATASET_SHAPES[spec.dataset][1]
        if size % patch:
            raise ModelSpecError(f"vit patch size {patch} does not divide the {spec.dataset} image size {size}")


def _construct(spec: ModelSpec) -> nn.Module:
    channels, size, _ = spec.input_shape
    classes = spec.num_classes
    opts = dict(spec.options)
    if spec.name == "mlp":
        return MLP(channels * size * size, classes, spec.p, **opts)
    if spec.name == "vit":
        return ViT(image_size=size, channels=channels, num_classes=classes, p=spec.p, **opts)
    if spec.name == "vit_b16":
        return ViT(image_size=size, channels=channels, num_classes=classes, p=spec.p, **VIT_B16)
    if spec.name == "lenet":
        return LeNet(channels, size, classes, spec.p)
    return build_resnet18(classes, spec.p, **opts)


def build_model(
    name: str | ModelSpec, dataset: str | None = None, p: float = 0.0, *, seed: int = 0, **options: Any
) -> nn.Module:
    """Build a model with seeded, reproducible initialization (the global RNG is left untouched)."""
    spec = name if isinstance(name, ModelSpec) else ModelSpec(name, dataset or "", float(p), seed, options)
    validate_spec(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = _construct(spec)
    model.spec = spec  # type: ignore[attr-defined]
    return model


def list_models() -> list[str]:
    return sorted(MODEL_OPTIONS)
