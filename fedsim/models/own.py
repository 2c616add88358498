"""Your own model: any ``nn.Module`` from a Python factory (``module.path:factory``) or from timm
(``timm:NAME``), adapted so that the federation and the attacker treat it like the built-in models.

Both kinds are entries of the one model table (``registry.MODELS``, keys ``CALLABLE_KEY`` and
``TIMM_KEY``); ``registry.model_family`` maps a name with a ``:`` to them (``own_model_key``), so no
caller needs to know which kind a model is. Their attack settings are the ``generic`` profile entry.

What ``adapt`` does to the model, once per build:

* every ``nn.Dropout`` with p > 0 becomes a ``MaskedDropout`` of the same p, so its masks are sampled,
  recorded, replayed and learned like the built-in models'; a dropout of rate 0 is an identity and is
  left as it is (timm reads ``attn_drop.p``, so it cannot be removed);
* functional dropout in ``forward`` (``F.dropout`` or ``torch.dropout``; timm's ResNet head calls
  ``F.dropout`` when ``drop_rate`` > 0) is routed, call by call, to a ``MaskedDropout`` of its own
  while the model runs (``_FunctionalCalls``);
* stochastic depth (timm's ``DropPath``, which ``drop_path_rate`` puts in the residual blocks, and
  torchvision's ``StochasticDepth`` in "row" mode) becomes a ``MaskedDropPath`` of the same rate: a
  second mask, one keep-or-drop per image (shape (B, 1, ..., 1)), sampled and recorded by the client,
  replayed by WIIG and learned by DIA like a dropout mask, with its own rate (timm spreads
  ``drop_path_rate`` linearly over the blocks) where the run's p is the dropout's;
* the dropout layers are listed in the order one forward pass runs them (``OwnModel``);
* in-place activations and fused attention are switched off: the attack keeps layer outputs that an
  in-place op would overwrite, and differentiates the model's gradient a second time, which fused
  attention (``F.scaled_dot_product_attention``'s CPU kernel) does not support; any other in-place
  edit of a kept input or output (``x = self.conv(x); x += 1``, ``relu_``) is the engine's to handle:
  it finds it by the tensor's version, copies that layer's input or output and runs the pass again
  (attacker/engine/gradients.py), so it is not refused here;
* every activation whose derivative torch cannot differentiate (``nn.Hardsigmoid``: the attack
  differentiates the gradient a second time) becomes an exact equivalent built from ops it can
  (``TWICE_DIFFERENTIABLE``, one entry per activation): its modules are swapped for an
  ``ExactActivation``, and its functional calls in ``forward`` (``F.hardsigmoid``) are routed to the
  same function while the model runs (``_FunctionalCalls``);
* BatchNorm runs as the client runs it, chosen by the model option ``batchnorm_mode``
  (``BATCHNORM_OPTION``, never passed to the factory): "eval" (the default) keeps it in eval mode in
  the clients' training and in the attack alike, an affine map of each image with the running
  statistics, which the attack batches like any layer; "train" leaves it to the model's mode, so
  the clients' local rounds normalize by their batch's statistics (and update the running ones) and
  so does the attack's replay of a victim batch: the images of a batch are coupled, so the attack
  takes each victim batch as one job, one at a time (attacker/engine/gradients.py), and needs B >= 2
  wherever a feature map reaches 1x1 (train-mode BatchNorm rejects a single value per channel).

What it refuses, in one line naming the model or the layer (``ModelSpecError``): a factory that cannot
be imported or raises, an unknown timm name, an output that is not (batch, classes) logits, a dropout
whose rate is not the run's p, a dropout layer that runs twice in one pass, functional dropout it
cannot route (in place, channel-wise, alpha, inside attention), any other random draw in ``forward``
(a hand-written stochastic depth, torchvision's "batch" mode, a timm ``DropPath`` without
``scale_by_keep``: a mask the attack cannot record or replay), train-mode BatchNorm unless
``batchnorm_mode`` is "train", and a model whose gradient the attack cannot differentiate
(``check_own_model``).
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from .dropout import DropoutMode, MaskedDropout, MaskedDropPath, dropout_mode
from .errors import ModelSpecError


@runtime_checkable
class ModelSpec(Protocol):
    """What this module reads of a ``registry.ModelSpec``. The registry's table calls this module's
    builders and checks, so this module states the fields it needs instead of importing the registry
    back (an import cycle); named like the registry's class so the signatures read the same."""

    @property
    def name(self) -> str: ...
    @property
    def dataset(self) -> str: ...
    @property
    def p(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def options(self) -> dict[str, Any]: ...
    @property
    def input_shape(self) -> tuple[int, int, int]: ...
    @property
    def num_classes(self) -> int: ...
    def to_dict(self) -> dict[str, Any]: ...


CALLABLE_KEY = "module.path:factory"  # the table's entry for a Python factory
TIMM_KEY = "timm:NAME"  # the table's entry for a timm model
TIMM_PREFIX = "timm:"

_IDENTIFIER = r"[A-Za-z_]\w*"

# The run's values a factory receives when its signature names them (the first name found): a
# factory may take them, and then the dataset and --p decide, not a model option.
RUN_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "classes": ("num_classes",),
    "channels": ("in_channels", "in_chans"),
    "p": ("p", "drop_rate", "dropout"),
    "size": ("image_size", "img_size"),
}
# The model option that chooses how BatchNorm runs ("eval" or "train"; see the module docstring).
BATCHNORM_OPTION = "batchnorm_mode"
BATCHNORM_MODES = ("eval", "train")
# timm's create_model arguments the run sets.
TIMM_RUN_ARGUMENTS = ("pretrained", "num_classes", "in_chans", "drop_rate")

# Element-wise dropout: routed through masks. Its argument names, in order.
_DROPOUT_ARGS: dict[Any, tuple[str, ...]] = {
    F.dropout: ("input", "p", "training", "inplace"),
    torch.dropout: ("input", "p", "train"),
}
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
_EXACT_CALLS: dict[Any, Callable[[Tensor], Tensor]] = {
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


def _exact_call(func: Any, args: tuple, kwargs: dict) -> Tensor:
    """A functional activation call of ``_EXACT_CALLS`` run by its exact equivalent."""
    x = _arg(args, kwargs, "input", 0, None)
    inplace = bool(_arg(args, kwargs, "inplace", 1, False))
    if not inplace:
        return _EXACT_CALLS[func](x)
    # The equivalent keeps its input for the backward pass: give it a copy, then write x in place as the call would.
    return x.copy_(_EXACT_CALLS[func](x.clone()))


def own_model_key(name: str) -> str | None:
    """The table key of an own model's name (``timm:NAME`` or ``module.path:factory``), else None."""
    if name.startswith(TIMM_PREFIX):
        return TIMM_KEY if len(name) > len(TIMM_PREFIX) else None
    module, sep, attr = name.partition(":")
    dotted = all(part.isidentifier() for part in module.split(".")) and all(p.isidentifier() for p in attr.split("."))
    return CALLABLE_KEY if sep and dotted else None


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


# -- building -----------------------------------------------------------------------------------


def _add_working_dir() -> None:
    """Put the working folder on ``sys.path``, as ``python -m`` does, so ``examples.own_model:small_cnn``
    imports from the folder a command runs in (installed console scripts do not add it). Here rather
    than in the command lines: the federation's clients build the model in Ray worker processes, which
    start in the same folder, and Python code calling ``build_model`` gets the same rule."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


# Importing ``module.path:factory`` runs that module's code. A name typed by the user (a command line,
# a config file they pass) is theirs to run; a name that arrives with data (a capture's record.json,
# a server's round config on a SuperNode) is not, so it is built only if listed here. The CLIs add the
# ``--model`` the user typed; Ray workers and child processes inherit the variable; a SuperNode's
# operator sets it. timm names need no trust: they only pick a model registered in timm.
TRUSTED_FACTORIES_ENV = "DLA_MODEL_FACTORIES"


def trusted_factories() -> set[str]:
    return {n.strip() for n in os.environ.get(TRUSTED_FACTORIES_ENV, "").split(",") if n.strip()}


def trust_factory(name: str | None) -> None:
    """Allow ``name`` (when it is a ``module.path:factory``) to be imported in this process and its children."""
    if name and own_model_key(name) == CALLABLE_KEY and name not in trusted_factories():
        os.environ[TRUSTED_FACTORIES_ENV] = ",".join(sorted(trusted_factories() | {name}))


def _import_factory(name: str) -> Callable[..., Any]:
    module_name, _, attr = name.partition(":")
    if name not in trusted_factories():
        raise ModelSpecError(
            f"model {name} is a Python factory and importing it runs its code: name it yourself with "
            f"--model {name} (or list it in {TRUSTED_FACTORIES_ENV}) to allow it"
        )
    _add_working_dir()
    try:
        obj: Any = pkgutil.resolve_name(name)
    except Exception as err:
        # A failed import leaves no entry in sys.modules: then the module (the user's code) failed, whatever
        # it raised; with the module imported, an AttributeError is the attribute path that is missing.
        if sys.modules.get(module_name) is None:
            raise ModelSpecError(f"model {name}: cannot import {module_name} ({_one_line(err)})") from None
        if isinstance(err, AttributeError):
            raise ModelSpecError(f"model {name}: {module_name} has no attribute {attr!r}") from None
        raise
    if not callable(obj):
        raise ModelSpecError(f"model {name}: {attr} is a {type(obj).__name__}, not a callable returning an nn.Module")
    return obj


def _run_arguments(factory: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """The run's values (``RUN_ARGUMENTS``) under the names the factory's signature gives them;
    ``num_classes`` also to a factory with ``**kwargs`` (torchvision's builders take it that way)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): the options alone
        return {}
    named = {n for n, prm in params.items() if prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY)}
    var_keyword = any(prm.kind is prm.VAR_KEYWORD for prm in params.values())
    out = {}
    for key, names in RUN_ARGUMENTS.items():
        found = next((n for n in names if n in named), None)
        if found is None and key == "classes" and var_keyword:
            found = "num_classes"
        if found is not None:
            out[found] = values[key]
    return out


def _call(make: Callable[[], Any], what: str) -> Any:
    try:
        return make()
    except ModelSpecError:
        raise
    except Exception as err:  # the user's factory: its error, in one line
        raise ModelSpecError(f"{what} raised {_one_line(err)}") from None


def batchnorm_mode(spec: ModelSpec) -> str:
    """How the model's BatchNorm runs: the model option ``batchnorm_mode`` ("eval" by default)."""
    mode = spec.options.get(BATCHNORM_OPTION, "eval")
    if mode not in BATCHNORM_MODES:
        raise ModelSpecError(
            f"model option {BATCHNORM_OPTION} of {spec.name} must be one of {BATCHNORM_MODES}, got {mode!r}"
        )
    return mode


def _factory_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k != BATCHNORM_OPTION}


def from_callable(spec: ModelSpec, channels: int, size: int, classes: int, options: dict[str, Any]) -> nn.Module:
    """``module.path:factory``: the factory called with the model options (and the run's values it names)."""
    factory = _import_factory(spec.name)
    options = _factory_options(options)
    run = _run_arguments(factory, {"classes": classes, "channels": channels, "p": spec.p, "size": size})
    clash = sorted(set(run) & set(options))
    if clash:
        raise ModelSpecError(
            f"model option(s) {clash} of {spec.name} come from the run (classes and channels from the dataset, "
            f"the dropout rate from p): leave them out of the model options"
        )
    net = _call(lambda: factory(**run, **options), f"model factory {spec.name}")
    return adapt(net, spec, (channels, size, size), classes)


def from_timm(spec: ModelSpec, channels: int, size: int, classes: int, options: dict[str, Any]) -> nn.Module:
    """``timm:NAME``: ``timm.create_model(NAME, pretrained=False, ...)`` with drop_rate = p; never downloads."""
    try:
        import timm
    except ImportError:
        raise ModelSpecError(f"model {spec.name} needs the timm package (pip install timm)") from None
    arch = spec.name[len(TIMM_PREFIX) :]
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else " (timm.list_models() lists them)"
        raise ModelSpecError(f"unknown timm model {arch!r}{hint}")
    options = _factory_options(options)
    clash = sorted(set(TIMM_RUN_ARGUMENTS) & set(options))
    if clash:
        raise ModelSpecError(
            f"model option(s) {clash} of {spec.name} are set by the run (no pretrained weights; classes and "
            f"channels from the dataset; drop_rate = p): leave them out of the model options"
        )
    net = _call(
        lambda: timm.create_model(
            arch, pretrained=False, num_classes=classes, in_chans=channels, drop_rate=spec.p, **options
        ),
        f"timm.create_model({arch!r})",
    )
    return adapt(net, spec, (channels, size, size), classes)


# -- the adapted model ----------------------------------------------------------------------------


def _dropout_call(func: Any, args: tuple, kwargs: dict) -> tuple[Tensor, float, bool, bool]:
    """(input, p, training, inplace) of an element-wise dropout call, as its defaults fill them."""
    bound = dict(zip(_DROPOUT_ARGS[func], args), **kwargs)
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


class _FunctionalCalls(TorchFunctionMode):
    """Routes one forward pass's functional dropout calls, in call order, to the model's slots, and
    the functional activation calls of ``_EXACT_CALLS`` to their exact equivalents.

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
        if func in _EXACT_CALLS:
            return _exact_call(func, args, kwargs)
        if func not in _DROPOUT_ARGS:
            return func(*args, **kwargs)
        x, p, training, _ = _dropout_call(func, args, kwargs)
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


def _pin_batchnorm(net: nn.Module) -> None:
    for module in net.modules():
        if isinstance(module, _BatchNorm):
            module.train(False)


class OwnModel(nn.Module):
    """A user's model (``net``) with its dropout routed through ``MaskedDropout`` layers.

    ``dropout`` holds every dropout layer in forward order and is registered before ``net``:
    ``modules()`` yields a module once, at its first place, so ``dropout_layers`` (which lists the
    layers in ``modules()`` order) gives the forward order even where ``net`` registers its layers in
    another order. The swapped ``nn.Dropout`` layers also sit at their own places in ``net``; the
    functional slots (``functional``: their indices in ``dropout``) live here only. ``exact_calls``:
    its forward calls an activation of ``_EXACT_CALLS`` functionally, which is routed while it runs."""

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
        # Eval-mode BatchNorm unless batchnorm_mode is "train" (the module docstring says why): Lightning
        # and the client's local round switch the whole model to train mode, and this keeps BatchNorm out of it.
        if self.pin_batchnorm:
            _pin_batchnorm(self.net)
        return self

    def forward(self, x: Tensor) -> Tensor:
        if not self.functional and not self.exact_calls:
            return self.net(x)
        slots: list[MaskedDropout] = [self.dropout[i] for i in self.functional]  # type: ignore[misc]
        with _FunctionalCalls(slots):
            return self.net(x)


# -- the probe: one forward pass that finds the dropout order and what cannot be audited ------------


def _arg(args: tuple, kwargs: dict, name: str, index: int, default: Any) -> Any:
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else default


def _refusal(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why the attack cannot take this op in a forward pass, or None."""
    name = getattr(func, "__name__", str(func))
    if func in _OTHER_DROPOUT and float(_arg(args, kwargs, "p", 1, 0.5)) > 0:
        return f"{name}: only element-wise dropout (nn.Dropout, F.dropout) is recorded and replayed"
    if func is F.scaled_dot_product_attention and float(_arg(args, kwargs, "dropout_p", 4, 0.0)) > 0:
        return "attention dropout inside F.scaled_dot_product_attention: its mask cannot be recorded"
    if func is F.batch_norm and _arg(args, kwargs, "training", 5, False):
        return (
            "train-mode BatchNorm (batch statistics couple the images of a batch): give it running statistics "
            f'(eval mode, the default), or set the model option {BATCHNORM_OPTION} to "train" to audit it as such'
        )
    if func in _RANDOM or func in (F.rrelu, torch.rrelu) and _arg(args, kwargs, "training", 3, False):
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
        self.exact_calls = False  # the forward calls an activation of _EXACT_CALLS functionally

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _EXACT_CALLS:
            self.exact_calls = True
            return _exact_call(func, args, kwargs)
        if func in _DROPOUT_ARGS:
            x, p, _, inplace = _dropout_call(func, args, kwargs)
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


@dataclass
class _Swap:
    original: nn.Module
    layer: MaskedDropout
    places: list[tuple[nn.Module, str]] = field(default_factory=list)


def _swap_dropout(net: nn.Module, spec: ModelSpec) -> list[_Swap]:
    """Every ``nn.Dropout`` with p > 0 replaced by a ``MaskedDropout`` of the same p (a module
    registered at several places: one layer for all of them)."""
    swaps: dict[int, _Swap] = {}
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
            swap = swaps.setdefault(id(child), _Swap(child, MaskedDropout(child.p)))
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


def _swap_drop_path(net: nn.Module, spec: ModelSpec) -> list[_Swap]:
    """Every stochastic-depth module (``_drop_path_classes``, their own forward) with rate > 0 replaced
    by a ``MaskedDropPath`` of the same rate."""
    classes = _drop_path_classes()
    swaps: dict[int, _Swap] = {}
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
            swap = swaps.setdefault(id(child), _Swap(child, MaskedDropPath(rate)))
            swap.places.append((parent, key))
            setattr(parent, key, swap.layer)
    return list(swaps.values())


def _swap_activations(net: nn.Module) -> None:
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


def _attack_ready(net: nn.Module) -> None:
    _swap_activations(net)  # the attack differentiates the gradient a second time
    for module in net.modules():
        if isinstance(getattr(module, "inplace", None), bool):
            module.inplace = False  # nn.ReLU(inplace=True) and kin: the attack keeps what they would overwrite
        if getattr(module, "fused_attn", None) is True:
            module.fused_attn = False  # timm's attention: the fused kernel has no second derivative


def _probe(
    net: nn.Module, spec: ModelSpec, input_shape: tuple[int, int, int], classes: int
) -> tuple[list[MaskedDropout | str], bool]:
    """One forward pass of 2 zero images in train mode with dropout off: the dropout layers and
    functional calls in the order they ran (``MaskedDropout`` / the calling layer's name), and whether
    it called an activation of ``_EXACT_CALLS`` functionally."""
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
            f"model {spec.name} fails on 2 {spec.dataset} images of shape {input_shape}: {_one_line(err)}{hint}"
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
    """The user's module made ready for the federation and the attack (see the module docstring)."""
    if not isinstance(net, nn.Module):
        raise ModelSpecError(f"model {spec.name} returned a {type(net).__name__}, not a torch nn.Module")
    _attack_ready(net)
    swaps = _swap_dropout(net, spec) + _swap_drop_path(net, spec)
    pin = batchnorm_mode(spec) == "eval"
    net.train()
    if pin:
        _pin_batchnorm(net)
    events, exact_calls = _probe(net, spec, input_shape, classes)
    names = {id(m): n for n, m in net.named_modules()}
    runs: dict[int, int] = {}
    for event in events:
        if isinstance(event, MaskedDropout):
            runs[id(event)] = runs.get(id(event), 0) + 1
            name = names[id(event)]
            if runs[id(event)] == 2:
                raise ModelSpecError(
                    f"dropout layer {name} of {spec.name} runs more than once in one forward pass: each run needs "
                    "a mask of its own, so give each place its own nn.Dropout"
                )
            if event.p != spec.p and not isinstance(event, MaskedDropPath):  # one the model brought itself
                raise ModelSpecError(f"dropout layer {name} of {spec.name} has p = {event.p}, the run's p is {spec.p}")
    for swap in swaps:
        if id(swap.layer) not in runs:  # never runs: the original is left in place, and no mask is made for it
            for parent, key in swap.places:
                setattr(parent, key, swap.original)
    layers: list[MaskedDropout] = []
    functional: list[int] = []
    for event in events:
        if isinstance(event, str):
            functional.append(len(layers))
            event = MaskedDropout(spec.p)
        layers.append(event)
    if spec.p > 0 and all(isinstance(layer, MaskedDropPath) for layer in layers):
        raise ModelSpecError(
            f"model {spec.name} runs no dropout (nn.Dropout or F.dropout with p > 0) although p = {spec.p}: give "
            "it dropout at the run's rate (a factory gets it as its p, drop_rate or dropout argument), or use p = 0"
        )
    return OwnModel(net, layers, functional, pin_batchnorm=pin, exact_calls=exact_calls)


# -- the check: everything above, and a second-order gradient, once per spec and process ---------------


def _second_order_problem(model: nn.Module, spec: ModelSpec) -> str | None:
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
        return f"the attack cannot differentiate the gradient of model {spec.name} a second time: {_one_line(err)}"
    return None


_CHECKED: dict[str, str | None] = {}


def _check(construct: Callable[..., nn.Module], spec: ModelSpec) -> str | None:
    key = json.dumps(spec.to_dict(), sort_keys=True, default=repr)
    if key not in _CHECKED:
        channels, size, _ = spec.input_shape
        try:
            with torch.random.fork_rng(devices=[]):  # the caller's random stream is left untouched
                torch.manual_seed(spec.seed)
                model = construct(spec, channels, size, spec.num_classes, dict(spec.options))
                _CHECKED[key] = _second_order_problem(model, spec)
        except ModelSpecError as err:
            _CHECKED[key] = str(err)
    return _CHECKED[key]


# ``ModelFamily.check`` of each kind: why a spec cannot be built or attacked, else None. It builds the
# model once per spec and process (cached), so that a bad model is one line before anything is written.
check_callable: Callable[[ModelSpec], str | None] = partial(_check, from_callable)
check_timm: Callable[[ModelSpec], str | None] = partial(_check, from_timm)
