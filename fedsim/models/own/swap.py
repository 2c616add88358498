"""The layer swaps that make a user's module attackable: its ``nn.Dropout`` layers become
``MaskedDropout``, its stochastic depth ``MaskedDropPath``, its activations of
``TWICE_DIFFERENTIABLE`` their exact equivalents, and in-place activations and fused attention are
switched off (``attack_ready``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..dropout import MaskedDropout, MaskedDropPath
from ..errors import ModelSpecError
from .activations import swap_activations
from .spec import ModelSpec


@dataclass
class Swap:
    """One swapped layer: the original, its replacement, and every (parent, name) it sat at."""

    original: nn.Module
    layer: MaskedDropout
    places: list[tuple[nn.Module, str]] = field(default_factory=list)

    def undo(self) -> None:
        for parent, key in self.places:
            setattr(parent, key, self.original)


def swap_dropout(net: nn.Module, spec: ModelSpec) -> list[Swap]:
    """Every ``nn.Dropout`` with p > 0 replaced by a ``MaskedDropout`` of the same p (a module
    registered at several places: one layer for all of them)."""
    swaps: dict[int, Swap] = {}
    for parent_name, parent in list(net.named_modules(remove_duplicate=False)):
        for key, child in list(parent.named_children()):
            # nn.Dropout's own forward only: a subclass with its own forward calls F.dropout, which is routed
            if not isinstance(child, nn.Dropout) or type(child).forward is not nn.Dropout.forward or child.p == 0:
                continue
            name = f"{parent_name}.{key}" if parent_name else key
            if child.p != spec.p:
                raise ModelSpecError(
                    f"dropout layer {name} of {spec.name} has p = {child.p}, the run's p is {spec.p}: build it "
                    "with the run's rate (a factory gets it as its p, drop_rate or dropout argument)"
                )
            swap = swaps.setdefault(id(child), Swap(child, MaskedDropout(child.p)))
            swap.places.append((parent, key))
            setattr(parent, key, swap.layer)
    return list(swaps.values())


def _drop_path_classes() -> dict[type, str]:
    """The stochastic-depth modules swapped for ``MaskedDropPath``: class -> its rate attribute."""
    found: dict[type, str] = {}
    try:
        from timm.layers import DropPath

        found[DropPath] = "drop_prob"
    except ImportError:
        pass
    try:
        from torchvision.ops import StochasticDepth

        found[StochasticDepth] = "p"
    except ImportError:
        pass
    return found


def swap_drop_path(net: nn.Module, spec: ModelSpec) -> list[Swap]:
    """Every stochastic-depth module (``_drop_path_classes``, their own forward) with rate > 0 replaced
    by a ``MaskedDropPath`` of the same rate."""
    classes = _drop_path_classes()
    swaps: dict[int, Swap] = {}
    for parent_name, parent in list(net.named_modules(remove_duplicate=False)):
        for key, child in list(parent.named_children()):
            rate_attr = classes.get(type(child))
            rate = float(getattr(child, rate_attr, 0.0) or 0.0) if rate_attr else 0.0
            if rate_attr is None or rate == 0:
                continue
            name = f"{parent_name}.{key}" if parent_name else key
            if not getattr(child, "scale_by_keep", True) or getattr(child, "mode", "row") != "row":
                raise ModelSpecError(
                    f"stochastic depth {name} of {spec.name} is not the per-image, 1/(1 - rate)-scaled kind "
                    "(timm's scale_by_keep=False or torchvision's mode='batch'): its mask cannot be replayed as such"
                )
            if not 0 < rate < 1:
                raise ModelSpecError(f"stochastic depth {name} of {spec.name} has rate {rate}, not in (0, 1)")
            swap = swaps.setdefault(id(child), Swap(child, MaskedDropPath(rate)))
            swap.places.append((parent, key))
            setattr(parent, key, swap.layer)
    return list(swaps.values())


def attack_ready(net: nn.Module) -> None:
    """The swaps and switches every own model gets before its dropout is looked at."""
    swap_activations(net)  # the attack differentiates the gradient a second time
    for module in net.modules():
        if isinstance(getattr(module, "inplace", None), bool):
            module.inplace = False  # nn.ReLU(inplace=True) and kin: the attack keeps what they would overwrite
        if getattr(module, "fused_attn", None) is True:
            module.fused_attn = False  # timm's attention: the fused kernel has no second derivative
