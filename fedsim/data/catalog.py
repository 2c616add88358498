"""The datasets, one table: each dataset's names, shape, classes, normalization, loader and the
paper's victim set, so that adding a dataset is one entry of ``DATASETS``. Everything that depends
on which dataset it is reads its entry: :func:`get_spec` (the normalization), :func:`load_dataset`,
the paper's victims (``victim_sets``) and the model table's input shapes (``fedsim.models.registry``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch.utils.data import Dataset

from .datasets import TorchvisionFiles, cifar10_fallback, imagenet_folder, mnist_fallback
from .errors import DataUnavailableError
from .hf import BUILTIN, load_hf, parse_source
from .normalization import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    MNIST_MEAN,
    MNIST_STD,
    DatasetSpec,
)


class Loader(Protocol):
    """How an entry's images are read: (data root, train split?, spec, download allowed?, timeout)."""

    def __call__(self, root: Path, train: bool, spec: DatasetSpec, download: bool, timeout_s: float) -> Dataset: ...


@dataclass(frozen=True)
class VictimSet:
    """One of the paper's victim files (``victim_sets``): its name, pinned hash and tensor shape."""

    dataset: str
    filename: str
    sha256: str
    shape: tuple[int, int, int, int]


@dataclass(frozen=True)
class DatasetEntry:
    """One dataset. ``channels``: the channel counts it is fed with, its own first; a grey dataset may
    also list 3 (the paper feeds MNIST so to LeNet and ResNet-18), its one channel repeated with its
    mean and std. ``title``: its name in messages; ``aliases``: other spellings users write."""

    name: str
    title: str
    channels: tuple[int, ...]
    image_size: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    load: Loader
    aliases: tuple[str, ...] = ()
    victims: VictimSet | None = None  # the paper's victim images of this dataset, if it has some


DATASETS: dict[str, DatasetEntry] = {
    e.name: e
    for e in (
        DatasetEntry(
            "mnist",
            "MNIST",
            (1, 3),
            28,
            10,
            MNIST_MEAN,
            MNIST_STD,
            TorchvisionFiles("MNIST", "MNIST/raw", mnist_fallback),
            victims=VictimSet(
                "mnist",
                "MNIST_128.tdump",
                "6bc361169e1a06e661e9078507b8513ea4971410d34c2fcf185719242974c8e2",
                (128, 1, 28, 28),
            ),
        ),
        DatasetEntry(
            "cifar10",
            "CIFAR-10",
            (3,),
            32,
            10,
            CIFAR10_MEAN,
            CIFAR10_STD,
            TorchvisionFiles("CIFAR10", "cifar-10-batches-py", cifar10_fallback),
            aliases=("cifar-10", "cifar_10"),
            victims=VictimSet(
                "cifar10",
                "CIFAR10_128.tdump",
                "b0d591f982736658802f61e311b89679b4f113b1f8bfd0c3e5e406dd7ad6dd74",
                (128, 3, 32, 32),
            ),
        ),
        DatasetEntry(
            "imagenet",
            "ImageNet",
            (3,),
            224,
            1000,
            IMAGENET_MEAN,
            IMAGENET_STD,
            imagenet_folder,
            aliases=("imagenet1k", "imagenet-1k"),
        ),
    )
}

# The paper's victim sets by dataset (victim_sets reads and tests pin this one dict).
PAPER_VICTIMS: dict[str, VictimSet] = {e.name: e.victims for e in DATASETS.values() if e.victims is not None}


def canonical_name(name: str) -> str:
    """Map a user-facing dataset name (its table name or an alias, any case) to its table name."""
    key = name.strip().lower()
    # read from the table on each call (a handful of entries), so an entry added later is found too
    aliases = {alias: e.name for e in DATASETS.values() for alias in (e.name, *e.aliases)}
    if key not in aliases:
        raise ValueError(f"unknown dataset {name!r}; expected one of: {', '.join(DATASETS)}")
    return aliases[key]


def dataset_entry(name: str) -> DatasetEntry:
    """The table entry of ``name`` (any spelling :func:`canonical_name` takes)."""
    return DATASETS[canonical_name(name)]


def get_spec(name: str, channels: int | None = None) -> DatasetSpec:
    """Return the spec of ``name``; a grey dataset (MNIST) may be requested with 3 channels.

    3-channel MNIST (the paper feeds it so to LeNet and ResNet-18) repeats the single-channel
    mean/std per channel, so normalizing a repeated image equals repeating a normalized image.
    """
    entry = dataset_entry(name)
    c = entry.channels[0] if channels is None else channels
    if c not in entry.channels:
        if len(entry.channels) > 1:
            raise ValueError(f"{entry.title} supports channels={' or '.join(map(str, entry.channels))}, got {channels}")
        raise ValueError(f"{entry.name} has {entry.channels[0]} channels, got channels={channels}")
    repeat = c // len(entry.mean)  # 1, or 3 for a grey dataset fed as 3 channels
    return DatasetSpec(entry.name, c, entry.image_size, entry.num_classes, entry.mean * repeat, entry.std * repeat)


def load_dataset(
    name: str,
    root: str | Path,
    train: bool = True,
    channels: int | None = None,
    download: bool = True,
    timeout_s: float = 20,
    source: str = "builtin",
) -> Dataset:
    """Load ``name`` ('mnist', 'cifar10' or 'imagenet') yielding ``(normalized CxHxW, int label)``.

    ``source`` other than "builtin" reads the images from a Hugging Face dataset (``hf:NAME[:CONFIG]``)
    or a local image folder (``imagefolder:PATH``) and brings them to ``name``'s spec (fedsim/data/hf.py).

    Builtin: the entry's loader (``datasets``). For MNIST / CIFAR-10, in order: torchvision files under
    ``root``; if ``download``, a download after a reachability probe limited to ``timeout_s`` (and every
    socket operation of the download limited to ``timeout_s``); the offline samples. ImageNet: an image
    folder under ``root``. Raises :class:`DataUnavailableError` naming where to put the files when all
    of these fail.
    """
    if Path(root).exists() and not Path(root).is_dir():
        raise DataUnavailableError(f"data root {root} is a file, not a folder")
    entry = dataset_entry(name)
    spec = get_spec(entry.name, channels)
    root = Path(root).expanduser()
    if source not in ("", BUILTIN):
        try:
            parse_source(source)
        except ValueError as err:
            raise DataUnavailableError(str(err)) from None
        return load_hf(source, spec, train, download=download, timeout_s=min(timeout_s, 5))
    return entry.load(root, train, spec, download, timeout_s)
