"""Model, data and the small local loops a client and the server run (plain torch: the loops are tiny)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedsim.data import dataset_labels, load_dataset, partition_dirichlet, partition_iid, sample_victims
from fedsim.models import ModelSpec, build_model, get_recorded_masks, set_dropout_mode
from fedsim.models.registry import THREE_CHANNEL_MODELS
from fedsim.run_config import model_options


def model_spec(cfg: Mapping[str, Any]) -> ModelSpec:
    return ModelSpec(cfg["model"], cfg["dataset"], float(cfg["p"]), int(cfg["model-seed"]), model_options(cfg))


def make_model(cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """The configured model, with ``state`` loaded (cast to the model's dtype) when given."""
    model = build_model(model_spec(cfg))
    if state is not None:
        model.load_state_dict(dict(state))  # load_state_dict copies, casting float64 to float32
    return model


@functools.lru_cache(maxsize=4)
def _dataset(name: str, root: str, train: bool, channels: int | None, download: bool) -> Dataset:
    # Cached per process: a Ray actor serves many rounds and clients with one copy.
    return load_dataset(name, root, train=train, channels=channels, download=download)


def load_split(cfg: Mapping[str, Any], train: bool) -> Dataset:
    channels = 3 if cfg["model"] in THREE_CHANNEL_MODELS and cfg["dataset"] == "mnist" else None
    return _dataset(cfg["dataset"], str(cfg["data-root"]), train, channels, bool(cfg["download"]))


@functools.lru_cache(maxsize=8)
def _partitions(
    n: int, num_partitions: int, kind: str, alpha: float, seed: int, labels: tuple[int, ...] | None
) -> list[np.ndarray]:
    if kind == "dirichlet":
        return partition_dirichlet(np.asarray(labels), num_partitions, alpha, seed)
    return partition_iid(n, num_partitions, seed)


def partition_indices(cfg: Mapping[str, Any], dataset: Dataset, partition_id: int, num_partitions: int) -> np.ndarray:
    """This client's indices; every client derives the same split from the shared seed."""
    labels = tuple(dataset_labels(dataset).tolist()) if cfg["partitioning"] == "dirichlet" else None
    parts = _partitions(
        len(dataset), num_partitions, cfg["partitioning"], float(cfg["dirichlet-alpha"]), int(cfg["seed"]), labels
    )
    return parts[partition_id]


def _optimizer(cfg: Mapping[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    if cfg["optimizer"] == "adam":
        return torch.optim.Adam(model.parameters(), lr=float(cfg["lr"]))
    return torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]), momentum=float(cfg["momentum"]))


def train_local(
    model: nn.Module, data: Dataset, cfg: Mapping[str, Any], seed: int = 0
) -> dict[str, float]:
    """Local training with the model's own dropout (sampling): ``local-epochs`` epochs, or
    ``local-steps`` batches when that is positive. Returns the mean training loss and step count."""
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(data, batch_size=int(cfg["batch-size"]), shuffle=True, generator=generator)
    optimizer = _optimizer(cfg, model)
    set_dropout_mode(model, "auto")
    model.train()
    max_steps = int(cfg["local-steps"])
    epochs = int(cfg["local-epochs"]) if max_steps <= 0 else 10**9
    steps, total = 0, 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # reproducible dropout masks for a given round and client
        for _ in range(epochs):
            for images, labels in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
                total += loss.detach().item()
                steps += 1
                if 0 < max_steps <= steps:
                    break
            if 0 < max_steps <= steps:
                break
    return {"train-loss": total / max(steps, 1), "local-steps": float(steps)}


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


@dataclass
class OneStepResult:
    """A client's one plain-SGD step on its victim batch, and the ground truth behind it."""

    local_state: dict[str, torch.Tensor]
    gradient: list[torch.Tensor]  # model.parameters() order
    param_names: list[str]
    images: torch.Tensor
    labels: torch.Tensor
    masks: list[torch.Tensor]
    loss: float


def victim_batch(
    cfg: Mapping[str, Any], dataset: Dataset, indices: np.ndarray, server_round: int, partition_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """B victims of this client's partition, drawn afresh per round (seeded by run seed, round, client)."""
    b = int(cfg["victim-batch-size"])
    seed = int(np.random.SeedSequence([int(cfg["seed"]), server_round, partition_id]).generate_state(1)[0])
    ((images, labels),) = sample_victims(dataset, indices, k=b, batch_size=b, seed=seed)
    return images, labels


def one_step(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, lr: float, float64: bool = True, seed: int = 0
) -> OneStepResult:
    """One plain SGD step (mean cross-entropy over the batch) with the dropout masks recorded.

    With ``float64`` the new weights are computed and returned in float64, so that the server's
    (global - local) / lr gives back the float32 gradient to within float64 rounding."""
    set_dropout_mode(model, "record")
    model.train()
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss = F.cross_entropy(model(images), labels)
    grads = torch.autograd.grad(loss, params)
    masks = [m.clone() for m in get_recorded_masks(model)]
    set_dropout_mode(model, "auto")
    dtype = torch.float64 if float64 else None
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    local = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in state.items()}
    for name, grad in zip(names, grads):
        local[name] = local[name] - lr * grad.to(local[name].dtype)
    return OneStepResult(local, [g.detach() for g in grads], names, images, labels, masks, loss.detach().item())
