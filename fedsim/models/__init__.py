"""Models of the paper, all built on the one ``MaskedDropout`` layer."""

from .dropout import (
    DropoutMode,
    MaskedDropout,
    clear_masks,
    dropout_layers,
    dropout_mode,
    get_recorded_masks,
    mask_shapes,
    set_dropout_mode,
    set_masks,
)
from .registry import ModelSpec, ModelSpecError, build_model, list_models

__all__ = [
    "DropoutMode",
    "MaskedDropout",
    "ModelSpec",
    "ModelSpecError",
    "build_model",
    "clear_masks",
    "dropout_layers",
    "dropout_mode",
    "get_recorded_masks",
    "list_models",
    "mask_shapes",
    "set_dropout_mode",
    "set_masks",
]
