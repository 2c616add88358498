"""How attacks treat the client's dropout masks: the mask modes, and DIA's initializations (paper Table 3)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedsim.models import MaskedDropout
from fedsim.models.dropout import call_layers

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


def analytical_rules(model: nn.Module, shapes: list[torch.Size]) -> list[tuple[str, str] | None]:
    """Per dropout layer, where paper eq. 7 (B = 1) reads its mask from the gradient, for a layer whose
    mask is (1, n):

    * ("row", W) after a Linear W with n outputs (the MLP): a neuron was dropped iff its ROW of W's
      gradient is all zero;
    * ("column", W) before a Linear W with n inputs (LeNet's and ResNet's classifier): W's gradient is
      δᵀ(m ⊙ h), so a feature was dropped iff its COLUMN is all zero (or its input was 0, where the mask
      does not matter);

    None where neither applies (and at B > 1, where a zero needs every image's mask to be 0), and for
    every call of a layer that runs more than once in a pass. One entry per mask: per dropout call,
    in call order (``shapes`` is ``mask_shapes``)."""
    weights = {n: tuple(w.shape) for n, w in model.named_parameters()}
    leaves = [(name, m) for name, m in model.named_modules() if not list(m.children())]
    calls = call_layers(model)
    if len(calls) != len(shapes):  # not one pass's masks: no call can be paired with its layer
        return [None] * len(shapes)
    shape_of = {id(m): tuple(s) for m, s in zip(calls, shapes)}
    rule_of: dict[int, tuple[str, str] | None] = {}
    last_linear: str | None = None
    for k, (name, module) in enumerate(leaves):
        if isinstance(module, nn.Linear):
            last_linear = name
            continue
        if not isinstance(module, MaskedDropout):
            continue
        shape = shape_of.get(id(module), ())
        following = leaves[k + 1] if k + 1 < len(leaves) else None
        after = f"{last_linear}.weight" if last_linear is not None else None
        before = f"{following[0]}.weight" if following and isinstance(following[1], nn.Linear) else None
        last_linear = None  # a mask only follows the Linear right before it
        single = len(shape) == 2 and shape[0] == 1
        rule: tuple[str, str] | None = None
        if single and after in weights and weights[after][0] == shape[1]:
            rule = ("row", after)
        elif single and before in weights and weights[before][1] == shape[1]:
            rule = ("column", before)
        rule_of[id(module)] = rule
    # a layer run twice: its neighbours in the model say nothing of where each call's mask shows
    return [rule_of.get(id(m)) if calls.count(m) == 1 else None for m in calls]


def analytical_masks(
    model: nn.Module,
    gradient: list[Tensor],
    shapes: list[torch.Size],
    p: float,
    generator: torch.Generator | None = None,
) -> list[Tensor]:
    """Each dropout layer's mask read from the one-step gradient where ``analytical_rules`` has a rule;
    Bernoulli(1 - p) elsewhere."""
    grads = dict(zip([n for n, _ in model.named_parameters()], gradient))
    masks = []
    for shape, rule in zip(shapes, analytical_rules(model, shapes)):
        if rule is None:
            masks.append(init_mask(shape, p, "bernoulli", generator))
            continue
        side, weight = rule
        kept = grads[weight].abs().sum(1 if side == "row" else 0) > 0
        masks.append(kept.float().reshape(shape))
    return masks


# -- mask modes: how an attack treats the client's dropout, in one table ----------------------------


@dataclass
class MaskContext:
    """What a mode may use to build one job's masks."""

    shapes: list[torch.Size]
    p: float
    mask_init: str
    model: nn.Module
    gradient: list[Tensor] | None  # the one-step gradient; None for an update (several steps)
    oracle: Any  # attacker.jobs.Oracle, only for modes with uses_oracle
    generator: torch.Generator
    rates: list[float] | None = None  # per mask, its drop rate where it is not p (stochastic depth)

    def rate_of(self) -> list[float]:
        return self.rates if self.rates is not None else [self.p] * len(self.shapes)


@dataclass(frozen=True)
class MaskMode:
    kind: str  # learn: optimized per job; const: fixed per job; random: fresh Bernoulli(1 - p) each iteration
    init: Callable[[MaskContext], list[Tensor]] | None = None  # initial masks (learn, const)
    uses_oracle: bool = False  # the threat model: only such modes may see the client's true masks


def _off(ctx: MaskContext) -> list[Tensor]:
    # a constant 1 - p cancels the 1/(1 - p) scaling: dropout off, as in eval mode
    # (each mask at its own rate: a stochastic-depth layer scales by 1/(1 - its rate))
    return [torch.full(s, 1.0 - q) for s, q in zip(ctx.shapes, ctx.rate_of())]


def _oracle(ctx: MaskContext) -> list[Tensor]:
    return [m.float() for m in ctx.oracle.masks]


def _learn(ctx: MaskContext) -> list[Tensor]:
    # The analytical init reads a one-step gradient; an update (K steps' masks mixed in one Δ) takes
    # Bernoulli(1 - p), as analytical_masks does for any layer its rule does not reach.
    # A stochastic-depth mask (its rate is not p) starts from its own rate, never from a gradient rule.
    rates = ctx.rate_of()
    if ctx.mask_init == "analytical" and ctx.gradient is not None:
        masks = analytical_masks(ctx.model, ctx.gradient, ctx.shapes, ctx.p, ctx.generator)
        return [
            m if q == ctx.p else init_mask(s, q, "bernoulli", ctx.generator)
            for m, s, q in zip(masks, ctx.shapes, rates)
        ]
    method = "bernoulli" if ctx.mask_init == "analytical" else ctx.mask_init
    return [init_mask(s, q, method, ctx.generator) for s, q in zip(ctx.shapes, rates)]


MASK_MODES: dict[str, MaskMode] = {
    "off": MaskMode("const", _off),  # IG (eval)
    "random": MaskMode("random"),  # IG (train)
    "oracle": MaskMode("const", _oracle, uses_oracle=True),  # WIIG
    "learn": MaskMode("learn", _learn),  # DIA
}


def mask_mode(name: str, p: float | Sequence[float]) -> MaskMode:
    """The mode an attack runs in: ``p`` is the dropout rate, or each mask's own rate (stochastic depth
    keeps its rate at p = 0); with every rate 0 there is no mask to treat, so every mode is off."""
    rates = [p] if isinstance(p, int | float) else list(p)
    return MASK_MODES[name] if any(rates) else MASK_MODES["off"]
