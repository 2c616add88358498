"""The adapted model (``OwnModel``) and the routing of its functional calls while it runs: each
``F.dropout`` / ``torch.dropout`` call, in call order, to a ``MaskedDropout`` of its own, and each
functional activation of ``activations.EXACT_CALLS`` to its exact equivalent (``FunctionalCalls``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from ..dropout import DropoutMode, MaskedDropout
from .activations import EXACT_CALLS, exact_call

# Element-wise dropout: routed through masks. Its argument names, in order.
DROPOUT_ARGS: dict[Any, tuple[str, ...]] = {
    F.dropout: ("input", "p", "training", "inplace"),
    torch.dropout: ("input", "p", "train"),
}


def dropout_call(func: Any, args: tuple, kwargs: dict) -> tuple[Tensor, float, bool, bool]:
    """(input, p, training, inplace) of an element-wise dropout call, as its defaults fill them."""
    bound = dict(zip(DROPOUT_ARGS[func], args), **kwargs)
    training = bound.get("training", bound.get("train", True))
    return bound["input"], float(bound.get("p", 0.5)), bool(training), bool(bound.get("inplace", False))


def _run_slot(slot: MaskedDropout, x: Tensor, training: bool) -> Tensor:
    """One functional dropout call through its layer. In auto mode the call's own ``training`` decides,
    as F.dropout's does; the explicit modes (record, replay, learn, off) apply as in the module layers."""
    if slot.mode is not DropoutMode.AUTO:
        return slot(x)
    slot.mode = DropoutMode.SAMPLE if training else DropoutMode.OFF
    try:
        return slot(x)
    finally:
        slot.mode = DropoutMode.AUTO


class FunctionalCalls(TorchFunctionMode):
    """Routes one forward pass's functional dropout calls, in call order, to the model's slots, and
    the functional activation calls of ``EXACT_CALLS`` to their exact equivalents.

    Why a torch function mode and not a patched ``F.dropout``: it sees every spelling (``F.dropout``,
    ``torch.dropout``, a name imported from ``torch.nn.functional`` before any patch), holds only for
    this thread and this ``with`` block (a patched module attribute would change every model in the
    process, the Ray worker's other clients included), and it composes with ``functional_call`` and
    autograd. Its cost, a Python call per torch op of the pass, is about 2% of a ResNet-18 forward on
    CPU (measured), and only models with functional dropout or such an activation call pay it."""

    def __init__(self, slots: list[MaskedDropout]) -> None:
        super().__init__()
        self.slots, self.calls = slots, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in EXACT_CALLS:
            return exact_call(func, args, kwargs)
        if func not in DROPOUT_ARGS:
            return func(*args, **kwargs)
        x, p, training, _ = dropout_call(func, args, kwargs)
        if p == 0:
            return func(*args, **kwargs)
        if self.calls == len(self.slots):
            raise RuntimeError(
                f"the model called functional dropout more often than the {len(self.slots)} time(s) it did when "
                "it was built: a varying number of dropout calls cannot be recorded or replayed"
            )
        slot = self.slots[self.calls]
        self.calls += 1
        if p != slot.p:
            raise RuntimeError(f"functional dropout call {self.calls} has p = {p}, built with p = {slot.p}")
        return _run_slot(slot, x, training)


def pin_batchnorm(net: nn.Module) -> None:
    """Every BatchNorm of ``net`` in eval mode (running statistics), whatever mode the rest is in."""
    for module in net.modules():
        if isinstance(module, _BatchNorm):
            module.train(False)


class OwnModel(nn.Module):
    """A user's model (``net``) with its dropout routed through ``MaskedDropout`` layers.

    ``dropout`` holds every dropout layer in the order a forward pass first runs it and is registered
    before ``net``: ``modules()`` yields a module once, at its first place, so ``dropout_layers`` (which
    lists the layers in ``modules()`` order) gives the forward order even where ``net`` registers its
    layers in another order (the masks themselves come per call, in call order: ``fedsim.models.dropout``).
    The swapped ``nn.Dropout`` layers also sit at their own places in ``net``; the functional slots
    (``functional``: their indices in ``dropout``) live here only. ``exact_calls``: its forward calls
    an activation of ``EXACT_CALLS`` functionally, which is routed while it runs."""

    def __init__(
        self,
        net: nn.Module,
        layers: list[MaskedDropout],
        functional: list[int],
        pin_batchnorm: bool = True,
        exact_calls: bool = False,
    ) -> None:
        super().__init__()
        self.dropout = nn.ModuleList(layers)
        self.net = net
        self.functional = list(functional)
        self.pin_batchnorm = pin_batchnorm
        self.exact_calls = exact_calls
        self.train()

    def train(self, mode: bool = True) -> OwnModel:
        super().train(mode)
        # Eval-mode BatchNorm unless batchnorm_mode is "train" (the package docstring says why): Lightning
        # and the client's local round switch the whole model to train mode, and this keeps BatchNorm out of it.
        if self.pin_batchnorm:
            pin_batchnorm(self.net)
        return self

    def forward(self, x: Tensor) -> Tensor:
        if not self.functional and not self.exact_calls:
            return self.net(x)
        slots: list[MaskedDropout] = [self.dropout[i] for i in self.functional]  # type: ignore[misc]
        with FunctionalCalls(slots):
            return self.net(x)
