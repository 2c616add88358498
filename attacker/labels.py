"""Label recovery from the shared gradient of the classifier layer (when labels are not assumed known)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _classifier_grads(model: nn.Module, gradient: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name
    if last is None:
        raise ValueError("label recovery needs a final Linear classifier")
    grads = dict(zip([n for n, _ in model.named_parameters()], gradient))
    return grads[f"{last}.weight"], grads.get(f"{last}.bias")


def recover_labels(model: nn.Module, gradient: list[Tensor], batch_size: int) -> Tensor:
    """B = 1 (iDLG): with softmax cross-entropy, the classifier's weight-gradient row of the true
    class points against every other row (its factor p - 1 is negative, theirs p > 0); with a bias
    the true class is the only negative bias gradient. B > 1: the B classes whose rows are most
    opposed to the others (a batch heuristic that assumes distinct labels, as iDLG's extensions do)."""
    weight, bias = _classifier_grads(model, gradient)
    if bias is not None:
        score = bias  # sum over the batch of (softmax - onehot): most negative = present
    else:
        rows = weight.reshape(weight.shape[0], -1)
        gram = rows @ rows.T
        gram.fill_diagonal_(0)
        score = (gram < 0).float().sum(1).neg() + 1e-6 * gram.sum(1)  # most opposed rows first
    order = torch.argsort(score)
    return order[:batch_size].sort().values.to(torch.long)
