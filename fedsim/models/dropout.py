"""The one dropout layer every model uses, and the model-level API to drive it.

Why a custom layer: ``nn.Dropout`` can only sample fresh masks in train mode. Auditing gradient
leakage needs the same layer to record the client's masks (ground truth), replay them (WIIG),
multiply by optimized fuzzy masks (DIA), or be switched off (IG in eval mode), independently of
``model.train()``/``model.eval()``.

One mask per call: a model's masks are one entry per dropout *call* of a forward pass, in call
order. For a layer that runs once per pass that is one mask per layer, in forward order; a layer that
runs k times (timm's distilled DeiT runs its ``head_drop`` on both heads' tokens) has k masks, each
at its own place in the call order. The API below (``set_dropout_mode``, ``set_masks``,
``mask_shapes``, ...) binds the model's layers to one ``DropoutPass``, which a forward pre-hook on
the model (the one the API was given) restarts at every forward: each call takes the next mask,
records the next one, and the pass's shapes and recorded masks are read in call order.

Layer order: ``dropout_layers(model)`` returns layers in ``model.modules()`` order, which is the
order in which the submodules were registered in ``__init__``. Every built-in model registers its
dropout layers in forward-pass order (own models list theirs in forward order, ``own.routing``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor, nn


class DropoutMode(StrEnum):
    AUTO = "auto"  # like nn.Dropout: sample in train mode, identity in eval mode
    SAMPLE = "sample"  # standard inverted dropout, in train and eval mode alike
    RECORD = "record"  # sample, and keep this pass's binary mask (batch dimension included)
    REPLAY = "replay"  # multiply by a given binary mask
    LEARN = "learn"  # multiply by an external real-valued mask that receives gradients
    OFF = "off"  # identity


class DropoutPass:
    """The dropout calls of one forward pass of a model, shared by its layers: the masks given for
    replay / learn (one per call, in call order) and, per call so far, its layer, mask shape and
    recorded mask (None where the call did not record)."""

    def __init__(self) -> None:
        self.masks: list[Tensor] | None = None
        self.layers: list[MaskedDropout] = []
        self.shapes: list[torch.Size] = []
        self.recorded: list[Tensor | None] = []
        self.order: list[MaskedDropout] | None = None  # the layer of each call, as ``mask_shapes`` found it

    def start(self) -> None:
        self.layers, self.shapes, self.recorded = [], [], []

    def given(self, layer: MaskedDropout, mode: DropoutMode, shape: torch.Size) -> Tensor:
        """The given mask of the call just begun (the last in ``layers``)."""
        k = len(self.layers) - 1
        if self.masks is None:
            raise RuntimeError(f"{layer.kind} layer in {mode.value} mode has no mask set")
        if k >= len(self.masks):
            raise RuntimeError(f"dropout call {k + 1} of this pass has no mask: {len(self.masks)} masks were given")
        mask = self.masks[k]
        if mask.shape != shape:
            raise ValueError(
                f"{layer.kind} mask shape {tuple(mask.shape)} does not match {tuple(shape)} (dropout call {k + 1})"
            )
        return mask


_PASS = "_dropout_pass"  # the attribute of a model (the API's root) holding its DropoutPass


def _start_pass(module: nn.Module, _args: Any) -> None:
    module.__dict__[_PASS].start()


class MaskedDropout(nn.Module):
    """Inverted dropout with sample / record / replay / learn / off modes.

    In every masked mode the output is ``x * mask / (1 - p)``, so replaying a recorded mask
    reproduces the recorded pass exactly, and a learned mask equal to a binary one equals replay.
    Each call of the layer is its own place in the pass (``DropoutPass``): a layer run twice in one
    forward records two masks and replays or learns two.
    """

    kind = "dropout"  # in error messages

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout rate p must be in [0, 1), got {p}")
        self.p = float(p)
        self.mode = DropoutMode.AUTO
        # The pass of the model the API bound this layer to; None until then (each call a pass of its own).
        self.run: DropoutPass | None = None

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode.value}"

    def new_mask(self, x: Tensor) -> Tensor:
        """An uninitialised mask for ``x``: one entry per activation (``x``'s own layout, so a pass
        draws its Bernoulli samples as ``torch.empty_like(x).bernoulli_`` always has)."""
        return torch.empty_like(x)

    def mask_shape(self, x: Tensor) -> torch.Size:
        return x.shape

    def forward(self, x: Tensor) -> Tensor:
        run = self.run
        if run is None:  # not bound to a model: this call is a pass of its own
            run = DropoutPass()
        shape = self.mask_shape(x)
        run.layers.append(self)
        run.shapes.append(shape)
        run.recorded.append(None)
        mode = self.mode
        if mode is DropoutMode.AUTO:
            mode = DropoutMode.SAMPLE if self.training else DropoutMode.OFF
        if mode is DropoutMode.OFF or self.p == 0.0 and mode is not DropoutMode.LEARN:
            if mode is DropoutMode.RECORD:
                run.recorded[-1] = self.new_mask(x).fill_(1.0)
            return x
        scale = 1.0 / (1.0 - self.p)
        if mode in (DropoutMode.SAMPLE, DropoutMode.RECORD):
            keep = self.new_mask(x).bernoulli_(1.0 - self.p)
            if mode is DropoutMode.RECORD:
                run.recorded[-1] = keep.detach().clone()
            return x * keep * scale
        return x * run.given(self, mode, shape) * scale


class MaskedDropPath(MaskedDropout):
    """Stochastic depth (timm's ``DropPath``, ``drop_path_rate``) as a mask layer: one keep-or-drop
    per image, a mask of shape (B, 1, ..., 1) that multiplies the residual branch, ``x * mask / (1 - p)``
    in every masked mode as in ``MaskedDropout``. Its rate is the layer's own (timm spreads
    ``drop_path_rate`` over the blocks), not the run's dropout p; its calls' shapes are the mask's,
    so ``mask_shapes`` and the attack's learned masks have one entry per image."""

    kind = "drop-path"

    def mask_shape(self, x: Tensor) -> torch.Size:
        return torch.Size((x.shape[0],) + (1,) * (x.ndim - 1))

    def new_mask(self, x: Tensor) -> Tensor:
        return x.new_empty(self.mask_shape(x))  # one draw per image, as timm's DropPath draws


def dropout_layers(model: nn.Module) -> list[MaskedDropout]:
    """All dropout layers of ``model`` in the documented, fixed (forward) order, each once."""
    return [m for m in model.modules() if isinstance(m, MaskedDropout)]


def _bind(model: nn.Module) -> tuple[list[MaskedDropout], DropoutPass]:
    """The model's layers, bound to the model's pass (made, with its hooks, the first time)."""
    run = model.__dict__.get(_PASS)
    if run is None:
        run = DropoutPass()
        model.__dict__[_PASS] = run
        model.register_forward_pre_hook(_start_pass)  # a module-level function: copies and pickles keep it
    layers = dropout_layers(model)
    for layer in layers:
        layer.run = run
    return layers, run


def call_layers(model: nn.Module) -> list[MaskedDropout]:
    """The layer of each dropout call of a pass, in call order (a layer run k times is there k times),
    as the last ``mask_shapes`` found it; before one, ``dropout_layers``."""
    run = model.__dict__.get(_PASS)
    return list(run.order) if run is not None and run.order is not None else dropout_layers(model)


def mask_rates(model: nn.Module, p: float, count: int) -> list[float]:
    """The drop rate of each of ``count`` masks (``mask_shapes`` order, repeated per local step): the run's
    p for dropout layers, a ``MaskedDropPath``'s own rate for stochastic depth."""
    per_call = [layer.p if isinstance(layer, MaskedDropPath) else p for layer in call_layers(model)]
    if not per_call or count % len(per_call):
        return [p] * count
    return [per_call[i % len(per_call)] for i in range(count)]


def set_dropout_mode(model: nn.Module, mode: DropoutMode | str) -> None:
    mode = DropoutMode(mode)
    for layer in _bind(model)[0]:
        layer.mode = mode


def get_recorded_masks(model: nn.Module) -> list[Tensor]:
    """The masks the last forward pass recorded, one per dropout call, in call order."""
    layers, run = _bind(model)
    if layers and not run.recorded:
        raise RuntimeError("the model has recorded no mask (run a forward pass in record mode)")
    masks = []
    for i, mask in enumerate(run.recorded):
        if mask is None:
            raise RuntimeError(f"dropout call {i + 1} has recorded no mask (run a forward pass in record mode)")
        masks.append(mask)
    return masks


def set_masks(model: nn.Module, masks: Sequence[Tensor]) -> None:
    """Give the model its masks for replay or learn: one per dropout call of a pass, in call order
    (``mask_shapes`` order)."""
    layers, run = _bind(model)
    if run.order is not None and len(masks) != len(run.order):
        raise ValueError(f"model makes {len(run.order)} dropout calls per pass, got {len(masks)} masks")
    if run.order is None and len(masks) < len(layers):  # every layer runs at least once
        raise ValueError(f"model has {len(layers)} dropout layers, got {len(masks)} masks")
    # a learned mask (nn.Parameter) is handed over as a view: it must not become a model parameter
    run.masks = [mask.view_as(mask) if isinstance(mask, nn.Parameter) else mask for mask in masks]


def clear_masks(model: nn.Module) -> None:
    _, run = _bind(model)
    run.masks = None
    run.recorded = []


def mask_shapes(model: nn.Module, example: Tensor) -> list[torch.Size]:
    """The mask shape of every dropout call of a forward pass of ``example``, in call order (no masks kept)."""
    _, run = _bind(model)
    with dropout_mode(model, DropoutMode.OFF), torch.no_grad():
        model(example)
    run.order = list(run.layers)
    return list(run.shapes)


@contextmanager
def dropout_mode(model: nn.Module, mode: DropoutMode | str) -> Iterator[None]:
    """Temporarily switch every dropout layer of ``model`` to ``mode``."""
    layers, _ = _bind(model)
    previous = [layer.mode for layer in layers]
    set_dropout_mode(model, mode)
    try:
        yield
    finally:
        for layer, old in zip(layers, previous):
            layer.mode = old
