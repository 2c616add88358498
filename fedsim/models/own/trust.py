"""Which ``module.path:factory`` names this process may import, and importing one.

Importing ``module.path:factory`` runs that module's code. A name typed by the user (a command line,
a config file they pass) is theirs to run; a name that arrives with data (a capture's record.json, a
server's round config on a SuperNode) is not, so it is built only if it is trusted. timm names need
no trust: they only pick a model registered in timm.

Where the trust lives: the environment variable ``DLA_MODEL_FACTORIES`` (comma-separated names), and
nowhere else. The CLIs add the ``--model`` the user typed (:func:`trust_factory`, the one function
that writes it); the models are built far from the command line, in processes the CLI does not call
into: the federation's Ray workers and a local deployment's SuperNode processes inherit the
variable from the process that started them, and a SuperNode's operator sets it. No argument reaches
those processes, and the model name that does (the run config) is the untrusted data itself.
"""

from __future__ import annotations

import os
import pkgutil
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ModelSpecError
from .spec import CALLABLE_KEY, one_line, own_model_key

TRUSTED_FACTORIES_ENV = "DLA_MODEL_FACTORIES"


def trusted_factories(environ: Mapping[str, str] | None = None) -> set[str]:
    """The trusted factory names: those listed in ``environ`` (this process's environment by default)."""
    env = os.environ if environ is None else environ
    return {n.strip() for n in env.get(TRUSTED_FACTORIES_ENV, "").split(",") if n.strip()}


def trust_factory(name: str | None) -> None:
    """Allow ``name`` (when it is a ``module.path:factory``) to be imported in this process and its children.

    The only write of the trust: into the environment, because the processes that build the model
    (Ray workers, SuperNodes) start from this one's environment and are reached by nothing else."""
    if name and own_model_key(name) == CALLABLE_KEY and name not in trusted_factories():
        os.environ[TRUSTED_FACTORIES_ENV] = ",".join(sorted(trusted_factories() | {name}))


def untrusted(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the factory ``name`` may not be imported (nobody named it), or None."""
    if name in trusted_factories(environ):
        return None
    return (
        f"model {name} is a Python factory and importing it runs its code: name it yourself with "
        f"--model {name} (or list it in {TRUSTED_FACTORIES_ENV}) to allow it"
    )


def _add_working_dir() -> None:
    """Put the working folder on ``sys.path``, as ``python -m`` does, so ``examples.own_model:small_cnn``
    imports from the folder a command runs in (installed console scripts do not add it). For good, not
    just while importing: a factory's module may import its neighbours when it is called or runs.
    Here rather than in the command lines: the federation's clients build the model in Ray worker
    processes, which start in the same folder, and Python code calling ``build_model`` gets the same rule."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def import_factory(name: str) -> Callable[..., Any]:
    """The callable ``module.path:factory`` names, once it is trusted; ModelSpecError in one line."""
    module_name, _, attr = name.partition(":")
    problem = untrusted(name)
    if problem:
        raise ModelSpecError(problem)
    _add_working_dir()
    try:
        obj: Any = pkgutil.resolve_name(name)
    except Exception as err:
        # A failed import leaves no entry in sys.modules: then the module (the user's code) failed, whatever
        # it raised; with the module imported, an AttributeError is the attribute path that is missing.
        if sys.modules.get(module_name) is None:
            raise ModelSpecError(f"model {name}: cannot import {module_name} ({one_line(err)})") from None
        if isinstance(err, AttributeError):
            raise ModelSpecError(f"model {name}: {module_name} has no attribute {attr!r}") from None
        raise
    if not callable(obj):
        raise ModelSpecError(f"model {name}: {attr} is a {type(obj).__name__}, not a callable returning an nn.Module")
    return obj
