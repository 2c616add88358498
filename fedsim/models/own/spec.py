"""What every part of ``own`` shares: the spec fields it reads, the two table keys and how a name maps
to them, the ``batchnorm_mode`` option, and the one-line form of a user's error."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..errors import ModelSpecError


@runtime_checkable
class ModelSpec(Protocol):
    """What this package reads of a ``registry.ModelSpec``. The registry's table calls this package's
    builders and checks, so the package states the fields it needs instead of importing the registry
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

# The model option that chooses how BatchNorm runs ("eval" or "train"; see the package docstring).
BATCHNORM_OPTION = "batchnorm_mode"
BATCHNORM_MODES = ("eval", "train")


def own_model_key(name: str) -> str | None:
    """The table key of an own model's name (``timm:NAME`` or ``module.path:factory``), else None."""
    if name.startswith(TIMM_PREFIX):
        return TIMM_KEY if len(name) > len(TIMM_PREFIX) else None
    module, sep, attr = name.partition(":")
    dotted = all(part.isidentifier() for part in module.split(".")) and all(p.isidentifier() for p in attr.split("."))
    return CALLABLE_KEY if sep and dotted else None


def one_line(err: BaseException) -> str:
    """A user's error (their factory, their forward) as one line: its type and first line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def batchnorm_mode(spec: ModelSpec) -> str:
    """How the model's BatchNorm runs: the model option ``batchnorm_mode`` ("eval" by default)."""
    mode = spec.options.get(BATCHNORM_OPTION, "eval")
    if mode not in BATCHNORM_MODES:
        raise ModelSpecError(
            f"model option {BATCHNORM_OPTION} of {spec.name} must be one of {BATCHNORM_MODES}, got {mode!r}"
        )
    return mode


def factory_options(options: dict[str, Any]) -> dict[str, Any]:
    """The model options a factory receives: all but ``batchnorm_mode``, which is the adapter's."""
    return {k: v for k, v in options.items() if k != BATCHNORM_OPTION}


def call_arg(args: tuple, kwargs: dict, name: str, index: int, default: Any) -> Any:
    """Argument ``name`` (position ``index``) of a torch function call as a torch function mode sees it."""
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else default
