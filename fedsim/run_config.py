"""The federated run's configuration: one schema, one flat dict with Flower-style hyphenated keys.

``SCHEMA`` names every setting once, with its default, type, allowed values (a choice list, a
range, or a format check) and a short help text. Everything else is derived from it: ``DEFAULTS``,
the validation in :func:`resolve_config`, and the flags of the ``fedsim`` command line
(``--`` + the key). The same keys and defaults live in ``[tool.flwr.app.config]`` of pyproject.toml
for ``flwr run`` (a test keeps the two equal), and the simulation entry point passes them as
overrides. The server sends the resolved dict to every client in each round's ConfigRecord, so
clients never depend on how the run was launched (the legacy ``run_simulation`` API gives apps an
empty run config).

Flower's run config is flat and hyphenated (``num-server-rounds``, ``model-options`` as a JSON
string); YAML files and Python code use snake_case (``num_server_rounds``, ``model_options`` as a
dict). :func:`to_run_config` and :func:`from_run_config` are the one mapping between the two.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from fedsim import secagg
from fedsim.capture_kinds import client_kinds
from fedsim.capture_rounds import parse_capture_rounds
from fedsim.client_step import BATCH_ORDERS, OPTIMIZERS
from fedsim.data.hf import parse_source
from fedsim.data.partition import PARTITIONERS, PartitionError, make_partitioner
from fedsim.data.partition import parse_options as parse_partitioner_options
from fedsim.defenses import DEFENSES, NO_DEFENSE
from fedsim.dp_sgd import NOISE_SOURCES
from fedsim.ranges import AT_LEAST_0, AT_LEAST_1, POSITIVE, UNIT, Range
from fedsim.strategies import STRATEGIES, StrategyOptionsError, check_options, parse_options


class RunConfigError(ValueError):
    """An unknown key or an impossible value in the run configuration."""


@dataclass(frozen=True)
class Setting:
    """One run config setting. Its type is its default's type (bool, int, float or str)."""

    key: str
    default: Any
    help: str
    choices: Collection[str] | None = None  # a live view (a table's keys) follows entries added later
    range: Range | None = None
    check: Callable[[Any], None] | None = None  # format check of a str value; raises RunConfigError
    group: str = ""

    @property
    def type(self) -> type:
        return type(self.default)

    def describe(self) -> str:
        """The allowed values in words ("one of a, b", ">= 1", "[0, 1)"); "" when any value of the type is."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        return str(self.range) if self.range is not None else ""

    def coerce(self, value: Any) -> Any:
        """``value`` (from TOML, YAML, a command line string, a ConfigRecord) as this setting's type."""
        if self.type is bool:
            if isinstance(value, str):
                if value.strip().lower() in ("1", "true", "yes", "on"):
                    return True
                if value.strip().lower() in ("0", "false", "no", "off", ""):
                    return False
                raise RunConfigError(f"{self.key}: expected a boolean, got {value!r}")
            if isinstance(value, (bool, int)):
                return bool(value)
            raise RunConfigError(f"{self.key}: expected a boolean, got {value!r}")
        try:
            if self.type is int:
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
                return int(value)
            if self.type is float:
                return float(value)
        except (TypeError, ValueError):
            raise RunConfigError(
                f"{self.key}: expected {'an' if self.type is int else 'a'} {self.type.__name__}, got {value!r}"
            ) from None
        return str(value)

    def validate(self, value: Any) -> None:
        if self.check is not None:  # first: a check can say more than "must be one of" (defense combinations)
            self.check(value)
        if self.choices is not None and value not in self.choices:
            raise RunConfigError(f"{self.key} must be one of {', '.join(self.choices)}; got {value!r}")
        problem = self.range.problem(value) if self.range is not None else None
        if problem:
            raise RunConfigError(f"{self.key} must be {problem}; got {value!r}")


def _check_model_options(text: str) -> None:
    _parse_model_options(text)


def _parse_model_options(text: str) -> dict[str, Any]:
    try:
        options = json.loads(text or "{}")
    except json.JSONDecodeError:
        raise RunConfigError(f"model-options must be a JSON object, got {text!r}") from None
    if not isinstance(options, dict):
        raise RunConfigError(f"model-options must be a JSON object, got {text!r}")
    return options


def _check_strategy_options(text: str) -> None:
    # The JSON shape here; which parameters the chosen strategy takes: resolve_config (two settings).
    try:
        parse_options(text)
    except StrategyOptionsError as err:
        raise RunConfigError(str(err)) from None


def _check_partitioner_options(text: str) -> None:
    # The JSON shape here; which parameters the chosen partitioner takes: resolve_config (two settings).
    try:
        parse_partitioner_options(text)
    except PartitionError as err:
        raise RunConfigError(str(err)) from None


def _check_data_source(text: str) -> None:
    try:
        parse_source(text)
    except ValueError as err:
        raise RunConfigError(str(err)) from None


def _parse_capture_rounds(text: str) -> set[int] | str:
    try:
        return parse_capture_rounds(text)
    except ValueError as err:
        raise RunConfigError(str(err)) from None


def _check_capture_rounds(text: str) -> None:
    _parse_capture_rounds(text)


def _check_failure_spec(text: str) -> None:
    if text and not re.fullmatch(r"\d+:\d+(,\d+)*", text):
        raise RunConfigError(f"inject-client-failure must look like 'ROUND:PARTITION[,PARTITION...]', got {text!r}")


def _check_defense(text: str) -> None:
    parts = [part.strip() for part in re.split(r"[+,]", str(text)) if part.strip()]
    if len(parts) > 1:
        if "dp-sgd" in parts:
            others = ", ".join(p for p in parts if p != "dp-sgd")
            raise RunConfigError(
                f"defense dp-sgd cannot be combined with another update-level defense ({others}): its noise and "
                "clipping would be applied twice and its epsilon double-counted; one defense per run"
            )
        raise RunConfigError(f"one defense per run; got {text!r}")


# Vocabulary the capture store, the strategy and the attacker share with the run config (the capture
# kinds are fedsim.capture_kinds.CAPTURE_KINDS).
LABEL_POLICIES = ("known", "recovered")

SCHEMA: tuple[Setting, ...] = (
    # model
    Setting(
        "model",
        "mlp",
        "model name (fedsim.models: mlp, vit, vit_b16, lenet, resnet18), or your own: module.path:factory "
        "(a callable returning an nn.Module) or timm:NAME (docs/models.md)",
        group="model",
    ),
    Setting("dataset", "mnist", "dataset (mnist, cifar10, imagenet)", group="model"),
    Setting("p", 0.25, "dropout rate of the model", range=Range(0, 1, high_open=True), group="model"),
    Setting("model-seed", 0, "seed of the initial global model", group="model"),
    Setting(
        "model-options",
        "{}",
        "JSON object of build_model options (your own model: its factory's keyword arguments), e.g. '{\"width\": 64}'",
        check=_check_model_options,
        group="model",
    ),
    # federation
    Setting("num-clients", 10, "number of clients (SuperNodes)", range=AT_LEAST_1, group="federation"),
    Setting("num-server-rounds", 3, "number of server rounds", range=AT_LEAST_1, group="federation"),
    Setting(
        "fraction-train",
        1.0,
        "fraction of the clients sampled for training each round",
        range=Range(0, 1, low_open=True),
        group="federation",
    ),
    Setting(
        "fraction-evaluate",
        0.0,
        "fraction of the clients that evaluate each round (0: the server evaluates centrally only)",
        range=UNIT,
        group="federation",
    ),
    Setting(
        "partitioning",
        "iid",
        "the Flower Datasets partitioner that divides the data among the clients (docs/data.md): "
        + "; ".join(f"{p.name}: {p.help}" for p in PARTITIONERS.values()),
        choices=PARTITIONERS.keys(),
        group="federation",
    ),
    Setting(
        "partitioner-options",
        "{}",
        "JSON object of the partitioner's parameters, by Flower Datasets' names, e.g. "
        "'{\"min_partition_size\": 5}' (dirichlet), '{\"num_classes_per_partition\": 3}' (pathological), "
        '\'{"num_shards_per_partition": 4}\' (shard), \'{"partition_by": "writer_id"}\' (natural-id)',
        check=_check_partitioner_options,
        group="federation",
    ),
    Setting(
        "dirichlet-alpha",
        0.5,
        "Dirichlet concentration (small: strong label skew): the alpha of the dirichlet partitioner",
        range=POSITIVE,
        group="federation",
    ),
    Setting("seed", 0, "seed of the partitions and the clients' local training", group="federation"),
    Setting(
        "strategy",
        "fedavg",
        "the server's Flower strategy, which the curious capture wraps (docs/strategies.md): "
        + "; ".join(f"{e.name}: {e.help}" for e in STRATEGIES.values()),
        choices=STRATEGIES.keys(),
        group="federation",
    ),
    Setting(
        "strategy-options",
        "{}",
        "JSON object of the strategy's parameters, by Flower's names: "
        + "; ".join(f"{e.name}: {', '.join(e.params)}" for e in STRATEGIES.values() if e.params)
        + ", e.g. '{\"eta\": 0.01}'",
        check=_check_strategy_options,
        group="federation",
    ),
    # local training
    Setting("local-epochs", 1, "local epochs per round", range=AT_LEAST_1, group="local training"),
    Setting(
        "local-steps",
        0,
        "> 0: this many local batches per round instead of epochs",
        range=AT_LEAST_0,
        group="local training",
    ),
    Setting("batch-size", 64, "local training batch size", range=AT_LEAST_1, group="local training"),
    Setting("lr", 1e-3, "local learning rate", range=AT_LEAST_0, group="local training"),
    Setting("optimizer", "adam", "local optimizer", choices=OPTIMIZERS, group="local training"),
    Setting("momentum", 0.0, "SGD momentum", range=AT_LEAST_0, group="local training"),
    Setting(
        "batch-order",
        "shuffled",
        "order of the local batches: a fresh seeded permutation per epoch, or the partition's order",
        choices=BATCH_ORDERS,
        group="local training",
    ),
    # defenses: Flower client mods and strategy wrappers (fedsim.defenses)
    Setting(
        "defense",
        NO_DEFENSE,
        "defense of the clients' updates: " + "; ".join(f"{d.name}: {d.help}" for d in DEFENSES.values()),
        choices=DEFENSES.keys(),
        check=_check_defense,
        group="defense",
    ),
    Setting(
        "clip-norm",
        1.0,
        "DP defenses: L2 clipping norm of each client's update (local DP: also its sensitivity; "
        "dp-sgd: of each example's gradient)",
        range=POSITIVE,
        group="defense",
    ),
    Setting(
        "noise-multiplier",
        1.0,
        "central DP: Gaussian noise stdev of the aggregate = noise-multiplier * clip-norm / sampled clients; "
        "dp-sgd with dp-noise-from noise-multiplier: the noise of each step, in units of clip-norm",
        range=POSITIVE,
        group="defense",
    ),
    Setting(
        "dp-epsilon",
        10.0,
        "local DP: epsilon of each client's Gaussian mechanism; dp-sgd: the target epsilon of the whole training",
        range=POSITIVE,
        group="defense",
    ),
    Setting(
        "dp-delta",
        1e-5,
        "local DP: delta of each client's Gaussian mechanism; dp-sgd: the accountant's delta (< 1/client data size)",
        range=Range(0, 1, True, True),
        group="defense",
    ),
    Setting(
        "prune-fraction",
        0.1,
        "prune: the fraction of each update tensor's entries kept (largest magnitude)",
        range=Range(0, 1, low_open=True),
        group="defense",
    ),
    Setting(
        "dp-noise-from",
        "epsilon",
        "dp-sgd: the noise multiplier is derived from dp-epsilon over the whole training (epsilon), is "
        "noise-multiplier (noise-multiplier), or 0 (none: clipping only, no guarantee)",
        choices=NOISE_SOURCES,
        group="defense",
    ),
    Setting(
        "dp-fix-model",
        False,
        "dp-sgd: convert layers Opacus cannot train per example (BatchNorm -> GroupNorm) with its "
        "ModuleValidator.fix instead of refusing the model",
        group="defense",
    ),
    # secure aggregation: Flower's SecAgg+ (fedsim.secagg)
    Setting(
        "secagg",
        False,
        "secure aggregation: Flower's SecAgg+ (SecAggPlusWorkflow on the server, secaggplus_mod on the clients); "
        "the server sees only the quantized num_examples-weighted mean of each round's replies",
        group="secure aggregation",
    ),
    Setting(
        "num-shares",
        1.0,
        "secagg: the shares each client's secrets are split into; an integer >= 3, or a fraction in (0, 1] "
        "of the sampled clients (2 clients need the fraction)",
        range=POSITIVE,
        group="secure aggregation",
    ),
    Setting(
        "reconstruction-threshold",
        0.5,
        "secagg: the shares that reconstruct a secret (the dropouts a round survives); an integer >= 2 below "
        "num-shares, or a fraction in (0, 1] of num-shares (at least 2)",
        range=POSITIVE,
        group="secure aggregation",
    ),
    Setting(
        "max-weight",
        1000.0,
        "secagg: the largest num_examples weight of one client; each client's weights are scaled by "
        "num_examples / max-weight before quantization",
        range=POSITIVE,
        group="secure aggregation",
    ),
    Setting(
        "clipping-range",
        8.0,
        "secagg: the scaled weights are clipped to [-clipping-range, clipping-range] before quantization",
        range=POSITIVE,
        group="secure aggregation",
    ),
    Setting(
        "quantization-range",
        4194304,
        "secagg: the integer levels of the quantization grid (step 2 * clipping-range / quantization-range); "
        "Flower's default 2**22",
        range=AT_LEAST_1,
        group="secure aggregation",
    ),
    # capture / audit
    Setting(
        "capture-rounds",
        "",
        "rounds the curious server captures: '' none, 'all', or '1,3,5'",
        check=_check_capture_rounds,
        group="capture",
    ),
    Setting(
        "capture-kind",
        "gradient",
        "gradient: one-step SGD rounds on B victims; update: normal rounds",
        choices=client_kinds(),
        group="capture",
    ),
    Setting(
        "capture-images",
        0,
        "update capture rounds: each client trains on this many images drawn from its "
        "partition, a victim set small enough to reconstruct (0: its whole partition)",
        range=AT_LEAST_0,
        group="capture",
    ),
    Setting(
        "victim-batch-size", 1, "B, the victim images of a one-step capture round", range=AT_LEAST_1, group="capture"
    ),
    Setting(
        "onestep-lr",
        1e-3,
        "learning rate of a one-step round (small: it should not disturb training)",
        range=POSITIVE,
        group="capture",
    ),
    Setting(
        "onestep-float64", True, "send one-step weights in float64 so (global - local)/lr is exact", group="capture"
    ),
    Setting(
        "labels",
        "known",
        "known: a one-step reply discloses its labels (the paper's assumption); "
        "recovered: it does not, and the attacker recovers them from the gradient",
        choices=LABEL_POLICIES,
        group="capture",
    ),
    Setting(
        "audit",
        False,
        "clients also return the oracle (true images, labels, masks); measurements only",
        group="capture",
    ),
    # fault injection (reliability tests and drills)
    Setting(
        "inject-client-failure",
        "",
        "'ROUND:PARTITION[,PARTITION...]': those clients raise in that round",
        check=_check_failure_spec,
        group="fault injection",
    ),
    # evaluation and output
    Setting(
        "early-stop-patience",
        0,
        "rounds without a better test accuracy before stopping; 0: off",
        range=AT_LEAST_0,
        group="output",
    ),
    Setting("eval-batch-size", 1000, "batch size of the server's test evaluation", range=AT_LEAST_1, group="output"),
    Setting("run-dir", "runs/fedsim", "run folder (must be new or empty)", group="output"),
    Setting("data-root", "data", "dataset folder (downloads go here when the network allows)", group="output"),
    Setting(
        "data-source",
        "builtin",
        "where the images come from (docs/data.md): builtin (torchvision files under data-root, or the "
        "offline samples), hf:NAME[:CONFIG] (a Hugging Face Hub dataset, e.g. hf:ylecun/mnist; offline: "
        "its cached copy only) or imagefolder:PATH (a local image folder, Hugging Face's imagefolder); "
        "the images are brought to the dataset's spec",
        check=_check_data_source,
        group="output",
    ),
    Setting("download", True, "try to download datasets that are not under data-root", group="output"),
)

SETTINGS: dict[str, Setting] = {s.key: s for s in SCHEMA}
DEFAULTS: dict[str, Any] = {s.key: s.default for s in SCHEMA}

# Settings that are JSON objects in the run config and dicts in YAML and Python.
_JSON_KEYS = ("model-options", "strategy-options", "partitioner-options")

# Keys renamed since earlier versions: named in the error, so an old config says what to write now.
_RENAMED = {"label-policy": "labels (values known | recovered)"}


def to_run_config(mapping: Mapping[str, Any] | None) -> dict[str, Any]:
    """snake_case names (YAML, Python) as Flower run config keys: ``num_server_rounds`` becomes
    ``num-server-rounds`` and a ``model_options`` dict the JSON string Flower needs. Hyphenated keys
    pass through, so the function is idempotent."""
    out: dict[str, Any] = {}
    for key, value in (mapping or {}).items():
        key = str(key).replace("_", "-")
        if key in _JSON_KEYS and isinstance(value, Mapping):
            value = json.dumps(dict(value), sort_keys=True)
        out[key] = value
    return out


def from_run_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The reverse of :func:`to_run_config`: snake_case keys, the JSON settings (``model_options``,
    ``strategy_options``, ``partitioner_options``) as dicts."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if key == "model-options" and isinstance(value, str):
            value = _parse_model_options(value)
        elif key == "strategy-options" and isinstance(value, str):
            value = parse_options(value)
        elif key == "partitioner-options" and isinstance(value, str):
            value = parse_partitioner_options(value)
        out[str(key).replace("-", "_")] = value
    return out


def resolve_config(*layers: Mapping[str, Any] | None, strict: bool = True) -> dict[str, Any]:
    """DEFAULTS overlaid by ``layers`` in order (later wins), coerced and checked against SCHEMA.

    Layers may use snake_case names (see :func:`to_run_config`). Keys not in the schema raise in
    ``strict`` mode and are dropped otherwise (a Flower context or ConfigRecord also carries keys of
    its own, such as ``server-round``)."""
    cfg = dict(DEFAULTS)
    for layer in layers:
        for key, value in to_run_config(layer).items():
            if key not in SETTINGS:
                if strict:
                    if key in _RENAMED:
                        raise RunConfigError(f"run config key {key!r} is now {_RENAMED[key]}")
                    raise RunConfigError(f"unknown run config key {key!r}; known: {', '.join(sorted(DEFAULTS))}")
                continue
            cfg[key] = SETTINGS[key].coerce(value)
    for key, value in cfg.items():
        SETTINGS[key].validate(value)
    try:  # the options must be ones the chosen strategy takes
        check_options(cfg["strategy"], cfg["strategy-options"])
    except StrategyOptionsError as err:
        raise RunConfigError(str(err)) from None
    problem = secagg.problem(cfg)  # secure aggregation with its settings, the strategy and the defense
    if problem:
        raise RunConfigError(problem)
    try:  # the partitioner must take its options (and Flower Datasets' own checks of them pass)
        make_partitioner(cfg["partitioning"], cfg["partitioner-options"], cfg["num-clients"], cfg["seed"], cfg)
    except PartitionError as err:
        raise RunConfigError(str(err)) from None
    return cfg


def model_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model-options`` JSON string of a run config, as a dict."""
    return _parse_model_options(cfg["model-options"])


def capture_rounds(cfg: Mapping[str, Any]) -> set[int] | str:
    """The rounds to capture: a set of round numbers, or "all"."""
    return _parse_capture_rounds(cfg["capture-rounds"])
