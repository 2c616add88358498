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
from .registry import MODELS, ModelFamily, ModelSpec, ModelSpecError, build_model, list_models, model_family

__all__ = [
    "MODELS",
    "ModelFamily",
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
    "model_family",
    "set_dropout_mode",
    "set_masks",
]
