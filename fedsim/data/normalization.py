"""Dataset specifications and the normalization the paper uses (each dataset's spec comes from its
entry in the dataset table, ``catalog.DATASETS``: ``catalog.get_spec``).

All attacks work in *normalized* space (dummies start as N(0,1) there and are boxed to the
image of [0,1]), so the exact constants matter: they are the ones from the paper's protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MNIST_MEAN: tuple[float, ...] = (0.13066373765468597,)
MNIST_STD: tuple[float, ...] = (0.30810782313346863,)
CIFAR10_MEAN: tuple[float, ...] = (0.4914672374725342, 0.4822617471218109, 0.4467701315879822)
CIFAR10_STD: tuple[float, ...] = (0.24703224003314972, 0.24348513782024384, 0.26158785820007324)
IMAGENET_MEAN: tuple[float, ...] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, ...] = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class DatasetSpec:
    """Shape, class count and normalization of one dataset (as fed to the models)."""

    name: str
    channels: int
    image_size: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(
                f"DatasetSpec {self.name!r}: mean/std must have {self.channels} entries, "
                f"got {len(self.mean)}/{len(self.std)}"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"DatasetSpec {self.name!r}: std must be positive, got {self.std}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """Image shape (C, H, W)."""
        return (self.channels, self.image_size, self.image_size)

    @property
    def num_pixels(self) -> int:
        """Number of input values per image (what IG optimizes for B=1)."""
        return self.channels * self.image_size * self.image_size


def _channel_stats(
    mean: Sequence[float], std: Sequence[float], like: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean/std as (C,1,1) tensors, on the device and in the float dtype of ``like``."""
    dtype = like.dtype if like is not None and like.is_floating_point() else torch.float32
    device = like.device if like is not None else None
    mean_t = torch.tensor(tuple(mean), dtype=dtype, device=device).view(-1, 1, 1)
    std_t = torch.tensor(tuple(std), dtype=dtype, device=device).view(-1, 1, 1)
    return mean_t, std_t


def _check_channels(x: torch.Tensor, spec: DatasetSpec) -> None:
    if x.dim() < 3 or x.shape[-3] != spec.channels:
        raise ValueError(f"expected a tensor shaped (..., {spec.channels}, H, W) for {spec.name}, got {tuple(x.shape)}")


def normalize(x: torch.Tensor, spec: DatasetSpec) -> torch.Tensor:
    """Map images in [0,1] (shape (..., C, H, W)) to normalized space."""
    _check_channels(x, spec)
    mean, std = _channel_stats(spec.mean, spec.std, x)
    return (x - mean) / std


def denormalize(x: torch.Tensor, spec: DatasetSpec, *, clamp: bool) -> torch.Tensor:
    """Inverse of :func:`normalize`: normalized tensors back to pixel space.

    ``clamp=True`` clips to [0,1] (for reconstructions, which can overshoot, and for display);
    ``clamp=False`` is the exact inverse."""
    _check_channels(x, spec)
    return denormalize_stats(x, spec.mean, spec.std, clamp=clamp)


def denormalize_stats(x: torch.Tensor, mean: Sequence[float], std: Sequence[float], *, clamp: bool) -> torch.Tensor:
    """:func:`denormalize` with explicit per-channel ``mean``/``std`` (shape (..., C, H, W); a
    one-entry mean/std applies to every channel), for callers that hold statistics, not a spec."""
    mean_t, std_t = _channel_stats(mean, std, x)
    out = x * std_t + mean_t
    return out.clamp(0.0, 1.0) if clamp else out


def box_bounds(
    spec: DatasetSpec,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (low, high), each shaped (C,1,1): the normalized images of pixel values 0 and 1.

    The attacks clamp dummy images into this box after each step.
    """
    mean = torch.tensor(spec.mean, dtype=torch.float64).view(-1, 1, 1)
    std = torch.tensor(spec.std, dtype=torch.float64).view(-1, 1, 1)
    # Compute in float64 so the bounds are the exactly rounded values, then cast.
    low = ((0.0 - mean) / std).to(device=device, dtype=dtype)
    high = ((1.0 - mean) / std).to(device=device, dtype=dtype)
    return low, high
