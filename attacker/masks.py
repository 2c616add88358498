"""DIA mask initializations (paper appendix Table 3)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedsim.models import MaskedDropout

MASK_INITS = ("bernoulli", "normal_keep", "normal_half", "analytical")


def init_mask(shape: torch.Size, p: float, method: str, generator: torch.Generator | None = None) -> Tensor:
    """One layer's initial fuzzy mask, clipped to [0, 1] like every DIA iterate."""
    if method == "bernoulli":  # keep-probability 1 - p, as the client's masks
        mask = torch.bernoulli(torch.full(shape, 1.0 - p), generator=generator)
    elif method == "normal_keep":  # N(1 - p, 1/sqrt(n_i))
        n = torch.Size(shape).numel()
        mask = (1.0 - p) + torch.randn(shape, generator=generator) / n**0.5
    elif method == "normal_half":  # N(0.5, 0.25): p unknown to the attacker
        mask = 0.5 + 0.25 * torch.randn(shape, generator=generator)
    else:
        raise ValueError(f"unknown mask init {method!r}; choose from {MASK_INITS}")
    return mask.clamp_(0.0, 1.0)


def analytical_masks(
    model: nn.Module, gradient: list[Tensor], shapes: list[torch.Size], p: float, generator: torch.Generator | None = None
) -> list[Tensor]:
    """Paper eq. 7 (B = 1): a neuron of a fully-connected layer was dropped iff its row of that
    layer's weight gradient is all zero. Applies to dropout layers whose mask is (1, n) right after
    a Linear with n outputs; every other layer falls back to Bernoulli(1 - p)."""
    grads = dict(zip([n for n, _ in model.named_parameters()], gradient))
    last_linear: str | None = None
    masks = []
    layer_index = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last_linear = name
        elif isinstance(module, MaskedDropout):
            shape = shapes[layer_index]
            layer_index += 1
            weight_grad = grads.get(f"{last_linear}.weight") if last_linear is not None else None
            if weight_grad is not None and len(shape) == 2 and shape[0] == 1 and weight_grad.shape[0] == shape[1]:
                masks.append((weight_grad.abs().sum(1) > 0).float().reshape(shape))
            else:
                masks.append(init_mask(shape, p, "bernoulli", generator))
            last_linear = None  # a mask only follows the Linear right before it
    return masks
