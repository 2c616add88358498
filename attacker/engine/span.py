"""The images' span read off the shared gradient: where the dummies can be held.

A first Linear on the flattened image has the gradient ``dL/dW = sum_b delta_b x_b^T``: every row is a
mix of the B images, so the images lie in the row space of that gradient, a B-dimensional subspace of
the pixels, known to the server from the capture alone. The same holds for an update of an optimizer
whose every step moves a weight by a sum of outer products (SGD, with momentum: its
``ClientOptimizer.lowrank_replay``), but not for Adam's elementwise step, nor where noise or pruning
filled or cut the gradient (its rank is then above B, or its rows are no mixes of the images). Holding
the dummies in that subspace takes away all but B x B of their B x pixels unknowns
(``AttackConfig.image_span``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..closed_form.probe import first_layer
from ..jobs import VictimJob

# The gradient is rank <= B to float32 precision where its (B+1)-th singular value is below this share of
# its first (a float32 rank-B matrix's rounding leaves 1e-7-1e-6; noise or a defense leaves far more).
RANK_RTOL = 1e-5


def span_reason(job: VictimJob, model: nn.Module) -> str | None:
    """Why the images' span cannot be read off ``job``'s capture, in a few words; None where it can."""
    found = _span_or_reason(job, model)
    return found if isinstance(found, str) else None


def image_span(job: VictimJob, model: nn.Module) -> Tensor | None:
    """An orthonormal basis (pixels, B) of the images' span in the model's input space; None where
    ``span_reason`` gives a reason."""
    found = _span_or_reason(job, model)
    return None if isinstance(found, str) else found


def _span_or_reason(job: VictimJob, model: nn.Module) -> Tensor | str:
    if job.match_support:
        return "the capture was pruned (its rows are no longer mixes of the images)"
    if job.plan is not None and not job.plan.optimizer.algorithm.lowrank_replay:
        return f"an update of {job.plan.optimizer.algorithm.title} steps does not move a weight by outer products"
    layer = first_layer(model, tuple(job.spec.input_shape))
    if layer is None or not isinstance(layer.module, nn.Linear) or layer.pixels is None or layer.tokens != 1:
        return "the model's first layer is no Linear on the flattened image"
    grads = dict(zip([n for n, _ in model.named_parameters()], job.gradient))
    dw = grads[layer.weight].detach().double().cpu()  # (units, entries), entries in the layer's order
    b = job.batch_size
    if b >= dw.shape[1]:
        return f"B = {b} is not below the image's {dw.shape[1]} pixels"
    _, s, vh = torch.linalg.svd(dw, full_matrices=False)
    if not s.numel() or s[0] <= 0:
        return "the first Linear's gradient is zero"
    if s.numel() > b and s[b] > RANK_RTOL * s[0]:
        return f"the first Linear's gradient has rank above B = {b} (noise or a defense filled it)"
    basis = torch.zeros(dw.shape[1], b, dtype=torch.float64)
    basis[layer.pixels.flatten()] = vh[:b].T  # the layer's entries back to the image's flat pixels
    return basis
