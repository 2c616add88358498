"""Attack objectives as lookups: a gradient distance by name, and loss terms by their weight key.

The engine's loss for job j is ``DISTANCES[attack.distance](terms)[j] + sum_k w_k[j] * TERMS[k].fn(inputs)[j]``.
Adding a distance is one function in ``DISTANCES``; adding a prior or regularizer is one function
registered with :func:`term` under the name of its weight key, plus that key (default 0) in
``attacker.attacks.AttackConfig``. Every function returns one value per job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ..closed_form.probe import first_layer, position_embedding
from ..profiles import BASE_PROFILE, profile_settings
from .gradients import MatchTerms

EPS = 1e-8


@dataclass
class TermInputs:
    """What a loss term may look at: the matching terms, the dummy images of the active jobs
    (job-major rows), each dropout layer's masks for those jobs, and the dropout rate (``rates``: each
    mask's own, where stochastic-depth masks drop at their layer's rate rather than p)."""

    match: MatchTerms
    images: Tensor
    num_jobs: int
    masks: list[Tensor]
    p: float
    copies: int = 1  # an unknown batch order: each job's images are this many epoch copies (copy-major)
    rates: list[float] | None = None  # per mask its drop rate; None: p for every mask
    # The dummies' input features to the model's last Linear (rows job-major) and each job's target
    # features from its gradient (engine/features.py); None where no active job has a target.
    features: Tensor | None = None
    target_features: Tensor | None = None
    # The name of the model's position-embedding parameter (``position_parameter``); None: it has none.
    position: str | None = None


@dataclass(frozen=True)
class Term:
    key: str  # the AttackConfig field holding its weight
    fn: Callable[[TermInputs], Tensor]
    learned_masks_only: bool = False  # weight forced to 0 for jobs whose masks are not learned
    copies_only: bool = False  # weight forced to 0 for jobs without epoch copies (a known batch order)
    default: Callable[[str], float] | None = None  # the weight when the config says None, by model name


DISTANCES: dict[str, Callable[[MatchTerms], Tensor]] = {}
TERMS: dict[str, Term] = {}


def distance(name: str):
    def register(fn: Callable[[MatchTerms], Tensor]) -> Callable[[MatchTerms], Tensor]:
        DISTANCES[name] = fn
        return fn

    return register


def term(
    key: str,
    *,
    learned_masks_only: bool = False,
    copies_only: bool = False,
    default: Callable[[str], float] | None = None,
):
    def register(fn: Callable[[TermInputs], Tensor]) -> Callable[[TermInputs], Tensor]:
        TERMS[key] = Term(key, fn, learned_masks_only, copies_only, default)
        return fn

    return register


# -- distances --------------------------------------------------------------------------------------


def _cosine(dot: Tensor, norm2: Tensor, target_norm2: Tensor) -> Tensor:
    return 1 - dot.sum(0) / (norm2.sum(0).clamp_min(0).sqrt() * target_norm2.sum(0).sqrt() + EPS)


@distance("cosine")
def cosine_distance(terms: MatchTerms) -> Tensor:
    """ONE cosine distance over all parameter gradients concatenated (not per layer), per job."""
    return _cosine(terms.dot, terms.norm2, terms.target_norm2)


@distance("euclidean")
def euclidean_distance(terms: MatchTerms) -> Tensor:
    """Squared Euclidean distance ||g - g*||^2 per job (APRIL's D), from the same terms."""
    return (terms.norm2 - 2 * terms.dot + terms.target_norm2).sum(0)


def param_cosine_distance(terms: MatchTerms, name: str) -> Tensor:
    """Cosine distance restricted to the parameter ``name`` (as model.named_parameters() names it)."""
    rows = [i for i, n in enumerate(terms.names) if n == name]
    if not rows:
        raise ValueError(f"the model has no parameter named {name}")
    return _cosine(terms.dot[rows], terms.norm2[rows], terms.target_norm2[rows])


def position_parameter(model: nn.Module, input_shape: tuple[int, ...], classes: int) -> str | None:
    """The name of the model's position embedding, found by what it is, not by its name (the
    project's ViT calls it pos_embedding, timm's pos_embed): the parameter added to every token after a
    per-patch linear embedding, by the gradient identity it implies on a probe (closed_form.probe).
    None for a model without one. The probe differentiates w.r.t. the weights, which the engine
    freezes: they take gradients for it and are frozen again after."""
    layer = first_layer(model, input_shape)
    if layer is None:
        return None
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    try:
        found = position_embedding(model, layer, input_shape, classes)
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return None if found is None else found.name


# -- loss terms -------------------------------------------------------------------------------------


@term("lambda_pos")
def position_embedding_term(inputs: TermInputs) -> Tensor:
    """APRIL's extra cosine term on the position-embedding gradient (ViT), whatever the parameter's name."""
    if inputs.position is None:
        raise ValueError(
            "the model has no position embedding (a parameter added to every patch token), which APRIL's "
            "lambda_pos term matches"
        )
    return param_cosine_distance(inputs.match, inputs.position)


@term("tv_weight", default=lambda model: profile_settings(BASE_PROFILE, model)["tv_weight"])
def total_variation_term(inputs: TermInputs) -> Tensor:
    return total_variation(inputs.images, inputs.num_jobs)


@term("lambda_mask", learned_masks_only=True)
def mask_term(inputs: TermInputs) -> Tensor:
    return mask_regularizer(inputs.masks, inputs.num_jobs, inputs.rates or inputs.p)


@term("lambda_features")
def features_term(inputs: TermInputs) -> Tensor:
    """The dummies' classifier-input features against the features the gradient gives (closed form):
    the squared error relative to the target's norm, per job (breaching's feature regularization)."""
    if inputs.features is None or inputs.target_features is None:
        raise ValueError("the features term needs the dummies' and the target features (B = 1 gradient jobs)")
    f = inputs.features.reshape(inputs.num_jobs, -1)
    t = inputs.target_features.reshape(inputs.num_jobs, -1)
    return (f - t).pow(2).sum(1) / t.pow(2).sum(1).clamp_min(EPS)


# 1e-2: the order prior is a mean squared pixel difference, O(0.1-1) for random dummies in normalized
# space, so at 1e-2 it stays well below the cosine distance (in [0, 2]) it regularizes. Chosen by that
# scale argument only: NOT tuned. It applies only to unknown-order jobs (copies_only).
@term("lambda_order", copies_only=True, default=lambda model: 1e-2)
def order_term(inputs: TermInputs) -> Tensor:
    return copies_prior(inputs.images, inputs.num_jobs, inputs.copies)


def copies_prior(x: Tensor, num_jobs: int, copies: int) -> Tensor:
    """The order-invariant prior of an unknown batch order (after Dimitrov et al.'s epoch-copy prior): per
    job, the mean over copies and pixels of (mean image of copy e - mean over all copies)². The same
    images in any order give the same mean image, so the prior ties the copies without knowing which
    image of one copy is which of another; it is zero when every copy is a permutation of the others."""
    means = x.reshape(num_jobs, copies, -1, *x.shape[1:]).mean(2)  # (jobs, copies, ...)
    return (means - means.mean(1, keepdim=True)).pow(2).flatten(1).mean(1)


def total_variation(x: Tensor, num_jobs: int) -> Tensor:
    """Anisotropic TV per job: mean |dx| + mean |dy| over the job's images."""
    xj = x.reshape(num_jobs, -1, *x.shape[1:])
    dx = (xj[..., :, 1:] - xj[..., :, :-1]).abs().flatten(1).mean(1)
    dy = (xj[..., 1:, :] - xj[..., :-1, :]).abs().flatten(1).mean(1)
    return dx + dy


def mask_regularizer(layers: list[Tensor], num_jobs: int, p: float | Sequence[float]) -> Tensor:
    """Paper eq. 5 per job: sum over layers of |p - (1 - mean(psi))|, each mean over the job's own
    entries. layers[i]: masks of layer i for all jobs, rows job by job. ``p`` may be one rate per layer
    (a stochastic-depth mask is pulled toward its own drop rate, not the dropout layers' p)."""
    rates = [p] * len(layers) if isinstance(p, int | float) else list(p)
    return sum(((1 - m.reshape(num_jobs, -1).mean(1)) - q).abs() for m, q in zip(layers, rates, strict=True))  # type: ignore[return-value]


def term_weight(attack: Any, key: str, model_name: str) -> float:
    """The weight of loss term ``key`` for ``attack`` on ``model_name`` (None: the term's default)."""
    value = getattr(attack, key)
    if value is None:
        default = TERMS[key].default
        return default(model_name) if default is not None else 0.0
    return float(value)
