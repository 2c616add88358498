"""Attack objectives: gradient distances from per-job terms, total variation, mask regularizer."""

from __future__ import annotations

from torch import Tensor

from .gradients import MatchTerms

EPS = 1e-8


def cosine_distance(terms: MatchTerms) -> Tensor:
    """ONE cosine distance over all parameter gradients concatenated (not per layer), per job."""
    dot = terms.dot.sum(0)
    norm = terms.norm2.sum(0).clamp_min(0).sqrt() * terms.target_norm2.sum(0).sqrt()
    return 1 - dot / (norm + EPS)


def euclidean_distance(terms: MatchTerms) -> Tensor:
    """Squared Euclidean distance ||g - g*||^2 per job (APRIL's D), from the same terms."""
    return (terms.norm2 - 2 * terms.dot + terms.target_norm2).sum(0)


def param_cosine_distance(terms: MatchTerms, name_suffix: str) -> Tensor:
    """Cosine distance restricted to the parameters whose name ends with ``name_suffix``."""
    rows = [i for i, n in enumerate(terms.names) if n.endswith(name_suffix)]
    if not rows:
        raise ValueError(f"the model has no parameter named *{name_suffix}")
    dot = terms.dot[rows].sum(0)
    norm = terms.norm2[rows].sum(0).clamp_min(0).sqrt() * terms.target_norm2[rows].sum(0).sqrt()
    return 1 - dot / (norm + EPS)


def total_variation(x: Tensor, num_jobs: int) -> Tensor:
    """Anisotropic TV per job: mean |dx| + mean |dy| over the job's images."""
    xj = x.reshape(num_jobs, -1, *x.shape[1:])
    dx = (xj[..., :, 1:] - xj[..., :, :-1]).abs().flatten(1).mean(1)
    dy = (xj[..., 1:, :] - xj[..., :-1, :]).abs().flatten(1).mean(1)
    return dx + dy


def mask_regularizer(layers: list[Tensor], num_jobs: int, p: float) -> Tensor:
    """Paper eq. 5 per job: sum over layers of |p - (1 - mean(psi))|, each mean over the job's own
    entries. layers[i]: masks of layer i for all jobs, rows job by job."""
    return sum(((1 - m.reshape(num_jobs, -1).mean(1)) - p).abs() for m in layers)  # type: ignore[return-value]
