"""Building an own model: a trusted ``module.path:factory`` called with the model options and the run's
values its signature names, or ``timm.create_model``; either result goes through ``adapt``."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ..errors import ModelSpecError
from .probe import adapt
from .spec import TIMM_PREFIX, ModelSpec, factory_options, one_line
from .trust import import_factory

# The run's values a factory receives when its signature names them (the first name found): a
# factory may take them, and then the dataset and --p decide, not a model option.
RUN_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "classes": ("num_classes",),
    "channels": ("in_channels", "in_chans"),
    "p": ("p", "drop_rate", "dropout"),
    "size": ("image_size", "img_size"),
}
# timm's create_model arguments the run sets.
TIMM_RUN_ARGUMENTS = ("pretrained", "num_classes", "in_chans", "drop_rate")


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
        raise ModelSpecError(f"{what} raised {one_line(err)}") from None


def from_callable(spec: ModelSpec, channels: int, size: int, classes: int, options: dict[str, Any]) -> nn.Module:
    """``module.path:factory``: the factory called with the model options (and the run's values it names)."""
    factory = import_factory(spec.name)
    options = factory_options(options)
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
    options = factory_options(options)
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
