"""The activations torch cannot differentiate twice, each with an exact equivalent built from ops it
can (``TWICE_DIFFERENTIABLE``): the attack differentiates the model's gradient a second time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from .spec import call_arg


def hardsigmoid(x: Tensor) -> Tensor:
    """``F.hardsigmoid``, the same function built from ops with a second derivative (torch's
    ``hardsigmoid_backward`` has none). Clamped at x, not at x + 3 as relu6(x + 3) / 6 is: the same
    value bit for bit, and the gradient non-zero exactly where torch's is (x in (-3, 3); just below
    3, x + 3 rounds to 6). The gradient's value is 1/6 times the incoming one: torch multiplies by
    its float 1/6, so the two can differ in the last bit (and in float64 torch's is only float-accurate)."""
    return (F.hardtanh(x, -3.0, 3.0) + 3.0) / 6.0


@dataclass(frozen=True)
class Exact:
    """An activation's twice-differentiable exact equivalent: ``function(x)``, and the activation's
    functional spellings that are routed to it while the model runs (a call's ``inplace=True`` too)."""

    function: Callable[[Tensor], Tensor]
    functional: tuple[Callable[..., Tensor], ...] = ()


# The activations torch cannot differentiate twice, by module class, with their exact equivalent;
# adding one is one entry. nn.Hardswish is not one (torch has hardswish_backward's derivative), nor
# are timm's own HardSigmoid / HardSwish (relu6-based) and their *Me variants (their backward is made
# of differentiable ops): tests/test_own_models.py checks each of those and each entry.
TWICE_DIFFERENTIABLE: dict[type[nn.Module], Exact] = {
    nn.Hardsigmoid: Exact(hardsigmoid, functional=(F.hardsigmoid,)),
}
# The functional spellings of the table, each with its equivalent: what the torch function modes route.
EXACT_CALLS: dict[Any, Callable[[Tensor], Tensor]] = {
    f: exact.function for exact in TWICE_DIFFERENTIABLE.values() for f in exact.functional
}


class ExactActivation(nn.Module):
    """The module put in place of an activation of ``TWICE_DIFFERENTIABLE``: its exact equivalent."""

    def __init__(self, function: Callable[[Tensor], Tensor], replaces: str) -> None:
        super().__init__()
        self.function, self.replaces = function, replaces

    def forward(self, x: Tensor) -> Tensor:
        return self.function(x)

    def extra_repr(self) -> str:
        return f"{self.function.__name__}, in place of {self.replaces}"


def exact_call(func: Any, args: tuple, kwargs: dict) -> Tensor:
    """A functional activation call of ``EXACT_CALLS`` run by its exact equivalent."""
    x = call_arg(args, kwargs, "input", 0, None)
    inplace = bool(call_arg(args, kwargs, "inplace", 1, False))
    if not inplace:
        return EXACT_CALLS[func](x)
    # The equivalent keeps its input for the backward pass: give it a copy, then write x in place as the call would.
    return x.copy_(EXACT_CALLS[func](x.clone()))


def swap_activations(net: nn.Module) -> None:
    """Every module of a ``TWICE_DIFFERENTIABLE`` class (that class exactly: a subclass may have a
    forward of its own) replaced by an ``ExactActivation`` (a module at several places: one for all)."""
    swapped: dict[int, ExactActivation] = {}
    for parent in list(net.modules()):
        for key, child in list(parent.named_children()):
            exact = TWICE_DIFFERENTIABLE.get(type(child))
            if exact is None:
                continue
            if id(child) not in swapped:
                swapped[id(child)] = ExactActivation(exact.function, type(child).__name__)
            setattr(parent, key, swapped[id(child)])
