"""The model check (``ModelFamily.check`` of both own kinds): why a spec cannot be built or attacked,
else None. It builds the model and differentiates its gradient a second time, so that a bad model
is one line before anything is written.

``build_model`` runs the check on every build, and the model is the same for the same spec within a
process (the factory's module is imported once, timm's registry does not change), so the result is
cached per spec (``functools.lru_cache`` keyed by the spec's JSON). Whether a factory is trusted is
not part of that: it is asked on every check, before the cache, since the CLI may trust a name after
a first check refused it."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..dropout import DropoutMode, dropout_mode
from ..errors import ModelSpecError
from .build import from_callable, from_timm
from .spec import ModelSpec, batchnorm_mode, one_line
from .trust import untrusted

Construct = Callable[[ModelSpec, int, int, int, dict], nn.Module]


def second_order_problem(model: nn.Module, spec: ModelSpec) -> str | None:
    """Why the attack cannot differentiate the model's gradient with respect to the images (it does so
    every iteration), or None."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return f"model {spec.name} has no trainable parameters: there is no gradient to attack"
    n = 2 if batchnorm_mode(spec) == "train" else 1  # train-mode BatchNorm needs a batch (B >= 2)
    x = torch.randn(n, *spec.input_shape, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    try:
        with dropout_mode(model, DropoutMode.OFF):
            loss = F.cross_entropy(model(x), torch.zeros(n, dtype=torch.long))
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        norm = sum(g.pow(2).sum() for g in grads if g is not None)
        if not isinstance(norm, Tensor) or not norm.requires_grad:
            return f"the gradient of model {spec.name} does not depend on its input: there is nothing to reconstruct"
        torch.autograd.grad(norm, x)
    except RuntimeError as err:
        return f"the attack cannot differentiate the gradient of model {spec.name} a second time: {one_line(err)}"
    return None


def model_problem(construct: Construct, spec: ModelSpec) -> str | None:
    """Why ``construct`` cannot build ``spec`` into a model the attack can take, or None; uncached.
    Seeded by the spec, and the caller's random stream is left untouched."""
    channels, size, _ = spec.input_shape
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = construct(spec, channels, size, spec.num_classes, dict(spec.options))
            return second_order_problem(model, spec)
    except ModelSpecError as err:
        return str(err)


@dataclass(frozen=True)
class _Keyed:
    """A spec as a cache key: equal and hashed by its JSON (a spec's options dict is not hashable)."""

    key: str
    spec: ModelSpec = field(compare=False)


@functools.cache
def _cached_problem(construct: Construct, keyed: _Keyed) -> str | None:
    return model_problem(construct, keyed.spec)


def _keyed(spec: ModelSpec) -> _Keyed:
    return _Keyed(json.dumps(spec.to_dict(), sort_keys=True, default=repr), spec)


def check_callable(spec: ModelSpec) -> str | None:
    """The check of a ``module.path:factory`` spec: refused untrusted (never imported), else cached."""
    return untrusted(spec.name) or _cached_problem(from_callable, _keyed(spec))


def check_timm(spec: ModelSpec) -> str | None:
    """The check of a ``timm:NAME`` spec, cached."""
    return _cached_problem(from_timm, _keyed(spec))
