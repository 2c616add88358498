"""Client partitions through Flower Datasets, and victim sampling.

The clients' shares are cut by a Flower Datasets partitioner (``flwr_datasets.partitioner``) over a
Hugging Face ``datasets.Dataset``: the columns the partitioner reads (the label, an id column), one row
per example in the dataset's order. :data:`PARTITIONERS` is the one table from the run config's
``partitioning`` name to the partitioner class and its parameters; ``partitioner-options`` (a JSON
object, Flower Datasets' parameter names) sets the rest. As Flower's ``FederatedDataset`` does, the
rows are shuffled with the run's seed before the partitioner sees them, and the seeded partitioners get
the same seed, so a partition is a function of (data, partitioner, options, number of clients, seed).
A partition is returned as the sorted row indices of the client's examples.

What Flower Datasets does not do stays here: drawing a client's victims (:func:`sample_victims`).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    import datasets

# The column of the partition table that holds each row's index in the dataset.
ROW = "__row__"
LABEL = "label"


class PartitionError(ValueError):
    """An unknown partitioner, a parameter it does not take or out of its range, or data it cannot split."""


@dataclass(frozen=True)
class Partitioner:
    """One entry of :data:`PARTITIONERS`: a Flower Datasets partitioner class and how the run fills it.

    ``class_name`` is looked up in ``flwr_datasets.partitioner`` when used (importing Flower Datasets pulls
    pyarrow and pandas: a run config check does not need them). ``fixed`` are the parameters the run
    sets itself (``num_partitions`` from num-clients, ``seed`` from seed); ``from_config`` maps a
    parameter to the run config key that supplies it; ``defaults`` are this project's defaults where
    Flower has none or the table sets one; ``minimum`` is each numeric parameter's lower bound,
    (bound, strict)."""

    name: str
    class_name: str
    help: str
    fixed: tuple[str, ...] = ("num_partitions", "seed")
    from_config: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    minimum: Mapping[str, tuple[float, bool]] = field(default_factory=dict)
    required: tuple[str, ...] = ()

    @property
    def cls(self) -> type:
        import flwr_datasets.partitioner as fp

        return getattr(fp, self.class_name)

    def params(self) -> tuple[str, ...]:
        """The parameters partitioner-options may set: the class's own, less those the run fills."""
        taken = set(self.fixed) | set(self.from_config)
        return tuple(p for p in inspect.signature(self.cls.__init__).parameters if p not in {"self", *taken})


PARTITIONERS: dict[str, Partitioner] = {
    p.name: p
    for p in (
        Partitioner(
            "iid",
            "IidPartitioner",
            "equal random shares (the seeded shuffle, then contiguous shards)",
            fixed=("num_partitions",),
        ),
        Partitioner(
            "dirichlet",
            "DirichletPartitioner",
            "label skew: each class's shares drawn from Dirichlet(dirichlet-alpha)",
            from_config={"alpha": "dirichlet-alpha"},
            defaults={"partition_by": LABEL},
            minimum={"min_partition_size": (0, False)},
        ),
        Partitioner(
            "pathological",
            "PathologicalPartitioner",
            "each client holds num_classes_per_partition classes (default 2)",
            defaults={"partition_by": LABEL, "num_classes_per_partition": 2},
            minimum={"num_classes_per_partition": (1, False)},
        ),
        Partitioner(
            "shard",
            "ShardPartitioner",
            "sort by label, cut into shards, num_shards_per_partition (default 2) per client",
            defaults={"partition_by": LABEL, "num_shards_per_partition": 2},
            minimum={"num_shards_per_partition": (1, False), "shard_size": (1, False)},
        ),
        Partitioner(
            "natural-id",
            "NaturalIdPartitioner",
            "one client per value of an id column (partition_by: the column; as many values as clients)",
            fixed=(),
            required=("partition_by",),
        ),
    )
}


def parse_options(text: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """``partitioner-options`` (a JSON object string, or a dict already) as a dict."""
    if isinstance(text, Mapping):
        return dict(text)
    try:
        options = json.loads(text or "{}")
    except json.JSONDecodeError:
        raise PartitionError(f"partitioner-options must be a JSON object, got {text!r}") from None
    if not isinstance(options, dict):
        raise PartitionError(f"partitioner-options must be a JSON object, got {text!r}")
    return options


def partitioner_kwargs(
    name: str, options: str | Mapping[str, Any] | None, num_partitions: int, seed: int, config: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments of partitioner ``name``'s class for this run; PartitionError naming what is
    wrong (an unknown partitioner, a parameter it does not take, one out of range or missing)."""
    entry = PARTITIONERS.get(name)
    if entry is None:
        raise PartitionError(f"unknown partitioner {name!r}; known: {', '.join(PARTITIONERS)}")
    given = parse_options(options)
    # The class's signature only where there are options to check: it imports Flower Datasets
    # (datasets, pandas, pyarrow, seaborn: about 1.5 s of CPU), which a run config check, the
    # attacker and the ServerApp never need otherwise.
    params = entry.params() if given else ()
    for key in given:
        if key in entry.from_config:
            raise PartitionError(f"partitioner {name}: set {key} with the run config key {entry.from_config[key]}")
        if key in entry.fixed:
            raise PartitionError(f"partitioner {name}: {key} is set by the run (num-clients, seed), not an option")
        if key not in params:
            raise PartitionError(f"partitioner {name} takes no parameter {key!r}; it takes: {', '.join(params)}")
    kwargs: dict[str, Any] = {"num_partitions": num_partitions, "seed": seed}
    kwargs = {k: v for k, v in kwargs.items() if k in entry.fixed}
    kwargs.update({param: config[key] for param, key in entry.from_config.items()})
    kwargs.update(entry.defaults)
    kwargs.update(given)
    for key in entry.required:
        if key not in kwargs:
            raise PartitionError(
                f'partitioner {name} needs {key} in partitioner-options, e.g. \'{{"{key}": "writer_id"}}\''
            )
    for key, (bound, strict) in entry.minimum.items():
        value = kwargs.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PartitionError(f"partitioner {name}: {key} must be a number, got {value!r}")
        if value < bound or (strict and value == bound):
            raise PartitionError(
                f"partitioner {name}: {key} must be {'>' if strict else '>='} {bound:g}; got {value!r}"
            )
    if "num_partitions" in kwargs and num_partitions < 1:
        raise PartitionError(f"partitioner {name}: num-clients must be >= 1, got {num_partitions}")
    return kwargs


def make_partitioner(
    name: str, options: str | Mapping[str, Any] | None, num_partitions: int, seed: int, config: Mapping[str, Any]
) -> Any:
    """The Flower Datasets partitioner for this run (no data yet); its own checks (alpha > 0, ...) as
    PartitionError."""
    return _construct(name, partitioner_kwargs(name, options, num_partitions, seed, config))


def _construct(name: str, kwargs: Mapping[str, Any]) -> Any:
    try:
        return PARTITIONERS[name].cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise PartitionError(f"partitioner {name} ({_show(kwargs)}): {err}") from None


def _show(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def label_table(labels: Sequence[int] | np.ndarray | torch.Tensor, **columns: Sequence[Any]) -> datasets.Dataset:
    """A partition table: a ``datasets.Dataset`` with the ``label`` column (and any other columns given,
    e.g. an id column) of a dataset whose images live elsewhere (the built-in torch datasets)."""
    import datasets

    from .hf import quiet

    y = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels).reshape(-1).astype(np.int64)
    with quiet():
        return datasets.Dataset.from_dict({LABEL: y, **{k: list(v) for k, v in columns.items()}})


def partition_dataset(
    table: datasets.Dataset,
    num_partitions: int,
    name: str = "iid",
    options: str | Mapping[str, Any] | None = None,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
) -> list[np.ndarray]:
    """Split the rows of ``table`` (a ``datasets.Dataset``: its images are not read) among
    ``num_partitions`` clients with partitioner ``name``: per client, the sorted row indices.

    Deterministic for a seed. PartitionError when the partitioner cannot split this data: a client
    left without data (more clients than examples), a column missing, Flower's own refusals (no
    Dirichlet draw gave every client min_partition_size examples, ...)."""
    config = {"dirichlet-alpha": 0.5, **(config or {})}
    kwargs = partitioner_kwargs(name, options, num_partitions, seed, config)
    partitioner = _construct(name, kwargs)
    by = kwargs.get("partition_by")
    if by is not None and by not in table.column_names:
        raise PartitionError(
            f"partitioner {name}: the data has no column {by!r} to partition by; its columns: "
            f"{', '.join(c for c in table.column_names if c != ROW)}"
        )
    if len(table) < num_partitions:
        raise PartitionError(f"cannot split {len(table)} examples among {num_partitions} clients (each needs one)")
    keep = [c for c in table.column_names if c in (by, LABEL)]
    with _quiet():
        rows = table.select_columns(keep or table.column_names[:1])
        rows = rows.add_column(ROW, np.arange(len(table), dtype=np.int64))
        # As FederatedDataset(shuffle=True, seed=seed): the rows are shuffled before partitioning.
        partitioner.dataset = rows.shuffle(seed=seed)
        try:
            if partitioner.num_partitions != num_partitions:  # natural-id: one client per id value
                raise PartitionError(
                    f"partitioner {name}: column {by!r} has {partitioner.num_partitions} distinct values, "
                    f"so the run needs num-clients {partitioner.num_partitions}, not {num_partitions}"
                )
            parts = [
                np.sort(np.asarray(partitioner.load_partition(i)[ROW], dtype=np.int64)) for i in range(num_partitions)
            ]
        except PartitionError:
            raise
        except (ValueError, KeyError, TypeError, ArithmeticError) as err:  # Flower's refusals (a shard of 0 rows: 1/0)
            raise PartitionError(
                f"partitioner {name} cannot split these {len(table)} examples among {num_partitions} clients "
                f"({type(err).__name__}: {err}); use fewer clients or other partitioner-options"
            ) from None
    empty = [i for i, part in enumerate(parts) if len(part) == 0]
    if empty:
        raise PartitionError(
            f"partitioner {name} left client(s) {', '.join(map(str, empty[:5]))} without data "
            f"({len(table)} examples, {num_partitions} clients); use fewer clients or other options"
        )
    return parts


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Flower Datasets' warnings (Dirichlet redraws, classes left unused) and progress bars off: a
    partition that cannot be made is one PartitionError, one that can is silent."""
    from .hf import quiet

    # The natural-id partitioner draws a tqdm bar that no argument turns off (tqdm reads TQDM_DISABLE
    # only when it is imported); the bar writes to sys.stderr, so the block's stderr goes to a buffer
    # that is dropped. Errors leave the block as exceptions, and loggers keep the stream they were given.
    with quiet(), warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def partition_table(dataset: Dataset) -> datasets.Dataset:
    """The partition table of a torch dataset: a Hugging Face dataset's own columns (less the images),
    or the labels of a built-in one as a ``datasets.Dataset``."""
    from .datasets import dataset_labels

    table = getattr(dataset, "table", None)
    return table if table is not None else label_table(dataset_labels(dataset))


def partition_iid(num_items: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """IID partitions of ``range(num_items)`` through Flower Datasets' IidPartitioner (sorted parts,
    sizes differ by at most one)."""
    return partition_dataset(label_table(np.zeros(num_items, dtype=np.int64)), num_clients, "iid", seed=seed)


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
        raise ValueError(f"the client's partition holds {len(indices)} items, fewer than the k={k} victims requested")
    chosen = np.random.default_rng(seed).choice(indices, size=k, replace=False)
    batches = []
    for start in range(0, k, batch_size):
        items = [dataset[int(i)] for i in chosen[start : start + batch_size]]
        images = torch.stack([torch.as_tensor(img) for img, _ in items])
        labels = torch.tensor([int(lbl) for _, lbl in items], dtype=torch.int64)
        batches.append((images, labels))
    return batches
