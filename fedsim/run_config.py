"""The federated run's configuration: one flat dict with Flower-style hyphenated keys.

The same keys live in ``[tool.flwr.app.config]`` of pyproject.toml (for ``flwr run``), and the
simulation entry point passes them as overrides. The server sends the resolved dict to every client
in each round's ConfigRecord, so clients never depend on how the run was launched (the legacy
``run_simulation`` API gives apps an empty run config).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

DEFAULTS: dict[str, Any] = {
    # model
    "model": "mlp",
    "dataset": "mnist",
    "p": 0.25,
    "model-seed": 0,
    "model-options": "{}",  # JSON object of build_model options
    # federation
    "num-clients": 10,
    "num-server-rounds": 3,
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,  # client-side evaluation off: the server evaluates centrally
    "partitioning": "iid",  # iid | dirichlet
    "dirichlet-alpha": 0.5,
    "seed": 0,
    # local training
    "local-epochs": 1,
    "local-steps": 0,  # > 0: this many batches instead of epochs
    "batch-size": 64,
    "lr": 1e-3,
    "optimizer": "adam",  # adam | sgd
    "momentum": 0.0,
    # capture / audit
    "capture-rounds": "",  # "" none, "all", or "1,3,5"
    "capture-kind": "gradient",  # gradient: one-step SGD rounds on B victims; update: normal rounds
    "victim-batch-size": 1,
    "onestep-lr": 1e-3,  # small: a one-step round should not disturb training
    "onestep-float64": True,  # send one-step weights in float64 so (global - local)/lr is exact
    "label-policy": "known",  # known | unknown
    "audit": False,  # clients also return the oracle (true images, labels, masks)
    # fault injection (reliability tests and drills): "round:partition,partition" raises in those clients
    "inject-client-failure": "",
    # evaluation and output
    "early-stop-patience": 0,  # 0: off
    "eval-batch-size": 1000,
    "run-dir": "runs/fedsim",
    "data-root": "data",
    "download": True,
}

_CHOICES = {
    "optimizer": ("adam", "sgd"),
    "partitioning": ("iid", "dirichlet"),
    "capture-kind": ("gradient", "update"),
    "label-policy": ("known", "unknown"),
}


class RunConfigError(ValueError):
    """An unknown key or an impossible value in the run configuration."""


def _coerce(key: str, value: Any) -> Any:
    default = DEFAULTS[key]
    if isinstance(default, bool):
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off", ""):
                return False
            raise RunConfigError(f"{key}: expected a boolean, got {value!r}")
        return bool(value)
    try:
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except (TypeError, ValueError):
        raise RunConfigError(f"{key}: expected a {type(default).__name__}, got {value!r}") from None
    return str(value)


def resolve_config(*layers: Mapping[str, Any] | None, strict: bool = True) -> dict[str, Any]:
    """DEFAULTS overlaid by ``layers`` in order (later wins), coerced to the defaults' types.

    Keys not in DEFAULTS raise in ``strict`` mode and are dropped otherwise (a Flower context or
    ConfigRecord also carries keys of its own, such as ``server-round``)."""
    cfg = dict(DEFAULTS)
    for layer in layers:
        for key, value in (layer or {}).items():
            key = key.replace("_", "-")
            if key not in DEFAULTS:
                if strict:
                    raise RunConfigError(f"unknown run config key {key!r}; known: {', '.join(sorted(DEFAULTS))}")
                continue
            cfg[key] = _coerce(key, value)
    for key, choices in _CHOICES.items():
        if cfg[key] not in choices:
            raise RunConfigError(f"{key} must be one of {choices}, got {cfg[key]!r}")
    if not 0.0 <= cfg["p"] < 1.0:
        raise RunConfigError(f"p must be in [0, 1), got {cfg['p']}")
    if cfg["num-clients"] < 1 or cfg["num-server-rounds"] < 1:
        raise RunConfigError("num-clients and num-server-rounds must be >= 1")
    if cfg["inject-client-failure"] and not re.fullmatch(r"\d+:\d+(,\d+)*", str(cfg["inject-client-failure"])):
        raise RunConfigError(f"inject-client-failure must look like 'ROUND:PARTITION[,PARTITION...]', got {cfg['inject-client-failure']!r}")
    model_options(cfg)  # validate the JSON early
    capture_rounds(cfg)
    return cfg


def model_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    try:
        options = json.loads(cfg["model-options"] or "{}")
    except json.JSONDecodeError:
        raise RunConfigError(f"model-options must be a JSON object, got {cfg['model-options']!r}") from None
    if not isinstance(options, dict):
        raise RunConfigError(f"model-options must be a JSON object, got {cfg['model-options']!r}")
    return options


def capture_rounds(cfg: Mapping[str, Any]) -> set[int] | str:
    """The rounds to capture: a set of round numbers, or "all"."""
    text = str(cfg["capture-rounds"]).strip().lower()
    if text == "all":
        return "all"
    if not text:
        return set()
    try:
        return {int(part) for part in text.replace(" ", ",").split(",") if part}
    except ValueError:
        raise RunConfigError(f"capture-rounds must be 'all' or round numbers like '1,3', got {text!r}") from None
