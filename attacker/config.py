"""Attack run configuration: YAML in, validated, resolved, and written beside the results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from fedsim.client_step import LocalPlan, LocalPlanError
from fedsim.data import PAPER_VICTIMS
from fedsim.models import ModelSpec, ModelSpecError
from fedsim.models.registry import validate_spec
from fedsim.run_config import DEFAULTS, LABEL_POLICIES, RunConfigError, from_run_config, resolve_config, to_run_config
from fedsim.task import local_plan

from .attacks import AttackConfig, AttackConfigError, attack_names, make_attack
from .engine.checkpoints import CHECKPOINT_EVERY
from .engine.optimizers import ATTACK_OPTIMIZERS
from .profiles import BASE_PROFILE, DEFAULT_PROFILE, ProfileError, check_profile, profile_settings

# auto: a GPU when there is one; gpu and cuda: an NVIDIA GPU; mps: Apple's (Lightning's accelerator names).
DEVICES = ("auto", "cpu", "gpu", "cuda", "mps")
LOCAL_ROUND_KEYS = {"local_epochs", "local_steps", "batch_size", "optimizer", "lr", "momentum", "batch_order"}


class ConfigError(ValueError):
    """A configuration the user must fix: the message names the key and the problem."""


# The settings an attack config shares with the federation take their names and defaults from the
# one schema (fedsim.run_config), in its snake_case form.
_FED = from_run_config(DEFAULTS)


VICTIM_SOURCES = ("builtin", "paper", "file", "captures")


@dataclass
class VictimConfig:
    # builtin: a client's partition; paper: the paper's victims of `dataset` (fetched on first use);
    # file: a victim file; captures: a federated run
    source: str = "builtin"
    model: str = _FED["model"]
    dataset: str = _FED["dataset"]
    p: float = _FED["p"]
    model_options: dict[str, Any] = field(default_factory=lambda: dict(_FED["model_options"]))
    victim_batch_size: int = _FED["victim_batch_size"]
    count: int = 8  # victim images (count / victim_batch_size jobs per attack)
    file: str | None = None
    captures: str | None = None  # a federated run folder (with captures/, and oracle/ when audited)
    max_captures: int = 0  # 0: every gradient capture in the run
    data_root: str = _FED["data_root"]
    num_clients: int = _FED["num_clients"]
    client: int = 0
    seed: int = _FED["seed"]
    model_seed: int = _FED["model_seed"]
    # Offline FedAvg victims: each client runs this local round on its victim_batch_size images and
    # shares its update (run-config names: local_epochs, local_steps, batch_size, optimizer, lr,
    # momentum, batch_order). None: one step, a shared gradient (the paper).
    local_round: dict[str, Any] | None = None


@dataclass
class RunConfig:
    victims: VictimConfig = field(default_factory=VictimConfig)
    attacks: list[str] = field(default_factory=lambda: ["ig_eval", "wiig", "dia"])
    attack_overrides: dict[str, Any] = field(default_factory=dict)
    labels: str = _FED["labels"]  # known (the paper) or recovered (from the gradient)
    device: str = "auto"
    seed: int = 0
    lpips: bool = True
    checkpoint_every: int = CHECKPOINT_EVERY
    profile: str = DEFAULT_PROFILE  # the attack settings per model family (attacker.profiles)
    # an attack that needs what a capture may lack (dia_span: the images' span) is skipped, the reason kept,
    # where a job lacks it (the audit's defaults), instead of refused (an attack the user named)
    skip_inapplicable: bool = False
    max_unroll_gb: float = 8.0  # memory for replaying FedAvg updates: groups are sized to fit, larger rounds refused

    def attack_configs(self) -> list[AttackConfig]:
        return [make_attack(name, **self.attack_overrides) for name in attack_names(self.attacks)]

    def for_model(
        self, attack: AttackConfig, spec: ModelSpec, fits: Callable[[AttackConfig], bool] | None = None
    ) -> AttackConfig:
        """``attack`` with the profile's settings for ``spec``'s family and dataset, except where the
        config's attack_overrides set them (the user's word wins). ``fits`` says whether the job can take
        the settings (an optimizer that holds the masks at their init, as L-BFGS, needs masks it does not
        have to learn: engine/lbfgs.py); where it cannot, the job takes the paper's settings for the family."""
        settings = profile_settings(self.profile, spec.name, spec.dataset)
        fitted = replace(attack, **{k: v for k, v in settings.items() if k not in self.attack_overrides})
        fixed = ATTACK_OPTIMIZERS[fitted.optimizer].needs_fixed_masks and "optimizer" not in self.attack_overrides
        if fits is not None and fixed and not fits(fitted):
            settings = profile_settings(BASE_PROFILE, spec.name, spec.dataset)
            fitted = replace(attack, **{k: v for k, v in settings.items() if k not in self.attack_overrides})
        return fitted

    def model_spec(self) -> ModelSpec:
        v = self.victims
        return ModelSpec(v.model, v.dataset, float(v.p), v.model_seed, dict(v.model_options))

    def local_plan(self) -> LocalPlan | None:
        """The victims' local round as fedsim's client step describes it (the same reader as the client's)."""
        if self.victims.local_round is None:
            return None
        cfg = resolve_config(to_run_config(self.victims.local_round))
        return local_plan(cfg, one_step=False, seed=self.seed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_keys(data: dict, cls: type, where: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(where + '.' + k if where else k for k in unknown)}; allowed: {sorted(known)}"
        )


def _expect(value: Any, types: type | tuple, key: str) -> None:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ConfigError(f"{key} must be {getattr(types, '__name__', types)}, got {value!r}")
    if not isinstance(value, types):
        name = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{key} must be {name}, got {value!r}")


def parse_config(data: dict[str, Any]) -> RunConfig:
    """Validate a config mapping (unknown keys, types, ranges) and return the resolved config."""
    _check_keys(data, RunConfig, "")
    victims = data.get("victims") or {}
    _check_keys(victims, VictimConfig, "victims")
    victims = dict(victims)
    if not isinstance(data.get("attack_overrides") or {}, dict):
        raise ConfigError("attack_overrides must be a mapping of attack settings")
    if "attacks" in data and (
        not isinstance(data["attacks"], list) or not all(isinstance(a, str) for a in data["attacks"])
    ):
        raise ConfigError("attacks must be a list of attack names")
    for key, types in (("model", str), ("dataset", str), ("source", str), ("data_root", str)):
        if key in victims:
            _expect(victims[key], types, f"victims.{key}")
    for key in ("victim_batch_size", "count", "num_clients", "client", "seed", "model_seed", "max_captures"):
        if key in victims:
            _expect(victims[key], int, f"victims.{key}")
    if "p" in victims:
        _expect(victims["p"], (int, float), "victims.p")
    cfg = RunConfig(victims=VictimConfig(**victims), **{k: v for k, v in data.items() if k != "victims"})
    v = cfg.victims
    if v.source not in VICTIM_SOURCES:
        raise ConfigError(f"victims.source must be one of {', '.join(VICTIM_SOURCES)}, got {v.source!r}")
    if v.source == "paper" and v.dataset not in PAPER_VICTIMS:
        raise ConfigError(
            f"victims.source 'paper' needs a dataset with the paper's victims "
            f"({', '.join(PAPER_VICTIMS)}), got {v.dataset!r}"
        )
    if v.source == "file" and not v.file:
        raise ConfigError("victims.file is required when victims.source is 'file'")
    if v.source == "captures" and not v.captures:
        raise ConfigError("victims.captures (a federated run folder) is required when victims.source is 'captures'")
    if not 0 <= v.p < 1:
        raise ConfigError(f"victims.p must be in [0, 1), got {v.p}")
    if v.victim_batch_size <= 0:
        raise ConfigError(f"victims.victim_batch_size must be positive, got {v.victim_batch_size}")
    if v.count <= 0 or v.count % v.victim_batch_size:
        raise ConfigError(
            f"victims.count must be a positive multiple of victim_batch_size ({v.victim_batch_size}), got {v.count}"
        )
    if v.local_round is not None:
        if not isinstance(v.local_round, dict):
            raise ConfigError("victims.local_round must be a mapping of local-training settings")
        unknown = sorted(set(v.local_round) - LOCAL_ROUND_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown key(s) victims.local_round.{', '.join(unknown)}; allowed: {sorted(LOCAL_ROUND_KEYS)}"
            )
        if v.source == "captures":
            raise ConfigError("victims.local_round describes offline victims; captures carry their own round")
        try:
            cfg.local_plan()
        except (RunConfigError, LocalPlanError) as err:
            raise ConfigError(f"victims.local_round: {err}") from None
    if not 0 <= v.client < v.num_clients:
        raise ConfigError(f"victims.client must be in [0, {v.num_clients}), got {v.client}")
    if cfg.labels not in LABEL_POLICIES:
        raise ConfigError(f"labels must be one of {', '.join(LABEL_POLICIES)}, got {cfg.labels!r}")
    try:
        check_profile(cfg.profile)
    except ProfileError as err:
        raise ConfigError(str(err)) from None
    if cfg.device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {cfg.device!r}")
    if not isinstance(cfg.attacks, list) or not cfg.attacks:
        raise ConfigError("attacks must be a non-empty list of attack names")
    _expect(cfg.skip_inapplicable, bool, "skip_inapplicable")
    _expect(cfg.max_unroll_gb, (int, float), "max_unroll_gb")
    if not cfg.max_unroll_gb > 0:
        raise ConfigError(f"max_unroll_gb must be positive, got {cfg.max_unroll_gb}")
    _expect(cfg.checkpoint_every, int, "checkpoint_every")
    if cfg.checkpoint_every <= 0:
        raise ConfigError(f"checkpoint_every must be positive, got {cfg.checkpoint_every}")
    try:
        validate_spec(cfg.model_spec())
        cfg.attack_configs()
    except (ModelSpecError, AttackConfigError, TypeError) as err:
        raise ConfigError(str(err)) from None
    return cfg


def load_config(path: str | Path) -> RunConfig:
    return parse_config(read_config_data(path))


def read_config_data(path: str | Path) -> dict[str, Any]:
    """A config file's mapping as written, not yet validated: the CLI lays its flags over it first, so
    that e.g. ``--model resnet18`` and the file's ``model_options`` are checked together."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config path {path} is a directory, not a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config {path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of settings, not a {type(data).__name__}")
    return data or {}


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
