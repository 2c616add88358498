"""The probe: one forward pass of a user's module that finds its dropout layers and functional
dropout calls in the order they run and refuses what the attack cannot take; and ``adapt``, which
swaps the layers (``swap``), probes, and wraps the result in an ``OwnModel``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..dropout import DropoutMode, MaskedDropout, MaskedDropPath, dropout_mode
from ..errors import ModelSpecError
from .activations import EXACT_CALLS, exact_call
from .routing import DROPOUT_ARGS, OwnModel, dropout_call, pin_batchnorm
from .spec import BATCHNORM_OPTION, TIMM_PREFIX, ModelSpec, batchnorm_mode, call_arg, one_line
from .swap import attack_ready, swap_drop_path, swap_dropout

# Dropout whose mask is not element-wise (channels) or not a plain product (alpha): refused when p > 0.
_OTHER_DROPOUT = {
    f
    for f in (
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.alpha_dropout,
        F.feature_alpha_dropout,
        torch.alpha_dropout,
        torch.feature_alpha_dropout,
        torch.feature_dropout,
        getattr(torch, "native_dropout", None),
        getattr(torch, "dropout_", None),
    )
    if f is not None
}
# Random draws: in a forward pass (outside the dropout layers) they are a mask the attack cannot see.
_RANDOM = {
    torch.rand,
    torch.rand_like,
    torch.randn,
    torch.randn_like,
    torch.randint,
    torch.randint_like,
    torch.randperm,
    torch.bernoulli,
    torch.normal,
    torch.poisson,
    torch.multinomial,
    Tensor.bernoulli,
    Tensor.bernoulli_,
    Tensor.uniform_,
    Tensor.normal_,
    Tensor.exponential_,
    Tensor.geometric_,
    Tensor.cauchy_,
    Tensor.log_normal_,
    Tensor.random_,
    Tensor.multinomial,
}


def _refusal(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why the attack cannot take this op in a forward pass, or None."""
    name = getattr(func, "__name__", str(func))
    if func in _OTHER_DROPOUT and float(call_arg(args, kwargs, "p", 1, 0.5)) > 0:
        return f"{name}: only element-wise dropout (nn.Dropout, F.dropout) is recorded and replayed"
    if func is F.scaled_dot_product_attention and float(call_arg(args, kwargs, "dropout_p", 4, 0.0)) > 0:
        return "attention dropout inside F.scaled_dot_product_attention: its mask cannot be recorded"
    if func is F.batch_norm and call_arg(args, kwargs, "training", 5, False):
        return (
            "train-mode BatchNorm (batch statistics couple the images of a batch): give it running statistics "
            f'(eval mode, the default), or set the model option {BATCHNORM_OPTION} to "train" to audit it as such'
        )
    if func in _RANDOM or func in (F.rrelu, torch.rrelu) and call_arg(args, kwargs, "training", 3, False):
        return (
            f"a random draw ({name}) outside dropout and timm's DropPath (e.g. a stochastic depth of the model's "
            "own): a mask the attack cannot record or replay"
        )
    return None


class _Probe(TorchFunctionMode):
    """Watches one forward pass with dropout off: logs each functional dropout call (as the name of the
    layer that made it) into ``events``, and refuses the ops the attack cannot take."""

    def __init__(self, spec: ModelSpec, events: list[MaskedDropout | str], where: Callable[[], str]) -> None:
        super().__init__()
        self.name, self.p, self.events, self.where = spec.name, spec.p, events, where
        self.train_batchnorm = batchnorm_mode(spec) == "train"
        self.exact_calls = False  # the forward calls an activation of EXACT_CALLS functionally

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in EXACT_CALLS:
            self.exact_calls = True
            return exact_call(func, args, kwargs)
        if func in DROPOUT_ARGS:
            x, p, _, inplace = dropout_call(func, args, kwargs)
            if p == 0:
                return func(*args, **kwargs)
            if inplace:
                raise ModelSpecError(
                    f"model {self.name}: in-place functional dropout in {self.where()}: call it with inplace=False"
                )
            if p != self.p:
                raise ModelSpecError(
                    f"model {self.name}: functional dropout in {self.where()} has p = {p}, the run's p is {self.p}"
                )
            self.events.append(self.where())
            return x
        problem = _refusal(func, args, kwargs)
        if problem and self.train_batchnorm and func is F.batch_norm:
            problem = None  # train-mode BatchNorm, asked for
        if problem:
            raise ModelSpecError(f"model {self.name}: {problem}, in {self.where()}")
        return func(*args, **kwargs)


def _probe(
    net: nn.Module, spec: ModelSpec, input_shape: tuple[int, int, int], classes: int
) -> tuple[list[MaskedDropout | str], bool]:
    """One forward pass of 2 zero images in train mode with dropout off: the dropout layers and
    functional calls in the order they ran (``MaskedDropout`` / the calling layer's name), and whether
    it called an activation of ``EXACT_CALLS`` functionally."""
    events: list[MaskedDropout | str] = []
    running: list[str] = []  # the layers running now, innermost last, to name where a problem is
    handles = []

    # (A hook's return value would replace the input or output: these return None.)
    def enter(module: nn.Module, _args: tuple, name: str) -> None:
        running.append(name)
        if isinstance(module, MaskedDropout):
            events.append(module)

    def leave(module: nn.Module, _args: tuple, out: Any, name: str) -> None:
        running.pop()

    for name, module in net.named_modules():
        handles.append(module.register_forward_pre_hook(partial(enter, name=name)))
        handles.append(module.register_forward_hook(partial(leave, name=name)))

    def where() -> str:
        inner = next((n for n in reversed(running) if n), "")
        return f"layer {inner} ({type(net.get_submodule(inner)).__name__})" if inner else "its forward"

    buffers = {name: b.clone() for name, b in net.named_buffers()}  # train-mode BatchNorm would update them
    probe = _Probe(spec, events, where)
    try:
        with torch.no_grad(), dropout_mode(net, DropoutMode.OFF), probe:
            out = net(torch.zeros(2, *input_shape))
    except ModelSpecError:
        raise
    except Exception as err:  # the user's forward: its error, in one line
        hint = ""
        if spec.name.startswith(TIMM_PREFIX) and "img_size" not in spec.options:
            hint = f" (a timm model made for another image size takes img_size={input_shape[1]} in the model options)"
        raise ModelSpecError(
            f"model {spec.name} fails on 2 {spec.dataset} images of shape {input_shape}: {one_line(err)}{hint}"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, b in net.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    if not isinstance(out, Tensor) or tuple(out.shape) != (2, classes):
        got = f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else f"a {type(out).__name__}"
        raise ModelSpecError(
            f"model {spec.name} returns {got} for 2 images, not (2, {classes}): {spec.dataset} has {classes} "
            "classes and the model must return their logits as one tensor"
        )
    return events, probe.exact_calls


def adapt(net: Any, spec: ModelSpec, input_shape: tuple[int, int, int], classes: int) -> OwnModel:
    """The user's module made ready for the federation and the attack (see the package docstring)."""
    if not isinstance(net, nn.Module):
        raise ModelSpecError(f"model {spec.name} returned a {type(net).__name__}, not a torch nn.Module")
    attack_ready(net)
    swaps = swap_dropout(net, spec) + swap_drop_path(net, spec)
    pin = batchnorm_mode(spec) == "eval"
    net.train()
    if pin:
        pin_batchnorm(net)
    events, exact_calls = _probe(net, spec, input_shape, classes)
    names = {id(m): n for n, m in net.named_modules()}
    ran: set[int] = set()
    layers: list[MaskedDropout] = []  # each layer once, at its first run (a layer run k times has k masks)
    functional: list[int] = []
    for event in events:
        if isinstance(event, str):  # a functional call: a layer of its own, run once
            functional.append(len(layers))
            layers.append(MaskedDropout(spec.p))
            continue
        if id(event) in ran:
            continue
        ran.add(id(event))
        if event.p != spec.p and not isinstance(event, MaskedDropPath):  # one the model brought itself
            raise ModelSpecError(
                f"dropout layer {names[id(event)]} of {spec.name} has p = {event.p}, the run's p is {spec.p}"
            )
        layers.append(event)
    for swap in swaps:
        if id(swap.layer) not in ran:  # never runs: the original is left in place, and no mask is made for it
            swap.undo()
    if spec.p > 0 and all(isinstance(layer, MaskedDropPath) for layer in layers):
        raise ModelSpecError(
            f"model {spec.name} runs no dropout (nn.Dropout or F.dropout with p > 0) although p = {spec.p}: give "
            "it dropout at the run's rate (a factory gets it as its p, drop_rate or dropout argument), or use p = 0"
        )
    return OwnModel(net, layers, functional, pin_batchnorm=pin, exact_calls=exact_calls)
