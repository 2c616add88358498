"""Client partitions (IID and label-skewed Dirichlet) and victim sampling.

Every function takes an explicit seed and uses its own numpy Generator, so results are
reproducible and independent of global random state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset


def _check_clients(num_items: int, num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_items < num_clients:
        raise ValueError(
            f"cannot split {num_items} items among {num_clients} clients (each needs at least one)"
        )


def partition_iid(num_items: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(num_items)`` and cut it into ``num_clients`` near-equal parts (sizes differ
    by at most one). Each part is sorted; parts are disjoint and cover every item."""
    _check_clients(num_items, num_clients)
    order = np.random.default_rng(seed).permutation(num_items)
    return [np.sort(part).astype(np.int64) for part in np.array_split(order, num_clients)]


def partition_dirichlet(
    labels: Sequence[int] | np.ndarray | torch.Tensor,
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 1,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed split: for each class, client shares are drawn from Dirichlet(alpha).

    Small ``alpha`` concentrates each class on few clients (strong skew); large ``alpha``
    approaches IID. Draws are repeated (up to ``max_tries``, deterministically from ``seed``)
    until every client holds at least ``min_size`` items; otherwise ValueError.
    """
    y = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels).reshape(-1)
    y = y.astype(np.int64)
    _check_clients(len(y), num_clients)
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    if min_size * num_clients > len(y):
        raise ValueError(
            f"min_size={min_size} x {num_clients} clients exceeds the {len(y)} items available"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    for _ in range(max_tries):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for cls in classes:
            idx = rng.permutation(np.flatnonzero(y == cls))
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            # Cumulative cut points turn fractional shares into whole, exhaustive slices.
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
            for client, part in enumerate(np.split(idx, cuts)):
                buckets[client].append(part)
        parts = [np.sort(np.concatenate(b)).astype(np.int64) for b in buckets]
        if min(len(p) for p in parts) >= min_size:
            return parts
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split gave every one of {num_clients} clients at least "
        f"{min_size} items in {max_tries} tries; lower min_size or raise alpha"
    )


def sample_victims(
    dataset: Dataset,
    partition_indices: Sequence[int] | np.ndarray,
    k: int = 128,
    batch_size: int = 1,
    seed: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Draw ``k`` distinct items of one client's partition and group them into batches.

    Returns ``k // batch_size`` pairs ``(images BxCxHxW, labels int64 B)``. ``k`` must be a
    multiple of ``batch_size`` (the paper's 128 victims with B in {1, 4, 8, 16}), so no victim is
    silently dropped; ValueError if not, or if the partition holds fewer than ``k`` items.
    """
    indices = np.asarray(partition_indices, dtype=np.int64).reshape(-1)
    if k < 1 or batch_size < 1:
        raise ValueError(f"k and batch_size must be >= 1, got k={k}, batch_size={batch_size}")
    if k % batch_size != 0:
        raise ValueError(f"k={k} is not a multiple of batch_size={batch_size}")
    if len(np.unique(indices)) != len(indices):
        raise ValueError("partition_indices contains duplicates")
    if len(indices) < k:
        raise ValueError(
            f"the client's partition holds {len(indices)} items, fewer than the k={k} victims requested"
        )
    chosen = np.random.default_rng(seed).choice(indices, size=k, replace=False)
    batches = []
    for start in range(0, k, batch_size):
        items = [dataset[int(i)] for i in chosen[start : start + batch_size]]
        images = torch.stack([torch.as_tensor(img) for img, _ in items])
        labels = torch.tensor([int(lbl) for _, lbl in items], dtype=torch.int64)
        batches.append((images, labels))
    return batches
