"""The server strategies a run can choose (``--strategy NAME``): one table, name -> Flower class and
the parameters it takes from the run config's ``strategy-options`` (a JSON object, Flower's own
keyword names). The curious capture (``fedsim.strategy.CuriousStrategy``) wraps whichever one is
built here, so aggregation is always Flower's own code.

Under secure aggregation (``secagg``) the server runs Flower's SecAgg+ workflow, which drives a legacy
``flwr.server.strategy`` strategy: each entry names its legacy class too (the same keyword parameters),
or none where the strategy needs each client's model (median, trimmed mean, Krum) and SecAgg+ gives the
server only their weighted mean.

This module imports Flower only when a strategy is built: the run config (``--help`` included)
reads the table's names and parameters without loading ``flwr.serverapp``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedsim.ranges import Range


class StrategyOptionsError(ValueError):
    """An unknown strategy, a parameter it does not take, or a value out of range."""


@dataclass(frozen=True)
class Param:
    """One keyword argument of a Flower strategy: the numbers it takes (an integer or a finite float
    range, ``fedsim.ranges``) and a help text."""

    range: Range
    help: str = ""

    def check(self, strategy: str, name: str, value: Any) -> float | int:
        if not isinstance(value, bool) and isinstance(value, int | float):
            # JSON writes 2 and 2.0 alike: an integral float is the integer, an int a float parameter's float
            if not self.range.integer:
                value = float(value)
            elif isinstance(value, float) and value.is_integer():
                value = int(value)
        problem = self.range.problem(value)
        if problem:
            raise StrategyOptionsError(f"strategy {strategy}: {name} must be {problem}, got {value!r}")
        return value

    def describe(self) -> str:
        return self.range.describe()


def _float(low: float | None = None, high: float | None = None, **kwargs: Any) -> Range:
    return Range(low, high, finite=True, **kwargs)


@dataclass(frozen=True)
class StrategyEntry:
    name: str
    flower_class: str  # a class of flwr.serverapp.strategy
    help: str
    params: dict[str, Param] = field(default_factory=dict)
    # Changes the client's local objective (FedProx's proximal term): the client step adds it when the
    # server sends it (fedsim.client_app), and the attacker's replay reads it from the capture.
    client_objective: str = ""
    # The same strategy in flwr.server.strategy (the legacy API that SecAgg+'s workflow drives), taking
    # the same parameters; "" where it aggregates each client's model, which secure aggregation hides.
    legacy_class: str = ""

    def flower(self) -> type:
        import flwr.serverapp.strategy as flwr_strategies

        return getattr(flwr_strategies, self.flower_class)

    def legacy(self) -> type:
        import flwr.server.strategy as flwr_legacy

        if not self.legacy_class:
            raise StrategyOptionsError(f"strategy {self.name} has no form for secure aggregation")
        return getattr(flwr_legacy, self.legacy_class)


_POSITIVE = _float(0.0, low_open=True)
_DECAY = _float(0.0, 1.0, high_open=True)
# FedOpt's parameters (FedAdam, FedYogi, FedAdagrad), as flwr.serverapp.strategy.FedOpt names them.
_FEDOPT = {
    "eta": Param(_POSITIVE, "server-side learning rate"),
    "eta_l": Param(_POSITIVE, "client-side learning rate (Flower keeps it, does not use it)"),
    "beta_1": Param(_DECAY, "first-moment decay"),
    "beta_2": Param(_DECAY, "second-moment decay"),
    "tau": Param(_POSITIVE, "adaptivity (added to the root of the second moment)"),
}

STRATEGIES: dict[str, StrategyEntry] = {
    e.name: e
    for e in (
        StrategyEntry("fedavg", "FedAvg", "sample-weighted average of the client models", legacy_class="FedAvg"),
        StrategyEntry(
            "fedprox",
            "FedProx",
            "FedAvg's aggregation; clients add (mu/2)||w - w_global||^2 to their loss",
            {"proximal_mu": Param(_float(0.0), "weight of the proximal term")},
            client_objective="proximal_mu",
            legacy_class="FedProx",
        ),
        StrategyEntry(
            "fedadam", "FedAdam", "FedAvg's average as a pseudo-gradient for a server Adam step", _FEDOPT, "", "FedAdam"
        ),
        StrategyEntry(
            "fedyogi", "FedYogi", "FedAvg's average as a pseudo-gradient for a server Yogi step", _FEDOPT, "", "FedYogi"
        ),
        StrategyEntry(
            "fedadagrad",
            "FedAdagrad",
            "FedAvg's average as a pseudo-gradient for a server Adagrad step",
            _FEDOPT,
            legacy_class="FedAdagrad",
        ),
        StrategyEntry("fedmedian", "FedMedian", "coordinate-wise median of the client models"),
        StrategyEntry(
            "fedtrimmedavg",
            "FedTrimmedAvg",
            "coordinate-wise mean after cutting the beta fraction at each end",
            {"beta": Param(_float(0.0, 0.5, high_open=True), "fraction cut at each end")},
        ),
        StrategyEntry(
            "krum",
            "Krum",
            "the one client model closest to its neighbours (Blanchard et al.)",
            {"num_malicious_nodes": Param(Range(0, integer=True), "f, the Byzantine clients tolerated")},
        ),
    )
}

# Flower's constructor arguments that the federation settings fill, never strategy-options.
COMMON_ARGS = ("fraction_train", "fraction_evaluate", "min_train_nodes", "min_evaluate_nodes", "min_available_nodes")


def get_strategy(name: str) -> StrategyEntry:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise StrategyOptionsError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}") from None


def parse_options(text: str | Mapping[str, Any]) -> dict[str, Any]:
    """The ``strategy-options`` setting (a JSON object string, or already a mapping) as a dict."""
    if isinstance(text, Mapping):
        return dict(text)
    try:
        options = json.loads(text or "{}")
    except json.JSONDecodeError:
        raise StrategyOptionsError(f"strategy-options must be a JSON object, got {text!r}") from None
    if not isinstance(options, dict):
        raise StrategyOptionsError(f"strategy-options must be a JSON object, got {text!r}")
    return options


def check_options(name: str, options: str | Mapping[str, Any]) -> dict[str, Any]:
    """``options`` checked against strategy ``name``: its own parameters only, each in range.
    Returns them coerced (ints for int parameters). Raises StrategyOptionsError in one line."""
    entry = get_strategy(name)
    out: dict[str, Any] = {}
    for key, value in parse_options(options).items():
        if key not in entry.params:
            takes = ", ".join(entry.params) or "no parameters"
            hint = " (set by the federation settings)" if key in COMMON_ARGS else ""
            raise StrategyOptionsError(
                f"strategy {name} does not take {key!r}{hint}; it takes {takes} (strategy-options)"
            )
        out[key] = entry.params[key].check(name, key, value)
    return out


def build_strategy(name: str, options: str | Mapping[str, Any], **common: Any) -> Any:
    """A Flower strategy (``flwr.serverapp.strategy``) of the table, with ``options`` checked and
    ``common`` (fraction_train, min_train_nodes, ...) passed through."""
    unknown = set(common) - set(COMMON_ARGS)
    if unknown:
        raise TypeError(f"not a federation argument: {', '.join(sorted(unknown))}")
    return get_strategy(name).flower()(**common, **check_options(name, options))


# The legacy API's names for the federation arguments (flwr.server.strategy.FedAvg and its subclasses).
LEGACY_ARGS = {
    "fraction_train": "fraction_fit",
    "fraction_evaluate": "fraction_evaluate",
    "min_train_nodes": "min_fit_clients",
    "min_evaluate_nodes": "min_evaluate_clients",
    "min_available_nodes": "min_available_clients",
}


def build_legacy_strategy(name: str, options: str | Mapping[str, Any], **kwargs: Any) -> Any:
    """The legacy Flower strategy (``flwr.server.strategy``) of entry ``name``, for the SecAgg+ workflow:
    ``options`` checked as for :func:`build_strategy`, the federation arguments (by this module's
    names) renamed to the legacy ones, and the legacy-only ones (evaluate_fn, on_fit_config_fn,
    initial_parameters, ...) passed through."""
    common = {LEGACY_ARGS.get(k, k): v for k, v in kwargs.items()}
    return get_strategy(name).legacy()(**common, **check_options(name, options))
