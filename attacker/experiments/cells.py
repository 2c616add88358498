"""The parts of an experiment: its cells, the experiment a file describes, and the command line's
settings on top (parsed by ``spec``, expanded from grids by ``grids``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsim.run_config import DEFAULTS, resolve_config, to_run_config
from fedsim.task import local_plan

from ..config import ConfigError
from ..profiles import DEFAULT_PROFILE

CELL_KEYS = {
    "id",
    "model",
    "dataset",
    "p",
    "victim_batch_size",
    "attacks",
    "overrides",
    "model_options",
    "victims",
    "optional",
    "paper",
    "federation",
}


class ExperimentError(ConfigError):
    """An experiment file or an output folder the user must fix."""


@dataclass
class Cell:
    experiment: str
    id: str
    model: str
    dataset: str
    p: float
    victim_batch_size: int
    attacks: list[str]
    overrides: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] = field(default_factory=dict)
    victims: dict[str, Any] = field(default_factory=dict)
    optional: bool = False
    paper: dict[str, Any] = field(default_factory=dict)
    # Run config settings of the cell's own federation (e.g. a defense): with them, the cell's victims
    # are that federation's captured round and its accuracy is that federation's (attacker.experiments.run).
    federation: dict[str, Any] = field(default_factory=dict)

    @property
    def B(self) -> int:
        """The paper's symbol for the victim batch size, used in labels and report columns."""
        return self.victim_batch_size

    @property
    def key(self) -> str:
        return f"{self.experiment}-{self.id}"

    @property
    def local_round(self) -> dict[str, Any] | None:
        """The victims' FedAvg round (victims.local_round), or None for the paper's one step."""
        return self.victims.get("local_round")

    @property
    def local_steps(self) -> int | None:
        """K, the local steps of the cell's FedAvg round (None: the one-step setting)."""
        if self.local_round is None:
            return None
        cfg = resolve_config(to_run_config(self.local_round))
        return len(local_plan(cfg, one_step=False, seed=0).schedule.batches(self.victim_batch_size, 0))

    @property
    def optimizer(self) -> str | None:
        return None if self.local_round is None else str(self.local_round.get("optimizer", DEFAULTS["optimizer"]))

    def local_round_label(self) -> str | None:
        r = self.local_round
        if r is None:
            return None
        return (
            f"N={self.victim_batch_size} b={r.get('batch_size', DEFAULTS['batch-size'])} "
            f"E={r.get('local_epochs', DEFAULTS['local-epochs'])} {self.optimizer} lr={r.get('lr', DEFAULTS['lr'])}"
        )

    def federated(self, settings: Settings) -> bool:
        """Whether the cell's victims are a federation's captured round: the command line asks for
        federated victims, or the cell runs its own federation (e.g. a defense), then always."""
        return settings.victim_source == "federated" or bool(self.federation)

    def label(self, iterations: int | None = None) -> str:
        """The cell in words; ``iterations`` (the command line's --iterations) replaces the config's
        cap, so a caption never shows a cap the run did not use."""
        overrides = dict(self.overrides)
        if iterations is not None:
            overrides["max_iterations"] = iterations
        extra = "".join(f", {k}={v}" for k, v in {**self.federation, **overrides}.items())
        return f"{self.model}/{self.dataset} p={self.p:g} B={self.B}{extra}"


@dataclass
class Experiment:
    name: str
    title: str
    source: str
    victims: dict[str, Any]
    attack_overrides: dict[str, Any]
    metrics: list[str]
    accuracy: dict[str, Any] | None
    figures: list[dict[str, Any]]
    cells: list[Cell]
    path: Path | None = None


@dataclass
class Settings:
    """What the command line decides on top of the experiment files."""

    victims: int | None = None  # victim images per cell (rounded up to a multiple of B); None: the file's count
    iterations: int | None = None
    device: str = "auto"
    # paper: the paper's victim files; builtin: a client's partition of the dataset; federated: the
    # curious server's round-1 captures of a Flower simulation (one victim batch per client)
    victim_source: str = "paper"
    federation_dir: str = "federations"  # where federated victim sources go (under the output folder)
    data_root: str = "data"
    lpips: bool = True
    cells: list[str] = field(default_factory=list)  # patterns on "<experiment>-<cell>"
    include_optional: bool = False
    accuracy: bool = True
    fl_rounds: int = 3
    fl_local_steps: int = 0
    fl_clients: int | None = None
    progress: bool = True
    seed: int = 0
    profile: str = DEFAULT_PROFILE  # attack settings per model family (attacker.profiles)


def need(cond: bool, where: str, msg: str) -> None:
    """An ExperimentError naming where in the file and what is wrong, unless ``cond``."""
    if not cond:
        raise ExperimentError(f"{where}: {msg}")
