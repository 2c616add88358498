"""Build any model of the paper, or your own (``own``: ``module.path:factory``, ``timm:NAME``), from a
name, a dataset and the dropout rate p.

A ``ModelSpec`` is plain data (JSON-serializable) so that captures and results can say exactly
which model they belong to, and rebuild it bit for bit from its seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from fedsim.data.catalog import DATASETS

from . import own
from .errors import ModelSpecError
from .lenet import LeNet
from .mlp import MLP
from .resnet import NORMS, STEMS, build_resnet18
from .vit import ViT

VIT_B16 = dict(patch_size=16, dim=768, depth=12, heads=12, dim_head=64, mlp_dim=3072)
VIT_B16_IMAGE_SIZE = 224  # ImageNet's: the size its position embeddings are made for


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
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        unknown = set(data) - {"name", "dataset", "p", "seed", "options"}
        if unknown:
            raise ModelSpecError(f"unknown model spec keys: {sorted(unknown)}")
        return cls(**data)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(channels, size, size) as the model sees the dataset (the dataset table's entry)."""
        entry = DATASETS[self.dataset]
        channels = 3 if model_family(self.name).three_channel else entry.channels[0]
        return (channels, entry.image_size, entry.image_size)

    @property
    def num_classes(self) -> int:
        return DATASETS[self.dataset].num_classes


def _check_vit(spec: ModelSpec) -> str | None:
    patch = spec.options.get("patch_size", 4)
    size = DATASETS[spec.dataset].image_size
    return f"vit patch size {patch} does not divide the {spec.dataset} image size {size}" if size % patch else None


def _check_vit_b16(spec: ModelSpec) -> str | None:
    if DATASETS[spec.dataset].image_size != VIT_B16_IMAGE_SIZE:
        return "vit_b16 takes 224x224 ImageNet images; use 'vit' for MNIST and CIFAR-10"
    return None


@dataclass(frozen=True)
class ModelFamily:
    """Everything that depends on which model it is, in one entry: how to build it, what it accepts,
    and how the attacker treats it (its settings' family, its jobs per batch). The federation reads
    the first part, the attacker the second."""

    name: str
    # (spec, channels, image size, classes, options) -> the model, built with the spec's dropout rate.
    construct: Callable[[ModelSpec, int, int, int, dict[str, Any]], nn.Module]
    # The options it accepts; None: any, the model's own constructor judges them (own models).
    options: frozenset[str] | None = frozenset()
    # The values an option may take, where they are a fixed set: another value is a one-line error.
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    # The paper feeds MNIST to the CNNs as 3-channel images (its Parameters check; tests/test_models.py).
    three_channel: bool = False
    check: Callable[[ModelSpec], str | None] | None = None  # why a spec cannot be built, or None
    # The key of its attack settings in attacker.profiles.PROFILES (a model without one: "generic").
    attack_family: str = "generic"
    # Jobs per batched optimization by device kind ("cpu", "gpu"); absent: no cap of the model's own.
    group_caps: Mapping[str, int] = field(default_factory=dict)


# Group caps. CPU: beyond these, throughput stops growing while memory keeps growing (measured on
# 2 cores: ViT/CIFAR-10 41-43 victim-it/s at V = 8-32, 25 and 7.0 GB at V = 128). GPU (an H200,
# `make gpu-check`): a ViT iteration takes about the same 62-71 ms from V = 1 to V = 128 (kernel
# launches, not arithmetic, bound it; 4.7 GB at 128) and a ResNet-18 one 53 ms at V = 16, 78-82 ms
# at V = 64 (4.7 GB), so both batch more jobs there; the ViT-B/16 stays at one job until measured.
MODELS: dict[str, ModelFamily] = {
    f.name: f
    for f in (
        ModelFamily(
            "mlp",
            lambda spec, c, size, classes, opts: MLP(c * size * size, classes, spec.p, **opts),
            frozenset({"bias", "width", "depth"}),
            attack_family="mlp",
        ),
        ModelFamily(
            "vit",
            lambda spec, c, size, classes, opts: ViT(
                image_size=size, channels=c, num_classes=classes, p=spec.p, **opts
            ),
            frozenset({"patch_size", "dim", "depth", "heads", "dim_head", "mlp_dim"}),
            check=_check_vit,
            attack_family="vit",
            group_caps={"cpu": 16, "gpu": 128},
        ),
        ModelFamily(
            "vit_b16",
            lambda spec, c, size, classes, opts: ViT(
                image_size=size, channels=c, num_classes=classes, p=spec.p, **VIT_B16
            ),
            check=_check_vit_b16,
            attack_family="vit",
            group_caps={"cpu": 1, "gpu": 1},
        ),
        ModelFamily(
            "lenet",
            lambda spec, c, size, classes, opts: LeNet(c, size, classes, spec.p),
            three_channel=True,
            attack_family="lenet",
        ),
        ModelFamily(
            "resnet18",
            lambda spec, c, size, classes, opts: build_resnet18(classes, spec.p, **opts),
            frozenset({"norm", "stem"}),
            choices={"norm": NORMS, "stem": STEMS},
            three_channel=True,
            attack_family="resnet",
            group_caps={"cpu": 16, "gpu": 64},
        ),
        # Your own model (own/): any name with a ':' resolves to one of these (model_family); the
        # attack settings are the profile's generic entry, and there is no group cap of its own.
        ModelFamily(own.CALLABLE_KEY, own.from_callable, None, check=own.check_callable),
        ModelFamily(own.TIMM_KEY, own.from_timm, None, check=own.check_timm),
    )
}


def model_family(name: str) -> ModelFamily:
    """The table entry of ``name``: its own, or for ``module.path:factory`` and ``timm:NAME`` the generic
    entry of that kind (``own.own_model_key``)."""
    key = name if name in MODELS else own.own_model_key(name)
    if key is None or key not in MODELS:
        raise ModelSpecError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[key]


def validate_spec(spec: ModelSpec) -> None:
    family = model_family(spec.name)
    if spec.dataset not in DATASETS:
        raise ModelSpecError(f"unknown dataset {spec.dataset!r}; choose from {sorted(DATASETS)}")
    if isinstance(spec.p, bool) or not isinstance(spec.p, (int, float)) or not 0.0 <= spec.p < 1.0:
        raise ModelSpecError(f"dropout rate p must be a number in [0, 1), got {spec.p!r}")
    unknown = set(spec.options) - family.options if family.options is not None else set()
    if unknown:
        raise ModelSpecError(
            f"unknown option(s) {sorted(unknown)} for model {spec.name!r}; allowed: {sorted(family.options or ())}"
        )
    for key, allowed in family.choices.items():
        if key in spec.options and spec.options[key] not in allowed:
            raise ModelSpecError(
                f"model option {key} of {spec.name} must be one of {allowed}, got {spec.options[key]!r}"
            )
    problem = family.check(spec) if family.check is not None else None
    if problem:
        raise ModelSpecError(problem)


def _construct(spec: ModelSpec) -> nn.Module:
    channels, size, _ = spec.input_shape
    return model_family(spec.name).construct(spec, channels, size, spec.num_classes, dict(spec.options))


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
    return sorted(MODELS)
