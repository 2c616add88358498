"""Model, data, the local plan a client runs (from the run config) and central evaluation."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedsim import dp_sgd
from fedsim.client_step import CLIENT_OPTIMIZERS, LocalPlan, OptimizerSpec, Schedule, one_step_plan
from fedsim.data import PartitionError, load_dataset, partition_dataset, sample_victims
from fedsim.data.partition import partition_table
from fedsim.defenses import DEFENSES, check_run
from fedsim.models import ModelSpec, build_model, set_dropout_mode
from fedsim.models.registry import model_family
from fedsim.run_config import RunConfigError, model_options


def model_spec(cfg: Mapping[str, Any]) -> ModelSpec:
    return ModelSpec(cfg["model"], cfg["dataset"], float(cfg["p"]), int(cfg["model-seed"]), model_options(cfg))


def make_model(cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """The configured model, with ``state`` loaded (cast to the model's dtype) when given. Under dp-sgd
    with ``dp-fix-model``, converted by Opacus' ModuleValidator.fix (server and clients alike)."""
    model = build_model(model_spec(cfg))
    if _dp_sgd(cfg) and cfg.get("dp-fix-model"):
        model, _ = dp_sgd.fix_model(model)
    if state is not None:
        model.load_state_dict(dict(state))  # load_state_dict copies, casting float64 to float32
    return model


def _dp_sgd(cfg: Mapping[str, Any]) -> bool:
    return DEFENSES[str(cfg["defense"])].in_local_round


def check_defense(cfg: Mapping[str, Any]) -> list[str]:
    """RunConfigError when the run's defense cannot be applied to its model (fedsim.defenses.check_run)
    or, under dp-sgd, to its model and clients' data (fedsim.dp_sgd); else what it changed in the model
    (dp-fix-model), one line per module."""
    if cfg.get("secagg"):
        # SecAgg+ quantizes and averages every state entry as a float (flwr's quantize), so an integer
        # buffer (BatchNorm's num_batches_tracked) would come back a float mean.
        ints = [k for k, v in make_model(cfg).state_dict().items() if not v.is_floating_point()]
        if ints:
            raise RunConfigError(
                f"secagg cannot run with model {cfg['model']}: SecAgg+ averages every state entry as a float, "
                f"and {ints[0]} is not floating point"
            )
    if _dp_sgd(cfg):
        return _check_dp_sgd(cfg)
    dtypes = (
        {k: v.dtype for k, v in make_model(cfg).state_dict().items()}
        if DEFENSES[str(cfg["defense"])].needs_float_state
        else None
    )
    problem = check_run(cfg, dtypes)
    if problem:
        raise RunConfigError(problem)
    return []


def _check_dp_sgd(cfg: Mapping[str, Any]) -> list[str]:
    model = build_model(model_spec(cfg))
    problems = dp_sgd.model_problems(model)
    changes: list[str] = []
    if problems and not cfg.get("dp-fix-model"):
        raise RunConfigError(
            f"defense dp-sgd cannot train model {cfg['model']} per example ({problems[0]}); "
            "--dp-fix-model converts it with Opacus' ModuleValidator.fix"
        )
    if problems:
        _, changes = dp_sgd.fix_model(model)
    # The smallest client decides: delta must stay below 1/n and the batch within its data.
    train = load_split(cfg, train=True)
    n = min(len(partition_indices(cfg, train, i, int(cfg["num-clients"]))) for i in range(int(cfg["num-clients"])))
    problem = dp_sgd.check_config(cfg, n)
    if problem:
        raise RunConfigError(problem)
    return changes


@functools.lru_cache(maxsize=4)
def _dataset(name: str, root: str, train: bool, channels: int | None, download: bool, source: str) -> Dataset:
    # Cached per process: a Ray actor serves many rounds and clients with one copy.
    return load_dataset(name, root, train=train, channels=channels, download=download, source=source)


def load_split(cfg: Mapping[str, Any], train: bool) -> Dataset:
    # A three-channel model (the paper's LeNet, ResNet-18) takes a grey dataset as 3 channels (the dataset table)
    channels = 3 if model_family(cfg["model"]).three_channel else None
    source = str(cfg.get("data-source", "builtin"))
    return _dataset(cfg["dataset"], str(cfg["data-root"]), train, channels, bool(cfg["download"]), source)


@functools.lru_cache(maxsize=8)
def _partitions(
    dataset: Dataset, num_partitions: int, kind: str, options: str, alpha: float, seed: int
) -> list[np.ndarray]:
    # Keyed by the dataset object (one per process, _dataset): every client of an actor reuses the split.
    table = partition_table(dataset)
    return partition_dataset(table, num_partitions, kind, options, seed, {"dirichlet-alpha": alpha})


def partition_indices(cfg: Mapping[str, Any], dataset: Dataset, partition_id: int, num_partitions: int) -> np.ndarray:
    """This client's indices, cut by the run's Flower Datasets partitioner (fedsim.data.partition); every
    client derives the same split from the shared seed. RunConfigError when the data cannot be split so."""
    try:
        parts = _partitions(
            dataset,
            num_partitions,
            str(cfg["partitioning"]),
            str(cfg.get("partitioner-options", "{}")),
            float(cfg["dirichlet-alpha"]),
            int(cfg["seed"]),
        )
    except PartitionError as err:
        raise RunConfigError(str(err)) from None
    return parts[partition_id]


def check_data(cfg: Mapping[str, Any]) -> None:
    """Load the training split and cut its partitions now (and the test split's, when clients evaluate):
    a source or partitioner that cannot serve this run is one RunConfigError or DataUnavailableError
    before anything starts or is written."""
    num_clients = int(cfg["num-clients"])
    partition_indices(cfg, load_split(cfg, train=True), 0, num_clients)
    if float(cfg["fraction-evaluate"]) > 0:
        partition_indices(cfg, load_split(cfg, train=False), 0, num_clients)


def local_plan(
    cfg: Mapping[str, Any],
    *,
    one_step: bool,
    seed: int,
    record_masks: bool = False,
    num_examples: int = 0,
    victim_set: bool = False,
) -> LocalPlan:
    """The client's round as the run config describes it: a training round (``local-epochs`` epochs,
    or ``local-steps`` batches, with the configured optimizer) or a one-step capture round. Under
    dp-sgd, ``num_examples`` (the client's data size: its sample rate) must be given; a round on a
    victim set (``one_step`` or ``victim_set``) keeps its fixed batches (fedsim.dp_sgd.spec_from_config)."""
    dp = None
    if _dp_sgd(cfg):
        if num_examples < 1:
            # The attacker's replay has no data size: it builds its own spec (attacker.captures.replay_plan).
            raise RunConfigError("dp-sgd: a round needs the client's data size (its sample rate)")
        dp = dp_sgd.spec_from_config(cfg, num_examples, fixed_batches=one_step or victim_set)
    if one_step:
        return replace(one_step_plan(float(cfg["onestep-lr"]), seed=seed, float64=bool(cfg["onestep-float64"])), dp=dp)
    steps = int(cfg["local-steps"])
    schedule = Schedule(
        epochs=int(cfg["local-epochs"]) if steps <= 0 else 10**9,
        batch_size=int(cfg["batch-size"]),
        max_steps=max(steps, 0),
        order=str(cfg["batch-order"]),
    )
    # The run config's momentum only for an optimizer that takes one; an unknown name is OptimizerSpec's to refuse.
    algorithm = CLIENT_OPTIMIZERS.get(str(cfg["optimizer"]))
    momentum = float(cfg["momentum"]) if algorithm is not None and algorithm.takes_momentum else 0.0
    optimizer = OptimizerSpec(str(cfg["optimizer"]), float(cfg["lr"]), momentum=momentum)
    return LocalPlan(schedule, optimizer, record_masks=record_masks, seed=seed, dp=dp)


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, batch_size: int = 1000) -> dict[str, float]:
    """Accuracy and mean cross-entropy with dropout off (eval mode)."""
    set_dropout_mode(model, "auto")
    model.eval()
    correct, loss_sum, n = 0, 0.0, 0
    for images, labels in DataLoader(data, batch_size=batch_size):
        logits = model(images)
        loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(1) == labels).sum())
        n += len(labels)
    return {"accuracy": correct / max(n, 1), "loss": loss_sum / max(n, 1)}


def victim_batch(
    cfg: Mapping[str, Any],
    dataset: Dataset,
    indices: np.ndarray,
    server_round: int,
    partition_id: int,
    count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` (default B) victims of this client's partition, drawn afresh per round (seeded by run
    seed, round, client)."""
    b = int(cfg["victim-batch-size"]) if count is None else count
    seed = int(np.random.SeedSequence([int(cfg["seed"]), server_round, partition_id]).generate_state(1)[0])
    ((images, labels),) = sample_victims(dataset, indices, k=b, batch_size=b, seed=seed)
    return images, labels
