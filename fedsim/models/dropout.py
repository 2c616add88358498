"""The one dropout layer every model uses, and the model-level API to drive it.

Why a custom layer: ``nn.Dropout`` can only sample fresh masks in train mode. Auditing gradient
leakage needs the same layer to record the client's masks (ground truth), replay them (WIIG),
multiply by optimized fuzzy masks (DIA), or be switched off (IG in eval mode), independently of
``model.train()``/``model.eval()``.

Layer order: ``dropout_layers(model)`` returns layers in ``model.modules()`` order, which is the
order in which the submodules were registered in ``__init__``. Every model in this package
registers its dropout layers in forward-pass order, so masks lists are in forward order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum

import torch
from torch import Tensor, nn


class DropoutMode(StrEnum):
    AUTO = "auto"  # like nn.Dropout: sample in train mode, identity in eval mode
    SAMPLE = "sample"  # standard inverted dropout, in train and eval mode alike
    RECORD = "record"  # sample, and keep this pass's binary mask (batch dimension included)
    REPLAY = "replay"  # multiply by a given binary mask
    LEARN = "learn"  # multiply by an external real-valued mask that receives gradients
    OFF = "off"  # identity


class MaskedDropout(nn.Module):
    """Inverted dropout with sample / record / replay / learn / off modes.

    In every masked mode the output is ``x * mask / (1 - p)``, so replaying a recorded mask
    reproduces the recorded pass exactly, and a learned mask equal to a binary one equals replay.
    """

    kind = "dropout"  # in error messages

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout rate p must be in [0, 1), got {p}")
        self.p = float(p)
        self.mode = DropoutMode.AUTO
        self.mask: Tensor | None = None  # given mask for replay / learn
        self.recorded: Tensor | None = None  # mask of the last record-mode pass
        self.last_shape: torch.Size | None = None  # activation shape seen by the last pass

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode.value}"

    def new_mask(self, x: Tensor) -> Tensor:
        """An uninitialised mask for ``x``: one entry per activation (``x``'s own layout, so a pass
        draws its Bernoulli samples as ``torch.empty_like(x).bernoulli_`` always has)."""
        return torch.empty_like(x)

    def mask_shape(self, x: Tensor) -> torch.Size:
        return x.shape

    def forward(self, x: Tensor) -> Tensor:
        shape = self.mask_shape(x)
        self.last_shape = shape
        mode = self.mode
        if mode is DropoutMode.AUTO:
            mode = DropoutMode.SAMPLE if self.training else DropoutMode.OFF
        if mode is DropoutMode.OFF or self.p == 0.0 and mode is not DropoutMode.LEARN:
            if mode is DropoutMode.RECORD:
                self.recorded = self.new_mask(x).fill_(1.0)
            return x
        scale = 1.0 / (1.0 - self.p)
        if mode in (DropoutMode.SAMPLE, DropoutMode.RECORD):
            keep = self.new_mask(x).bernoulli_(1.0 - self.p)
            if mode is DropoutMode.RECORD:
                self.recorded = keep.detach().clone()
            return x * keep * scale
        if self.mask is None:
            raise RuntimeError(f"{self.kind} layer in {mode.value} mode has no mask set")
        if self.mask.shape != shape:
            raise ValueError(f"{self.kind} mask shape {tuple(self.mask.shape)} does not match {tuple(shape)}")
        return x * self.mask * scale


class MaskedDropPath(MaskedDropout):
    """Stochastic depth (timm's ``DropPath``, ``drop_path_rate``) as a mask layer: one keep-or-drop
    per image, a mask of shape (B, 1, ..., 1) that multiplies the residual branch, ``x * mask / (1 - p)``
    in every masked mode as in ``MaskedDropout``. Its rate is the layer's own (timm spreads
    ``drop_path_rate`` over the blocks), not the run's dropout p; ``last_shape`` is the mask's shape,
    so ``mask_shapes`` and the attack's learned masks have one entry per image."""

    kind = "drop-path"

    def mask_shape(self, x: Tensor) -> torch.Size:
        return torch.Size((x.shape[0],) + (1,) * (x.ndim - 1))

    def new_mask(self, x: Tensor) -> Tensor:
        return x.new_empty(self.mask_shape(x))  # one draw per image, as timm's DropPath draws


def mask_rates(model: nn.Module, p: float, count: int) -> list[float]:
    """The drop rate of each of ``count`` masks (``mask_shapes`` order, repeated per local step): the run's
    p for dropout layers, a ``MaskedDropPath``'s own rate for stochastic depth."""
    per_layer = [layer.p if isinstance(layer, MaskedDropPath) else p for layer in dropout_layers(model)]
    if not per_layer or count % len(per_layer):
        return [p] * count
    return [per_layer[i % len(per_layer)] for i in range(count)]


def dropout_layers(model: nn.Module) -> list[MaskedDropout]:
    """All dropout layers of ``model`` in the documented, fixed (forward) order."""
    return [m for m in model.modules() if isinstance(m, MaskedDropout)]


def set_dropout_mode(model: nn.Module, mode: DropoutMode | str) -> None:
    mode = DropoutMode(mode)
    for layer in dropout_layers(model):
        layer.mode = mode


def get_recorded_masks(model: nn.Module) -> list[Tensor]:
    masks = []
    for i, layer in enumerate(dropout_layers(model)):
        if layer.recorded is None:
            raise RuntimeError(f"dropout layer {i} has recorded no mask (run a forward pass in record mode)")
        masks.append(layer.recorded)
    return masks


def set_masks(model: nn.Module, masks: Sequence[Tensor]) -> None:
    """Give each dropout layer its mask, in ``dropout_layers`` order (for replay or learn)."""
    layers = dropout_layers(model)
    if len(masks) != len(layers):
        raise ValueError(f"model has {len(layers)} dropout layers, got {len(masks)} masks")
    for layer, mask in zip(layers, masks):
        # a learned mask (nn.Parameter) is handed over as a view: it must not become a model parameter
        layer.mask = mask.view_as(mask) if isinstance(mask, nn.Parameter) else mask


def clear_masks(model: nn.Module) -> None:
    for layer in dropout_layers(model):
        layer.mask = None
        layer.recorded = None


def mask_shapes(model: nn.Module, example: Tensor) -> list[torch.Size]:
    """Activation shape at every dropout layer for a forward pass of ``example`` (no masks kept)."""
    with dropout_mode(model, DropoutMode.OFF), torch.no_grad():
        model(example)
    return [layer.last_shape for layer in dropout_layers(model)]  # type: ignore[misc]


@contextmanager
def dropout_mode(model: nn.Module, mode: DropoutMode | str) -> Iterator[None]:
    """Temporarily switch every dropout layer of ``model`` to ``mode``."""
    layers = dropout_layers(model)
    previous = [layer.mode for layer in layers]
    set_dropout_mode(model, mode)
    try:
        yield
    finally:
        for layer, old in zip(layers, previous):
            layer.mode = old
